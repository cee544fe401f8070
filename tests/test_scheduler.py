"""Scheduler: what it reports (its queue gauges are read when scraped, not set per chunk), and layer
parts on the send side."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvxfer_protocol.slot_layout import KVLayout, part_bytes
from kvxferd.buffers.host_pool import HostPool
from kvxferd.config import Config
from kvxferd.core.engines import Engine
from kvxferd.core.node import Node
from kvxferd.core.peer_port import BootstrapMsg, CreditSpec, Identity
from kvxferd.core.types import (
    ChunkSpec,
    EngineSpec,
    FailureCode,
    Parallelism,
    Role,
    RoomKey,
    RoomState,
    SlotRef,
    ZeroCopyTarget,
)
from kvxferd.datapath.credits import CreditWindow
from kvxferd.datapath.notif import decode_notifs
from kvxferd.datapath.scheduler import Scheduler
from kvxferd.datapath.workers import TransferJob, WorkerPool
from kvxferd.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from kvxferd.ops.metrics import Metrics
from kvxferd.transports.interface import XferState
from tests.test_workers import GatedTransport


@pytest.mark.asyncio
async def test_queue_gauges_show_the_writes_in_flight_when_scraped() -> None:
    loop = asyncio.get_running_loop()
    tr = GatedTransport()
    pool = WorkerPool(tr, loop, 2)  # type: ignore[arg-type]
    metrics = Metrics(CollectorRegistry())
    Scheduler(pool, metrics, window=lambda link: None, chunk_done=lambda r, c: None,  # type: ignore[arg-type,return-value]
              fail=lambda r, code, why: None, local_notif=lambda n: None)
    depth = lambda q: metrics.registry.get_sample_value("kvxferd_queue_depth", {"queue": q})  # noqa: E731
    finished = asyncio.Event()
    left = [2]

    def on_done(job: TransferJob, state: XferState, error: str) -> None:
        left[0] -= 1
        if not left[0]:
            finished.set()

    pool.start()
    try:
        assert depth("workers") == 0 and depth("waiting_slot") == 0
        for n in (b"a", b"b"):
            tr.gates[n] = threading.Event()
            pool.submit(TransferJob(remote="peer", pairs=[(1, 2, 3)], notif=n, on_done=on_done))
        assert depth("workers") == 2  # nothing set it: the scrape asked the pool
        for n in (b"a", b"b"):
            tr.gates[n].set()
        await asyncio.wait_for(finished.wait(), 10)
        assert depth("workers") == 0
    finally:
        for g in tr.gates.values():
            g.set()
        pool.stop()


# ---------------------------------------------------------------- layer parts, send side (docs/design/layerwise.md §2)
# On an in-process prefill node with a recording peer link and recording workers: what each part
# posts (descriptors, notification entries), when the source slot goes back, when Complete goes,
# and that every refusal changes nothing.

LAY = KVLayout(4, 4, 16, 2, 16)  # 4 layers, 4 KV heads
TOKENS = 16


class _Link:
    """A decode daemon that records what is sent to it."""

    is_self = False
    up = True

    def __init__(self) -> None:
        self.daemon_id = self.agent_name = "dec"
        self.instance_id, self.address = "dec-i", "dec:1"
        self.sent: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("send_"):
            return lambda *a, **k: self.sent.append((name, a))
        raise AttributeError(name)

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [a for n, a in self.sent if n == "send_" + kind]


class _Workers:
    in_flight = 0

    def __init__(self) -> None:
        self.jobs: list[TransferJob] = []

    def submit(self, job: TransferJob) -> None:
        self.jobs.append(job)

    async def run_blocking(self, fn: Any, *a: Any) -> Any:
        return fn(*a)

    def finish(self) -> list[TransferJob]:
        """Every recorded job reports DONE, in order; returns them."""
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job.on_done(job, XferState.DONE, "")
        return jobs


@pytest.fixture
async def prefill() -> AsyncIterator[tuple[Node, _Workers, _Link]]:
    pool = HostPool("", 16 << 20, "parts0", backing="private")
    n = Node(Config(), pool, Metrics(CollectorRegistry()), Identity("me", "me-i"))
    workers, peer = _Workers(), _Link()
    window = CreditWindow(peer, n.metrics)  # type: ignore[arg-type]
    window.add([CreditSpec(11, "ring", 1 << 30, 1 << 20, "DRAM", 0)])
    n.attach(workers, lambda link: window, None, list)  # type: ignore[arg-type]
    try:
        yield n, workers, peer
    finally:
        pool.close()


def _engine(n: Node, tp: int = 1, rank: int = 0) -> Engine:
    return n.register_engine(EngineSpec(Role.PREFILL, "p", LAY, Parallelism(tp, rank), 1 << 20, None, 0, "p"), None)


def _boot(n: Node, peer: _Link, rid: int, layer_parts: bool = True, reader: int = 0, decode_tp: int = 1) -> int:
    msg = BootstrapMsg(RoomKey(rid), "p", reader, decode_tp, LAY, TOKENS, 0, "ring", notif_token=bytes(16),
                       layer_parts=layer_parts)
    return n.on_bootstrap(peer, msg).code  # type: ignore[arg-type]


def _part(rid: int, slot: SlotRef, group: int, lo: int, hi: int, chunk: int = 0, **kw: Any) -> ChunkSpec:
    return ChunkSpec(RoomKey(rid), chunk, 0, TOKENS, slot, False, b"", (), 0, group, lo, hi, **kw)


def _seal(rid: int, group: int = 2, chunk: int = 0, aux: bytes = b"tok") -> ChunkSpec:
    return ChunkSpec(RoomKey(rid), chunk, 0, TOKENS, SlotRef(0, 0), True, aux, (), 0, group, LAY.num_layers,
                     LAY.num_layers)


def _entries(job: TransferJob) -> list[tuple[int, int, int]]:
    got = decode_notifs(job.notif)
    assert got is not None, job.notif
    return [(n.layer_group, n.layer_start, n.layer_end) for n in got]


def _counted(n: Node, event: str) -> float:
    return n.metrics.registry.get_sample_value("kvxferd_layer_parts_total", {"role": "prefill", "event": event}) or 0


async def _turn() -> None:
    """The rest of this loop turn: a chunk's later parts are posted at its end (Scheduler.submit_soon)."""
    await asyncio.sleep(0)


async def test_parts_post_group_runs_and_the_slot_and_complete_wait_for_every_layer_and_the_seal(
        prefill: tuple[Node, _Workers, _Link]) -> None:
    n, workers, peer = prefill
    eng = _engine(n)
    assert _boot(n, peer, 1) == 0
    slot, _ = n.acquire_slot(eng.id, TOKENS)
    base = eng.ring.base_addr + slot.offset
    per_layer = LAY.planes * TOKENS * LAY.head_dim * LAY.dtype_bytes
    n.enqueue_chunk(eng.id, _part(1, slot, 2, 2, 4))  # the second group first
    (job,) = workers.finish()
    # 1->1, all 4 heads: group 1 of the group-major slot is one run, at its offset on both sides.
    assert job.pairs == ((base + 2 * 4 * per_layer, (1 << 30) + 2 * 4 * per_layer, 2 * 4 * per_layer),)
    assert job.notif.startswith(b"kvx4 ") and _entries(job) == [(2, 2, 4)]
    room = n.send.rooms[1]
    assert n.slots_held() == 1 and not peer.of("complete")  # layers [0, 2) are still to come
    n.enqueue_chunk(eng.id, _part(1, slot, 2, 0, 2))
    assert not workers.jobs  # posted at the end of the turn, with any part of the chunk admitted meanwhile
    await _turn()
    (job,) = workers.finish()
    assert job.pairs == ((base, 1 << 30, 2 * 4 * per_layer),) and _entries(job) == [(2, 0, 2)]
    # Every layer written: the source slot is back, but no Complete before the seal (aux exists
    # only after the last layer).
    assert n.slots_held() == 0 and room.state is RoomState.TRANSFERRING and not peer.of("complete")
    n.enqueue_chunk(eng.id, _seal(1, aux=b"first-token"))
    assert not workers.jobs  # a seal moves no bytes
    assert peer.of("complete") == [(RoomKey(1), 0, 1, b"first-token")]
    assert (_counted(n, "enqueued"), _counted(n, "sealed"), _counted(n, "written")) == (2, 1, 2)


async def test_parts_that_queue_together_go_as_one_write_with_one_entry_per_contiguous_range(
        prefill: tuple[Node, _Workers, _Link]) -> None:
    n, workers, peer = prefill
    eng = _engine(n)
    slot, _ = n.acquire_slot(eng.id, TOKENS)
    for lo in (3, 0, 1):  # before the bootstrap: they wait in the scheduler
        n.enqueue_chunk(eng.id, _part(2, slot, 1, lo, lo + 1))
    assert not workers.jobs
    assert _boot(n, peer, 2) == 0
    (job,) = workers.finish()
    assert _entries(job) == [(1, 0, 2), (1, 3, 4)]
    per_layer = LAY.planes * TOKENS * LAY.head_dim * LAY.dtype_bytes
    assert sum(p[2] for p in job.pairs) == 3 * 4 * per_layer
    hist = n.metrics.registry.get_sample_value("kvxferd_parts_per_write_sum")
    assert hist == 3
    n.enqueue_chunk(eng.id, _part(2, slot, 1, 2, 3))
    n.enqueue_chunk(eng.id, _seal(2, group=1))
    await _turn()
    (job,) = workers.finish()
    assert _entries(job) == [(1, 2, 3)] and peer.of("complete") == [(RoomKey(2), 0, 1, b"tok")]


async def test_later_parts_admitted_in_one_turn_go_as_one_write(prefill: tuple[Node, _Workers, _Link]) -> None:
    n, workers, peer = prefill
    eng = _engine(n)
    assert _boot(n, peer, 10) == 0
    slot, _ = n.acquire_slot(eng.id, TOKENS)
    n.enqueue_chunk(eng.id, _part(10, slot, 1, 0, 1))  # the first part brings the slot and goes at once
    (first,) = workers.finish()
    for lo in (3, 1, 2):  # one turn's parts (several lane frames read at once), out of order
        n.enqueue_chunk(eng.id, _part(10, slot, 1, lo, lo + 1))
    await _turn()
    (job,) = workers.finish()
    assert _entries(first) == [(1, 0, 1)] and _entries(job) == [(1, 1, 4)]  # one entry per contiguous range
    hist = n.metrics.registry.get_sample_value
    assert (hist("kvxferd_parts_per_write_count"), hist("kvxferd_parts_per_write_sum")) == (2, 4)
    assert hist("kvxferd_parts_per_write_bucket", {"le": "2.0"}) == 1 and _counted(n, "written") == 4


async def test_a_whole_chunk_is_a_kvx3_notification_and_one_descriptor(prefill: tuple[Node, _Workers, _Link]) -> None:
    n, workers, peer = prefill
    eng = _engine(n)
    assert _boot(n, peer, 3, layer_parts=False) == 0
    slot, _ = n.acquire_slot(eng.id, TOKENS)
    n.enqueue_chunk(eng.id, ChunkSpec(RoomKey(3), 0, 0, TOKENS, slot, True, b"x"))
    (job,) = workers.finish()
    assert job.notif.startswith(b"kvx3 ") and job.notif.count(b" ") == 11
    assert len(job.pairs) == 1 and job.pairs[0][2] == part_bytes(LAY, 1, 0, TOKENS)
    assert peer.of("complete") == [(RoomKey(3), 0, 1, b"x")] and n.slots_held() == 0


async def test_every_refused_part_changes_nothing(prefill: tuple[Node, _Workers, _Link]) -> None:
    n, workers, peer = prefill
    eng = _engine(n)
    assert _boot(n, peer, 4) == 0
    slot, _ = n.acquire_slot(eng.id, TOKENS)
    other, _ = n.acquire_slot(eng.id, TOKENS)
    n.enqueue_chunk(eng.id, _part(4, slot, 2, 0, 2))
    workers.finish()
    refusals: list[tuple[ChunkSpec, type[Exception], str]] = [
        (_part(4, slot, 2, 1, 3), InvalidArgument, "groups of 2"),  # off the group grid
        (_part(4, slot, 2, 0, 2), AlreadyExists, "already enqueued"),  # layers enqueued before
        (_part(4, slot, 1, 2, 3), InvalidArgument, "layer_group"),  # another group size than its first part
        (_part(4, other, 2, 2, 4), InvalidArgument, "slot"),  # another slot
        (dataclasses.replace(_part(4, slot, 2, 2, 4), last=True), InvalidArgument, "seal"),  # last on a part
        (_seal(4, chunk=1), InvalidArgument, "before any of its layer parts"),
        (dataclasses.replace(_seal(4), last=False), InvalidArgument, "last"),
        (_part(4, slot, 2, 2, 6), InvalidArgument, "non-empty range"),  # past the model's layers
    ]
    room = n.send.rooms[4]
    before = (room.state, n.slots_held(), dict(room.writers[0].chunks), room.writers[0].chunks[0].layers.enqueued)  # type: ignore[union-attr]
    for chunk, exc, why in refusals:
        with pytest.raises(exc, match=why):
            n.enqueue_chunk(eng.id, chunk)
        after = (room.state, n.slots_held(), dict(room.writers[0].chunks), room.writers[0].chunks[0].layers.enqueued)  # type: ignore[union-attr]
        assert after == before and not workers.jobs, chunk
    assert _counted(n, "refused") == len(refusals)
    # A whole chunk of an id sent as parts is refused too.
    with pytest.raises(AlreadyExists):
        n.enqueue_chunk(eng.id, ChunkSpec(RoomKey(4), 0, 0, TOKENS, other, False, b""))
    n.enqueue_chunk(eng.id, _part(4, slot, 2, 2, 4))
    n.enqueue_chunk(eng.id, _seal(4))
    with pytest.raises(AlreadyExists, match="already sealed"):
        n.enqueue_chunk(eng.id, _seal(4))
    await _turn()
    workers.finish()
    assert peer.of("complete") == [(RoomKey(4), 0, 1, b"tok")] and n.slots_held() == 0
    assert other.offset in eng.acquired  # the refused whole chunk left its slot with the engine


async def test_a_reader_that_did_not_opt_in_gets_no_parts(prefill: tuple[Node, _Workers, _Link]) -> None:
    n, workers, peer = prefill
    eng = _engine(n)
    # Bootstrapped without the opt-in: a part is refused naming why, whole chunks go as before.
    assert _boot(n, peer, 5, layer_parts=False) == 0
    slot, _ = n.acquire_slot(eng.id, TOKENS)
    with pytest.raises(FailedPrecondition, match=r"decode rank 0 of room 5\.0 takes no layer parts"):
        n.enqueue_chunk(eng.id, _part(5, slot, 2, 0, 2))
    assert n.send.rooms[5].state is RoomState.WAITING_FOR_INPUT and not workers.jobs
    # Parts waiting for their bootstrap, then a reader without the opt-in: the room fails on both
    # sides (the bootstrap is refused) and the slot comes back.
    n.enqueue_chunk(eng.id, _part(6, slot, 2, 0, 2))
    assert _boot(n, peer, 6, layer_parts=False) != 0
    room = n.send.rooms[6]
    assert room.state is RoomState.FAILED and room.failure_code is FailureCode.MISMATCH
    assert "takes no layer parts" in room.failure_reason and n.slots_held() == 0 and not workers.jobs


async def test_writers_of_one_chunk_must_agree_on_its_group(prefill: tuple[Node, _Workers, _Link]) -> None:
    n, workers, peer = prefill
    e0, e1 = _engine(n, tp=2, rank=0), _engine(n, tp=2, rank=1)
    assert _boot(n, peer, 7) == 0
    s0, _ = n.acquire_slot(e0.id, TOKENS)
    s1, _ = n.acquire_slot(e1.id, TOKENS)
    n.enqueue_chunk(e0.id, _part(7, s0, 2, 0, 2))
    with pytest.raises(InvalidArgument, match="groups of 4 layers, rank 0 sent it in groups of 2"):
        n.enqueue_chunk(e1.id, ChunkSpec(RoomKey(7), 0, 0, TOKENS, s1, False, b""))  # whole: one group
    with pytest.raises(InvalidArgument, match="groups of 1 layers, rank 0 sent it in groups of 2"):
        n.enqueue_chunk(e1.id, _part(7, s1, 1, 0, 1))
    n.enqueue_chunk(e1.id, _part(7, s1, 2, 2, 4))
    jobs = workers.finish()
    # TP 2->1: each writer's 2 heads are half the reader's; one run per (writer, group).
    assert sorted(_entries(j)[0] for j in jobs) == [(2, 0, 2), (2, 2, 4)]
    assert all(len(j.pairs) == 1 for j in jobs)


async def test_a_gqa_replica_writes_nothing_and_its_parts_count_as_written(
        prefill: tuple[Node, _Workers, _Link]) -> None:
    n, workers, peer = prefill
    # 4 KV heads over prefill TP 8: rank 1 holds rank 0's head again and sends nothing.
    replica = _engine(n, tp=8, rank=1)
    assert _boot(n, peer, 8) == 0
    slot, _ = n.acquire_slot(replica.id, TOKENS)
    n.enqueue_chunk(replica.id, _part(8, slot, 2, 0, 2))
    assert not workers.jobs and n.slots_held() == 1  # half the layers: the slot stays
    n.enqueue_chunk(replica.id, _part(8, slot, 2, 2, 4))
    n.enqueue_chunk(replica.id, _seal(8))
    await _turn()
    chunk = n.send.rooms[8].writers[1].chunks[0]
    assert not workers.jobs and n.slots_held() == 0 and chunk.done
    assert not peer.of("complete")  # the other seven ranks have sent nothing yet


async def test_a_zero_copy_part_writes_only_its_layers_planes(prefill: tuple[Node, _Workers, _Link]) -> None:
    n, workers, peer = prefill
    spec = EngineSpec(Role.PREFILL, "p", LAY, Parallelism(1, 0), 1 << 20, None, 0, "p", zero_copy=True)
    eng = n.register_engine(spec, None)
    pages = (3, 4)  # 16 tokens of page size 16: one page, plus one page the target lists beyond
    target = ZeroCopyTarget(1 << 32, eng.pool_slots, "DRAM", 0, (7,))
    msg = BootstrapMsg(RoomKey(9), "p", 0, 1, LAY, TOKENS, 0, "ring", zero_copy=target, notif_token=bytes(16),
                       layer_parts=True)
    assert n.on_bootstrap(peer, msg).code == 0  # type: ignore[arg-type]
    n.enqueue_chunk(eng.id, ChunkSpec(RoomKey(9), 0, 0, TOKENS, SlotRef(0, 0), False, b"", pages[:1], 0, 1, 1, 3))
    (job,) = workers.finish()
    slot_bytes = 4 * LAY.head_dim * LAY.dtype_bytes  # one token of all 4 heads
    plane_bytes = eng.pool_slots * slot_bytes
    # Layers [1, 3): planes 2..5 (K and V of each), one run of 16 token slots in each.
    assert [((d - (1 << 32)) // plane_bytes, n_) for _, d, n_ in job.pairs] == [(p, 16 * slot_bytes) for p in range(2, 6)]
    assert _entries(job) == [(1, 1, 3)]
    with pytest.raises(InvalidArgument, match="slot"):  # other pages than its first part's
        n.enqueue_chunk(eng.id, ChunkSpec(RoomKey(9), 0, 0, TOKENS, SlotRef(0, 0), False, b"", pages[1:], 0, 1, 0, 1))


async def test_a_seal_with_layers_never_enqueued_fails_the_room_at_once(prefill: tuple[Node, _Workers, _Link]) -> None:
    n, workers, peer = prefill
    eng = _engine(n)
    assert _boot(n, peer, 10) == 0
    slot, _ = n.acquire_slot(eng.id, TOKENS)
    n.enqueue_chunk(eng.id, _part(10, slot, 1, 0, 1))
    n.enqueue_chunk(eng.id, _part(10, slot, 1, 3, 4))
    workers.finish()
    n.enqueue_chunk(eng.id, _seal(10, group=1))
    room = n.send.rooms[10]
    # As a token gap at completion: MISMATCH on both sides at once, not a room held to its deadline.
    assert room.state is RoomState.FAILED and room.failure_code is FailureCode.MISMATCH
    assert "layers [(1, 3)] of chunk 0 were never enqueued" in room.failure_reason
    assert [a[1] for a in peer.of("abort")] == [FailureCode.MISMATCH] and not peer.of("complete")
    assert n.slots_held() == 0
