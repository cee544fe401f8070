from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DaemonRef(_message.Message):
    __slots__ = ("daemon_id", "instance_id", "address")
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    daemon_id: str
    instance_id: str
    address: str
    def __init__(self, daemon_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("sender", "agent_name", "nixl_metadata", "version")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    sender: DaemonRef
    agent_name: str
    nixl_metadata: bytes
    version: str
    def __init__(self, sender: _Optional[_Union[DaemonRef, _Mapping]] = ..., agent_name: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ..., version: _Optional[str] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("sender", "agent_name", "nixl_metadata", "version")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    sender: DaemonRef
    agent_name: str
    nixl_metadata: bytes
    version: str
    def __init__(self, sender: _Optional[_Union[DaemonRef, _Mapping]] = ..., agent_name: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ..., version: _Optional[str] = ...) -> None: ...

class BootstrapRequest(_message.Message):
    __slots__ = ("sender", "room", "prefill_group", "reader_rank", "decode_tp", "layout", "num_tokens", "deadline_unix_ms", "zero_copy")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PREFILL_GROUP_FIELD_NUMBER: _ClassVar[int]
    READER_RANK_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ZERO_COPY_FIELD_NUMBER: _ClassVar[int]
    sender: DaemonRef
    room: _common_pb2.RoomKey
    prefill_group: str
    reader_rank: int
    decode_tp: int
    layout: _common_pb2.KVLayout
    num_tokens: int
    deadline_unix_ms: int
    zero_copy: ZeroCopyTarget
    def __init__(self, sender: _Optional[_Union[DaemonRef, _Mapping]] = ..., room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., prefill_group: _Optional[str] = ..., reader_rank: _Optional[int] = ..., decode_tp: _Optional[int] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., zero_copy: _Optional[_Union[ZeroCopyTarget, _Mapping]] = ...) -> None: ...

class ZeroCopyTarget(_message.Message):
    __slots__ = ("address", "num_slots", "mem", "device", "pages")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MEM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    address: int
    num_slots: int
    mem: str
    device: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, address: _Optional[int] = ..., num_slots: _Optional[int] = ..., mem: _Optional[str] = ..., device: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ...) -> None: ...

class BootstrapReply(_message.Message):
    __slots__ = ("prefill_tp", "layout", "zero_copy")
    PREFILL_TP_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ZERO_COPY_FIELD_NUMBER: _ClassVar[int]
    prefill_tp: int
    layout: _common_pb2.KVLayout
    zero_copy: bool
    def __init__(self, prefill_tp: _Optional[int] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., zero_copy: _Optional[bool] = ...) -> None: ...

class AllocSlotRequest(_message.Message):
    __slots__ = ("sender", "room", "chunk_id", "reader_rank", "token_start", "num_tokens", "last")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    READER_RANK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    sender: DaemonRef
    room: _common_pb2.RoomKey
    chunk_id: int
    reader_rank: int
    token_start: int
    num_tokens: int
    last: bool
    def __init__(self, sender: _Optional[_Union[DaemonRef, _Mapping]] = ..., room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., chunk_id: _Optional[int] = ..., reader_rank: _Optional[int] = ..., token_start: _Optional[int] = ..., num_tokens: _Optional[int] = ..., last: _Optional[bool] = ...) -> None: ...

class AllocSlotReply(_message.Message):
    __slots__ = ("granted", "address", "length", "mem", "device")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MEM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    address: int
    length: int
    mem: str
    device: int
    def __init__(self, granted: _Optional[bool] = ..., address: _Optional[int] = ..., length: _Optional[int] = ..., mem: _Optional[str] = ..., device: _Optional[int] = ...) -> None: ...

class PeerWatermarkRequest(_message.Message):
    __slots__ = ("sender", "ring", "watermark")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    sender: DaemonRef
    ring: str
    watermark: _common_pb2.WatermarkPos
    def __init__(self, sender: _Optional[_Union[DaemonRef, _Mapping]] = ..., ring: _Optional[str] = ..., watermark: _Optional[_Union[_common_pb2.WatermarkPos, _Mapping]] = ...) -> None: ...

class PeerWatermarkReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("sender", "room", "reader_rank", "num_chunks", "aux")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    READER_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    AUX_FIELD_NUMBER: _ClassVar[int]
    sender: DaemonRef
    room: _common_pb2.RoomKey
    reader_rank: int
    num_chunks: int
    aux: bytes
    def __init__(self, sender: _Optional[_Union[DaemonRef, _Mapping]] = ..., room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., reader_rank: _Optional[int] = ..., num_chunks: _Optional[int] = ..., aux: _Optional[bytes] = ...) -> None: ...

class CompleteReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerAbortRequest(_message.Message):
    __slots__ = ("sender", "room", "code", "reason", "quiesced")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    QUIESCED_FIELD_NUMBER: _ClassVar[int]
    sender: DaemonRef
    room: _common_pb2.RoomKey
    code: _common_pb2.FailureCode
    reason: str
    quiesced: bool
    def __init__(self, sender: _Optional[_Union[DaemonRef, _Mapping]] = ..., room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., code: _Optional[_Union[_common_pb2.FailureCode, str]] = ..., reason: _Optional[str] = ..., quiesced: _Optional[bool] = ...) -> None: ...

class PeerAbortReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("sender",)
    SENDER_FIELD_NUMBER: _ClassVar[int]
    sender: DaemonRef
    def __init__(self, sender: _Optional[_Union[DaemonRef, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("sender",)
    SENDER_FIELD_NUMBER: _ClassVar[int]
    sender: DaemonRef
    def __init__(self, sender: _Optional[_Union[DaemonRef, _Mapping]] = ...) -> None: ...
