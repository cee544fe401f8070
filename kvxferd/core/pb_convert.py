"""protobuf <-> domain conversions shared by the engine and peer servicers."""

from __future__ import annotations

from kvxfer_protocol.limits import MAX_LAYERS
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2, peer_pb2
from kvxfer_protocol.slot_layout import KVLayout
from kvxferd.buffers.host_pool import Watermark
from kvxferd.config import _valid_hostport
from kvxferd.core.caps import MAX_DEVICE_UUID, MAX_ENGINE_NAME, MAX_GROUP, check_len
from kvxferd.core.types import (
    ChunkSpec,
    CudaRingSpec,
    DaemonRef,
    EngineSpec,
    LandedChunk,
    Parallelism,
    Role,
    RoomEvent,
    RoomKey,
    RoomView,
    SlotRef,
    ZeroCopyTarget,
)
from kvxferd.errors import InvalidArgument

MAX_PAGES = 1 << 20


def room_key(pb: common_pb2.RoomKey) -> RoomKey:
    return RoomKey(pb.id, pb.generation)


def room_key_pb(key: RoomKey) -> common_pb2.RoomKey:
    return common_pb2.RoomKey(id=key.id, generation=key.generation)


def layout(pb: common_pb2.KVLayout) -> KVLayout:
    try:
        return KVLayout(
            num_layers=pb.num_layers, total_kv_heads=pb.total_kv_heads, head_dim=pb.head_dim,
            dtype_bytes=pb.dtype_bytes, page_size=pb.page_size, mla=pb.mla,
        )
    except ValueError as exc:
        raise InvalidArgument(f"layout: {exc}") from exc


def layout_pb(lay: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        num_layers=lay.num_layers, total_kv_heads=lay.total_kv_heads, head_dim=lay.head_dim,
        dtype_bytes=lay.dtype_bytes, page_size=lay.page_size, mla=lay.mla,
    )


def engine_spec(req: engine_pb2.RegisterEngineRequest) -> EngineSpec:
    if req.role not in (engine_pb2.ROLE_PREFILL, engine_pb2.ROLE_DECODE):
        raise InvalidArgument("role must be ROLE_PREFILL or ROLE_DECODE")
    if not req.HasField("layout"):
        raise InvalidArgument("layout is required")
    lay = layout(req.layout)
    if lay.dtype_bytes not in (1, 2, 4, 8):
        raise InvalidArgument(f"dtype_bytes must be 1, 2, 4 or 8, got {lay.dtype_bytes}")
    if lay.num_layers > 4096 or lay.total_kv_heads > 4096 or lay.head_dim > 65536 or lay.page_size > 65536:
        raise InvalidArgument("layout dimensions are out of range")
    par = req.parallel
    parallel = Parallelism(par.tp_size or 1, par.tp_rank, par.pp_size or 1, par.pp_rank)
    cuda = None
    if req.HasField("cuda_ring"):
        c = req.cuda_ring
        if len(c.handle) != 64:
            raise InvalidArgument(f"cuda_ring.handle must be 64 bytes (cudaIpcMemHandle_t), got {len(c.handle)}")
        if c.size <= 0:
            raise InvalidArgument("cuda_ring.size must be positive")
        check_len("cuda_ring.device_uuid", c.device_uuid, MAX_DEVICE_UUID)
        cuda = CudaRingSpec(bytes(c.handle), c.device_uuid, c.offset, c.size)
    check_len("name", req.name, MAX_ENGINE_NAME)
    check_len("group", req.group, MAX_GROUP)
    return EngineSpec(
        role=Role(req.role), group=req.group, layout=lay, parallel=parallel, ring_bytes=req.ring_bytes,
        cuda_ring=cuda, lease_ms=req.lease_ms, name=req.name, zero_copy=req.zero_copy,
        claim_slots=req.claim_slots, layer_parts=req.layer_parts,
    )


def chunk_spec(req: engine_pb2.EnqueueChunkRequest) -> ChunkSpec:
    # Per chunk on the enqueue path (a third of its cost): each field is read once, since every
    # read of a protobuf field builds a Python object.
    if not req.HasField("room"):
        raise InvalidArgument("room is required")
    pages = req.pages
    group, start, end = req.layer_group, req.layer_start, req.layer_end
    if group or start or end:
        # The model's layer count is the sender's to check (kvxfer_protocol.slot_layout.check_part).
        if max(group, end) > MAX_LAYERS or start > end:
            raise InvalidArgument(f"layer part [{start}, {end}) of groups of {group} layers: out of range")
        if start == end:  # the seal: no bytes, so neither slot nor pages
            if pages or req.HasField("slot") or req.claim:
                raise InvalidArgument("a seal (layer_start == layer_end) carries no slot, pages or claim")
            room = req.room
            return ChunkSpec(RoomKey(room.id, room.generation), req.chunk_id, req.token_start, req.num_tokens,
                             SlotRef(0, 0), req.last, req.aux, (), 0, group, start, end)
    if pages:
        if len(pages) > MAX_PAGES:
            raise InvalidArgument(f"at most {MAX_PAGES} pages per chunk")
        page_ids = tuple(pages)
    elif not req.HasField("slot"):
        raise InvalidArgument("slot (or pages, for zero-copy engines) is required")
    else:
        page_ids = ()
    room, slot = req.room, req.slot
    return ChunkSpec(RoomKey(room.id, room.generation), req.chunk_id, req.token_start, req.num_tokens,
                     SlotRef(slot.offset, slot.length), req.last, req.aux, page_ids, req.claim, group, start, end)


def chunk_spec_pb(c: ChunkSpec) -> engine_pb2.EnqueueChunkRequest:
    """The request an engine sends for `c` (tests, tools); the reverse of chunk_spec."""
    req = engine_pb2.EnqueueChunkRequest(
        room=room_key_pb(c.room), chunk_id=c.chunk_id, token_start=c.token_start, num_tokens=c.num_tokens,
        last=c.last, aux=c.aux, pages=list(c.pages), claim=c.claim, layer_group=c.layer_group,
        layer_start=c.layer_start, layer_end=c.layer_end,
    )
    if not c.pages and not c.is_seal:
        req.slot.CopyFrom(common_pb2.Slot(offset=c.slot.offset, length=c.slot.length))
    return req


def zero_copy_target(pb: peer_pb2.ZeroCopyTarget) -> ZeroCopyTarget:
    if len(pb.pages) > MAX_PAGES:
        raise InvalidArgument(f"at most {MAX_PAGES} pages per room")
    return ZeroCopyTarget(pb.address, pb.num_slots, pb.mem or "DRAM", pb.device, tuple(pb.pages))


def zero_copy_target_pb(t: ZeroCopyTarget) -> peer_pb2.ZeroCopyTarget:
    return peer_pb2.ZeroCopyTarget(address=t.address, num_slots=t.num_slots, mem=t.mem, device=t.device,
                                   pages=list(t.pages))


def landed_pb(c: LandedChunk) -> engine_pb2.LandedChunk:
    return engine_pb2.LandedChunk(
        chunk_id=c.chunk_id, slot=common_pb2.Slot(offset=c.slot.offset, length=c.slot.length),
        token_start=c.token_start, num_tokens=c.num_tokens, last=c.last, chunk_bytes=c.chunk_bytes,
        layer_group=c.layer_group, layer_start=c.layer_start, layer_end=c.layer_end,
        chunk_complete=c.chunk_complete,
    )


def landed_chunk(pb: engine_pb2.LandedChunk) -> LandedChunk:
    """The reverse of landed_pb (tests, tools)."""
    return LandedChunk(pb.chunk_id, SlotRef(pb.slot.offset, pb.slot.length), pb.token_start, pb.num_tokens,
                       pb.last, pb.chunk_bytes, pb.layer_group, pb.layer_start, pb.layer_end, pb.chunk_complete)


def room_status_pb(v: RoomView) -> engine_pb2.RoomStatus:
    return engine_pb2.RoomStatus(
        room=room_key_pb(v.room), state=common_pb2.RoomState.ValueType(v.state),
        failure_code=common_pb2.FailureCode.ValueType(v.failure_code),
        failure_reason=v.failure_reason, landed=[landed_pb(c) for c in v.landed], aux=v.aux,
        chunks_done=v.chunks_done, pages_fenced=v.pages_fenced,
    )


def room_event_pb(ev: RoomEvent) -> engine_pb2.RoomEvent:
    out = engine_pb2.RoomEvent(
        room=room_key_pb(ev.room), state=common_pb2.RoomState.ValueType(ev.state),
        failure_code=common_pb2.FailureCode.ValueType(ev.failure_code),
        failure_reason=ev.failure_reason, aux=ev.aux, chunks_done=ev.chunks_done,
        pages_fenced=ev.pages_fenced,
    )
    if ev.landed is not None:
        out.landed.CopyFrom(landed_pb(ev.landed))
    return out


def watermark_pb(w: Watermark) -> common_pb2.WatermarkPos:
    return common_pb2.WatermarkPos(sequence=w.sequence, free_bytes=w.free_bytes, largest_free=w.largest_free)


# What heartbeat_interval_s allows (config.py): a peer's word is not taken beyond it.
MAX_HEARTBEAT_MS = 60_000


def daemon_ref(pb: peer_pb2.DaemonRef) -> DaemonRef:
    if not pb.daemon_id or not pb.instance_id:
        raise InvalidArgument("sender.daemon_id and sender.instance_id are required")
    # We may dial it: only HOST:PORT, as for the address.
    if pb.stream_address and not _valid_hostport(pb.stream_address):
        raise InvalidArgument(f"sender.stream_address must be HOST:PORT, got {pb.stream_address[:100]!r}")
    if pb.heartbeat_interval_ms > MAX_HEARTBEAT_MS:
        raise InvalidArgument(f"sender.heartbeat_interval_ms must be at most {MAX_HEARTBEAT_MS}")
    return DaemonRef(pb.daemon_id, pb.instance_id, pb.address, pb.stream_address, pb.heartbeat_interval_ms / 1000)


def daemon_ref_pb(ref: DaemonRef) -> peer_pb2.DaemonRef:
    return peer_pb2.DaemonRef(daemon_id=ref.daemon_id, instance_id=ref.instance_id, address=ref.address,
                              stream_address=ref.stream_address,
                              heartbeat_interval_ms=round(ref.heartbeat_interval_s * 1000))
