"""Daemon-to-daemon gRPC servicer (the handshake, the control stream, a liveness probe) and the
listener of the same control stream as plain frames (kvxferd.peer.wire).

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

from kvxfer_protocol.pb.kvxfer.v1 import peer_pb2, peer_pb2_grpc
from kvxfer_protocol.version import PROTOCOL_VERSION, protocol_mismatch
from kvxferd.config import Config
from kvxferd.core.pb_convert import daemon_ref, daemon_ref_pb
from kvxferd.core.peer_port import Identity
from kvxferd.engine_api.servicer import status_of
from kvxferd.errors import FailedPrecondition, KvxferError
from kvxferd.ops.listener_bounds import ListenerCaps, RefusalLog, listener_caps
from kvxferd.peer import call_caps as peer_calls
from kvxferd.peer.auth import PeerCreds, ids_from_auth_context
from kvxferd.peer.link import CONTROL_TIMEOUT_S, Session, proof_of, proof_pb
from kvxferd.peer.manager import PeerManager
from kvxferd.peer.wire import WireStream, server_context
from kvxferd.transports.interface import Transport
from kvxferd.transports.local_ipc import same_host

logger = logging.getLogger(__name__)

PEER_UNARY = ("Challenge", "Handshake", "Heartbeat")
# The largest first frame a framed stream may send before its Hello is accepted: a Hello (ids, an
# address, a proof) is well under 1 KiB; a bigger frame before it is a protocol error.
MAX_HELLO_FRAME = 16 << 10


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

    async def Challenge(self, request: peer_pb2.ChallengeRequest, context: grpc.aio.ServicerContext) -> peer_pb2.ChallengeReply:
        # Our instance id and a nonce: nothing a caller who has not proven itself could use.
        return peer_pb2.ChallengeReply(instance_id=self._m.ident.instance_id, nonce=self._m.auth.challenge())

    async def Handshake(self, request: peer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext) -> peer_pb2.HandshakeReply:
        mismatch = protocol_mismatch(request.version)
        if mismatch:
            # Refused before anything else is believed or kept: the caller's message names both versions.
            self._m.auth.refused("handshake", f"from {request.sender.daemon_id[:100]!r}: {mismatch}")
            raise FailedPrecondition(mismatch)
        proof, metadata = await self._m.accept_handshake(
            daemon_ref(request.sender), request.agent_name, bytes(request.nixl_metadata), proof_of(request),
            creds_of(context))
        peer_calls.vouch()  # a peer proved itself from this source: the peer port keeps room for it
        # The dialer names our instance in its tag when a challenge told it (secret modes), else "".
        me, sender = self._m.ident, request.sender
        same_host.check(request.host_tag, sender, me.instance_id if request.HasField("proof") else "",
                        self._m.auth.mode != "insecure")
        return peer_pb2.HandshakeReply(
            sender=self._me(), agent_name=self._transport.name, nixl_metadata=metadata, version=PROTOCOL_VERSION,
            proof=proof_pb(proof), host_tag=same_host.tag(me, sender.instance_id),
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
        peer_calls.authenticated()  # a peer's stream: no stranger's cap counts it, nor cuts it, any more
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
    daemon), and nothing after it is read before that.

    Strangers are bounded apart from peers: a stream before its Hello may send one frame of at most
    MAX_HELLO_FRAME within CONTROL_TIMEOUT_S, and at most `unauthenticated_streams` of them are open
    at once; a newcomer over that evicts the oldest stream of the source holding the most, so
    strangers that hold streams open can delay a peer by one reconnect, never keep it out (and a
    dialer whose framed stream is cut before it was taken up uses the Session RPC instead).
    Accepted streams (two per peer we may know) have their own cap, which strangers never touch."""

    def __init__(self, manager: PeerManager, config: Config, caps: ListenerCaps | None = None) -> None:
        self._m = manager
        self._config = config
        self._caps = caps or listener_caps(config, 1 << 16)
        self._server: asyncio.AbstractServer | None = None
        self._streams: set[WireStream] = set()
        self._strangers: dict[WireStream, str] = {}  # before their Hello, oldest first: stream -> source
        self._refusals = RefusalLog("framed peer port")

    async def start(self, host: str, port: int) -> int:
        """Listens on host:port (0: a free port); returns the port."""
        # A small reader limit: what a stream buffers before we read it is about twice this.
        self._server = await asyncio.start_server(
            self._serve, host.strip("[]") or None, port, ssl=server_context(self._config), limit=64 << 10,
            ssl_handshake_timeout=CONTROL_TIMEOUT_S if self._config.tls_enabled else None)
        return int(self._server.sockets[0].getsockname()[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for stream in [*self._streams, *self._strangers]:
            stream.close()
        self._refusals.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = WireStream(reader, writer, MAX_HELLO_FRAME)
        if len(self._strangers) >= self._caps.unauthenticated_streams:
            self._evict_stranger()
        self._strangers[stream] = stream.peer.rpartition(":")[0]
        try:
            await self._session(stream)
        except Exception as exc:
            self._refusals(f"stream failed: {type(exc).__name__}")
            logger.debug("control stream from %s failed", stream.peer, exc_info=True)
        finally:
            self._strangers.pop(stream, None)
            self._streams.discard(stream)
            stream.close()

    def _evict_stranger(self) -> None:
        """Cuts the oldest stream, not yet past its Hello, of the source that holds the most."""
        counts: dict[str, int] = {}
        for source in self._strangers.values():
            counts[source] = counts.get(source, 0) + 1
        top = max(counts, key=counts.__getitem__)
        victim = next(s for s, source in self._strangers.items() if source == top)
        del self._strangers[victim]
        victim.abort("evicted before its Hello")
        self._refusals(f"stream evicted before its Hello ({self._caps.unauthenticated_streams} open)")

    async def _session(self, stream: WireStream) -> None:
        first = await _opening(stream)
        if first is None:
            self._refusals(NO_HELLO)
            await stream.refuse(grpc.StatusCode.INVALID_ARGUMENT.value[0], NO_HELLO)
            return
        # Past its Hello frame: no longer evictable (accept may wait), counted with the peers'.
        self._strangers.pop(stream, None)
        if len(self._streams) >= self._caps.framed_streams:
            self._refusals("accepted streams at their cap")
            await stream.refuse(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                f"{self._caps.framed_streams} control streams open already")
            return
        self._streams.add(stream)
        # Its teardown (a loss, a newer stream) cuts it: nothing waits on a peer that stopped reading.
        session = Session(stream.write, stream.abort, "framed")
        try:
            h = await self._m.accept(first.msgs[0].hello, session, PeerCreds(stream.peer_cert_ids()))
        except KvxferError as exc:
            await stream.refuse(status_of(exc).value[0], str(exc))
            return
        stream.trust(self._config.max_message_bytes)
        try:
            await self._m.serve_stream(h, session, peer_pb2.PeerBatch(msgs=first.msgs[1:]), stream)
        except KvxferError as exc:
            await stream.refuse(status_of(exc).value[0], str(exc))
        finally:
            session.closed = True
