"""The data mover: NIXL WRITEs between daemons, behind a small interface.

`NixlTransport` is the real one (one NIXL agent per daemon, UCX backend). `LocalTransport`
copies in-process with ctypes.memmove and exists for unit tests only. `FaultInjector` lets
tests make posts end in ERROR without moving bytes.

Threading (measured, see docs/nixl-notes.md): a NIXL agent created with the default sync mode
(NONE) is not safe to call from several threads: concurrent posts and polls segfault. We create
the agent with NIXL_THREAD_SYNC_RW, where NIXL takes its own reader/writer lock, so the hot path
(post_write, check, release, get_notifs) takes no Python lock at all. A Python lock serialises
only the control path (register/deregister, add/remove remote, close) and our own bookkeeping.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
import os
import struct
import threading
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

    @property
    def armed(self) -> bool:
        with self._lock:
            return self._next > 0 or bool(self._matching)

    def should_fail(self, remote: str, pairs: Sequence[tuple[int, int, int]], notif: bytes) -> bool:
        """Called once per post; consumes one armed failure when it returns True."""
        with self._lock:
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


def _handle(obj: object) -> XferHandle:
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


def apply_ucx_env_defaults() -> None:
    """Environment defaults UCX must see before the first agent is created in this process.

    UCX_MODULES=^efa: the nixl wheel bundles its own libibverbs and libnl, but UCX's EFA module
    links the system libefa, which pulls in the system copies too. With both loaded, a libnl
    destructor segfaults at process exit (every process that created a UCX agent exits with 139).
    Leaving EFA out keeps InfiniBand/RoCE (mlx5) and TCP; an operator who needs EFA over UCX sets
    UCX_MODULES explicitly (e.g. to "all") and we leave it alone.
    """
    if "UCX_MODULES" not in os.environ:
        os.environ["UCX_MODULES"] = "^efa"
    # UCX_MEMTYPE_CACHE=n: UCX's memory-type cache knows only allocations its hooks saw; a GPU ring
    # the daemon mapped with cudaIpcOpenMemHandle is not among them, so UCX took it for host memory
    # and NIXL refused to register it as VRAM (NIXL_ERR_BACKEND, "VRAM memory is detected as host",
    # seen on an H200 with nixl-cu13 1.5.1). Without the cache UCX asks the CUDA driver instead.
    if "UCX_MEMTYPE_CACHE" not in os.environ:
        os.environ["UCX_MEMTYPE_CACHE"] = "n"


_MD_HEADER = b"nixlSerDes|Agent"


def agent_name_from_metadata(metadata: bytes) -> str | None:
    """The agent name at the start of NIXL's serialized metadata, or None if it does not parse.

    Only used to find the old entry to drop when NIXL refuses to load a restarted peer's
    metadata over the old one; everything else takes the name NIXL returns.
    """
    if not metadata.startswith(_MD_HEADER) or len(metadata) < len(_MD_HEADER) + 8:
        return None
    (size,) = struct.unpack_from("<Q", metadata, len(_MD_HEADER))
    start = len(_MD_HEADER) + 8
    if size == 0 or start + size > len(metadata):
        return None
    try:
        return metadata[start:start + size].decode()
    except UnicodeDecodeError:
        return None


@functools.cache
def nixl_api() -> Any:
    """NIXL's Python API module (`nixl._api` of the backend wheel that fits this machine).

    The `nixl` meta package picks nixl_cu12 or nixl_cu13 from torch's CUDA version, read off disk;
    with a CPU-only torch there is none, and it imports torch to ask (2.5 s of a daemon's start on
    the 2-core CI machine, for a daemon that never touches torch). In that case, and only then,
    the installed backend wheel is imported directly, newest CUDA first, as the meta package's own
    fallback does.
    """
    import importlib
    import sys

    if "nixl._api" in sys.modules or "torch" in sys.modules:
        return importlib.import_module("nixl._api")
    try:
        from nixl_meta_utils import _torch_cuda_version_from_disk  # the meta package's own probe

        cuda = _torch_cuda_version_from_disk()
    except Exception:
        cuda = "unknown"
    if cuda is not None:
        return importlib.import_module("nixl._api")
    for backend in ("nixl_cu13", "nixl_cu12"):
        try:
            return importlib.import_module(f"{backend}._api")
        except ModuleNotFoundError as exc:
            if exc.name != backend:
                raise
    return importlib.import_module("nixl._api")


def _as_str(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


class NixlTransport:
    """One NIXL agent (UCX backend) for the whole daemon; safe to use from several threads."""

    def __init__(self, name: str, progress_thread: bool = False,
                 fault_injector: FaultInjector | None = None, num_workers: int = 1) -> None:
        apply_ucx_env_defaults()
        try:
            api = nixl_api()
            nixl_agent, nixl_agent_config, nixl_thread_sync_t = api.nixl_agent, api.nixl_agent_config, api.nixl_thread_sync_t
        except ImportError as exc:
            raise TransportError(f"NIXL is not installed or does not load: {exc}") from exc
        self.name = name
        self.progress_thread = progress_thread
        self._faults = fault_injector
        try:
            self._agent = nixl_agent(name, nixl_agent_config(
                enable_prog_thread=progress_thread, backends=[],
                sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
            ))
        except Exception as exc:
            raise TransportError(f"cannot create NIXL agent {name!r}: {exc}") from exc
        if "UCX" not in self._agent.plugin_list:
            raise TransportError("NIXL has no UCX backend here (plugin missing); cannot move data")
        try:
            # One UCX worker per posting thread: NIXL binds each thread that prepares a transfer
            # to the next worker in turn, so threads that post (kvxferd.workers) copy in parallel
            # instead of queueing on one worker's lock.
            self._agent.create_backend("UCX", {"num_workers": str(num_workers)})
        except Exception as exc:
            raise TransportError(f"cannot create the UCX backend of NIXL agent {name!r}: {exc}") from exc
        self._ctl = threading.Lock()
        self._regions: dict[int, tuple[Any, int, str, int]] = {}  # addr -> (reg dlist, length, mem, device)
        self._remotes: dict[str, bytes] = {}  # name -> metadata as loaded
        self._closed = False
        logger.info("NIXL agent %s ready (UCX, %d worker%s, progress thread %s)", name, num_workers,
                    "" if num_workers == 1 else "s", "on" if progress_thread else "off")

    # -- control path (serialised by self._ctl) -------------------------------------------

    def register_region(self, addr: int, length: int, mem: str = "DRAM", device: int = 0) -> None:
        if length <= 0 or addr <= 0:
            raise TransportError(f"cannot register region at 0x{addr:x} of {length} bytes")
        with self._ctl:
            self._check_open()
            if addr in self._regions:
                raise TransportError(f"a region at 0x{addr:x} is already registered")
            try:
                reg = self._agent.register_memory([(addr, length, device, "")], mem)
            except Exception as exc:
                raise TransportError(f"registering {mem} 0x{addr:x}+{length} (device {device}) failed: {exc}") from exc
            self._regions[addr] = (reg, length, mem, device)

    def deregister_region(self, addr: int) -> None:
        with self._ctl:
            entry = self._regions.pop(addr, None)
            if entry is None or self._closed:
                return
            try:
                self._agent.deregister_memory(entry[0])
            except Exception as exc:
                raise TransportError(f"deregistering 0x{addr:x} failed: {exc}") from exc

    def metadata(self) -> bytes:
        """Full agent metadata for the peer handshake; covers only regions registered so far."""
        with self._ctl:
            self._check_open()
            return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        """Loads a peer's metadata; returns its agent name.

        Same bytes again: nothing to do (transfers in flight keep going). Different bytes under a
        loaded name (a restarted peer, or a live one that registered or released memory): the old
        entry is removed and the new one loaded, never merged. NIXL's in-place load only adds
        regions: a released region stays loaded, and a new one at a reused address (the next
        cudaIpcOpenMemHandle often maps where the last one was) was refused with NOT_ALLOWED for
        VRAM on the GPU box, after which NIXL had dropped the whole agent. Removing the entry
        fails the WRITEs still in flight to it, so callers quiesce the peer first
        (WorkerPool.exclusive).
        """
        name = agent_name_from_metadata(metadata)
        with self._ctl:
            self._check_open()
            if name is not None and name in self._remotes:
                if self._remotes[name] == metadata:
                    return name
                self._forget(name)
            try:
                loaded = _as_str(self._agent.add_remote_agent(metadata))
            except Exception as exc:
                raise TransportError(f"loading NIXL metadata of {name or 'a peer'} failed: {exc}") from exc
            self._remotes[loaded] = metadata
            return loaded

    def remove_remote(self, name: str) -> None:
        """Drops a peer's metadata and connection; WRITEs still in flight to it end in ERROR."""
        with self._ctl:
            if self._closed:
                return
            self._forget(name)

    def _forget(self, name: str) -> None:
        known = self._remotes.pop(name, None) is not None
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            if known:
                logger.warning("removing NIXL agent %s failed: %s", name, exc)

    def close(self) -> None:
        """Removes every peer and deregisters every region; later calls raise TransportError."""
        with self._ctl:
            if self._closed:
                return
            for name in list(self._remotes):
                self._forget(name)
            for addr, (reg, _, _, _) in list(self._regions.items()):
                try:
                    self._agent.deregister_memory(reg)
                except Exception as exc:
                    logger.warning("deregistering 0x%x at close failed: %s", addr, exc)
            self._regions.clear()
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self.name} is closed")

    # -- data path (no Python lock: the agent runs with NIXL_THREAD_SYNC_RW) ---------------

    def post_write(self, remote: str, pairs: Sequence[tuple[int, int, int]], notif: bytes,
                   local_mem: str = "DRAM", remote_mem: str = "DRAM",
                   local_device: int = 0, remote_device: int = 0) -> XferHandle:
        """One NIXL WRITE of every pair, with `notif` delivered to the peer after the bytes."""
        self._check_open()
        descs = coalesce(pairs)
        nbytes = sum(n for _, _, n in descs)
        if self._faults is not None and self._faults.should_fail(remote, pairs, notif):
            return XferHandle(remote, nbytes, state=XferState.ERROR, error="injected fault")
        agent = self._agent
        try:
            local = agent.get_xfer_descs([(a, n, local_device) for a, _, n in descs], local_mem)
            far = agent.get_xfer_descs([(a, n, remote_device) for _, a, n in descs], remote_mem)
            native = agent.initialize_xfer("WRITE", local, far, remote, notif)
        except Exception as exc:
            raise TransportError(
                f"preparing a WRITE of {nbytes} bytes ({len(descs)} descriptors, {local_mem}->{remote_mem}) to "
                f"{remote} failed: {type(exc).__name__}: {exc} (peer unknown or removed, or a range outside "
                f"registered memory)"
            ) from exc
        try:
            status = agent.transfer(native)
        except Exception as exc:
            self._drop(native)
            raise TransportError(f"posting a WRITE to {remote} failed: {type(exc).__name__}: {exc}") from exc
        if status == "ERR":
            self._drop(native)
            raise TransportError(f"posting a WRITE to {remote} failed: NIXL returned ERR")
        state = XferState.DONE if status == "DONE" else XferState.PENDING
        return XferHandle(remote, nbytes, native, state)

    def check(self, handle: object) -> XferState:
        h = _handle(handle)
        if h.state is not XferState.PENDING or h.released:
            return h.state
        try:
            status = self._agent.check_xfer_state(h._native)
        except Exception as exc:
            # NIXL raises (rather than returning ERR) when the peer disconnected or was removed.
            h.state, h.error = XferState.ERROR, f"{type(exc).__name__}: {exc}"
            return h.state
        if status == "DONE":
            h.state = XferState.DONE
        elif status != "PROC":
            h.state, h.error = XferState.ERROR, f"NIXL reported {status}"
        return h.state

    def release(self, handle: object) -> None:
        """Frees the handle; one still in flight is cancelled (TransportError if NIXL cannot)."""
        h = _handle(handle)
        if h.released:
            return
        h.released = True
        if h.state is XferState.PENDING:
            h.state, h.error = XferState.ERROR, "released before it finished"
        if h._native is None:
            return
        native, h._native = h._native, None
        try:
            native.release()
        except Exception as exc:
            raise TransportError(f"releasing a WRITE to {h.remote} failed: {exc}") from exc

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, in arrival order per sending agent."""
        if self._closed:
            return []
        try:
            got = self._agent.get_new_notifs()
        except Exception as exc:
            raise TransportError(f"reading NIXL notifications failed: {exc}") from exc
        return [(_as_str(src), bytes(msg)) for src, msgs in got.items() for msg in msgs]

    @staticmethod
    def _drop(native: Any) -> None:
        try:
            native.release()
        except Exception:
            logger.debug("releasing a failed WRITE handle failed", exc_info=True)


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
        return _handle(handle).state

    def release(self, handle: object) -> None:
        _handle(handle).released = True

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
