"""Daemon-to-daemon gRPC servicer (the handshake, the control stream, a liveness probe) and the
listener of the same control stream as plain frames (kvxferd.peer_wire).

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
from kvxferd.config import Config
from kvxferd.convert import daemon_ref, daemon_ref_pb
from kvxferd.errors import KvxferError
from kvxferd.peer_auth import PeerCreds, ids_from_auth_context
from kvxferd.peer_link import CONTROL_TIMEOUT_S, Session, proof_of, proof_pb
from kvxferd.peer_wire import WireStream, server_context
from kvxferd.peers import PeerManager
from kvxferd.ports import Identity
from kvxferd.servicer import status_of
from kvxferd.transport import Transport

logger = logging.getLogger(__name__)

PEER_UNARY = ("Handshake", "Heartbeat")
# Framed streams open at once, Hello read or not, beyond two per peer we may know: a bound on
# what strangers can hold open.
SPARE_WIRE_STREAMS = 16


NO_HELLO = "a session starts with a Hello"


async def _opening(batches: AsyncIterator[peer_pb2.PeerBatch]) -> peer_pb2.PeerBatch | None:
    """A stream's first batch if it comes in time and starts with a Hello, else None: both kinds of
    stream are refused the same way before anything else on them is read."""
    try:
        first = await asyncio.wait_for(batches.__anext__(), CONTROL_TIMEOUT_S)
    except (StopAsyncIteration, asyncio.TimeoutError, OSError, KvxferError):
        return None
    return first if first.msgs and first.msgs[0].WhichOneof("body") == "hello" else None


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
        return daemon_ref_pb(self._m.me)

    async def Handshake(self, request: peer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext) -> peer_pb2.HandshakeReply:
        proof, metadata = await self._m.accept_handshake(
            daemon_ref(request.sender), request.agent_name, bytes(request.nixl_metadata), proof_of(request),
            creds_of(context))
        return peer_pb2.HandshakeReply(
            sender=self._me(), agent_name=self._transport.name, nixl_metadata=metadata, version=__version__,
            proof=proof_pb(proof),
        )

    async def Session(self, request_iterator: AsyncIterator[peer_pb2.PeerBatch], context: Any) -> None:
        first = await _opening(request_iterator)
        if first is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, NO_HELLO)
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


class WireServer:
    """Serves the control stream as plain frames on its own port. A stream is taken on exactly
    the Session RPC's terms: its first batch starts with a Hello that PeerManager.accept matches
    to a completed handshake of that instance (with mTLS, the client certificate must name the
    daemon), and nothing after it is read before that."""

    def __init__(self, manager: PeerManager, config: Config) -> None:
        self._m = manager
        self._config = config
        self._server: asyncio.AbstractServer | None = None
        self._streams: set[WireStream] = set()

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0: a free port); returns the port."""
        self._server = await asyncio.start_server(
            self._serve, host.strip("[]") or None, port, ssl=server_context(self._config), limit=1 << 20,
            ssl_handshake_timeout=CONTROL_TIMEOUT_S if self._config.tls_enabled else None)
        return int(self._server.sockets[0].getsockname()[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for stream in list(self._streams):
            stream.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = WireStream(reader, writer, self._config.max_message_bytes)
        cap = 2 * self._config.max_peers + SPARE_WIRE_STREAMS
        if len(self._streams) >= cap:
            await stream.refuse(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], f"{cap} control streams open already")
            return
        self._streams.add(stream)
        try:
            await self._session(stream)
        except Exception:
            logger.exception("control stream from %s failed", stream.peer)
        finally:
            self._streams.discard(stream)
            stream.close()

    async def _session(self, stream: WireStream) -> None:
        first = await _opening(stream)
        if first is None:
            await stream.refuse(grpc.StatusCode.INVALID_ARGUMENT.value[0], NO_HELLO)
            return
        # Its teardown (a loss, a newer stream) cuts it: nothing waits on a peer that stopped reading.
        session = Session(stream.write, stream.abort, "framed")
        try:
            h = await self._m.accept(first.msgs[0].hello, session, PeerCreds(stream.peer_cert_ids()))
        except KvxferError as exc:
            await stream.refuse(status_of(exc).value[0], str(exc))
            return
        try:
            await self._m.serve_stream(h, session, peer_pb2.PeerBatch(msgs=first.msgs[1:]), stream)
        except KvxferError as exc:
            await stream.refuse(status_of(exc).value[0], str(exc))
        finally:
            session.closed = True
