"""Write planning of the prefill side: which bytes of a chunk go where, as (src, dst, length)
descriptors grouped into WRITEs.

Pure: no I/O, no clock, no state. The scheduler (kvxferd.datapath.scheduler) decides *when* a chunk may go
(bootstrap, credits); this module says *what* goes: for a staged chunk, its head slices cut out of
the writer's slot into the destination ranges carved from the reader windows, one WRITE per kind
of destination memory; for a zero-copy chunk, its token slots from the writer's pool pages into
the reader's, one descriptor per run of slots that is consecutive on both sides (the transport
merges a staged WRITE's neighbouring descriptors itself: kvxferd.transports.interface.coalesce).
A layer part (docs/design/layerwise.md §1) writes some layers of a group-major slot: a head slice
becomes one run per group (kvxfer_protocol.slot_layout.part_runs), or per layer range of the pool's
layer-major planes when zero-copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvxfer_protocol.slot_layout import HeadSlice, KVLayout, layer_bytes, part_runs, rank_heads

Pair = tuple[int, int, int]  # (source address, destination address, bytes)
# A head slice's byte runs, relative to the writer's part and the reader's part (a layer part's).
SliceRuns = Callable[[HeadSlice], Sequence[Pair]]


class PlanError(ValueError):
    """A chunk that cannot be written as planned; the message says why (the room fails with it)."""


class _WindowSpec(Protocol):
    @property
    def mem(self) -> str: ...

    @property
    def device(self) -> int: ...


class _Window(Protocol):
    @property
    def spec(self) -> _WindowSpec: ...


class DestRange(Protocol):
    """Where one (chunk, reader) lands: a range carved from a window the reader's daemon granted
    (kvxferd.datapath.credits.HeldRange)."""

    @property
    def held(self) -> _Window: ...

    @property
    def address(self) -> int: ...

    @property
    def length(self) -> int: ...


R = TypeVar("R", bound=DestRange)


@dataclass(frozen=True, slots=True)
class SlotWrite(Generic[R]):
    """One WRITE of a staged chunk: its parts for the readers whose ranges lie in one kind of
    memory (the readers of one decode daemon: TP 1->4 sends four parts as one WRITE)."""

    mem: str
    device: int
    parts: tuple[tuple[HeadSlice, R], ...]
    pairs: tuple[Pair, ...]
    nbytes: int


def plan_slot_writes(chunk_id: int, slices: Sequence[HeadSlice], dest: Callable[[int], R], head_bytes: int,
                     src_base: int, src_len: int, runs: SliceRuns | None = None) -> list[SlotWrite[R]]:
    """The WRITEs of one staged chunk: each slice's heads from the writer's slot (`src_len` bytes at
    `src_base`, one head every `head_bytes`) into its reader's range (`dest(reader)`). `runs`: a
    layer part's runs of each slice (layer_runs); None: the whole chunk, one run a slice.

    Raises PlanError if a slice falls outside its slot or its range: the decode side sized nothing
    here (the ranges were cut for exactly these tokens), so that is a layout disagreement."""
    groups: dict[tuple[str, int], list[tuple[HeadSlice, R, Sequence[Pair]]]] = {}
    for s in slices:
        r = dest(s.reader)
        if runs is None:
            cut: Sequence[Pair] = ((s.src_head * head_bytes, s.dst_head * head_bytes, s.num_heads * head_bytes),)
            fits = cut[0][1] + cut[0][2] <= r.length and cut[0][0] + cut[0][2] <= src_len
        else:
            cut = runs(s)
            fits = all(d + n <= r.length and o + n <= src_len for o, d, n in cut)
        if not fits:
            raise PlanError(f"chunk {chunk_id} does not fit its slots")
        spec = r.held.spec
        groups.setdefault((spec.mem, spec.device), []).append((s, r, cut))
    writes = []
    for (mem, device), parts in groups.items():
        pairs = [(src_base + o, r.address + d, n) for _, r, cut in parts for o, d, n in cut]
        writes.append(SlotWrite(mem, device, tuple((s, r) for s, r, _ in parts), tuple(pairs),
                                sum(p[2] for p in pairs)))
    return writes


def layer_runs(layout: KVLayout, num_tokens: int, layer_group: int, layers: Sequence[tuple[int, int]],
               prefill_tp: int, decode_tp: int) -> SliceRuns:
    """Each slice's runs for layers `layers` (ranges on the group grid) of a chunk whose slots are
    laid out with `layer_group` layers a group: the (cached) plan of each range, shifted to its
    group's offsets on both sides."""
    per_layer = layer_bytes(layout, num_tokens)
    total, mla, num_layers = layout.total_kv_heads, layout.mla, layout.num_layers

    def runs(s: HeadSlice) -> list[Pair]:
        src_heads = rank_heads(total, prefill_tp, s.writer, mla).count
        dst_heads = rank_heads(total, decode_tp, s.reader, mla).count
        return [run for lo, hi in layers for run in part_runs(num_layers, layer_group, lo, hi, per_layer, src_heads,
                                                                 dst_heads, s.src_head, s.dst_head, s.num_heads)]
    return runs


@dataclass(frozen=True, slots=True)
class PagePlan:
    """The source of a zero-copy chunk: its tokens and the writer's pool pages holding them."""

    token_start: int
    num_tokens: int
    pages: Sequence[int]  # the pages the chunk's tokens touch, from the one holding token_start
    pool_address: int  # the writer's pool: layer-major planes of pool_slots token slots each
    pool_slots: int


class PageTarget(Protocol):
    """A zero-copy reader's pool and the room's pages in it, in token order (kvxferd.core.types.ZeroCopyTarget)."""

    @property
    def address(self) -> int: ...

    @property
    def num_slots(self) -> int: ...

    @property
    def pages(self) -> Sequence[int]: ...


def plan_page_writes(chunk_id: int, layout: KVLayout, src: PagePlan, num_heads: int, target: PageTarget,
                     layers: Sequence[tuple[int, int]] = ((0, 0),)) -> list[Pair]:
    """The descriptors of one zero-copy part: pool pages to pool pages, one per (layer, K/V,
    contiguous run of token slots). A chunk may start and end mid-page: only its own tokens' slots
    are written, so a page two chunks share is filled by both, each at its token offsets.
    `layers`: a layer part's ranges, whose planes alone are written (the pools are layer-major);
    (0, 0) is every layer.

    Same TP (or MLA): writer and reader hold the same `num_heads`, so a token slot has one size."""
    ps = layout.page_size
    first = src.token_start // ps
    dst_pages = target.pages[first : first + len(src.pages)]
    if len(dst_pages) != len(src.pages):
        raise PlanError(f"chunk {chunk_id} exceeds the decode pages")
    slot_bytes = num_heads * layout.head_dim * layout.dtype_bytes
    runs = slot_runs(src.pages, dst_pages, src.token_start % ps, src.num_tokens, ps)
    pairs = []
    planes = [p for lo, hi in layers for p in range(lo * layout.planes, (hi or layout.num_layers) * layout.planes)]
    for plane in planes:
        src_plane = src.pool_address + plane * src.pool_slots * slot_bytes
        dst_plane = target.address + plane * target.num_slots * slot_bytes
        for ss, ds, n in runs:
            pairs.append((src_plane + ss * slot_bytes, dst_plane + ds * slot_bytes, n * slot_bytes))
    return pairs


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_page, dst_page, pages) runs where both sides are consecutive: one descriptor per run."""
    runs: list[tuple[int, int, int]] = []
    for sp, dp in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == sp and runs[-1][1] + runs[-1][2] == dp:
            a, b, n = runs[-1]
            runs[-1] = (a, b, n + 1)
        else:
            runs.append((sp, dp, 1))
    return runs


def slot_runs(src_pages: Sequence[int], dst_pages: Sequence[int], offset: int, num_tokens: int,
              page_size: int) -> list[tuple[int, int, int]]:
    """(src_slot, dst_slot, slots) runs for tokens [offset, offset + num_tokens) of a page list
    (token ``offset`` is the first page's slot ``offset``), where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    pos = 0  # page-list-relative slot of the first page of the current run
    for sp, dp, n in coalesce(src_pages, dst_pages):
        lo, hi = max(pos, offset), min(pos + n * page_size, offset + num_tokens)
        if lo < hi:
            runs.append((sp * page_size + lo - pos, dp * page_size + lo - pos, hi - lo))
        pos += n * page_size
    return runs
