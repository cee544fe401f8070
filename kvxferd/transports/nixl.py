"""The real data mover: NIXL WRITEs between daemons (one NIXL agent per daemon, UCX backend),
behind kvxferd.transports.interface's interface.

Threading (measured, see docs/nixl-notes.md): a NIXL agent created with the default sync mode
(NONE) is not safe to call from several threads: concurrent posts and polls segfault. We create
the agent with NIXL_THREAD_SYNC_RW, where NIXL takes its own reader/writer lock, so the hot path
(post_write, check, release, get_notifs) takes no Python lock at all. A Python lock serialises
only the control path (register/deregister, add/remove remote, close) and our own bookkeeping.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kvxferd.transports.interface import FaultInjector, TransportError, XferHandle, XferState, as_handle, coalesce

logger = logging.getLogger(__name__)


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
    """One NIXL agent (UCX backend unless `backend` names another) for the whole daemon; safe to use
    from several threads."""

    def __init__(self, name: str, progress_thread: bool = False,
                 fault_injector: FaultInjector | None = None, num_workers: int = 1, backend: str = "UCX") -> None:
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
        offered = sorted(_as_str(p) for p in self._agent.plugin_list)
        if backend not in offered:
            raise TransportError(f"NIXL offers no backend {backend!r} here (nixl_backend); it offers: "
                                 f"{', '.join(offered) or 'none'}")
        self.backend = backend
        try:
            # One UCX worker per posting thread: NIXL binds each thread that prepares a transfer
            # to the next worker in turn, so threads that post (kvxferd.datapath.workers) copy in parallel
            # instead of queueing on one worker's lock. Other plugins get their defaults: an option a
            # plugin does not declare is refused by it.
            params = {"num_workers": str(num_workers)} if backend == "UCX" else {}
            self._agent.create_backend(backend, params)
        except Exception as exc:
            raise TransportError(f"cannot create the {backend} backend of NIXL agent {name!r}: {exc}") from exc
        # The data path calls NIXL's bindings under the Python API (same calls, same order): a WRITE
        # is five NIXL calls, and each wrapper's argument checks and handle object ran under the GIL
        # that every transfer thread and the event loop share, per WRITE.
        self._core = self._agent.agent
        self._bind = sys.modules[type(self._core).__module__]
        self._mem_kinds = dict(self._agent.nixl_mems)
        self._write_op = self._agent.nixl_ops["WRITE"]
        self._done, self._in_prog = self._bind.NIXL_SUCCESS, self._bind.NIXL_IN_PROG
        # NIXL's getNotifs takes the agent lock exclusively, so it waits for every post in flight (a
        # post holds it shared while UCX copies over CMA) and the calls behind it wait too; of the
        # data path's calls only releaseXferReq waits there holding the GIL, which stalled every
        # Python thread of the daemon (measured: a release took up to 5.4 ms while a thread polled
        # notifications next to two posting threads, 40 us without). Releases and polls take this
        # lock first, so a release that would queue behind a poll waits here, GIL released.
        self._notif_gate = threading.Lock()
        self._ctl = threading.Lock()
        self._regions: dict[int, tuple[Any, int, str, int]] = {}  # addr -> (reg dlist, length, mem, device)
        self._remotes: dict[str, bytes] = {}  # name -> metadata as loaded
        self._closed = False
        logger.info("NIXL agent %s ready (%s, %d worker%s, progress thread %s)", name, backend, num_workers,
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
            return self._load(metadata, f"loading NIXL metadata of {name or 'a peer'}")

    def remove_remote(self, name: str) -> None:
        """Drops a peer's metadata and connection; WRITEs still in flight to it end in ERROR."""
        with self._ctl:
            if self._closed:
                return
            self._forget(name)

    def reconnect(self, name: str, metadata: bytes) -> str:
        """Drops a peer's entry and its connection and loads `metadata` afresh; returns the agent name.

        After a transport error (NIXL_ERR_REMOTE_DISCONNECT) NIXL keeps the failed UCX endpoint
        in the entry, and every later WRITE to that peer failed the same way until the daemon
        restarted; a new entry makes a new endpoint. Callers quiesce the peer first
        (WorkerPool.exclusive), as for add_remote."""
        with self._ctl:
            self._check_open()
            self._forget(name)
            if self._faults is not None:
                self._faults.rebuilt(name)
            return self._load(metadata, f"reloading NIXL metadata of {name}")

    def _load(self, metadata: bytes, what: str) -> str:
        """Adds a peer's agent entry from its metadata (under self._ctl); returns its agent name."""
        try:
            loaded = _as_str(self._agent.add_remote_agent(metadata))
        except Exception as exc:
            raise TransportError(f"{what} failed: {exc}") from exc
        self._remotes[loaded] = metadata
        return loaded

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
        core, dlist, kinds = self._core, self._bind.nixlXferDList, self._mem_kinds
        try:
            local = dlist(kinds[local_mem], [(a, n, local_device) for a, _, n in descs])
            far = dlist(kinds[remote_mem], [(a, n, remote_device) for _, a, n in descs])
            native = core.createXferReq(self._write_op, local, far, remote, notif, [])
        except Exception as exc:
            raise TransportError(
                f"preparing a WRITE of {nbytes} bytes ({len(descs)} descriptors, {local_mem}->{remote_mem}) to "
                f"{remote} failed: {type(exc).__name__}: {exc} (peer unknown or removed, or a range outside "
                f"registered memory)"
            ) from exc
        try:
            status = core.postXferReq(native, b"")
        except Exception as exc:
            self._drop(native)
            raise TransportError(f"posting a WRITE to {remote} failed: {type(exc).__name__}: {exc}") from exc
        if status != self._done and status != self._in_prog:
            self._drop(native)
            raise TransportError(f"posting a WRITE to {remote} failed: NIXL returned {status}")
        return XferHandle(remote, nbytes, native, XferState.DONE if status == self._done else XferState.PENDING)

    def send_notif(self, remote: str, notif: bytes) -> None:
        """`notif` to `remote` with no WRITE: after bytes copied by CUDA IPC (kvxferd.transports.local_ipc),
        so the peer's receive path is the one WRITEs take."""
        self._check_open()
        try:
            # genNotif waits for the agent lock holding the GIL, like releaseXferReq: never behind a poll.
            with self._notif_gate:
                self._core.genNotif(remote, notif)
        except Exception as exc:
            raise TransportError(f"sending a notification to {remote} failed: {type(exc).__name__}: {exc}") from exc

    def check(self, handle: object) -> XferState:
        h = as_handle(handle)
        if h.state is not XferState.PENDING or h.released:
            return h.state
        try:
            status = self._core.getXferStatus(h._native)
        except Exception as exc:
            # NIXL raises (rather than returning ERR) when the peer disconnected or was removed.
            h.state, h.error = XferState.ERROR, f"{type(exc).__name__}: {exc}"
            return h.state
        if status == self._done:
            h.state = XferState.DONE
        elif status != self._in_prog:
            h.state, h.error = XferState.ERROR, f"NIXL reported {status}"
        return h.state

    def release(self, handle: object) -> None:
        """Frees the handle; one still in flight is cancelled (TransportError if NIXL cannot)."""
        h = as_handle(handle)
        if h.released:
            return
        h.released = True
        if h.state is XferState.PENDING:
            h.state, h.error = XferState.ERROR, "released before it finished"
        if h._native is None:
            return
        native, h._native = h._native, None
        try:
            with self._notif_gate:
                self._core.releaseXferReq(native)
        except Exception as exc:
            raise TransportError(f"releasing a WRITE to {h.remote} failed: {exc}") from exc

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, in arrival order per sending agent."""
        if self._closed:
            return []
        try:
            with self._notif_gate:
                got = self._agent.get_new_notifs()
        except Exception as exc:
            raise TransportError(f"reading NIXL notifications failed: {exc}") from exc
        return [(_as_str(src), bytes(msg)) for src, msgs in got.items() for msg in msgs]

    def _drop(self, native: int) -> None:
        try:
            with self._notif_gate:
                self._core.releaseXferReq(native)
        except Exception:
            logger.debug("releasing a failed WRITE handle failed", exc_info=True)
