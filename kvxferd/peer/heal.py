"""What keeps a pair of daemons working through faults that pass: slow peers, pauses of this daemon,
and transport errors.

- **Slow or dead.** A control stream silent for the heartbeat limit used to be lost at once: a
  loaded daemon stalled 2.2 s failed 19 rooms in the field. While the stream is silent, the peer's
  port is probed with a TCP connect. A peer whose host still accepts it (its process holds the
  listening socket, and the path works: a SIGSTOPped or stalled daemon) is slow, not dead, and is
  lost only after `slow_peer_limit_s` of silence (at least SLOW_FACTOR times the limit): its rooms
  fail at their own deadlines meanwhile, so a stall that passes costs no room that could wait. A
  refused connect (the process is gone) or one that fails or gets no answer (a cut path) leaves the
  loss at the limit, as before. A dead process usually breaks the stream first anyway.
  The probe (Knock) is a non-blocking connect whose answer is read from the kernel at each liveness
  pass, not from a task of the loop: on a loaded machine this daemon's passes and tasks run late,
  and the probe used to be judged by when the loop got round to it. A pass that ran late could find
  the peer past the limit with no probe yet, start one and lose the peer in the same breath, as
  "no word for 3.0 s" with the peer's port accepting all along; so could a probe task that a busy
  loop had not run by its timeout. Now only an answer, or a connect still unanswered a pass after it
  began, loses the peer.
- **Pauses of this daemon.** After SIGSTOP, or a stalled event loop, the monotonic clock has run on
  while nothing could be heard: a daemon resumed after 20 s declared healthy peers dead by that
  clock. A liveness pass that runs PAUSE_S later than due gives every peer a fresh window
  (kvxferd.app's lease sweep does not count the time away against engine leases).
- **Transport errors.** In the field one NIXL_ERR_REMOTE_DISCONNECT left the pair failing every
  later WRITE until a daemon restarted, with the peer shown up. Now a transport error marks the pair
  broken (GetStatus and kvxferd_peers show it down) and rebuilds the peer's NIXL connection: a fresh
  handshake (which also reloads changed metadata), then the entry dropped and loaded again while no
  WRITE to the peer is in flight (WorkerPool.exclusive fences them), retried with back-off while
  the cause lasts. The WRITEs already failed fail their rooms; the next room gets the new connection.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import select
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvxferd.config import Config, split_hostport
from kvxferd.core.peer_port import Link
from kvxferd.datapath.workers import WorkerPool
from kvxferd.ops.metrics import Metrics
from kvxferd.peer.link import CONTROL_TIMEOUT_S, PeerLink
from kvxferd.transports.interface import Transport

logger = logging.getLogger(__name__)

# A silent peer whose port still accepts connections is lost after at least this many heartbeat limits.
SLOW_FACTOR = 2
# A liveness pass this much later than due: this daemon did not run meanwhile.
PAUSE_S = 1.0
# Rebuilding a broken pair's connection: first retry, longest wait between retries.
REBUILD_MIN_S = 0.1
REBUILD_MAX_S = 2.0


class Knock:
    """A TCP connect to a peer's port, started without blocking; its answer is read from the kernel
    when asked, so it does not depend on when this daemon's loop gets round to it."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.answer = ""  # "" while there is none yet
        self._sock: socket.socket | None = None
        self._closed = False

    def connect(self, family: int, addr: tuple[Any, ...]) -> None:
        if self.answer or self._closed:  # (a name resolved after the probe was given up)
            return
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            self.answer = f"is out of reach: {exc}"
            return
        sock.setblocking(False)
        err = sock.connect_ex(addr)
        if err == errno.EINPROGRESS:
            self._sock = sock
            return
        sock.close()
        self.answer = _connect_answer(err)

    def read(self, now: float, timeout: float) -> str:
        """Its answer now, or "" while one may still come: a connect the kernel has completed (or
        refused) by now, however late this is asked; none `timeout` after the start is an answer too."""
        if not self.answer and self._sock is not None:
            poll = select.poll()
            poll.register(self._sock, select.POLLOUT)
            if poll.poll(0):
                self.answer = _connect_answer(self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
        if not self.answer and now - self.started >= timeout:
            self.answer = f"is out of reach: no answer to a connect within {now - self.started:.1f} s"
        if self.answer:
            self.close()
        return self.answer

    def fail(self, why: str) -> None:
        self.answer = self.answer or f"is out of reach: {why}"
        self.close()

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _connect_answer(err: int) -> str:
    if err == 0:
        return "accepts"
    if err == errno.ECONNREFUSED:
        return "refuses connections"
    return f"is out of reach: {os.strerror(err)}"


class PairHealth:
    def __init__(self, config: Config, transport: Transport, workers: WorkerPool, metrics: Metrics,
                 spawn: Callable[[Any, str], None], refresh: Callable[[], None],
                 handshake: Callable[[PeerLink], Awaitable[None]]) -> None:
        self._transport = transport
        self._workers = workers
        self._metrics = metrics
        self._spawn = spawn
        self._refresh = refresh
        self._handshake = handshake
        self._limit = config.heartbeat_misses * config.heartbeat_interval_s
        self._slow_limit = config.slow_peer_limit_s
        self._tick = config.heartbeat_interval_s / 4
        self._last_pass = 0.0  # the first pass starts the count
        self._knocks: dict[PeerLink, Knock] = {}  # each silent link's probe still waiting for its answer

    # ------------------------------------------------------------------ pauses

    def woke(self, now: float, links: list[PeerLink]) -> None:
        """Called at every liveness pass: after a pause, every link counts as heard just now."""
        gap, self._last_pass = now - self._last_pass, now
        for h in [h for h in self._knocks if h not in links]:  # (lost meanwhile: nobody asks any more)
            self._knocks.pop(h).close()
        if gap < self._tick + PAUSE_S or gap == now or not links:
            return
        for h in links:
            h.last_rx = max(h.last_rx, now)
            h.probe = None
            knock = self._knocks.pop(h, None)
            if knock is not None:
                knock.close()
        logger.warning("this daemon did not run for %.1f s (paused, or its event loop stalled): its %d peer(s) get "
                       "a fresh heartbeat window", gap, len(links))

    # ------------------------------------------------------------------ slow or dead

    def judge(self, h: PeerLink, now: float, why: str) -> str:
        """`why` (PeerLink.silent) says the link is silent past its limit; returns the reason to
        lose it now, or "" while it is only slow. Probes its port once it is half-way there."""
        quiet = now - h.last_rx
        limit = max(self._limit, h.peer_limit_s)
        if quiet < limit:
            h.slow_since = 0.0
        if h.session is None or h.is_self or quiet < limit / 2:
            return why
        p = h.probe
        if p is None or p[0] < h.last_rx or (p[1] == "running" and h not in self._knocks):  # one per silence
            self._knock(h, now)
        p = self._read(h, now, min(limit / 2, CONTROL_TIMEOUT_S))
        if not why:
            return ""
        if p[1] == "running" and now - p[0] < self._tick / 2:
            # Started by this very pass (the passes before it ran late, or the peer spoke since the
            # last probe): it has not had a moment to be answered yet; the next pass reads it.
            return ""
        # Only a port that answered keeps it: a connect still unanswered a pass after it began (a path
        # that drops packets; a stopped daemon's kernel answers at once) leaves the loss where it was.
        slow_limit = max(SLOW_FACTOR * limit, self._slow_limit)
        if p[1] == "accepts" and quiet < slow_limit:
            if not h.slow_since:
                h.slow_since = now
                logger.warning("peer %s (%s): no word for %.1f s, but its port accepts connections: slow, not lost "
                               "(lost after %.0f s of silence)", h.daemon_id, h.address, quiet, slow_limit)
            return ""
        if p[1] == "accepts":
            return f"{why} (its port accepts connections, but the daemon does not speak)"
        if p[1] == "running":
            return f"{why} (a connect to its port is unanswered after {now - p[0]:.1f} s)"
        return f"{why} (its port {p[1]})"

    def _knock(self, h: PeerLink, now: float) -> None:
        old = self._knocks.pop(h, None)
        if old is not None:
            old.close()
        knock = self._knocks[h] = Knock(now)
        h.probe = (now, "running")
        try:
            host, port = split_hostport(h.address)
            family, _, _, _, addr = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV)[0]
        except ValueError as exc:
            knock.fail(str(exc))
        except socket.gaierror:  # a name: resolved off the loop, as a connect to it would be
            self._spawn(self._resolve(knock, host, port), f"probe of {h.address}")
        else:
            knock.connect(family, addr)

    @staticmethod
    async def _resolve(knock: Knock, host: str, port: int) -> None:
        try:
            family, _, _, _, addr = (await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM))[0]
        except OSError as exc:
            knock.fail(str(exc) or type(exc).__name__)
        else:
            knock.connect(family, addr)

    def _read(self, h: PeerLink, now: float, timeout: float) -> tuple[float, str]:
        """The link's probe, with the kernel's answer to its connect where there is one by now."""
        p = h.probe
        knock = self._knocks.get(h)
        assert p is not None
        if knock is not None and knock.started == p[0] and p[1] == "running":
            answer = knock.read(now, timeout)
            if answer:
                del self._knocks[h]
                p = h.probe = (p[0], answer)
        return p

    # ------------------------------------------------------------------ transport errors

    def transport_failed(self, peer: Link, error: str, posted_at: float) -> None:
        """A WRITE to `peer` failed in the transport: the pair is broken until its connection is rebuilt.
        WRITEs posted before the last rebuild failed on the old connection and change nothing."""
        h = peer
        assert isinstance(h, PeerLink)
        if not h.up or h.is_self or h.broken or posted_at < h.rebuilt_at:
            return
        h.broken = error
        logger.warning("peer %s (%s): transport error (%s); the pair is down until its NIXL connection is rebuilt",
                       h.daemon_id, h.address, error)
        self._refresh()
        self._spawn(self._rebuild(h, h.instance_id), f"rebuild the NIXL connection to {h.address}")

    async def _rebuild(self, h: PeerLink, instance: str) -> None:
        backoff = REBUILD_MIN_S
        tries = 0
        while h.up and h.broken and h.instance_id == instance:
            tries += 1
            try:
                async with h.lock:
                    # Its current metadata (and ours to it): whatever changed since is loaded now.
                    await self._handshake(h)
                name = h.agent_name
                loaded = await self._workers.exclusive(name, self._transport.reconnect, name, h.metadata)
            except Exception as exc:
                logger.warning("peer %s: rebuilding its NIXL connection failed (try %d: %s); next try in %.1f s",
                               h.daemon_id, tries, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, REBUILD_MAX_S)
                continue
            if not h.up or h.instance_id != instance:
                # Lost meanwhile: its entry was dropped, and a new instance loads its own.
                self._spawn(self._workers.run_blocking(self._transport.remove_remote, loaded), "remove remote")
                return
            h.agent_name, h.broken, h.rebuilt_at = loaded, "", time.monotonic()
            self._metrics.peer_series.labels(self._metrics.peer_reconnects, h.daemon_id).inc()
            logger.info("peer %s (%s): NIXL connection rebuilt after %d tr%s; the pair is up again", h.daemon_id,
                        h.address, tries, "y" if tries == 1 else "ies")
            self._refresh()
