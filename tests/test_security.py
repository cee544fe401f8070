"""Who may talk to a daemon: the engine socket's permissions (checked by connecting as other
users), TLS and mutual TLS on the TCP listeners (certificates made here with `cryptography`), two
daemons completing a room over mTLS while peers without a valid client certificate are refused,
request size limits, and no listener on a non-loopback address unless configured.
"""

from __future__ import annotations

import asyncio
import datetime
import errno
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvxfer_client import (
    AsyncPrefillSender,
    DecodeReceiver,
    KvxferError,
    Layout,
    PrefillSender,
    RoomFailed,
    Tls,
    async_daemon_status,
    daemon_status,
)
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc
from kvxfer_protocol.version import PROTOCOL_VERSION
from kvxferd.config import Config
from tests.conftest import ROOT, DaemonProc, daemon_env, spawn_daemon, wait_ready
from tests.peer_client import PERMISSION_DENIED, Wire, peer_streams

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16)
NOBODY = 65534  # nobody / nogroup on Debian


# --------------------------------------------------------------------------- other users


def as_user(uid: int, gid: int, fn: Callable[[], int]) -> int:
    """Runs fn in a forked child that dropped to uid/gid (supplementary groups: just gid) and
    returns its exit code. A fork, not a new interpreter: this one lives under /root (0700)."""
    pid = os.fork()
    if pid == 0:  # child: no threads, no grpc; plain syscalls, then _exit
        code = 98
        try:
            os.setgroups([gid])
            os.setgid(gid)
            os.setuid(uid)
            code = fn()
        except BaseException:
            code = 99
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def connect_errno(path: str) -> Callable[[], int]:
    def go() -> int:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError as exc:
            return exc.errno or 97
        finally:
            s.close()
        return 0

    return go


def register(socket_path: str) -> engine_pb2.RegisterEngineReply:
    with grpc.insecure_channel(f"unix:{socket_path}") as ch:
        return engine_pb2_grpc.EngineStub(ch).RegisterEngine(engine_pb2.RegisterEngineRequest(
            role=engine_pb2.ROLE_PREFILL, group="sec", layout=LAYOUT.to_pb(),
            parallel=common_pb2.Parallelism(tp_size=1), ring_bytes=1 << 20, lease_ms=60_000,
        ), timeout=10)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to other uids needs root (CI runs as root)")


@dataclass
class Fleet:
    workdir: Path
    d: dict[str, DaemonProc]


@pytest.fixture(scope="module")
def fleet(pki: Pki) -> Iterator[Fleet]:
    """Every daemon these tests need, started at once (each spends seconds starting NIXL):
    plain   default settings, but a 64 KiB request limit
    grp     engine socket 0660 for group nogroup
    tls     TLS on the peer service and a TCP engine listener, no client certificates
    pre/dec mutual TLS (pre also has a TCP engine listener)
    rogue   trusts our CA but presents a certificate of another CA
    liar    mutual TLS with a valid certificate that names another daemon (pre)."""
    wd = Path(tempfile.mkdtemp(prefix="kvxs-"))
    specs = {
        "plain": ["--set", "max_message_bytes=65536"],
        "grp": ["--set", "socket_mode=0o660", "--set", "socket_group=nogroup"],
        "tls": ["--listen", "127.0.0.1:0", *pki.daemon_args("tls", client_auth=False)],
        "pre": ["--listen", "127.0.0.1:0", *pki.daemon_args("pre", client_auth=True)],
        "dec": pki.daemon_args("dec", client_auth=True),
        "rogue": pki.daemon_args("rogue", client_auth=True),
        "liar": pki.daemon_args("pre", client_auth=True),
    }
    procs = {name: spawn_daemon(wd, name, *args, wait=False) for name, args in specs.items()}
    try:
        for p in procs.values():
            wait_ready(p)
        # Let everyone traverse the directory: only the sockets' own modes may stop them.
        os.chmod(wd, 0o755)
        yield Fleet(wd, procs)
    finally:
        for p in procs.values():  # all at once: each drains on its own
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.stop(timeout=30)
        shutil.rmtree(wd, ignore_errors=True)


@needs_root
def test_engine_socket_and_pool_are_private_to_the_daemon_user(fleet: Fleet) -> None:
    d = fleet.d["plain"]
    st = os.stat(d.socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    # The pool is handed out on <socket>.pool (fd passing): that socket is the gate to it.
    pool = register(d.socket).pool_socket
    assert stat.S_IMODE(os.stat(pool).st_mode) == 0o600
    assert as_user(NOBODY, NOBODY, connect_errno(d.socket)) == errno.EACCES
    assert as_user(NOBODY, NOBODY, connect_errno(pool)) == errno.EACCES
    assert as_user(NOBODY, NOBODY, connect_errno(d.socket + ".lane")) == errno.EACCES
    assert as_user(os.geteuid(), os.getegid(), connect_errno(d.socket)) == 0  # the probe itself works


@needs_root
def test_socket_group_lets_its_members_in_and_nobody_else(fleet: Fleet) -> None:
    d = fleet.d["grp"]
    st = os.stat(d.socket)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == NOBODY
    pool = register(d.socket).pool_socket
    pst = os.stat(pool)
    assert stat.S_IMODE(pst.st_mode) == 0o660 and pst.st_gid == NOBODY, "engines of the group could not get the pool"
    # A member of the group (uid nobody, gid nogroup) may connect to all three sockets ...
    for path in (d.socket, pool, d.socket + ".lane"):
        assert as_user(NOBODY, NOBODY, connect_errno(path)) == 0, path
    # ... a user outside it to none.
    for path in (d.socket, pool, d.socket + ".lane"):
        assert as_user(54321, 54321, connect_errno(path)) == errno.EACCES, path


# --------------------------------------------------------------------------- certificates


# Certificates issued by the test CA, each naming its daemon id (URI SAN kvxferd://daemon/<name>);
# "rogue" is issued by another CA.
ISSUED = ("pre", "dec", "tls", "client", "attacker")


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca: Path
    rogue_ca: Path

    def cert(self, name: str) -> Path:
        return self.dir / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    def daemon_args(self, name: str, client_auth: bool) -> list[str]:
        return ["--set", f"tls_cert={self.cert(name)}", "--set", f"tls_key={self.key(name)}", "--set",
                f"tls_ca={self.ca}", "--set", f"tls_client_auth={'true' if client_auth else 'false'}"]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate, cn: str,
          uri: str = "") -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """One certificate per daemon, for both sides of peer channels (server and client auth); it
    names the daemon id `cn` as a URI SAN (or `uri` instead), which binds the id to the certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.UniformResourceIdentifier(uri or f"kvxferd://daemon/{cn}")]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _write(path: Path, key: ec.EllipticCurvePrivateKey | None = None, cert: x509.Certificate | None = None) -> Path:
    if key is not None:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        path.chmod(0o600)
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca = _ca("kvxferd test CA")
    rca_key, rca = _ca("rogue CA")
    pki = Pki(d, _write(d / "ca.pem", cert=ca), _write(d / "rogue-ca.pem", cert=rca))
    for name, (issuer_key, issuer) in {**{n: (ca_key, ca) for n in ISSUED}, "rogue": (rca_key, rca)}.items():
        key, cert = _leaf(issuer_key, issuer, name)
        _write(pki.key(name), key=key)
        _write(pki.cert(name), cert=cert)
    # Issue #36 class 8: our CA, the victim's id "pre" in the CN, and a URI SAN naming something else.
    key, cert = _leaf(ca_key, ca, "pre", uri="spiffe://example.org/ns/x/sa/other")
    _write(pki.key("uri-other"), key=key)
    _write(pki.cert("uri-other"), cert=cert)
    return pki


# --------------------------------------------------------------------------- TLS listeners


def engine_status(target: str, creds: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    ch = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
    with ch:
        try:
            engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def peer_status(target: str, creds: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """A Heartbeat with no sender: any application answer (INVALID_ARGUMENT) means we got in."""
    ch = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
    with ch:
        try:
            peer_pb2_grpc.PeerStub(ch).Heartbeat(peer_pb2.HeartbeatRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def creds(pki: Pki, root: Path | None = None, client: tuple[Path, Path] | None = None) -> grpc.ChannelCredentials:
    kw: dict[str, Any] = {"root_certificates": (root or pki.ca).read_bytes()}
    if client is not None:
        kw["certificate_chain"], kw["private_key"] = client[0].read_bytes(), client[1].read_bytes()
    return grpc.ssl_channel_credentials(**kw)


IN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
REFUSED = grpc.StatusCode.UNAVAILABLE


def test_tls_on_engine_and_peer_listeners(fleet: Fleet, pki: Pki) -> None:
    d = fleet.d["tls"]
    engine_tcp = str(d.info["engine_tcp"])
    assert engine_tcp.startswith("127.0.0.1:")
    for target, call in ((engine_tcp, engine_status), (d.peer_address, peer_status)):
        assert call(target, None) == REFUSED, f"plaintext accepted on {target}"
        assert call(target, creds(pki, root=pki.rogue_ca)) == REFUSED, "a client trusted a certificate it should not"
        assert call(target, creds(pki)) in IN, f"TLS client refused on {target}"
    # The Unix socket stays plaintext (local, guarded by file permissions).
    assert engine_status(f"unix:{d.socket}", None) == grpc.StatusCode.OK


def test_mutual_tls_refuses_clients_without_a_valid_certificate(fleet: Fleet, pki: Pki) -> None:
    d = fleet.d["pre"]
    for target, call in ((str(d.info["engine_tcp"]), engine_status), (d.peer_address, peer_status)):
        assert call(target, None) == REFUSED
        assert call(target, creds(pki)) == REFUSED, "no client certificate, yet accepted"
        assert call(target, creds(pki, client=(pki.cert("rogue"), pki.key("rogue")))) == REFUSED, \
            "rogue client certificate accepted"
        assert call(target, creds(pki, client=(pki.cert("client"), pki.key("client")))) in IN


def test_two_daemons_with_mutual_tls_complete_a_room_and_refuse_a_rogue_peer(fleet: Fleet) -> None:
    # rogue trusts the real CA (so it accepts pre's server certificate) but presents a
    # certificate of another CA: only the client-certificate check can stop it. plain has no TLS.
    pre, dec, rogue, plain = (fleet.d[n] for n in ("pre", "dec", "rogue", "plain"))
    chunks = [bytes([i + 1]) * (16 * 256) for i in range(3)]
    with PrefillSender(socket=pre.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx, \
            DecodeReceiver(socket=dec.socket, group="gd", layout=LAYOUT, ring_bytes=1 << 20) as rx:
        rx.expect(1, pre.peer_address, "g", 48)
        for i, data in enumerate(chunks):
            tx.send_chunk(1, i, 16 * i, 16, data, last=i == 2, aux=b"mtls" if i == 2 else b"")
        got, st = rx.receive(1, timeout=30)
        assert [got[i] for i in range(3)] == chunks and st.aux == b"mtls"
        tx.wait(1, timeout=10)
        for bad in (rogue, plain):
            with DecodeReceiver(socket=bad.socket, group="gd", layout=LAYOUT, ring_bytes=1 << 20) as brx:
                brx.expect(2, pre.peer_address, "g", 16)
                with pytest.raises(RoomFailed) as ei:
                    brx.receive(2, timeout=30)
                assert ei.value.failure_code in ("PEER_LOST", "MISMATCH") and "bootstrap" in ei.value.reason, ei.value
    with grpc.insecure_channel(f"unix:{pre.socket}") as ch:
        st = engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=5)
    assert {p.daemon_id for p in st.peers} == {"dec"}, "a peer without a valid certificate got in"
    # The room ran on the framed stream, under the same mutual TLS.
    assert peer_streams(pre).get("framed", 0) >= 1 and peer_streams(dec).get("framed", 0) >= 1
    assert peer_streams(pre).get("grpc", 0) == 0 and peer_streams(dec).get("grpc", 0) == 0


def test_the_framed_stream_needs_a_client_certificate_that_names_the_daemon(fleet: Fleet, pki: Pki) -> None:
    pre = fleet.d["pre"]

    def tls(client: str | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        if client is not None:
            ctx.load_cert_chain(str(pki.cert(client)), str(pki.key(client)))
        return ctx

    hello = peer_pb2.PeerMsg(hello=peer_pb2.Hello(
        sender=peer_pb2.DaemonRef(daemon_id="dec", instance_id="x", address="127.0.0.1:9"), peer_instance_id="y"))
    # Plaintext on a TLS port, TLS without a client certificate, one from another CA: no answer.
    for client in ("plaintext", None, "rogue"):
        try:
            w = Wire(pre, None if client == "plaintext" else tls(client))
            w.batch(hello)
            got = w.frame()
        except OSError:  # ssl.SSLError included
            got = None
        assert got is None, f"{client}: a stream without a valid client certificate got an answer: {got!r}"
    # A valid certificate, but it names "client" and the Hello claims "dec".
    w = Wire(pre, tls("client"))
    w.batch(hello)
    code, why = w.refusal()
    assert code == PERMISSION_DENIED and "not named by the peer's certificate" in why, why
    w.close()


def test_python_client_and_cli_speak_tls_and_mutual_tls(fleet: Fleet, pki: Pki) -> None:
    tls_tcp, mtls_tcp = str(fleet.d["tls"].info["engine_tcp"]), str(fleet.d["pre"].info["engine_tcp"])
    # Server TLS: the CA as a path or as bytes; an engine registers, maps its ring and takes a slot.
    assert daemon_status(tls_tcp, Tls(ca=pki.ca)).daemon_id == "tls"
    assert daemon_status(tls_tcp, Tls(ca=pki.ca.read_bytes())).daemon_id == "tls"
    with PrefillSender(socket=tls_tcp, tls=Tls(ca=str(pki.ca)), group="tls-g", layout=LAYOUT,
                       ring_bytes=1 << 20) as tx:
        tx.release_slot(tx.acquire(16))
    for bad in (None, Tls(ca=pki.rogue_ca)):  # plaintext, or a CA that did not sign the daemon
        with pytest.raises(KvxferError) as ei:
            daemon_status(tls_tcp, bad)
        assert ei.value.code == REFUSED
    # Mutual TLS: our certificate from files or from memory; none, or one of another CA, is refused.
    mine = Tls(ca=pki.ca, cert=pki.cert("client"), key=pki.key("client"))
    assert daemon_status(mtls_tcp, mine).daemon_id == "pre"
    assert daemon_status(mtls_tcp, Tls(*(p.read_bytes() for p in (pki.ca, pki.cert("client"), pki.key("client"))))).daemon_id == "pre"
    for bad in (Tls(ca=pki.ca), Tls(ca=pki.ca, cert=pki.cert("rogue"), key=pki.key("rogue"))):
        with pytest.raises(KvxferError) as ei:
            daemon_status(mtls_tcp, bad)
        assert ei.value.code == REFUSED

    async def aio() -> str:
        tx = await AsyncPrefillSender.create(socket=mtls_tcp, tls=mine, group="tls-a", layout=LAYOUT,
                                             ring_bytes=1 << 20)
        try:
            await tx.release_slot(await tx.acquire(16))
        finally:
            await tx.close()
        with pytest.raises(KvxferError) as ei:
            await async_daemon_status(mtls_tcp, Tls(ca=pki.ca))
        assert ei.value.code == REFUSED
        return (await async_daemon_status(mtls_tcp, mine)).daemon_id

    assert asyncio.run(aio()) == "pre"
    with pytest.raises(ValueError):
        daemon_status(fleet.d["pre"].socket, mine)  # TLS over the Unix socket is a mistake, said so
    # The CLI takes the same material.
    cli = [sys.executable, "-m", "kvxferd", "status", "--socket", mtls_tcp, "--json", "--tls-ca", str(pki.ca)]
    ok = subprocess.run([*cli, "--tls-cert", str(pki.cert("client")), "--tls-key", str(pki.key("client"))], capture_output=True,
                        text=True, timeout=60, env=daemon_env(), cwd=ROOT)
    assert ok.returncode == 0 and json.loads(ok.stdout)["daemon_id"] == "pre", ok.stderr
    refused = subprocess.run(cli, capture_output=True, text=True, timeout=60, env=daemon_env(), cwd=ROOT)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr


# --------------------------------------------------------------------------- certificate-bound daemon ids


def _code(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""  # type: ignore[no-any-return]
    return grpc.StatusCode.OK, ""


def _peer_ids(d: DaemonProc) -> set[str]:
    with grpc.insecure_channel(f"unix:{d.socket}") as ch:
        st = engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=5)
    return {p.daemon_id for p in st.peers}


def test_a_certificate_binds_the_daemon_id_its_holder_may_claim(fleet: Fleet, pki: Pki) -> None:
    """Holding a valid certificate of daemon "attacker", a caller cannot handshake, open a stream
    or heartbeat as daemon "D" (or as "pre", a daemon the target knows); as itself it can."""
    from kvxferd.transports.nixl import NixlTransport

    dec = fleet.d["dec"]
    agent = NixlTransport(f"kvx-sec-{os.getpid()}", progress_thread=False)
    ch = grpc.secure_channel(dec.peer_address, creds(pki, client=(pki.cert("attacker"), pki.key("attacker"))))
    try:
        stub = peer_pb2_grpc.PeerStub(ch)

        def ref(daemon_id: str) -> peer_pb2.DaemonRef:
            return peer_pb2.DaemonRef(daemon_id=daemon_id, instance_id="i-1", address="127.0.0.1:9")

        def handshake(daemon_id: str) -> tuple[grpc.StatusCode, str]:
            return _code(lambda: stub.Handshake(peer_pb2.HandshakeRequest(
                sender=ref(daemon_id), agent_name=agent.name, nixl_metadata=agent.metadata(),
                version=PROTOCOL_VERSION), timeout=10))

        for claimed in ("D", "pre"):
            code, why = handshake(claimed)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "certificate" in why, (claimed, code, why)
            hello = peer_pb2.PeerMsg(hello=peer_pb2.Hello(sender=ref(claimed)))
            code, why = _code(lambda hello=hello: list(stub.Session(iter([peer_pb2.PeerBatch(msgs=[hello])]), timeout=10)))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "certificate" in why, (claimed, code, why)
            code, why = _code(lambda claimed=claimed: stub.Heartbeat(peer_pb2.HeartbeatRequest(sender=ref(claimed)),
                                                                     timeout=10))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "certificate" in why, (claimed, code, why)
        assert not {"D", "attacker"} & _peer_ids(dec), "a refused handshake left a peer behind"
        # The same certificate, claiming the id it names: in, and listed under that id only.
        assert handshake("attacker") == (grpc.StatusCode.OK, "")
        assert _code(lambda: stub.Heartbeat(peer_pb2.HeartbeatRequest(sender=ref("attacker")), timeout=10))[0] == \
            grpc.StatusCode.OK
        ids = _peer_ids(dec)
        assert "attacker" in ids and "D" not in ids, ids
    finally:
        ch.close()
        agent.close()


def test_the_cn_does_not_name_a_daemon_when_the_certificate_has_a_uri_san(fleet: Fleet, pki: Pki) -> None:
    """A certificate of our CA whose CN is "pre" (a daemon dec knows) and whose only URI SAN names
    something else names no daemon at all: a handshake, Hello or Heartbeat as "pre" is refused on
    the gRPC port (gRPC's auth context) and a Hello on the framed port (Python ssl's peercert)."""
    from kvxferd.transports.nixl import NixlTransport

    dec = fleet.d["dec"]
    agent = NixlTransport(f"kvx-sec-uri-{os.getpid()}", progress_thread=False)
    client = (pki.cert("uri-other"), pki.key("uri-other"))
    ch = grpc.secure_channel(dec.peer_address, creds(pki, client=client))
    try:
        stub = peer_pb2_grpc.PeerStub(ch)
        ref = peer_pb2.DaemonRef(daemon_id="pre", instance_id="i-forged", address="127.0.0.1:9")
        for call in (lambda: stub.Handshake(peer_pb2.HandshakeRequest(
                        sender=ref, agent_name=agent.name, nixl_metadata=agent.metadata(), version=PROTOCOL_VERSION),
                        timeout=10),
                     lambda: list(stub.Session(iter([peer_pb2.PeerBatch(msgs=[peer_pb2.PeerMsg(
                         hello=peer_pb2.Hello(sender=ref))])]), timeout=10)),
                     lambda: stub.Heartbeat(peer_pb2.HeartbeatRequest(sender=ref), timeout=10)):
            code, why = _code(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "not named by the peer's certificate []" in why, \
                (code, why)
        tls = ssl.create_default_context(cafile=str(pki.ca))
        tls.load_cert_chain(str(client[0]), str(client[1]))
        wire = Wire(dec, tls)
        try:
            wire.batch(peer_pb2.PeerMsg(hello=peer_pb2.Hello(sender=ref)))
            code, why = wire.refusal()
            assert code == PERMISSION_DENIED and "certificate []" in why, (code, why)
        finally:
            wire.close()
    finally:
        ch.close()
        agent.close()


def test_a_daemon_whose_certificate_names_another_id_is_not_used(fleet: Fleet) -> None:
    """"liar" holds a valid certificate of daemon "pre": daemons it dials refuse its client
    certificate, and a daemon dialing it refuses the handshake reply (the server's certificate
    does not name the daemon id the reply claims), so no room can use it."""
    dec, liar = fleet.d["dec"], fleet.d["liar"]
    with DecodeReceiver(socket=dec.socket, group="gl", layout=LAYOUT, ring_bytes=1 << 20) as rx:
        rx.expect(7, liar.peer_address, "g", 16)
        with pytest.raises(RoomFailed) as ei:
            rx.receive(7, timeout=30)
        assert ei.value.failure_code == "PEER_LOST", ei.value
        assert "'liar' is not named by the peer's certificate ['pre']" in ei.value.reason, ei.value
    assert "liar" not in _peer_ids(dec)


# --------------------------------------------------------------------------- size limits and bind addresses


def test_request_size_limit_is_enforced_on_both_services(fleet: Fleet) -> None:
    d = fleet.d["plain"]
    big = b"x" * (100 << 10)
    with grpc.insecure_channel(f"unix:{d.socket}") as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            stub.EnqueueChunks(engine_pb2.EnqueueChunksRequest(chunks=[engine_pb2.EnqueueChunkRequest(aux=big)]), timeout=5)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Just under the limit is read and judged on its content.
        with pytest.raises(grpc.RpcError) as ei:
            stub.RegisterEngine(engine_pb2.RegisterEngineRequest(name="n" * (60 << 10)), timeout=5)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(d.peer_address) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            peer_pb2_grpc.PeerStub(ch).Handshake(peer_pb2.HandshakeRequest(nixl_metadata=big), timeout=5)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert engine_status(f"unix:{d.socket}", None) == grpc.StatusCode.OK
    assert d.proc.poll() is None


def _listening(pid: int) -> list[tuple[str, str, int]]:
    """(proto, local address, port) of every TCP listener and bound UDP socket of a process."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]:
            f = line.split()
            local, state, inode = f[1], f[3], f[9]
            if inode not in inodes or (proto.startswith("tcp") and state != "0A"):
                continue
            hexaddr, hexport = local.split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc prints addresses as host-order 32-bit words.
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.append((proto, str(ipaddress.ip_address(words)), int(hexport, 16)))
    return out


def _loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def test_no_listener_on_a_non_loopback_address_by_default(fleet: Fleet) -> None:
    defaults = Config()
    assert defaults.peer_listen.startswith("127.0.0.1:") and defaults.metrics_host == "127.0.0.1"
    assert defaults.listen == "" and not defaults.tls_client_auth
    # Every port the daemon opens, its own and those of the libraries it loads (gRPC, UCX);
    # tests.conftest.spawn_daemon keeps the defaults but for ephemeral ports (and metrics on).
    d = fleet.d["plain"]
    socks = _listening(d.proc.pid)
    assert any(port == int(d.peer_address.rpartition(":")[2]) for _, _, port in socks)
    exposed = [s for s in socks if not _loopback(s[1])]
    assert not exposed, f"listening beyond loopback: {exposed}"
