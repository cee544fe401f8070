"""The peer layer when things go wrong, with daemons in the test's event loop (serve(), as
tests.conftest.inproc runs them) and framed streams against raw sockets:

- the liveness task survives its own failures (an exception used to end it for good);
- a peer that handshakes and opens no stream is lost, then dialed again;
- a stream to a peer that stopped reading is cut: no writer, reader, buffer or socket stays;
- two daemons that dial each other at once keep one stream (the lower daemon id's), lose
  nothing queued, and call nobody lost; a peer that opens a new stream while we hold one is
  taken as having lost the old one (what ran on it fails here too).

A peer "hangs" (as under SIGSTOP) by having its writes never finish and its socket not read. Its
port still accepts connections, so by default it would be held as slow for slow_peer_limit_s
(kvxferd.peer.heal); the tests of a hung peer's loss set it to 0 (lost at twice the heartbeat limit).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvxfer_protocol.pb.kvxfer.v1 import peer_pb2
from kvxferd.config import Config
from kvxferd.core.types import FailureCode, RoomKey
from kvxferd.ops.metrics import Metrics
from kvxferd.peer import link as peer_link
from kvxferd.peer import wire as peer_wire
from kvxferd.peer.link import PeerLink, Session
from kvxferd.peer.manager import PeerManager
from kvxferd.peer.wire import WireStream
from tests.conftest import InProcDaemon
from tests.readiness import budget

# ---------------------------------------------------------------------------- helpers


@pytest.fixture
def logs(caplog: Any) -> Any:
    """caplog at INFO for the daemon's loggers, whatever an earlier test (setup_logging) left."""
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="kvxferd")
    return caplog


def manager(d: InProcDaemon) -> PeerManager:
    # A stopped daemon's manager may linger (earlier tests can reuse the port and the name):
    # only the one whose liveness task still runs is this daemon's.
    gc.collect()
    (pm,) = [o for o in gc.get_objects() if isinstance(o, PeerManager) and o.ident.address == d.peer_address
             and o.ident.daemon_id == d.daemon_id and o._task is not None and not o._task.done()]
    return pm


class Inbox:
    """Stands in front of a daemon's PeerInbox: records losses and aborts (aborts go no further)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lost: list[tuple[str, str]] = []
        self.aborts: list[tuple[str, int]] = []
        self.fail_lost = 0  # the next N on_peer_lost calls raise

    def on_peer_lost(self, peer: Any, reason: str) -> None:
        self.lost.append((peer.daemon_id, reason))
        if self.fail_lost:
            self.fail_lost -= 1
            raise RuntimeError("injected on_peer_lost failure")
        self.inner.on_peer_lost(peer, reason)

    def on_abort(self, peer: Any, key: RoomKey, code: FailureCode, reason: str, quiesced: bool) -> None:
        self.aborts.append((peer.daemon_id, key.id))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def spy(pm: PeerManager) -> Inbox:
    inbox = Inbox(pm._inbox)
    pm._inbox = inbox
    return inbox


async def until(cond: Callable[[], Any], timeout: float, what: str) -> None:
    # The base budget is a quiet box's: at load 2-4x a liveness pass runs late, and a pass later than
    # PAUSE_S gives every peer a fresh window (correctly: kvxferd.peer.heal), so losses take longer.
    timeout = budget(timeout)
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout:.1f} s: {what}"
        await asyncio.sleep(0.02)


def wire_of(session: Session) -> WireStream:
    """The framed stream under a session (its cancel is the stream's abort)."""
    stream = getattr(session.cancel, "__self__", None)
    assert isinstance(stream, WireStream), session.kind
    return stream


def hang(h: PeerLink, read: bool = False, write: bool = False) -> asyncio.Event:
    """This side of `h`'s stream stops reading its socket and/or its writes never finish (the
    writes end, failing, once the returned event is set)."""
    thaw = asyncio.Event()
    session = h.session
    assert session is not None
    if read:
        wire_of(session)._writer.transport.pause_reading()
    if write:
        async def stuck(batch: Any) -> None:
            await thaw.wait()
            raise ConnectionError("thawed")

        session.write = stuck  # type: ignore[method-assign]
    return thaw


def abort_msg(link: PeerLink, room: int, reason: str = "test") -> None:
    link.send_abort(RoomKey(room), FailureCode.ABORTED, reason, quiesced=True)


# ---------------------------------------------------------------------------- 1: liveness survives


async def test_liveness_goes_on_after_its_checks_fail(inproc: Any, logs: Any) -> None:
    a, b, c = [await inproc(n, transport="local", slow_peer_limit_s=0) for n in ("la", "lb", "lc")]
    pa, pb, pc = manager(a), manager(b), manager(c)
    inbox = spy(pa)
    hab = await pa.connect(b.peer_address)
    hac = await pa.connect(c.peer_address)
    # A credit sweep raises once, then the redial pass does: both used to end the task.
    sweeps = 0
    sweep = hab.window.sweep

    def bad_sweep(now: float) -> None:
        nonlocal sweeps
        sweeps += 1
        if sweeps == 1:
            raise RuntimeError("injected sweep failure")
        sweep(now)

    hab.window.sweep = bad_sweep  # type: ignore[method-assign]
    await until(lambda: sweeps >= 3, 5, "liveness passes after the failing sweep")
    links = 0
    link = pa.link

    def bad_link(address: str) -> PeerLink:
        nonlocal links
        links += 1
        if links == 1:
            raise RuntimeError("injected link failure")
        return link(address)

    pa.link = bad_link  # type: ignore[method-assign]
    await until(lambda: links >= 3, 5, "redial passes after the failing one")
    assert "injected sweep failure" in logs.text and "injected link failure" in logs.text
    assert pa._task is not None and not pa._task.done()
    # Now lb and lc fall silent; handing lb's loss to the domain raises. Both are still found.
    inbox.fail_lost = 1
    thaw_b = hang(pb.known("la"), write=True)
    thaw_c = hang(pc.known("la"), write=True)
    try:
        await until(lambda: {d for d, _ in inbox.lost} == {"lb", "lc"}, 5, "lb and lc called lost")
        assert all("no word for" in why for _, why in inbox.lost), inbox.lost
        assert "injected on_peer_lost failure" in logs.text
        assert not pa._task.done()
    finally:
        thaw_b.set()
        thaw_c.set()
    # The redials go on too: both are up again, each with a stream.
    await until(lambda: hab.up and hab.session is not None and hac.up and hac.session is not None, 15,
                "lb and lc redialed")


# ---------------------------------------------------------------------------- 2: handshake, no stream


async def test_a_handshake_that_no_stream_follows_is_lost_and_dialed_again(inproc: Any, logs: Any) -> None:
    a, b = await inproc("na", transport="local"), await inproc("nb", transport="local")
    pa, pb = manager(a), manager(b)
    inbox = spy(pa)
    pa._first_word = 1.5  # the handshake's 5 s, shortened
    await pb.handshake(pb.link(a.peer_address))  # nb handshakes and opens no stream
    h = pa.known("nb")
    assert h is not None and h.up and h.session is None
    await until(lambda: inbox.lost, 5, "nb lost for opening no stream")
    assert "no control stream" in inbox.lost[0][1], inbox.lost
    # na dials it itself: up again, with a stream both ends use.
    await until(lambda: h.up and h.session is not None and h.session.heard, 10, "nb redialed")
    assert h.session.ours
    hb = pb.known("na")
    assert hb is not None and hb.session is not None
    inbox_b = spy(pb)
    abort_msg(h, 7)
    await until(lambda: inbox_b.aborts == [("na", 7)], 5, "a message over the new stream")


async def test_a_peer_that_handshook_and_went_away_is_lost(inproc: Any) -> None:
    # The reviewer's case: nb handshakes, opens no stream, then exits; it used to stay up forever.
    a, b = await inproc("ga", transport="local"), await inproc("gb", transport="local")
    pa, pb = manager(a), manager(b)
    pa._first_word = 1.5
    await pb.handshake(pb.link(a.peer_address))
    b.stop.set()
    await asyncio.wait_for(b.task, 30)
    h = pa.known("gb")
    assert h is not None
    await until(lambda: not h.up, 5, "gb lost")
    await asyncio.sleep(1.0)  # and it stays lost: nothing answers there
    assert not h.up and h.session is None


# ---------------------------------------------------------------------------- 3: a peer that reads nothing


@pytest.fixture
async def deaf() -> Any:
    """A TCP listener that accepts and never reads, with small socket buffers; yields its port."""
    held: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.pause_reading()
        held.append(writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    yield server.sockets[0].getsockname()[1]
    server.close()
    for w in held:
        w.transport.abort()


async def _dial_small(port: int) -> WireStream:
    wire = await peer_wire.dial(f"127.0.0.1:{port}", Config(), 5)
    wire._writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    return wire


BIG = peer_pb2.PeerBatch(msgs=[peer_pb2.PeerMsg(abort=peer_pb2.Abort(reason="x" * (1 << 20)))])


async def test_a_write_to_a_peer_that_reads_nothing_is_cut(deaf: int, monkeypatch: Any) -> None:
    monkeypatch.setattr(peer_wire, "DRAIN_TIMEOUT_S", 0.3)
    wire = await _dial_small(deaf)
    t0 = time.monotonic()
    with pytest.raises(ConnectionAbortedError, match="read nothing"):
        for _ in range(100):
            await wire.write(BIG)
    assert time.monotonic() - t0 < 5
    # Its reader ends with the reason, and the socket is gone.
    with pytest.raises(ConnectionAbortedError, match="read nothing"):
        await asyncio.wait_for(wire.__anext__(), 2)
    await asyncio.wait_for(wire._writer.wait_closed(), 2)


async def test_closing_a_stream_to_a_peer_that_reads_nothing_finishes(deaf: int, monkeypatch: Any) -> None:
    monkeypatch.setattr(peer_wire, "CLOSE_GRACE_S", 0.3)
    wire = await _dial_small(deaf)
    for _ in range(3):  # 3 MiB: under the drain mark, far over what the kernel takes
        await wire.write(BIG)
    assert wire._writer.transport.get_write_buffer_size() > 0
    wire.close()
    await asyncio.wait_for(wire._writer.wait_closed(), 3)  # used to wait for the peer forever
    # Aborting (a session's teardown) does not wait at all; the reader just ends.
    wire = await _dial_small(deaf)
    for _ in range(3):
        await wire.write(BIG)
    wire.abort()
    await asyncio.wait_for(wire._writer.wait_closed(), 1)
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(wire.__anext__(), 1)


@pytest.fixture
def dialed(monkeypatch: Any) -> list[WireStream]:
    """Every framed stream a daemon in this process dials."""
    got: list[WireStream] = []
    dial = peer_link.dial

    async def spy_dial(*args: Any) -> WireStream:
        wire = await dial(*args)
        got.append(wire)
        return wire

    monkeypatch.setattr(peer_link, "dial", spy_dial)
    return got


def _flood(h: PeerLink, n: int = 40_000) -> None:
    for i in range(n):
        abort_msg(h, i + 1, "y" * 500)  # 20 MB: more than the socket buffers hold


async def test_a_session_with_a_hung_peer_is_torn_down(inproc: Any, dialed: list[WireStream], logs: Any) -> None:
    a, b = [await inproc(n, transport="local", slow_peer_limit_s=0) for n in ("ha", "hb")]
    pa, pb = manager(a), manager(b)
    h = await pa.connect(b.peer_address)
    await until(lambda: h.session is not None and h.session.heard, 3, "the stream taken up")
    (wire,) = dialed
    session = h.session
    # hb: SIGSTOP, as it were. Its own liveness stops too, and it cannot be redialed (a stopped
    # process answers no handshake): nothing but ha's teardown may end the stream.
    thaw = hang(pb.known("ha"), read=True, write=True)
    assert pb._task is not None
    pb._task.cancel()
    pa._next_dial[b.peer_address] = (float("inf"), 1.0)
    try:
        _flood(h)
        await until(lambda: not h.up, 5, "hb lost for its silence")
        assert "no word for" in logs.text
        # The writer (it was waiting on the full socket) ends, and so do the socket and the reader.
        await asyncio.wait_for(wire._writer.wait_closed(), 2)
        assert session is not None and session.writer is not None
        await asyncio.wait_for(asyncio.shield(session.writer), 2)
        await until(lambda: wire._reader.at_eof(), 2, "the reader at its end")
    finally:
        thaw.set()


async def test_a_peer_that_stops_reading_but_still_speaks_is_cut(
        inproc: Any, dialed: list[WireStream], monkeypatch: Any, logs: Any) -> None:
    monkeypatch.setattr(peer_wire, "DRAIN_TIMEOUT_S", 0.3)
    # A long heartbeat: sb, hearing nothing (it does not read), would call sa lost only after 4 s.
    a, b = [await inproc(n, transport="local", heartbeat_interval_s=2.0) for n in ("sa", "sb")]
    pa, pb = manager(a), manager(b)
    inbox = spy(pa)
    h = await pa.connect(b.peer_address)
    await until(lambda: h.session is not None and h.session.heard, 3, "the stream taken up")
    (wire,) = dialed
    hang(pb.known("sa"), read=True)  # sb still sends heartbeats: only the drain can tell
    _flood(h)
    await until(lambda: not h.up, 5, "sb lost")
    assert "read nothing" in inbox.lost[0][1], inbox.lost
    await asyncio.wait_for(wire._writer.wait_closed(), 2)


# ---------------------------------------------------------------------------- 4: both dial at once


@pytest.mark.parametrize("slow", ["", "low", "high", "dial"])
@pytest.mark.parametrize("stream_port", [0, -1], ids=["framed", "grpc"])
async def test_daemons_dialing_each_other_at_once_keep_one_stream(
        inproc: Any, logs: Any, monkeypatch: Any, stream_port: int, slow: str) -> None:
    a = await inproc("xa", transport="local", peer_stream_port=stream_port)
    b = await inproc("xb", transport="local", peer_stream_port=stream_port)
    pa, pb = manager(a), manager(b)
    ia, ib = spy(pa), spy(pb)
    # Which one takes streams up late decides which of the two streams each sees first; "dial":
    # xb's stream takes long to open, and xa's comes up on xb meanwhile.
    if slow == "low":
        pa.accept_delay_s = 0.3
    elif slow == "high":
        pb.accept_delay_s = 0.3
    elif slow == "dial":
        dial_framed = PeerLink._dial_framed

        async def slow_dial(self: PeerLink, *args: Any) -> Any:
            if self.daemon_id == "xa":  # xb's: it opens once xa's stream is up on xb
                await until(lambda: self.session is not None, 10, "xa's stream taken up on xb")
            return await dial_framed(self, *args)

        monkeypatch.setattr(PeerLink, "_dial_framed", slow_dial)
    if slow == "dial":  # xa starts once xb is dialing
        later = asyncio.ensure_future(pb.connect(a.peer_address))
        await until(lambda: pb.known("xa") is not None and pb.known("xa").dialing, 5, "xb dialing")
        ha = await pa.connect(b.peer_address)
        hb = await later
    else:
        ha, hb = await asyncio.gather(pa.connect(b.peer_address), pb.connect(a.peer_address))
    # Both send at once, before the streams are settled: nothing may be lost.
    abort_msg(ha, 1)
    abort_msg(hb, 2)
    await until(lambda: ia.aborts and ib.aborts, 5, "the messages of both sides")
    await asyncio.sleep(1.5)  # more than the heartbeat limit: a dropped stream is noticed by now
    assert ia.lost == [] and ib.lost == [], (ia.lost, ib.lost)
    assert " lost: " not in logs.text
    assert ib.aborts == [("xa", 1)] and ia.aborts == [("xb", 2)]
    # One stream, alive both ways: the one xa (the lower id) dialed where both did. (Where one's
    # handshake and stream were through before the other began to dial, that one's.)
    assert ha.up and hb.up and ha.session is not None and hb.session is not None
    assert ha.session.ours != hb.session.ours and ha.session.heard and hb.session.heard
    if stream_port == 0:  # the very same connection
        mine, other = wire_of(ha.session)._writer, wire_of(hb.session)._writer
        assert mine.get_extra_info("sockname")[:2] == other.get_extra_info("peername")[:2]
        assert mine.get_extra_info("peername")[:2] == other.get_extra_info("sockname")[:2]
    if slow == "dial":
        assert ha.session.ours and "xa (" in logs.text and "the peer's came up while ours" in logs.text
    abort_msg(ha, 3)
    abort_msg(hb, 4)
    await until(lambda: len(ia.aborts) == 2 and len(ib.aborts) == 2, 5, "later messages")


@pytest.mark.parametrize("stream_port", [0, -1], ids=["framed", "grpc"])
async def test_both_redialing_after_a_blip_settles_on_one_stream(inproc: Any, stream_port: int) -> None:
    # Both drop the pair at once, over and over: their redial loops then dial each other at about
    # the same time, with whatever timing the loop gives. Nothing but the blips may be a loss.
    a = await inproc("ya", transport="local", peer_stream_port=stream_port)
    b = await inproc("yb", transport="local", peer_stream_port=stream_port)
    pa, pb = manager(a), manager(b)
    ia, ib = spy(pa), spy(pb)
    ha = await pa.connect(b.peer_address)
    hb = pb.known("ya")
    assert hb is not None

    def settled() -> bool:
        return all(h.up and h.session is not None and h.session.heard for h in (ha, hb))

    rng = random.Random(stream_port)

    async def connect(pm: PeerManager, d: InProcDaemon, delay: float) -> None:
        await asyncio.sleep(delay)
        await pm.connect(d.peer_address)

    for i in range(8):
        await until(settled, 10, f"round {i}: the pair up again")
        pa.lost(ha, "blip")
        pb.lost(hb, "blip")
        if i % 2:  # both connect at once, one of them up to 20 ms later (else the redial loops do)
            lag = rng.uniform(0, 0.02)
            await asyncio.gather(connect(pa, b, lag if i % 4 == 1 else 0), connect(pb, a, 0 if i % 4 == 1 else lag))
    await until(settled, 10, "the pair up at the end")
    await asyncio.sleep(1.5)
    assert [why for _, why in ia.lost] == ["peer yb lost: blip"] * 8, ia.lost
    assert [why for _, why in ib.lost] == ["peer ya lost: blip"] * 8, ib.lost
    # (Which stream survives depends on whether the redials overlapped: the first one through
    # wins where they did not.)
    assert ha.session is not None and hb.session is not None and ha.session.ours != hb.session.ours
    abort_msg(ha, 1)
    abort_msg(hb, 2)
    await until(lambda: ia.aborts == [("yb", 2)] and ib.aborts == [("ya", 1)], 5, "messages after the blips")


@pytest.mark.parametrize("case", ["lower-redials", "dialer-redials", "higher-redials-later"])
async def test_a_new_stream_from_a_peer_that_lost_the_old_one_fails_what_ran_on_it(
        inproc: Any, logs: Any, case: str) -> None:
    a, b = await inproc("ra", transport="local"), await inproc("rb", transport="local")
    pa, pb = manager(a), manager(b)
    ia, ib = spy(pa), spy(pb)
    if case == "lower-redials":  # rb dialed; ra lost that stream and dials one of its own
        first, other, redialer, holder = pb, a, pa, ib
    elif case == "dialer-redials":  # ra dialed, and dials again
        first, other, redialer, holder = pa, b, pa, ib
    else:  # ra dialed; rb dials one of its own well after that stream settled
        first, other, redialer, holder = pa, b, pb, ia
        pa._first_word = 0.5
    h = await first.connect(other.peer_address)
    await until(lambda: h.session is not None and h.session.heard, 3, "the first stream taken up")
    if case == "higher-redials-later":
        await asyncio.sleep(0.6)
    # The redialer gives its stream up without telling (as if its close were still on the way):
    # its writer hangs (once it has taken its next heartbeat), and it dials anew.
    peer = b if redialer is pa else a
    mine = redialer.by_address(peer.peer_address)
    assert mine is not None and mine.session is not None
    thaw = hang(mine, write=True)
    await asyncio.sleep(0.3)
    mine.session = None
    await redialer.connect(peer.peer_address)
    await until(lambda: holder.lost, 3, "the old stream lost on the other side")
    assert len(holder.lost) == 1 and "opened a new control stream" in holder.lost[0][1], holder.lost
    # The new stream carries both ways; nothing else is lost.
    ha, hb = pa.known("rb"), pb.known("ra")
    assert ha is not None and hb is not None
    await until(lambda: ha.session is not None and hb.session is not None and ha.session.heard
                and hb.session.heard, 3, "the new stream taken up")
    abort_msg(ha, 5)
    abort_msg(hb, 6)
    await until(lambda: ia.aborts == [("rb", 6)] and ib.aborts == [("ra", 5)], 5, "messages on the new stream")
    await asyncio.sleep(1.0)
    assert len(ia.lost) + len(ib.lost) == 1, (ia.lost, ib.lost)
    thaw.set()


# ---------------------------------------------------------------------------- PeerLink, alone


def _link() -> PeerLink:
    link = PeerLink("127.0.0.1:1", Config(heartbeat_interval_s=30.0), Metrics())
    link.up = True
    return link


async def test_tie_break_verdicts() -> None:
    link = _link()
    try:
        now = time.monotonic()
        assert link.race(True, now, 5) == "take" and link.race(False, now, 5) == "take"
        link.dialing = True  # ours is being dialed: the lower id keeps it
        assert link.race(True, now, 5) == "refuse" and link.race(False, now, 5) == "take"
        link.dialing = False
        ours = Session(lambda b: asyncio.sleep(0), lambda: None, ours=True)
        link.attach(ours)  # not taken up yet
        assert link.race(True, now, 5) == "refuse" and link.race(False, now, 5) == "take"
        ours.hear()  # taken up: crossing Hellos are still a tie-break for a while, then a redial
        assert link.race(True, time.monotonic(), 5) == "refuse"
        assert link.race(True, time.monotonic() + 6, 5) == "replace"
        assert link.race(False, time.monotonic(), 5) == "replace"
        theirs = Session(lambda b: asyncio.sleep(0), lambda: None)
        theirs.hear()
        link.attach(theirs)  # a peer that dials twice lost its first stream, whoever is lower
        assert link.race(True, now, 5) == "replace" and link.race(False, now, 5) == "replace"
    finally:
        await link.close()


async def test_a_held_stream_sends_nothing_before_the_peer_speaks_and_a_drop_keeps_the_queue() -> None:
    link = _link()
    sent: dict[str, list[Any]] = {"s1": [], "s2": [], "s3": []}

    def writer(name: str) -> Callable[[Any], Any]:
        async def write(batch: Any) -> None:
            sent[name].append(batch)
        return write

    try:
        s1 = Session(writer("s1"), lambda: None, ours=True, hold=True)
        link.attach(s1)
        abort_msg(link, 1)
        await asyncio.sleep(0.05)
        assert sent["s1"] == [], "a held stream wrote before the peer spoke"
        s1.hear()
        await asyncio.sleep(0.05)
        assert [m.abort.room.id for b in sent["s1"] for m in b.msgs] == [1]
        # A stream refused in a tie-break is dropped: what was queued waits for the next one.
        s2 = Session(writer("s2"), lambda: None, ours=True, hold=True)
        link.attach(s2)
        abort_msg(link, 2)
        link.drop(s2)
        assert link.session is None and s2.closed and s1.closed
        s3 = Session(writer("s3"), lambda: None)
        link.attach(s3)
        await asyncio.sleep(0.05)
        assert sent["s2"] == [] and [m.abort.room.id for b in sent["s3"] for m in b.msgs] == [2]
        # Silence: a stream after `limit`, one not taken up and a missing one after `first_word`.
        t = link.last_rx
        assert link.silent(t + 2.0, 2.0, 5.0) == "" and "no word" in link.silent(t + 5.0, 2.0, 5.0)
        s3.hear()
        assert link.silent(t + 1.0, 2.0, 5.0) == "" and "no word" in link.silent(t + 2.0, 2.0, 5.0)
        link.session = None
        assert link.silent(t + 4.0, 2.0, 5.0) == "" and "no control stream" in link.silent(t + 5.0, 2.0, 5.0)
        link.dialing = True
        assert link.silent(t + 50.0, 2.0, 5.0) == ""
    finally:
        await link.close()


# ---------------------------------------------------------------------------- 5: peers that left are forgotten


async def test_a_peer_down_for_peer_forget_s_is_forgotten_and_no_longer_dialed(inproc: Any) -> None:
    # heartbeat 0.5 s x 2 misses: peer_forget_s may be as short as 1 s.
    a = await inproc("fa", transport="local", peer_forget_s=1.5)
    b = await inproc("fb", transport="local")
    pa = manager(a)
    h = await pa.connect(b.peer_address)
    assert h.up and pa.known("fb") is h
    b.stop.set()
    await asyncio.wait_for(b.task, 30)
    await until(lambda: not h.up, 5, "fb lost")
    assert pa.known("fb") is h  # still known (and redialed) while it may come back
    t_lost = time.monotonic()
    await until(lambda: pa.known("fb") is None and pa.by_address(b.peer_address) is None, 5, "fb forgotten")
    assert time.monotonic() - t_lost >= 1.0  # not before peer_forget_s (less the liveness pass's step)
    assert b.peer_address not in pa._next_dial  # and it is no longer dialed
    await asyncio.sleep(0.5)
    assert pa.by_address(b.peer_address) is None
    assert next(c for c in pa.status().caps if c.name == "peers").used == 0


async def test_a_configured_peer_is_never_forgotten(inproc: Any) -> None:
    b = await inproc("sb", transport="local")
    a = await inproc("sa", transport="local", peer_forget_s=1.0, peers=[b.peer_address])
    pa = manager(a)
    await until(lambda: pa.known("sb") is not None and pa.known("sb").up, 10, "sb dialed")  # type: ignore[union-attr]
    b.stop.set()
    await asyncio.wait_for(b.task, 30)
    await until(lambda: not pa.known("sb").up, 5, "sb lost")  # type: ignore[union-attr]
    await asyncio.sleep(2.0)
    assert pa.known("sb") is not None and pa.by_address(b.peer_address) is not None


async def test_a_new_peer_at_max_peers_evicts_one_long_down(inproc: Any) -> None:
    a = await inproc("ma", transport="local", max_peers=1)
    b = await inproc("mb", transport="local")
    c = await inproc("mc", transport="local")
    pa, pb, pc = manager(a), manager(b), manager(c)
    await pb.connect(a.peer_address)
    await until(lambda: pa.known("mb") is not None and pa.known("mb").up, 5, "mb up at ma")  # type: ignore[union-attr]
    hb = pa.known("mb")
    assert hb is not None
    # At the cap with mb up: mc's handshake is refused.
    with pytest.raises(Exception) as err:
        await pc.connect(a.peer_address)
    assert "peers" in str(err.value), err.value
    b.stop.set()
    await asyncio.wait_for(b.task, 30)
    await until(lambda: not hb.up, 5, "mb lost")
    # Down for the heartbeat limit (1 s): mb makes room for mc, long before peer_forget_s.
    await asyncio.sleep(1.2)
    await pc.connect(a.peer_address)
    await until(lambda: pa.known("mc") is not None and pa.known("mc").up, 5, "mc up at ma")  # type: ignore[union-attr]
    assert pa.known("mb") is None and pa.by_address(b.peer_address) is None


# ---------------------------------------------------------------------------- 6: heartbeat intervals differ


async def test_a_peer_with_a_longer_heartbeat_interval_is_not_lost_for_it(inproc: Any) -> None:
    # fast: 0.5 s x 2 misses = 1 s of silence is a loss; slow writes a keep-alive every 1.5 s
    # (half its 3 s interval). Fast used to lose slow every second or so (a rollout of a new
    # heartbeat_interval_s across a fleet failed every room between old and new daemons).
    fast = await inproc("hf", transport="local", slow_peer_limit_s=0)
    slow = await inproc("hs", transport="local", heartbeat_interval_s=3.0, peer_forget_s=6.0, slow_peer_limit_s=0)
    pf, ps = manager(fast), manager(slow)
    inbox = spy(pf)
    h = await pf.connect(slow.peer_address)
    await until(lambda: ps.known("hf") is not None and ps.known("hf").up, 5, "hf up at hs")  # type: ignore[union-attr]
    assert h.peer_limit_s == 6.0 and ps.known("hf").peer_limit_s == 1.0  # type: ignore[union-attr]
    await asyncio.sleep(4.0)
    assert h.up and inbox.lost == []
    # And a slow peer that does go silent is still lost, after its own limit.
    hang(h, read=True)
    t0 = time.monotonic()
    await until(lambda: inbox.lost, 12, "hs lost once silent")  # (it is redialed at once)
    assert time.monotonic() - t0 >= 4.0 and inbox.lost[0][0] == "hs" and "no word" in inbox.lost[0][1]
