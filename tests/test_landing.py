"""The decode side's layer coverage (kvxferd.datapath.landing): a chunk lands only when every
expected writer covered every layer, once; whole chunks are the range [0, L). Then the receiver
on an in-process node: layer events (merged per loop turn, only to watchers that asked), PollRoom
and watermarks on complete chunks only, MISMATCH on both sides, the Bootstrap's opt-in."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
from typing import Any

import pytest

from kvxfer_protocol.slot_layout import KVLayout, part_bytes
from kvxferd.core.engines import Engine
from kvxferd.core.node import Node
from kvxferd.core.peer_port import BootstrapAnswer, BootstrapMsg
from kvxferd.core.rooms import RecvRoom
from kvxferd.core.types import EngineSpec, FailureCode, LandedChunk, Parallelism, Role, RoomKey, RoomState
from kvxferd.datapath.landing import ChunkLanding, LayerMismatch, group_size, layer_span, runs, span_mask
from kvxferd.datapath.notif import Notif
from kvxferd.errors import InvalidArgument
from tests import test_data_path_refusals as refusals
from tests.test_data_path_refusals import Link

L = 10
node = refusals.node  # the in-process node fixture (a daemon without NIXL, peers that record what they get)


def test_a_whole_chunk_is_every_layer_and_lands_when_its_last_writer_does() -> None:
    c = ChunkLanding(3, L, frozenset({0, 1}))
    assert c.land(1, 0, 0, 0) == (0, False)  # writer 0's heads of every layer are still out
    assert c.land(0, 0, 0, 0) == (span_mask(0, L), True)
    assert c.complete and c.layer_group == L


def test_parts_land_per_group_and_the_reader_holds_a_layer_once_every_writer_brought_it() -> None:
    c = ChunkLanding(0, L, frozenset({0, 1}))
    assert c.land(0, 4, 4, 8) == (0, False)
    assert c.land(1, 4, 0, 4) == (0, False)
    assert c.land(1, 4, 4, 8) == (span_mask(4, 8), False)
    assert c.land(0, 4, 8, 10) == (0, False)  # the last group is short (10 = 4 + 4 + 2)
    assert c.land(0, 4, 0, 4) == (span_mask(0, 4), False)
    assert not c.complete
    assert c.land(1, 4, 8, 10) == (span_mask(8, 10), True)
    assert c.complete


def test_parts_in_any_order_complete_the_chunk_exactly_when_the_last_layer_lands() -> None:
    rng = random.Random(37)
    for _ in range(200):
        g = rng.randint(1, L)
        writers = frozenset(range(rng.randint(1, 4)))
        # Each writer sends its groups, some merged into one range, in a random order.
        entries = []
        for w in writers:
            bounds = sorted({0, L} | {b for b in range(g, L, g) if rng.random() < 0.5})
            entries += [(w, a, b) for a, b in itertools.pairwise(bounds)]
        rng.shuffle(entries)
        c = ChunkLanding(1, L, writers)
        held = 0
        for i, (w, a, b) in enumerate(entries):
            new, complete = c.land(w, g, a, b)
            assert new & held == 0 and complete == (i == len(entries) - 1)
            held |= new
        assert held == span_mask(0, L) and c.complete


@pytest.mark.parametrize(("g", "first", "again", "why"), [
    (0, (0, 0), (0, 0), "layers [0, 10) of chunk 5 from writer 1 landed twice"),
    (2, (2, 6), (4, 8), "layers [4, 6) of chunk 5 from writer 1 landed twice"),
    (2, (0, 10), (8, 10), "layers [8, 10) of chunk 5 from writer 1 landed twice"),
    (10, (0, 0), (0, 10), "layers [0, 10) of chunk 5 from writer 1 landed twice"),  # kvx3 then kvx4 [0, L)
])
def test_a_writers_layers_landing_twice_is_a_mismatch_that_changes_nothing(
        g: int, first: tuple[int, int], again: tuple[int, int], why: str) -> None:
    c = ChunkLanding(5, L, frozenset({1, 2}))
    c.land(1, g, *first)
    before = dict(c.masks), c.held
    with pytest.raises(LayerMismatch) as err:
        c.land(1, g, *again)
    assert str(err.value) == why
    assert (c.masks, c.held) == before
    # The other writer's layers are its own: the same range from it counts.
    assert c.land(2, g, *again)[0] == span_mask(*layer_span(g, *again, L)) & c.masks[1]


@pytest.mark.parametrize(("g", "start", "end", "why"), [
    (4, 2, 6, "do not fall on groups of 4 layers"),
    (4, 4, 6, "do not fall on groups of 4 layers"),
    (4, 8, 11, "are not a part of a 10-layer chunk"),
    (4, 4, 4, "are not a part"),
    (4, 10, 10, "are not a part"),  # a seal carries no bytes: never a notification
    (4, 6, 2, "are not a part"),
])
def test_a_range_that_is_no_part_is_refused(g: int, start: int, end: int, why: str) -> None:
    c = ChunkLanding(0, L, frozenset({0}))
    with pytest.raises(LayerMismatch, match=why):
        c.land(0, g, start, end)
    assert not c.masks and c.layer_group == 0


def test_writers_of_one_chunk_must_cut_it_in_the_same_groups() -> None:
    c = ChunkLanding(7, L, frozenset({0, 1}))
    c.land(0, 4, 0, 4)
    with pytest.raises(LayerMismatch, match="writers of chunk 7 disagree on its layer group \\(2 vs 4 layers\\)"):
        c.land(1, 2, 0, 2)
    with pytest.raises(LayerMismatch, match="disagree"):
        c.land(1, 0, 0, 0)  # a whole chunk is one group of L
    assert c.land(1, 4, 0, 8)[0] == span_mask(0, 4)


def test_group_size_and_span_helpers() -> None:
    assert [group_size(g, L) for g in (0, 1, 9, 10, 11)] == [L, 1, 9, L, L]
    assert layer_span(0, 0, 0, L) == (0, L) and layer_span(3, 9, 10, L) == (9, 10)
    assert runs(0) == [] and runs(span_mask(0, L)) == [(0, L)]
    assert runs(0b1011_0110) == [(1, 3), (4, 6), (7, 8)]
    rng = random.Random(1)
    for _ in range(500):
        m = rng.getrandbits(80)
        assert sum(span_mask(a, b) for a, b in runs(m)) == m


# ---------------------------------------------------------------- the receiver and its events, in-process

LAYERS = KVLayout(8, 4, 16, 2, 16)


def decode_engine(n: Node, layer_parts: bool = True) -> Engine:
    return n.register_engine(EngineSpec(Role.DECODE, "d", LAYERS, Parallelism(1, 0), 1 << 20, None, 0, "d",
                                        layer_parts=layer_parts), None)


async def bootstrapped(n: Node, eng: Engine, peer: Link, rid: int, prefill_tp: int, tokens: int = 16) -> RecvRoom:
    async def connect(addr: str) -> Link:
        return peer

    n.recv.connect = connect
    n.expect_room(eng.id, RoomKey(rid), "1.2.3.4:5", "p", tokens, 0)
    await asyncio.sleep(0.01)
    n.on_bootstrap_reply(peer, BootstrapAnswer(RoomKey(rid), 0, 0, "", prefill_tp, LAYERS, False))
    await asyncio.sleep(0.01)
    room = n.recv.rooms[rid]
    assert room.plan is not None and room.state is RoomState.WAITING_FOR_INPUT
    return room


def landed_parts(n: Node) -> float | None:
    return n.metrics.registry.get_sample_value("kvxferd_layer_parts_total", {"role": "decode", "event": "landed"})


def drain(q: asyncio.Queue[Any]) -> list[tuple[int, int, int, bool, int]]:
    """(chunk, layer_start, layer_end, chunk_complete, layer_group) of each landed event; states as -1."""
    out = []
    while q.qsize():
        ev = q.get_nowait()
        c = ev.landed
        out.append((-1, 0, 0, False, int(ev.state)) if c is None else
                   (c.chunk_id, c.layer_start, c.layer_end, c.chunk_complete, c.layer_group))
    return out


async def test_layer_parts_of_two_writers_land_per_range_and_the_chunk_once_both_covered_every_layer(
        node: Node) -> None:
    dec = decode_engine(node)
    peer = Link("pre")
    room = await bootstrapped(node, dec, peer, 5, prefill_tp=2)  # 4 heads: writers 0, 1 each bring 2
    (boot_msg,), _ = peer.of("bootstrap")[0]
    assert boot_msg.layer_parts is True  # the engine opted in: its Bootstrap says so
    layered, plain = node.watch(dec.id, layer_progress=True), node.watch(dec.id)
    (gid,) = node.ledger.grants
    key = RoomKey(5)

    def part(writer: int, start: int, end: int, chunk: int = 0, tokens: tuple[int, int] = (0, 16)) -> None:
        tb = part_bytes(LAYERS, 1, 0, 1)
        node.recv.landed(Notif(key, chunk, writer, 0, tokens[0], tokens[1], tokens[0] + tokens[1] == 16, gid,
                               tokens[0] * tb, room.notif_token, 2, start, end))

    # Chunk 0 (tokens [0, 8)) in groups of 2 layers; writer 1 first, out of order.
    part(1, 2, 6, tokens=(0, 8))
    part(0, 0, 4, tokens=(0, 8))  # layers [2, 4) now held from both, [0, 2) still lacks writer 1
    part(0, 4, 6, tokens=(0, 8))  # [4, 6) too: merged with [2, 4) in this loop turn
    assert drain(layered) == [] and drain(plain) == []  # sent at the turn's end, not per part
    await asyncio.sleep(0)
    assert drain(layered) == [(0, 2, 6, False, 2)]
    assert drain(plain) == [] and node.poll_room(dec.id, key).landed == ()  # PollRoom: complete chunks only
    with pytest.raises(InvalidArgument, match="has not landed"):
        node.watermark(dec.id, key, [0])
    part(1, 0, 2, tokens=(0, 8))
    part(0, 6, 8, tokens=(0, 8))
    part(1, 6, 8, tokens=(0, 8))  # completes chunk 0: at once, with the layers still unsent
    assert drain(layered) == [(0, 0, 2, False, 2), (0, 6, 8, True, 2)]
    assert drain(plain) == [(0, 0, 0, True, 2)]
    (view,) = node.poll_room(dec.id, key).landed
    assert (view.chunk_id, view.chunk_complete, view.layer_group, view.num_tokens) == (0, True, 2, 8)
    node.watermark(dec.id, key, [0])
    # Chunk 1 (tokens [8, 16)): whole groups merged into single ranges; the room ends with it.
    part(0, 0, 8, chunk=1, tokens=(8, 8))
    part(1, 0, 8, chunk=1, tokens=(8, 8))
    node.recv.complete(peer, key, 0, 2, b"")
    assert room.state is RoomState.SUCCESS
    assert drain(layered) == [(1, 0, 8, True, 2), (-1, 0, 0, False, int(RoomState.SUCCESS))]
    assert drain(plain) == [(1, 0, 0, True, 2), (-1, 0, 0, False, int(RoomState.SUCCESS))]
    assert landed_parts(node) == 8


async def test_a_whole_chunk_lands_as_before_for_every_watcher(node: Node) -> None:
    dec = decode_engine(node)
    peer = Link("pre")
    room = await bootstrapped(node, dec, peer, 6, prefill_tp=1)
    layered, plain = node.watch(dec.id, layer_progress=True), node.watch(dec.id)
    (gid,) = node.ledger.grants
    node.recv.landed(Notif(RoomKey(6), 0, 0, 0, 0, 16, True, gid, 0, room.notif_token))  # a kvx3 entry
    assert drain(layered) == [(0, 0, 8, True, 0)]
    ev = plain.get_nowait()
    assert ev.landed == LandedChunk(0, ev.landed.slot, 0, 16, True, part_bytes(LAYERS, 1, 0, 16))
    assert landed_parts(node) == 0  # a whole chunk is no layer part


@pytest.mark.parametrize(("entries", "why"), [
    ([(0, 2, 0, 4), (0, 2, 2, 6)], "layers [2, 4) of chunk 0 from writer 0 landed twice"),
    ([(0, 0, 0, 0), (0, 0, 0, 0)], "layers [0, 8) of chunk 0 from writer 0 landed twice"),
    ([(0, 2, 0, 2), (1, 4, 0, 4)], "writers of chunk 0 disagree on its layer group (4 vs 2 layers)"),
    ([(0, 2, 0, 2), (1, 0, 0, 0)], "writers of chunk 0 disagree on its layer group (8 vs 2 layers)"),
    ([(0, 4, 2, 6)], "layers [2, 6) do not fall on groups of 4 layers"),
    ([(0, 4, 4, 12)], "layers [4, 12) are not a part of a 8-layer chunk"),
])
async def test_layers_landing_twice_or_off_the_grid_fail_the_room_on_both_sides(
        node: Node, entries: list[tuple[int, int, int, int]], why: str) -> None:
    dec = decode_engine(node)
    peer = Link("pre")
    room = await bootstrapped(node, dec, peer, 7, prefill_tp=2)
    watch = node.watch(dec.id, layer_progress=True)
    (gid,) = node.ledger.grants
    for writer, group, start, end in entries:
        node.recv.landed(Notif(RoomKey(7), 0, writer, 0, 0, 16, True, gid, 0, room.notif_token, group, start, end))
    assert room.state is RoomState.FAILED and room.failure_code is FailureCode.MISMATCH
    assert room.failure_reason == why
    twice = node.metrics.registry.get_sample_value("kvxferd_layer_parts_total", {"role": "decode", "event": "duplicate"})
    assert twice == (1 if "twice" in why else 0)
    (abort,) = peer.of("abort")
    assert abort[0][0] == RoomKey(7) and abort[0][2] == why
    # No layer event of a failed room follows its end; the range went back to the prefill side.
    await asyncio.sleep(0)
    assert drain(watch)[-1] == (-1, 0, 0, False, int(RoomState.FAILED))
    assert node.slots_held() == 0 and peer.of("release")


async def test_the_bootstrap_carries_the_readers_opt_in_and_the_prefill_room_names_who_did_not(node: Node) -> None:
    dec = decode_engine(node, layer_parts=False)
    peer = Link("pre")
    await bootstrapped(node, dec, peer, 8, prefill_tp=1)
    (boot_msg,), _ = peer.of("bootstrap")[0]
    assert boot_msg.layer_parts is False
    # The prefill side: a room's readers and what their Bootstraps said.
    node.register_engine(EngineSpec(Role.PREFILL, "p", LAYERS, Parallelism(1, 0), 1 << 20, None, 0, "p"), None)
    dec_peer = Link("dec")
    msg = BootstrapMsg(RoomKey(9), "p", 0, 2, LAYERS, 16, 0, "ring", notif_token=bytes(16), layer_parts=True)
    assert node.on_bootstrap(dec_peer, msg).code == 0
    sroom = node.send.rooms[9]
    assert sroom.layer_parts_refusal() == ""  # reader 1 has not bootstrapped: nothing known against it
    assert node.on_bootstrap(dec_peer, dataclasses.replace(msg, reader=1, layer_parts=False)).code == 0
    assert sroom.layer_parts_refusal() == (
        "decode rank 1 of room 9.0 takes no layer parts (engine or daemon older than protocol 1.1)")
    # A reader's Bootstrap again (a retry), now with the opt-in: it counts.
    assert node.on_bootstrap(dec_peer, dataclasses.replace(msg, reader=1)).code == 0
    assert node.send.rooms[9] is sroom and sroom.layer_parts_refusal() == "" and sroom.layer_readers == {0, 1}
