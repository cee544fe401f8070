"""Head slicing between prefill and decode tensor-parallel groups.

A rank's part of a chunk is laid out ``[local_heads, layers, planes, tokens, head_dim]``
so that any contiguous run of local heads is one contiguous byte range; a
:class:`HeadSlice` therefore maps to exactly one (src, dst, length) copy.

GQA head placement (mirrors what the engines do):

* ``total >= tp``: heads are split evenly, rank ``r`` holds
  ``[r * total // tp, (r + 1) * total // tp)``; ``total % tp`` must be 0.
* ``total < tp``: every rank holds one head, rank ``r`` holds head
  ``r * total // tp``; several ranks hold the same head and only the lowest
  of them sends it so a reader never receives a head twice.

MLA has a single latent "head" replicated everywhere, which is the
``total == 1`` case of the replication rule: writer 0 sends to every reader.

Layer parts (protocol 1.1, docs/design/layerwise.md §1): a layer-wise chunk's slot is
group-major ``[groups, local_heads, layers_in_group, planes, tokens, head_dim]`` with ``g``
layers a group (the last group may be short). ``g >= layers`` is one group: today's bytes
exactly. Group ``j`` starts at ``j * g * heads * b`` and head ``h`` inside it at ``h * g_j * b``
(``b``: one head's one layer), so a head slice of one group is still one byte range.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from kvxfer_protocol.limits import MAX_LAYERS

logger = logging.getLogger(__name__)

__all__ = [
    "HeadSlice",
    "KVLayout",
    "RankHeads",
    "bytes_per_head",
    "check_part",
    "group_of",
    "group_span",
    "layer_bytes",
    "part_bytes",
    "part_runs",
    "plan",
    "rank_heads",
]


def _check_positive(name: str, value: object) -> None:
    # bool is an int subclass; True as a head count is always a caller bug.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_total(total_kv_heads: int, mla: bool) -> None:
    _check_positive("total_kv_heads", total_kv_heads)
    if mla and total_kv_heads != 1:
        raise ValueError(f"MLA layouts have exactly 1 latent kv head, got total_kv_heads={total_kv_heads}")


@dataclass(frozen=True)
class KVLayout:
    """Shape of one model's KV cache as seen by the transfer path."""

    num_layers: int
    total_kv_heads: int  # MLA: 1
    head_dim: int  # MLA: latent width (kv_lora_rank + rope dim)
    dtype_bytes: int  # 1 for fp8, 2 for bf16/fp16, 4 for fp32
    page_size: int
    mla: bool = False

    def __post_init__(self) -> None:
        _check_positive("num_layers", self.num_layers)
        _check_total(self.total_kv_heads, self.mla)
        _check_positive("head_dim", self.head_dim)
        _check_positive("dtype_bytes", self.dtype_bytes)
        _check_positive("page_size", self.page_size)

    @property
    def planes(self) -> int:
        """K and V are separate planes unless MLA, which stores one latent."""
        return 1 if self.mla else 2


@dataclass(frozen=True)
class RankHeads:
    start: int  # global index of this rank's first KV head
    count: int  # heads held locally (>= 1)


@dataclass(frozen=True)
class HeadSlice:
    writer: int  # prefill tp rank that sends
    reader: int  # decode tp rank that receives
    src_head: int  # first head, local index within the writer's part
    dst_head: int  # first head, local index within the reader's part
    num_heads: int


def _validate_tp(total_kv_heads: int, tp_size: int, mla: bool) -> None:
    _check_total(total_kv_heads, mla)
    _check_positive("tp_size", tp_size)
    if total_kv_heads >= tp_size and total_kv_heads % tp_size != 0:
        raise ValueError(
            f"total_kv_heads={total_kv_heads} cannot be split evenly over tp_size={tp_size}: "
            "when kv heads >= tp size they must be divisible by it"
        )


# Pure functions of a few ints, asked per chunk on the hot path: cached. typed=True keeps True
# apart from 1 (a bool is always refused), and a refusal is never cached.
@functools.lru_cache(maxsize=4096, typed=True)
def rank_heads(total_kv_heads: int, tp_size: int, rank: int, mla: bool = False) -> RankHeads:
    """Global KV heads held by ``rank`` of a ``tp_size`` group."""
    _validate_tp(total_kv_heads, tp_size, mla)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < tp_size:
        raise ValueError(f"rank must be an int in [0, {tp_size}), got {rank!r}")
    if total_kv_heads >= tp_size:
        per_rank = total_kv_heads // tp_size
        return RankHeads(start=rank * per_rank, count=per_rank)
    return RankHeads(start=rank * total_kv_heads // tp_size, count=1)


def _sender_of(head: int, total_kv_heads: int, tp_size: int) -> int:
    """Lowest prefill rank holding global ``head``."""
    if total_kv_heads >= tp_size:
        return head // (total_kv_heads // tp_size)
    # Smallest r with r * total // tp == head, i.e. ceil(head * tp / total).
    return -(-head * tp_size // total_kv_heads)


@functools.lru_cache(maxsize=1024, typed=True)
def plan(prefill_tp: int, decode_tp: int, total_kv_heads: int, mla: bool = False) -> tuple[HeadSlice, ...]:
    """Every (writer → reader) head range needed to fill every decode rank once.

    Slices are ordered by reader, then by destination head. Consecutive heads
    coming from the same writer are merged so each slice is one byte range.
    """
    _validate_tp(total_kv_heads, prefill_tp, mla)
    _validate_tp(total_kv_heads, decode_tp, mla)
    writer_parts = [rank_heads(total_kv_heads, prefill_tp, w, mla) for w in range(prefill_tp)]
    slices: list[HeadSlice] = []
    for reader in range(decode_tp):
        dst = rank_heads(total_kv_heads, decode_tp, reader, mla)
        run: HeadSlice | None = None
        for local in range(dst.count):
            head = dst.start + local
            writer = _sender_of(head, total_kv_heads, prefill_tp)
            src_head = head - writer_parts[writer].start
            if (
                run is not None
                and run.writer == writer
                and run.src_head + run.num_heads == src_head
                and run.dst_head + run.num_heads == local
            ):
                run = HeadSlice(writer, reader, run.src_head, run.dst_head, run.num_heads + 1)
                continue
            if run is not None:
                slices.append(run)
            run = HeadSlice(writer=writer, reader=reader, src_head=src_head, dst_head=local, num_heads=1)
        if run is not None:
            slices.append(run)
    return tuple(slices)


def bytes_per_head(layout: KVLayout, num_tokens: int) -> int:
    """Bytes one KV head occupies in a slot: layers * planes * tokens * head_dim * dtype."""
    _check_positive("num_tokens", num_tokens)
    return layout.num_layers * layout.planes * num_tokens * layout.head_dim * layout.dtype_bytes


def part_bytes(layout: KVLayout, tp_size: int, rank: int, num_tokens: int) -> int:
    """Size of ``rank``'s whole part of a ``num_tokens`` chunk."""
    heads = rank_heads(layout.total_kv_heads, tp_size, rank, layout.mla)
    return heads.count * bytes_per_head(layout, num_tokens)


def layer_bytes(layout: KVLayout, num_tokens: int) -> int:
    """Bytes one KV head's one layer occupies in a slot: planes * tokens * head_dim * dtype."""
    _check_positive("num_tokens", num_tokens)
    return layout.planes * num_tokens * layout.head_dim * layout.dtype_bytes


def group_of(num_layers: int, layer_group: int) -> int:
    """Layers per group as the slot is laid out: 0 or >= num_layers is one group (today's layout)."""
    return num_layers if layer_group <= 0 or layer_group >= num_layers else layer_group


def group_span(num_layers: int, layer_group: int, j: int) -> tuple[int, int]:
    """(first layer, layers in it) of group ``j``; only the last group may be short."""
    g = group_of(num_layers, layer_group)
    first = j * g
    if not 0 <= first < num_layers:
        raise ValueError(f"group {j} is outside {num_layers} layers of {g} a group")
    return first, min(g, num_layers - first)


def check_part(num_layers: int, layer_group: int, layer_start: int, layer_end: int) -> str:
    """Why a part's layer fields do not fit a model of ``num_layers`` layers, or "" when they do.

    0/0/0 is the whole chunk; ``layer_start == layer_end == num_layers`` is the chunk's seal (no
    bytes); else ``[layer_start, layer_end)`` is non-empty, starts on a group boundary and ends on
    one or at ``num_layers``."""
    if layer_group == layer_start == layer_end == 0:
        return ""
    if num_layers > MAX_LAYERS:
        return f"layer parts need at most {MAX_LAYERS} layers, the model has {num_layers}"
    if not 0 < layer_group <= MAX_LAYERS:
        return f"layer_group must be in [1, {MAX_LAYERS}] for a layer part, got {layer_group}"
    if layer_start == layer_end == num_layers:
        return ""
    if not 0 <= layer_start < layer_end <= num_layers:
        return f"layers [{layer_start}, {layer_end}) are not a non-empty range of the {num_layers} layers"
    g = group_of(num_layers, layer_group)
    if layer_start % g or (layer_end % g and layer_end != num_layers):
        return f"layers [{layer_start}, {layer_end}) do not start and end on groups of {g} layers"
    return ""


@functools.lru_cache(maxsize=4096)
def part_runs(num_layers: int, layer_group: int, layer_start: int, layer_end: int, per_layer: int,
              src_heads: int, dst_heads: int, src_head: int, dst_head: int,
              num_heads: int) -> tuple[tuple[int, int, int], ...]:
    """(src offset, dst offset, length) byte runs copying heads ``[src_head, +num_heads)`` of a
    writer's part (``src_heads`` local heads) to ``[dst_head, +num_heads)`` of a reader's part
    (``dst_heads``) for layers ``[layer_start, layer_end)`` (validated: check_part); offsets are
    relative to the two parts' starts. ``per_layer``: layer_bytes. One run a group, adjacent
    groups joined where contiguous on both sides (whole heads, ``num_heads == src_heads ==
    dst_heads``); layers 0/0 and the one-group layout give today's single run."""
    g = group_of(num_layers, layer_group)
    if layer_start == layer_end == 0:
        layer_end = num_layers
    runs: list[tuple[int, int, int]] = []
    for j in range(layer_start // g, -(-layer_end // g)):
        first, g_j = group_span(num_layers, g, j)
        src = first * src_heads * per_layer + src_head * g_j * per_layer
        dst = first * dst_heads * per_layer + dst_head * g_j * per_layer
        length = num_heads * g_j * per_layer
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + length)
        else:
            runs.append((src, dst, length))
    return tuple(runs)
