"""What the client's callers hand in and get back: layouts, slots, chunks, landed chunks, room
states, statuses and events, registrations (frozen dataclasses, no protobuf)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxfer_protocol.pb.kvxfer.v1 import common_pb2


class RoomState(enum.IntEnum):
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4
    FAILED = 5


@dataclass(frozen=True)
class Layout:
    """The model's KV layout as the engine holds it (see the proto's KVLayout)."""

    num_layers: int
    total_kv_heads: int
    head_dim: int
    dtype_bytes: int
    page_size: int = 16
    mla: bool = False
    dtype: str = ""

    def to_pb(self) -> common_pb2.KVLayout:
        return common_pb2.KVLayout(
            num_layers=self.num_layers, total_kv_heads=self.total_kv_heads, head_dim=self.head_dim,
            dtype_bytes=self.dtype_bytes, page_size=self.page_size, mla=self.mla, dtype=self.dtype,
        )

    def chunk_pages(self, room_pages: Sequence[int], token_start: int, num_tokens: int) -> tuple[list[int], int]:
        """A chunk's pages (those its tokens touch, from the one holding ``token_start``) and the
        offset of its first token in the first: what the kernels' ``page_ids``/``token_offset`` and
        a zero-copy ``enqueue(pages=...)`` take. Chunks may start and end anywhere in a page."""
        if token_start < 0 or num_tokens < 1:
            raise ValueError(f"bad token range [{token_start}, +{num_tokens})")
        first, offset = divmod(token_start, self.page_size)
        last = -(-(token_start + num_tokens) // self.page_size)
        if last > len(room_pages):
            raise ValueError(f"tokens up to {token_start + num_tokens} need {last} pages, the room has {len(room_pages)}")
        return list(room_pages[first:last]), offset


@dataclass(frozen=True)
class Slot:
    """A slot in this engine's ring: the chunk is written at [offset, offset + chunk_bytes)."""

    offset: int
    length: int
    chunk_bytes: int
    # The client's tag for a slot it cut out of the ring itself (claimed slots); 0: from the daemon.
    claim: int = 0


@dataclass(frozen=True)
class Landed:
    """A chunk whose every writer has landed in this reader's ring; in a layer_progress event
    (``watch(layer_progress=True)``), the layers ``[layer_start, layer_end)`` of it that landed."""

    chunk_id: int
    offset: int
    length: int
    token_start: int
    num_tokens: int
    last: bool
    chunk_bytes: int
    # The slot's layers a group (0: one group, the whole-chunk layout).
    layer_group: int = 0
    layer_start: int = 0
    layer_end: int = 0
    # Every layer of the chunk is held: scatter what is left and watermark it.
    chunk_complete: bool = True

    def layers(self, num_layers: int) -> tuple[int, int]:
        """The layer range this says landed: the whole chunk when no range is named."""
        return (self.layer_start, self.layer_end) if self.layer_end else (0, num_layers)


@dataclass(frozen=True)
class RoomStatus:
    room: int
    generation: int
    state: RoomState
    failure_code: str
    failure_reason: str
    landed: tuple[Landed, ...] = ()
    aux: bytes = b""
    chunks_done: int = 0
    # Zero-copy decode: FAILED, and a prefill WRITE may still land in the room's pages; reuse
    # them once this is False (release() waits for it).
    pages_fenced: bool = False

    @property
    def finished(self) -> bool:
        return self.state in (RoomState.SUCCESS, RoomState.FAILED)


@dataclass(frozen=True)
class RoomEvent:
    room: int
    generation: int
    state: RoomState
    failure_code: str = ""
    failure_reason: str = ""
    landed: Landed | None = None
    aux: bytes = b""
    # On a sending engine's events: its chunks of the room written so far.
    chunks_done: int = 0
    # As RoomStatus.pages_fenced: a fenced FAILED event is followed by one with False.
    pages_fenced: bool = False


@dataclass(frozen=True)
class Chunk:
    """One chunk to enqueue (for batched enqueue)."""

    room: int
    chunk_id: int
    token_start: int
    num_tokens: int
    slot: Slot | None
    last: bool = False
    aux: bytes = b""
    generation: int = 0
    pages: tuple[int, ...] = ()
    # A layer part (kvxfer_client._parts): layers [layer_start, layer_end) of a group-major slot of
    # layer_group layers a group; all 0: the whole chunk.
    layer_group: int = 0
    layer_start: int = 0
    layer_end: int = 0


@dataclass
class Registration:
    engine_id: str
    pool_path: str
    pool_bytes: int
    ring_offset: int
    ring_bytes: int
    lease_ms: int
    daemon_id: str
    peer_address: str
    extra: dict[str, Any] = field(default_factory=dict)
    pool_socket: str = ""
    lane_socket: str = ""
    claim_slots: bool = False
    token_bytes: int = 0
    slot_align: int = 0
