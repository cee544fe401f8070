"""Slow or dead, and this daemon's own pauses (kvxferd.peer_heal), against real sockets: a silent peer
whose port accepts a TCP connect is slow and lost only after slow_peer_limit_s; one whose
port refuses is lost at the limit, saying so; after a pause every link counts as heard just now.
The daemon-level cases (SIGSTOP of real daemons, transport errors) are in tests/faults/test_pair_heal.py.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

from kvxferd.config import Config
from kvxferd.metrics import Metrics
from kvxferd.peer_heal import SLOW_FACTOR, PairHealth
from kvxferd.peer_link import PeerLink, Session

CONFIG = Config(heartbeat_interval_s=1.0, heartbeat_misses=2, slow_peer_limit_s=0.0)
LIMIT = 2.0


TASKS: set[asyncio.Future[Any]] = set()


def health_spawn(coro: Any, what: str) -> None:
    task = asyncio.ensure_future(coro)
    TASKS.add(task)
    task.add_done_callback(TASKS.discard)


async def no_handshake(h: PeerLink) -> None:
    raise AssertionError("no handshake here")


def health() -> PairHealth:
    return PairHealth(CONFIG, None, None, Metrics(), health_spawn, lambda: None, no_handshake)  # type: ignore[arg-type]


async def silent_link(address: str) -> PeerLink:
    h = PeerLink(address, CONFIG, Metrics())
    h.daemon_id, h.up = "p", True

    async def write(batch: Any) -> None:
        return None

    h.session = Session(write, lambda: None)
    h.session.hear()
    return h


async def probed(ph: PairHealth, h: PeerLink, quiet: float) -> str:
    """Judges `h` silent for `quiet` s (which starts its probe) and waits for the probe's answer."""
    now = time.monotonic()
    h.last_rx = now - quiet
    assert ph.judge(h, now, "") == ""
    for _ in range(200):
        assert h.probe is not None
        if h.probe[1] != "running":
            return h.probe[1]
        await asyncio.sleep(0.01)
    raise AssertionError("the probe never answered")


async def test_a_silent_peer_whose_port_accepts_is_slow_not_lost() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ph, h = health(), await silent_link(f"127.0.0.1:{port}")
    try:
        assert await probed(ph, h, LIMIT / 2 + 0.1) == "accepts"
        now = h.last_rx + LIMIT + 0.5
        assert ph.judge(h, now, "no word for 2.5 s") == ""
        assert h.slow_since == now
        late = h.last_rx + SLOW_FACTOR * LIMIT  # slow_peer_limit_s=0: twice the limit, the floor
        why = ph.judge(h, late, "no word for 4.0 s")
        assert why.startswith("no word for 4.0 s") and "accepts connections, but the daemon does not speak" in why
        # It speaks again: the next silence is probed afresh.
        h.last_rx = time.monotonic()
        assert ph.judge(h, h.last_rx + 0.1, "") == "" and h.slow_since == 0.0
    finally:
        server.close()
        await h.close()


async def test_a_slow_peer_limit_keeps_a_stalled_peer_past_a_20s_stall() -> None:
    """slow_peer_limit_s = 60 keeps a peer whose port accepts through a 20 s stall (its rooms fail at
    their own deadlines), and loses it once that much silence has passed."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = Config(heartbeat_interval_s=1.0, heartbeat_misses=2, slow_peer_limit_s=60.0)
    ph = PairHealth(cfg, None, None, Metrics(), health_spawn, lambda: None, no_handshake)  # type: ignore[arg-type]
    h = PeerLink(f"127.0.0.1:{port}", cfg, Metrics())
    h.daemon_id, h.up = "p", True
    h.session = Session(lambda batch: asyncio.sleep(0), lambda: None)
    h.session.hear()
    try:
        assert await probed(ph, h, LIMIT / 2 + 0.1) == "accepts"
        assert ph.judge(h, h.last_rx + 20.5, "no word for 20.5 s") == ""
        why = ph.judge(h, h.last_rx + cfg.slow_peer_limit_s, f"no word for {cfg.slow_peer_limit_s:.1f} s")
        assert "does not speak" in why
    finally:
        server.close()
        await h.close()


async def test_a_silent_peer_whose_port_refuses_is_lost_at_the_limit() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once it is closed
    ph, h = health(), await silent_link(f"127.0.0.1:{port}")
    try:
        assert await probed(ph, h, LIMIT / 2 + 0.1) == "refuses connections"
        why = ph.judge(h, h.last_rx + LIMIT, "no word for 2.0 s")
        assert why == "no word for 2.0 s (its port refuses connections)", why
    finally:
        await h.close()


async def test_after_a_pause_every_link_counts_as_heard_just_now() -> None:
    ph = health()
    a, b = await silent_link("127.0.0.1:1"), await silent_link("127.0.0.1:2")
    try:
        t0 = time.monotonic()
        a.last_rx = b.last_rx = t0 - 0.1
        ph.woke(t0, [a, b])  # the first pass only starts the count
        ph.woke(t0 + 0.3, [a, b])  # on time
        assert a.last_rx == b.last_rx == t0 - 0.1
        ph.woke(t0 + 20.3, [a, b])  # 20 s away (SIGSTOP)
        assert a.last_rx == b.last_rx == t0 + 20.3
        assert ph.judge(a, t0 + 20.4, "") == ""
    finally:
        await a.close()
        await b.close()
