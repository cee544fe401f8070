"""Transfer workers: the only module that starts threads.

Each worker thread owns a queue and posts NIXL WRITEs, then polls every handle it
has in flight (never waiting on one while others could progress) and reports
each result back to the event loop with call_soon_threadsafe.

A job goes to the thread with the least work handed to it, whatever its peer: the
transport gives each thread its own UCX worker (NixlTransport(num_workers=...)), so
WRITEs from different threads copy in parallel, and one room's chunks too. Over CMA
(daemons on one host) UCX copies inside the post, on the posting thread: a single
thread is one core's copy speed (measured 6.1 GB/s on the 2-core VM; two threads with
two UCX workers 9.4 GB/s; two threads sharing one UCX worker 5.9 GB/s at twice the CPU,
spinning on its lock).

Jobs that wait in one thread's queue together and carry the same merge key (the scheduler
uses the room) go as one WRITE, up to _MERGE_MAX jobs and merge_max_bytes, with one
notification listing every part: one post, one completion and one notification instead of one
each. Nothing waits to be merged: only what is already queued behind a busy thread is.
Measured on the 16-core box, merging on and off interleaved (bench/results/merge-writes-h100box.json):
TP 4->2 +40 % with 5 MiB chunks (1.25 MiB parts), +11 % with 20 MiB; TP 1->1 and 1->4 within
the noise (jobs of 20 MiB never merge). Keying by chunk instead (only the parts of one chunk
from different writers) merged almost nothing: partner parts go to different threads. With many
threads (8 on 16 cores) queues stay short and a room's jobs, spread by load alone, rarely met
either: while every thread is busy, a job now follows the last job of its room (if that thread's
load is within one of the least loaded), so it waits where it can share a WRITE. A fake transport
copying 1.7 ms per post, 16 rooms x 4 writers x 4 chunks, 8 threads: 253 WRITEs for 256 jobs
before, 145 after (4 threads: 239 -> 135).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvxferd.buffers.gpu_rings import device_copies
from kvxferd.config import Config
from kvxferd.transports import local_ipc
from kvxferd.transports.interface import Transport, TransportError, XferState

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Poll back-off while transfers are in flight: short enough to keep chunk
# latency low, long enough not to starve the event loop on 2 cores.
_POLL_MIN_S = 0.00002
_POLL_MAX_S = 0.0005
# Notification polling: fast while WRITEs are expected, slow when nothing is (an idle daemon
# must cost ~nothing; NIXL has no blocking wait for notifications).
_NOTIF_BUSY_S = 0.001
_NOTIF_IDLE_S = 0.05
# First sleep after notifications came: WRITEs land ~1 ms apart at 15 GB/s, so starting the
# back-off at 20 µs woke the thread ~4.4 times per 20 MiB chunk (2-core VM); from 200 µs, ~2.3
# times, ~100 µs less CPU per chunk, and the detection delay still tops out at _NOTIF_BUSY_S.
_NOTIF_MIN_S = 0.0002
# Merging: at most this many jobs in one WRITE (its notification lists every part of each; the
# bytes are capped by Config.merge_max_bytes), and how far down a thread's queue a job looks for
# partners.
_MERGE_MAX = 8
_MERGE_SCAN = 64


# How a job that the transport failed is reported (a failed post, or NIXL's ERR on a posted WRITE),
# as opposed to one failed here (credit revoked, daemon stopping, a same-node copy).
POST_FAILED = "post failed: "
NIXL_ERR = "NIXL reported ERR"


def transport_error(error: str) -> bool:
    """Whether a failed job's error came from the transport, i.e. the peer's connection may be broken."""
    return error == NIXL_ERR or error.startswith(POST_FAILED)


Outcome = tuple[list["TransferJob"], XferState, str]  # jobs that ended alike: state and error


def _deliver(outcomes: list[Outcome]) -> None:
    for jobs, state, error in outcomes:
        for job in jobs:
            job.on_done(job, state, error)


_PR_SET_NAME = 15


def _name_os_thread() -> None:
    """Gives the OS thread the Python thread's name (first 15 bytes) so `top -H`, `ps -L` and
    per-thread CPU accounting show which part of the daemon spends the CPU."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, threading.current_thread().name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass(eq=False)
class TransferJob:
    """One NIXL WRITE, already resolved to addresses: a writer's parts of one chunk for the
    readers on one daemon (kvxferd.datapath.scheduler), or one zero-copy part."""

    remote: str
    pairs: Sequence[tuple[int, int, int]]
    notif: bytes
    on_done: Callable[[TransferJob, XferState, str], None]
    local_mem: str = "DRAM"
    remote_mem: str = "DRAM"
    local_device: int = 0
    remote_device: int = 0
    tag: Any = None
    nbytes: int = 0
    # The credits written into (credits.Held): a WRITE is never posted once one is revoked.
    credits: Sequence[Any] = ()
    posted_at: float = 0.0
    finished_at: float = 0.0
    # Jobs with the same key (not None), remote and memory kinds that wait in one thread's queue
    # together go as one WRITE (the scheduler uses the room: a failed WRITE fails only that room).
    merge_key: Any = None
    # A same-node copy between GPU rings: the link it took (kvxferd.buffers.gpu_rings.LINK_*), its metrics path.
    link: str = ""
    _worker: int = field(default=-1, repr=False)  # the thread it was handed to


def by_ipc(job: TransferJob, peer_id: str, peer_instance: str) -> TransferJob:
    """A job to a daemon on this host whose reader rings came with their CUDA IPC handles is
    copied here device to device, then its notification goes alone (kvxferd.transports.local_ipc); one
    whose rings cannot be opened here stays a NIXL WRITE."""
    if job.remote and job.credits and local_ipc.same_host(peer_id, peer_instance):
        got = local_ipc.views.route(job.pairs, [c.spec for c in job.credits], job.local_mem, job.local_device)
        if got is not None:
            job.pairs, job.remote_device = got
            job.link, job.merge_key = local_ipc.PATH_IPC, local_ipc.IpcLane(job.local_device, job.remote_device)
            local_ipc.same_host.used(peer_id, peer_instance)
    return job


@dataclass(eq=False)
class _Posted:
    """One WRITE in flight and the jobs it carries."""

    handle: Any
    jobs: list[TransferJob]


class WorkerPool:
    def __init__(self, transport: Transport, loop: asyncio.AbstractEventLoop, workers: int,
                 post_delay: Callable[[], float] | None = None,
                 join_notifs: Callable[[list[bytes]], bytes] | None = None,
                 merge_max_bytes: int = Config.merge_max_bytes) -> None:
        self._transport = transport
        # How the notifications of jobs merged into one WRITE become one (None: never merge).
        self._join_notifs = join_notifs
        self._merge_max_bytes = merge_max_bytes
        # Test-only fault hook: seconds to hold the next post (delays a WRITE past a revocation).
        self._post_delay = post_delay
        # Set by the decode side while it expects chunks: notifications are then polled fast.
        self.expecting: Callable[[], bool] = lambda: True
        self._loop = loop
        self._queues: list[queue.SimpleQueue[TransferJob | None]] = [queue.SimpleQueue() for _ in range(workers)]
        # Jobs handed to each thread and not reported yet (under _lock): where the next one goes.
        self._load = [0] * workers
        # Per merge key: the thread its last job went to and its jobs not reported yet (under _lock).
        self._affinity: dict[Any, list[int]] = {}
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"kvx-worker-{i}", daemon=True)
            for i in range(workers)
        ]
        self._in_flight = 0
        self._lock = threading.Lock()
        # Per remote agent: jobs handed to a thread and not yet reported (under _lock), and the
        # jobs parked while exclusive() swaps that agent's NIXL entry (loop thread only).
        self._posted: dict[str, int] = {}
        self._parked: dict[str, list[TransferJob]] = {}
        self._exclusive_locks: dict[str, asyncio.Lock] = {}
        self._blocking = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvx-blocking")
        self._notif_thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def start_notif_poller(self, handler: Callable[[list[tuple[str, bytes]]], None]) -> None:
        self._notif_thread = threading.Thread(
            target=self._poll_notifs, args=(handler,), name="kvx-notif", daemon=True
        )
        self._notif_thread.start()

    def submit(self, job: TransferJob) -> None:
        with self._lock:
            self._in_flight += 1
        parked = self._parked.get(job.remote) if job.remote else None
        if parked is not None:
            parked.append(job)
            return
        self._hand_over(job)

    def _hand_over(self, job: TransferJob) -> None:
        key = job.merge_key
        with self._lock:
            self._posted[job.remote] = self._posted.get(job.remote, 0) + 1
            load = self._load
            index = min(range(len(load)), key=load.__getitem__)
            if key is not None:
                aff = self._affinity.get(key)
                if aff is None:
                    self._affinity[key] = [index, 1]
                else:
                    # Every thread busy: the job waits in some queue anyway, and behind a job of its own
                    # room it goes out in that job's WRITE (_take_group). Spread by load alone, the
                    # parts of one room scattered over 8 threads and almost never met in a queue.
                    # A local-ipc lane stays on one thread: copies of two threads on one GPU only split it.
                    if isinstance(key, local_ipc.IpcLane) or (load[index] and load[aff[0]] <= load[index] + 1):
                        index = aff[0]
                    aff[0] = index
                    aff[1] += 1
            load[index] += 1
        job._worker = index
        if self._stop.is_set():
            self._report(job, XferState.ERROR, "daemon stopped before the transfer was posted")
            return
        self._queues[index].put(job)

    def posted_to(self, remote: str) -> int:
        with self._lock:
            return self._posted.get(remote, 0)

    async def exclusive(self, remote: str, fn: Callable[..., T], *args: Any, drain_timeout_s: float = 5.0) -> T:
        """Runs the blocking fn(*args) while no WRITE to `remote` is in flight.

        New jobs for that agent are parked meanwhile and handed over afterwards, in order. Used
        to replace a live peer's NIXL entry: removing it fails every WRITE still in flight to it.
        WRITEs to a live peer finish in milliseconds; one still running after drain_timeout_s
        (a frozen peer) is left to fail, which fails its room with a reason, rather than
        stalling every other room to that peer.
        """
        lock = self._exclusive_locks.setdefault(remote, asyncio.Lock())
        async with lock:
            self._parked[remote] = []
            try:
                deadline = self._loop.time() + drain_timeout_s
                while self.posted_to(remote) and self._loop.time() < deadline:
                    await asyncio.sleep(0.001)
                if left := self.posted_to(remote):
                    logger.warning("%d WRITE(s) to %s still in flight after %.1f s; replacing its entry anyway",
                                   left, remote, drain_timeout_s)
                return await self.run_blocking(fn, *args)
            finally:
                for job in self._parked.pop(remote, []):
                    self._hand_over(job)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs a slow call (NIXL metadata load, registration) off the event loop."""
        return await self._loop.run_in_executor(self._blocking, fn, *args)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for q in self._queues:
            q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))
        if self._notif_thread is not None:
            self._notif_thread.join(max(0.0, deadline - time.monotonic()))
        self._blocking.shutdown(wait=False, cancel_futures=True)

    def _report(self, job: TransferJob, state: XferState, error: str) -> None:
        self._report_all([job], state, error)

    def _report_all(self, jobs: list[TransferJob], state: XferState, error: str) -> None:
        self._report_outcomes([(jobs, state, error)])

    def _report_outcomes(self, outcomes: list[Outcome]) -> None:
        """Accounts for finished jobs and hands them to the loop in one wake-up (every WRITE that one
        pass over a thread's WRITEs in flight found finished: one wake-up of the loop, not one each)."""
        now = time.monotonic()
        with self._lock:
            for job in (j for jobs, _, _ in outcomes for j in jobs):
                self._in_flight -= 1
                if job._worker >= 0:
                    self._load[job._worker] -= 1
                    job._worker = -1
                    if job.merge_key is not None:
                        aff = self._affinity.get(job.merge_key)
                        if aff is not None:
                            aff[1] -= 1
                            if aff[1] <= 0:
                                del self._affinity[job.merge_key]
                n = self._posted.get(job.remote, 0) - 1
                if n > 0:
                    self._posted[job.remote] = n
                else:
                    self._posted.pop(job.remote, None)
                job.finished_at = job.finished_at or now  # a local-ipc job's is its own notification
        try:
            if len(outcomes) == 1 and len(outcomes[0][0]) == 1:
                (job,), state, error = outcomes[0]
                self._loop.call_soon_threadsafe(job.on_done, job, state, error)
            else:
                self._loop.call_soon_threadsafe(_deliver, outcomes)
        except RuntimeError:
            # The loop is closed: the daemon is gone and nobody is waiting.
            pass

    def _take_group(self, backlog: collections.deque[TransferJob]) -> list[TransferJob]:
        """The oldest queued job and, if it may merge, the queued jobs that can share its WRITE
        (in queue order); every other job keeps its place."""
        first = backlog.popleft()
        ipc = first.link == local_ipc.PATH_IPC  # a launch burst, each job its own notification: no byte cap
        if first.merge_key is None or not first.remote or (self._join_notifs is None and not ipc):
            return [first]
        shape = (first.merge_key, first.remote, first.local_mem, first.remote_mem, first.local_device,
                 first.remote_device)
        group, keep, nbytes = [first], [], first.nbytes
        for _ in range(min(len(backlog), _MERGE_SCAN)):
            j = backlog.popleft()
            if (len(group) < _MERGE_MAX and (ipc or nbytes + j.nbytes <= self._merge_max_bytes)
                    and shape == (j.merge_key, j.remote, j.local_mem, j.remote_mem, j.local_device, j.remote_device)):
                group.append(j)
                nbytes += j.nbytes
            else:
                keep.append(j)
        backlog.extendleft(reversed(keep))
        return group

    def _post(self, group: list[TransferJob]) -> _Posted | None:
        if self._post_delay is not None:
            delay = self._post_delay()
            if delay > 0:
                logger.warning("fault injection: holding a WRITE to %s for %.2f s", group[0].remote or "self", delay)
                time.sleep(delay)
        now = time.monotonic()
        jobs: list[TransferJob] = []
        revoked: list[TransferJob] = []
        for job in group:
            job.posted_at = now
            # The decode side revoked the credit (ring released, session lost) after this WRITE was
            # dispatched: its space may be about to be reused, so nothing is posted.
            (revoked if any(c.revoked for c in job.credits) else jobs).append(job)
        if revoked:
            logger.warning("%d WRITE(s) to %s not posted: destination credit revoked before the WRITE was posted",
                           len(revoked), group[0].remote or "self")
            self._report_all(revoked, XferState.ERROR, "destination credit revoked before the WRITE was posted")
        if not jobs:
            return None
        job = jobs[0]
        if job.link == local_ipc.PATH_IPC:
            # To a daemon on this host: each job's notification follows its bytes, as NIXL's follows a WRITE.
            self._report_outcomes([([j], XferState.ERROR if err else XferState.DONE, POST_FAILED + err if tr else err)
                                   for j, err, tr in local_ipc.copy_batch(jobs, self._notify)])
            return None
        if not job.remote:
            # Same-node path: source and destination are both mapped here (never merged).
            try:
                if job.local_mem == "DRAM" and job.remote_mem == "DRAM":
                    for src, dst, length in job.pairs:
                        ctypes.memmove(dst, src, length)
                else:
                    link = device_copies(job.pairs, job.local_mem, job.local_device, job.remote_mem,
                                         job.remote_device)
                    job.link = job.link or link
            except Exception as exc:
                self._report(job, XferState.ERROR, f"local copy failed: {exc}")
                return None
            self._report(job, XferState.DONE, "")
            return None
        if len(jobs) == 1:
            pairs, notif = job.pairs, job.notif
        else:
            assert self._join_notifs is not None
            pairs = [p for j in jobs for p in j.pairs]
            notif = self._join_notifs([j.notif for j in jobs])
        try:
            handle = self._transport.post_write(
                job.remote, pairs, notif,
                local_mem=job.local_mem, remote_mem=job.remote_mem,
                local_device=job.local_device, remote_device=job.remote_device,
            )
        except Exception as exc:
            logger.warning("posting transfer to %s failed: %s", job.remote, exc)
            self._report_all(jobs, XferState.ERROR, f"{POST_FAILED}{exc}")
            return None
        return _Posted(handle, jobs)

    def _notify(self, remote: str, notif: bytes) -> None:
        send = getattr(self._transport, "send_notif", None)
        if send is None:
            raise TransportError(f"{type(self._transport).__name__} sends no notification without a WRITE")
        send(remote, notif)

    def _run(self, index: int) -> None:
        _name_os_thread()
        q = self._queues[index]
        backlog: collections.deque[TransferJob] = collections.deque()
        active: list[_Posted] = []
        backoff = _POLL_MIN_S
        while True:
            # Take everything queued (jobs that arrived together can share a WRITE); block only
            # when nothing is queued or in flight.
            try:
                job = q.get() if not (active or backlog) else q.get_nowait()
                while True:
                    if job is None:
                        if backlog:
                            self._report_all(list(backlog), XferState.ERROR,
                                             "daemon stopped before the transfer was posted")
                        self._drain_on_stop(active)
                        return
                    backlog.append(job)
                    job = q.get_nowait()
            except queue.Empty:
                pass
            if backlog:
                posted = self._post(self._take_group(backlog))
                if posted is not None:
                    active.append(posted)
                # Report completions between posts, not only once the queue runs dry: a worker
                # fed faster than it copies (UCX over CMA copies inside the post) otherwise held
                # every finished job, and the source slots and rooms behind it, until a lull
                # (measured on loopback: ~2x lower throughput, and rooms held for seconds whose
                # WRITE did not finish inside its post).
                active, _ = self._reap(active)
                continue
            active, progressed = self._reap(active)
            if active:
                backoff = _POLL_MIN_S if progressed else min(backoff * 2, _POLL_MAX_S)
                time.sleep(backoff)

    def _reap(self, active: list[_Posted]) -> tuple[list[_Posted], bool]:
        """Checks every WRITE in flight once, reports the finished ones; returns (still in flight, any finished)."""
        still: list[_Posted] = []
        finished: list[Outcome] = []
        for p in active:
            state = self._check(p)
            if state is XferState.PENDING:
                still.append(p)
                continue
            self._release(p)
            finished.append((p.jobs, state, "" if state is XferState.DONE else NIXL_ERR))
        if finished:
            self._report_outcomes(finished)
        return still, bool(finished)

    def _check(self, p: _Posted) -> XferState:
        try:
            return self._transport.check(p.handle)
        except Exception as exc:
            logger.warning("checking transfer to %s failed: %s", p.jobs[0].remote, exc)
            return XferState.ERROR

    def _release(self, p: _Posted) -> None:
        try:
            self._transport.release(p.handle)
        except Exception as exc:
            logger.debug("release of transfer handle failed: %s", exc)

    def _drain_on_stop(self, active: list[_Posted]) -> None:
        # Finish what was posted (the bytes are already moving); bounded wait.
        deadline = time.monotonic() + 5.0
        while active and time.monotonic() < deadline:
            active, _ = self._reap(active)
            if active:
                time.sleep(_POLL_MAX_S)
        for p in active:
            self._release(p)  # cancels it: the handle is NIXL's, not a Python object that frees itself
            self._report_all(p.jobs, XferState.ERROR, "daemon stopped before the transfer finished")

    def _poll_notifs(self, handler: Callable[[list[tuple[str, bytes]]], None]) -> None:
        _name_os_thread()
        idle = _NOTIF_BUSY_S
        while not self._stop.is_set():
            try:
                notifs = self._transport.get_notifs()
            except Exception as exc:
                logger.warning("polling NIXL notifications failed: %s", exc)
                notifs = []
            if notifs:
                try:
                    self._loop.call_soon_threadsafe(handler, notifs)
                except RuntimeError:
                    return
                idle = _NOTIF_MIN_S
            else:
                idle = min(idle * 2, _NOTIF_BUSY_S if self.expecting() else _NOTIF_IDLE_S)
            time.sleep(idle)
