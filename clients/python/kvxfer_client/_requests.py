"""Engine API requests built from the client's types, and replies read back into them; the
timeouts and batch sizes the sync and asyncio clients share."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from kvxfer_client.errors import KvxferError
from kvxfer_client.types import Chunk, Landed, Layout, Registration, RoomEvent, RoomState, RoomStatus
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2
from kvxfer_protocol.version import PROTOCOL_VERSION

# enqueue_many over the lane sends a batch of at least twice this many chunks as pipelined calls
# of this many each (measured: bench rpc, batches of 256).
PIPELINE_PART = 64


def register_request(
    role: int, group: str, layout: Layout, tp_size: int, tp_rank: int, ring_bytes: int, name: str,
    lease_ms: int, cuda_ring: dict[str, Any] | None, pp_size: int = 1, pp_rank: int = 0, zero_copy: bool = False,
    claim_slots: bool = False, layer_parts: bool = False,
) -> engine_pb2.RegisterEngineRequest:
    req = engine_pb2.RegisterEngineRequest(
        role=engine_pb2.Role.ValueType(role), group=group, layout=layout.to_pb(),
        parallel=common_pb2.Parallelism(tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank),
        ring_bytes=ring_bytes, lease_ms=lease_ms, name=name, zero_copy=zero_copy, claim_slots=claim_slots,
        protocol_version=PROTOCOL_VERSION, layer_parts=layer_parts,
    )
    if cuda_ring is not None:
        req.cuda_ring.CopyFrom(engine_pb2.CudaIpcRing(**cuda_ring))
        # The daemon imports the ring while we ask again: no call has to outlive the import.
        req.accept_pending = True
    return req


# How long a registration may wait for the daemon to import its GPU ring (eight ranks per side
# starting at once queue their imports); each call is short, this bounds them all.
RING_READY_TIMEOUT_S = 600.0


def still_pending(req: engine_pb2.RegisterEngineRequest, reply: engine_pb2.RegisterEngineReply, deadline: float) -> bool:
    """Whether to ask again (then ``req`` names the pending registration); raises past ``deadline``."""
    if not reply.pending:
        return False
    if time.monotonic() > deadline:
        raise KvxferError(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"the daemon had not imported the GPU ring after {RING_READY_TIMEOUT_S:.0f} s")
    req.registration_id = reply.registration_id
    return True


def registration(reply: engine_pb2.RegisterEngineReply) -> Registration:
    return Registration(
        engine_id=reply.engine_id, pool_path=reply.pool_path, pool_bytes=reply.pool_bytes,
        ring_offset=reply.ring_offset, ring_bytes=reply.ring_bytes, lease_ms=reply.lease_ms,
        daemon_id=reply.daemon_id, peer_address=reply.peer_address, pool_socket=reply.pool_socket,
        lane_socket=reply.lane_socket, claim_slots=reply.claim_slots, token_bytes=reply.token_bytes,
        slot_align=reply.slot_align,
    )


def acquire_request(engine_id: str, num_tokens: int, deadline: float, call_timeout: float) -> engine_pb2.AcquireSlotRequest:
    """The daemon waits for space itself, in rounds of at most one call timeout."""
    wait_s = max(0.0, min(deadline - time.monotonic(), call_timeout))
    return engine_pb2.AcquireSlotRequest(engine_id=engine_id, num_tokens=num_tokens, wait_ms=int(wait_s * 1000))


def retry_full_or_raise(exc: KvxferError, deadline: float) -> None:
    """After an AcquireSlot round that failed (either kind of slot): raises `exc` unless the ring
    was only still full and the caller's deadline leaves time for another round."""
    if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() >= deadline:
        raise exc


# A zero-copy decode room's ReleaseRoom may wait for the page fence, which the daemon lifts
# after its credit quarantine (30 s) at the latest.
RELEASE_TIMEOUT_S = 40.0


def room_pb(room: int, generation: int = 0) -> common_pb2.RoomKey:
    return common_pb2.RoomKey(id=room, generation=generation)


def fill_chunk(req: engine_pb2.EnqueueChunkRequest, engine_id: str, c: Chunk) -> engine_pb2.EnqueueChunkRequest:
    """Sets a request's fields from a chunk, in place: a batch's entries are filled where they
    live (``batch.chunks.add()``), not built apart and copied in (half the client's cost a chunk)."""
    req.engine_id = engine_id
    req.chunk_id, req.token_start, req.num_tokens, req.last = c.chunk_id, c.token_start, c.num_tokens, c.last
    room = req.room
    room.id, room.generation = c.room, c.generation
    if c.aux:
        req.aux = c.aux
    if c.pages:
        req.pages.extend(c.pages)
    if c.slot is not None:
        slot = req.slot
        slot.offset, slot.length = c.slot.offset, c.slot.length
        if c.slot.claim:
            req.claim = c.slot.claim
    if c.layer_group:
        req.layer_group, req.layer_start, req.layer_end = c.layer_group, c.layer_start, c.layer_end
    return req


def chunk_request(engine_id: str, c: Chunk) -> engine_pb2.EnqueueChunkRequest:
    return fill_chunk(engine_pb2.EnqueueChunkRequest(), engine_id, c)


def chunks_request(engine_id: str, chunks: Sequence[Chunk]) -> engine_pb2.EnqueueChunksRequest:
    batch = engine_pb2.EnqueueChunksRequest()
    add = batch.chunks.add
    for c in chunks:
        fill_chunk(add(), engine_id, c)
    return batch


def _failure_name(code: int) -> str:
    return common_pb2.FailureCode.Name(code).removeprefix("FAILURE_CODE_") if code else ""


def landed(pb: engine_pb2.LandedChunk) -> Landed:
    # A daemon older than protocol 1.1 names no layers and sends only complete chunks.
    return Landed(pb.chunk_id, pb.slot.offset, pb.slot.length, pb.token_start, pb.num_tokens, pb.last, pb.chunk_bytes,
                  pb.layer_group, pb.layer_start, pb.layer_end, pb.chunk_complete or not pb.layer_end)


def room_status(pb: engine_pb2.RoomStatus) -> RoomStatus:
    return RoomStatus(
        room=pb.room.id, generation=pb.room.generation, state=RoomState(pb.state),
        failure_code=_failure_name(pb.failure_code), failure_reason=pb.failure_reason,
        landed=tuple(landed(c) for c in pb.landed), aux=bytes(pb.aux), chunks_done=pb.chunks_done,
        pages_fenced=pb.pages_fenced,
    )


def room_event(pb: engine_pb2.RoomEvent) -> RoomEvent:
    return RoomEvent(
        room=pb.room.id, generation=pb.room.generation, state=RoomState(pb.state),
        failure_code=_failure_name(pb.failure_code), failure_reason=pb.failure_reason,
        landed=landed(pb.landed) if pb.HasField("landed") else None, aux=bytes(pb.aux),
        chunks_done=pb.chunks_done, pages_fenced=pb.pages_fenced,
    )


def watch_request(engine_id: str, chunk_progress: bool, layer_progress: bool) -> engine_pb2.WatchRoomsRequest:
    return engine_pb2.WatchRoomsRequest(engine_id=engine_id, chunk_progress=chunk_progress,
                                        layer_progress=layer_progress)


def watermark_request(engine_id: str, room: int, chunk_ids: Iterable[int], generation: int = 0) -> engine_pb2.WatermarkRequest:
    return engine_pb2.WatermarkRequest(engine_id=engine_id, room=room_pb(room, generation), chunk_ids=list(chunk_ids))
