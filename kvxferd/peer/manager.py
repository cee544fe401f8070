"""Peer daemons: handshakes, control streams, liveness, restarts, and routing what they send.

Peers are learned from the rooms a daemon serves (ExpectRoom names the prefill daemon) and from
the static `peers` list. A peer whose stream breaks or falls silent, or that handshakes and opens
no stream, is lost at once: its rooms fail on this side and its credits are revoked. It is never
blacklisted: the next connect handshakes again, with its new NIXL metadata if it restarted. Two
daemons that dial each other at once keep the stream the lower daemon id dialed, and lose nothing
(PeerLink.race); a peer that opens a new stream otherwise lost the one we hold, and so do we.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvxfer_protocol.pb.kvxfer.v1 import peer_pb2
from kvxfer_protocol.version import PROTOCOL_VERSION
from kvxferd.config import Config, _valid_hostport
from kvxferd.core.pb_convert import daemon_ref, daemon_ref_pb
from kvxferd.core.peer_port import Identity, Link
from kvxferd.core.types import DaemonRef
from kvxferd.datapath.credits import CreditWindow
from kvxferd.datapath.workers import WorkerPool
from kvxferd.errors import InvalidArgument, KvxferError, PermissionDenied, Unavailable
from kvxferd.ops.metrics import Metrics
from kvxferd.peer.auth import Binding, PeerAuth, PeerCreds, Proof
from kvxferd.peer.caps import PeerLimits, PeerStatus
from kvxferd.peer.dispatch import PeerInbox, dispatch
from kvxferd.peer.heal import PairHealth
from kvxferd.peer.link import CONTROL_TIMEOUT_S, PeerLink, Session, TieBreak, forget, lost_tie_break, proof_of, proof_pb
from kvxferd.peer.wire import refused as _refused
from kvxferd.transports.interface import Transport
from kvxferd.transports.local_ipc import same_host

logger = logging.getLogger(__name__)


class PeerManager:
    def __init__(self, ident: Identity, config: Config, transport: Transport, workers: WorkerPool,
                 metrics: Metrics, inbox: PeerInbox, spawn: Callable[[Any, str], None]) -> None:
        self.ident = ident
        self.config = config
        self._transport = transport
        self._workers = workers
        self._metrics = metrics
        metrics.peer_series.cap = config.max_peer_series
        self._inbox = inbox
        self._spawn = spawn
        self._by_address: dict[str, PeerLink] = {}
        self._by_id: dict[str, PeerLink] = {}
        self._task: asyncio.Task[None] | None = None
        self._next_dial: dict[str, tuple[float, float]] = {}  # address -> (next try, last wait)
        self.auth = PeerAuth(config, metrics)
        self.limits = PeerLimits(config, metrics, lambda: len(self._by_id), lambda: len(self._by_address),
                                 len(config.peers))
        # Test-only fault hook (`slow-accept S`): a stream we accept is taken up S seconds late, as
        # a loaded node or a slow NIXL metadata load delays it.
        self.accept_delay_s = 0.0
        self._rx_batches = metrics.peer_batches.labels(direction="in")
        self._rx_msgs = metrics.peer_messages.labels(direction="in")
        # Liveness: every live session hears from its peer at least every interval/2 (an empty
        # batch when idle), so silence for `misses` intervals means the peer or the path is gone.
        # A stream we dialed is silent until the peer has taken it up (checked its proof, maybe
        # loaded new NIXL metadata): on a loaded node that took longer than a short heartbeat
        # limit, and rooms failed PEER_LOST between a stream breaking and its replacement, so
        # until the first word it gets the handshake's time; so does a handshake until its stream.
        self._limit = config.heartbeat_misses * config.heartbeat_interval_s
        self._first_word = max(self._limit, CONTROL_TIMEOUT_S)
        self.health = PairHealth(config, transport, workers, metrics, spawn, self._refresh, self.handshake)

    # ------------------------------------------------------------------ lookups

    def all(self) -> list[Link]:
        return list(self._by_id.values())

    def known(self, daemon_id: str) -> PeerLink | None:
        return self._by_id.get(daemon_id)

    def by_address(self, address: str) -> PeerLink | None:
        return self._by_address.get(address)

    @staticmethod
    def window(peer: Link) -> CreditWindow:
        assert isinstance(peer, PeerLink)
        return peer.window

    def link(self, address: str) -> PeerLink:
        h = self._by_address.get(address)
        if h is None:
            h = PeerLink(address, self.config, self._metrics)
            self._by_address[address] = h
        return h

    @property
    def me(self) -> DaemonRef:
        i = self.ident
        return DaemonRef(i.daemon_id, i.instance_id, i.address, i.stream_address, self.config.heartbeat_interval_s)

    @property
    def _me(self) -> peer_pb2.DaemonRef:
        return daemon_ref_pb(self.me)

    def status(self) -> PeerStatus:
        return PeerStatus(self.auth.mode, self.limits.usage())

    # ------------------------------------------------------------------ dialing

    async def connect(self, address: str) -> Link:
        """A peer that is up, handshaken and has a live session (dialing one now if needed)."""
        h = self.link(address)
        if h.up and h.session is not None and (h.is_self or h.md_epoch_sent == self.ident.md_epoch):
            return h
        async with h.lock:
            if not h.up or h.md_epoch_sent != self.ident.md_epoch:
                try:
                    await self.handshake(h)
                except Exception:
                    # Nobody we know answered: keep no link (nor channel), so such addresses don't pile up.
                    if address not in self.config.peers:
                        self._drop_unused(h, fresh=True)
                    raise
            if h.session is None:
                if h.is_self:
                    # Rooms between two engines of this daemon: the "stream" is a direct hand-off.
                    self._start_session(h, Session(self._to_self(h), lambda: None, "local"))
                else:
                    await self._dial_session(h)
        return h

    def _to_self(self, h: PeerLink) -> Callable[[peer_pb2.PeerBatch], Any]:
        async def write(batch: peer_pb2.PeerBatch) -> None:
            self.on_batch(h, batch)

        return write

    async def handshake(self, h: PeerLink) -> None:
        epoch = self.ident.md_epoch
        agent, metadata = self._transport.name, self._transport.metadata()
        keys, challenge = self.auth.signing_keys(), await self.auth.challenge_of(h.stub, CONTROL_TIMEOUT_S)
        for i, key in enumerate(keys):
            sent = self.auth.request_proof(self.me, agent, metadata, key, challenge)
            try:
                reply = await h.stub.Handshake(
                    peer_pb2.HandshakeRequest(sender=self._me, agent_name=agent, nixl_metadata=metadata,
                                              version=PROTOCOL_VERSION, proof=proof_pb(sent),
                                              host_tag=same_host.tag(self.ident, challenge.instance_id)),
                    timeout=CONTROL_TIMEOUT_S,
                )
                break
            except grpc.aio.AioRpcError as exc:
                # Mid-rotation the peer may know only our previous secret.
                if exc.code() != grpc.StatusCode.PERMISSION_DENIED or i + 1 == len(keys):
                    raise
        ref, their_md = h.answered(reply), bytes(reply.nixl_metadata)
        self.limits.metadata(len(their_md))
        # The server's certificate must name the daemon it claims to be (mTLS).
        self.auth.check_claim(await self.auth.server_ids(h.address, CONTROL_TIMEOUT_S), ref.daemon_id)
        binding = self.auth.verify_reply(ref, reply.agent_name, their_md, self.me, sent, key, proof_of(reply), challenge)
        same_host.check(reply.host_tag, ref, self.ident.instance_id, self.auth.mode != "insecure")
        await self.adopt(h, ref, reply.agent_name, their_md)
        self._bind(ref.daemon_id, binding)
        h.md_epoch_sent = epoch

    def _bind(self, daemon_id: str, binding: Binding) -> None:
        h = self._by_id.get(daemon_id)
        if h is not None and binding[0]:
            h.bindings.append(binding)

    async def _dial_session(self, h: PeerLink) -> None:
        h.dialing = True  # in the same step as connect's check (see PeerLink.race)
        try:
            proof = self.auth.hello_proof(self.me, h.instance_id, h.bindings[-1] if h.bindings else None)
            hello = peer_pb2.PeerMsg(hello=peer_pb2.Hello(sender=self._me, peer_instance_id=h.instance_id,
                                                          proof=proof_pb(proof)))
            # The higher daemon id holds its writes until the peer has taken the stream up.
            opened = await h.open_stream(peer_pb2.PeerBatch(msgs=[hello]), self.config, self.auth,
                                         hold=self.ident.daemon_id > h.daemon_id)
        finally:
            h.dialing = False
        if opened is None or h.taken(opened[0].cancel):
            logger.info("control stream with %s (%s): the peer's came up while ours was being opened; "
                        "ours is closed", h.daemon_id, h.address)
            return
        session, batches = opened
        self._start_session(h, session)
        self._spawn(self._read(h, session, batches), f"{session.kind} control stream with {h.address}")

    def _start_session(self, h: PeerLink, session: Session) -> None:
        self._metrics.peer_streams.labels(kind=session.kind).inc()
        logger.info("control stream with %s (%s) up: %s", h.daemon_id, h.address, session.kind)
        h.attach(session)
        if h.lost_instance:
            old, h.lost_instance = h.lost_instance, ""
            self._inbox.on_peer_back(h, old)

    async def _read(self, h: PeerLink, session: Session, batches: Any, reraise: bool = False) -> None:
        why = "control stream closed"
        refused: KvxferError | None = None
        tie = False
        try:
            async for batch in batches:
                if session.closed:
                    return
                if not session.heard:
                    session.hear()  # (a stream we dialed: taken up, our held writes may go)
                self.on_batch(h, batch)
        except KvxferError as exc:
            why, refused, tie = f"control stream refused: {exc}", exc, lost_tie_break(exc)
        except grpc.aio.AioRpcError as exc:
            why, tie = f"control stream broke: {exc.code().name}", lost_tie_break(exc)
        except asyncio.CancelledError:
            return
        except Exception as exc:
            why = f"control stream failed: {exc!r}"
        if tie and session.ours and not session.heard:
            # Both dialed at once and the peer keeps its own stream: ours carried nothing but its
            # Hello (held), and what is queued goes on the peer's stream once it is taken up.
            logger.info("control stream with %s (%s): the peer keeps the one it dialed", h.daemon_id, h.address)
            h.drop(session)
            return
        if h.session is session and not session.closed and not h.framed_cut(  # (then not a loss)
                session, why, lambda: self._spawn(self.connect(h.address), f"Session stream with {h.address}")):
            self.lost(h, why)
        if refused is not None and reraise:
            raise refused

    # ------------------------------------------------------------------ accepting

    async def accept_handshake(self, ref: DaemonRef, agent: str, metadata: bytes, proof: Proof | None,
                               creds: PeerCreds) -> tuple[Proof | None, bytes]:
        """A peer's handshake: checked in full before it may add anything to the peer table; a
        refused one leaves nothing behind and dials nothing. Returns our proof and metadata."""
        try:
            with self.limits.handshake():
                return await self._accept_handshake(ref, agent, metadata, proof, creds)
        except KvxferError as exc:
            self.auth.refused("handshake", f"from {ref.daemon_id[:100]!r} at {ref.address[:100]!r}: {exc}")
            raise

    async def _accept_handshake(self, ref: DaemonRef, agent: str, metadata: bytes, proof: Proof | None,
                                creds: PeerCreds) -> tuple[Proof | None, bytes]:
        self.limits.metadata(len(metadata))
        if not metadata or not agent:
            raise InvalidArgument("agent_name and nixl_metadata are required")
        # We may dial it back: only HOST:PORT, nothing a resolver would guess at (no names, no schemes).
        if not _valid_hostport(ref.address):
            raise InvalidArgument(f"sender.address must be HOST:PORT, got {ref.address[:100]!r}")
        self.auth.check_claim(creds, ref.daemon_id)
        their_nonce, key = self.auth.verify_request(ref, agent, metadata, proof, self.ident.instance_id)
        # Claiming the address of another daemon that is up would re-bind its link (failing its
        # rooms, pointing its NIXL agent elsewhere): only a daemon gone silent can be replaced.
        known = self._by_address.get(ref.address)
        if known is not None and known.up and known.daemon_id and known.daemon_id != ref.daemon_id:
            raise PermissionDenied(f"{ref.address} belongs to daemon {known.daemon_id!r}, which is up")
        if ref.daemon_id not in self._by_id and len(self._by_id) >= self.config.max_peers:
            self._forget(time.monotonic(), self._limit)  # at the cap: make room from peers long down
        self.limits.new_peer(ref.daemon_id not in self._by_id, known is None)
        h = self.link(ref.address)
        try:
            await self.adopt(h, ref, agent, metadata)
        except KvxferError:
            raise
        except Exception as exc:
            raise InvalidArgument(f"cannot load the peer's NIXL metadata: {exc}") from exc
        finally:
            self._drop_unused(h, fresh=known is None)
        ours = self._transport.metadata()
        reply, binding = self.auth.reply_proof(self.me, self._transport.name, ours, ref, their_nonce, key)
        self._bind(ref.daemon_id, binding)
        return reply, ours

    def _drop_unused(self, h: PeerLink, fresh: bool) -> None:
        """A link made for a handshake that failed, or that turned out to alias a known daemon."""
        if fresh and (not h.daemon_id or self._by_address.get(h.address) is not h):
            if self._by_address.get(h.address) is h:
                del self._by_address[h.address]
            self._spawn(h.close(), f"close unused link {h.address}")

    def check_heartbeat(self, ref: DaemonRef | None, creds: PeerCreds) -> None:
        if ref is not None:
            self.auth.check_claim(creds, ref.daemon_id)

    async def accept(self, hello: peer_pb2.Hello, session: Session, creds: PeerCreds) -> PeerLink:
        """A stream opened by a peer: it must name a completed handshake of that exact instance."""
        ref = daemon_ref(hello.sender)
        try:
            self.auth.check_claim(creds, ref.daemon_id)
            h = self._by_id.get(ref.daemon_id)
            if h is None or not h.up or h.instance_id != ref.instance_id:
                raise PermissionDenied(f"daemon {ref.daemon_id!r} instance {ref.instance_id!r} has not handshaken")
            if hello.peer_instance_id != self.ident.instance_id:
                raise PermissionDenied("the stream was meant for another instance of this daemon")
            self.auth.verify_hello(ref, hello.peer_instance_id, proof_of(hello), h.bindings)
        except KvxferError as exc:
            self.auth.refused("session", f"from {ref.daemon_id[:100]!r}: {exc}")
            raise
        if self.accept_delay_s:
            logger.warning("fault injection: accepting the stream from %s %.1f s late", ref.daemon_id,
                           self.accept_delay_s)
            await asyncio.sleep(self.accept_delay_s)
            if not h.up or h.instance_id != ref.instance_id:
                raise Unavailable(f"daemon {ref.daemon_id!r} was lost before its stream was taken up")
        # From here to the attach nothing awaits: the decision holds for the state it saw.
        verdict = h.race(self.ident.daemon_id < h.daemon_id, time.monotonic(), self._first_word)
        if verdict == "refuse":
            logger.info("control stream from %s: both dialed at once; the pair keeps ours", h.daemon_id)
            raise TieBreak()
        if verdict == "replace":
            # It dials only when it has no stream with us: it lost ours (and what ran on it), so do we.
            self._lose_session(h, "it opened a new control stream; the old one is lost")
        session.hear()  # its Hello
        self._start_session(h, session)
        return h

    async def serve_stream(self, h: PeerLink, session: Session, rest: peer_pb2.PeerBatch, batches: Any) -> None:
        try:
            self.on_batch(h, rest)
        except KvxferError as exc:
            self.lost(h, f"control stream refused: {exc}")
            raise
        await self._read(h, session, batches, reraise=True)

    # ------------------------------------------------------------------ identities and metadata

    async def adopt(self, h: PeerLink, ref: DaemonRef, agent_name: str, metadata: bytes) -> None:
        """Records who is behind a link and loads its NIXL metadata (replacing a restarted peer's)."""
        if ref.daemon_id == self.ident.daemon_id:
            if ref.instance_id != self.ident.instance_id:
                raise InvalidArgument(f"another daemon uses our daemon_id {ref.daemon_id!r}")
            h.is_self = True
        old = self._by_id.get(ref.daemon_id)
        if old is not None and old is not h:
            # Same daemon reached by another address: keep one link.
            if old.instance_id == ref.instance_id and old.up:
                self._by_address[h.address] = old
                old.stream_address = ref.stream_address
                await self._reload_metadata(old, metadata)
                return
            self.lost(old, "peer restarted" if old.instance_id != ref.instance_id else "peer re-addressed")
            self._by_id.pop(ref.daemon_id, None)
        if h.up and h.instance_id == ref.instance_id and (h.agent_name or h.is_self):
            # A repeated handshake from the same process: never remove its entry (transfers may be
            # using it), but load metadata that changed (a GPU ring registered or released since).
            h.stream_address = ref.stream_address
            await self._reload_metadata(h, metadata)
            return
        if h.up and h.instance_id and h.instance_id != ref.instance_id:
            self.lost(h, f"peer {ref.daemon_id} restarted")
        if h.instance_id and h.instance_id != ref.instance_id:
            h.lost_instance = h.lost_instance or h.instance_id
            h.bindings.clear()
        if not h.is_self:
            if h.agent_name:
                await self._workers.run_blocking(self._transport.remove_remote, h.agent_name)
            h.agent_name = await self._workers.run_blocking(self._transport.add_remote, metadata)
            h.metadata = metadata
        else:
            h.agent_name = agent_name
        h.daemon_id, h.instance_id, h.stream_address = ref.daemon_id, ref.instance_id, ref.stream_address
        h.peer_limit_s = self.config.heartbeat_misses * ref.heartbeat_interval_s
        if ref.address and ref.address != h.address:
            self._by_address.setdefault(ref.address, h)
        h.up = True
        h.last_rx = time.monotonic()
        self._by_id[ref.daemon_id] = h
        self._metrics.peer_series.admit(ref.daemon_id)
        self._refresh()
        logger.info("peer %s (%s) is up, NIXL agent %s", ref.daemon_id, h.address, h.agent_name)

    async def _reload_metadata(self, h: PeerLink, metadata: bytes) -> None:
        """Same live peer, handshaking again. Changed metadata (it imported or released a GPU ring):
        its NIXL entry is replaced whole while no WRITE to it is in flight."""
        if h.is_self or not h.agent_name or metadata == h.metadata:
            return
        try:
            h.agent_name = await self._workers.exclusive(h.agent_name, self._transport.add_remote, metadata)
        except Exception as exc:
            self.lost(h, f"loading its new NIXL metadata failed: {exc}")
            raise
        h.metadata = metadata
        self._metrics.peer_series.labels(self._metrics.peer_metadata_reloads, h.daemon_id).inc()
        logger.info("peer %s: NIXL metadata replaced (it registered or released memory)", h.daemon_id)

    def lost(self, h: PeerLink, reason: str) -> None:
        if not h.up:
            return
        h.up, h.broken = False, ""  # a new handshake loads a new entry
        h.down_since = time.monotonic()
        self._lose_session(h, reason)
        if h.agent_name and not h.is_self:
            name, h.agent_name = h.agent_name, ""
            h.metadata = b""
            self._spawn(self._workers.run_blocking(self._transport.remove_remote, name), "remove remote")
        self._refresh()

    def _lose_session(self, h: PeerLink, reason: str) -> None:
        """What ran on the link's stream fails and its credits are revoked (the link stays up if
        only its stream was lost: the next one tells the ledger, as after a loss)."""
        h.lost_instance = h.instance_id
        logger.warning("peer %s (%s) lost: %s", h.daemon_id, h.address, reason)
        h.detach()
        h.window.lost()
        self._inbox.on_peer_lost(h, f"peer {h.daemon_id} lost: {reason}")

    def instance_gone(self, daemon_id: str, instance_id: str, reason: str) -> None:
        """The fleet registry lost this instance's record (lease expired or revoked, or a new instance
        replaced it): it is lost at once, unless it spoke to us within the last heartbeat interval;
        then etcd, not the peer, is what failed (an outage outlived the lease), and the stream decides."""
        h = self._by_id.get(daemon_id)
        if h is None or not h.up or h.instance_id != instance_id or h.is_self:
            return
        if time.monotonic() - h.last_rx < self.config.heartbeat_interval_s:
            logger.info("peer %s: %s, but it spoke to us just now; its stream decides", daemon_id, reason)
            return
        self.lost(h, f"registry: {reason}")

    def _refresh(self) -> None:
        up = sum(1 for h in self._by_id.values() if h.up and not h.broken)
        self._metrics.peers.labels(state="up").set(up)
        self._metrics.peers.labels(state="down").set(len(self._by_id) - up)

    # ------------------------------------------------------------------ incoming messages

    def on_batch(self, h: PeerLink, batch: peer_pb2.PeerBatch) -> None:
        self.limits.batch(len(batch.msgs))
        h.last_rx = time.monotonic()
        self._rx_batches.inc()
        if not batch.msgs:
            return
        self._rx_msgs.inc(len(batch.msgs))
        for msg in batch.msgs:
            if not h.up:
                return
            try:
                dispatch(self._inbox, h, msg)
            except KvxferError as exc:
                logger.warning("peer %s: %s message refused: %s", h.daemon_id, msg.WhichOneof("body"), exc)
            except Exception:
                logger.exception("peer %s: handling a %s message failed", h.daemon_id, msg.WhichOneof("body"))

    # ------------------------------------------------------------------ liveness

    def start(self) -> None:
        for addr in self.config.peers:
            self.link(addr)
        self._task = asyncio.ensure_future(self._liveness())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for h in set(self._by_address.values()):
            await h.close()

    async def _liveness(self) -> None:
        # Silent streams, and handshakes that no stream followed, are lost (PeerLink.silent); idle
        # credit windows go back. A failure with one peer is logged and the pass goes on: this task
        # ending would stop all of that, and the redials, for the rest of the process.
        interval = self.config.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval / 4)
            now = time.monotonic()
            self.health.woke(now, [h for h in self._by_id.values() if h.up])
            for h in set(self._by_id.values()):
                try:
                    if not h.up:
                        continue
                    why = self.health.judge(h, now, h.silent(now, self._limit, self._first_word))
                    if why:
                        self.lost(h, why)
                    else:
                        h.window.sweep(now)
                except Exception:
                    logger.exception("peer %s (%s): liveness check failed", h.daemon_id, h.address)
            self._forget(now, self.config.peer_forget_s)
            # Static peers, and peers we lost, are dialed again until they answer (backing off to
            # 4 intervals) or are forgotten: a restarted peer is up again before the next room.
            for addr in {*self.config.peers, *(h.address for h in self._by_address.values() if h.daemon_id)}:
                try:
                    self._redial(addr, now, interval)
                except Exception:
                    logger.exception("peer %s: redial failed", addr)

    def _forget(self, now: float, after_s: float) -> None:
        for h in forget(self._by_address, self._by_id, self._next_dial, now, after_s, self.config.peers):
            if h.daemon_id not in self._by_id:  # (not when only an old address of it went)
                self._metrics.peer_series.forget(h.daemon_id)
            self._spawn(h.close(), f"close forgotten link {h.address}")
        self._refresh()

    def _redial(self, addr: str, now: float, interval: float) -> None:
        h = self.link(addr)
        if h.up or h.is_self or h.lock.locked() or now < self._next_dial.get(addr, (0.0, 0.0))[0]:
            return
        wait = min(self._next_dial.get(addr, (0.0, interval / 2))[1] * 2, 4 * interval)
        self._next_dial[addr] = (now + wait, wait)
        self._spawn(self._dial(addr), f"dial {addr}")

    async def _dial(self, addr: str) -> None:
        try:
            await self.connect(addr)
        except Exception as exc:
            logger.debug("peer %s not reachable: %s", addr, exc)
            h = self.link(addr)
            if h.lost_instance and not h.up and await _refused(addr):
                # Nothing listens on its port any more: the instance we lost is gone, and so is
                # any WRITE it could still have posted into the credits it held.
                old, h.lost_instance = h.lost_instance, ""
                logger.info("peer %s (%s): its port refuses connections; instance %s is gone", h.daemon_id, addr, old)
                self._inbox.on_peer_gone(h, old)
        else:
            self._next_dial.pop(addr, None)
