"""Slow or dead, and this daemon's own pauses (kvxferd.peer.heal), against real sockets: a silent peer
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
from kvxferd.ops.metrics import Metrics
from kvxferd.peer.heal import SLOW_FACTOR, PairHealth
from kvxferd.peer.link import PeerLink, Session

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
    """Judges `h` silent for `quiet` s (which starts its probe), then judges it again until the probe
    has its answer (read from the kernel at each judgement, as each liveness pass does)."""
    now = time.monotonic()
    h.last_rx = now - quiet
    assert ph.judge(h, now, "") == ""
    for _ in range(200):
        assert h.probe is not None
        if h.probe[1] != "running":
            return h.probe[1]
        await asyncio.sleep(0.01)
        assert ph.judge(h, time.monotonic(), "") == ""
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


async def test_a_late_pass_does_not_lose_a_peer_on_a_probe_it_just_started() -> None:
    """The race behind "no word for 3.0 s" after a stop: this daemon's passes ran late (a loaded loop),
    so the first pass to find the peer silent past half the limit also finds it past the whole limit.
    The probe it starts cannot have been answered yet: the peer is kept for the next pass, which reads
    the kernel's answer (accepts: slow, not lost)."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ph, h = health(), await silent_link(f"127.0.0.1:{port}")
    try:
        now = time.monotonic()
        h.last_rx = now - (LIMIT + 0.1)
        assert ph.judge(h, now, "no word for 2.1 s") == ""
        assert h.probe is not None
        # The connect on loopback is often answered before the pass is over; if not, the next pass,
        # a tick later, reads the kernel's answer with no task of this loop having run for it (a busy
        # loop runs its tasks late).
        if h.probe[1] == "running":
            time.sleep(0.05)
            assert ph.judge(h, now + CONFIG.heartbeat_interval_s / 4, "no word for 2.35 s") == ""
        assert h.probe[1] == "accepts" and h.slow_since >= now
    finally:
        server.close()
        await h.close()


async def test_a_connect_still_unanswered_a_pass_later_loses_the_peer_at_the_limit() -> None:
    """A path that drops packets (here: a listener whose accept queue is full, so the kernel drops the
    SYN) is lost at the limit, as before: the probe started half-way has no answer by then."""
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    port = full.getsockname()[1]
    fillers = []
    try:
        for _ in range(8):  # fill the accept queue: connects beyond it get no answer
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            fillers.append(c)
        time.sleep(0.05)
        ph, h = health(), await silent_link(f"127.0.0.1:{port}")
        try:
            start = time.monotonic()
            h.last_rx = start - LIMIT / 2
            assert ph.judge(h, start, "") == ""
            time.sleep(0.05)
            assert ph.judge(h, start + 0.25, "") == "" and h.probe is not None and h.probe[1] == "running"
            why = ph.judge(h, start + LIMIT / 2, "no word for 2.0 s")
            assert why.startswith("no word for 2.0 s (") and ("unanswered" in why or "out of reach" in why), why
        finally:
            await h.close()
    finally:
        for c in fillers:
            c.close()
        full.close()


async def test_a_probe_started_before_a_pause_is_dropped_with_its_socket() -> None:
    """A pause gives every link a fresh window: the probe begun before it is given up (its socket
    closed), and the next silence is probed afresh."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ph, h = health(), await silent_link(f"127.0.0.1:{port}")
    try:
        t0 = time.monotonic()
        ph.woke(t0, [h])
        h.last_rx = t0 - LIMIT / 2
        assert ph.judge(h, t0, "") == "" and h.probe is not None
        ph.woke(t0 + 20.0, [h])
        assert h.probe is None and h.last_rx == t0 + 20.0
        assert ph.judge(h, t0 + 20.1, "") == "" and h.probe is None
        # A link no longer up loses its probe at the next pass.
        h.last_rx = t0 + 20.0 - LIMIT / 2
        ph.judge(h, t0 + 20.2, "")
        assert h.probe is not None
        ph.woke(t0 + 20.3, [])
        assert ph.judge(h, t0 + 20.4, "") == "" and h.probe is not None
    finally:
        server.close()
        await h.close()
