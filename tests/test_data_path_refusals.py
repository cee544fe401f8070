"""Refusals and dead engines on the data path, on in-process nodes with recording peer links:
a refused Bootstrap leaves no room behind (and supersedes nothing); a decode engine that dies
with a SUCCESS room it never fully watermarked gives back its slots, its room and its ring;
a chunk part larger than the reader's whole ring fails its room at once instead of blocking
the ring's other rooms until the deadline; a decode room answers only the engine that expects it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvxfer_protocol.slot_layout import KVLayout, part_bytes
from kvxferd.buffers.host_pool import HostPool
from kvxferd.config import Config
from kvxferd.core.engines import Engine
from kvxferd.core.node import Node
from kvxferd.core.peer_port import BootstrapAnswer, BootstrapMsg, CreditSpec, Identity
from kvxferd.core.types import EngineSpec, FailureCode, Parallelism, Role, RoomKey, RoomState
from kvxferd.datapath.credits import CreditWindow
from kvxferd.datapath.notif import Notif
from kvxferd.errors import NotFound
from kvxferd.ops.metrics import Metrics

LAY = KVLayout(2, 4, 16, 2, 16)  # 4 KV heads: decode TP 3 cannot split them


class Link:
    """A peer daemon that records what is sent to it."""

    is_self = False
    up = True

    def __init__(self, name: str) -> None:
        self.daemon_id = self.agent_name = name
        self.instance_id = name + "-i"
        self.address = name + ":1"
        self.sent: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("send_"):
            return lambda *a, **k: self.sent.append((name, a, k))
        raise AttributeError(name)

    def of(self, kind: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        return [(a, k) for n, a, k in self.sent if n == "send_" + kind]


class Workers:
    in_flight = 0

    def submit(self, job: Any) -> None:
        pass

    async def run_blocking(self, fn: Any, *a: Any) -> Any:
        return fn(*a)


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    pool = HostPool("", 32 << 20, "refusal0", backing="private")
    n = Node(Config(), pool, Metrics(CollectorRegistry()), Identity("me", "me-i"))
    windows: dict[int, CreditWindow] = {}
    n.attach(Workers(), lambda link: windows.setdefault(id(link), CreditWindow(link, n.metrics)),  # type: ignore[arg-type]
             None, list)  # type: ignore[arg-type]
    try:
        yield n
    finally:
        pool.close()


def engine(n: Node, role: Role, group: str, ring: int = 1 << 20, tp: int = 1, rank: int = 0) -> Engine:
    return n.register_engine(EngineSpec(role, group, LAY, Parallelism(tp, rank), ring, None, 0, group), None)


def boot(key: RoomKey, decode_tp: int = 1, reader: int = 0, num_tokens: int = 16, layout: KVLayout = LAY) -> BootstrapMsg:
    return BootstrapMsg(key, "p", reader, decode_tp, layout, num_tokens, 0, "ring", notif_token=bytes(16))


async def test_a_refused_bootstrap_leaves_no_room_and_supersedes_nothing(node: Node) -> None:
    pre = engine(node, Role.PREFILL, "p")
    peer, other = Link("dec"), Link("dec2")
    peer_rooms = node.engines.limits.peer_rooms
    # A Bootstrap without the room's notification token (an older decode daemon) is refused, no room.
    ans = node.on_bootstrap(peer, dataclasses.replace(boot(RoomKey(1)), notif_token=b""))
    assert ans.code != 0 and "notif_token" in ans.message, ans
    assert not node.send.rooms
    # New rooms: refused for a reader the heads cannot be split for, or another model's layout.
    for rid in range(1, 6):
        ans = node.on_bootstrap(peer, boot(RoomKey(rid), decode_tp=3))
        assert ans.code != 0 and "kv heads" in ans.message.lower(), ans
    ans = node.on_bootstrap(peer, boot(RoomKey(6), layout=KVLayout(3, 4, 16, 2, 16)))
    assert ans.code != 0 and "layout mismatch" in ans.message
    assert not node.send.rooms and not peer_rooms.get(peer.address)
    # The decode side failed its half on the refusal: the prefill engine learns it at once
    # (a tombstone, bounded like the decode side's aborts), it does not open a room nobody bootstraps.
    view = node.poll_room(pre.id, RoomKey(1))
    assert view.state is RoomState.FAILED and view.failure_code is FailureCode.MISMATCH and "refused" in view.failure_reason

    # A room in use: a refused newer generation neither supersedes nor fails it.
    assert node.on_bootstrap(peer, boot(RoomKey(7))).code == 0
    room = node.send.rooms[7]
    assert room.state is RoomState.WAITING_FOR_INPUT and peer_rooms[peer.address] == 1
    assert node.on_bootstrap(peer, boot(RoomKey(7, 1), decode_tp=3)).code != 0
    assert node.send.rooms[7] is room and room.state is RoomState.WAITING_FOR_INPUT and room.key == RoomKey(7)
    # Another decode daemon naming it is refused and changes nothing either.
    assert node.on_bootstrap(other, boot(RoomKey(7), num_tokens=32)).code != 0
    assert room.state is RoomState.WAITING_FOR_INPUT and not peer_rooms.get(other.address)
    # Its own decode daemon disagreeing on the room's size: that daemon fails its half on the
    # refusal, so ours fails with it at once rather than at its deadline.
    assert node.on_bootstrap(peer, boot(RoomKey(7), num_tokens=32)).code != 0
    assert room.state is RoomState.FAILED and room.failure_code is FailureCode.MISMATCH
    assert len(node.send.rooms) == 1 and peer_rooms[peer.address] == 1


async def expect_bootstrapped(node: Node, eng: Engine, peer: Link, rid: int, tokens: int = 16) -> None:
    async def connect(addr: str) -> Link:
        return peer

    node.recv.connect = connect  # type: ignore[assignment]
    node.expect_room(eng.id, RoomKey(rid), "1.2.3.4:5", "p", tokens, 0)
    await asyncio.sleep(0.01)
    node.on_bootstrap_reply(peer, BootstrapAnswer(RoomKey(rid), eng.rank, 0, "", 1, LAY, False))
    await asyncio.sleep(0.01)


@pytest.mark.parametrize("how", ["lease", "unregister", "re-register"])
async def test_a_dead_decode_engine_gives_back_a_success_room_it_never_consumed(node: Node, how: str) -> None:
    dec = engine(node, Role.DECODE, "d")
    peer = Link("pre")
    await expect_bootstrapped(node, dec, peer, 7)
    room = node.recv.rooms[7]
    (gid,) = node.ledger.grants
    node.recv.landed(Notif(RoomKey(7), 0, 0, 0, 0, 16, True, gid, 0))
    node.recv.complete(peer, RoomKey(7), 0, 1, b"")
    assert room.state is RoomState.SUCCESS and node.slots_held() == 1
    if how == "lease":
        dec.lease_deadline = 0.0
        node.expire_leases()
    elif how == "unregister":
        node.unregister_engine(dec.id)
    else:
        engine(node, Role.DECODE, "d")
    assert 7 not in node.recv.rooms and not node.engines.limits.peer_rooms
    assert room.state is RoomState.SUCCESS  # it succeeded: nothing to fail, only to give back
    assert peer.of("release") and peer.of("revoke")
    # The prefill daemon returns the revoked credit: the ring is free to close.
    node.ledger.returned(peer, [gid])  # type: ignore[arg-type]
    assert not node.ledger.grants and node.slots_held() == 0 and dec not in node.engines._closing


async def test_a_success_room_of_two_readers_waits_for_the_live_one(node: Node) -> None:
    d0 = engine(node, Role.DECODE, "d", tp=2, rank=0)
    d1 = engine(node, Role.DECODE, "d", tp=2, rank=1)
    peer = Link("pre")
    await expect_bootstrapped(node, d0, peer, 9)
    await expect_bootstrapped(node, d1, peer, 9)
    room = node.recv.rooms[9]
    grants = {g.engine.rank: gid for gid, g in node.ledger.grants.items()}
    for reader in (0, 1):
        node.recv.landed(Notif(RoomKey(9), 0, 0, reader, 0, 16, True, grants[reader], 0))
        node.recv.complete(peer, RoomKey(9), reader, 1, b"")
    assert room.state is RoomState.SUCCESS and node.slots_held() == 2
    node.unregister_engine(d1.id)
    # Rank 1's slot is back (and the prefill side told so, and asked for the revoked credit);
    # rank 0 still reads its own.
    node.ledger.returned(peer, [grants[1]])  # type: ignore[arg-type]
    assert node.recv.rooms[9] is room and node.slots_held() == 1 and d1 not in node.engines._closing
    assert peer.of("release")[0][1]["ranges"] == [(grants[1], 0)]
    assert node.poll_room(d0.id, RoomKey(9)).landed
    await node.release_room(d0.id, RoomKey(9))
    assert 9 not in node.recv.rooms and node.slots_held() == 0


async def test_only_the_engine_that_expects_a_decode_room_may_poll_abort_or_release_it(node: Node) -> None:
    a, b = engine(node, Role.DECODE, "dA"), engine(node, Role.DECODE, "dB")  # both rank 0
    await expect_bootstrapped(node, a, Link("pre"), 100)
    for call in (node.poll_room, node.release_room, lambda e, k: node.abort_room(e, k, "")):
        with pytest.raises(NotFound, match="not expected by this engine"):
            got = call(b.id, RoomKey(100))
            if inspect.isawaitable(got):
                await got
    room = node.recv.rooms[100]
    assert room.state is RoomState.WAITING_FOR_INPUT and not room.readers[0].released
    assert node.poll_room(a.id, RoomKey(100)).state is RoomState.WAITING_FOR_INPUT


async def test_a_part_larger_than_the_readers_whole_ring_fails_its_room_at_once(node: Node) -> None:
    one_token = part_bytes(LAY, 1, 0, 1)
    dec = engine(node, Role.DECODE, "d", ring=16 * one_token)
    peer = Link("pre")
    await expect_bootstrapped(node, dec, peer, 1, tokens=64)
    await expect_bootstrapped(node, dec, peer, 2, tokens=16)
    node.on_credit_request(peer, dec.id, 32 * one_token)  # type: ignore[arg-type]
    # Room 1 has 64 tokens still to come and may hold such a chunk: it fails, on both sides at once.
    r1, r2 = node.recv.rooms[1], node.recv.rooms[2]
    assert r1.state is RoomState.FAILED and r1.failure_code is FailureCode.MISMATCH
    assert "can never fit" in r1.failure_reason
    assert [a[0] for a, _ in peer.of("abort")] == [RoomKey(1)]
    # Room 2 (16 tokens) cannot: it goes on.
    assert r2.state is RoomState.WAITING_FOR_INPUT
    # A request that fits the ring is served as before (here: queued until space frees).
    node.on_credit_request(peer, dec.id, 16 * one_token)  # type: ignore[arg-type]
    assert r2.state is RoomState.WAITING_FOR_INPUT and node.ledger._waiting


def test_a_chunk_that_never_gets_space_does_not_keep_its_ring_asked_for() -> None:
    link = Link("dec")
    w = CreditWindow(link, Metrics(CollectorRegistry()))  # type: ignore[arg-type]
    w.add([CreditSpec(1, "R", 0x1000, 1 << 16, "DRAM", 0)])
    got: list[tuple[str, bool]] = []
    assert w.take("R", 1 << 20, RoomKey(1), lambda r: got.append(("big", r is not None))) is None
    # FIFO: a chunk that fits waits behind it.
    assert w.take("R", 4096, RoomKey(2), lambda r: got.append(("small", r is not None))) is None
    assert [a for a, _ in link.of("credit_request")] == [("R", 1 << 20)]
    # The decode side failed the big chunk's room: its chunk stops waiting, the next is served,
    # and the ring's next shortage is asked for again (the refused request is not still "out").
    w.cancel_room(RoomKey(1))
    assert got == [("big", False), ("small", True)]
    assert w.take("R", 62 << 10, RoomKey(3), lambda r: got.append(("next", r is not None))) is None
    assert [a for a, _ in link.of("credit_request")] == [("R", 1 << 20), ("R", 62 << 10)]


async def test_a_restarted_decode_daemons_grants_are_not_taken_for_its_predecessors(node: Node) -> None:
    """A prefill daemon may still hold credits of a decode daemon's previous process (revoked,
    a WRITE in flight) when the new process grants it space. Grant ids restarted at 1, so the
    new grant carried an id the window held already, and the window skipped it: that space sat
    granted and unused until it was reclaimed."""
    pool2 = HostPool("", 32 << 20, "refusal1", backing="private")
    try:
        restarted = Node(Config(), pool2, Metrics(CollectorRegistry()), Identity("me", "me-i2"))
        prefill = Link("pre")
        window = CreditWindow(prefill, Metrics(CollectorRegistry()))  # type: ignore[arg-type]
        for n in (node, restarted):
            dec = engine(n, Role.DECODE, "d")
            n.ledger.ensure(prefill, dec, 64 << 10)  # type: ignore[arg-type]
            ((specs,), _) = prefill.of("grant")[-1]
            window.add(specs)
            if n is node:
                # The old process's credit is revoked while a WRITE into it is still in flight.
                (held,) = window.held.values()
                held.in_flight = 1
                window.lost()
        old_id, new_id = (a[0][0].id for a, _ in prefill.of("grant"))
        assert old_id != new_id
        assert set(window.held) == {old_id, new_id}
        assert window.held[new_id].revoked is False  # the new grant is usable
    finally:
        pool2.close()


@pytest.mark.parametrize(("spans", "why"), [([(0, 8), (16, 8)], "[8, 16) were never sent"),
                                            ([(0, 16), (8, 8), (16, 8)], "[8, 16) were sent twice"),
                                            ([(0, 8), (8, 8)], "[16, 24) were never sent")])
async def test_a_decode_room_whose_chunks_do_not_cover_its_tokens_is_no_success(
        node: Node, spans: list[tuple[int, int]], why: str) -> None:
    # Whatever the prefill daemon reports (an older one did not check its writers' chunks).
    dec = engine(node, Role.DECODE, "d")
    peer = Link("pre")
    await expect_bootstrapped(node, dec, peer, 11, tokens=24)
    room = node.recv.rooms[11]
    (gid,) = node.ledger.grants
    tb = part_bytes(LAY, 1, 0, 1)
    for cid, (start, n) in enumerate(spans):
        node.recv.landed(Notif(RoomKey(11), cid, 0, 0, start, n, cid == len(spans) - 1, gid, start * tb))
    node.recv.complete(peer, RoomKey(11), 0, len(spans), b"")
    assert room.state is RoomState.FAILED and room.failure_code is FailureCode.MISMATCH, room.state
    assert why in room.failure_reason, room.failure_reason
    (abort,) = peer.of("abort")
    assert abort[0][0] == RoomKey(11)
