"""Test-only fault control (config `fault_injection = true`), driven by writing one command to
`<socket>.faults`:

- `N`: the next N NIXL posts end in ERROR, so tests can fail a transfer inside a subprocess daemon;
- `break S`: the next NIXL post breaks its peer's connection as NIXL_ERR_REMOTE_DISCONNECT did in the
  field: every later post to that peer fails until the daemon rebuilds the connection, which fails
  for S seconds (the cause, say a full tmpfs, lasts that long) and works afterwards;
- `delay S`: the next WRITE is held S seconds before it is posted (a WRITE delayed past a credit
  revocation, as a stalled worker or network would);
- `stall S`: the event loop is blocked S seconds, as a long GC pause or a stuck call would block
  it: no heartbeat goes out and no peer message is read, so peers declare this daemon lost while
  its process lives on and its worker threads go on posting WRITEs it has not learnt are revoked;
- `register BYTES` / `release`: register a new DRAM region with NIXL (release: the oldest such
  region) and bump the metadata epoch, as importing or releasing an engine's GPU ring does, so CPU
  tests exercise re-handshakes with changed NIXL metadata while rooms are in flight;
- `stream-off`: the framed control stream's port closes, with every stream on it, as a firewall
  that lets only the peer port through would have it: peers must fall back to the Session RPC;
- `slow-accept S`: every control stream a peer opens to this daemon from now on is taken up S
  seconds late (0 ends it), so the dialing side hears nothing on it for S seconds.

The file sits next to the socket, in a directory only the daemon's user can write; the hook does
not exist unless fault_injection is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvxferd.core.peer_port import Identity
from kvxferd.transports.interface import FaultInjector, Transport

logger = logging.getLogger(__name__)

FAULT_CONTROL_SUFFIX = ".faults"


class PostDelay:
    """One-shot delays handed to the worker that posts next (read from worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[float] = []

    def add(self, seconds: float) -> None:
        with self._lock:
            self._pending.append(seconds)

    def take(self) -> float:
        if not self._pending:
            return 0.0
        with self._lock:
            return self._pending.pop(0) if self._pending else 0.0


async def fault_control(path: str, injector: FaultInjector, delays: PostDelay, transport: Transport,
                        ident: Identity, run_blocking: Callable[..., Awaitable[Any]],
                        close_stream: Callable[[], None] | None = None,
                        slow_accept: Callable[[float], None] | None = None) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a leftover of an earlier run must not fire now
    scratch: list[tuple[mmap.mmap, int]] = []
    try:
        while True:
            await asyncio.sleep(0.05)
            try:
                # Never through a symlink, and never more than a command's worth.
                with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)) as fh:
                    text = fh.read(256)
                if not text:
                    # `echo cmd > file` creates the file before it writes: taking it now would
                    # lose the command. Read it again next tick (tests rename a whole file in).
                    continue
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                logger.warning("fault injection: %s refused (%s); removed", path, exc.strerror)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                continue
            words = text.split()
            try:
                if len(words) == 1 and words[0].isdigit():
                    injector.fail_next(int(words[0]))
                    logger.warning("fault injection: the next %s NIXL transfer(s) will end in ERROR", words[0])
                elif len(words) == 2 and words[0] == "break":
                    injector.break_pair(float(words[1]))
                    logger.warning("fault injection: the next NIXL post breaks its peer's connection (cause lasts "
                                   "%s s)", words[1])
                elif len(words) == 2 and words[0] == "delay":
                    delays.add(float(words[1]))
                    logger.warning("fault injection: the next WRITE is held %s s before it is posted", words[1])
                elif len(words) == 2 and words[0] == "stall":
                    logger.warning("fault injection: the event loop stalls for %s s", words[1])
                    time.sleep(float(words[1]))  # blocking on purpose: the loop is what stalls
                    logger.warning("fault injection: the event loop runs again")
                elif len(words) == 2 and words[0] == "register" and words[1].isdigit():
                    m = mmap.mmap(-1, int(words[1]))
                    buf = ctypes.c_char.from_buffer(m)
                    addr = ctypes.addressof(buf)
                    del buf  # a live export would keep m.close() from unmapping it
                    await run_blocking(transport.register_region, addr, len(m), "DRAM", 0)
                    scratch.append((m, addr))
                    ident.md_epoch += 1
                    logger.warning("fault injection: registered %d B at 0x%x (metadata epoch %d)", len(m), addr,
                                   ident.md_epoch)
                elif words == ["release"] and scratch:
                    m, addr = scratch.pop(0)
                    await run_blocking(transport.deregister_region, addr)
                    m.close()  # unmapped: the next region may land at the same address, like a GPU ring
                    ident.md_epoch += 1
                    logger.warning("fault injection: released a region (metadata epoch %d)", ident.md_epoch)
                elif len(words) == 2 and words[0] == "slow-accept" and slow_accept is not None:
                    slow_accept(float(words[1]))
                    logger.warning("fault injection: control streams are taken up %s s late", words[1])
                elif words == ["stream-off"] and close_stream is not None:
                    close_stream()
                    logger.warning("fault injection: the framed control stream's port is closed")
                else:
                    logger.warning("fault injection: unknown command %r in %s", text[:40], path)
            except Exception as exc:
                logger.warning("fault injection: %r failed: %s", text[:40], exc)
    finally:
        for _, addr in scratch:
            with contextlib.suppress(Exception):
                transport.deregister_region(addr)
