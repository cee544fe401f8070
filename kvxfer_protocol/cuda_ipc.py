"""Share GPU memory between processes with CUDA IPC handles.

Engines export their staging rings (:func:`export_tensor`); the daemon opens
them once (:func:`open_handle`) and registers the raw device pointer with NIXL.

Nothing here touches CUDA at import time: the runtime library is loaded on the
first export/open, so this module imports fine on CPU-only machines and
handle validation works there too.

Export does not go through ``UntypedStorage._share_cuda_``: that private API
changes its byte format across torch releases and pins the block in torch's
cross-process ref-count "limbo" for as long as a consumer might exist. Instead
the allocation base is read from the driver (``cuMemGetAddressRange``) and
``cudaIpcGetMemHandle`` is called on it. Memory from torch's
``expandable_segments`` allocator is not IPC-exportable this way; CUDA reports
an error that is surfaced as :class:`CudaIpcError`.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "IPC_HANDLE_BYTES",
    "CudaIpcError",
    "CudaIpcHandle",
    "ImportedMemory",
    "device_uuid",
    "export_pointer",
    "export_tensor",
    "open_handle",
]

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_CUDA_IPC_LAZY_ENABLE_PEER_ACCESS = 1
_UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


class CudaIpcError(RuntimeError):
    """CUDA is unavailable here or refused an IPC call."""


def _normalize_uuid(value: str) -> str:
    v = value.strip().lower()
    if v.startswith("gpu-"):
        v = v[4:]
    return f"GPU-{v}"


@dataclass(frozen=True)
class CudaIpcHandle:
    """A device byte range another process can open.

    ``handle`` names the whole ``cudaMalloc`` allocation; the shared range is
    ``[base + offset, base + offset + size)`` of it. ``device_uuid`` (``GPU-…``,
    as nvidia-smi prints it) identifies the GPU independently of
    ``CUDA_VISIBLE_DEVICES`` numbering, which differs between engine and daemon.
    """

    handle: bytes
    device_uuid: str
    size: int
    offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.handle, bytes) or len(self.handle) != IPC_HANDLE_BYTES:
            got = len(self.handle) if isinstance(self.handle, (bytes, bytearray)) else type(self.handle).__name__
            raise ValueError(f"CUDA IPC handle must be {IPC_HANDLE_BYTES} bytes, got {got}")
        if not any(self.handle):
            raise ValueError("CUDA IPC handle is all zeros")
        if not isinstance(self.device_uuid, str):
            raise ValueError(f"device_uuid must be a str, got {type(self.device_uuid).__name__}")
        uuid = _normalize_uuid(self.device_uuid)
        if not _UUID_RE.match(uuid):
            raise ValueError(f"device_uuid {self.device_uuid!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-...)")
        object.__setattr__(self, "device_uuid", uuid)  # canonical form so equal GPUs compare equal
        for name in ("size", "offset"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.size <= 0:
            raise ValueError(f"size must be positive, got {self.size}")
        if self.offset < 0:
            raise ValueError(f"offset must be >= 0, got {self.offset}")


# ---------------------------------------------------------------------------
# lazy CUDA loading


class _CudaLibs:
    def __init__(self, cudart: ctypes.CDLL, cuda: ctypes.CDLL) -> None:
        self.cudart = cudart
        self.cuda = cuda
        cudart.cudaGetErrorString.restype = ctypes.c_char_p
        cudart.cudaGetErrorString.argtypes = [ctypes.c_int]
        cudart.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcMemHandle, ctypes.c_uint]
        cudart.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcMemHandle), ctypes.c_void_p]
        cudart.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        cudart.cudaSetDevice.argtypes = [ctypes.c_int]
        cudart.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        cudart.cudaDeviceCanAccessPeer.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        cudart.cudaDeviceEnablePeerAccess.argtypes = [ctypes.c_int, ctypes.c_uint]
        cuda.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        cuda.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self.cudart.cudaGetErrorString(rc)
            raise CudaIpcError(f"{what} failed: CUDA error {rc} ({msg.decode() if msg else '?'})")

    def check_driver(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self.cuda.cuGetErrorString(rc, ctypes.byref(msg))
            raise CudaIpcError(f"{what} failed: CUDA driver error {rc} ({(msg.value or b'?').decode()})")


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


_libs: _CudaLibs | None = None
_libs_lock = threading.Lock()


def _cudart_candidates() -> list[str]:
    # Prefer the runtime torch already mapped into this process: same version,
    # and it is the one guaranteed to match the installed driver.
    found: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart" in os.path.basename(path) and path not in found:
                    found.append(path)
    except OSError:
        pass
    try:
        import torch

        lib_dirs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
        nvidia = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia")
        lib_dirs += glob.glob(os.path.join(nvidia, "*", "lib"))
        for d in lib_dirs:
            found += sorted(glob.glob(os.path.join(d, "libcudart.so*")), reverse=True)
    except ImportError:
        pass
    found += ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
    return found


def _load() -> _CudaLibs:
    global _libs
    with _libs_lock:
        if _libs is not None:
            return _libs
        try:
            import torch
        except ImportError as exc:
            raise CudaIpcError("CUDA IPC needs torch with CUDA support") from exc
        if not torch.cuda.is_available():
            raise CudaIpcError("CUDA IPC needs a CUDA GPU, but torch.cuda.is_available() is False on this machine")
        torch.cuda.init()  # maps libcudart and creates the primary context we share
        cudart: ctypes.CDLL | None = None
        errors: list[str] = []
        for name in _cudart_candidates():
            try:
                cudart = ctypes.CDLL(name)
                break
            except OSError as exc:
                errors.append(f"{name}: {exc}")
        if cudart is None:
            raise CudaIpcError("could not load libcudart: " + "; ".join(errors[-4:]))
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaIpcError(f"could not load the CUDA driver library: {exc}") from exc
        _libs = _CudaLibs(cudart, cuda)
        logger.debug("cuda_ipc loaded %s", cudart._name)
        return _libs


def _device_index(uuid: str) -> int:
    import torch

    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise CudaIpcError(f"GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?)")


def device_uuid(index: int) -> str:
    """``GPU-…`` UUID of local CUDA device ``index``."""
    import torch

    return _normalize_uuid(str(torch.cuda.get_device_properties(index).uuid))


class _OnDevice:
    """Run runtime calls with ``index`` current, restoring the caller's device."""

    def __init__(self, libs: _CudaLibs, index: int) -> None:
        self._libs, self._index, self._prev = libs, index, ctypes.c_int(-1)

    def __enter__(self) -> None:
        self._libs.check(self._libs.cudart.cudaGetDevice(ctypes.byref(self._prev)), "cudaGetDevice")
        self._libs.check(self._libs.cudart.cudaSetDevice(self._index), "cudaSetDevice")

    def __exit__(self, *exc: object) -> None:
        self._libs.cudart.cudaSetDevice(self._prev.value)


# ---------------------------------------------------------------------------
# export


def export_pointer(ptr: int, size: int, device: int) -> CudaIpcHandle:
    """Export ``size`` bytes at device pointer ``ptr`` on local device ``device``."""
    if ptr <= 0 or size <= 0:
        raise ValueError(f"need a non-null pointer and a positive size, got ptr={ptr:#x} size={size}")
    libs = _load()
    with _OnDevice(libs, device):
        base = ctypes.c_uint64()
        alloc_size = ctypes.c_size_t()
        libs.check_driver(
            libs.cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(alloc_size), ctypes.c_uint64(ptr)),
            "cuMemGetAddressRange",
        )
        offset = ptr - base.value
        if offset + size > alloc_size.value:
            raise ValueError(
                f"range of {size} bytes at offset {offset} overruns its {alloc_size.value}-byte allocation"
            )
        handle = _IpcMemHandle()
        libs.check(
            libs.cudart.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base.value)),
            "cudaIpcGetMemHandle (memory from expandable_segments or cuMemMap cannot be exported)",
        )
    return CudaIpcHandle(
        handle=bytes(handle),  # the struct's raw bytes; field access would stop at the first NUL
        device_uuid=device_uuid(device),
        size=size,
        offset=offset,
    )


def export_tensor(tensor: torch.Tensor) -> CudaIpcHandle:
    """Export a contiguous CUDA tensor's bytes. Keep the tensor alive while peers use it."""
    if tensor.device.type != "cuda":
        raise ValueError(f"can only export CUDA tensors, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("can only export contiguous tensors (the handle describes one byte range)")
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        raise ValueError("cannot export an empty tensor")
    index = tensor.device.index if tensor.device.index is not None else 0
    return export_pointer(tensor.data_ptr(), size, index)


# ---------------------------------------------------------------------------
# import


class ImportedMemory:
    """A peer's device memory mapped into this process. Close exactly once."""

    def __init__(self, libs: _CudaLibs, base: int, handle: CudaIpcHandle, device_index: int,
                 context_device: int | None = None) -> None:
        self._libs = libs
        self._base = base
        # The device whose context holds this mapping (another GPU's for a peer mapping).
        self.context_device = device_index if context_device is None else context_device
        self._lock = threading.Lock()
        self._closed = False
        self.ptr = base + handle.offset
        self.size = handle.size
        self.device_index = device_index
        self.handle = handle

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap (``cudaIpcCloseMemHandle``). Idempotent; pointers and tensors from this become invalid."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with _OnDevice(self._libs, self.context_device):
                self._libs.check(
                    self._libs.cudart.cudaIpcCloseMemHandle(ctypes.c_void_p(self._base)),
                    "cudaIpcCloseMemHandle",
                )

    def as_tensor(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Zero-copy 1-D view of the range (uint8 unless ``dtype`` given). Invalid after close()."""
        import torch

        if self._closed:
            raise CudaIpcError("memory already closed")
        dt = dtype or torch.uint8
        itemsize = torch.empty((), dtype=dt).element_size()
        if self.size % itemsize:
            raise ValueError(f"{self.size} bytes is not a whole number of {dt} elements")
        with torch.cuda.device(self.device_index):
            raw = torch.as_tensor(_CudaArray(self.ptr, self.size), device=f"cuda:{self.device_index}")
        return raw.view(dt)

    def __enter__(self) -> ImportedMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"ImportedMemory(ptr={self.ptr:#x}, size={self.size}, device={self.device_index}, {state})"


class _CudaArray:
    """Minimal __cuda_array_interface__ exporter so torch can wrap a raw pointer."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,  # no "stream" key: callers order access with their own streams/events
            "strides": None,
        }


def open_handle(handle: CudaIpcHandle, context_device: int | None = None) -> ImportedMemory:
    """Map a peer's exported range into this process (must be another process): in the context of
    the GPU that holds it, or with `context_device` in another GPU's context, as a peer mapping
    that GPU's copy engines reach over the peer link (see kvxferd.buffers.gpu_rings.PeerViews)."""
    if not isinstance(handle, CudaIpcHandle):
        raise ValueError(f"expected a CudaIpcHandle, got {type(handle).__name__}")
    libs = _load()
    index = _device_index(handle.device_uuid)
    raw = _IpcMemHandle()
    ctypes.memmove(ctypes.byref(raw), handle.handle, IPC_HANDLE_BYTES)
    base = ctypes.c_void_p()
    with _OnDevice(libs, index if context_device is None else context_device):
        libs.check(
            libs.cudart.cudaIpcOpenMemHandle(ctypes.byref(base), raw, _CUDA_IPC_LAZY_ENABLE_PEER_ACCESS),
            "cudaIpcOpenMemHandle",
        )
    if not base.value:
        raise CudaIpcError("cudaIpcOpenMemHandle returned a null pointer")
    return ImportedMemory(libs, base.value, handle, index, context_device)
