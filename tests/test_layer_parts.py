"""Layer parts end to end (issue #37, docs/design/layerwise.md §5 first row): two daemons as
separate processes, prefill ranks that send each chunk as layer parts of a group-major slot (out
of order, several groups merged into one part, many rooms in one call), a seal with the aux,
decode ranks that opted in and watch layer events; every byte of every reader's slot checked,
for TP 1->1, 4->2, 2->4, GQA 1->4 and 4->1, MLA; and the refusals and failures of §2.

One daemon pair serves the module; each case registers its own engine groups."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvxfer_client import (
    AsyncPrefillSender,
    DecodeReceiver,
    KvxferError,
    Layout,
    PrefillSender,
    RoomEvent,
    RoomFailed,
    RoomState,
)
from kvxfer_client._parts import layer_part, seal_part
from kvxfer_protocol.slot_layout import rank_heads
from tests.conftest import DaemonProc, spawn_daemon, stop_all
from tests.readiness import Budget
from tests.test_e2e import status
from tests.test_zero_copy import PS, pool_view

L, G = 7, 3  # groups [0, 3), [3, 6), [6, 7): the last one short
GROUPS = [(0, 3), (3, 6), (6, 7)]
# Orders the parts of a chunk go in: out of order, and two groups merged into one part.
ORDERS = ([(3, 6), (0, 3), (6, 7)], [(0, 6), (6, 7)], [(6, 7), (0, 3), (3, 6)])


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[DaemonProc, DaemonProc]]:
    with tempfile.TemporaryDirectory(prefix="kvl") as tmp:
        pre = spawn_daemon(Path(tmp), "lp-pre")
        dec = spawn_daemon(Path(tmp), "lp-dec")
        try:
            yield pre, dec
        finally:
            stop_all(pre, dec)


def layout_of(heads: int, mla: bool = False) -> Layout:
    return Layout(num_layers=L, total_kv_heads=heads, head_dim=16, dtype_bytes=2, page_size=16, mla=mla,
                  dtype="bfloat16")


def group_major(kv: np.ndarray) -> bytes:
    """[heads, layers, planes, tokens, row bytes] as the slot holds it: [groups, heads, g, ...]."""
    return b"".join(kv[:, lo:hi].tobytes() for lo, hi in GROUPS)


@dataclass
class Watcher:
    """A decode rank's layer events, read on a thread until cancelled."""

    rx: DecodeReceiver

    def __post_init__(self) -> None:
        self.events: list[RoomEvent] = []
        self.stream = self.rx.watch(layer_progress=True)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for ev in self.stream:
                self.events.append(ev)
        except KvxferError:
            pass  # the stream is cancelled when the engine closes

    def ranges(self, room: int, chunk: int) -> list[tuple[int, int, int, bool]]:
        return [(e.landed.layer_start, e.landed.layer_end, e.landed.layer_group, e.landed.chunk_complete)
                for e in list(self.events) if e.room == room and e.landed is not None and e.landed.chunk_id == chunk]


def engines(pre: DaemonProc, dec: DaemonProc, name: str, layout: Layout, ptp: int, dtp: int,
            layer_parts: bool = True) -> tuple[list[PrefillSender], list[DecodeReceiver]]:
    txs = [PrefillSender(socket=pre.socket, group=f"{name}-p", layout=layout, tp_size=ptp, tp_rank=r,
                         ring_bytes=2 << 20) for r in range(ptp)]
    rxs = [DecodeReceiver(socket=dec.socket, group=f"{name}-d", layout=layout, tp_size=dtp, tp_rank=r,
                          ring_bytes=2 << 20, layer_parts=layer_parts) for r in range(dtp)]
    return txs, rxs


def kv_for(rng: np.random.Generator, layout: Layout, tokens: int) -> np.ndarray:
    planes = 1 if layout.mla else 2
    return rng.integers(0, 256, (layout.total_kv_heads, L, planes, tokens, layout.head_dim * 2), dtype=np.uint8)


def heads(layout: Layout, tp: int, rank: int) -> slice:
    h = rank_heads(layout.total_kv_heads, tp, rank, layout.mla)
    return slice(h.start, h.start + h.count)


CASES = [("tp11", 2, False, 1, 1), ("tp42", 4, False, 4, 2), ("tp24", 4, False, 2, 4),
         ("gqa14", 2, False, 1, 4), ("gqa41", 2, False, 4, 1), ("mla12", 1, True, 1, 2)]


@pytest.mark.parametrize(("name", "kv_heads", "mla", "ptp", "dtp"), CASES, ids=[c[0] for c in CASES])
def test_layer_parts_land_every_byte(pair: tuple[DaemonProc, DaemonProc], name: str, kv_heads: int, mla: bool,
                                     ptp: int, dtp: int) -> None:
    pre, dec = pair
    layout = layout_of(kv_heads, mla)
    rng = np.random.default_rng(len(name) * 100 + ptp * 10 + dtp)
    first = 100 * (1 + [c[0] for c in CASES].index(name))  # room ids are the daemons', not a group's
    rooms = {first + i: [int(t) for t in rng.integers(5, 40, 2)] for i in range(3)}  # room -> chunk token counts
    kv = {(room, c): kv_for(rng, layout, t) for room, counts in rooms.items() for c, t in enumerate(counts)}
    txs, rxs = engines(pre, dec, name, layout, ptp, dtp)
    watchers = [Watcher(rx) for rx in rxs]
    try:
        for rx in rxs:
            for room, counts in rooms.items():
                rx.expect(room, pre.peer_address, f"{name}-p", sum(counts))
        for r, tx in enumerate(txs):
            mine = heads(layout, ptp, r)
            for c in range(2):
                slots = {}
                for room, counts in rooms.items():
                    slots[room] = tx.acquire(counts[c])
                    tx.slot_view(slots[room])[:] = group_major(kv[(room, c)][mine])
                # The k-th part of every room's chunk in one call; rank 0 does not wait for verdicts.
                for step in range(3):
                    parts = []
                    for i, (room, counts) in enumerate(rooms.items()):
                        order = ORDERS[(i + c + r) % len(ORDERS)]
                        if step < len(order):
                            lo, hi = order[step]
                            parts.append(layer_part(room, c, sum(counts[:c]), counts[c], slots[room], G, lo, hi))
                    assert tx.enqueue_layers(parts, wait=r != 0) == [None] * len(parts)
            assert tx.flush() == []
            # The seals, with the first token (aux), once every chunk's parts are in.
            seals = [seal_part(layout, room, 1, counts[0], counts[1], G, aux=f"tok{room}".encode())
                     for room, counts in rooms.items()]
            assert tx.enqueue_layers(seals) == [None] * len(seals)
        checked = 0
        for d, rx in enumerate(rxs):
            mine = heads(layout, dtp, d)
            for room in rooms:
                got, st = rx.receive(room, timeout=Budget(f"room {room} at decode rank {d}", 30).limit())
                assert st.state is RoomState.SUCCESS and st.aux == f"tok{room}".encode()
                for c in range(2):
                    assert got[c] == group_major(kv[(room, c)][mine]), f"{name} room {room} chunk {c} rank {d}"
                    checked += len(got[c])
        assert checked > 0
        for tx in txs:
            for room in rooms:
                assert tx.wait(room, timeout=30).state is RoomState.SUCCESS
        # Layer events: per chunk, ranges of groups that tile [0, L), one of them completing it.
        b = Budget("layer events of every chunk", 10)
        for w in watchers:
            for room in rooms:
                for c in range(2):
                    while not any(done for *_, done in w.ranges(room, c)) and not b.expired():
                        time.sleep(0.01)
                    got_ranges = w.ranges(room, c)
                    covered = sorted((lo, hi) for lo, hi, _, _ in got_ranges if hi)
                    assert [x for lo, hi in covered for x in range(lo, hi)] == list(range(L)), got_ranges
                    assert all(lo % G == 0 and g == G for lo, _, g, _ in got_ranges), got_ranges
                    assert sum(done for *_, done in got_ranges) == 1, got_ranges
    finally:
        for w in watchers:
            w.stream.cancel()
        for e in [*txs, *rxs]:
            e.close()
    for daemon in (pre, dec):
        assert status(daemon.socket).slots_held == 0


def test_aio_parts_and_seal(pair: tuple[DaemonProc, DaemonProc]) -> None:
    pre, dec = pair
    layout = layout_of(2)
    rng = np.random.default_rng(7)
    kv = kv_for(rng, layout, 24)
    rx = DecodeReceiver(socket=dec.socket, group="aio-d", layout=layout, ring_bytes=2 << 20, layer_parts=True)

    async def send() -> None:
        tx = await AsyncPrefillSender.create(socket=pre.socket, group="aio-p", layout=layout, ring_bytes=2 << 20)
        try:
            slot = await tx.acquire(24)
            tx.slot_view(slot)[:] = group_major(kv)
            assert await tx.enqueue_layers([layer_part(7, 0, 0, 24, slot, G, 3, 7)], wait=False) == [None]
            assert await tx.enqueue_layers([layer_part(7, 0, 0, 24, slot, G, 0, 3)]) == [None]
            assert await tx.flush() == []
            await tx.seal(7, 0, 0, 24, G, aux=b"first")
            assert (await tx.wait(7, timeout=30)).state is RoomState.SUCCESS
        finally:
            await tx.close()

    try:
        rx.expect(7, pre.peer_address, "aio-p", 24)
        asyncio.run(send())
        got, st = rx.receive(7, timeout=30)
        assert st.aux == b"first" and got == {0: group_major(kv)}
    finally:
        rx.close()


def test_zero_copy_parts_write_only_their_layers(pair: tuple[DaemonProc, DaemonProc]) -> None:
    """Zero-copy pools are layer-major already: a part narrows the pages' plane range."""
    pre, dec = pair
    layout = Layout(num_layers=L, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=PS)
    slots = 16 * PS
    ring = L * 2 * slots * 2 * layout.head_dim * 2
    tx = PrefillSender(socket=pre.socket, group="zc-p", layout=layout, zero_copy=True, ring_bytes=ring)
    rx = DecodeReceiver(socket=dec.socket, group="zc-d", layout=layout, zero_copy=True, ring_bytes=ring,
                        layer_parts=True)
    try:
        src, dst = pool_view(tx, layout, 2), pool_view(rx, layout, 2)
        src[:] = np.random.default_rng(3).integers(0, 256, src.shape, dtype=np.uint8)
        dst[:] = 0xAB
        tokens, split = 40, 20  # chunk 1 starts mid-page
        ppages, dpages = [5, 1, 9], [2, 12, 6]
        rx.expect(9, pre.peer_address, "zc-p", tokens, pages=dpages)
        spans = [(0, 0, split), (1, split, tokens - split)]
        parts = [layer_part(9, c, t0, n, None, G, lo, hi, pages=layout.chunk_pages(ppages, t0, n)[0])
                 for c, t0, n in spans for lo, hi in ([(3, 7), (0, 3)] if c else [(0, 3), (3, 6), (6, 7)])]
        assert tx.enqueue_layers(parts[:2]) == [None, None]
        # Chunk 0 misses layers [6, 7): until they come, it has not landed, and they are not written.
        assert tx.enqueue_layers(parts[3:]) == [None, None]
        b = Budget("chunk 1 of room 9 landed", 20)
        while not any(c.chunk_id == 1 for c in rx.poll(9).landed) and not b.expired():
            time.sleep(0.01)
        assert [c.chunk_id for c in rx.poll(9).landed] == [1], b.failure()
        first = [dpages[t // PS] * PS + t % PS for t in range(split)]
        assert (dst[6][:, first] == 0xAB).all() and not (dst[5][:, first] == 0xAB).all()
        assert tx.enqueue_layers([parts[2]]) == [None]
        tx.seal(9, 1, split, tokens - split, G, aux=b"zc")
        st = rx.wait(9, timeout=Budget("zero-copy room 9", 30).limit())
        assert st.aux == b"zc" and sorted(c.chunk_id for c in st.landed) == [0, 1]
        for t in range(tokens):
            pi, off = divmod(t, PS)
            assert np.array_equal(dst[:, :, dpages[pi] * PS + off], src[:, :, ppages[pi] * PS + off]), t
        assert (np.delete(dst.reshape(L, 2, slots // PS, -1), dpages, axis=2) == 0xAB).all()
        rx.watermark(9, [0, 1])
        assert tx.wait(9, timeout=30).state is RoomState.SUCCESS
    finally:
        tx.close()
        rx.close()


def test_refusals_and_failures(pair: tuple[DaemonProc, DaemonProc]) -> None:
    pre, dec = pair
    layout = layout_of(2)
    rng = np.random.default_rng(11)
    kv = kv_for(rng, layout, 16)
    (tx,), (rx,) = engines(pre, dec, "bad", layout, 1, 1)
    (tx_old,), (rx_old,) = engines(pre, dec, "old", layout, 1, 1, layer_parts=False)
    extra: list[PrefillSender | DecodeReceiver] = []
    try:
        # A duplicate layer range is refused and changes nothing: the room still succeeds.
        rx.expect(1, pre.peer_address, "bad-p", 16)
        slot = tx.acquire(16)
        tx.slot_view(slot)[:] = group_major(kv)
        assert tx.enqueue_layers([layer_part(1, 0, 0, 16, slot, G, 0, 3)]) == [None]
        (dup,) = tx.enqueue_layers([layer_part(1, 0, 0, 16, slot, G, 0, 6)])
        assert dup is not None and dup.code == grpc.StatusCode.ALREADY_EXISTS, dup
        # A part in another group size than the chunk's first is refused too.
        (mixed,) = tx.enqueue_layers([layer_part(1, 0, 0, 16, slot, 2, 4, 6)])
        assert mixed is not None and mixed.code == grpc.StatusCode.INVALID_ARGUMENT and "layer_group" in str(mixed)
        assert tx.enqueue_layers([layer_part(1, 0, 0, 16, slot, G, 3, 7)]) == [None]
        tx.seal(1, 0, 0, 16, G, aux=b"a")
        got, st = rx.receive(1, timeout=30)
        assert got == {0: group_major(kv)} and st.aux == b"a"

        # Two writers of one chunk in different group sizes: the second is refused, naming the first's.
        (w0, w1), (rx2,) = engines(pre, dec, "mixg", layout, 2, 1)
        extra = [w0, w1, rx2]
        rx2.expect(4, pre.peer_address, "mixg-p", 16)
        s0, s1 = w0.acquire(16), w1.acquire(16)
        w0.slot_view(s0)[:] = group_major(kv[:1])
        w1.slot_view(s1)[:] = group_major(kv[1:])
        assert w0.enqueue_layers([layer_part(4, 0, 0, 16, s0, G, 0, 7)]) == [None]
        (other,) = w1.enqueue_layers([layer_part(4, 0, 0, 16, s1, 2, 0, 7)])
        assert other is not None and other.code == grpc.StatusCode.INVALID_ARGUMENT and "groups of" in str(other)
        assert w1.enqueue_layers([layer_part(4, 0, 0, 16, s1, G, 0, 7)]) == [None]
        for w in (w0, w1):
            w.seal(4, 0, 0, 16, G)
        got, _ = rx2.receive(4, timeout=30)
        assert got == {0: group_major(kv)}

        # A reader that did not opt in: once it has bootstrapped the room, a part is refused, naming why.
        rx_old.expect(2, pre.peer_address, "old-p", 16)
        b = Budget("room 2 bootstrapped at the prefill daemon", 15)
        while not b.expired():
            try:
                tx_old.poll(2)
                break
            except KvxferError:
                time.sleep(0.01)  # NOT_FOUND until the Bootstrap came
        slot = tx_old.acquire(16)
        (refused,) = tx_old.enqueue_layers([layer_part(2, 0, 0, 16, slot, G, 0, 3)])
        assert refused is not None and refused.code == grpc.StatusCode.FAILED_PRECONDITION, refused
        assert "takes no layer parts" in str(refused)
        tx_old.release_slot(slot)  # refused: the slot is still the engine's
        tx_old.abort(2, "test done")

        # A layer never sent and the seal: the room fails MISMATCH on both sides at once (the
        # deadline, far off, is not what ends it).
        rx.expect(3, pre.peer_address, "bad-p", 16, deadline_ms=120_000)
        slot = tx.acquire(16)
        tx.slot_view(slot)[:] = group_major(kv)
        assert tx.enqueue_layers([layer_part(3, 0, 0, 16, slot, G, 0, 3), layer_part(3, 0, 0, 16, slot, G, 6, 7)]) \
            == [None, None]
        tx.seal(3, 0, 0, 16, G)
        with pytest.raises(KvxferError) as failed:
            rx.wait(3, timeout=Budget("room 3 fails", 20).limit())
        assert isinstance(failed.value, RoomFailed) and failed.value.failure_code == "MISMATCH", failed.value
        assert rx.poll(3).landed == ()  # the chunk missing a layer never landed
        assert tx.poll(3).failure_code == "MISMATCH"
    finally:
        for e in (tx, rx, tx_old, rx_old, *extra):
            e.close()
    assert status(pre.socket).slots_held == 0
