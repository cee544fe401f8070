"""A peer made by hand for the security and fuzz tests: it speaks the Peer service with or without
the shared secret (kvxferd.peer_auth builds its proofs), plus status and metric readers."""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from kvxfer_client._pb.kvxfer.v1 import engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc
from kvxferd.config import load_config
from kvxferd.domain import DaemonRef
from kvxferd.metrics import Metrics
from kvxferd.peer_auth import Binding, PeerAuth, Proof
from kvxferd.peer_link import proof_of, proof_pb
from tests.conftest import DaemonProc

OK = grpc.StatusCode.OK


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


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


def code_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""  # type: ignore[no-any-return]
    return OK, ""


class Client:
    """A hostile (or, with the right secret, legitimate) peer made by hand."""

    def __init__(self, d: DaemonProc, secret: bytes | None, tmp: Path) -> None:
        path = secret_file(tmp, f"client-{secrets.token_hex(4)}", secret) if secret else None
        cfg = load_config(None, env={}, overrides={"socket": str(tmp / "c.sock"), "metrics_port": -1,
                                                   "peer_secret_file": str(path) if path else ""})
        self.auth = PeerAuth(cfg, Metrics())
        self.channel = grpc.insecure_channel(d.peer_address)
        self.stub = peer_pb2_grpc.PeerStub(self.channel)

    def request(self, ref: DaemonRef, agent: str, md: bytes, key: bytes | None = None,
                proof: Proof | None = None) -> peer_pb2.HandshakeRequest:
        if proof is None and key is not None:
            proof = self.auth.request_proof(ref, agent, md, key)
        return peer_pb2.HandshakeRequest(
            sender=peer_pb2.DaemonRef(daemon_id=ref.daemon_id, instance_id=ref.instance_id, address=ref.address),
            agent_name=agent, nixl_metadata=md, version="test", proof=proof_pb(proof))

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
