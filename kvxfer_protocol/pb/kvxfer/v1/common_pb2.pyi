from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RoomState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROOM_STATE_UNSPECIFIED: _ClassVar[RoomState]
    ROOM_STATE_BOOTSTRAPPING: _ClassVar[RoomState]
    ROOM_STATE_WAITING_FOR_INPUT: _ClassVar[RoomState]
    ROOM_STATE_TRANSFERRING: _ClassVar[RoomState]
    ROOM_STATE_SUCCESS: _ClassVar[RoomState]
    ROOM_STATE_FAILED: _ClassVar[RoomState]

class FailureCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_CODE_UNSPECIFIED: _ClassVar[FailureCode]
    FAILURE_CODE_ABORTED: _ClassVar[FailureCode]
    FAILURE_CODE_DEADLINE: _ClassVar[FailureCode]
    FAILURE_CODE_TRANSFER_ERROR: _ClassVar[FailureCode]
    FAILURE_CODE_PEER_LOST: _ClassVar[FailureCode]
    FAILURE_CODE_ENGINE_LOST: _ClassVar[FailureCode]
    FAILURE_CODE_MISMATCH: _ClassVar[FailureCode]
    FAILURE_CODE_SHUTDOWN: _ClassVar[FailureCode]
    FAILURE_CODE_SUPERSEDED: _ClassVar[FailureCode]
ROOM_STATE_UNSPECIFIED: RoomState
ROOM_STATE_BOOTSTRAPPING: RoomState
ROOM_STATE_WAITING_FOR_INPUT: RoomState
ROOM_STATE_TRANSFERRING: RoomState
ROOM_STATE_SUCCESS: RoomState
ROOM_STATE_FAILED: RoomState
FAILURE_CODE_UNSPECIFIED: FailureCode
FAILURE_CODE_ABORTED: FailureCode
FAILURE_CODE_DEADLINE: FailureCode
FAILURE_CODE_TRANSFER_ERROR: FailureCode
FAILURE_CODE_PEER_LOST: FailureCode
FAILURE_CODE_ENGINE_LOST: FailureCode
FAILURE_CODE_MISMATCH: FailureCode
FAILURE_CODE_SHUTDOWN: FailureCode
FAILURE_CODE_SUPERSEDED: FailureCode

class RoomKey(_message.Message):
    __slots__ = ("id", "generation")
    ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    id: int
    generation: int
    def __init__(self, id: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "total_kv_heads", "head_dim", "dtype_bytes", "page_size", "mla", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MLA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    total_kv_heads: int
    head_dim: int
    dtype_bytes: int
    page_size: int
    mla: bool
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., total_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype_bytes: _Optional[int] = ..., page_size: _Optional[int] = ..., mla: _Optional[bool] = ..., dtype: _Optional[str] = ...) -> None: ...

class Parallelism(_message.Message):
    __slots__ = ("tp_size", "tp_rank", "pp_size", "pp_rank")
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    def __init__(self, tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class WatermarkPos(_message.Message):
    __slots__ = ("sequence", "free_bytes", "largest_free")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    free_bytes: int
    largest_free: int
    def __init__(self, sequence: _Optional[int] = ..., free_bytes: _Optional[int] = ..., largest_free: _Optional[int] = ...) -> None: ...
