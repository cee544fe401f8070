"""Engine-facing gRPC servicer: protobuf <-> domain and nothing else.

Domain errors become gRPC status codes in `rpc_errors`; handler latency is
recorded per method.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message_factory import GetMessageClass

from kvxfer_protocol.lane_frames import LANE_SUFFIX
from kvxfer_protocol.limits import MAX_BATCH_CHUNKS
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from kvxfer_protocol.version import PROTOCOL_VERSION, parse_protocol, protocol_mismatch
from kvxferd import errors
from kvxferd.buffers.gpu_rings import gpu_data_path, gpu_links
from kvxferd.buffers.host_pool import POOL_SUFFIX
from kvxferd.core.caps import MAX_ID, StreamTicket, check_len
from kvxferd.core.engines import Engine, Ring
from kvxferd.core.node import Node
from kvxferd.core.pb_convert import chunk_spec, engine_spec, room_event_pb, room_key, room_status_pb, watermark_pb
from kvxferd.core.types import Role, SlotRef
from kvxferd.engine_api.pending_registrations import FIRST_WAIT_S, POLL_WAIT_S, PendingRegistrations
from kvxferd.ops.metrics import Metrics
from kvxferd.peer.caps import PeerStatus
from kvxferd.transports.local_ipc import same_host

logger = logging.getLogger(__name__)

_CODES: dict[type[errors.KvxferError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.CapExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,  # a caller at one of the daemon's caps
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_of(exc: errors.KvxferError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return grpc.StatusCode.UNKNOWN


def rpc_errors(service: str, metrics: Metrics) -> Callable[[Any], Any]:
    """Wraps a unary handler: domain errors -> status codes, latency -> histogram."""

    def deco(fn: Any) -> Any:
        method = fn.__name__
        # The OK child is looked up once: a label lookup per call cost more than the observation.
        ok = metrics.rpc_duration.labels(service=service, method=method, code=grpc.StatusCode.OK.name)

        @functools.wraps(fn)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            t0 = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                return await fn(self, request, context)
            except errors.KvxferError as exc:
                code = status_of(exc)
                await context.abort(code, str(exc))
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                code = grpc.StatusCode.INTERNAL
                logger.exception("%s/%s failed", service, method)
                await context.abort(code, f"internal error: {exc!r}")
            finally:
                child = ok if code is grpc.StatusCode.OK else metrics.rpc_duration.labels(
                    service=service, method=method, code=code.name)
                child.observe(time.perf_counter() - t0)

        return wrapper

    return deco


def wrap_servicer(obj: Any, service: str, metrics: Metrics, unary: tuple[str, ...]) -> None:
    deco = rpc_errors(service, metrics)
    for name in unary:
        fn = getattr(type(obj), name)
        setattr(obj, name, deco(fn).__get__(obj))


_EMPTY_REGISTER = engine_pb2.RegisterEngineReply


def _check_client_protocol(request: engine_pb2.RegisterEngineRequest) -> None:
    """Refuses a client of another protocol MAJOR before anything is registered."""
    theirs = request.protocol_version
    if not theirs:
        # A client older than this field. Accepted: engines keep running across a daemon upgrade
        # and re-register with the new daemon; refusing them would turn an upgrade into an outage.
        logger.warning("engine %r (group %r) sent no protocol version (a client older than protocol 1.0); "
                       "accepted as %s", request.name[:MAX_ID], request.group[:MAX_ID], PROTOCOL_VERSION)
        return
    check_len("protocol_version", theirs, MAX_ID)
    why = protocol_mismatch(theirs, who="engine client")
    if why:
        raise (errors.InvalidArgument if parse_protocol(theirs) is None else errors.FailedPrecondition)(why)
_CODE_OK = grpc.StatusCode.OK.value[0]


class EngineServicer(engine_pb2_grpc.EngineServicer):
    UNARY = (
        "RegisterEngine", "UnregisterEngine", "KeepAlive", "AcquireSlot", "ReleaseSlot", "ExpectRoom",
        "EnqueueChunk", "EnqueueChunks", "PollRoom", "Watermark", "AbortRoom", "ReleaseRoom", "GetStatus",
    )

    def __init__(self, node: Node, metrics: Metrics, cuda_importer: Callable[..., Ring] | None,
                 peer_status: Callable[[], PeerStatus] | None = None) -> None:
        self._node = node
        self._peer_status = peer_status
        self._metrics = metrics
        self._cuda_importer = cuda_importer
        self._pending = PendingRegistrations()
        wrap_servicer(self, "Engine", metrics, self.UNARY)

    def lane_methods(self) -> tuple[dict[str, tuple[Any, Any]], dict[str, tuple[Any, Any]], frozenset[str]]:
        """What kvxferd.engine_api.lane serves, each with its request class: every unary call but
        RegisterEngine (which hands out the lane), and the WatchRooms stream (a landed chunk is
        an event); and which unary calls may wait (AcquireSlot, for ring space)."""
        service = engine_pb2.DESCRIPTOR.services_by_name["Engine"]
        unary = {name: (getattr(self, name), GetMessageClass(service.methods_by_name[name].input_type))
                 for name in self.UNARY if name != "RegisterEngine"}
        return unary, {"WatchRooms": (self.WatchRooms, engine_pb2.WatchRoomsRequest)}, frozenset({"AcquireSlot"})

    async def RegisterEngine(self, request: engine_pb2.RegisterEngineRequest, context: Any) -> engine_pb2.RegisterEngineReply:
        _check_client_protocol(request)
        spec = engine_spec(request)
        node = self._node
        # Answer "pending" well inside the caller's deadline, whatever it is.
        left = context.time_remaining() if context is not None else None
        budget = POLL_WAIT_S if left is None else max(0.0, min(POLL_WAIT_S, left / 2))
        check_len("registration_id", request.registration_id, MAX_ID)
        if request.registration_id:
            got = await self._pending.wait(request.registration_id, budget)
        elif request.accept_pending and spec.cuda_ring is not None and self._cuda_importer is not None:
            node.engines.check_spec(spec)  # bad input is refused now, not by a later call
            reg_id = self._pending.start(node.register_engine_async(spec, self._cuda_importer))
            got = await self._pending.wait(reg_id, min(FIRST_WAIT_S, budget))
            if got is None:
                return engine_pb2.RegisterEngineReply(pending=True, registration_id=reg_id, daemon_id=node.ident.daemon_id)
        else:
            got = await node.register_engine_async(spec, self._cuda_importer)
        if got is None:
            return engine_pb2.RegisterEngineReply(
                pending=True, registration_id=request.registration_id, daemon_id=node.ident.daemon_id
            )
        eng = got
        return engine_pb2.RegisterEngineReply(
            engine_id=eng.id, pool_path=node.pool.path, pool_bytes=node.pool.size,
            pool_socket="" if node.pool.path else node.config.socket + POOL_SUFFIX,
            lane_socket=node.config.socket + LANE_SUFFIX if node.config.engine_lane else "",
            ring_offset=eng.ring.pool_offset if eng.ring.kind == "host" else 0, ring_bytes=eng.ring.size,
            lease_ms=int(node.lease_s(eng) * 1000), daemon_id=node.ident.daemon_id, peer_address=node.ident.address,
            claim_slots=eng.claims_slots, token_bytes=eng.token_bytes if eng.claims_slots else 0,
            slot_align=eng.ring.alloc.align if eng.claims_slots else 0,
        )

    async def UnregisterEngine(self, request: engine_pb2.UnregisterEngineRequest, context: Any) -> engine_pb2.UnregisterEngineReply:
        self._node.unregister_engine(request.engine_id)
        return engine_pb2.UnregisterEngineReply()

    async def KeepAlive(self, request: engine_pb2.KeepAliveRequest, context: Any) -> engine_pb2.KeepAliveReply:
        return engine_pb2.KeepAliveReply(lease_ms=int(self._node.keep_alive(request.engine_id) * 1000))

    async def AcquireSlot(self, request: engine_pb2.AcquireSlotRequest, context: Any) -> engine_pb2.AcquireSlotReply:
        # Bounded by the call's own deadline too: a waiting call never outlives its caller.
        left = context.time_remaining()
        wait_s = min(request.wait_ms / 1000, 600.0, max(0.0, left - 0.05) if left is not None else 600.0)
        if request.claims:
            freed = await self._node.wait_freed(request.engine_id, list(request.held_claims), wait_s)
            return engine_pb2.AcquireSlotReply(freed_claims=freed)
        if request.wait_ms:
            slot, nbytes = await self._node.acquire_slot_wait(request.engine_id, request.num_tokens, wait_s)
        else:
            slot, nbytes = self._node.acquire_slot(request.engine_id, request.num_tokens)
        return engine_pb2.AcquireSlotReply(
            slot=common_pb2.Slot(offset=slot.offset, length=slot.length), chunk_bytes=nbytes
        )

    async def ReleaseSlot(self, request: engine_pb2.ReleaseSlotRequest, context: Any) -> engine_pb2.ReleaseSlotReply:
        self._node.release_slot(request.engine_id, SlotRef(request.slot.offset, request.slot.length))
        return engine_pb2.ReleaseSlotReply()

    async def ExpectRoom(self, request: engine_pb2.ExpectRoomRequest, context: Any) -> engine_pb2.ExpectRoomReply:
        if not request.HasField("room"):
            raise errors.InvalidArgument("room is required")
        room = self._node.expect_room(
            request.engine_id, room_key(request.room), request.prefill_address, request.prefill_group,
            request.num_tokens, request.deadline_ms, tuple(request.pages),
        )
        return engine_pb2.ExpectRoomReply(state=common_pb2.RoomState.ValueType(room.state))

    async def EnqueueChunk(self, request: engine_pb2.EnqueueChunkRequest, context: Any) -> engine_pb2.EnqueueChunkReply:
        self._node.enqueue_chunk(request.engine_id, chunk_spec(request))
        return self._with_freed(request, self._accepted(request))

    def _with_freed(self, req: engine_pb2.EnqueueChunkRequest,
                    reply: engine_pb2.EnqueueChunkReply) -> engine_pb2.EnqueueChunkReply:
        """Claimed slots the daemon let go of, told to the engine with a reply it gets anyway
        (once per call: a batch's come in its first result)."""
        if req.claim:
            freed = self._node.take_freed(req.engine_id)
            if freed:
                reply.freed_claims.extend(freed)
        return reply

    def _enqueue_one(self, req: engine_pb2.EnqueueChunkRequest,
                     reply: engine_pb2.EnqueueChunkReply | None = None) -> engine_pb2.EnqueueChunkReply:
        try:
            self._node.enqueue_chunk(req.engine_id, chunk_spec(req))
        except errors.KvxferError as exc:
            if reply is None:
                reply = engine_pb2.EnqueueChunkReply()
            reply.code, reply.message = status_of(exc).value[0], str(exc)
            return reply
        return self._accepted(req, reply)

    def _accepted(self, req: engine_pb2.EnqueueChunkRequest,
                  reply: engine_pb2.EnqueueChunkReply | None = None) -> engine_pb2.EnqueueChunkReply:
        if reply is None:
            reply = engine_pb2.EnqueueChunkReply(code=_CODE_OK)
        if req.next_tokens:
            # Best effort: no free slot (or any refusal) just leaves it unset, and the engine
            # falls back to AcquireSlot, which reports the reason.
            try:
                slot, nbytes = self._node.acquire_slot(req.engine_id, req.next_tokens)
            except errors.KvxferError:
                return reply
            reply.next_slot.offset, reply.next_slot.length = slot.offset, slot.length
            reply.next_chunk_bytes = nbytes
        return reply

    async def EnqueueChunks(self, request: engine_pb2.EnqueueChunksRequest, context: Any) -> engine_pb2.EnqueueChunksReply:
        if len(request.chunks) > MAX_BATCH_CHUNKS:
            raise errors.InvalidArgument(f"at most {MAX_BATCH_CHUNKS} chunks per call, got {len(request.chunks)}")
        reply = engine_pb2.EnqueueChunksReply()
        add = reply.results.add
        for c in request.chunks:
            # Filled in place: results=[...] would copy each reply message into the list once more.
            self._enqueue_one(c, add())
        if request.chunks:
            self._with_freed(request.chunks[0], reply.results[0])
        return reply

    async def EnqueueStream(
        self, request_iterator: AsyncIterator[engine_pb2.EnqueueChunkRequest], context: Any
    ) -> AsyncIterator[engine_pb2.EnqueueChunkReply]:
        async with self._stream(context) as ticket:
            async for req in request_iterator:
                try:
                    self._node.stream_join(ticket, req.engine_id)
                except errors.KvxferError as exc:
                    yield engine_pb2.EnqueueChunkReply(code=status_of(exc).value[0], message=str(exc))
                    continue
                yield self._with_freed(req, self._enqueue_one(req))

    @contextlib.asynccontextmanager
    async def _stream(self, context: Any) -> AsyncIterator[StreamTicket]:
        """A server stream counted (open_streams cap) while it is open; refused at the cap."""
        try:
            ticket = self._node.open_stream()
        except errors.KvxferError as exc:
            await context.abort(status_of(exc), str(exc))
            raise  # abort raises; never reached
        try:
            yield ticket
        finally:
            self._node.close_stream(ticket)

    async def PollRoom(self, request: engine_pb2.PollRoomRequest, context: Any) -> engine_pb2.RoomStatus:
        if not request.HasField("room"):
            raise errors.InvalidArgument("room is required")
        return room_status_pb(self._node.poll_room(request.engine_id, room_key(request.room)))

    async def WatchRooms(self, request: engine_pb2.WatchRoomsRequest, context: Any) -> AsyncIterator[engine_pb2.RoomEvent]:
        async with self._stream(context):
            try:
                q = self._node.watch(request.engine_id, request.chunk_progress, request.layer_progress)
            except errors.KvxferError as exc:
                await context.abort(status_of(exc), str(exc))
                return
            try:
                while True:
                    ev = await q.get()
                    if ev is None:
                        return
                    if isinstance(ev, errors.KvxferError):  # the reader fell behind: this stream ends
                        await context.abort(status_of(ev), str(ev))
                        return
                    yield room_event_pb(ev)
            finally:
                self._node.unwatch(request.engine_id, q)

    async def Watermark(self, request: engine_pb2.WatermarkRequest, context: Any) -> engine_pb2.WatermarkReply:
        if not request.HasField("room"):
            raise errors.InvalidArgument("room is required")
        wm = self._node.watermark(request.engine_id, room_key(request.room), request.chunk_ids)
        return engine_pb2.WatermarkReply(watermark=watermark_pb(wm))

    async def AbortRoom(self, request: engine_pb2.AbortRoomRequest, context: Any) -> engine_pb2.AbortRoomReply:
        if not request.HasField("room"):
            raise errors.InvalidArgument("room is required")
        self._node.abort_room(request.engine_id, room_key(request.room), request.reason)
        return engine_pb2.AbortRoomReply()

    async def ReleaseRoom(self, request: engine_pb2.ReleaseRoomRequest, context: Any) -> engine_pb2.ReleaseRoomReply:
        if not request.HasField("room"):
            raise errors.InvalidArgument("room is required")
        await self._node.release_room(request.engine_id, room_key(request.room))
        return engine_pb2.ReleaseRoomReply()

    async def GetStatus(self, request: engine_pb2.GetStatusRequest, context: Any) -> engine_pb2.DaemonStatus:
        st = self._node.status()
        engines: list[Engine] = st["engines"]  # type: ignore[assignment]
        peer_side = self._peer_status() if self._peer_status is not None else PeerStatus("", ())
        return engine_pb2.DaemonStatus(
            daemon_id=str(st["daemon_id"]), version=str(st["version"]), serving=bool(st["serving"]),
            engines=[
                engine_pb2.EngineInfo(
                    engine_id=e.id, name=e.spec.name, role=engine_pb2.Role.ValueType(e.role.value), group=e.spec.group,
                    parallel=common_pb2.Parallelism(
                        tp_size=e.spec.parallel.tp_size, tp_rank=e.spec.parallel.tp_rank,
                        pp_size=e.spec.parallel.pp_size, pp_rank=e.spec.parallel.pp_rank,
                    ),
                    ring_kind=e.ring.kind, ring_bytes=e.ring.size, ring_used_bytes=e.ring.alloc.used_bytes,
                    slots_held=e.ring.alloc.slots_held,
                )
                for e in engines
            ],
            peers=[
                engine_pb2.PeerInfo(
                    daemon_id=p.daemon_id, address=p.address, state="up" if p.up and not p.broken else "down",
                    rooms=self._node.rooms_with(p),
                    path="local" if p.is_self else same_host.path(p.daemon_id, p.instance_id),
                )
                for p in st["peers"]  # type: ignore[attr-defined]
            ],
            rooms_by_state=st["rooms_by_state"],  # type: ignore[arg-type]
            slots_held=int(st["slots_held"]),  # type: ignore[call-overload]
            pool_bytes=int(st["pool_bytes"]),  # type: ignore[call-overload]
            pool_backing=str(st["pool_backing"]),
            pool_huge_bytes=int(st["pool_huge_bytes"]),  # type: ignore[call-overload]
            uptime_s=float(st["uptime_s"]),  # type: ignore[arg-type]
            peer_address=str(st["peer_address"]),
            gpu_data_path=gpu_data_path(self._node.config.data_path),
            caps=[engine_pb2.CapUsage(name=c.name, used=c.used, limit=c.limit)
                  for c in st["caps"]],  # type: ignore[attr-defined]
            peer_caps=[engine_pb2.CapUsage(name=c.name, used=c.used, limit=c.limit) for c in peer_side.caps],
            peer_auth=peer_side.auth_mode,
            gpu_links=gpu_links(),
        )


__all__ = ["EngineServicer", "Role", "rpc_errors", "status_of", "wrap_servicer"]
