"""One peer daemon: its identity, its NIXL agent, and the one control stream of the pair.

Outgoing messages are queued and coalesced: whatever the event loop produced for this peer
while the previous batch was being written goes out as the next single batch, so a burst of
chunks costs a handful of stream writes, not one RPC each. An empty batch goes out when a side
has been silent for a heartbeat interval; the other side counts any batch as a sign of life.

Range releases (a reader consumed a chunk) are the one message sent per chunk in steady state,
and nothing waits on one but the credit window, which is many chunks deep. They wait up to
LAZY_FLUSH_S for company (or leave at once with any other message): on 2 cores each stream
write cost the decode daemon ~45 µs of wall time and woke the prefill daemon's loop, once per
chunk. A prefill daemon that runs short of space asks for credit, and the answer (a grant or a
reclaim) is an urgent message that takes the held releases along: a small ring never waits the
delay out.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import grpc

from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from kvxfer_protocol.version import protocol_mismatch
from kvxferd.config import PEER_BATCH_MSGS, Config
from kvxferd.core.pb_convert import daemon_ref, layout_pb, room_key_pb, zero_copy_target_pb
from kvxferd.core.peer_port import BootstrapAnswer, BootstrapMsg, CreditSpec
from kvxferd.core.types import DaemonRef, FailureCode, RoomKey
from kvxferd.datapath.credits import CreditWindow
from kvxferd.errors import AlreadyExists, FailedPrecondition, KvxferError, Unavailable
from kvxferd.ops.metrics import Metrics
from kvxferd.peer.auth import Binding, PeerAuth, PeerCreds, Proof
from kvxferd.peer.wire import WireStream, dial

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 5.0
FRAMED_RETRY_S = 60.0
# At most this many messages per batch: a bounded message size whatever the backlog.
MAX_BATCH = PEER_BATCH_MSGS
# How long a range release may wait for other messages to share its batch.
LAZY_FLUSH_S = 0.002
# Range releases queued together go as one message of at most this many ranges.
MAX_RANGES_PER_MSG = 1024
# Handshakes with one peer instance a Session Hello may be bound to (two sides may handshake at once).
BINDINGS_KEPT = 4
# How a stream is refused to the daemon that lost a tie-break (both dialed at once): not a loss.
TIE_BREAK = "both daemons dialed a control stream at once; the one the lower daemon id dialed is kept"


class TieBreak(AlreadyExists):
    """A stream refused because the pair keeps the one its lower daemon id dialed."""

    def __init__(self) -> None:
        super().__init__(TIE_BREAK)


def lost_tie_break(exc: BaseException) -> bool:
    """Whether a stream we dialed was refused as the loser of a tie-break (gRPC or framed)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() == grpc.StatusCode.ALREADY_EXISTS and TIE_BREAK in (exc.details() or "")
    return isinstance(exc, KvxferError) and TIE_BREAK in str(exc)


def channel_credentials(config: Config) -> grpc.ChannelCredentials | None:
    if not config.tls_enabled:
        return None
    key, cert, ca = config.tls_material()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def proof_pb(proof: Proof | None) -> peer_pb2.PeerProof | None:
    if proof is None:
        return None
    return peer_pb2.PeerProof(nonce=proof.nonce, unix_ms=proof.unix_ms, mac=proof.mac, peer_nonce=proof.peer_nonce)


def proof_of(msg: Any) -> Proof | None:
    """The PeerProof field of a HandshakeRequest, HandshakeReply or Hello, if set."""
    if not msg.HasField("proof"):
        return None
    p = msg.proof
    return Proof(bytes(p.nonce), p.unix_ms, bytes(p.mac), bytes(p.peer_nonce))


def grpc_options(config: Config) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
    ]


class Session:
    """One open Session stream, dialed by us (`ours`) or accepted from the peer.

    When both daemons dial at once, the pair keeps the stream the lower daemon id dialed (see
    PeerLink.race). A stream the higher one dials may thus be refused, or dropped for the peer's:
    it is opened with `hold`, and nothing but its Hello goes out on it before the peer has taken it
    up (its first batch, which an accepting daemon sends at once), so nothing is lost with it."""

    def __init__(self, write: Callable[[peer_pb2.PeerBatch], Awaitable[Any]], cancel: Callable[[], Any],
                 kind: str = "grpc", ours: bool = False, hold: bool = False) -> None:
        self.write = write
        self.cancel = cancel
        self.kind = kind  # framed (kvxferd.peer.wire), grpc (the Session RPC) or local
        self.ours = ours
        self.hold = hold
        self.closed = False
        self.writer: asyncio.Task[None] | None = None
        # Whether the peer has spoken on this stream yet (a Hello counts): until it has, the
        # liveness check gives it the handshake's time, not the heartbeat limit.
        self.heard = False
        self.heard_at = 0.0
        self._go = asyncio.Event()  # held writes may go: the peer spoke, or the stream is closed

    def hear(self) -> None:
        if not self.heard:
            self.heard, self.heard_at = True, time.monotonic()
            self._go.set()


class PeerLink:
    def __init__(self, address: str, config: Config, metrics: Metrics) -> None:
        self.address = address
        self.daemon_id = ""
        self.instance_id = ""
        self.agent_name = ""
        # Its framed control stream (kvxferd.peer.wire), from its handshake; "" = Session RPC only.
        self.stream_address = ""
        # When the peer's framed port cut or refused a stream of ours before taking it up (strangers
        # at its cap, say): the Session RPC serves the pair until FRAMED_RETRY_S later.
        self.framed_failed_at = -FRAMED_RETRY_S
        self.metadata = b""  # the NIXL metadata loaded for agent_name
        self.is_self = False
        self.up = False
        # When it went down (or was made, never up yet): forgotten after peer_forget_s.
        self.down_since = time.monotonic()
        # Identity.md_epoch our last handshake carried: memory registered since is unknown to the
        # peer's NIXL agent until we send our metadata again.
        self.md_epoch_sent = -1
        self.last_rx = time.monotonic()
        self.session: Session | None = None
        self.dialing = False  # a stream of ours is being opened (not attached yet)
        # The instance we last lost (or "" if never): a session that comes up again tells the
        # ledger, which then settles the credits revoked at the loss.
        self.lost_instance = ""
        # heartbeat_misses of the peer's own heartbeat interval (0: it did not say): a peer that
        # speaks less often than we would is not lost for it.
        self.peer_limit_s = 0.0
        # kvxferd.peer.heal: the probe of its port while it is silent (started, result), since when
        # it is judged slow, why its NIXL connection is broken ("": it is not), when it was rebuilt.
        self.probe: tuple[float, str] | None = None
        self.slow_since = 0.0
        self.broken = ""
        self.rebuilt_at = 0.0
        # Handshakes completed with this instance (shared-secret mode), newest last.
        self.bindings: collections.deque[Binding] = collections.deque(maxlen=BINDINGS_KEPT)
        self.window = CreditWindow(self, metrics)
        self.lock = asyncio.Lock()
        self._interval = config.heartbeat_interval_s
        self._metrics_out = metrics.peer_batches.labels(direction="out")
        self._metrics_msgs = metrics.peer_messages.labels(direction="out")
        self._out: list[peer_pb2.PeerMsg] = []
        # The range release still queued in _out that later ones join (None once a batch is taken).
        self._open_release: Any = None
        self._wake = asyncio.Event()
        self._lazy: asyncio.TimerHandle | None = None
        creds = channel_credentials(config)
        opts = grpc_options(config)
        self.channel = (
            grpc.aio.secure_channel(address, creds, options=opts) if creds
            else grpc.aio.insecure_channel(address, options=opts)
        )
        self.stub = peer_pb2_grpc.PeerStub(self.channel)

    def __repr__(self) -> str:
        return f"PeerLink({self.daemon_id or '?'}@{self.address})"

    # ------------------------------------------------------------------ the stream

    async def open_stream(self, first: peer_pb2.PeerBatch, config: Config, auth: PeerAuth,
                          hold: bool) -> tuple[Session, Any] | None:
        """Our stream to the peer with `first` (its Hello) sent: framed where the peer serves it and
        we reach it, else the Session RPC. None if the peer's stream came up meanwhile and we took
        it (see `taken`; on the framed stream no Hello went out on ours then)."""
        wire = await self._dial_framed(config, auth)
        if self.taken(wire.abort if wire is not None else lambda: None):
            return None
        if wire is None:
            call = self.stub.Session()
            await call.write(first)
            return Session(call.write, call.cancel, ours=True, hold=hold), call
        try:
            await wire.write(first)
        except BaseException:
            wire.abort()
            raise
        return Session(wire.write, wire.abort, "framed", ours=True, hold=hold), wire

    async def _dial_framed(self, config: Config, auth: PeerAuth) -> WireStream | None:
        """The peer's framed stream; None where it names none (or it is off here) or it is out of
        reach, for the Session RPC to serve instead."""
        if not self.stream_address or config.peer_stream_port < 0:
            return None
        if time.monotonic() - self.framed_failed_at < FRAMED_RETRY_S:
            return None
        try:
            wire = await dial(self.stream_address, config, CONTROL_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            # A firewall that lets only the peer port through, say: slower, but it works.
            logger.warning("peer %s: its control stream at %s is out of reach (%s); using the gRPC "
                           "Session stream instead", self.daemon_id, self.stream_address, exc or type(exc).__name__)
            return None
        try:
            # mTLS: the stream's server must be the daemon we handshook with.
            auth.check_claim(PeerCreds(wire.peer_cert_ids()), self.daemon_id)
        except BaseException:
            wire.abort()
            raise
        return wire

    def answered(self, reply: peer_pb2.HandshakeReply) -> DaemonRef:
        """The daemon that answered our handshake; refused if it speaks another protocol MAJOR."""
        ref = daemon_ref(reply.sender)
        if mismatch := protocol_mismatch(reply.version):
            raise FailedPrecondition(f"daemon {ref.daemon_id[:100]!r} at {self.address}: {mismatch}")
        return ref

    def taken(self, close: Callable[[], Any]) -> bool:
        """While we dial: True, with our stream closed by `close`, if the link has a stream now (the
        peer's, taken in a tie-break it won); raises if the peer was lost meanwhile."""
        if self.up and self.session is None:
            return False
        close()
        if not self.up:
            raise Unavailable(f"peer {self.daemon_id} was lost while our control stream to it was opened")
        return True

    def attach(self, session: Session) -> None:
        """Makes `session` the one we write to (a newer one replaces an older one). Its first batch
        leaves at once: for a stream we accepted, that tells the dialer it was taken up."""
        old, self.session = self.session, session
        if old is not None and old is not session:
            self._close(old)
        self.last_rx = time.monotonic()
        session.writer = asyncio.ensure_future(self._write_loop(session))
        self._wake.set()

    def drop(self, session: Session) -> None:
        """Closes a stream the peer refused in a tie-break: not a loss. What is queued stays for the
        stream the peer dialed; liveness calls the peer lost if that one does not come up."""
        if self.session is session:
            self.session = None
            self.last_rx = time.monotonic()
        self._close(session)

    def framed_cut(self, session: Session, why: str, redial: Callable[[], Any]) -> bool:
        """Whether `session`, our framed stream, ended before the peer took it up (its framed port
        cut or refused it: strangers at its cap of streams before a Hello, say); if so it is
        dropped, `redial` opens the next, and the Session RPC serves the pair for FRAMED_RETRY_S."""
        if session.kind != "framed" or not session.ours or session.heard or self.session is not session:
            return False
        logger.warning("control stream with %s (%s): %s before it was taken up; using the gRPC Session "
                       "stream", self.daemon_id, self.address, why)
        self.framed_failed_at = time.monotonic()
        self.drop(session)
        redial()
        return True

    def race(self, low: bool, now: float, recent_s: float) -> str:
        """What to do with a stream the peer opened while this link is up: "take" it, "refuse" it
        (TieBreak: we are the lower daemon id and dial or hold a stream of ours, which the peer will
        take instead), or take it as a "replace"ment of a stream the peer must have lost.

        Both dialed at once: the lower id keeps its own stream; the higher one takes the lower's
        and drops its own, which has carried nothing yet (held). A stream of ours the peer took up
        within `recent_s` still counts as dialed at once (its Hello may have crossed our stream's
        first batch); an older one, or one the peer dialed, was given up by the peer if it dials
        again (it dials only with no stream), and what ran on it failed on its side."""
        cur = self.session
        mine = self.dialing or (cur is not None and cur.ours)
        if mine and low and (cur is None or not cur.heard or now - cur.heard_at < recent_s):
            return "refuse"
        if cur is None or (mine and not low and not cur.heard):
            return "take"
        return "replace"

    def silent(self, now: float, limit: float, first_word: float) -> str:
        """Why this link (up) is to be called lost now, or "". A stream must hear from the peer
        every `limit` s, a new one within `first_word`; a link the peer handshook on but opened no
        stream for (or whose stream was refused or dropped) within `first_word` is lost as well."""
        quiet = now - self.last_rx
        limit, first_word = max(limit, self.peer_limit_s), max(first_word, self.peer_limit_s)
        if self.session is None:
            if not self.dialing and quiet >= first_word:
                return f"no control stream for {quiet:.1f} s after the handshake"
        elif quiet >= (limit if self.session.heard else first_word):
            return f"no word for {quiet:.1f} s"
        return ""

    def detach(self) -> None:
        if self.session is not None:
            self._close(self.session)
            self.session = None
        self._out.clear()
        self._open_release = None
        self._cancel_lazy()

    def _cancel_lazy(self) -> None:
        if self._lazy is not None:
            self._lazy.cancel()
            self._lazy = None

    def _close(self, session: Session) -> None:
        # The writer is not cancelled mid-write: gRPC cannot end a stream while a write of it is
        # still pending. It sees `closed` once its current write is done, and stops.
        session.closed = True
        session._go.set()
        self._wake.set()
        try:
            session.cancel()
        except Exception:
            logger.debug("cancelling a peer stream failed", exc_info=True)

    async def _write_loop(self, session: Session) -> None:
        if session.hold:
            await session._go.wait()
        while not session.closed:
            try:
                await asyncio.wait_for(self._wake.wait(), self._interval / 2)
            except asyncio.TimeoutError:
                pass
            if session.closed:
                return
            self._wake.clear()
            self._cancel_lazy()
            msgs, self._out = self._out[:MAX_BATCH], self._out[MAX_BATCH:]
            self._open_release = None  # the batch copies its messages: later ranges must not join them
            if self._out:
                self._wake.set()
            try:
                await session.write(peer_pb2.PeerBatch(msgs=msgs))
            except Exception as exc:
                if not session.closed:
                    logger.info("writing to peer %s failed: %s", self.daemon_id or self.address, exc)
                return
            self._metrics_out.inc()
            if msgs:
                self._metrics_msgs.inc(len(msgs))

    def _push(self, msg: peer_pb2.PeerMsg) -> None:
        self._out.append(msg)
        self._wake.set()

    def _push_lazy(self, msg: peer_pb2.PeerMsg) -> None:
        """Queues a message that may wait LAZY_FLUSH_S for others to share its batch."""
        self._out.append(msg)
        if self._lazy is None and not self._wake.is_set():
            self._lazy = asyncio.get_running_loop().call_later(LAZY_FLUSH_S, self._wake.set)

    # ------------------------------------------------------------------ messages (ports.Link)

    def send_bootstrap(self, m: BootstrapMsg) -> None:
        b = peer_pb2.Bootstrap(
            room=room_key_pb(m.room), prefill_group=m.group, reader_rank=m.reader, decode_tp=m.decode_tp,
            layout=layout_pb(m.layout), num_tokens=m.num_tokens, deadline_unix_ms=max(0, m.deadline_unix_ms),
            reader_ring=m.reader_ring, notif_token=m.notif_token, layer_parts=m.layer_parts,
        )
        if m.zero_copy is not None:
            b.zero_copy.CopyFrom(zero_copy_target_pb(m.zero_copy))
        self._push(peer_pb2.PeerMsg(bootstrap=b))

    def send_bootstrap_reply(self, a: BootstrapAnswer) -> None:
        r = peer_pb2.BootstrapReply(room=room_key_pb(a.room), reader_rank=a.reader, code=a.code,
                                    message=a.message[:1000], prefill_tp=a.prefill_tp, zero_copy=a.zero_copy)
        if a.layout is not None:
            r.layout.CopyFrom(layout_pb(a.layout))
        self._push(peer_pb2.PeerMsg(bootstrap_reply=r))

    def send_grant(self, credits: Sequence[CreditSpec]) -> None:
        self._push(peer_pb2.PeerMsg(grant=peer_pb2.CreditGrant(credits=[
            peer_pb2.Credit(id=c.id, ring=c.ring, address=c.address, length=c.length, mem=c.mem, device=c.device,
                            local=None if c.local is None else peer_pb2.LocalRing(
                                handle=c.local.handle, device_uuid=c.local.device_uuid, size=c.local.size,
                                offset=c.local.offset, base=c.local.base))
            for c in credits
        ])))

    def send_credit_request(self, ring: str, nbytes: int) -> None:
        self._push(peer_pb2.PeerMsg(credit_request=peer_pb2.CreditRequest(ring=ring, bytes=nbytes)))

    def send_credit_return(self, ids: Sequence[int]) -> None:
        self._push(peer_pb2.PeerMsg(credit_return=peer_pb2.CreditReturn(ids=list(ids))))

    def send_revoke(self, ids: Sequence[int], reason: str) -> None:
        self._push(peer_pb2.PeerMsg(revoke=peer_pb2.CreditRevoke(ids=list(ids), reason=reason[:500])))

    def send_reclaim(self, ring: str) -> None:
        self._push(peer_pb2.PeerMsg(reclaim=peer_pb2.Reclaim(ring=ring)))

    def send_release(self, ranges: Sequence[tuple[int, int]] = (), rooms: Sequence[RoomKey] = ()) -> None:
        rel = self._open_release
        if not rooms and rel is not None and len(rel.ranges) + len(ranges) <= MAX_RANGES_PER_MSG:
            # Joins the range release still queued (its flush is already due): one message, and
            # one dispatch on the other side, for every chunk consumed meanwhile.
            add = rel.ranges.add
            for c, o in ranges:
                add(credit_id=c, offset=o)
            return
        msg = peer_pb2.PeerMsg(release=peer_pb2.RangeRelease(
            ranges=[peer_pb2.Range(credit_id=c, offset=o) for c, o in ranges],
            rooms=[room_key_pb(k) for k in rooms],
        ))
        if rooms:
            self._push(msg)
            return
        self._open_release = msg.release
        self._push_lazy(msg)

    def send_complete(self, room: RoomKey, reader: int, num_chunks: int, aux: bytes) -> None:
        self._push(peer_pb2.PeerMsg(complete=peer_pb2.Complete(
            room=room_key_pb(room), reader_rank=reader, num_chunks=num_chunks, aux=aux)))

    def send_complete_ack(self, room: RoomKey, reader: int, code: int, message: str = "") -> None:
        self._push(peer_pb2.PeerMsg(complete_ack=peer_pb2.CompleteAck(
            room=room_key_pb(room), reader_rank=reader, code=code, message=message[:1000])))

    def send_abort(self, room: RoomKey, code: FailureCode, reason: str, quiesced: bool) -> None:
        self._push(peer_pb2.PeerMsg(abort=peer_pb2.Abort(
            room=room_key_pb(room), code=common_pb2.FailureCode.ValueType(code), reason=reason[:1000],
            quiesced=quiesced)))

    async def close(self) -> None:
        self.detach()
        await self.channel.close()


def forget(by_address: dict[str, PeerLink], by_id: dict[str, PeerLink], next_dial: dict[str, Any], now: float,
           after_s: float, static: Collection[str]) -> list[PeerLink]:
    """Takes the links nobody needs any more out of the peer tables (down for after_s, not being
    dialed, not a configured peer) and returns them, for closing. What their rooms and credits
    were is settled already: the loss failed the rooms, and credits are revoked (ours, granted to
    the peer, stay quarantined by the ledger, which keeps its own reference to the link)."""
    def stale(h: PeerLink) -> bool:
        return (not h.up and not h.is_self and not h.dialing and not h.lock.locked()
                and h.address not in static and now - h.down_since >= after_s)

    gone: dict[int, PeerLink] = {}
    for table in (by_address, by_id):
        for key, h in list(table.items()):
            if stale(h):
                del table[key]
                gone[id(h)] = h
    for h in gone.values():
        next_dial.pop(h.address, None)  # the redial back-off, kept by the address dialed
        logger.info("peer %s (%s) forgotten: down for %.0f s", h.daemon_id or "?", h.address, now - h.down_since)
    return list(gone.values())
