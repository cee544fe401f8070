"""A peer made by hand for the security and fuzz tests: it speaks the Peer service with or without
the shared secret (kvxferd.peer.auth builds its proofs), plus status and metric readers."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import ssl
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from kvxfer_client import DecodeReceiver, Layout, PrefillSender
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc
from kvxfer_protocol.version import PROTOCOL_VERSION
from kvxferd.config import load_config
from kvxferd.core.types import DaemonRef
from kvxferd.ops.metrics import Metrics
from kvxferd.peer.auth import Binding, Challenge, PeerAuth, Proof
from kvxferd.peer.link import proof_of, proof_pb
from kvxferd.peer.wire import BATCH, FRAME, REFUSE
from tests.conftest import DaemonProc, wait_ready

OK = grpc.StatusCode.OK


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16)
CHUNK = 16 * 256  # bytes of 16 tokens of LAYOUT


@contextlib.contextmanager
def running(procs: dict[str, DaemonProc]) -> Iterator[dict[str, DaemonProc]]:
    """Daemons spawned with wait=False: ready on entry, all stopped (SIGTERM at once) on exit."""
    try:
        for p in procs.values():
            wait_ready(p)
        yield procs
    finally:
        for p in procs.values():
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.stop(timeout=30)


def nixl_agent(prefix: str) -> Iterator[Any]:
    """A NIXL agent of this process (for a fixture to yield from): valid metadata for handshakes."""
    from kvxferd.transports.nixl import NixlTransport

    t = NixlTransport(f"{prefix}-{os.getpid()}", progress_thread=False)
    yield t
    t.close()


def one_room(tx_d: DaemonProc, rx_d: DaemonProc, room: int, mid: Callable[[], None] | None = None) -> None:
    """A 3-chunk room tx_d -> rx_d, every byte checked; `mid` runs after the first chunk."""
    chunks = [secrets.token_bytes(CHUNK) for _ in range(3)]
    with PrefillSender(socket=tx_d.socket, group=f"g{room}", layout=LAYOUT, ring_bytes=1 << 20) as tx, \
            DecodeReceiver(socket=rx_d.socket, group=f"d{room}", layout=LAYOUT, ring_bytes=1 << 20) as rx:
        rx.expect(room, tx_d.peer_address, f"g{room}", 48)
        for i, data in enumerate(chunks):
            tx.send_chunk(room, i, 16 * i, 16, data, last=i == 2, aux=b"aux" if i == 2 else b"")
            if i == 0 and mid is not None:
                mid()
        got, st = rx.receive(room, timeout=30)
        assert [got[i] for i in range(3)] == chunks and st.aux == b"aux", "room bytes differ"
        tx.wait(room, timeout=10)


def secret_file(d: Path, name: str, secret: bytes) -> Path:
    path = d / f"{name}.secret"
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    return path


def status(d: DaemonProc) -> engine_pb2.DaemonStatus:
    with grpc.insecure_channel(f"unix:{d.socket}") as ch:
        return engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=10)


def caps(d: DaemonProc) -> dict[str, tuple[int, int]]:
    return {c.name: (c.used, c.limit) for c in status(d).peer_caps}


def peer_streams(d: DaemonProc) -> dict[str, float]:
    """Control streams the daemon opened, by kind (kvxferd_peer_streams_total)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'^kvxferd_peer_streams_total\{kind="(\w+)"\} (\S+)$', text, re.M)}


def code_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""  # type: ignore[no-any-return]
    return OK, ""


class Client:
    """A hostile (or, with the right secret, legitimate) peer made by hand. Without a secret it
    is a local user who cannot read the host secret: no proofs at all."""

    def __init__(self, d: DaemonProc, secret: bytes | None, tmp: Path) -> None:
        path = secret_file(tmp, f"client-{secrets.token_hex(4)}", secret) if secret else None
        cfg = load_config(None, env={}, overrides={"socket": str(tmp / "c.sock"), "metrics_port": -1,
                                                   "peer_secret_file": str(path) if path else "",
                                                   "insecure_peers": path is None})
        self.auth = PeerAuth(cfg, Metrics())
        self.channel = grpc.insecure_channel(d.peer_address)
        self.stub = peer_pb2_grpc.PeerStub(self.channel)

    def challenge(self) -> Challenge:
        c = self.stub.Challenge(peer_pb2.ChallengeRequest(), timeout=10)
        return Challenge(c.instance_id, bytes(c.nonce))

    def request(self, ref: DaemonRef, agent: str, md: bytes, key: bytes | None = None,
                proof: Proof | None = None, challenge: Challenge | None = None,
                version: str = PROTOCOL_VERSION) -> peer_pb2.HandshakeRequest:
        """A HandshakeRequest; with `key`, its proof covers `challenge` (a fresh one if None)."""
        if proof is None and key is not None:
            proof = self.auth.request_proof(ref, agent, md, key, challenge or self.challenge())
        return peer_pb2.HandshakeRequest(
            sender=peer_pb2.DaemonRef(daemon_id=ref.daemon_id, instance_id=ref.instance_id, address=ref.address),
            agent_name=agent, nixl_metadata=md, version=version, proof=proof_pb(proof))

    def handshake(self, ref: DaemonRef, agent: str, md: bytes) -> tuple[peer_pb2.HandshakeReply, Binding]:
        """A real handshake; the reply's proof is checked as a daemon would."""
        key = self.auth.signing_keys()[0]
        req = self.request(ref, agent, md, key)
        reply = self.stub.Handshake(req, timeout=10)
        peer = DaemonRef(reply.sender.daemon_id, reply.sender.instance_id, reply.sender.address)
        binding = self.auth.verify_reply(peer, reply.agent_name, bytes(reply.nixl_metadata), ref, proof_of(req), key,
                                         proof_of(reply))
        return reply, binding

    def hello(self, ref: DaemonRef, peer_instance: str, binding: Binding | None) -> peer_pb2.PeerMsg:
        return peer_pb2.PeerMsg(hello=peer_pb2.Hello(
            sender=peer_pb2.DaemonRef(daemon_id=ref.daemon_id, instance_id=ref.instance_id, address=ref.address),
            peer_instance_id=peer_instance, proof=proof_pb(self.auth.hello_proof(ref, peer_instance, binding))))

    def close(self) -> None:
        self.channel.close()


INVALID_ARGUMENT, PERMISSION_DENIED = 3, 7  # gRPC status codes, as REFUSE frames carry them


class Wire:
    """A raw framed connection to a daemon's stream port (kvxferd.peer.wire), TLS with `tls`."""

    def __init__(self, d: DaemonProc, tls: ssl.SSLContext | None = None) -> None:
        host, _, port = str(d.info["stream_address"]).rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=10)
        self.sock = tls.wrap_socket(sock, server_hostname=host) if tls is not None else sock

    def send(self, payload: bytes, kind: int = BATCH, length: int | None = None) -> None:
        self.sock.sendall(FRAME.pack(len(payload) if length is None else length, kind) + payload)

    def batch(self, *msgs: peer_pb2.PeerMsg) -> None:
        self.send(peer_pb2.PeerBatch(msgs=list(msgs)).SerializeToString())

    def frame(self) -> tuple[int, bytes] | None:
        """The next frame, or None once the daemon closed the connection."""
        head = self._read(FRAME.size)
        if head is None:
            return None
        length, kind = FRAME.unpack(head)
        body = self._read(length)
        assert body is not None, "the daemon closed inside a frame"
        return kind, body

    def refusal(self) -> tuple[int, str]:
        """The REFUSE frame the daemon sends, after which it must close."""
        got = self.frame()
        assert got is not None and got[0] == REFUSE, f"expected a refusal, got {got!r}"
        assert self.frame() is None, "the daemon kept a refused stream open"
        return got[1][0], got[1][1:].decode()

    def _read(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                part = self.sock.recv(n - len(buf))
            except (ConnectionResetError, ssl.SSLError):
                return None
            if not part:
                return None
            buf += part
        return buf

    def close(self) -> None:
        self.sock.close()
