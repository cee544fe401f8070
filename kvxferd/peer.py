"""Daemon-to-daemon control plane: peer handles (client side), heartbeats, and the Peer servicer.

Peers are learned from the rooms a daemon serves (ExpectRoom names the prefill
daemon; Bootstrap carries the decode daemon's address) and from the static
`peers` list. A peer that misses heartbeats is marked down and its rooms fail at
once on this side; it is never blacklisted: the next successful heartbeat or
handshake brings it back, with its new NIXL metadata if it restarted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc

from kvxfer_client._pb.kvxfer.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from kvxferd import __version__
from kvxferd.config import Config, _valid_hostport
from kvxferd.convert import (
    daemon_ref,
    daemon_ref_pb,
    layout,
    layout_pb,
    room_key,
    room_key_pb,
    watermark_pb,
    zero_copy_target,
    zero_copy_target_pb,
)
from kvxferd.domain import DaemonRef, FailureCode, RoomKey, ZeroCopyTarget
from kvxferd.errors import FailedPrecondition, InvalidArgument, KvxferError, NotFound, PermissionDenied
from kvxferd.layout import KVLayout
from kvxferd.memory import Watermark
from kvxferd.metrics import Metrics

if TYPE_CHECKING:
    from kvxferd.node import Node
    from kvxferd.workers import WorkerPool

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 5.0


def channel_credentials(config: Config) -> grpc.ChannelCredentials | None:
    if not config.tls_enabled:
        return None
    key, cert, ca = config.tls_material()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def grpc_options(config: Config) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
    ]


class PeerHandle:
    def __init__(self, manager: PeerManager, address: str) -> None:
        self._m = manager
        self.address = address
        self.daemon_id = ""
        self.instance_id = ""
        self.agent_name = ""
        self.metadata = b""  # the NIXL metadata loaded for agent_name
        self.is_self = False
        self.up = False
        # Node.md_epoch our last handshake carried: a GPU ring registered since is unknown to
        # the peer's NIXL agent (a WRITE into it fails NOT_FOUND) until we send metadata again.
        self.md_epoch_sent = -1
        self.last_ok = time.monotonic()
        self.bytes_sent = 0
        self._space = asyncio.Event()
        self._lock = asyncio.Lock()
        creds = channel_credentials(manager.config)
        opts = grpc_options(manager.config)
        self.channel = (
            grpc.aio.secure_channel(address, creds, options=opts) if creds else grpc.aio.insecure_channel(address, options=opts)
        )
        self.stub = peer_pb2_grpc.PeerStub(self.channel)

    def __repr__(self) -> str:
        return f"PeerHandle({self.daemon_id or '?'}@{self.address})"

    # A fresh event per wait round, so a watermark pushed while an AllocSlot is
    # in flight is not lost.
    def space_event(self) -> asyncio.Event:
        return self._space

    def space_freed(self) -> None:
        ev, self._space = self._space, asyncio.Event()
        ev.set()

    def answered(self) -> None:
        """A reply to one of our requests proves the peer alive (both ways) as well as a heartbeat
        answer does. Under load heartbeats queue behind that very traffic: counting only them
        declared busy peers dead (seen in the soak at 2 s of heartbeat silence)."""
        self.last_ok = time.monotonic()

    @property
    def _me(self) -> peer_pb2.DaemonRef:
        return daemon_ref_pb(self._m.node.ref)

    async def handshake(self, force: bool = True) -> None:
        async with self._lock:
            node = self._m.node
            if self.up and not force and self.md_epoch_sent == node.md_epoch:
                return
            epoch = node.md_epoch
            reply = await self.stub.Handshake(
                peer_pb2.HandshakeRequest(
                    sender=self._me, agent_name=node.transport.name, nixl_metadata=node.transport.metadata(),
                    version=__version__,
                ),
                timeout=CONTROL_TIMEOUT_S,
            )
            await self._m.adopt(self, daemon_ref(reply.sender), reply.agent_name, bytes(reply.nixl_metadata))
            self.md_epoch_sent = epoch

    async def bootstrap(
        self, key: RoomKey, group: str, reader: int, decode_tp: int, lay: KVLayout, num_tokens: int,
        deadline_unix_ms: int, zero_copy: ZeroCopyTarget | None = None,
    ) -> tuple[int, KVLayout]:
        req = peer_pb2.BootstrapRequest(
            sender=self._me, room=room_key_pb(key), prefill_group=group, reader_rank=reader,
            decode_tp=decode_tp, layout=layout_pb(lay), num_tokens=num_tokens,
            deadline_unix_ms=max(0, deadline_unix_ms),
        )
        if zero_copy is not None:
            req.zero_copy.CopyFrom(zero_copy_target_pb(zero_copy))
        reply = await self.stub.Bootstrap(req, timeout=CONTROL_TIMEOUT_S)
        self.answered()
        return reply.prefill_tp, layout(reply.layout)

    async def alloc_slot(
        self, key: RoomKey, chunk_id: int, reader: int, token_start: int, num_tokens: int, last: bool,
    ) -> tuple[int, int, str, int] | None:
        reply = await self.stub.AllocSlot(
            peer_pb2.AllocSlotRequest(
                sender=self._me, room=room_key_pb(key), chunk_id=chunk_id, reader_rank=reader,
                token_start=token_start, num_tokens=num_tokens, last=last,
            ),
            timeout=CONTROL_TIMEOUT_S,
        )
        self.answered()
        if not reply.granted:
            return None
        return reply.address, reply.length, reply.mem or "DRAM", reply.device

    async def complete(self, key: RoomKey, reader: int, num_chunks: int, aux: bytes) -> None:
        await self.stub.Complete(
            peer_pb2.CompleteRequest(
                sender=self._me, room=room_key_pb(key), reader_rank=reader, num_chunks=num_chunks, aux=aux
            ),
            timeout=CONTROL_TIMEOUT_S,
        )
        self.answered()

    async def abort(self, key: RoomKey, code: FailureCode, reason: str, quiesced: bool) -> None:
        try:
            await self.stub.Abort(
                peer_pb2.PeerAbortRequest(
                    sender=self._me, room=room_key_pb(key), code=common_pb2.FailureCode.ValueType(code), reason=reason[:1000], quiesced=quiesced
                ),
                timeout=CONTROL_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:
            # The peer may be the reason the room failed; its heartbeat logic takes over.
            logger.info("room %s: abort not delivered to %s: %s", key, self.daemon_id, exc.code().name)

    async def push_watermark(self, ring: str, wm: Watermark) -> None:
        try:
            await self.stub.Watermark(
                peer_pb2.PeerWatermarkRequest(sender=self._me, ring=ring, watermark=watermark_pb(wm)),
                timeout=CONTROL_TIMEOUT_S,
            )
            self.answered()
        except grpc.aio.AioRpcError as exc:
            logger.info("watermark push to %s failed: %s", self.daemon_id, exc.code().name)

    async def close(self) -> None:
        await self.channel.close()


class PeerManager:
    def __init__(self, node: Node, config: Config, workers: WorkerPool, metrics: Metrics) -> None:
        self.node = node
        self.config = config
        self._workers = workers
        self._metrics = metrics
        self._by_address: dict[str, PeerHandle] = {}
        self._by_id: dict[str, PeerHandle] = {}
        self._task: asyncio.Task[None] | None = None
        self._beats_in_flight: set[PeerHandle] = set()

    def all(self) -> list[PeerHandle]:
        return list(self._by_id.values())

    def known(self, daemon_id: str) -> PeerHandle | None:
        return self._by_id.get(daemon_id)

    def _handle(self, address: str) -> PeerHandle:
        h = self._by_address.get(address)
        if h is None:
            h = PeerHandle(self, address)
            self._by_address[address] = h
        return h

    async def connect(self, address: str) -> PeerHandle:
        """A peer that is up and handshaken (handshaking now if needed)."""
        h = self._handle(address)
        if not h.up or (not h.is_self and h.md_epoch_sent != self.node.md_epoch):
            # Many rooms may ask at once; one handshake serves them all. A GPU ring registered
            # since the last one makes us send our metadata again before a room can use it.
            await h.handshake(force=False)
        return h

    def handle_for(self, sender: DaemonRef) -> PeerHandle:
        h = self._by_id.get(sender.daemon_id)
        if h is None or not h.up:
            raise FailedPrecondition(f"daemon {sender.daemon_id!r} has not handshaken with this daemon")
        if h.instance_id != sender.instance_id:
            raise FailedPrecondition(f"daemon {sender.daemon_id!r} restarted; handshake again")
        return h

    async def adopt(self, h: PeerHandle, ref: DaemonRef, agent_name: str, metadata: bytes) -> None:
        """Records who is behind a handle and loads its NIXL metadata (replacing a restarted peer's)."""
        node = self.node
        if ref.daemon_id == node.daemon_id:
            if ref.instance_id != node.instance_id:
                raise InvalidArgument(f"another daemon uses our daemon_id {ref.daemon_id!r}")
            h.is_self = True
        old = self._by_id.get(ref.daemon_id)
        if old is not None and old is not h:
            # Same daemon reached by another address: keep one handle.
            if old.instance_id == ref.instance_id and old.up:
                self._by_address[h.address] = old
                await self._reload_metadata(old, metadata)
                return
            self._lost(old, "peer restarted" if old.instance_id != ref.instance_id else "peer re-addressed")
            self._by_id.pop(ref.daemon_id, None)
        if h.up and h.instance_id == ref.instance_id and h.agent_name:
            # A repeated handshake from the same process: never remove its entry (transfers
            # may be using it), but load metadata that grew (a GPU ring registered since).
            h.last_ok = time.monotonic()
            await self._reload_metadata(h, metadata)
            return
        if h.up and h.instance_id and h.instance_id != ref.instance_id:
            self._lost(h, f"peer {ref.daemon_id} restarted")
        if not h.is_self:
            if h.agent_name:
                await self._workers.run_blocking(node.transport.remove_remote, h.agent_name)
            h.agent_name = await self._workers.run_blocking(node.transport.add_remote, metadata)
            h.metadata = metadata
        else:
            h.agent_name = agent_name
        h.daemon_id, h.instance_id = ref.daemon_id, ref.instance_id
        if ref.address and ref.address != h.address:
            self._by_address.setdefault(ref.address, h)
        h.up = True
        h.last_ok = time.monotonic()
        self._by_id[ref.daemon_id] = h
        self._refresh()
        logger.info("peer %s (%s) is up, NIXL agent %s", ref.daemon_id, h.address, h.agent_name)

    async def _reload_metadata(self, h: PeerHandle, metadata: bytes) -> None:
        """Same live peer, handshaking again. Unchanged metadata: nothing to do. Changed (it
        imported or released a GPU ring): its NIXL entry is replaced whole while no WRITE to it
        is in flight; WRITEs queued meanwhile wait and then go out against the new entry."""
        if h.is_self or not h.agent_name or metadata == h.metadata:
            return
        name = h.agent_name
        try:
            h.agent_name = await self._workers.exclusive(name, self.node.transport.add_remote, metadata)
        except Exception as exc:
            # The old entry is gone as well: nothing can be written to the peer until a fresh
            # handshake loads it, so its rooms fail now rather than at their next WRITE.
            self._lost(h, f"loading its new NIXL metadata failed: {exc}")
            raise
        h.metadata = metadata
        self._metrics.peer_metadata_reloads.labels(peer=h.daemon_id).inc()
        logger.info("peer %s: NIXL metadata replaced (it registered or released memory)", h.daemon_id)

    def _lost(self, h: PeerHandle, reason: str) -> None:
        if not h.up:
            return
        h.up = False
        logger.warning("peer %s (%s) lost: %s", h.daemon_id, h.address, reason)
        self.node.peer_lost(h, f"peer {h.daemon_id} lost: {reason}")
        if h.agent_name and not h.is_self:
            name, h.agent_name = h.agent_name, ""
            self.node.spawn(self._workers.run_blocking(self.node.transport.remove_remote, name), "remove remote")
        self._refresh()

    def instance_gone(self, daemon_id: str, instance_id: str, reason: str) -> None:
        """The fleet registry lost this instance's record (lease expired or revoked, or a new
        instance replaced it): it is lost at once, unless it answered us within the last heartbeat
        interval; then etcd, not the peer, is what failed (an outage outlived the lease), and
        heartbeats decide."""
        h = self._by_id.get(daemon_id)
        if h is None or not h.up or h.instance_id != instance_id or h.is_self:
            return
        if time.monotonic() - h.last_ok < self.config.heartbeat_interval_s:
            logger.info("peer %s: %s, but it answered us just now; heartbeats decide", daemon_id, reason)
            return
        self._lost(h, f"registry: {reason}")

    def _refresh(self) -> None:
        up = sum(1 for h in self._by_id.values() if h.up)
        self._metrics.peers.labels(state="up").set(up)
        self._metrics.peers.labels(state="down").set(len(self._by_id) - up)

    def start(self) -> None:
        for addr in self.config.peers:
            self._handle(addr)
        self._task = asyncio.ensure_future(self._heartbeats())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for h in set(self._by_address.values()):
            await h.close()

    async def _heartbeats(self) -> None:
        # Beats go out at a fixed rate, one in flight per peer, and silence is checked every
        # eighth of an interval: a peer is lost within misses x interval (+ an eighth) of its
        # last answer. Waiting for each round of beats (each may take a whole interval to time out
        # when the network drops packets) before sleeping again stretched that to ~4 intervals.
        interval = self.config.heartbeat_interval_s
        limit = self.config.heartbeat_misses * interval
        beating: dict[PeerHandle, float] = {}  # handle -> when its next beat is due
        while True:
            await asyncio.sleep(interval / 8)
            now = time.monotonic()
            for h in {h for h in self._by_address.values() if not h.is_self}:
                if h not in self._beats_in_flight and now >= beating.get(h, 0.0):
                    beating[h] = now + interval
                    self._beats_in_flight.add(h)
                    self.node.spawn(self._beat(h, interval), f"heartbeat {h.address}")
                silent = now - h.last_ok
                if h.up and silent >= limit:
                    self._lost(h, f"no heartbeat answer for {silent:.1f} s")

    async def _beat(self, h: PeerHandle, interval: float) -> None:
        try:
            await self._beat_once(h, interval)
        finally:
            self._beats_in_flight.discard(h)

    async def _beat_once(self, h: PeerHandle, interval: float) -> None:
        try:
            reply = await h.stub.Heartbeat(peer_pb2.HeartbeatRequest(sender=h._me), timeout=interval)
        except grpc.aio.AioRpcError as exc:
            if h.daemon_id:
                self._metrics.heartbeat_misses.labels(peer=h.daemon_id).inc()
            silent = time.monotonic() - h.last_ok
            if h.up and silent >= self.config.heartbeat_misses * interval:
                self._lost(h, f"no heartbeat answer for {silent:.1f} s ({exc.code().name})")
            return
        ref = daemon_ref(reply.sender)
        if h.up and ref.instance_id != h.instance_id:
            self._lost(h, "peer restarted")
        h.last_ok = time.monotonic()
        if not h.up:
            try:
                await h.handshake()
            except Exception as exc:
                logger.info("re-handshake with %s failed: %s", h.address, exc)


def _abort_code(value: int) -> FailureCode:
    try:
        return FailureCode(value)
    except ValueError:
        return FailureCode.UNSPECIFIED


class PeerServicer(peer_pb2_grpc.PeerServicer):
    """Converts peer protobufs to domain calls; errors become gRPC statuses in app.rpc_errors."""

    def __init__(self, node: Node, manager: PeerManager) -> None:
        self._node = node
        self._m = manager

    async def Handshake(self, request: peer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext) -> peer_pb2.HandshakeReply:
        ref = daemon_ref(request.sender)
        if not request.nixl_metadata or not request.agent_name:
            raise InvalidArgument("agent_name and nixl_metadata are required")
        # This daemon dials the address back (heartbeats): only HOST:PORT, nothing a resolver
        # would have to guess at (no bare names, no schemes).
        if not _valid_hostport(ref.address):
            raise InvalidArgument(f"sender.address must be HOST:PORT, got {ref.address[:100]!r}")
        # Claiming the address of another daemon that is up would re-bind its handle (failing
        # its rooms, pointing its NIXL agent elsewhere): only a daemon gone silent can be replaced.
        known = self._m._by_address.get(ref.address)
        if known is not None and known.up and known.daemon_id and known.daemon_id != ref.daemon_id:
            raise PermissionDenied(f"{ref.address} belongs to daemon {known.daemon_id!r}, which is up")
        h = self._m._handle(ref.address)
        try:
            await self._m.adopt(h, ref, request.agent_name, bytes(request.nixl_metadata))
        except KvxferError:
            raise
        except Exception as exc:
            raise InvalidArgument(f"cannot load the peer's NIXL metadata: {exc}") from exc
        node = self._node
        return peer_pb2.HandshakeReply(
            sender=daemon_ref_pb(node.ref), agent_name=node.transport.name, nixl_metadata=node.transport.metadata(),
            version=__version__,
        )

    async def Bootstrap(self, request: peer_pb2.BootstrapRequest, context: grpc.aio.ServicerContext) -> peer_pb2.BootstrapReply:
        ref = daemon_ref(request.sender)
        if not request.HasField("room") or not request.HasField("layout"):
            raise InvalidArgument("room and layout are required")
        room = self._node.bootstrap(
            ref, room_key(request.room), request.prefill_group, request.reader_rank, request.decode_tp,
            layout(request.layout), request.num_tokens, request.deadline_unix_ms,
            zero_copy_target(request.zero_copy) if request.HasField("zero_copy") else None,
        )
        assert room.layout is not None
        return peer_pb2.BootstrapReply(
            prefill_tp=room.prefill_tp, layout=layout_pb(room.layout), zero_copy=room.zero_copy
        )

    async def AllocSlot(self, request: peer_pb2.AllocSlotRequest, context: grpc.aio.ServicerContext) -> peer_pb2.AllocSlotReply:
        ref = daemon_ref(request.sender)
        got = self._node.alloc_slot(
            ref, room_key(request.room), request.chunk_id, request.reader_rank, request.token_start,
            request.num_tokens, request.last,
        )
        if got is None:
            return peer_pb2.AllocSlotReply(granted=False)
        addr, length, mem, device = got
        return peer_pb2.AllocSlotReply(granted=True, address=addr, length=length, mem=mem, device=device)

    async def Watermark(self, request: peer_pb2.PeerWatermarkRequest, context: grpc.aio.ServicerContext) -> peer_pb2.PeerWatermarkReply:
        self._node.peer_watermark(daemon_ref(request.sender))
        return peer_pb2.PeerWatermarkReply()

    async def Complete(self, request: peer_pb2.CompleteRequest, context: grpc.aio.ServicerContext) -> peer_pb2.CompleteReply:
        self._node.complete(
            daemon_ref(request.sender), room_key(request.room), request.reader_rank, request.num_chunks,
            bytes(request.aux),
        )
        return peer_pb2.CompleteReply()

    async def Abort(self, request: peer_pb2.PeerAbortRequest, context: grpc.aio.ServicerContext) -> peer_pb2.PeerAbortReply:
        ref = daemon_ref(request.sender)
        if self._m.known(ref.daemon_id) is None:
            raise PermissionDenied(f"daemon {ref.daemon_id!r} is not a known peer")
        self._node.peer_abort(ref, room_key(request.room), _abort_code(request.code), request.reason, request.quiesced)
        return peer_pb2.PeerAbortReply()

    async def Heartbeat(self, request: peer_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext) -> peer_pb2.HeartbeatReply:
        daemon_ref(request.sender)
        return peer_pb2.HeartbeatReply(sender=daemon_ref_pb(self._node.ref))


__all__ = ["NotFound", "PeerHandle", "PeerManager", "PeerServicer"]
