"""The data mover's interface: what a transport does, its handles and errors.

`kvxferd.transports.nixl.NixlTransport` is the real one (one NIXL agent per daemon, UCX
backend). `LocalTransport`, here, copies in-process with ctypes.memmove and exists for unit
tests only. `FaultInjector` lets tests make posts end in ERROR without moving bytes.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

logger = logging.getLogger(__name__)


class XferState(enum.Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    ERROR = "ERROR"


class TransportError(RuntimeError):
    """A transport call failed; the message says which call, which peer and why."""


@runtime_checkable
class Transport(Protocol):
    name: str  # this agent's name

    def register_region(self, addr: int, length: int, mem: str = "DRAM", device: int = 0) -> None: ...

    def deregister_region(self, addr: int) -> None: ...

    def metadata(self) -> bytes: ...
    def add_remote(self, metadata: bytes) -> str: ...

    def remove_remote(self, name: str) -> None: ...

    def reconnect(self, name: str, metadata: bytes) -> str: ...

    def post_write(self, remote: str, pairs: Sequence[tuple[int, int, int]], notif: bytes,
                   local_mem: str = "DRAM", remote_mem: str = "DRAM",
                   local_device: int = 0, remote_device: int = 0) -> object: ...

    def check(self, handle: object) -> XferState: ...

    def release(self, handle: object) -> None: ...

    def get_notifs(self) -> list[tuple[str, bytes]]: ...

    def close(self) -> None: ...


# (remote, pairs, notif) -> True to make that post fail.
FaultPredicate = Callable[[str, Sequence[tuple[int, int, int]], bytes], bool]


class FaultInjector:
    """Test hook: makes chosen post_write calls produce a handle whose check() is ERROR.

    A failed post moves no bytes and sends no notification, like a WRITE that NIXL reports
    as ERR. Safe to arm from one thread while workers post from others.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._matching: list[list[Any]] = []  # [predicate, remaining or None]
        # `break_pair`: the next post breaks its peer's connection (every later post to it fails)
        # until the connection is rebuilt (reconnect) once `_cause_until` (monotonic) has passed.
        self._break_next = False
        self._cause_until = 0.0
        self._broken: set[str] = set()

    def fail_next(self, n: int = 1) -> None:
        """The next n posts (on any peer) fail."""
        if n < 0:
            raise ValueError("n must be >= 0")
        with self._lock:
            self._next += n

    def fail_matching(self, predicate: FaultPredicate, times: int | None = None) -> None:
        """Posts for which predicate(remote, pairs, notif) is true fail; `times` of them, or all until clear()."""
        if times is not None and times <= 0:
            raise ValueError("times must be positive or None")
        with self._lock:
            self._matching.append([predicate, times])

    def clear(self) -> None:
        with self._lock:
            self._next = 0
            self._matching.clear()
            self._break_next = False
            self._broken.clear()

    def break_pair(self, cause_s: float) -> None:
        """The next post breaks its peer's connection for good, as NIXL_ERR_REMOTE_DISCONNECT did in
        the field: every later post to that peer fails until its connection is rebuilt, and a
        rebuild fails while the cause lasts (`cause_s` from now)."""
        with self._lock:
            self._break_next = True
            self._cause_until = time.monotonic() + cause_s

    def broken(self, remote: str) -> bool:
        return remote in self._broken

    def rebuilt(self, remote: str) -> None:
        """A rebuild of `remote`'s connection: refused (TransportError) while the cause lasts."""
        with self._lock:
            if remote in self._broken and time.monotonic() < self._cause_until:
                raise TransportError(f"reconnecting to {remote} failed: NIXL_ERR_REMOTE_DISCONNECT (injected: the "
                                     f"cause is still there)")
            self._broken.discard(remote)

    @property
    def armed(self) -> bool:
        with self._lock:
            return self._next > 0 or bool(self._matching) or self._break_next or bool(self._broken)

    def should_fail(self, remote: str, pairs: Sequence[tuple[int, int, int]], notif: bytes) -> bool:
        """Called once per post; consumes one armed failure when it returns True."""
        if self._broken and remote in self._broken:
            return True
        with self._lock:
            if self._break_next:
                self._break_next = False
                self._broken.add(remote)
                return True
            if self._next > 0:
                self._next -= 1
                return True
            for entry in self._matching:
                if entry[0](remote, pairs, notif):
                    if entry[1] is not None:
                        entry[1] -= 1
                        if entry[1] == 0:
                            self._matching.remove(entry)
                    return True
            return False


class XferHandle:
    """What post_write returns: pass it to check() and release(). `error` says why it failed."""

    __slots__ = ("_native", "error", "nbytes", "released", "remote", "state")

    def __init__(self, remote: str, nbytes: int, native: Any = None, state: XferState = XferState.PENDING,
                 error: str = "") -> None:
        self.remote = remote
        self.nbytes = nbytes
        self._native = native
        self.state = state
        self.error = error
        self.released = False

    def __repr__(self) -> str:
        return f"XferHandle(remote={self.remote!r}, nbytes={self.nbytes}, state={self.state.name})"


def as_handle(obj: object) -> XferHandle:
    if not isinstance(obj, XferHandle):
        raise TransportError(f"not a transfer handle: {obj!r}")
    return obj


def coalesce(pairs: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merges neighbours that are contiguous on both sides into one descriptor.

    NIXL's initialize_xfer does not merge descriptors (measured: 16 contiguous ones stay 16);
    fewer descriptors mean fewer UCX operations for the same bytes.
    """
    out: list[tuple[int, int, int]] = []
    for local, remote, length in pairs:
        if length <= 0 or local <= 0 or remote <= 0:
            raise TransportError(f"bad transfer pair (local=0x{local:x}, remote=0x{remote:x}, length={length})")
        if out:
            pl, pr, pn = out[-1]
            if pl + pn == local and pr + pn == remote:
                out[-1] = (pl, pr, pn + length)
                continue
        out.append((local, remote, length))
    if not out:
        raise TransportError("post_write needs at least one (local, remote, length) pair")
    return out


class LocalTransport:
    """In-process stand-in for unit tests: memmove between addresses of this process.

    Instances find each other by name in a class-level registry; metadata() is just the name
    and an instance id. Regions must be registered on both sides like with NIXL, so a test
    that forgets a registration fails here too. Never a default.
    """

    _registry: ClassVar[dict[str, LocalTransport]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str, fault_injector: FaultInjector | None = None) -> None:
        self.name = name
        self._faults = fault_injector
        self._lock = threading.Lock()
        self._regions: dict[int, int] = {}  # addr -> length
        self._remotes: set[str] = set()
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._closed = False
        self._token = f"{name}|{id(self):x}".encode()
        with self._registry_lock:
            self._registry[name] = self  # a restarted instance replaces the old one

    def register_region(self, addr: int, length: int, mem: str = "DRAM", device: int = 0) -> None:
        if mem != "DRAM":
            raise TransportError(f"LocalTransport only moves DRAM, not {mem}")
        if length <= 0 or addr <= 0:
            raise TransportError(f"cannot register region at 0x{addr:x} of {length} bytes")
        with self._lock:
            self._regions[addr] = length

    def deregister_region(self, addr: int) -> None:
        with self._lock:
            self._regions.pop(addr, None)

    def metadata(self) -> bytes:
        return b"kvxferd-local|" + self._token

    def add_remote(self, metadata: bytes) -> str:
        if not metadata.startswith(b"kvxferd-local|"):
            raise TransportError("not LocalTransport metadata")
        # b"kvxferd-local|" + name + b"|" + instance id; the name may itself contain "|".
        name = metadata[len(b"kvxferd-local|"):].rsplit(b"|", 1)[0].decode()
        with self._registry_lock:
            if name not in self._registry:
                raise TransportError(f"no LocalTransport named {name!r} in this process")
        with self._lock:
            self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        with self._lock:
            self._remotes.discard(name)

    def reconnect(self, name: str, metadata: bytes) -> str:
        self.remove_remote(name)
        if self._faults is not None:
            self._faults.rebuilt(name)
        return self.add_remote(metadata)

    def _covered(self, addr: int, length: int) -> bool:
        with self._lock:
            return any(base <= addr and addr + length <= base + size for base, size in self._regions.items())

    def post_write(self, remote: str, pairs: Sequence[tuple[int, int, int]], notif: bytes,
                   local_mem: str = "DRAM", remote_mem: str = "DRAM",
                   local_device: int = 0, remote_device: int = 0) -> XferHandle:
        if self._closed:
            raise TransportError(f"transport {self.name} is closed")
        if local_mem != "DRAM" or remote_mem != "DRAM":
            raise TransportError("LocalTransport only moves DRAM")
        descs = coalesce(pairs)
        nbytes = sum(n for _, _, n in descs)
        with self._lock:
            known = remote in self._remotes
        with self._registry_lock:
            peer = self._registry.get(remote)
        if not known or peer is None or peer._closed:
            raise TransportError(f"posting a WRITE to {remote} failed: peer unknown, removed or closed")
        for src, dst, n in descs:
            if not self._covered(src, n):
                raise TransportError(f"local range 0x{src:x}+{n} is not registered with {self.name}")
            if not peer._covered(dst, n):
                raise TransportError(f"remote range 0x{dst:x}+{n} is not registered with {remote}")
        if self._faults is not None and self._faults.should_fail(remote, pairs, notif):
            return XferHandle(remote, nbytes, state=XferState.ERROR, error="injected fault")
        for src, dst, n in descs:
            ctypes.memmove(dst, src, n)
        # Bytes first, then the notification, as NIXL guarantees.
        peer._inbox.append((self.name, bytes(notif)))
        return XferHandle(remote, nbytes, state=XferState.DONE)

    def check(self, handle: object) -> XferState:
        return as_handle(handle).state

    def release(self, handle: object) -> None:
        as_handle(handle).released = True

    def get_notifs(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        while True:
            try:
                out.append(self._inbox.popleft())
            except IndexError:
                return out

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._regions.clear()
            self._remotes.clear()
        with self._registry_lock:
            if self._registry.get(self.name) is self:
                del self._registry[self.name]
