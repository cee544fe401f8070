"""Room tables and the room state machine (both roles).

States only move forward; FAILED is terminal and keeps its code and reason until
the room is released. Rooms are keyed by id; a message whose generation is not
the room's current generation belongs to an older use of the id and is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvxfer_protocol.slot_layout import HeadSlice, KVLayout
from kvxferd.core.engines import Engine
from kvxferd.core.peer_port import Link
from kvxferd.core.types import ChunkSpec, FailureCode, LandedChunk, RoomKey, RoomState, SlotRef, ZeroCopyTarget
from kvxferd.datapath.credits import HeldRange
from kvxferd.datapath.landing import ChunkLanding
from kvxferd.datapath.notif import new_token
from kvxferd.datapath.parts import LayerMask

logger = logging.getLogger(__name__)


class RoomBase:
    role = ""

    def __init__(self, key: RoomKey, deadline_s: float) -> None:
        self.key = key
        self.state = RoomState.BOOTSTRAPPING
        self.failure_code = FailureCode.UNSPECIFIED
        self.failure_reason = ""
        self.created = time.monotonic()
        self.finished_at: float | None = None
        self.deadline_s = deadline_s
        self.deadline_handle: asyncio.TimerHandle | None = None
        self.gc_handle: asyncio.TimerHandle | None = None
        self.peer: Link | None = None
        self.layout: KVLayout | None = None
        self.plan: tuple[HeadSlice, ...] | None = None
        self.num_tokens: int | None = None
        self.aux = b""
        # The peer this room is counted against in the rooms_per_peer cap ("" = not counted).
        self.cap_peer = ""

    @property
    def finished(self) -> bool:
        return self.state in (RoomState.SUCCESS, RoomState.FAILED)

    def advance(self, state: RoomState) -> bool:
        """Moves forward only; returns True if the state changed."""
        if self.finished or state <= self.state:
            return False
        self.state = state
        if self.finished:
            self.finished_at = time.monotonic()
        return True

    def fail(self, code: FailureCode, reason: str) -> bool:
        if self.finished:
            return False
        self.state = RoomState.FAILED
        self.failure_code = code
        self.failure_reason = reason
        self.finished_at = time.monotonic()
        return True


@dataclass(eq=False, slots=True)
class OutChunk:
    """A prefill chunk handed over by one writer; owns its source slot until done."""

    writer: int
    engine: Engine
    spec: ChunkSpec
    parts_pending: int = 0
    in_flight: int = 0
    done: bool = False
    slot_freed: bool = False
    # A layer-wise chunk (sent as layer parts, `spec` its first part): what was enqueued and
    # written; None for a whole chunk.
    layers: LayerMask | None = None

    @property
    def complete(self) -> bool:
        """Every layer was enqueued and written (a whole chunk: once its jobs are done)."""
        return self.layers is None or self.layers.complete


@dataclass(eq=False, slots=True)
class WriterState:
    engine: Engine
    chunks: dict[int, OutChunk] = field(default_factory=dict)
    last_id: int | None = None
    done: set[int] = field(default_factory=set)
    aux: bytes = b""

    @property
    def finished(self) -> bool:
        return self.last_id is not None and len(self.done) == self.last_id + 1


@dataclass(eq=False)
class Dest:
    """The destination of one (chunk, reader): a range of a credit, shared by every writer of the
    chunk. Until the range is carved, the chunks of writers that arrived wait here."""

    token_start: int
    num_tokens: int
    range: HeldRange | None = None
    waiting: list[OutChunk] = field(default_factory=list)


class SendRoom(RoomBase):
    """Prefill side of a room."""

    role = "prefill"

    def __init__(self, key: RoomKey, deadline_s: float, group: str, prefill_tp: int, layout: KVLayout) -> None:
        super().__init__(key, deadline_s)
        self.group = group
        self.prefill_tp = prefill_tp
        self.layout = layout
        self.decode_tp: int | None = None
        self.readers: set[int] = set()
        self.writers: dict[int, WriterState] = {}
        # (chunk id, reader) -> destination; reader -> the reader engine's ring (its credits).
        self.dest: dict[tuple[int, int], Dest] = {}
        self.reader_rings: dict[int, str] = {}
        self.bootstrapped = False
        # Chunks enqueued before every reader bootstrapped.
        self.pending: list[OutChunk] = []
        self.in_flight = 0
        self.complete_sent = False
        self.acks_pending: set[int] = set()
        # Zero-copy rooms write pages of each reader's KV pool directly (no slots).
        self.zero_copy = False
        self.zc_targets: dict[int, ZeroCopyTarget] = {}
        # Failed with WRITEs into a zero-copy reader's pages in flight: the decode side keeps
        # those pages fenced until we say none is left (a quiesced Abort).
        self.owe_quiesced = False
        self.first_chunk_at: float | None = None
        # The decode daemon's secret for this room (its Bootstrap): every notification carries it.
        self.notif_token = b""
        # Ranks whose engine released the room (ReleaseRoom); forgotten once every rank did.
        self.released_by: set[int] = set()
        # A writer sent a chunk as layer parts: whole chunks check their group against them.
        self.has_parts = False
        # Decode ranks that bootstrapped with Bootstrap.layer_parts (their engine scatters layer parts).
        self.layer_readers: set[int] = set()

    def note_layer_parts(self, reader: int, layer_parts: bool) -> None:
        if layer_parts:
            self.layer_readers.add(reader)
        else:
            self.layer_readers.discard(reader)

    def layer_parts_refusal(self) -> str:
        """Why this room may not take layer parts, or "": a reader bootstrapped without opting in.
        Readers not bootstrapped yet are not known: parts wait for them like whole chunks, and the
        check runs again once they bootstrap."""
        if self.readers <= self.layer_readers:  # checked per part: no set built, nothing sorted
            return ""
        for r in sorted(self.readers - self.layer_readers):
            return f"decode rank {r} of room {self.key} takes no layer parts (engine or daemon older than protocol 1.1)"
        return ""

    def all_writers_finished(self) -> bool:
        return len(self.writers) == self.prefill_tp and all(w.finished for w in self.writers.values())

    def held_source_slots(self) -> int:
        return sum(1 for w in self.writers.values() for c in w.chunks.values() if not c.slot_freed)

    def token_gap(self) -> str:
        """Why the chunks of a writer do not cover the room's tokens exactly once, or "" (as
        RecvRoom.token_gap for the readers)."""
        for rank, w in sorted(self.writers.items()):
            why = token_gap(((c.spec.token_start, c.spec.num_tokens) for c in w.chunks.values()), self.num_tokens or 0)
            if why:
                return f"prefill rank {rank}'s chunks end the room, but {why}"
        return ""


@dataclass(eq=False)
class InSlot:
    """A destination slot of one (chunk, reader) on the decode side."""

    offset: int
    length: int
    token_start: int
    num_tokens: int
    last: bool
    chunk_bytes: int
    # The layers each expected writer landed (a whole chunk lands as all of them at once).
    layers: ChunkLanding
    # Where the prefill side wrote it: credit id and offset inside the credit (0, 0: zero-copy).
    credit_id: int = 0
    credit_offset: int = 0
    # Every layer from every expected writer: the engine may read it (PollRoom lists only these).
    landed: bool = False
    consumed: bool = False
    freed: bool = False

    @property
    def expected_writers(self) -> frozenset[int]:
        return self.layers.expected


@dataclass(eq=False)
class ReaderState:
    engine: Engine
    bootstrapped: bool = False
    slots: dict[int, InSlot] = field(default_factory=dict)
    num_chunks: int | None = None
    released: bool = False
    # Zero-copy reader: destination pages of the room's tokens.
    pages: tuple[int, ...] = ()

    def landed_count(self) -> int:
        return sum(1 for s in self.slots.values() if s.landed)

    @property
    def complete(self) -> bool:
        return self.num_chunks is not None and self.landed_count() >= self.num_chunks


class RecvRoom(RoomBase):
    """Decode side of a room."""

    role = "decode"

    def __init__(
        self, key: RoomKey, deadline_s: float, prefill_address: str, prefill_group: str, num_tokens: int,
        decode_tp: int, layout: KVLayout,
    ) -> None:
        super().__init__(key, deadline_s)
        self.prefill_address = prefill_address
        self.prefill_group = prefill_group
        # No address given: the fleet registry resolves the group once for all readers.
        self.by_group = not prefill_address
        self.resolving: asyncio.Future[str] | None = None
        self.num_tokens = num_tokens
        self.decode_tp = decode_tp
        self.layout = layout
        self.prefill_tp: int | None = None
        self.readers: dict[int, ReaderState] = {}
        # The prefill side was told we hold no range of this room any more.
        self.ranges_released = False
        # Landed notifications that arrived before the bootstrap reply (kvxferd.datapath.notif.Notif).
        self.early: list[Any] = []
        # Zero-copy: failed, and a prefill WRITE may still land in the readers' pages (kvxferd.datapath.fence).
        self.pages_fenced = False
        # Sent to the writer only (in each Bootstrap); a notification without it counts for nothing.
        self.notif_token = new_token()

    @property
    def zero_copy(self) -> bool:
        return any(rs.engine.spec.zero_copy for rs in self.readers.values())

    def token_gap(self) -> str:
        """Why the landed chunks of a reader do not cover the room's tokens exactly once, or "":
        a room whose chunks leave tokens out is no SUCCESS, whatever the prefill side says."""
        for rank, rs in sorted(self.readers.items()):
            why = token_gap(((s.token_start, s.num_tokens) for s in rs.slots.values()), self.num_tokens or 0)
            if why:
                return f"reader {rank}: {why}"
        return ""

    def tokens_left(self, rank: int) -> int:
        """The room's tokens that no chunk has brought to reader `rank` yet."""
        rs = self.readers.get(rank)
        return 0 if rs is None else (self.num_tokens or 0) - sum(s.num_tokens for s in rs.slots.values())


def token_gap(spans: Iterable[tuple[int, int]], total: int) -> str:
    """Why chunks of one (writer or reader), as (token_start, num_tokens), do not cover the room's
    `total` tokens exactly once each, or "" if they do."""
    pos = 0
    for start, n in sorted(spans):
        if start != pos:
            return (f"tokens [{pos}, {start}) were never sent" if start > pos
                    else f"tokens [{start}, {min(pos, start + n)}) were sent twice")
        pos += n
    return f"tokens [{pos}, {total}) were never sent" if pos < total else ""


def landed_view(cid: int, s: InSlot, layers: tuple[int, int] = (0, 0)) -> LandedChunk:
    """`layers`: the range a layer_progress event reports; (0, 0) for a complete chunk's view.
    The group is the writers' (0 for one group: a whole chunk reads as before layer parts)."""
    lay = s.layers
    group = 0 if lay.layer_group >= lay.num_layers else lay.layer_group
    return LandedChunk(cid, SlotRef(max(0, s.offset), s.length), s.token_start, s.num_tokens, s.last, s.chunk_bytes,
                       group, layers[0], layers[1], s.landed)


async def abort_unseen(connect: Callable[[str], Awaitable[Link]], room: RecvRoom, code: FailureCode,
                       reason: str) -> None:
    """A decode room failed before its bootstrap went out. The prefill side may already hold chunks
    of it (and their slots) waiting for that bootstrap, until its own deadline (120 s by default):
    it is told, as it would have been after a bootstrap (it tombstones a room it does not have)."""
    try:
        peer = await connect(room.prefill_address)
    except Exception as exc:
        logger.info("room %s: the prefill daemon %s was not told of the failure: %s", room.key,
                    room.prefill_address, exc)
        return
    peer.send_abort(room.key, code, reason, quiesced=False)
