"""Domain types shared by the daemon's modules (frozen dataclasses, no protobuf)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, TypeVar

from kvxfer_protocol.slot_layout import KVLayout

_T = TypeVar("_T")


def quick_init(cls: type[_T]) -> type[_T]:
    """A faster __init__ for a frozen dataclass built once or more per chunk.

    The generated one stores each field through object.__setattr__, which a frozen class needs
    and which costs ~0.1 µs a field on CPython 3.11/3.12: a ChunkSpec took 1.0 µs to build, an
    eighth of the daemon's work per enqueued chunk. This one stores through the slot descriptors
    (or the instance dict), in half the time. The instance stays frozen: only __init__ changes,
    __setattr__ still refuses, and eq, hash, order and repr are the dataclass's own."""
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__}: quick_init is for frozen dataclasses")
    if hasattr(cls, "__post_init__") or any(not f.init for f in dataclasses.fields(cls)):
        raise TypeError(f"{cls.__name__}: quick_init does not run __post_init__ or skip fields")
    slots = "__slots__" in cls.__dict__
    ns: dict[str, Any] = {}
    params, body = [], []
    for i, f in enumerate(dataclasses.fields(cls)):
        if f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: quick_init takes plain defaults only")
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            ns[f"_d{i}"] = f.default
            params.append(f"{f.name}=_d{i}")
        if slots:
            ns[f"_s{i}"] = cls.__dict__[f.name].__set__
            body.append(f"    _s{i}(self, {f.name})")
        else:
            body.append(f"    d[{f.name!r}] = {f.name}")
    head = [f"def __init__(self, {', '.join(params)}):"] + ([] if slots else ["    d = self.__dict__"])
    exec("\n".join(head + body), ns)  # our own field names only, as dataclasses itself does
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


class Role(enum.Enum):
    PREFILL = 1
    DECODE = 2


class RoomState(enum.IntEnum):
    """Forward-only: a room only moves to a higher value, FAILED is terminal."""

    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4
    FAILED = 5


class FailureCode(enum.IntEnum):
    UNSPECIFIED = 0
    ABORTED = 1
    DEADLINE = 2
    TRANSFER_ERROR = 3
    PEER_LOST = 4
    ENGINE_LOST = 5
    MISMATCH = 6
    SHUTDOWN = 7
    SUPERSEDED = 8


@quick_init
@dataclass(frozen=True, order=True, slots=True)
class RoomKey:
    id: int
    generation: int = 0

    def __str__(self) -> str:
        return f"{self.id}.{self.generation}"


@dataclass(frozen=True)
class Parallelism:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0


@dataclass(frozen=True)
class CudaRingSpec:
    handle: bytes
    device_uuid: str
    offset: int
    size: int


@dataclass(frozen=True)
class EngineSpec:
    role: Role
    group: str
    layout: KVLayout
    parallel: Parallelism
    ring_bytes: int
    cuda_ring: CudaRingSpec | None
    lease_ms: int
    name: str
    zero_copy: bool = False
    # Asked for claimed slots (RegisterEngineRequest.claim_slots); granted to slot-ring senders.
    claim_slots: bool = False
    # A decode engine that scatters group-major slots (RegisterEngineRequest.layer_parts).
    layer_parts: bool = False


@quick_init
@dataclass(frozen=True, slots=True)
class SlotRef:
    offset: int
    length: int


@quick_init
@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """One prefill chunk as the engine enqueued it."""

    room: RoomKey
    chunk_id: int
    token_start: int
    num_tokens: int
    slot: SlotRef
    last: bool
    aux: bytes
    pages: tuple[int, ...] = ()
    # The engine's tag for a slot it cut out of its ring itself; 0: a slot from AcquireSlot.
    claim: int = 0
    # A layer part (docs/design/layerwise.md): layers [layer_start, layer_end) of a group-major slot
    # of layer_group layers a group. 0/0/0: the whole chunk; layer_start == layer_end == L: the seal.
    layer_group: int = 0
    layer_start: int = 0
    layer_end: int = 0

    @property
    def is_part(self) -> bool:
        return bool(self.layer_group or self.layer_end)

    @property
    def is_seal(self) -> bool:
        return self.layer_end != 0 and self.layer_start == self.layer_end


@quick_init
@dataclass(frozen=True)
class LandedChunk:
    chunk_id: int
    slot: SlotRef
    token_start: int
    num_tokens: int
    last: bool
    chunk_bytes: int
    # The slot's layers a group (0: one group) and, in a layer_progress event, the layers that
    # landed; chunk_complete: every layer of the chunk is held (PollRoom lists only those).
    layer_group: int = 0
    layer_start: int = 0
    layer_end: int = 0
    chunk_complete: bool = True


@quick_init
@dataclass(frozen=True)
class RoomView:
    """What PollRoom returns."""

    room: RoomKey
    state: RoomState
    failure_code: FailureCode
    failure_reason: str
    landed: tuple[LandedChunk, ...] = ()
    aux: bytes = b""
    chunks_done: int = 0
    pages_fenced: bool = False


@quick_init
@dataclass(frozen=True)
class RoomEvent:
    room: RoomKey
    state: RoomState
    failure_code: FailureCode = FailureCode.UNSPECIFIED
    failure_reason: str = ""
    landed: LandedChunk | None = None
    aux: bytes = b""
    chunks_done: int = 0
    # A FAILED zero-copy decode room whose pages a prefill WRITE may still reach.
    pages_fenced: bool = False


@dataclass(frozen=True)
class ZeroCopyTarget:
    """A zero-copy reader's KV pool and the pages that receive one room."""

    address: int
    num_slots: int
    mem: str
    device: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class DaemonRef:
    daemon_id: str
    instance_id: str
    address: str
    # Where it serves the framed control stream (kvxferd.peer.wire); "" = gRPC Session only.
    stream_address: str = ""
    # Its heartbeat interval (0: not said): it is heard from at least every half of it.
    heartbeat_interval_s: float = 0.0
