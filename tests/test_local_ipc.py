"""Two daemons on one host, VRAM by CUDA IPC (issue #38), without CUDA: who counts as on this host,
what a credit carries, how a peer's ring is opened, translated, closed and given up on, and the
worker's copy-then-notify path. The CUDA calls are answered by fakes (host buffers stand in for
VRAM); tests/gpu/test_gpu_local_ipc.py runs the real ones through two daemons."""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvxfer_protocol.pb.kvxfer.v1 import peer_pb2
from kvxferd.buffers import gpu_rings as gpu
from kvxferd.core.peer_port import CreditSpec, LocalRing
from kvxferd.datapath import workers
from kvxferd.datapath.workers import POST_FAILED, TransferJob, WorkerPool, by_ipc
from kvxferd.peer.dispatch import _with_local
from kvxferd.transports import local_ipc
from kvxferd.transports.interface import XferState
from kvxferd.transports.local_ipc import PATH_IPC, IpcLane, IpcViews, SameHost, ring_for, valid_local

HANDLE = bytes(range(1, 65))
UUID = "GPU-00000000-0000-0000-0000-000000000001"


def ref(daemon: str, instance: str) -> SimpleNamespace:
    return SimpleNamespace(daemon_id=daemon, instance_id=instance)


def test_only_an_authenticated_peer_with_our_boot_id_is_on_this_host() -> None:
    here, there = SameHost(b"boot-a"), SameHost(b"boot-b")
    local_peer = SameHost(b"boot-a")
    tag = local_peer.tag(ref("pre", "i1"), "i9")
    assert here.check(tag, ref("pre", "i1"), "i9", authenticated=True)
    assert here(("pre"), "i1")
    # Another kernel (a remote peer) computes another tag.
    assert not here.check(there.tag(ref("far", "i2"), "i9"), ref("far", "i2"), "i9", authenticated=True)
    assert not here("far", "i2")
    # Not authenticated (insecure_peers): never, even with the right tag.
    assert not here.check(local_peer.tag(ref("x", "i3"), "i9"), ref("x", "i3"), "i9", authenticated=False)
    # A tag bound to one receiver or sender is no use to another (a remote peer relaying it).
    assert not here.check(tag, ref("pre", "i1"), "i8", authenticated=True)
    assert not here("pre", "i1")  # the failed proof also withdraws the earlier one
    assert not here.check(tag, ref("pre2", "i1"), "i9", authenticated=True)
    assert not here.check(b"", ref("pre", "i1"), "i9", authenticated=True)
    # No boot id here: nobody is ever same-host.
    assert not SameHost(b"").check(b"", ref("pre", "i1"), "i9", authenticated=True)


def test_the_real_boot_id_gives_a_tag() -> None:
    assert local_ipc.boot_id(), "no /proc/sys/kernel/random/boot_id"
    t = local_ipc.host_tag("d", "i", "j")
    assert len(t) == 32 and t == local_ipc.host_tag("d", "i", "j") != local_ipc.host_tag("d", "i", "k")


@pytest.fixture
def proven(monkeypatch: pytest.MonkeyPatch) -> SameHost:
    sh = SameHost(b"boot")
    assert sh.check(sh.tag(ref("peer", "inst"), "me"), ref("peer", "inst"), "me", authenticated=True)
    monkeypatch.setattr(local_ipc, "same_host", sh)
    import kvxferd.peer.dispatch as pd

    monkeypatch.setattr(pd, "same_host", sh)
    return sh


def test_credits_carry_the_engine_handle_only_to_a_proven_peer_and_only_for_gpu_rings(proven: SameHost) -> None:
    h = SimpleNamespace(handle=HANDLE, device_uuid=UUID, size=1 << 20, offset=4096)
    gpu.peer_views.add(0x7000_0000, 1 << 20, h, 0)
    try:
        assert proven.path("peer", "inst") == "nixl"
        got = ring_for("peer", "inst", "VRAM", 0x7000_0000, 1 << 20)
        assert got == LocalRing(HANDLE, UUID, 1 << 20, 4096, 0x7000_0000)
        assert proven.path("peer", "inst") == PATH_IPC
        assert ring_for("peer", "other-instance", "VRAM", 0x7000_0000, 1 << 20) is None
        assert ring_for("stranger", "inst", "VRAM", 0x7000_0000, 1 << 20) is None
        assert ring_for("peer", "inst", "DRAM", 0x7000_0000, 1 << 20) is None
        assert ring_for("peer", "inst", "VRAM", 0x6000_0000, 1 << 20) is None  # not an imported ring
    finally:
        gpu.peer_views.remove(0x7000_0000)


def test_a_grant_keeps_its_ring_only_from_a_proven_peer_and_inside_the_ring(proven: SameHost) -> None:
    loc = peer_pb2.LocalRing(handle=HANDLE, device_uuid=UUID, size=1 << 20, offset=0, base=0x7000_0000)
    spec = CreditSpec(5, "r", 0x7000_0000 + 4096, 8192, "VRAM", 0)
    got = _with_local(SimpleNamespace(daemon_id="peer", instance_id="inst"), spec, loc)  # type: ignore[arg-type]
    assert got.local is not None and got.local.base == 0x7000_0000 and valid_local(got)
    stranger = SimpleNamespace(daemon_id="peer", instance_id="restarted")
    assert _with_local(stranger, spec, loc).local is None  # type: ignore[arg-type]
    outside = CreditSpec(6, "r", 0x7000_0000 + (1 << 20) - 4096, 8192, "VRAM", 0)
    assert _with_local(SimpleNamespace(daemon_id="peer", instance_id="inst"), outside, loc).local is None  # type: ignore[arg-type]
    short = peer_pb2.LocalRing(handle=b"x" * 10, device_uuid=UUID, size=1 << 20, base=0x7000_0000)
    assert _with_local(SimpleNamespace(daemon_id="peer", instance_id="inst"), spec, short).local is None  # type: ignore[arg-type]


@dataclass
class FakeMapping:
    ptr: int
    device_index: int
    closed: bool = False

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeOpener:
    fail: bool = False
    opened: list[tuple[LocalRing, int | None, FakeMapping]] = field(default_factory=list)

    def __call__(self, loc: LocalRing, ctx: int | None) -> FakeMapping:
        if self.fail:
            raise RuntimeError("cudaIpcOpenMemHandle failed: CUDA error 201 (invalid device context)")
        m = FakeMapping(0x9000_0000 + 0x100_0000 * len(self.opened), 3)
        self.opened.append((loc, ctx, m))
        return m


RING = LocalRing(HANDLE, UUID, 1 << 20, 0, 0x7000_0000)


def credit(cid: int, off: int, n: int, ring: LocalRing | None = RING) -> CreditSpec:
    return CreditSpec(cid, "r", 0x7000_0000 + off, n, "VRAM", 1, ring)


def test_a_peer_ring_opens_once_translates_and_closes_with_its_last_credit() -> None:
    op = FakeOpener()
    v = IpcViews(op)
    a, b = credit(1, 0, 4096), credit(2, 8192, 4096)
    pairs, device = v.route([(0x100, 0x7000_0010, 64), (0x200, 0x7000_2000, 128)], [a, b], "VRAM", 0)  # type: ignore[misc]
    assert pairs == [(0x100, 0x9000_0010, 64), (0x200, 0x9000_2000, 128)]
    assert device == 0  # opened in the copying GPU's context: the copy runs there
    assert [(o[1]) for o in op.opened] == [0]  # one open for the ring, in GPU 0's context
    # A host source: the ring opens in its own GPU's context, the copy runs on that GPU.
    pairs2, device2 = v.route([(0x100, 0x7000_0000, 8)], [a], "DRAM", 0)  # type: ignore[misc]
    assert device2 == 3 and pairs2 == [(0x100, 0x9100_0000, 8)] and [o[1] for o in op.opened] == [0, None]
    # A destination outside every credit of the job, or a credit without a ring: NIXL.
    assert v.route([(0x100, 0x7000_9000, 8)], [a], "VRAM", 0) is None
    assert v.route([(0x100, 0x7000_0000, 8)], [credit(3, 0, 4096, None)], "VRAM", 0) is None
    assert len(v) == 2
    v.forget(a)
    # b still holds the GPU-0 mapping; the other one had only a.
    assert [o[2].closed for o in op.opened] == [False, True]
    v.forget(b)
    assert [o[2].closed for o in op.opened] == [True, True]
    assert len(v) == 0
    v.route([(0x100, 0x7000_0000, 8)], [credit(4, 0, 4096)], "VRAM", 0)
    assert len(op.opened) == 3  # a new credit of the ring opens it again


def test_a_ring_that_cannot_be_opened_goes_over_nixl_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    op = FakeOpener(fail=True)
    v = IpcViews(op)
    c = credit(1, 0, 4096)
    with caplog.at_level(logging.WARNING, logger="kvxferd.transports.local_ipc"):
        for _ in range(3):
            assert v.route([(0x100, 0x7000_0000, 8)], [c], "VRAM", 0) is None
    warned = [r for r in caplog.records if "cannot open its CUDA IPC handle" in r.getMessage()]
    assert len(warned) == 1 and "error 201" in warned[0].getMessage()
    v.forget(c)  # once its credits are gone, a later credit tries again (the fault may have passed)
    op.fail = False
    assert v.route([(0x100, 0x7000_0000, 8)], [credit(2, 0, 4096)], "VRAM", 0) is not None


class NotifTransport:
    """Records standalone notifications and what the destination held when each was sent."""

    def __init__(self, dst: ctypes.Array[ctypes.c_char] | None = None, with_notif: bool = True) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []
        self._dst = dst
        if not with_notif:
            self.send_notif = None  # type: ignore[assignment]

    def send_notif(self, remote: str, notif: bytes) -> None:
        self.sent.append((remote, notif, bytes(self._dst) if self._dst is not None else b""))

    def post_write(self, *a: Any, **k: Any) -> None:
        raise AssertionError("a CUDA IPC job must not be posted to NIXL")

    def check(self, handle: object) -> XferState:
        return XferState.DONE

    def release(self, handle: object) -> None:
        pass

    def get_notifs(self) -> list[tuple[str, bytes]]:
        return []


def fake_device_copy_batch(jobs: Sequence[Sequence[tuple[int, int, int]]], *a: Any,
                           threads: list[str] | None = None, gate: threading.Event | None = None,
                           fail_after: int = -1) -> tuple[str, int]:
    """device_copy_batch with memmove: each job's bytes, then its callback (the real one waits on
    the job's CUDA event there); `gate` holds the first copy, `fail_after` raises after that many jobs."""
    each = a[-1]
    assert threading.current_thread().name.startswith("kvx-worker")
    if threads is not None:
        threads.append(threading.current_thread().name)
    if gate is not None:
        assert gate.wait(10)
    for i, pairs in enumerate(jobs):
        if i == fail_after:
            raise RuntimeError("cudaEventSynchronize: CUDA error 700 (an illegal memory access)")
        for src, dst, n in pairs:
            ctypes.memmove(dst, src, n)
        each(i, 0.25)
    return gpu.LINK_SAME_GPU, 1000


async def run_job(tr: NotifTransport, job: TransferJob) -> tuple[XferState, str]:
    loop = asyncio.get_running_loop()
    pool = WorkerPool(tr, loop, 2, join_notifs=b"".join)  # type: ignore[arg-type]
    pool.start()
    fut: asyncio.Future[tuple[XferState, str]] = loop.create_future()
    job.on_done = lambda j, state, error: fut.set_result((state, error))
    try:
        pool.submit(job)
        return await asyncio.wait_for(fut, 10)
    finally:
        pool.stop()


@pytest.mark.asyncio
async def test_worker_copies_then_sends_the_notification_alone(proven: SameHost, monkeypatch: pytest.MonkeyPatch) -> None:
    src = ctypes.create_string_buffer(bytes(range(256)) * 16)
    dst = ctypes.create_string_buffer(4096)
    base = ctypes.addressof(dst)
    ring = LocalRing(HANDLE, UUID, 4096, 0, 0x7000_0000)
    views = IpcViews(lambda loc, ctx: FakeMapping(base, 0))
    monkeypatch.setattr(local_ipc, "views", views)
    monkeypatch.setattr(local_ipc, "device_copy_batch", fake_device_copy_batch)
    held = SimpleNamespace(spec=CreditSpec(1, "r", 0x7000_0000, 4096, "VRAM", 1, ring), revoked=False)
    job = by_ipc(TransferJob("peer-agent", [(ctypes.addressof(src), 0x7000_0100, 1024)], b"notif-1", lambda *a: None,
                             local_mem="VRAM", remote_mem="VRAM", credits=[held], merge_key="room"), "peer", "inst")
    assert job.link == PATH_IPC and job.merge_key == IpcLane(0, 0) and job.pairs == [(ctypes.addressof(src), base + 0x100, 1024)]
    tr = NotifTransport(dst)
    assert await run_job(tr, job) == (XferState.DONE, "")
    assert bytes(dst[0x100:0x500]) == bytes(src[:1024])
    assert len(tr.sent) == 1 and tr.sent[0][:2] == ("peer-agent", b"notif-1")
    assert tr.sent[0][2][0x100:0x500] == bytes(src[:1024])  # the bytes were there before the notification
    # A peer that did not prove it is on this host: the same job stays a NIXL WRITE.
    other = by_ipc(TransferJob("x", [(1, 0x7000_0100, 8)], b"n", lambda *a: None, credits=[held], merge_key="k"),
                   "peer", "restarted")
    assert other.link == "" and other.merge_key == "k"
    # A transport without standalone notifications: the job fails as a transport error (the pair heals).
    job2 = by_ipc(TransferJob("peer-agent", [(ctypes.addressof(src), 0x7000_0000, 16)], b"n2", lambda *a: None,
                              local_mem="VRAM", remote_mem="VRAM", credits=[held]), "peer", "inst")
    state, error = await run_job(NotifTransport(dst, with_notif=False), job2)
    assert state is XferState.ERROR and error.startswith(POST_FAILED) and "no notification" in error


@pytest.mark.asyncio
async def test_queued_ipc_jobs_of_a_lane_go_as_one_burst_on_one_thread(proven: SameHost,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs queued behind a busy copy (any room) go as one launch burst on the thread copying for
    their GPUs, each notified after its own bytes, with back-to-back times (summing to the burst's
    wall time, not n times it); a copy that fails mid-burst fails only the jobs not yet copied, and
    not as a transport error (the peer link is fine)."""
    src = ctypes.create_string_buffer(bytes(range(256)) * 16)
    dst = ctypes.create_string_buffer(4096)
    base = ctypes.addressof(dst)
    ring = LocalRing(HANDLE, UUID, 4096, 0, 0x7000_0000)
    monkeypatch.setattr(local_ipc, "views", IpcViews(lambda loc, ctx: FakeMapping(base, 0)))
    gate, threads = threading.Event(), list[str]()
    calls = [0]

    def fake(jobs: Sequence[Sequence[tuple[int, int, int]]], *a: Any) -> tuple[str, int]:
        calls[0] += 1
        return fake_device_copy_batch(jobs, *a, threads=threads, gate=gate if calls[0] in (1, 3) else None,
                                      fail_after=1 if calls[0] == 4 else -1)

    monkeypatch.setattr(local_ipc, "device_copy_batch", fake)
    held = SimpleNamespace(spec=CreditSpec(1, "r", 0x7000_0000, 4096, "VRAM", 1, ring), revoked=False)
    loop = asyncio.get_running_loop()
    tr = NotifTransport(dst)
    pool = WorkerPool(tr, loop, 4, join_notifs=b"".join)  # type: ignore[arg-type]
    pool.start()
    done: dict[bytes, asyncio.Future[tuple[XferState, str, TransferJob]]] = {}

    def submit(i: int) -> None:
        job = by_ipc(TransferJob("peer-agent", [(ctypes.addressof(src) + 256 * i, 0x7000_0000 + 256 * i, 256)],
                                 b"n%d" % i, lambda j, s, e: done[j.notif].set_result((s, e, j)),
                                 local_mem="VRAM", remote_mem="VRAM", credits=[held], merge_key=f"room{i}",
                                 nbytes=256), "peer", "inst")
        done[job.notif] = loop.create_future()
        pool.submit(job)

    before = local_ipc.stats.line()
    try:
        submit(0)
        while not threads:  # the first burst holds its thread; the rest queue behind it there
            await asyncio.sleep(0.005)
        for i in range(1, 6):
            submit(i)
        gate.set()
        got = [await asyncio.wait_for(done[b"n%d" % i], 10) for i in range(6)]
        assert [g[:2] for g in got] == [(XferState.DONE, "")] * 6
        assert len(set(threads)) == 1 and len(threads) == 2  # one thread: a burst of 1, then of 5
        assert [n for _, n, _ in tr.sent] == [b"n%d" % i for i in range(6)]
        for i, (_, _, seen) in enumerate(tr.sent):
            assert seen[256 * i:256 * (i + 1)] == bytes(src[256 * i:256 * (i + 1)])
        burst = [g[2] for g in got[1:]]
        for a, b in itertools.pairwise(burst):
            assert a.posted_at <= a.finished_at == b.posted_at <= b.finished_at  # back to back, never overlapping
        # A held copy again, then a burst of three whose copy fails after its first job.
        gate.clear()
        submit(6)
        while len(threads) < 3:
            await asyncio.sleep(0.005)
        for i in range(7, 10):
            submit(i)
        gate.set()
        got = [await asyncio.wait_for(done[b"n%d" % i], 10) for i in range(7, 10)]
    finally:
        pool.stop()
    assert len(threads) == 4 and got[0][:2] == (XferState.DONE, "") and [n for _, n, _ in tr.sent][-2:] == [b"n6", b"n7"]
    for state, error, _ in got[1:]:
        assert state is XferState.ERROR and "error 700" in error and not workers.transport_error(error)
    assert before != local_ipc.stats.line() and "jobs=" in local_ipc.stats.line()
