"""Daemon-to-daemon gRPC servicer: the handshake, the control stream, and a liveness probe.

Protobuf in, domain calls out; the stream's messages are routed by peers.PeerManager. Nothing a
peer sends after the handshake is read before its stream's Hello has been matched to a completed
handshake of that exact instance.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvxfer_client._pb.kvxfer.v1 import peer_pb2, peer_pb2_grpc
from kvxferd import __version__
from kvxferd.convert import daemon_ref, daemon_ref_pb
from kvxferd.domain import DaemonRef
from kvxferd.errors import KvxferError
from kvxferd.peer_auth import PeerCreds, ids_from_auth_context
from kvxferd.peer_link import CONTROL_TIMEOUT_S, Session, proof_of, proof_pb
from kvxferd.peers import PeerManager
from kvxferd.ports import Identity
from kvxferd.servicer import status_of
from kvxferd.transport import Transport

logger = logging.getLogger(__name__)

PEER_UNARY = ("Handshake", "Heartbeat")


def creds_of(context: Any) -> PeerCreds:
    """The daemon ids the caller's verified client certificate names (none without mTLS)."""
    ctx = context.auth_context()
    if not ctx.get("x509_pem_cert"):
        return PeerCreds()
    return PeerCreds(ids_from_auth_context(ctx))


class PeerServicer(peer_pb2_grpc.PeerServicer):
    def __init__(self, ident: Identity, manager: PeerManager, transport: Transport) -> None:
        self._ident = ident
        self._m = manager
        self._transport = transport

    def _me(self) -> peer_pb2.DaemonRef:
        return daemon_ref_pb(DaemonRef(self._ident.daemon_id, self._ident.instance_id, self._ident.address))

    async def Handshake(self, request: peer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext) -> peer_pb2.HandshakeReply:
        proof, metadata = await self._m.accept_handshake(
            daemon_ref(request.sender), request.agent_name, bytes(request.nixl_metadata), proof_of(request),
            creds_of(context))
        return peer_pb2.HandshakeReply(
            sender=self._me(), agent_name=self._transport.name, nixl_metadata=metadata, version=__version__,
            proof=proof_pb(proof),
        )

    async def Session(self, request_iterator: AsyncIterator[peer_pb2.PeerBatch], context: Any) -> None:
        try:
            first = await asyncio.wait_for(request_iterator.__anext__(), CONTROL_TIMEOUT_S)
        except (StopAsyncIteration, asyncio.TimeoutError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a session starts with a Hello")
            return
        if not first.msgs or first.msgs[0].WhichOneof("body") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a session starts with a Hello")
            return
        # Closing an accepted stream means returning from this handler: `done` tells it to.
        done = asyncio.get_running_loop().create_future()

        def _cancel() -> None:
            session.closed = True
            if not done.done():
                done.set_result(None)

        session = Session(context.write, _cancel)
        try:
            h = await self._m.accept(first.msgs[0].hello, session, creds_of(context))
        except KvxferError as exc:
            await context.abort(status_of(exc), str(exc))
            return
        rest = peer_pb2.PeerBatch(msgs=first.msgs[1:])
        reader = asyncio.ensure_future(self._m.serve_stream(h, session, rest, request_iterator))
        refused: BaseException | None = None
        try:
            await asyncio.wait([reader, done], return_when=asyncio.FIRST_COMPLETED)
            refused = reader.exception() if reader.done() and not reader.cancelled() else None
        finally:
            reader.cancel()
            session.closed = True
            if session.writer is not None:
                # The stream may end (an abort included) only once no write of it is pending.
                await asyncio.wait([session.writer], timeout=CONTROL_TIMEOUT_S)
        if isinstance(refused, KvxferError):
            await context.abort(status_of(refused), str(refused))

    async def Heartbeat(self, request: peer_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext) -> peer_pb2.HeartbeatReply:
        self._m.check_heartbeat(daemon_ref(request.sender) if request.HasField("sender") else None, creds_of(context))
        return peer_pb2.HeartbeatReply(sender=self._me())
