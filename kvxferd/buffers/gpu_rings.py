"""GPU staging rings: import an engine's ring through its CUDA IPC handle, register it with
NIXL as VRAM once, and unmap it when the engine goes away.

CUDA is touched only when the first GPU ring registers, so a CPU-only daemon
never loads it (and `import torch` stays off the start-up path).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvxferd.buffers.host_pool import RingAllocator
from kvxferd.core.engines import Ring
from kvxferd.core.types import EngineSpec
from kvxferd.errors import FailedPrecondition, InvalidArgument
from kvxferd.transports.interface import Transport

if TYPE_CHECKING:
    from kvxfer_protocol.cuda_ipc import _CudaLibs

logger = logging.getLogger(__name__)

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from unified addressing


def make_cuda_importer(transport: Transport) -> Callable[[EngineSpec], Ring]:
    def import_ring(spec: EngineSpec) -> Ring:
        from kvxfer_protocol import cuda_ipc

        assert spec.cuda_ring is not None
        c = spec.cuda_ring
        try:
            handle = cuda_ipc.CudaIpcHandle(handle=c.handle, device_uuid=c.device_uuid, size=c.size, offset=c.offset)
        except ValueError as exc:
            raise InvalidArgument(f"cuda_ring: {exc}") from exc
        try:
            mem = cuda_ipc.open_handle(handle)
        except cuda_ipc.CudaIpcError as exc:
            raise FailedPrecondition(f"cannot open the engine's CUDA IPC ring: {exc}") from exc
        try:
            transport.register_region(mem.ptr, mem.size, "VRAM", mem.device_index)
        except Exception as exc:
            mem.close()
            raise FailedPrecondition(f"cannot register the GPU ring with NIXL: {exc}") from exc

        peer_views.add(mem.ptr, mem.size, handle, mem.device_index)

        def close() -> None:
            try:
                peer_views.remove(mem.ptr)
                transport.deregister_region(mem.ptr)
            finally:
                mem.close()

        logger.info("imported GPU ring: %d B on %s (device %d)", mem.size, c.device_uuid, mem.device_index)
        return Ring(
            name="", kind="cuda", base_addr=mem.ptr, size=mem.size, pool_offset=0, mem="VRAM",
            device=mem.device_index, alloc=RingAllocator(mem.size), close=close,
        )

    return import_ring


_CUDA_STREAM_NON_BLOCKING = 1
_CUDA_PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_streams = threading.local()

# How a same-node copy moves, the `path` label of kvxferd_transfer_bytes_total for it.
LINK_HOST = "local"  # host pool to host pool: memmove in the worker
LINK_SAME_GPU = "local-gpu"  # both rings on one GPU
LINK_PEER = "local-p2p"  # two GPUs with peer access (NVLink or PCIe peer DMA)
LINK_STAGED = "local-staged"  # two GPUs without peer access: the driver bounces through host memory
LINK_HOST_GPU = "local-host-gpu"  # a pinned host ring and a GPU ring


def copy_link(src_mem: str, src_device: int, dst_mem: str, dst_device: int,
              can_access_peer: Callable[[int, int], bool]) -> str:
    """Which of the links above a same-node copy takes (pure: `can_access_peer` answers for CUDA)."""
    if src_mem != "VRAM" and dst_mem != "VRAM":
        return LINK_HOST
    if src_mem != "VRAM" or dst_mem != "VRAM":
        return LINK_HOST_GPU
    if src_device == dst_device:
        return LINK_SAME_GPU
    both = can_access_peer(src_device, dst_device) and can_access_peer(dst_device, src_device)
    return LINK_PEER if both else LINK_STAGED


class _PeerAccess:
    """Peer access between this process's GPU contexts, enabled once per pair of devices.

    The rings were imported with cudaIpcMemLazyEnablePeerAccess, so once a device's context has
    peer access to another, the other's imported rings are mapped into it too; without peer
    access a copy between two GPUs still works but the driver stages it through host memory
    (LINK_STAGED), at PCIe-to-host speed instead of NVLink's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._links: dict[tuple[int, int], str] = {}

    def link(self, src_mem: str, src_device: int, dst_mem: str, dst_device: int) -> str:
        if src_mem != "VRAM" or dst_mem != "VRAM" or src_device == dst_device:
            return copy_link(src_mem, src_device, dst_mem, dst_device, _never)
        key = (min(src_device, dst_device), max(src_device, dst_device))
        got = self._links.get(key)
        if got is None:
            with self._lock:
                got = self._links.get(key)
                if got is None:
                    got = self._links[key] = self._enable(*key)
        return got

    def _enable(self, a: int, b: int) -> str:
        from kvxfer_protocol import cuda_ipc

        libs = cuda_ipc._load()
        rt = libs.cudart

        def can(x: int, y: int) -> bool:
            flag = ctypes.c_int(0)
            libs.check(rt.cudaDeviceCanAccessPeer(ctypes.byref(flag), x, y), "cudaDeviceCanAccessPeer")
            return bool(flag.value)

        link = copy_link("VRAM", a, "VRAM", b, can)
        if link == LINK_PEER:
            prev = ctypes.c_int(0)
            libs.check(rt.cudaGetDevice(ctypes.byref(prev)), "cudaGetDevice")
            try:
                for x, y in ((a, b), (b, a)):
                    libs.check(rt.cudaSetDevice(x), "cudaSetDevice")
                    rc = rt.cudaDeviceEnablePeerAccess(y, 0)
                    if rc == _CUDA_PEER_ACCESS_ALREADY_ENABLED:
                        rt.cudaGetLastError()  # not an error here; clear it so no later check sees it
                    else:
                        libs.check(rc, f"cudaDeviceEnablePeerAccess({x} -> {y})")
            finally:
                rt.cudaSetDevice(prev.value)
        logger.info("GPU %d <-> GPU %d: same-node copies take %s", a, b, link)
        return link

    def known(self) -> dict[tuple[int, int], str]:
        """The device pairs met so far and their link (for status)."""
        return dict(self._links)


def _never(_a: int, _b: int) -> bool:
    return False


peer_access = _PeerAccess()


def gpu_links() -> list[str]:
    """The GPU pairs same-node copies have run between and their link, for status."""
    return [f"GPU {a} <-> GPU {b}: {link}" for (a, b), link in sorted(peer_access.known().items())]


class PeerViews:
    """The GPU rings this daemon imported, by address, each also mapped into another GPU's context
    when a copy from that GPU first needs it (and unmapped with the ring).

    Measured on two H200s joined by NVLink (bench/results/gpu-p2p-h200x2.json): a copy between two
    rings imported by CUDA IPC, each mapped in its own GPU's context, ran at 37 GB/s however it was
    issued (cudaMemcpyAsync on either GPU's stream, cudaMemcpyPeerAsync), peer access enabled; with
    the destination ring mapped a second time in the source GPU's context, 385 GB/s (torch's
    cudaMemcpyPeer between two tensors: 352 GB/s). So a cross-GPU copy writes through that mapping.
    """

    def __init__(self, opener: Callable[[Any, int], Any] | None = None) -> None:
        self._open = opener or _open_in_context
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted ring addresses
        self._rings: dict[int, tuple[int, Any, int]] = {}  # address -> (size, IPC handle, device)
        # (ring address, context device) -> mapping, or None where it could not be made
        self._views: dict[tuple[int, int], Any] = {}

    def add(self, addr: int, size: int, handle: Any, device: int) -> None:
        with self._lock:
            bisect.insort(self._starts, addr)
            self._rings[addr] = (size, handle, device)

    def remove(self, addr: int) -> None:
        """Forgets a ring and unmaps its views (the ring's own mapping is its owner's to close)."""
        with self._lock:
            if self._rings.pop(addr, None) is None:
                return
            self._starts.remove(addr)
            views = [self._views.pop(k) for k in [k for k in self._views if k[0] == addr]]
        for v in filter(None, views):
            try:
                v.close()
            except Exception as exc:  # the ring is going anyway: say so, do not fail its release
                logger.warning("unmapping a peer view of the GPU ring at 0x%x failed: %s", addr, exc)

    def handle_of(self, addr: int) -> Any:
        """The engine's IPC handle of the imported ring starting at `addr` (None: no such ring)."""
        with self._lock:
            got = self._rings.get(addr)
        return None if got is None else got[1]

    def translate(self, addr: int, length: int, device: int) -> int:
        """[addr, addr + length) as `device`'s context sees it: through its mapping of the imported
        ring holding the range when that ring is on another GPU, else `addr` itself."""
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return addr
            start = self._starts[i]
            size, handle, home = self._rings[start]
            if home == device or addr + length > start + size:
                return addr
            key = (start, device)
            if key not in self._views:
                try:
                    self._views[key] = self._open(handle, device)
                    logger.info("GPU ring at 0x%x (GPU %d) mapped into GPU %d's context for peer copies",
                                start, home, device)
                except Exception as exc:
                    # The copy still works through the ring's own mapping, only slower: say so once.
                    self._views[key] = None
                    logger.warning("cannot map the GPU ring at 0x%x (GPU %d) into GPU %d's context (%s): "
                                   "copies into it from GPU %d go through its own mapping, about a tenth "
                                   "of the peer link's speed", start, home, device, exc, device)
            view = self._views[key]
            return addr if view is None else int(view.ptr) + (addr - start)

    def __len__(self) -> int:
        return len(self._rings)


def _open_in_context(handle: Any, device: int) -> Any:
    from kvxfer_protocol import cuda_ipc

    return cuda_ipc.open_handle(handle, context_device=device)


peer_views = PeerViews()


def _stream(libs: _CudaLibs, device: int) -> ctypes.c_void_p:
    """This thread's copy stream on `device` (made current first: a stream belongs to the device
    current when it is created)."""
    per_device: dict[int, ctypes.c_void_p] | None = getattr(_streams, "by_device", None)
    if per_device is None:
        per_device = _streams.by_device = {}
    stream = per_device.get(device)
    if stream is None:
        # The highest priority the GPU offers: engines' kernels on the same GPU otherwise go first and
        # a copy waited behind them (one H100: a 64 MiB job's wait was ~160 us over its 75 us of GPU
        # time with the engines on that GPU, ~86 us with them on another). Copies are short; a
        # chunk waiting for one holds the reader's time to first token.
        least, greatest = ctypes.c_int(), ctypes.c_int()
        libs.check(libs.cudart.cudaDeviceGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
                   "cudaDeviceGetStreamPriorityRange")
        stream = ctypes.c_void_p()
        libs.check(libs.cudart.cudaStreamCreateWithPriority(ctypes.byref(stream), _CUDA_STREAM_NON_BLOCKING,
                                                            greatest), "cudaStreamCreateWithPriority")
        per_device[device] = stream
    return stream


def _events(libs: _CudaLibs, device: int, n: int) -> list[ctypes.c_void_p]:
    """At least `n` of this thread's timing events on `device` (reused: an event may be recorded again
    once waited for)."""
    per_device: dict[int, list[ctypes.c_void_p]] | None = getattr(_streams, "events", None)
    if per_device is None:
        per_device = _streams.events = {}
    evs = per_device.setdefault(device, [])
    while len(evs) < n:
        ev = ctypes.c_void_p()
        libs.check(libs.cudart.cudaEventCreate(ctypes.byref(ev)), "cudaEventCreate")
        evs.append(ev)
    return evs


@functools.cache
def _no_gil_release(name: str) -> ctypes.PyDLL:
    """libcudart again, through PyDLL: its calls keep the GIL. ctypes.CDLL drops and retakes the GIL
    around every call, and in a daemon whose other threads run Python, retaking it can wait up to
    the interpreter's switch interval (5 ms): per job that was GetDevice, SetDevice, one launch per
    pair, the wait and SetDevice again. Only the waits below, which block, go through the CDLL."""
    lib = ctypes.PyDLL(name)
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cudaEventQuery.argtypes = [ctypes.c_void_p]
    lib.cudaEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
    lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.cudaSetDevice.argtypes = [ctypes.c_int]
    return lib


# How long a wait for a job's event polls it holding the GIL before it blocks in cudaEventSynchronize
# (GIL released). Retaking the GIL after the block cost ~90 us a job on a busy daemon (H100 box, the
# 64 MiB jobs' wait less their GPU time across two GPUs, where no engine kernel shares the GPU); a
# poll keeps the GIL from the other threads for at most this long, and they take it at the next
# switch interval anyway.
_SPIN_S = 0.0003
_CUDA_ERROR_NOT_READY = 600


def _wait(libs: _CudaLibs, fast: ctypes.PyDLL, event: ctypes.c_void_p) -> None:
    deadline = time.perf_counter() + _SPIN_S
    while time.perf_counter() < deadline:
        rc = fast.cudaEventQuery(event)
        if rc != _CUDA_ERROR_NOT_READY:
            libs.check(rc, "cudaEventQuery")
            return
    libs.check(libs.cudart.cudaEventSynchronize(event), "cudaEventSynchronize")


def device_copies(pairs: Sequence[tuple[int, int, int]], src_mem: str = "VRAM", src_device: int = 0,
                  dst_mem: str = "VRAM", dst_device: int = 0) -> str:
    """Same-node path between two imported GPU rings (or GPU and host): every (src, dst, length)
    pair of a job queued on this thread's stream of the device that drives the copy, then one
    wait for them all. Returns the link it took (LINK_*).

    One synchronous ``cudaMemcpy`` per pair on the legacy default stream (the earlier form) paid a
    launch and a full wait per descriptor, and a zero-copy job has one per layer, K/V and run of
    slots; the legacy stream also serialised every worker's copies with each other. Between two
    GPUs the source GPU's copy engines push over the peer link into the destination ring's mapping
    in the source GPU's context (PeerViews).
    """
    return device_copy_batch([pairs], src_mem, src_device, dst_mem, dst_device)[0]


def device_copy_batch(jobs: Sequence[Sequence[tuple[int, int, int]]], src_mem: str = "VRAM", src_device: int = 0,
                      dst_mem: str = "VRAM", dst_device: int = 0,
                      each: Callable[[int, float], None] | None = None) -> tuple[str, int]:
    """Several jobs' pairs (see device_copies) queued back to back on this thread's stream, an event
    after each job; then each job's event is waited for in order and ``each(i, gpu_ms)`` called as
    soon as job i's bytes are there (its notification goes while the next job still copies), with
    the GPU time of job i's copies alone. One launch burst and one stream for a worker's queued jobs:
    jobs of several threads on one GPU only shared its bandwidth, each job then taking longer.
    Returns (link, nanoseconds spent launching)."""
    from kvxfer_protocol import cuda_ipc

    link = peer_access.link(src_mem, src_device, dst_mem, dst_device)
    if link == LINK_PEER:
        jobs = [[(src, peer_views.translate(dst, n, src_device), n) for src, dst, n in pairs] for pairs in jobs]
    libs = cuda_ipc._load()
    fast = _no_gil_release(libs.cudart._name)
    device = src_device if src_mem == "VRAM" else dst_device
    prev = ctypes.c_int(-1)
    libs.check(fast.cudaGetDevice(ctypes.byref(prev)), "cudaGetDevice")
    if prev.value != device:
        libs.check(fast.cudaSetDevice(device), "cudaSetDevice")
    try:
        stream = _stream(libs, device)
        evs = _events(libs, device, len(jobs) + 1)
        t0 = time.perf_counter_ns()
        libs.check(fast.cudaEventRecord(evs[0], stream), "cudaEventRecord")
        # A host side is this process's pageable memory (engines pin their own mappings only): CUDA
        # then copies inside the call, which must not hold the GIL meanwhile.
        slow = src_mem != "VRAM" or dst_mem != "VRAM"
        for i, pairs in enumerate(jobs):
            for src, dst, nbytes in pairs:
                if slow:
                    rc = libs.cudart.cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                                                     _CUDA_MEMCPY_DEFAULT, stream)
                else:
                    rc = fast.cudaMemcpyAsync(dst, src, nbytes, _CUDA_MEMCPY_DEFAULT, stream)
                libs.check(rc, "cudaMemcpyAsync")
            libs.check(fast.cudaEventRecord(evs[i + 1], stream), "cudaEventRecord")
        launch_ns = time.perf_counter_ns() - t0
        ms = ctypes.c_float()
        for i in range(len(jobs)):
            _wait(libs, fast, evs[i + 1])
            if each is not None:
                libs.check(fast.cudaEventElapsedTime(ctypes.byref(ms), evs[i], evs[i + 1]), "cudaEventElapsedTime")
                each(i, ms.value)
    finally:
        if prev.value != device and prev.value >= 0:
            fast.cudaSetDevice(prev.value)
    return link, launch_ns


def gpu_data_path(setting: str) -> str:
    """What GPU engines should use on this daemon: "vram" or "host" (``data_path`` config)."""
    if setting != "auto":
        return setting
    return "vram" if vram_over_nixl()[0] else "host"


@functools.cache
def vram_over_nixl(sys_root: str = "/sys") -> tuple[bool, str]:
    """Whether NIXL/UCX can move VRAM at network speed from this node, and why; probed once.

    VRAM is fast over UCX only with GPUDirect RDMA: an RDMA device, the NVIDIA peer-memory module
    that lets the NIC reach GPU memory, and UCX's CUDA transport. Without them UCX moves VRAM over
    TCP through host bounce buffers (0.20-0.27 GB/s measured on an H200 box, against ~5 GB/s
    DRAM to DRAM), so the pinned host path is the fast one. Reads files only: no CUDA, no NIXL.

    Two daemons on one host get no CUDA IPC from UCX either: its cuda_ipc transport exports the
    registered range with cuIpcGetMemHandle, which refuses a range that was itself imported by
    CUDA IPC (the daemon's rings: the engine owns the allocation), so UCX falls back to TCP
    (0.34-0.45 GB/s; 60 GB/s for memory the process cudaMalloc'd itself, two H200s:
    bench/results/gpu-p2p-h200x2.json).
    """
    ok, why = _probe_vram(Path(sys_root))
    logger.info("VRAM over NIXL %s: %s", "is fast" if ok else "is slow here, GPU engines use pinned host rings", why)
    return ok, why


def _probe_vram(root: Path) -> tuple[bool, str]:
    rdma = sorted(p.name for p in (root / "class" / "infiniband").glob("*"))
    if not rdma:
        return False, "no RDMA device (/sys/class/infiniband is empty)"
    if not any((root / "module" / m).exists() for m in ("nvidia_peermem", "nv_peer_mem")):
        return False, f"RDMA devices {rdma} but no GPUDirect peer-memory module (nvidia_peermem)"
    if not _ucx_has_cuda():
        return False, "UCX has no CUDA transport module (libuct_cuda)"
    return True, f"GPUDirect RDMA: {rdma} with nvidia_peermem and UCX's CUDA transport"


def _ucx_has_cuda() -> bool:
    # UCX loads its transports as modules from a directory next to the NIXL build that bundles it.
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            continue
        site = Path(spec.origin).parent.parent
        if any(site.glob(f"{name}.libs/ucx/libuct_cuda.so*")) or any(site.glob(f"{name}/**/libuct_cuda.so*")):
            return True
    return any(Path(d).glob("libuct_cuda.so*") for d in ("/usr/lib/ucx", "/usr/lib64/ucx", "/usr/local/lib/ucx"))
