"""The pinned host path for engines whose KV cache is on a GPU.

The engine's ring is a window of the daemon's shared-memory host pool, as for CPU engines, and
the engine page-locks its own mapping of that window with ``cudaHostRegister`` once per
registration. The gather/scatter kernels then move chunks between GPU pages and the slot at
copy-engine speed (a pageable slot would go through the driver's bounce buffers), and the
daemons move DRAM to DRAM with NIXL: the fast path where UCX has no GPUDirect RDMA for VRAM.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from typing import Any

logger = logging.getLogger(__name__)

# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every CUDA context of the process,
# and reachable from kernels through unified addressing (the kernels' direct host path).
_REGISTER_FLAGS = 0x01 | 0x02


def _cudart() -> Any:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("pin_host: pinning the host ring needs a CUDA GPU, and torch sees none")
    return torch.cuda.cudart()


def check_can_pin() -> None:
    """Raises before registration, rather than leaving a registered engine without its mapping."""
    _cudart()


class HostPin:
    """``cudaHostRegister`` over ``[offset, offset + length)`` of a mapping, page-rounded; undone by close()."""

    def __init__(self, mm: mmap.mmap, offset: int, length: int) -> None:
        view = (ctypes.c_char * length).from_buffer(mm, offset)
        addr = ctypes.addressof(view)
        del view  # an export left on the mmap would make closing it fail
        page = mmap.PAGESIZE
        self.addr = addr & ~(page - 1)
        self.length = ((addr + length + page - 1) & ~(page - 1)) - self.addr
        rt = _cudart()
        err = int(rt.cudaHostRegister(self.addr, self.length, _REGISTER_FLAGS))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {self.length} B of the host ring failed (cudaError {err})")
        self._rt: Any = rt
        logger.debug("pinned %d B of the host ring at %#x", self.length, self.addr)

    def close(self) -> None:
        if self._rt is not None:
            err = int(self._rt.cudaHostUnregister(self.addr))
            self._rt = None
            if err != 0:
                logger.warning("cudaHostUnregister of the host ring failed (cudaError %d)", err)


def gpu_ring_for(kv_device: str, gpu_data_path: str, ring_bytes: int) -> Any | None:
    """For an engine with its KV on ``kv_device`` (a CUDA device): a staging ring tensor on that GPU
    when the daemon says VRAM is the fast path, else None (a pinned host ring)."""
    if gpu_data_path != "vram":
        return None
    import torch

    return torch.empty(ring_bytes, dtype=torch.uint8, device=kv_device)
