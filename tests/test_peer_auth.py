"""Peer trust without mTLS: the shared-secret handshake (HMAC both ways, Hello bound to the
handshake, replay and clock checks, rotation), the default per-host secret (a local user who
cannot read it gets nothing and fails no room), the auth modes and their config errors, the
peer-side caps, and a flood of garbage handshakes that must leave nothing behind.

Real subprocess daemons, real gRPC and NIXL over loopback; the hostile client is this process
(with a NIXL agent of its own, so that its metadata is valid where the test needs it to be).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvxfer_client import DecodeReceiver, RoomFailed
from kvxfer_protocol.pb.kvxfer.v1 import peer_pb2, peer_pb2_grpc
from kvxfer_protocol.version import PROTOCOL_VERSION, parse_protocol
from kvxferd.config import Config, ConfigError, load_config
from kvxferd.core.types import DaemonRef
from kvxferd.peer import host_secret
from kvxferd.peer.auth import Challenge, Proof
from kvxferd.peer.link import proof_of, proof_pb
from tests.conftest import ROOT, DaemonProc, daemon_env, spawn_daemon
from tests.faults.harness import metric
from tests.peer_client import (
    LAYOUT,
    Client,
    caps,
    closed_port,
    code_of,
    nixl_agent,
    one_room,
    running,
    secret_file,
    status,
)

FLOOD = int(os.environ.get("KVX_FLOOD_HANDSHAKES", "1000"))
OK, DENIED, EXHAUSTED = grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass
class Fleet:
    workdir: Path
    d: dict[str, DaemonProc]
    secret: bytes
    files: dict[str, Path]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """sa, sb  share a secret (sb accepts the previous one for 3 s after a rotation)
    sx      another secret
    sn, sm  default settings: the host secret of this uid, shared with no set-up
    sc      the host secret of "another user" (its own host_secret_file), tight caps: 1 peer,
            4 KiB of metadata, 1 handshake at a time
    si      listens on 0.0.0.0 with insecure_peers."""
    wd = Path(tempfile.mkdtemp(prefix="kvxa-"))
    secret = secrets.token_hex(24).encode()
    files = {n: secret_file(wd, n, secret) for n in ("sa", "sb")}
    files["sx"] = secret_file(wd, "sx", secrets.token_hex(24).encode())
    specs: dict[str, list[str]] = {
        "sa": ["--set", f"peer_secret_file={files['sa']}"],
        "sb": ["--set", f"peer_secret_file={files['sb']}", "--set", "peer_secret_overlap_s=3"],
        "sx": ["--set", f"peer_secret_file={files['sx']}"],
        "sn": [],
        "sm": [],
        "sc": ["--set", f"host_secret_file={other_user_secret(wd)}", "--set", "max_peers=1",
               "--set", "max_peer_metadata_bytes=4096", "--set", "max_pending_handshakes=1"],
    }
    procs = {name: spawn_daemon(wd, name, *args, wait=False) for name, args in specs.items()}
    procs["si"] = spawn_daemon(wd, "si", "--set", "insecure_peers=true", wait=False, peer_listen="0.0.0.0:0")
    try:
        with running(procs):
            yield Fleet(wd, procs, secret, files)
    finally:
        shutil.rmtree(wd, ignore_errors=True)


@pytest.fixture(scope="module")
def agent() -> Iterator[Any]:
    yield from nixl_agent("kvx-auth")


def other_user_secret(wd: Path) -> Path:
    """Where daemon sc keeps its host secret: as another uid's would be, a file sn and sm never read."""
    home = wd / "other-user"
    home.mkdir(mode=0o700, exist_ok=True)
    return home / "host-secret"


def failed_room(tx_d: DaemonProc, rx_d: DaemonProc, room: int) -> RoomFailed:
    with DecodeReceiver(socket=rx_d.socket, group=f"x{room}", layout=LAYOUT, ring_bytes=1 << 20) as rx:
        rx.expect(room, tx_d.peer_address, "nobody", 16)
        with pytest.raises(RoomFailed) as ei:
            rx.receive(room, timeout=30)
    return ei.value


# --------------------------------------------------------------------------- config and modes


def test_peer_auth_modes_and_their_config_errors(tmp_path: Path) -> None:
    sock = {"socket": str(tmp_path / "s.sock")}
    assert load_config(None, env={}, overrides=sock).peer_auth_mode == "host-secret"
    assert load_config(None, env={}, overrides={**sock, "insecure_peers": True}).peer_auth_mode == "insecure"
    with pytest.raises(ConfigError, match="not loopback and peers are not authenticated"):
        load_config(None, env={}, overrides={**sock, "peer_listen": "0.0.0.0:7471"})
    insecure = load_config(None, env={}, overrides={**sock, "peer_listen": "0.0.0.0:7471", "insecure_peers": True})
    assert insecure.peer_auth_mode == "insecure"
    good = secret_file(tmp_path, "good", b"s" * 32)
    cfg = load_config(None, env={}, overrides={**sock, "peer_listen": "0.0.0.0:7471", "peer_secret_file": str(good)})
    assert cfg.peer_auth_mode == "secret"
    loose = secret_file(tmp_path, "loose", b"s" * 32)
    loose.chmod(0o640)
    with pytest.raises(ConfigError, match=r"accessible by group or others .*chmod 600"):
        load_config(None, env={}, overrides={**sock, "peer_secret_file": str(loose)})
    with pytest.raises(ConfigError, match="fewer than 16 bytes"):
        load_config(None, env={}, overrides={**sock, "peer_secret_file": str(secret_file(tmp_path, "short", b"x"))})
    with pytest.raises(ConfigError, match="choose one"):
        Config(socket=sock["socket"], peer_secret_file=str(good), tls_client_auth=True, tls_ca=str(good),
               tls_cert=str(good), tls_key=str(good)).validate()
    for key, bad in (("max_peers", 0), ("max_pending_handshakes", 0), ("max_peer_metadata_bytes", 100),
                     ("max_peer_batch_msgs", 10)):
        with pytest.raises(ConfigError, match=key):
            load_config(None, env={}, overrides={**sock, key: bad})


def test_the_host_secret_is_made_private_once_and_refused_when_planted(tmp_path: Path) -> None:
    """Created 0600 in a 0700 directory, the same bytes for every daemon of the uid (racing ones
    included); a planted symlink (file or directory), loose modes or a foreign owner are refused."""
    path = tmp_path / "home" / "host-secret"
    with futures.ThreadPoolExecutor(8) as pool:
        got = set(pool.map(lambda _: host_secret.load(str(path)), range(8)))
    assert len(got) == 1 and len(got.pop()) >= host_secret.MIN_BYTES
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["host-secret"], "a temporary file was left behind"
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    (planted / "host-secret").symlink_to(path)
    with pytest.raises(ConfigError, match="cannot be opened"):
        host_secret.load(str(planted / "host-secret"))
    (tmp_path / "linked").symlink_to(path.parent)
    with pytest.raises(ConfigError, match=r"directory .* cannot be opened"):
        host_secret.load(str(tmp_path / "linked" / "host-secret"))
    path.parent.chmod(0o770)
    with pytest.raises(ConfigError, match="not group/other-writable"):
        host_secret.load(str(path))
    path.parent.chmod(0o700)
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="mode 0600"):
        host_secret.load(str(path))
    path.chmod(0o600)
    if os.geteuid() == 0:  # (root can hand the file and the directory to another uid)
        os.chown(path, 65534, 65534)
        with pytest.raises(ConfigError, match="owned by uid 0"):
            host_secret.load(str(path))
        os.chown(path.parent, 65534, 65534)
        with pytest.raises(ConfigError, match="owned by uid 65534"):
            host_secret.load(str(path))


def test_a_non_loopback_daemon_without_peer_authentication_refuses_to_start(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvxferd", "serve", "--socket", str(tmp_path / "s.sock"),
                        "--peer-listen", "0.0.0.0:0", "--metrics-port", "-1"],
                       capture_output=True, text=True, timeout=60, env=daemon_env(), cwd=ROOT)
    assert r.returncode == 2, r
    assert "not loopback and peers are not authenticated" in r.stderr and "insecure_peers" in r.stderr, r.stderr
    # A loopback daemon whose host secret would sit in a directory others may write: one line, exit 2.
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    r = subprocess.run([sys.executable, "-m", "kvxferd", "serve", "--socket", str(tmp_path / "h.sock"),
                        "--metrics-port", "-1", "--set", f"host_secret_file={loose / 'host-secret'}"],
                       capture_output=True, text=True, timeout=60, env=daemon_env(), cwd=ROOT)
    assert r.returncode == 2 and "not group/other-writable" in r.stderr.splitlines()[-1], r


def test_auth_mode_shows_in_status_metrics_and_log(fleet: Fleet) -> None:
    for name, mode in (("sa", "secret"), ("sn", "host-secret"), ("si", "insecure")):
        d = fleet.d[name]
        assert status(d).peer_auth == mode, name
        assert metric(d, "kvxferd_peer_auth_mode", f'mode="{mode}"') == 1.0, name
        assert metric(d, "kvxferd_peer_auth_mode", 'mode="mtls"') == 0.0, name
    assert "insecure_peers: the peer service" in fleet.d["si"].log_text()
    assert "insecure_peers" not in fleet.d["sn"].log_text()


# --------------------------------------------------------------------------- shared secret


def test_secret_peers_complete_a_room_and_refuse_daemons_without_the_secret(fleet: Fleet) -> None:
    sa, sb, sx, sn = (fleet.d[n] for n in ("sa", "sb", "sx", "sn"))
    one_room(sa, sb, 1)
    room = 2
    for bad in (sx, sn):
        # Either side dialing: the secret daemon refuses the other's handshake or its reply.
        for tx, rx in ((sa, bad), (bad, sa)):
            failed = failed_room(tx, rx, room)
            room += 1
            assert failed.failure_code in ("PEER_LOST", "MISMATCH"), failed
    assert {p.daemon_id for p in status(sa).peers} == {"sb"}
    assert "sa" not in {p.daemon_id for p in status(sx).peers}


def test_handshake_proofs_are_checked_both_ways_and_bind_the_session(fleet: Fleet, agent: Any, tmp_path: Path) -> None:
    sb = fleet.d["sb"]
    c = Client(sb, fleet.secret, tmp_path)
    wrong = Client(sb, secrets.token_hex(24).encode(), tmp_path)
    md = agent.metadata()
    me = DaemonRef("hs-client", "inst-1", "127.0.0.1:9")
    key = c.auth.signing_keys()[0]
    try:
        hs = c.stub.Handshake
        assert code_of(lambda: hs(c.request(me, agent.name, md), timeout=10))[0] == DENIED  # no proof
        assert code_of(lambda: hs(wrong.request(me, agent.name, md, wrong.auth.signing_keys()[0]), timeout=10))[0] == DENIED
        stale = c.auth.request_proof(me, agent.name, md, key, c.challenge())
        assert stale is not None
        old = Proof(stale.nonce, stale.unix_ms - 120_000, stale.mac, stale.peer_nonce)
        assert code_of(lambda: hs(c.request(me, agent.name, md, proof=old), timeout=10))[0] == DENIED
        # A proof for other metadata (or another id) does not cover this request.
        other = c.auth.request_proof(me, agent.name, md + b"x", key, c.challenge())
        assert code_of(lambda: hs(c.request(me, agent.name, md, proof=other), timeout=10))[0] == DENIED
        # Nor one for a challenge sb never issued, or for another instance of sb.
        real = c.challenge()
        for made_up in (Challenge(real.instance_id, secrets.token_bytes(16)), Challenge("other-instance", real.nonce)):
            code, why = code_of(lambda ch=made_up: hs(c.request(me, agent.name, md, key, challenge=ch), timeout=10))
            assert code == DENIED, (made_up, code, why)
        assert "hs-client" not in {p.daemon_id for p in status(sb).peers}
        # The real thing: accepted, and the reply proves sb holds the secret too.
        req = c.request(me, agent.name, md, key)
        reply = hs(req, timeout=10)
        sent = proof_of(req)
        peer = DaemonRef(reply.sender.daemon_id, reply.sender.instance_id, reply.sender.address)
        binding = c.auth.verify_reply(peer, reply.agent_name, bytes(reply.nixl_metadata), me, sent, key, proof_of(reply))
        with pytest.raises(Exception, match="does not match"):
            c.auth.verify_reply(peer, reply.agent_name, bytes(reply.nixl_metadata) + b"x", me, sent, key, proof_of(reply))
        code, why = code_of(lambda: hs(req, timeout=10))
        assert code == DENIED and "challenge unknown, expired or used" in why, (code, why)

        def session(proof: Proof | None) -> tuple[grpc.StatusCode, str]:
            hello = peer_pb2.PeerMsg(hello=peer_pb2.Hello(
                sender=req.sender, peer_instance_id=peer.instance_id, proof=proof_pb(proof)))
            return code_of(lambda: list(c.stub.Session(iter([peer_pb2.PeerBatch(msgs=[hello])]), timeout=10)))

        assert session(None)[0] == DENIED
        forged = c.auth.hello_proof(me, peer.instance_id, (binding[0], b"n" * 16, key))
        assert session(forged)[0] == DENIED
        unkeyed = wrong.auth.hello_proof(me, peer.instance_id, (binding[0], binding[1], wrong.auth.signing_keys()[0]))
        assert session(unkeyed)[0] == DENIED
        assert session(c.auth.hello_proof(me, peer.instance_id, binding))[0] == OK
    finally:
        c.close()
        wrong.close()


def test_handshakes_refuse_another_protocol_major_and_name_both_versions(fleet: Fleet, agent: Any,
                                                                         tmp_path: Path) -> None:
    sb = fleet.d["sb"]
    c = Client(sb, fleet.secret, tmp_path)
    md, key = agent.metadata(), c.auth.signing_keys()[0]
    me = DaemonRef("hs-version", "inst-1", "127.0.0.1:9")
    ours = parse_protocol(PROTOCOL_VERSION)
    assert ours is not None
    try:
        for theirs in (f"{ours[0] + 1}.0", f"{ours[0] + 1}.{ours[1]}.3", "", "v-next"):
            code, why = code_of(lambda v=theirs: c.stub.Handshake(c.request(me, agent.name, md, key, version=v),
                                                                   timeout=10))
            assert code == grpc.StatusCode.FAILED_PRECONDITION, (theirs, code, why)
            assert PROTOCOL_VERSION in why and theirs in why, (theirs, why)
        assert "hs-version" not in {p.daemon_id for p in status(sb).peers}
        # A newer MINOR of the same MAJOR works; the reply names the responder's own version.
        reply = c.stub.Handshake(c.request(me, agent.name, md, key, version=f"{ours[0]}.{ours[1] + 1}"), timeout=10)
        assert reply.version == PROTOCOL_VERSION and reply.sender.daemon_id
    finally:
        c.close()


def test_secret_rotation_accepts_the_previous_secret_for_the_overlap(fleet: Fleet, agent: Any, tmp_path: Path) -> None:
    sb = fleet.d["sb"]
    new = secrets.token_hex(24).encode()
    old_c, new_c = Client(sb, fleet.secret, tmp_path), Client(sb, new, tmp_path)
    md = agent.metadata()

    def handshake(c: Client, n: int) -> grpc.StatusCode:
        ref = DaemonRef(f"rot-{n}", f"i-{n}", f"127.0.0.1:{20000 + n}")
        return code_of(lambda: c.stub.Handshake(c.request(ref, agent.name, md, c.auth.signing_keys()[0]), timeout=10))[0]

    try:
        assert handshake(new_c, 1) == DENIED
        secret_file(fleet.workdir, "sb", new)  # rewrites sb's file in place
        time.sleep(1.5)  # the file is looked at once a second at most
        assert handshake(new_c, 2) == OK
        assert handshake(old_c, 3) == OK, "the previous secret was refused inside the overlap"
        time.sleep(3.5)
        assert handshake(old_c, 4) == DENIED, "the previous secret still works after the overlap"
        assert handshake(new_c, 5) == OK
        assert "rotated" in sb.log_text() and fleet.secret.decode() not in sb.log_text()
    finally:
        secret_file(fleet.workdir, "sb", fleet.secret)
        old_c.close()
        new_c.close()
        time.sleep(1.5)


# --------------------------------------------------------------------------- caps


def test_peer_caps_are_refused_by_name_and_shown(fleet: Fleet, agent: Any, tmp_path: Path) -> None:
    sc = fleet.d["sc"]
    c = Client(sc, host_secret.load(str(other_user_secret(fleet.workdir))), tmp_path)
    md = agent.metadata()
    try:
        got = caps(sc)
        assert got == {"peers": (0, 1), "peer_addresses": (0, 2), "pending_handshakes": (0, 1),
                       "peer_metadata_bytes": (0, 4096), "peer_batch_msgs": (0, 4096)}, got
        assert metric(sc, "kvxferd_cap_limit", 'cap="peers"') == 1.0
        big = c.request(DaemonRef("p0", "i", "127.0.0.1:7"), agent.name, b"m" * 5000)
        code, why = code_of(lambda: c.stub.Handshake(big, timeout=10))
        assert code == EXHAUSTED and "peer_metadata_bytes" in why, (code, why)
        key = c.auth.signing_keys()[0]
        first = c.stub.Handshake(c.request(DaemonRef("p1", "i-0", "127.0.0.1:7"), agent.name, md, key), timeout=10)
        code, why = code_of(lambda: c.stub.Handshake(c.request(DaemonRef("p2", "i", "127.0.0.1:8"), agent.name, md,
                                                               key), timeout=10))
        assert code == EXHAUSTED and "cap peers" in why, (code, why)
        assert {p.daemon_id for p in status(sc).peers} == {"p1"}
        # Concurrent handshakes (p1 restarting over and over): beyond one in progress, refused.
        with futures.ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(lambda i: code_of(lambda: c.stub.Handshake(c.request(
                DaemonRef("p1", f"i-{i + 1}", "127.0.0.1:7"), agent.name, md, key), timeout=20)), range(16)))
        refused = [w for k, w in codes if k == EXHAUSTED]
        assert refused and all("pending_handshakes" in w for w in refused), codes
        assert all(k in (OK, EXHAUSTED) for k, _ in codes), codes
        assert caps(sc)["pending_handshakes"] == (0, 1)
        # A batch over max_peer_batch_msgs ends the caller's own stream.
        p1 = DaemonRef("p1", "i-last", "127.0.0.1:7")
        last, binding = c.handshake(p1, agent.name, md)
        hello = c.hello(p1, last.sender.instance_id, binding)
        batches = [peer_pb2.PeerBatch(msgs=[hello]), peer_pb2.PeerBatch(msgs=[peer_pb2.PeerMsg()] * 4097)]
        code, why = code_of(lambda: list(c.stub.Session(iter(batches), timeout=10)))
        assert code == EXHAUSTED and "peer_batch_msgs" in why, (code, why)
        assert first.sender.daemon_id == "sc"
        got = caps(sc)
        assert got["peers"] == (1, 1) and got["peer_metadata_bytes"][0] == len(md), got
        assert sc.proc.poll() is None
    finally:
        c.close()


# --------------------------------------------------------------------------- garbage floods


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _idle_cpu(pid: int, seconds: float = 2.0) -> float:
    t0 = _cpu_s(pid)
    time.sleep(seconds)
    return (_cpu_s(pid) - t0) / seconds


def test_garbage_handshakes_leave_nothing_behind(fleet: Fleet, agent: Any, tmp_path: Path) -> None:
    """FLOOD handshakes with distinct ids and addresses and no valid proof (none, random, another
    secret's, a stale one of ours, valid metadata or garbage) while a room is in flight: all
    refused, the peer table unchanged, nothing dialed, CPU back to idle, RSS flat, log lines
    rate-limited, and the room byte-exact."""
    sa, sb = fleet.d["sa"], fleet.d["sb"]
    one_room(sa, sb, 10)  # warm: the pair is handshaken, its first-room allocations made
    pid = sb.proc.pid
    before_peers, before_caps = {p.daemon_id for p in status(sb).peers}, caps(sb)
    refusals0 = metric(sb, "kvxferd_peer_refusals_total", 'reason="handshake"')
    log0 = sb.log_text().count("peer request refused")
    idle0, rss0 = _idle_cpu(pid), _rss_kib(pid)
    ours, theirs = Client(sb, fleet.secret, tmp_path), Client(sb, secrets.token_hex(24).encode(), tmp_path)
    md = agent.metadata()
    codes: dict[str, int] = {}

    def flood() -> None:
        key, bad_key = ours.auth.signing_keys()[0], theirs.auth.signing_keys()[0]
        for i in range(FLOOD):
            ref = DaemonRef(f"junk-{i}", f"i-{i}", f"10.{(i >> 8) & 255}.{i & 255}.1:{1024 + i}")
            meta = md if i % 2 else secrets.token_bytes(64 + i % 300)
            kind = i % 4
            if kind == 0:
                req = ours.request(ref, agent.name, meta)
            elif kind == 1:
                req = ours.request(ref, agent.name, meta, proof=Proof(secrets.token_bytes(16), int(time.time() * 1000),
                                                                      secrets.token_bytes(32)))
            elif kind == 2:
                req = theirs.request(ref, agent.name, meta, bad_key)
            else:
                p = ours.auth.request_proof(ref, agent.name, meta, key, ours.challenge())
                assert p is not None
                req = ours.request(ref, agent.name, meta, proof=Proof(p.nonce, p.unix_ms - 600_000, p.mac))
            code, _ = code_of(lambda req=req: ours.stub.Handshake(req, timeout=10))
            codes[code.name] = codes.get(code.name, 0) + 1

    try:
        t0 = time.monotonic()
        one_room(sa, sb, 11, mid=flood)
        took = time.monotonic() - t0
    finally:
        ours.close()
        theirs.close()
    print(f"flood: {FLOOD} handshakes in {took:.1f} s: {codes}")
    assert codes == {"PERMISSION_DENIED": FLOOD}, codes
    time.sleep(1.0)
    idle1, rss1 = _idle_cpu(pid), _rss_kib(pid)
    print(f"sb idle CPU {idle0:.3f} -> {idle1:.3f} cores, RSS {rss0 >> 10} -> {rss1 >> 10} MiB")
    assert {p.daemon_id for p in status(sb).peers} == before_peers
    assert caps(sb)["peers"] == before_caps["peers"] and caps(sb)["peer_addresses"] == before_caps["peer_addresses"]
    assert caps(sb)["pending_handshakes"][0] == 0
    assert metric(sb, "kvxferd_peer_refusals_total", 'reason="handshake"') - refusals0 == FLOOD
    assert idle1 <= idle0 + 0.05, f"the daemon keeps working after the flood: {idle0:.3f} -> {idle1:.3f} cores"
    assert rss1 - rss0 < 16 << 10, f"RSS grew {(rss1 - rss0) >> 10} MiB"
    logged = sb.log_text().count("peer request refused") - log0
    assert logged <= 2 + took / 10, f"{logged} refusal lines for {FLOOD} refusals"
    one_room(sa, sb, 12)


def test_handshakes_with_bad_metadata_leave_no_link(fleet: Fleet, tmp_path: Path) -> None:
    """With the host secret (the default), a handshake whose NIXL metadata does not load is refused
    and leaves no link (no gRPC channel, no address) behind: the address count is unchanged. So
    does a dial to an address where nothing answers."""
    sn = fleet.d["sn"]
    c = Client(sn, host_secret.load(host_secret.default_path()), tmp_path)
    before = caps(sn)["peer_addresses"]
    try:
        for i in range(200):
            md = secrets.token_bytes(100)
            req = c.request(DaemonRef(f"bad-{i}", "i", f"10.9.{i}.1:{2000 + i}"), "agent", md, c.auth.signing_keys()[0])
            assert code_of(lambda req=req: c.stub.Handshake(req, timeout=10))[0] == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        c.close()
    assert caps(sn)["peer_addresses"] == before
    assert not any(p.daemon_id.startswith("bad-") for p in status(sn).peers)
    # Dialing out to addresses where no daemon answers leaves no link behind either.
    with DecodeReceiver(socket=sn.socket, group="nowhere", layout=LAYOUT, ring_bytes=1 << 20) as rx:
        for i in range(10):
            rx.expect(500 + i, f"127.0.0.1:{closed_port()}", "g", 16)
        for i in range(10):
            with pytest.raises(RoomFailed):
                rx.receive(500 + i, timeout=30)
    assert caps(sn)["peer_addresses"] == before


# --------------------------------------------------------------------------- issue #36: the default, replays


def test_a_local_user_without_the_host_secret_gets_nothing_and_fails_no_room(fleet: Fleet, agent: Any,
                                                                             tmp_path: Path) -> None:
    """Default daemons sn and sm pair with no set-up (the host secret of this uid, 0600). A local
    user who cannot read it (a client without it, and with root a real other uid that tries to)
    gets a challenge and nothing else: no NIXL metadata, and a forged restart of sm (its id, a new
    instance) or a Hello claiming sm's live instance is refused while a room sm -> sn runs,
    byte-exact. A daemon of "another user" (sc, its own host secret) pairs with neither."""
    sn, sm, sc = fleet.d["sn"], fleet.d["sm"], fleet.d["sc"]
    path = host_secret.default_path()
    st = os.stat(path)
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o600, (path, oct(st.st_mode))
    if os.geteuid() == 0:
        from tests.test_security import as_user

        def read_errno() -> int:
            try:
                with open(path, "rb"):
                    return 0
            except OSError as exc:
                return exc.errno or 97

        assert as_user(65534, 65534, read_errno) != 0, "another uid can read the host secret"
    one_room(sn, sm, 40)  # the default pairs, both ways
    stranger, wrong = Client(sn, None, tmp_path), Client(sn, secrets.token_hex(32).encode(), tmp_path)
    md = agent.metadata()
    sm_instance = status_instance(sm)
    seen: list[tuple[grpc.StatusCode, str]] = []

    def attack() -> None:
        c = stranger.stub.Challenge(peer_pb2.ChallengeRequest(), timeout=10)
        assert {f.name for f, _ in c.ListFields()} == {"instance_id", "nonce"}, c
        for who, addr in (("sm", sm.peer_address), ("intruder", "127.0.0.1:9")):
            ref = DaemonRef(who, "forged-restart", addr)
            seen.append(code_of(lambda ref=ref: stranger.stub.Handshake(stranger.request(ref, agent.name, md),
                                                                        timeout=10)))
            seen.append(code_of(lambda ref=ref: wrong.stub.Handshake(
                wrong.request(ref, agent.name, md, wrong.auth.signing_keys()[0]), timeout=10)))
        hello = stranger.hello(DaemonRef("sm", sm_instance, sm.peer_address), status_instance(sn), None)
        seen.append(code_of(lambda: list(stranger.stub.Session(iter([peer_pb2.PeerBatch(msgs=[hello])]), timeout=10))))

    try:
        before, lost0 = {p.daemon_id: p.state for p in status(sn).peers}, sn.log_text().count("restarted")
        one_room(sm, sn, 41, mid=attack)
    finally:
        stranger.close()
        wrong.close()
    # Refused: no HandshakeReply, so no NIXL metadata, went to any of them.
    assert [code for code, _ in seen] == [DENIED] * 5, seen
    after = {p.daemon_id: p.state for p in status(sn).peers}
    assert after.get("sm") == before.get("sm") == "up" and "intruder" not in after, (before, after)
    assert sn.log_text().count("restarted") == lost0, "a forged handshake was taken for sm's restart"
    for tx, rx in ((sc, sn), (sn, sc)):
        assert failed_room(tx, rx, 42 if tx is sc else 43).failure_code in ("PEER_LOST", "MISMATCH")
    assert "sc" not in {p.daemon_id for p in status(sn).peers}


def status_instance(d: DaemonProc) -> str:
    """The daemon's own instance id, as its peers see it."""
    with grpc.insecure_channel(d.peer_address) as ch:
        return str(peer_pb2_grpc.PeerStub(ch).Heartbeat(peer_pb2.HeartbeatRequest(), timeout=10).sender.instance_id)


def test_a_captured_handshake_is_refused_after_the_responder_restarts(fleet: Fleet, agent: Any,
                                                                      tmp_path: Path) -> None:
    """A secret-mode Handshake captured on the wire is refused by the instance that took it, and
    by the same daemon after a restart (its proof covers the old instance's challenge); a fresh
    handshake with the restarted daemon works."""
    args = ("--set", f"peer_secret_file={fleet.files['sa']}")
    me, md = DaemonRef("replayer", "inst-r", "127.0.0.1:9"), agent.metadata()
    with running({"sr": spawn_daemon(fleet.workdir, "sr", *args, wait=False)}) as procs:
        c = Client(procs["sr"], fleet.secret, tmp_path)
        try:
            captured = c.request(me, agent.name, md, c.auth.signing_keys()[0])
            first = c.stub.Handshake(captured, timeout=10).sender.instance_id
            code, why = code_of(lambda: c.stub.Handshake(captured, timeout=10))
            assert code == DENIED and "challenge" in why, (code, why)
        finally:
            c.close()
    with running({"sr": spawn_daemon(fleet.workdir, "sr", *args, wait=False)}) as procs:
        c = Client(procs["sr"], fleet.secret, tmp_path)
        try:
            code, why = code_of(lambda: c.stub.Handshake(captured, timeout=10))
            assert code == DENIED and "challenge unknown, expired or used" in why, (code, why)
            assert "replayer" not in {p.daemon_id for p in status(procs["sr"]).peers}
            reply, _ = c.handshake(me, agent.name, md)
            assert reply.sender.daemon_id == "sr" and reply.sender.instance_id != first
        finally:
            c.close()
