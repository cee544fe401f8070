"""The framed control stream between daemons (kvxferd.peer.wire): rooms run on it, a daemon that
does not serve it is reached over the Session RPC, and it refuses exactly what the RPC refuses.

Real daemons (subprocesses) with a shared peer secret; a hand-made peer (tests.peer_client) with a
real NIXL agent speaks the frames on a raw socket."""

from __future__ import annotations

import secrets
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvxfer_protocol.pb.kvxfer.v1 import peer_pb2
from kvxferd.core.types import DaemonRef
from kvxferd.peer.wire import BATCH, FRAME, REFUSE
from tests.conftest import DaemonProc, spawn_daemon
from tests.faults.harness import fault_command, wait_until
from tests.peer_client import Client, Wire, code_of, nixl_agent, one_room, peer_streams, running, secret_file, status


@dataclass
class Fleet:
    d: dict[str, DaemonProc]
    secret: bytes


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """wa, wb: the framed stream on (the default); wg: peer_stream_port = -1 (Session RPC only);
    wc: max_peers = 1, 8 streams before a Hello; fa, fb, fc, fd: fault injection on. All share a peer secret."""
    wd = Path(tempfile.mkdtemp(prefix="kvxw-"))
    secret = secrets.token_hex(24).encode()
    path = secret_file(wd, "fleet", secret)
    faults = ["--set", "fault_injection=true"]
    specs = {"wa": [], "wb": [], "wg": ["--set", "peer_stream_port=-1"], "wc": ["--set", "max_peers=1", "--set", "max_unauthenticated_streams=8"],
             "fa": faults, "fb": faults, "fc": faults, "fd": faults}
    procs = {n: spawn_daemon(wd, n, "--set", f"peer_secret_file={path}", *a, wait=False) for n, a in specs.items()}
    try:
        with running(procs):
            yield Fleet(procs, secret)
    finally:
        shutil.rmtree(wd, ignore_errors=True)


@pytest.fixture(scope="module")
def agent() -> Iterator[Any]:
    yield from nixl_agent("kvx-wire")


def test_rooms_run_on_the_framed_stream_and_reach_a_daemon_without_one_over_grpc(fleet: Fleet) -> None:
    wa, wb, wg = (fleet.d[n] for n in ("wa", "wb", "wg"))
    assert wa.info["stream_address"] and wb.info["stream_address"]
    assert wg.info["stream_address"] == "", "peer_stream_port = -1 must not listen"
    one_room(wa, wb, 1)
    one_room(wb, wa, 2)
    assert peer_streams(wa).get("framed", 0) >= 1 and peer_streams(wb).get("framed", 0) >= 1
    assert peer_streams(wa).get("grpc", 0) == 0 and peer_streams(wb).get("grpc", 0) == 0, "a Session RPC where frames were due"
    # wg names no framed stream and dials none: both directions fall back to the Session RPC.
    one_room(wa, wg, 3)
    one_room(wg, wb, 4)
    assert peer_streams(wg).get("framed", 0) == 0 and peer_streams(wg).get("grpc", 0) >= 1
    assert peer_streams(wa).get("grpc", 0) >= 1 and peer_streams(wb).get("grpc", 0) >= 1


from tests.peer_client import INVALID_ARGUMENT, PERMISSION_DENIED  # noqa: E402


def test_the_framed_stream_refuses_what_the_session_rpc_refuses(fleet: Fleet, agent: Any, tmp_path: Path) -> None:
    wb = fleet.d["wb"]
    c = Client(wb, fleet.secret, tmp_path)
    me = DaemonRef("wire-client", "inst-1", "127.0.0.1:9")
    try:
        hb = peer_pb2.PeerMsg()
        # A first batch that is not a Hello, and an empty one.
        for first in ((hb,), ()):
            w = Wire(wb)
            w.batch(*first)
            assert w.refusal() == (INVALID_ARGUMENT, "a session starts with a Hello")
            w.close()
        # Frames that are not frames: too long, an unknown kind, bytes that do not parse.
        for payload, kind, length in ((b"", BATCH, 1 << 30), (b"x", 9, None), (b"\xff\xff\xff", BATCH, None)):
            w = Wire(wb)
            w.send(payload, kind, length)
            got = w.frame()
            assert got is None or got[0] == REFUSE, f"{(kind, length)}: the daemon answered {got!r}"
            if got is not None:
                assert w.frame() is None
            w.close()
        # A Hello before any handshake, then after one but without (or with a forged) proof.
        w = Wire(wb)
        w.batch(c.hello(me, wb.info["daemon_id"], None))
        code, why = w.refusal()
        assert code == PERMISSION_DENIED and "has not handshaken" in why, why
        w.close()
        assert "wire-client" not in {p.daemon_id for p in status(wb).peers}
        # A stream address the daemon could not dial is refused with the handshake, and adds nothing.
        bad = c.request(me, agent.name, agent.metadata(), c.auth.signing_keys()[0])
        bad.sender.stream_address = "not-a-hostport"
        code, why = code_of(lambda: c.stub.Handshake(bad, timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "stream_address must be HOST:PORT" in why, (code, why)
        assert "wire-client" not in {p.daemon_id for p in status(wb).peers}
        reply, binding = c.handshake(me, agent.name, agent.metadata())
        for bad in (None, (binding[0], b"n" * 16, binding[2])):
            w = Wire(wb)
            w.batch(c.hello(me, reply.sender.instance_id, bad))
            assert w.refusal()[0] == PERMISSION_DENIED
            w.close()
        # The real thing: accepted, and the daemon speaks (a heartbeat batch within its interval).
        w = Wire(wb)
        w.batch(c.hello(me, reply.sender.instance_id, binding))
        got = w.frame()
        assert got is not None and got[0] == BATCH, got
        peer_pb2.PeerBatch.FromString(got[1])
        assert "wire-client" in {p.daemon_id for p in status(wb).peers}
        w.close()
    finally:
        c.close()
    # The daemon still moves rooms after all of that.
    one_room(fleet.d["wa"], wb, 10)


def test_a_silent_connection_is_closed(fleet: Fleet) -> None:
    w = Wire(fleet.d["wa"])
    t0 = time.monotonic()
    code, why = w.refusal()
    assert code == INVALID_ARGUMENT and time.monotonic() - t0 < 9, (code, why, time.monotonic() - t0)
    w.close()


def test_a_framed_port_that_goes_away_leaves_the_session_rpc(fleet: Fleet) -> None:
    fa, fb = fleet.d["fa"], fleet.d["fb"]
    one_room(fa, fb, 20)
    assert peer_streams(fa).get("framed", 0) >= 1 and peer_streams(fa).get("grpc", 0) == 0
    # Both ports close, as a firewall opened for the peer port only would have it: the stream
    # between them breaks, and every dial of a framed stream from now on is refused.
    for d in (fa, fb):
        fault_command(d, "stream-off")
    # The next room starts once the Session RPC carries the pair: on a loaded machine the switch
    # can outlast the peer timeout (1.1 s here), and a room started in between failed PEER_LOST.
    wait_until(lambda: "framed control stream's port is closed" in fb.log_text()
               and peer_streams(fa).get("grpc", 0) + peer_streams(fb).get("grpc", 0) >= 1,
               10, "the pair to move to the Session RPC", every=0.05)
    one_room(fb, fa, 21)
    one_room(fa, fb, 22)
    assert peer_streams(fa).get("grpc", 0) >= 1 and peer_streams(fb).get("grpc", 0) >= 1
    assert "using the gRPC Session stream instead" in fa.log_text() + fb.log_text()


def test_a_stream_is_given_the_handshake_time_to_be_taken_up(fleet: Fleet) -> None:
    fc, fd = fleet.d["fc"], fleet.d["fd"]
    # fc takes up every stream 2 s late (a loaded node, a slow NIXL metadata load): longer than the
    # 1 s heartbeat limit, shorter than the handshake's 5 s. The decode side (fd) dials fc for the
    # room's bootstrap and hears nothing on its new stream meanwhile; it must not call fc lost.
    fault_command(fc, "slow-accept 2")
    wait_until(lambda: "streams are taken up 2 s late" in fc.log_text(), 10, "the slow-accept fault", every=0.05)
    t0 = time.monotonic()
    one_room(fc, fd, 30)
    assert time.monotonic() - t0 >= 1.5, "the stream was taken up at once: the fault did not hold it"
    assert "accepting the stream from" in fc.log_text()
    assert "no word for" not in fd.log_text() + fc.log_text(), "a stream not taken up yet was called lost"
    fault_command(fc, "slow-accept 0")
    one_room(fd, fc, 31)


def test_streams_that_never_say_hello_are_capped(fleet: Fleet) -> None:
    # Streams before their Hello are strangers' until proven otherwise: past the cap a newcomer
    # evicts the oldest (the listener accepts in arrival order), so held streams never keep a peer out.
    wc = fleet.d["wc"]
    held = [Wire(wc) for _ in range(8)]  # max_unauthenticated_streams = 8
    try:
        extra = Wire(wc)
        assert held[0].frame() is None, "the oldest stream that never said Hello must be evicted"
        extra.batch(peer_pb2.PeerMsg())
        assert extra.refusal() == (INVALID_ARGUMENT, "a session starts with a Hello")
        extra.close()
    finally:
        for w in held:
            w.close()


def test_frame_header_is_length_then_kind() -> None:
    # The layout peers of other versions rely on: u32 length, u8 kind, little-endian.
    assert FRAME.size == 5 and FRAME.pack(5, REFUSE) == struct.pack("<IB", 5, 1)
