"""WorkerPool: where jobs go, and that results come back on the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

from kvxferd.datapath.workers import TransferJob, WorkerPool
from kvxferd.transports.interface import XferState


class GatedTransport:
    """Posts block until the test opens their gate; records which thread posted what."""

    def __init__(self) -> None:
        self.gates: dict[bytes, threading.Event] = {}
        self.posted_by: dict[bytes, str] = {}
        self.entered = threading.Semaphore(0)

    def post_write(self, remote: str, pairs: Sequence[tuple[int, int, int]], notif: bytes, **_: object) -> bytes:
        self.posted_by[notif] = threading.current_thread().name
        self.entered.release()
        assert self.gates[notif].wait(10), f"gate of {notif!r} never opened"
        return notif

    def check(self, handle: object) -> XferState:
        return XferState.DONE

    def release(self, handle: object) -> None:
        pass

    def get_notifs(self) -> list[tuple[str, bytes]]:
        return []


@pytest.mark.asyncio
async def test_jobs_of_one_peer_go_to_idle_threads_and_run_at_once() -> None:
    loop = asyncio.get_running_loop()
    tr = GatedTransport()
    pool = WorkerPool(tr, loop, 3)  # type: ignore[arg-type]
    pool.start()
    done: dict[bytes, XferState] = {}
    all_done = asyncio.Event()
    names = [b"a", b"b", b"c", b"d"]

    def on_done(job: TransferJob, state: XferState, error: str) -> None:
        assert threading.current_thread() is threading.main_thread()  # back on the loop
        done[job.notif] = state
        if len(done) == len(names):
            all_done.set()

    try:
        for n in names:
            tr.gates[n] = threading.Event()
        # Three jobs to the same peer: each goes to a thread with nothing to do, so all three
        # are inside their post at once (a per-peer shard would have queued b and c behind a).
        for n in names[:3]:
            pool.submit(TransferJob("peer-1", [(1, 2, 3)], n, on_done))
        for _ in range(3):
            assert await loop.run_in_executor(None, tr.entered.acquire, True, 10)
        assert sorted(tr.posted_by.values()) == ["kvx-worker-0", "kvx-worker-1", "kvx-worker-2"]
        # The fourth goes to the first thread to finish: open b's gate only.
        tr.gates[b"b"].set()
        while b"b" not in done:
            await asyncio.sleep(0.005)
        pool.submit(TransferJob("peer-1", [(1, 2, 3)], b"d", on_done))
        tr.gates[b"d"].set()
        while b"d" not in done:
            await asyncio.sleep(0.005)
        assert tr.posted_by[b"d"] == tr.posted_by[b"b"]
        tr.gates[b"a"].set()
        tr.gates[b"c"].set()
        await asyncio.wait_for(all_done.wait(), 10)
        assert done == dict.fromkeys(names, XferState.DONE)
        assert pool.in_flight == 0
    finally:
        for g in tr.gates.values():
            g.set()
        pool.stop()


class _Credit:
    def __init__(self, revoked: bool) -> None:
        self.revoked = revoked


@pytest.mark.asyncio
async def test_jobs_of_one_room_queued_together_share_one_write() -> None:
    """While a thread is busy, jobs queue behind it; when it comes back, those with the same merge
    key (and peer) go as one WRITE whose notification joins theirs, in queue order; other jobs
    keep their order, a job whose credit was revoked meanwhile is refused alone, and every job
    gets its own result."""
    loop = asyncio.get_running_loop()
    tr = GatedTransport()
    pool = WorkerPool(tr, loop, 1, join_notifs=b"|".join, merge_max_bytes=16 << 20)  # type: ignore[arg-type]
    pool.start()
    done: dict[bytes, tuple[XferState, str]] = {}

    def on_done(job: TransferJob, state: XferState, error: str) -> None:
        assert threading.current_thread() is threading.main_thread()
        done[job.notif] = (state, error)

    def job(notif: bytes, key: object, peer: str = "peer-1", revoked: bool = False, nbytes: int = 3) -> TransferJob:
        return TransferJob(peer, [(len(done) + 1, 2, 3)], notif, on_done, merge_key=key,
                           credits=[_Credit(revoked)], nbytes=nbytes)

    try:
        for gate in (b"a", b"b|c|f", b"d", b"e", b"g", b"h", b"i"):
            tr.gates[gate] = threading.Event()
        pool.submit(job(b"a", "r1"))
        assert await loop.run_in_executor(None, tr.entered.acquire, True, 10)  # the thread is inside a's post
        for j in (job(b"b", "r2"), job(b"c", "r2"), job(b"d", "r3"), job(b"x", "r2", revoked=True),
                  job(b"e", "r2", peer="peer-2"), job(b"f", "r2"), job(b"g", None),
                  job(b"h", "r4", nbytes=10 << 20), job(b"i", "r4", nbytes=10 << 20)):
            pool.submit(j)
        for gate in tr.gates.values():
            gate.set()
        while len(done) < 10:
            await asyncio.sleep(0.005)
        # One WRITE for b, c and f (room r2, peer-1); d, e (another peer), g (no key) alone, and
        # h and i apart (together over the 16 MiB a merged WRITE may carry here).
        assert list(tr.posted_by) == [b"a", b"b|c|f", b"d", b"e", b"g", b"h", b"i"]
        assert {n: s for n, (s, _) in done.items()} == {
            **dict.fromkeys([b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h", b"i"], XferState.DONE),
            b"x": XferState.ERROR}
        assert "revoked" in done[b"x"][1]
        assert pool.in_flight == 0
    finally:
        for g in tr.gates.values():
            g.set()
        pool.stop()


@pytest.mark.asyncio
async def test_while_every_thread_is_busy_a_job_follows_its_room_and_shares_its_write() -> None:
    """An idle thread takes a job whatever its room (a room's WRITEs run in parallel); once every
    thread is busy, a job queues behind the last job of its room, where it can share a WRITE
    (spread by load alone, d and f of room r1 queued on different threads and went as two)."""
    loop = asyncio.get_running_loop()
    tr = GatedTransport()
    pool = WorkerPool(tr, loop, 3, join_notifs=b"|".join)  # type: ignore[arg-type]
    pool.start()
    done: dict[bytes, XferState] = {}

    def on_done(job: TransferJob, state: XferState, error: str) -> None:
        done[job.notif] = state

    def job(notif: bytes, key: str) -> TransferJob:
        return TransferJob("peer-1", [(1, 2, 3)], notif, on_done, merge_key=key, nbytes=3)

    try:
        for gate in (b"a", b"a2", b"c", b"d|f", b"e"):
            tr.gates[gate] = threading.Event()
        for j in (job(b"a", "r1"), job(b"a2", "r1"), job(b"c", "r3")):
            pool.submit(j)
            assert await loop.run_in_executor(None, tr.entered.acquire, True, 10)  # inside its post
        for j in (job(b"d", "r1"), job(b"e", "r2"), job(b"f", "r1")):
            pool.submit(j)
        for gate in tr.gates.values():
            gate.set()
        while len(done) < 6:
            await asyncio.sleep(0.005)
        assert len({tr.posted_by[n] for n in (b"a", b"a2", b"c")}) == 3
        assert tr.posted_by[b"d|f"] == tr.posted_by[b"a2"]
        assert set(tr.posted_by) == {b"a", b"a2", b"c", b"d|f", b"e"}
        assert set(done.values()) == {XferState.DONE} and pool.in_flight == 0
    finally:
        for g in tr.gates.values():
            g.set()
        pool.stop()
