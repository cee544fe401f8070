from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DaemonRef(_message.Message):
    __slots__ = ("daemon_id", "instance_id", "address", "stream_address", "heartbeat_interval_ms")
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STREAM_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    daemon_id: str
    instance_id: str
    address: str
    stream_address: str
    heartbeat_interval_ms: int
    def __init__(self, daemon_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., address: _Optional[str] = ..., stream_address: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class ChallengeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChallengeReply(_message.Message):
    __slots__ = ("instance_id", "nonce")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    nonce: bytes
    def __init__(self, instance_id: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("sender", "agent_name", "nixl_metadata", "version", "proof", "host_tag")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    HOST_TAG_FIELD_NUMBER: _ClassVar[int]
    sender: DaemonRef
    agent_name: str
    nixl_metadata: bytes
    version: str
    proof: PeerProof
    host_tag: bytes
    def __init__(self, sender: _Optional[_Union[DaemonRef, _Mapping]] = ..., agent_name: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ..., version: _Optional[str] = ..., proof: _Optional[_Union[PeerProof, _Mapping]] = ..., host_tag: _Optional[bytes] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("sender", "agent_name", "nixl_metadata", "version", "proof", "host_tag")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    HOST_TAG_FIELD_NUMBER: _ClassVar[int]
    sender: DaemonRef
    agent_name: str
    nixl_metadata: bytes
    version: str
    proof: PeerProof
    host_tag: bytes
    def __init__(self, sender: _Optional[_Union[DaemonRef, _Mapping]] = ..., agent_name: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ..., version: _Optional[str] = ..., proof: _Optional[_Union[PeerProof, _Mapping]] = ..., host_tag: _Optional[bytes] = ...) -> None: ...

class PeerProof(_message.Message):
    __slots__ = ("nonce", "unix_ms", "mac", "peer_nonce")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    PEER_NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    unix_ms: int
    mac: bytes
    peer_nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., unix_ms: _Optional[int] = ..., mac: _Optional[bytes] = ..., peer_nonce: _Optional[bytes] = ...) -> None: ...

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

class PeerBatch(_message.Message):
    __slots__ = ("msgs",)
    MSGS_FIELD_NUMBER: _ClassVar[int]
    msgs: _containers.RepeatedCompositeFieldContainer[PeerMsg]
    def __init__(self, msgs: _Optional[_Iterable[_Union[PeerMsg, _Mapping]]] = ...) -> None: ...

class PeerMsg(_message.Message):
    __slots__ = ("hello", "bootstrap", "bootstrap_reply", "grant", "credit_request", "credit_return", "revoke", "release", "complete", "complete_ack", "abort", "reclaim")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_REPLY_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    CREDIT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CREDIT_RETURN_FIELD_NUMBER: _ClassVar[int]
    REVOKE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_ACK_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    bootstrap: Bootstrap
    bootstrap_reply: BootstrapReply
    grant: CreditGrant
    credit_request: CreditRequest
    credit_return: CreditReturn
    revoke: CreditRevoke
    release: RangeRelease
    complete: Complete
    complete_ack: CompleteAck
    abort: Abort
    reclaim: Reclaim
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., bootstrap: _Optional[_Union[Bootstrap, _Mapping]] = ..., bootstrap_reply: _Optional[_Union[BootstrapReply, _Mapping]] = ..., grant: _Optional[_Union[CreditGrant, _Mapping]] = ..., credit_request: _Optional[_Union[CreditRequest, _Mapping]] = ..., credit_return: _Optional[_Union[CreditReturn, _Mapping]] = ..., revoke: _Optional[_Union[CreditRevoke, _Mapping]] = ..., release: _Optional[_Union[RangeRelease, _Mapping]] = ..., complete: _Optional[_Union[Complete, _Mapping]] = ..., complete_ack: _Optional[_Union[CompleteAck, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., reclaim: _Optional[_Union[Reclaim, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("sender", "peer_instance_id", "proof")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PEER_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    sender: DaemonRef
    peer_instance_id: str
    proof: PeerProof
    def __init__(self, sender: _Optional[_Union[DaemonRef, _Mapping]] = ..., peer_instance_id: _Optional[str] = ..., proof: _Optional[_Union[PeerProof, _Mapping]] = ...) -> None: ...

class Bootstrap(_message.Message):
    __slots__ = ("room", "prefill_group", "reader_rank", "decode_tp", "layout", "num_tokens", "deadline_unix_ms", "reader_ring", "zero_copy", "notif_token", "layer_parts")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PREFILL_GROUP_FIELD_NUMBER: _ClassVar[int]
    READER_RANK_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    READER_RING_FIELD_NUMBER: _ClassVar[int]
    ZERO_COPY_FIELD_NUMBER: _ClassVar[int]
    NOTIF_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LAYER_PARTS_FIELD_NUMBER: _ClassVar[int]
    room: _common_pb2.RoomKey
    prefill_group: str
    reader_rank: int
    decode_tp: int
    layout: _common_pb2.KVLayout
    num_tokens: int
    deadline_unix_ms: int
    reader_ring: str
    zero_copy: ZeroCopyTarget
    notif_token: bytes
    layer_parts: bool
    def __init__(self, room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., prefill_group: _Optional[str] = ..., reader_rank: _Optional[int] = ..., decode_tp: _Optional[int] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., reader_ring: _Optional[str] = ..., zero_copy: _Optional[_Union[ZeroCopyTarget, _Mapping]] = ..., notif_token: _Optional[bytes] = ..., layer_parts: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("room", "reader_rank", "code", "message", "prefill_tp", "layout", "zero_copy")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    READER_RANK_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TP_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ZERO_COPY_FIELD_NUMBER: _ClassVar[int]
    room: _common_pb2.RoomKey
    reader_rank: int
    code: int
    message: str
    prefill_tp: int
    layout: _common_pb2.KVLayout
    zero_copy: bool
    def __init__(self, room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., reader_rank: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., prefill_tp: _Optional[int] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., zero_copy: _Optional[bool] = ...) -> None: ...

class Credit(_message.Message):
    __slots__ = ("id", "ring", "address", "length", "mem", "device", "local")
    ID_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MEM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    id: int
    ring: str
    address: int
    length: int
    mem: str
    device: int
    local: LocalRing
    def __init__(self, id: _Optional[int] = ..., ring: _Optional[str] = ..., address: _Optional[int] = ..., length: _Optional[int] = ..., mem: _Optional[str] = ..., device: _Optional[int] = ..., local: _Optional[_Union[LocalRing, _Mapping]] = ...) -> None: ...

class LocalRing(_message.Message):
    __slots__ = ("handle", "device_uuid", "size", "offset", "base")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    device_uuid: str
    size: int
    offset: int
    base: int
    def __init__(self, handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ..., base: _Optional[int] = ...) -> None: ...

class CreditGrant(_message.Message):
    __slots__ = ("credits",)
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    credits: _containers.RepeatedCompositeFieldContainer[Credit]
    def __init__(self, credits: _Optional[_Iterable[_Union[Credit, _Mapping]]] = ...) -> None: ...

class CreditRequest(_message.Message):
    __slots__ = ("ring", "bytes")
    RING_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ring: str
    bytes: int
    def __init__(self, ring: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class CreditReturn(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CreditRevoke(_message.Message):
    __slots__ = ("ids", "reason")
    IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class Reclaim(_message.Message):
    __slots__ = ("ring",)
    RING_FIELD_NUMBER: _ClassVar[int]
    ring: str
    def __init__(self, ring: _Optional[str] = ...) -> None: ...

class Range(_message.Message):
    __slots__ = ("credit_id", "offset")
    CREDIT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    credit_id: int
    offset: int
    def __init__(self, credit_id: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class RangeRelease(_message.Message):
    __slots__ = ("ranges", "rooms")
    RANGES_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    ranges: _containers.RepeatedCompositeFieldContainer[Range]
    rooms: _containers.RepeatedCompositeFieldContainer[_common_pb2.RoomKey]
    def __init__(self, ranges: _Optional[_Iterable[_Union[Range, _Mapping]]] = ..., rooms: _Optional[_Iterable[_Union[_common_pb2.RoomKey, _Mapping]]] = ...) -> None: ...

class Complete(_message.Message):
    __slots__ = ("room", "reader_rank", "num_chunks", "aux")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    READER_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    AUX_FIELD_NUMBER: _ClassVar[int]
    room: _common_pb2.RoomKey
    reader_rank: int
    num_chunks: int
    aux: bytes
    def __init__(self, room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., reader_rank: _Optional[int] = ..., num_chunks: _Optional[int] = ..., aux: _Optional[bytes] = ...) -> None: ...

class CompleteAck(_message.Message):
    __slots__ = ("room", "reader_rank", "code", "message")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    READER_RANK_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    room: _common_pb2.RoomKey
    reader_rank: int
    code: int
    message: str
    def __init__(self, room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., reader_rank: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("room", "code", "reason", "quiesced")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    QUIESCED_FIELD_NUMBER: _ClassVar[int]
    room: _common_pb2.RoomKey
    code: _common_pb2.FailureCode
    reason: str
    quiesced: bool
    def __init__(self, room: _Optional[_Union[_common_pb2.RoomKey, _Mapping]] = ..., code: _Optional[_Union[_common_pb2.FailureCode, str]] = ..., reason: _Optional[str] = ..., quiesced: _Optional[bool] = ...) -> None: ...
