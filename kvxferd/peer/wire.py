"""The control stream between two daemons as plain length-prefixed frames on TCP (TLS when the
peer service uses it): the same PeerBatch messages as the gRPC Session stream, without gRPC.

Why: on the 2-core VM a grpc.aio bidirectional stream costs about 85 µs of CPU per message (both
sides, measured in one process: 170 µs a round trip) and, between two processes, a wake-up of
grpc's poller thread and of an event-engine thread on each side; a frame on a socket costs about
7 µs. A chunk costs the pair one to two control messages (credits, releases, completions), and on
a loaded node that CPU is taken from the copy.

Frames: payload length u32 (little-endian), kind u8, payload. BATCH carries a serialized
PeerBatch; REFUSE (accepting side only, then it closes) carries the gRPC status code as one byte
and the reason in UTF-8, so the dialer logs the same refusal the Session RPC would have given.
Who may open a stream, and what its first batch must hold, is exactly as for the Session RPC
(kvxferd.peer.servicer.WireServer hands both to the same PeerManager calls).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import struct
from typing import Any

from kvxfer_protocol.pb.kvxfer.v1 import peer_pb2
from kvxferd.config import Config, split_hostport
from kvxferd.errors import KvxferError
from kvxferd.peer.auth import client_tls_context, ids_from_peercert

logger = logging.getLogger(__name__)

FRAME = struct.Struct("<IB")
BATCH = 0
REFUSE = 1
# Above this much unsent data a write waits for the socket to drain (the peer reads slowly).
_HIGH_WATER = 4 << 20
# How long that wait may last: a peer that reads nothing for this long (stopped, wedged, a zero TCP
# window) has its stream cut, so no writer, reader, buffer or socket stays behind for it.
DRAIN_TIMEOUT_S = 5.0
# A stream closed with data still unsent is cut if the peer has not taken it after this long.
CLOSE_GRACE_S = 5.0


class StreamRefused(KvxferError):
    """The accepting daemon refused the stream (the reason is its own words)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{reason} (code {code})")
        self.code = code
        self.reason = reason


def server_context(config: Config) -> ssl.SSLContext | None:
    """TLS for the listener, as the gRPC peer service has it: our certificate, and with
    tls_client_auth a client certificate from our CA is required."""
    if not config.tls_enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_ca:
        ctx.load_verify_locations(config.tls_ca)
    ctx.verify_mode = ssl.CERT_REQUIRED if config.tls_client_auth else ssl.CERT_NONE
    return ctx


class WireStream:
    """One framed stream: an async iterator of the PeerBatches received, and a writer of ours."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame: int) -> None:
        self._reader = reader
        self._writer = writer
        self._max_frame = max_frame
        self._cut_why = ""  # why we cut the stream, for the reader (empty: a plain close)

    @property
    def peer(self) -> str:
        peer = self._writer.get_extra_info("peername")
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"

    def trust(self, max_frame: int) -> None:
        """The stream's Hello was accepted: frames up to `max_frame`, and the reader's usual buffer."""
        self._max_frame = max_frame
        self._reader._limit = max(self._reader._limit, 1 << 20)  # type: ignore[attr-defined]

    def peer_cert_ids(self) -> frozenset[str] | None:
        """Daemon ids the other side's verified certificate names (None: no certificate)."""
        cert = self._writer.get_extra_info("peercert")
        return ids_from_peercert(cert) if cert else None

    async def write(self, batch: peer_pb2.PeerBatch) -> None:
        self._send(BATCH, batch.SerializeToString())
        transport: Any = self._writer.transport
        if transport.get_write_buffer_size() > _HIGH_WATER:
            try:
                await asyncio.wait_for(self._writer.drain(), DRAIN_TIMEOUT_S)
            except asyncio.TimeoutError:
                self.abort(f"the peer read nothing for {DRAIN_TIMEOUT_S:g} s "
                           f"({transport.get_write_buffer_size()} B unsent); stream cut")
                raise ConnectionAbortedError(self._cut_why) from None

    def _send(self, kind: int, payload: bytes) -> None:
        if self._writer.is_closing():
            raise ConnectionResetError("the control stream is closed")
        self._writer.write(FRAME.pack(len(payload), kind) + payload)

    async def refuse(self, code: int, reason: str) -> None:
        """Tells the dialer why its stream is refused, then closes it."""
        try:
            self._send(REFUSE, bytes([code & 0xFF]) + reason.encode()[:4096])
            await asyncio.wait_for(self._writer.drain(), 5.0)
        except (OSError, asyncio.TimeoutError):
            pass
        self.close()

    def close(self) -> None:
        """Closes once what is buffered has been sent; cut if the peer takes none of it within
        CLOSE_GRACE_S (a plain close would wait for a peer that stopped reading forever)."""
        if self._writer.is_closing():
            return
        self._writer.close()
        if self._writer.transport.get_write_buffer_size():
            asyncio.get_running_loop().call_later(CLOSE_GRACE_S, self._cut_unsent)

    def _cut_unsent(self) -> None:
        # Data still buffered: the transport has not lost its connection yet (losing it empties
        # the buffer), so aborting it is safe.
        try:
            if self._writer.transport.get_write_buffer_size():
                self.abort("the peer did not read what was left to send; stream cut")
        except Exception:
            logger.debug("cutting a closed control stream failed", exc_info=True)

    def abort(self, why: str = "") -> None:
        """Cuts the stream at once, dropping what is unsent: a session's teardown waits for nothing
        from the peer. The reader then ends (with `why` as its error, if given)."""
        self._cut_why = self._cut_why or why
        transport: Any = self._writer.transport
        try:
            transport.abort()
        except Exception:  # the connection is gone already (a late abort can fail then)
            logger.debug("aborting a control stream failed", exc_info=True)

    def __aiter__(self) -> WireStream:
        return self

    async def __anext__(self) -> peer_pb2.PeerBatch:
        try:
            head = await self._reader.readexactly(FRAME.size)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                if self._cut_why:
                    raise ConnectionAbortedError(self._cut_why) from None
                raise StopAsyncIteration from None  # closed between frames
            raise ConnectionResetError("the control stream ended inside a frame header") from None
        length, kind = FRAME.unpack(head)
        if length > self._max_frame:
            self.close()
            raise ConnectionAbortedError(f"a control frame of {length} B (limit {self._max_frame}); stream closed")
        try:
            payload = await self._reader.readexactly(length)
        except asyncio.IncompleteReadError:
            raise ConnectionResetError("the control stream ended inside a frame") from None
        if kind == BATCH:
            try:
                return peer_pb2.PeerBatch.FromString(payload)
            except Exception:
                self.close()
                raise ConnectionAbortedError("a control frame that does not parse; stream closed") from None
        if kind == REFUSE and payload:
            raise StreamRefused(payload[0], payload[1:].decode(errors="replace"))
        self.close()
        raise ConnectionAbortedError(f"a control frame of unknown kind {kind}; stream closed")


async def dial(address: str, config: Config, timeout: float) -> WireStream:
    """Opens a framed stream to HOST:PORT (TLS as configured); raises OSError or TimeoutError."""
    host, port = split_hostport(address)
    ctx = client_tls_context(config) if config.tls_enabled else None
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, ssl=ctx, server_hostname=host if ctx else None,
                                limit=1 << 20),
        timeout)
    return WireStream(reader, writer, config.max_message_bytes)


async def refused(address: str) -> bool:
    """True if a TCP connect to `address` is actively refused (no process listens there)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*split_hostport(address)), 1.0)
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError, asyncio.TimeoutError):
        return False
    writer.close()
    return False
