"""What keeps a pair of daemons working through faults that pass: slow peers, pauses of this daemon,
and transport errors.

- **Slow or dead.** A control stream silent for the heartbeat limit used to be lost at once: a
  loaded daemon stalled 2.2 s failed 19 rooms in the field. While the stream is silent, the peer's
  port is probed with a TCP connect. A peer whose host still accepts it (its process holds the
  listening socket, and the path works: a SIGSTOPped or stalled daemon) is slow, not dead, and is
  lost only after `slow_peer_limit_s` of silence (at least SLOW_FACTOR times the limit): its rooms
  fail at their own deadlines meanwhile, so a stall that passes costs no room that could wait. A refused connect (the process is gone) or one
  that fails or times out (a cut path) leaves the loss at the limit, as before. A dead process
  usually breaks the stream first anyway.
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
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvxferd.config import Config
from kvxferd.metrics import Metrics
from kvxferd.peer_link import CONTROL_TIMEOUT_S, PeerLink
from kvxferd.peer_wire import split_hostport
from kvxferd.ports import Link
from kvxferd.transport import Transport
from kvxferd.workers import WorkerPool

logger = logging.getLogger(__name__)

# A silent peer whose port still accepts connections is lost after at least this many heartbeat limits.
SLOW_FACTOR = 2
# A liveness pass this much later than due: this daemon did not run meanwhile.
PAUSE_S = 1.0
# Rebuilding a broken pair's connection: first retry, longest wait between retries.
REBUILD_MIN_S = 0.1
REBUILD_MAX_S = 2.0


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

    # ------------------------------------------------------------------ pauses

    def woke(self, now: float, links: list[PeerLink]) -> None:
        """Called at every liveness pass: after a pause, every link counts as heard just now."""
        gap, self._last_pass = now - self._last_pass, now
        if gap < self._tick + PAUSE_S or gap == now or not links:
            return
        for h in links:
            h.last_rx = max(h.last_rx, now)
            h.probe = None
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
        if p is None or p[0] < h.last_rx:  # one probe per silence
            h.probe = (now, "running")
            self._spawn(self._probe(h, now, min(limit / 2, CONTROL_TIMEOUT_S)), f"probe of {h.address}")
            p = h.probe
        if not why:
            return ""
        # Only a port that answered keeps it: a probe still running at the limit (a path that drops
        # packets) leaves the loss where it always was.
        slow_limit = max(SLOW_FACTOR * limit, self._slow_limit)
        if p[1] == "accepts" and quiet < slow_limit:
            if not h.slow_since:
                h.slow_since = now
                logger.warning("peer %s (%s): no word for %.1f s, but its port accepts connections: slow, not lost "
                               "(lost after %.0f s of silence)", h.daemon_id, h.address, quiet, slow_limit)
            return ""
        if p[1] == "accepts":
            return f"{why} (its port accepts connections, but the daemon does not speak)"
        return f"{why} (its port {p[1]})" if p[1] != "running" else why

    async def _probe(self, h: PeerLink, started: float, timeout: float) -> None:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(*split_hostport(h.address)), timeout)
        except ConnectionRefusedError:
            result = "refuses connections"
        except (OSError, ValueError, asyncio.TimeoutError) as exc:
            result = f"is out of reach: {str(exc) or type(exc).__name__}"
        else:
            writer.close()
            result = "accepts"
        if h.probe is not None and h.probe[0] == started:
            h.probe = (started, result)

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
