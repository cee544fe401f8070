"""Layer parts on the send side (docs/design/layerwise.md §2): what one writer enqueued and wrote of
one layer-wise chunk, and whether a part may join it.

Pure: no I/O, no clock. A chunk's first part brings its slot (or pages) and its group size; every
later part and the seal repeat the chunk's tokens and slot and name layers none of the earlier parts
named. Credits, slots and watermarks stay per chunk: the source slot goes back once every layer
was enqueued and written (kvxferd.datapath.sender), and the scheduler posts the layers queued since
its last post of the chunk together (`take`), so parts that queue while a chunk waits for its
bootstrap or credits leave as one WRITE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvxfer_protocol.slot_layout import check_part, group_of
from kvxferd.core.types import ChunkSpec
from kvxferd.errors import AlreadyExists, InvalidArgument


def layer_bits(start: int, end: int) -> int:
    """The mask of layers [start, end)."""
    return (1 << end) - (1 << start)


def ranges_of(mask: int) -> list[tuple[int, int]]:
    """The runs of consecutive layers in `mask`, lowest first."""
    out: list[tuple[int, int]] = []
    layer = 0
    while mask:
        skip = (mask & -mask).bit_length() - 1  # lowest set bit
        mask >>= skip
        layer += skip
        run = (~mask & (mask + 1)).bit_length() - 1  # length of the run of ones at the bottom
        out.append((layer, layer + run))
        mask >>= run
        layer += run
    return out


@dataclass(eq=False, slots=True)
class LayerMask:
    """One writer's layer-wise chunk: its first part and the layers enqueued, queued for the
    scheduler and written."""

    num_layers: int
    group: int  # layers per group of the slot (kvxfer_protocol.slot_layout.group_of)
    first: ChunkSpec
    enqueued: int = 0
    todo: int = 0  # enqueued, not yet handed to a WRITE: the chunk waits in the scheduler
    todo_parts: int = 0  # the parts those layers came in (kvxferd_parts_per_write)
    written: int = 0
    sealed: bool = False
    # The scheduler's plan of this chunk's WRITEs, made at its first post (Scheduler._part_posts).
    posts: Any = None

    @property
    def complete(self) -> bool:
        full = (1 << self.num_layers) - 1
        return self.enqueued == full and self.written == full

    def add(self, start: int, end: int) -> bool:
        """Records an accepted part; True when the chunk must be handed to the scheduler, False when
        it waits there already (its layers join those queued)."""
        bits = layer_bits(start, end)
        queued = self.todo != 0
        self.enqueued |= bits
        self.todo |= bits
        self.todo_parts += 1
        return not queued

    def take(self) -> tuple[int, int]:
        """The layers queued since the last take and the parts they came in (the scheduler posts
        them now)."""
        todo, parts = self.todo, self.todo_parts
        self.todo = self.todo_parts = 0
        return todo, parts


def new_mask(chunk: ChunkSpec, num_layers: int) -> LayerMask:
    return LayerMask(num_layers, group_of(num_layers, chunk.layer_group), chunk)


def check_layer_part(chunk: ChunkSpec, num_layers: int, mask: LayerMask | None, writer: int) -> None:
    """Raises (InvalidArgument, AlreadyExists) when `chunk` (a part or a seal) cannot join what writer
    `writer` enqueued of its chunk (`mask`: None before its first part); changes nothing."""
    cid = chunk.chunk_id
    why = check_part(num_layers, chunk.layer_group, chunk.layer_start, chunk.layer_end)
    if why:
        raise InvalidArgument(f"room {chunk.room}: chunk {cid}: {why}")
    if chunk.is_seal:
        if not chunk.last:
            raise InvalidArgument(f"room {chunk.room}: the seal of chunk {cid} must be its room's last chunk (last)")
        if mask is None:
            raise InvalidArgument(f"room {chunk.room}: seal of chunk {cid} before any of its layer parts")
        if mask.sealed:
            raise AlreadyExists(f"room {chunk.room}: chunk {cid} was already sealed by rank {writer}")
    elif chunk.last or chunk.aux:
        raise InvalidArgument(f"room {chunk.room}: chunk {cid}: last and aux of a layer-wise chunk go on its seal")
    if mask is None:
        return
    first = mask.first
    group = group_of(num_layers, chunk.layer_group)
    seal = chunk.is_seal
    # Per part on the prefill loop: plain comparisons first, the list of differences only for a refusal.
    if not (group == mask.group and chunk.token_start == first.token_start and chunk.num_tokens == first.num_tokens
            and (seal or (chunk.slot == first.slot and chunk.claim == first.claim and chunk.pages == first.pages))):
        differs = [name for name, same in (
            ("layer_group", group == mask.group),
            ("token range", (chunk.token_start, chunk.num_tokens) == (first.token_start, first.num_tokens)),
            ("slot", seal or (chunk.slot, chunk.claim, chunk.pages) == (first.slot, first.claim, first.pages)),
        ) if not same]
        raise InvalidArgument(f"room {chunk.room}: a part of chunk {cid} differs from its first part in "
                              f"{', '.join(differs)}")
    if not seal and mask.enqueued & layer_bits(chunk.layer_start, chunk.layer_end):
        raise AlreadyExists(f"room {chunk.room}: layers of [{chunk.layer_start}, {chunk.layer_end}) of chunk {cid} "
                            f"were already enqueued by rank {writer}")


def chunk_group(mask: LayerMask | None, num_layers: int) -> int:
    """Layers per group of a writer's chunk (a whole chunk is one group)."""
    return num_layers if mask is None else mask.group


def missing_layers(chunks: dict[int, LayerMask | None], num_layers: int) -> str:
    """Why a sealed writer's layer-wise chunks (id -> mask; None: a whole chunk) cannot all land:
    layers none of their parts named, or "". The seal comes after the last layer (its aux exists
    only then), so a layer missing now would otherwise hold the room until its deadline."""
    full = (1 << num_layers) - 1
    for cid, mask in sorted(chunks.items()):
        if mask is not None and mask.enqueued != full:
            return f"layers {ranges_of(full & ~mask.enqueued)} of chunk {cid} were never enqueued"
    return ""
