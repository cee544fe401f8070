"""Two daemons on one host move VRAM by CUDA IPC, not through UCX (issue #38).

Why not UCX: its cuda_ipc transport exports the range a daemon registered with cuIpcGetMemHandle,
and CUDA refuses to export memory that was itself imported by IPC (a daemon's GPU rings are its
engines' allocations), so UCX falls back to TCP: 0.33 GB/s between two daemons on one H100, where
a device copy runs at ~1,300 GB/s. Re-exporting is impossible, but the decode daemon still holds
the reader ENGINE's own handle, and any process of the host may open that. So the decode daemon
passes it on with each credit on a GPU ring (Credit.local), the prefill daemon opens it once per
ring, copies device to device into it (kvxferd.buffers.gpu_rings.device_copies) and then sends the chunk's
notification alone over NIXL (a standalone notification: the decode side's receive path, credits,
tokens and coverage, is the one every WRITE takes).

Same host, proven: each handshake carries a host tag, an HMAC-SHA256 keyed by the kernel's boot id
(/proc/sys/kernel/random/boot_id: 122 random bits per boot, readable only by processes on this
kernel, containers included) over the sender's daemon id and instance and the receiver's instance.
A peer with our kernel computes the same tag; a remote peer never sees the boot id, only tags
bound to its own instance, so it can neither forge nor replay one (instances are random per start,
and the tag names the receiver). Tags count only in an authenticated handshake (host secret,
shared secret or mTLS): handles go to a proven same-host peer that proved who it is, and a peer's
handles are used only when it proved the same. A handle is no use off this host anyway.

Lifetime: a mapping is opened on the first copy into its ring and closed when the last credit of
that ring this daemon holds is gone (returned, revoked, or the peer lost): the credit fence
already waits for every copy into it. If opening fails (the GPU is not visible here, CUDA
refuses), that ring goes over NIXL, with one warning.

Per job: a worker takes every local-ipc job queued for the same pair of GPUs at once (they all go to
the thread already copying for that pair: copies of several threads on one GPU only split its
bandwidth), queues their copies back to back on its stream with an event after each, and notifies
each job as soon as its event fires, while the next job still copies (copy_batch). `stats` splits
where a job's time goes (GPU copy, launch, waiting, notification) and is logged with each
mapping closed (tests/gpu/test_gpu_local_ipc.py reads it). Measured (bench/results/local-ipc-ab-gpu-2026-11-28.json):
64 MiB jobs across two GPUs at 0.57-0.68 of cudaMemcpyPeer (0.31 before), but 0.12-0.13 of a device
copy on one GPU, where engines share the GPU: processes' CUDA contexts time-slice a GPU, so the
daemon's copy waits for its slice while an engine's kernels run (bench/device/ctx_share_probe.py:
~2.4 ms for a 50 us copy next to a busy process on that GPU). MPS, or a copy issued by an engine
process itself, avoids that wait; nothing in this process can.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvxferd.buffers.gpu_rings import device_copy_batch, peer_access, peer_views
from kvxferd.core.peer_port import CreditSpec, LocalRing

logger = logging.getLogger(__name__)

PATH_IPC = "local-ipc"  # kvxferd_transfer_bytes_total{path} and PeerInfo.path
BOOT_ID = "/proc/sys/kernel/random/boot_id"
_TAG_LABEL = b"kvxferd same-host/1"


@functools.cache
def boot_id(path: str = BOOT_ID) -> bytes:
    try:
        return Path(path).read_bytes().strip()
    except OSError:
        return b""  # no /proc: no tag, never a same-host peer


def host_tag(sender_id: str, sender_instance: str, receiver_instance: str, key: bytes | None = None) -> bytes:
    """The tag this host's processes compute for that sender and receiver (b"" without a boot id)."""
    k = boot_id() if key is None else key
    if not k:
        return b""
    msg = b"\0".join([_TAG_LABEL, sender_id.encode(), sender_instance.encode(), receiver_instance.encode()])
    return hmac.new(k, msg, hashlib.sha256).digest()


class _Ref(Protocol):
    """Who a tag names: a DaemonRef, its protobuf, or this daemon's Identity."""

    @property
    def daemon_id(self) -> str: ...

    @property
    def instance_id(self) -> str: ...


class SameHost:
    """Peer instances that proved they run on this host in an authenticated handshake."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key
        self._lock = threading.Lock()
        self._proven: set[tuple[str, str]] = set()
        self._ipc: set[tuple[str, str]] = set()  # of those, the ones rings went to or came from

    def tag(self, sender: _Ref, receiver_instance: str) -> bytes:
        return host_tag(sender.daemon_id, sender.instance_id, receiver_instance, self._key)

    def check(self, tag: bytes, sender: _Ref, receiver_instance: str, authenticated: bool) -> bool:
        """Records whether that peer instance is on this host; an unauthenticated one never is."""
        want = self.tag(sender, receiver_instance)
        sender_id, sender_instance = sender.daemon_id, sender.instance_id
        ok = authenticated and bool(tag) and bool(want) and hmac.compare_digest(tag, want)
        with self._lock:
            if ok:
                self._proven.add((sender_id, sender_instance))
            else:
                self._proven.discard((sender_id, sender_instance))
        if ok:
            logger.info("peer %s is on this host: GPU rings go to it as CUDA IPC handles", sender_id)
        return ok

    def __call__(self, daemon_id: str, instance: str) -> bool:
        return (daemon_id, instance) in self._proven

    def used(self, daemon_id: str, instance: str) -> None:
        with self._lock:
            self._ipc.add((daemon_id, instance))

    def path(self, daemon_id: str, instance: str) -> str:
        """The peer's path for status: local-ipc once GPU rings went either way by IPC, else nixl."""
        return PATH_IPC if (daemon_id, instance) in self._ipc else "nixl"


same_host = SameHost()


@dataclass(frozen=True)
class IpcLane:
    """The merge key of a local-ipc job: jobs of one lane (whatever their room) share a thread and a
    launch burst, never a notification."""

    local_device: int
    remote_device: int


class _Job(Protocol):
    """What copy_batch needs of a worker's TransferJob."""

    remote: str
    pairs: Sequence[tuple[int, int, int]]
    notif: bytes
    nbytes: int
    local_mem: str
    remote_mem: str
    local_device: int
    remote_device: int
    posted_at: float
    finished_at: float


class IpcStats:
    """Where local-ipc jobs' time went, summed since start (nanoseconds): `gpu` the copies themselves
    (CUDA events), `launch` queueing them, `wait` blocked until a job's bytes were there, `notify`
    NIXL's genNotif, `job` what kvxferd_chunk_transfer_seconds counts (the batch's wall time, each
    job from the previous job's end)."""

    FIELDS = ("jobs", "batches", "bytes", "gpu_ns", "launch_ns", "wait_ns", "notify_ns", "job_ns")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums = dict.fromkeys(self.FIELDS, 0)

    def add(self, **values: int) -> None:
        with self._lock:
            for k, v in values.items():
                self._sums[k] += v

    def line(self) -> str:
        with self._lock:
            return "local-ipc copies so far: " + " ".join(f"{k}={v}" for k, v in self._sums.items())


stats = IpcStats()


def copy_batch(jobs: Sequence[_Job], notify: Callable[[str, bytes], None]) -> list[tuple[Any, str, bool]]:
    """Copies `jobs` (one lane, in queue order) and notifies each once its bytes are there; returns
    (job, error or "", whether the error is the transport's) per job, with posted_at and finished_at
    set: from the end of the previous job (the batch's start for the first) to its notification."""
    first, out = jobs[0], []
    start = last = time.monotonic()
    gpu_ns = wait_ns = notify_ns = 0

    def done(i: int, gpu_ms: float) -> None:
        nonlocal last, gpu_ns, wait_ns, notify_ns
        job, t = jobs[i], time.monotonic()
        wait_ns += int((t - last) * 1e9)
        gpu_ns += int(gpu_ms * 1e6)
        try:
            notify(job.remote, job.notif)
            err = ""
        except Exception as exc:
            err = f"notification after a CUDA IPC copy: {exc}"
        job.posted_at, job.finished_at = last, time.monotonic()
        notify_ns += int((job.finished_at - t) * 1e9)
        last = job.finished_at
        out.append((job, err, bool(err)))

    try:
        _, launch_ns = device_copy_batch([j.pairs for j in jobs], first.local_mem, first.local_device,
                                         first.remote_mem, first.remote_device, done)
    except Exception as exc:
        launch_ns, now = 0, time.monotonic()
        for job in jobs[len(out):]:
            job.posted_at, job.finished_at = last, now
            out.append((job, f"local copy failed: {exc}", False))
    stats.add(jobs=len(jobs), batches=1, bytes=sum(j.nbytes for j in jobs), gpu_ns=gpu_ns, launch_ns=launch_ns,
              wait_ns=wait_ns - launch_ns, notify_ns=notify_ns, job_ns=int((last - start) * 1e9))
    return out


def ring_for(peer_id: str, peer_instance: str, mem: str, base_addr: int, size: int) -> LocalRing | None:
    """Decode side: what a credit on this ring carries for that peer (None: the peer writes over NIXL)."""
    if mem != "VRAM" or not same_host(peer_id, peer_instance):
        return None
    h = peer_views.handle_of(base_addr)
    if h is None:
        return None
    same_host.used(peer_id, peer_instance)
    return LocalRing(h.handle, h.device_uuid, size, h.offset, base_addr)


def valid_local(spec: CreditSpec) -> bool:
    """A credit's window lies inside the ring it names (else the ring is ignored: NIXL then)."""
    loc = spec.local
    return (loc is not None and len(loc.handle) == 64 and loc.size > 0
            and loc.base <= spec.address and spec.address + spec.length <= loc.base + loc.size)


def _open(loc: LocalRing, device: int | None) -> Any:
    from kvxfer_protocol import cuda_ipc

    h = cuda_ipc.CudaIpcHandle(handle=loc.handle, device_uuid=loc.device_uuid, size=loc.size, offset=loc.offset)
    if device is not None and (home := cuda_ipc._device_index(h.device_uuid)) != device:
        # The ring is mapped into the copying GPU's context (as PeerViews does: 360 GB/s over NVLink
        # where a copy between two contexts' mappings ran at 37): peer access between the two first.
        peer_access.link("VRAM", device, "VRAM", home)
    return cuda_ipc.open_handle(h, context_device=device)


_Key = tuple[bytes, int, int]  # (handle, offset in the allocation, context device or -1)


class IpcViews:
    """Prefill side: peers' GPU rings opened here, one mapping per ring (and copying GPU), kept
    while a credit of the ring is held."""

    def __init__(self, opener: Callable[[LocalRing, int | None], Any] | None = None) -> None:
        self._open = opener or _open
        self._lock = threading.Lock()
        self._views: dict[_Key, Any] = {}  # None where opening failed (NIXL for that ring)
        self._credits: dict[_Key, set[int]] = {}

    def route(self, pairs: Sequence[tuple[int, int, int]], credits: Sequence[CreditSpec], local_mem: str,
              local_device: int) -> tuple[list[tuple[int, int, int]], int] | None:
        """`pairs` with each destination as this process sees it, and the device the copy runs on;
        None when any destination's ring cannot be reached here (the job goes over NIXL)."""
        if not credits or any(c.local is None for c in credits):
            return None
        ctx = local_device if local_mem == "VRAM" else None  # a GPU source copies through its own context
        out, device = [], local_device
        for src, dst, n in pairs:
            c = next((c for c in credits if c.address <= dst and dst + n <= c.address + c.length), None)
            if c is None or c.local is None:
                return None
            view = self._view(c, ctx)
            if view is None:
                return None
            out.append((src, int(view.ptr) + (dst - c.local.base), n))
            device = local_device if ctx is not None else int(view.device_index)
        return out, device

    def _view(self, c: CreditSpec, ctx: int | None) -> Any:
        loc = c.local
        assert loc is not None
        key = (loc.handle, loc.offset, -1 if ctx is None else ctx)
        with self._lock:
            self._credits.setdefault(key, set()).add(c.id)
            if key in self._views:
                return self._views[key]
            try:
                view = self._open(loc, ctx)
                logger.info("ring %s of a peer on this host (%s) opened by CUDA IPC: copies go device to device",
                            c.ring, loc.device_uuid)
            except Exception as exc:
                view = None
                logger.warning("ring %s of a peer on this host (%s): cannot open its CUDA IPC handle (%s); "
                               "chunks for it go over NIXL", c.ring, loc.device_uuid, exc)
            self._views[key] = view
            return view

    def forget(self, spec: CreditSpec) -> None:
        """A credit is gone from this daemon (no copy into it in flight): the last one of a ring
        closes the ring's mapping."""
        if spec.local is None:
            return
        closing = []
        with self._lock:
            for key in [k for k, ids in self._credits.items() if spec.id in ids]:
                ids = self._credits[key]
                ids.discard(spec.id)
                if not ids:
                    del self._credits[key]
                    closing.append(self._views.pop(key, None))
        for view in filter(None, closing):
            try:
                view.close()
                logger.info("ring %s of a peer on this host: CUDA IPC mapping closed (no credit of it held); %s",
                            spec.ring, stats.line())
            except Exception as exc:  # the credit is gone either way
                logger.warning("ring %s of a peer on this host: closing its CUDA IPC mapping failed: %s",
                               spec.ring, exc)

    def __len__(self) -> int:
        return sum(1 for v in self._views.values() if v is not None)


views = IpcViews()
