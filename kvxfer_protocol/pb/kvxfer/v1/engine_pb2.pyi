from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role

class CudaIpcRing(_message.Message):
    __slots__ = ("handle", "device_uuid", "offset", "size")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    device_uuid: str
    offset: int
    size: int
    def __init__(self, handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("role", "group", "layout", "parallel", "ring_bytes", "cuda_ring", "lease_ms", "name", "zero_copy", "accept_pending", "registration_id", "claim_slots", "protocol_version", "layer_parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    RING_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_RING_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ZERO_COPY_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_PENDING_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYER_PARTS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    group: str
    layout: _common_pb2.KVLayout
    parallel: _common_pb2.Parallelism
    ring_bytes: int
    cuda_ring: CudaIpcRing
    lease_ms: int
    name: str
    zero_copy: bool
    accept_pending: bool
    registration_id: str
    claim_slots: bool
    protocol_version: str
    layer_parts: bool
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., group: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., parallel: _Optional[_Union[_common_pb2.Parallelism, _Mapping]] = ..., ring_bytes: _Optional[int] = ..., cuda_ring: _Optional[_Union[CudaIpcRing, _Mapping]] = ..., lease_ms: _Optional[int] = ..., name: _Optional[str] = ..., zero_copy: _Optional[bool] = ..., accept_pending: _Optional[bool] = ..., registration_id: _Optional[str] = ..., claim_slots: _Optional[bool] = ..., protocol_version: _Optional[str] = ..., layer_parts: _Optional[bool] = ...) -> None: ...

class RegisterEngineReply(_message.Message):
    __slots__ = ("engine_id", "pool_path", "pool_bytes", "ring_offset", "ring_bytes", "lease_ms", "daemon_id", "peer_address", "pending", "registration_id", "pool_socket", "lane_socket", "claim_slots", "token_bytes", "slot_align")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_PATH_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    RING_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RING_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LANE_SOCKET_FIELD_NUMBER: _ClassVar[int]
    CLAIM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_ALIGN_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    pool_path: str
    pool_bytes: int
    ring_offset: int
    ring_bytes: int
    lease_ms: int
    daemon_id: str
    peer_address: str
    pending: bool
    registration_id: str
    pool_socket: str
    lane_socket: str
    claim_slots: bool
    token_bytes: int
    slot_align: int
    def __init__(self, engine_id: _Optional[str] = ..., pool_path: _Optional[str] = ..., pool_bytes: _Optional[int] = ..., ring_offset: _Optional[int] = ..., ring_bytes: _Optional[int] = ..., lease_ms: _Optional[int] = ..., daemon_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., pending: _Optional[bool] = ..., registration_id: _Optional[str] = ..., pool_socket: _Optional[str] = ..., lane_socket: _Optional[str] = ..., claim_slots: _Optional[bool] = ..., token_bytes: _Optional[int] = ..., slot_align: _Optional[int] = ...) -> None: ...

class UnregisterEngineRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class UnregisterEngineReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class KeepAliveReply(_message.Message):
    __slots__ = ("lease_ms",)
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ms: int
    def __init__(self, lease_ms: _Optional[int] = ...) -> None: ...

class AcquireSlotRequest(_message.Message):
    __slots__ = ("engine_id", "num_tokens", "wait_ms", "claims", "held_claims")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    HELD_CLAIMS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    num_tokens: int
    wait_ms: int
    claims: bool
    held_claims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., wait_ms: _Optional[int] = ..., claims: _Optional[bool] = ..., held_claims: _Optional[_Iterable[int]] = ...) -> None: ...

class AcquireSlotReply(_message.Message):
    __slots__ = ("slot", "chunk_bytes", "freed_claims")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREED_CLAIMS_FIELD_NUMBER: _ClassVar[int]
    slot: _common_pb2.Slot
    chunk_bytes: int
    freed_claims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slot: _Optional[_Union[_common_pb2.Slot, _Mapping]] = ..., chunk_bytes: _Optional[int] = ..., freed_claims: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseSlotRequest(_message.Message):
    __slots__ = ("engine_id", "slot")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    slot: _common_pb2.Slot
    def __init__(self, engine_id: _Optional[str] = ..., slot: _Optional[_Union[_common_pb2.Slot, _Mapping]] = ...) -> None: ...

class ReleaseSlotReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpectRoomRequest(_message.Message):
    __slots__ = ("engine_id", "room", "prefill_address", "prefill_group", "num_tokens", "deadline_ms", "pages")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_GROUP_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    room: _common_pb2.RoomKey
    prefill_address: str
    prefill_group: str
    num_tokens: int
    deadline_ms: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., prefill_address: _Optional[str] = ..., prefill_group: _Optional[str] = ..., num_tokens: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpectRoomReply(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _common_pb2.RoomState
    def __init__(self, state: _Optional[_Union[_common_pb2.RoomState, str]] = ...) -> None: ...

class EnqueueChunkRequest(_message.Message):
    __slots__ = ("engine_id", "room", "chunk_id", "token_start", "num_tokens", "slot", "last", "aux", "pages", "next_tokens", "claim", "layer_group", "layer_start", "layer_end")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    AUX_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    LAYER_GROUP_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    room: _common_pb2.RoomKey
    chunk_id: int
    token_start: int
    num_tokens: int
    slot: _common_pb2.Slot
    last: bool
    aux: bytes
    pages: _containers.RepeatedScalarFieldContainer[int]
    next_tokens: int
    claim: int
    layer_group: int
    layer_start: int
    layer_end: int
    def __init__(self, engine_id: _Optional[str] = ..., room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., chunk_id: _Optional[int] = ..., token_start: _Optional[int] = ..., num_tokens: _Optional[int] = ..., slot: _Optional[_Union[_common_pb2.Slot, _Mapping]] = ..., last: _Optional[bool] = ..., aux: _Optional[bytes] = ..., pages: _Optional[_Iterable[int]] = ..., next_tokens: _Optional[int] = ..., claim: _Optional[int] = ..., layer_group: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class EnqueueChunkReply(_message.Message):
    __slots__ = ("code", "message", "next_slot", "next_chunk_bytes", "freed_claims")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NEXT_SLOT_FIELD_NUMBER: _ClassVar[int]
    NEXT_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREED_CLAIMS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    next_slot: _common_pb2.Slot
    next_chunk_bytes: int
    freed_claims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., next_slot: _Optional[_Union[_common_pb2.Slot, _Mapping]] = ..., next_chunk_bytes: _Optional[int] = ..., freed_claims: _Optional[_Iterable[int]] = ...) -> None: ...

class EnqueueChunksRequest(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[EnqueueChunkRequest]
    def __init__(self, chunks: _Optional[_Iterable[_Union[EnqueueChunkRequest, _Mapping]]] = ...) -> None: ...

class EnqueueChunksReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EnqueueChunkReply]
    def __init__(self, results: _Optional[_Iterable[_Union[EnqueueChunkReply, _Mapping]]] = ...) -> None: ...

class PollRoomRequest(_message.Message):
    __slots__ = ("engine_id", "room")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    room: _common_pb2.RoomKey
    def __init__(self, engine_id: _Optional[str] = ..., room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ...) -> None: ...

class LandedChunk(_message.Message):
    __slots__ = ("chunk_id", "slot", "token_start", "num_tokens", "last", "chunk_bytes", "layer_group", "layer_start", "layer_end", "chunk_complete")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_GROUP_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    chunk_id: int
    slot: _common_pb2.Slot
    token_start: int
    num_tokens: int
    last: bool
    chunk_bytes: int
    layer_group: int
    layer_start: int
    layer_end: int
    chunk_complete: bool
    def __init__(self, chunk_id: _Optional[int] = ..., slot: _Optional[_Union[_common_pb2.Slot, _Mapping]] = ..., token_start: _Optional[int] = ..., num_tokens: _Optional[int] = ..., last: _Optional[bool] = ..., chunk_bytes: _Optional[int] = ..., layer_group: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., chunk_complete: _Optional[bool] = ...) -> None: ...

class RoomStatus(_message.Message):
    __slots__ = ("room", "state", "failure_code", "failure_reason", "landed", "aux", "chunks_done", "pages_fenced")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_CODE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    AUX_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DONE_FIELD_NUMBER: _ClassVar[int]
    PAGES_FENCED_FIELD_NUMBER: _ClassVar[int]
    room: _common_pb2.RoomKey
    state: _common_pb2.RoomState
    failure_code: _common_pb2.FailureCode
    failure_reason: str
    landed: _containers.RepeatedCompositeFieldContainer[LandedChunk]
    aux: bytes
    chunks_done: int
    pages_fenced: bool
    def __init__(self, room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., state: _Optional[_Union[_common_pb2.RoomState, str]] = ..., failure_code: _Optional[_Union[_common_pb2.FailureCode, str]] = ..., failure_reason: _Optional[str] = ..., landed: _Optional[_Iterable[_Union[LandedChunk, _Mapping]]] = ..., aux: _Optional[bytes] = ..., chunks_done: _Optional[int] = ..., pages_fenced: _Optional[bool] = ...) -> None: ...

class WatchRoomsRequest(_message.Message):
    __slots__ = ("engine_id", "chunk_progress", "layer_progress")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    LAYER_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    chunk_progress: bool
    layer_progress: bool
    def __init__(self, engine_id: _Optional[str] = ..., chunk_progress: _Optional[bool] = ..., layer_progress: _Optional[bool] = ...) -> None: ...

class RoomEvent(_message.Message):
    __slots__ = ("room", "state", "failure_code", "failure_reason", "landed", "aux", "chunks_done", "pages_fenced")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_CODE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    AUX_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DONE_FIELD_NUMBER: _ClassVar[int]
    PAGES_FENCED_FIELD_NUMBER: _ClassVar[int]
    room: _common_pb2.RoomKey
    state: _common_pb2.RoomState
    failure_code: _common_pb2.FailureCode
    failure_reason: str
    landed: LandedChunk
    aux: bytes
    chunks_done: int
    pages_fenced: bool
    def __init__(self, room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., state: _Optional[_Union[_common_pb2.RoomState, str]] = ..., failure_code: _Optional[_Union[_common_pb2.FailureCode, str]] = ..., failure_reason: _Optional[str] = ..., landed: _Optional[_Union[LandedChunk, _Mapping]] = ..., aux: _Optional[bytes] = ..., chunks_done: _Optional[int] = ..., pages_fenced: _Optional[bool] = ...) -> None: ...

class WatermarkRequest(_message.Message):
    __slots__ = ("engine_id", "room", "chunk_ids")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    room: _common_pb2.RoomKey
    chunk_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., chunk_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class WatermarkReply(_message.Message):
    __slots__ = ("watermark",)
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    watermark: _common_pb2.WatermarkPos
    def __init__(self, watermark: _Optional[_Union[_common_pb2.WatermarkPos, _Mapping]] = ...) -> None: ...

class AbortRoomRequest(_message.Message):
    __slots__ = ("engine_id", "room", "reason")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    room: _common_pb2.RoomKey
    reason: str
    def __init__(self, engine_id: _Optional[str] = ..., room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortRoomReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRoomRequest(_message.Message):
    __slots__ = ("engine_id", "room")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    room: _common_pb2.RoomKey
    def __init__(self, engine_id: _Optional[str] = ..., room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ...) -> None: ...

class ReleaseRoomReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("engine_id", "name", "role", "group", "parallel", "ring_kind", "ring_bytes", "ring_used_bytes", "slots_held")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    RING_KIND_FIELD_NUMBER: _ClassVar[int]
    RING_BYTES_FIELD_NUMBER: _ClassVar[int]
    RING_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_HELD_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    name: str
    role: Role
    group: str
    parallel: _common_pb2.Parallelism
    ring_kind: str
    ring_bytes: int
    ring_used_bytes: int
    slots_held: int
    def __init__(self, engine_id: _Optional[str] = ..., name: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., group: _Optional[str] = ..., parallel: _Optional[_Union[_common_pb2.Parallelism, _Mapping]] = ..., ring_kind: _Optional[str] = ..., ring_bytes: _Optional[int] = ..., ring_used_bytes: _Optional[int] = ..., slots_held: _Optional[int] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("daemon_id", "address", "state", "bytes_sent", "rooms", "path")
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    daemon_id: str
    address: str
    state: str
    bytes_sent: int
    rooms: int
    path: str
    def __init__(self, daemon_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., bytes_sent: _Optional[int] = ..., rooms: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class CapUsage(_message.Message):
    __slots__ = ("name", "used", "limit")
    NAME_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    name: str
    used: int
    limit: int
    def __init__(self, name: _Optional[str] = ..., used: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class DaemonStatus(_message.Message):
    __slots__ = ("daemon_id", "version", "serving", "engines", "peers", "rooms_by_state", "slots_held", "pool_bytes", "pool_backing", "pool_huge_bytes", "uptime_s", "peer_address", "gpu_data_path", "caps", "peer_caps", "peer_auth", "gpu_links")
    class RoomsByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    ROOMS_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_HELD_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_BACKING_FIELD_NUMBER: _ClassVar[int]
    POOL_HUGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GPU_DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    CAPS_FIELD_NUMBER: _ClassVar[int]
    PEER_CAPS_FIELD_NUMBER: _ClassVar[int]
    PEER_AUTH_FIELD_NUMBER: _ClassVar[int]
    GPU_LINKS_FIELD_NUMBER: _ClassVar[int]
    daemon_id: str
    version: str
    serving: bool
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    rooms_by_state: _containers.ScalarMap[str, int]
    slots_held: int
    pool_bytes: int
    pool_backing: str
    pool_huge_bytes: int
    uptime_s: float
    peer_address: str
    gpu_data_path: str
    caps: _containers.RepeatedCompositeFieldContainer[CapUsage]
    peer_caps: _containers.RepeatedCompositeFieldContainer[CapUsage]
    peer_auth: str
    gpu_links: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, daemon_id: _Optional[str] = ..., version: _Optional[str] = ..., serving: _Optional[bool] = ..., engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., rooms_by_state: _Optional[_Mapping[str, int]] = ..., slots_held: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., pool_backing: _Optional[str] = ..., pool_huge_bytes: _Optional[int] = ..., uptime_s: _Optional[float] = ..., peer_address: _Optional[str] = ..., gpu_data_path: _Optional[str] = ..., caps: _Optional[_Iterable[_Union[CapUsage, _Mapping]]] = ..., peer_caps: _Optional[_Iterable[_Union[CapUsage, _Mapping]]] = ..., peer_auth: _Optional[str] = ..., gpu_links: _Optional[_Iterable[str]] = ...) -> None: ...
