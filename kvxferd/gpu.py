"""GPU staging rings: import an engine's ring through its CUDA IPC handle, register it with
NIXL as VRAM once, and unmap it when the engine goes away.

CUDA is touched only when the first GPU ring registers, so a CPU-only daemon
never loads it (and `import torch` stays off the start-up path).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvxferd.domain import EngineSpec
from kvxferd.errors import FailedPrecondition, InvalidArgument
from kvxferd.memory import RingAllocator

if TYPE_CHECKING:
    from kvxferd.node import Ring
    from kvxferd.transport import Transport

logger = logging.getLogger(__name__)

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from unified addressing


def make_cuda_importer(transport: Transport) -> Callable[[EngineSpec], Ring]:
    def import_ring(spec: EngineSpec) -> Ring:
        from kvxferd import cuda_ipc
        from kvxferd.node import Ring

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

        def close() -> None:
            try:
                transport.deregister_region(mem.ptr)
            finally:
                mem.close()

        logger.info("imported GPU ring: %d B on %s (device %d)", mem.size, c.device_uuid, mem.device_index)
        return Ring(
            name="", kind="cuda", base_addr=mem.ptr, size=mem.size, pool_offset=0, mem="VRAM",
            device=mem.device_index, alloc=RingAllocator(mem.size), close=close,
        )

    return import_ring


def device_copy(dst: int, src: int, nbytes: int) -> None:
    """Same-node path between two imported GPU rings (or GPU and host): one cudaMemcpy, no NIXL hop."""
    from kvxferd import cuda_ipc

    libs = cuda_ipc._load()
    libs.check(
        libs.cudart.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                               _CUDA_MEMCPY_DEFAULT),
        "cudaMemcpy",
    )
