"""Where an engine's staging ring lives: a CUDA IPC export of a GPU ring, or the daemon's host
pool mapped into this process (received over its pool socket when it has no path)."""

from __future__ import annotations

import json
import mmap
import os
import socket
import stat
from typing import Any

import grpc

from kvxfer_client._pinned import HostPin
from kvxfer_client.errors import KvxferError
from kvxfer_client.types import Registration


def export_ring(ring_tensor: Any) -> dict[str, Any]:
    """CudaIpcRing fields for a contiguous CUDA tensor the engine keeps alive as its staging ring."""
    from kvxfer_protocol.cuda_ipc import export_tensor

    h = export_tensor(ring_tensor)
    return {"handle": h.handle, "device_uuid": h.device_uuid, "offset": h.offset, "size": h.size}


def bytes_tensor(ring_tensor: Any, pool: PoolMapping | None, offset: int, length: int) -> Any:
    """A uint8 torch tensor over [offset, offset+length) of the ring: GPU ring or mapped host ring."""
    import torch

    if ring_tensor is not None:
        flat = ring_tensor.view(torch.uint8).reshape(-1)
        if offset < 0 or offset + length > flat.numel():
            raise ValueError(f"[{offset}, {offset + length}) is outside the {flat.numel()} B GPU ring")
        return flat[offset : offset + length]
    if pool is None:
        raise RuntimeError("this engine has no ring mapped here")
    return torch.frombuffer(pool.view(offset, length), dtype=torch.uint8)


POOL_PROTOCOL = "kvxferd-pool/1"


def receive_pool(reg: Registration, timeout_s: float = 10.0) -> int:
    """The daemon's pool file, received over its pool socket (a pool with no path: see the proto)."""
    instance = reg.engine_id.rpartition("@")[2]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(reg.pool_socket)
            msg, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
        except OSError as exc:
            raise KvxferError(grpc.StatusCode.UNAVAILABLE,
                              f"cannot receive the host pool from {reg.pool_socket}: {exc}") from exc
    try:
        header = json.loads(msg)
    except ValueError:
        header = {}
    if not fds or header.get("protocol") != POOL_PROTOCOL or header.get("instance") != instance \
            or header.get("bytes") != reg.pool_bytes:
        for fd in fds:
            os.close(fd)
        raise KvxferError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{reg.pool_socket} did not hand out this daemon's pool (got {header!r}, want instance "
                          f"{instance!r} of {reg.pool_bytes} B)")
    for extra in fds[1:]:
        os.close(extra)
    os.set_inheritable(fds[0], False)
    return fds[0]


class PoolMapping:
    """The daemon's host pool mapped into this process; the engine's ring is a window of it."""

    def __init__(self, reg: Registration, pin: bool = False) -> None:
        fd = receive_pool(reg) if reg.pool_socket else os.open(reg.pool_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            # Not a file the daemon made (replaced, truncated): refuse now, not SIGBUS on first touch.
            if not stat.S_ISREG(st.st_mode) or st.st_size < reg.pool_bytes:
                raise KvxferError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"host pool {reg.pool_path or reg.pool_socket} is not the daemon's "
                                  f"{reg.pool_bytes} B pool file")
            self._mm = mmap.mmap(fd, reg.pool_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # A GPU engine's host ring: page-locked here so its kernels reach it at copy-engine speed.
        self.pin = HostPin(self._mm, reg.ring_offset, reg.ring_bytes) if pin else None
        self._ring = memoryview(self._mm)[reg.ring_offset : reg.ring_offset + reg.ring_bytes]
        self.ring_bytes = reg.ring_bytes

    def view(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.ring_bytes:
            raise ValueError(f"[{offset}, {offset + length}) is outside this engine's ring of {self.ring_bytes} B")
        return self._ring[offset : offset + length]

    def close(self) -> None:
        if self.pin is not None:
            self.pin.close()
            self.pin = None
        self._ring.release()
        try:
            self._mm.close()
        except BufferError:
            # A caller still holds a view (e.g. a numpy array); the OS unmaps at exit.
            pass
