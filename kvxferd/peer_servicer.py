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
from kvxferd.config import _valid_hostport
from kvxferd.convert import daemon_ref, daemon_ref_pb
from kvxferd.domain import DaemonRef
from kvxferd.errors import InvalidArgument, KvxferError, PermissionDenied
from kvxferd.peer_link import CONTROL_TIMEOUT_S, Session
from kvxferd.peers import PeerManager
from kvxferd.ports import Identity
from kvxferd.servicer import status_of
from kvxferd.transport import Transport

logger = logging.getLogger(__name__)

PEER_UNARY = ("Handshake", "Heartbeat")


class PeerServicer(peer_pb2_grpc.PeerServicer):
    def __init__(self, ident: Identity, manager: PeerManager, transport: Transport) -> None:
        self._ident = ident
        self._m = manager
        self._transport = transport

    def _me(self) -> peer_pb2.DaemonRef:
        return daemon_ref_pb(DaemonRef(self._ident.daemon_id, self._ident.instance_id, self._ident.address))

    async def Handshake(self, request: peer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext) -> peer_pb2.HandshakeReply:
        ref = daemon_ref(request.sender)
        if not request.nixl_metadata or not request.agent_name:
            raise InvalidArgument("agent_name and nixl_metadata are required")
        # This daemon may dial the address back: only HOST:PORT, nothing a resolver would have to
        # guess at (no bare names, no schemes).
        if not _valid_hostport(ref.address):
            raise InvalidArgument(f"sender.address must be HOST:PORT, got {ref.address[:100]!r}")
        # Claiming the address of another daemon that is up would re-bind its link (failing its
        # rooms, pointing its NIXL agent elsewhere): only a daemon gone silent can be replaced.
        known = self._m.by_address(ref.address)
        if known is not None and known.up and known.daemon_id and known.daemon_id != ref.daemon_id:
            raise PermissionDenied(f"{ref.address} belongs to daemon {known.daemon_id!r}, which is up")
        h = self._m.link(ref.address)
        try:
            await self._m.adopt(h, ref, request.agent_name, bytes(request.nixl_metadata))
        except KvxferError:
            raise
        except Exception as exc:
            raise InvalidArgument(f"cannot load the peer's NIXL metadata: {exc}") from exc
        return peer_pb2.HandshakeReply(
            sender=self._me(), agent_name=self._transport.name, nixl_metadata=self._transport.metadata(),
            version=__version__,
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
            h = await self._m.accept(first.msgs[0].hello, session)
        except KvxferError as exc:
            await context.abort(status_of(exc), str(exc))
            return
        rest = peer_pb2.PeerBatch(msgs=first.msgs[1:])
        reader = asyncio.ensure_future(self._m.serve_stream(h, session, rest, request_iterator))
        try:
            await asyncio.wait([reader, done], return_when=asyncio.FIRST_COMPLETED)
        finally:
            reader.cancel()
            session.closed = True
            if session.writer is not None:
                # The stream may end only once no write of it is pending.
                await asyncio.wait([session.writer], timeout=CONTROL_TIMEOUT_S)

    async def Heartbeat(self, request: peer_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext) -> peer_pb2.HeartbeatReply:
        return peer_pb2.HeartbeatReply(sender=self._me())
