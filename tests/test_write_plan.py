"""kvxferd.datapath.write_plan on fake windows: which bytes of a chunk go where, without daemons or NIXL.

A fake window is a base address and a memory kind; its ranges are carved back to back like the
credit windows of kvxferd.datapath.credits. Every plan is checked by applying its descriptors to byte
arrays and comparing each reader's bytes with the heads it must hold (kvxfer_protocol.slot_layout.plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvxfer_protocol.slot_layout import KVLayout, bytes_per_head, part_bytes, plan, rank_heads
from kvxferd.datapath.write_plan import (
    PagePlan,
    PlanError,
    layer_runs,
    plan_page_writes,
    plan_slot_writes,
    slot_runs,
)


@dataclass(frozen=True)
class FakeSpec:
    mem: str
    device: int


@dataclass(frozen=True, eq=False)
class FakeWindow:
    spec: FakeSpec
    base: int
    cursor: list[int] = field(default_factory=lambda: [0])

    def take(self, nbytes: int) -> FakeRange:
        r = FakeRange(self, self.cursor[0], nbytes)
        self.cursor[0] += nbytes
        return r


@dataclass(frozen=True)
class FakeRange:
    held: FakeWindow
    offset: int
    length: int

    @property
    def address(self) -> int:
        return self.held.base + self.offset


def _apply(pairs: tuple[tuple[int, int, int], ...] | list[tuple[int, int, int]], src: bytes, src_base: int,
           dst: bytearray, dst_base: int) -> None:
    for s, d, n in pairs:
        assert n > 0
        dst[d - dst_base : d - dst_base + n] = src[s - src_base : s - src_base + n]


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 1), (1, 4), (4, 2), (2, 4), (8, 2)])
def test_staged_parts_land_on_the_readers_heads(ptp: int, dtp: int) -> None:
    heads, bph, base = 8, 64, 1 << 20
    win = FakeWindow(FakeSpec("DRAM", 0), base)
    ranges = {r: win.take(rank_heads(heads, dtp, r).count * bph) for r in range(dtp)}
    dst = bytearray(win.cursor[0])
    for writer in range(ptp):
        mine = rank_heads(heads, ptp, writer)
        src = bytes((mine.start + i // bph) % 251 for i in range(mine.count * bph))  # byte = global head
        slices = [s for s in plan(ptp, dtp, heads) if s.writer == writer]
        writes = plan_slot_writes(7, slices, ranges.__getitem__, bph, 4096, len(src))
        assert len(writes) == 1  # one kind of memory: every reader's part in one WRITE
        assert writes[0].nbytes == sum(s.num_heads for s in slices) * bph
        assert {r for _, r in writes[0].parts} == {ranges[s.reader] for s in slices}
        _apply(writes[0].pairs, src, 4096, dst, base)
    for r, rng in ranges.items():
        got = dst[rng.offset : rng.offset + rng.length]
        first = rank_heads(heads, dtp, r).start
        assert got == bytes((first + i // bph) % 251 for i in range(rng.length)), f"reader {r}"


def test_staged_parts_split_by_destination_memory() -> None:
    dram, vram = FakeWindow(FakeSpec("DRAM", 0), 1 << 20), FakeWindow(FakeSpec("VRAM", 1), 1 << 30)
    ranges = {0: dram.take(256), 1: vram.take(256), 2: dram.take(256), 3: vram.take(256)}
    slices = plan(1, 4, 8)
    writes = plan_slot_writes(1, slices, ranges.__getitem__, 128, 4096, 8 * 128)
    assert sorted((w.mem, w.device, [s.reader for s, _ in w.parts]) for w in writes) == [
        ("DRAM", 0, [0, 2]), ("VRAM", 1, [1, 3])]
    assert sum(w.nbytes for w in writes) == 8 * 128


@pytest.mark.parametrize(("src_len", "dst_len"), [(8 * 128 - 1, 256), (8 * 128, 255)])
def test_a_part_outside_its_slot_or_range_is_refused(src_len: int, dst_len: int) -> None:
    win = FakeWindow(FakeSpec("DRAM", 0), 1 << 20)
    ranges = {r: win.take(dst_len) for r in range(4)}
    with pytest.raises(PlanError, match="chunk 9 does not fit its slots"):
        plan_slot_writes(9, plan(1, 4, 8), ranges.__getitem__, 128, 4096, src_len)


@dataclass(frozen=True)
class FakeTarget:
    address: int
    num_slots: int
    pages: tuple[int, ...]


@pytest.mark.parametrize(("token_start", "num_tokens"), [(0, 16), (3, 7), (5, 11), (12, 9), (0, 1)])
def test_zero_copy_writes_exactly_the_chunk_tokens(token_start: int, num_tokens: int) -> None:
    lay = KVLayout(num_layers=2, total_kv_heads=2, head_dim=4, dtype_bytes=2, page_size=4)
    slot, pool_slots = 2 * 4 * 2, 32  # bytes per token slot of 2 heads; slots per plane
    planes = lay.num_layers * lay.planes
    src_pages, dst_pages = (5, 6, 2, 3, 0, 7), (1, 2, 7, 4, 5, 6)
    first, last = token_start // 4, (token_start + num_tokens - 1) // 4
    src = PagePlan(token_start, num_tokens, src_pages[first : last + 1], 0x10000, pool_slots)
    target = FakeTarget(0x80000, pool_slots, dst_pages)
    pairs = plan_page_writes(3, lay, src, 2, target)
    pool = bytes(i % 253 for i in range(planes * pool_slots * slot))
    dst = bytearray(planes * pool_slots * slot)
    _apply(pairs, pool, 0x10000, dst, 0x80000)
    want = bytearray(len(dst))
    for t in range(token_start, token_start + num_tokens):
        s_slot = src_pages[t // 4] * 4 + t % 4
        d_slot = dst_pages[t // 4] * 4 + t % 4
        for p in range(planes):
            s_off, d_off = (p * pool_slots + s_slot) * slot, (p * pool_slots + d_slot) * slot
            want[d_off : d_off + slot] = pool[s_off : s_off + slot]
    assert dst == want
    runs = slot_runs(src.pages, dst_pages[first : last + 1], token_start % 4, num_tokens, 4)
    assert len(pairs) == planes * len(runs)  # one descriptor per (plane, run), never per token


def test_zero_copy_past_the_decode_pages_is_refused() -> None:
    lay = KVLayout(num_layers=1, total_kv_heads=1, head_dim=4, dtype_bytes=2, page_size=4)
    src = PagePlan(4, 8, (1, 2), 0x1000, 8)
    with pytest.raises(PlanError, match="chunk 2 exceeds the decode pages"):
        plan_page_writes(2, lay, src, 1, FakeTarget(0x9000, 8, (0, 3)))


# ---------------------------------------------------------------- layer parts (docs/design/layerwise.md §1)


def _group_major(lay: KVLayout, tp: int, rank: int, tokens: int, group: int, layers: set[int]) -> bytes:
    """A rank's part laid out [groups, local heads, layers_in_group, planes, tokens, head_dim],
    written out element by element: each byte names (global head, layer, byte); layers outside
    `layers` are zero (not written)."""
    heads = rank_heads(lay.total_kv_heads, tp, rank, lay.mla)
    b = lay.planes * tokens * lay.head_dim * lay.dtype_bytes
    n, g = lay.num_layers, group if 0 < group < lay.num_layers else lay.num_layers
    out = bytearray(heads.count * n * b)
    for h in range(heads.count):
        for layer in layers:
            j, within = divmod(layer, g)
            g_j = min(g, n - j * g)
            at = j * g * heads.count * b + (h * g_j + within) * b
            out[at : at + b] = bytes(((heads.start + h) * 37 + layer * 11 + i) % 251 or 1 for i in range(b))
    return bytes(out)


# (prefill TP, decode TP, KV heads, MLA): same TP, 4->2, 2->4, GQA replicas both ways, MLA.
_TP_CASES = [(1, 1, 8, False), (4, 2, 8, False), (2, 4, 8, False), (1, 4, 2, False), (4, 1, 2, False),
             (2, 2, 1, True)]


@pytest.mark.parametrize(("ptp", "dtp", "heads", "mla"), _TP_CASES)
def test_layer_parts_land_every_byte_once(ptp: int, dtp: int, heads: int, mla: bool) -> None:
    lay = KVLayout(num_layers=7, total_kv_heads=heads, head_dim=4, dtype_bytes=2, page_size=4, mla=mla)
    tokens, group = 3, 2  # groups [0,2) [2,4) [4,6) [6,7): the last one short
    win = FakeWindow(FakeSpec("DRAM", 0), 1 << 20)
    ranges = {r: win.take(part_bytes(lay, dtp, r, tokens)) for r in range(dtp)}
    dst = bytearray(win.cursor[0])
    # Out of order, one merged range, the short last group alone; each writer sends them all.
    parts = [[(4, 6)], [(0, 2), (2, 4)], [(6, 7)]]
    sent: set[int] = set()
    for part in parts:
        for writer in range(ptp):
            src = _group_major(lay, ptp, writer, tokens, group, set(range(lay.num_layers)))
            slices = [s for s in plan(ptp, dtp, heads, mla) if s.writer == writer]
            runs = layer_runs(lay, tokens, group, part, ptp, dtp)
            writes = plan_slot_writes(5, slices, ranges.__getitem__, bytes_per_head(lay, tokens), 4096, len(src), runs)
            assert len(writes) == (1 if slices else 0)
            for w in writes:
                # One descriptor per (slice, group), joined where both sides are contiguous.
                assert len(w.pairs) <= sum(len(runs(s)) for s in slices)
                _apply(w.pairs, src, 4096, dst, 1 << 20)
        sent |= {layer for lo, hi in part for layer in range(lo, hi)}
        for r, rng in ranges.items():
            want = _group_major(lay, dtp, r, tokens, group, sent)
            assert dst[rng.offset : rng.offset + rng.length] == want, f"reader {r} after layers {sorted(sent)}"


def test_one_part_of_one_head_slice_is_one_descriptor() -> None:
    # 4->2 over 8 heads: each writer's 2 heads are half a reader's; a group of them is one run.
    lay = KVLayout(num_layers=8, total_kv_heads=8, head_dim=4, dtype_bytes=2, page_size=4)
    win = FakeWindow(FakeSpec("DRAM", 0), 1 << 20)
    ranges = {r: win.take(part_bytes(lay, 2, r, 5)) for r in range(2)}
    for writer in range(4):
        slices = [s for s in plan(4, 2, 8) if s.writer == writer]
        writes = plan_slot_writes(1, slices, ranges.__getitem__, bytes_per_head(lay, 5), 0, 1 << 16,
                                  layer_runs(lay, 5, 2, [(2, 4)], 4, 2))
        assert [len(w.pairs) for w in writes] == [1]
        # Two groups of a head slice are two runs (the reader's other heads lie between).
        writes = plan_slot_writes(1, slices, ranges.__getitem__, bytes_per_head(lay, 5), 0, 1 << 16,
                                  layer_runs(lay, 5, 2, [(2, 6)], 4, 2))
        assert [len(w.pairs) for w in writes] == [2]


def test_whole_chunk_plan_is_unchanged_by_the_one_group_layout() -> None:
    lay = KVLayout(num_layers=6, total_kv_heads=8, head_dim=4, dtype_bytes=2, page_size=4)
    win = FakeWindow(FakeSpec("DRAM", 0), 1 << 20)
    ranges = {r: win.take(part_bytes(lay, 4, r, 3)) for r in range(4)}
    slices = [s for s in plan(2, 4, 8) if s.writer == 1]
    whole = plan_slot_writes(2, slices, ranges.__getitem__, bytes_per_head(lay, 3), 0, 1 << 16)
    for group in (0, 6, 64):
        one = plan_slot_writes(2, slices, ranges.__getitem__, bytes_per_head(lay, 3), 0, 1 << 16,
                               layer_runs(lay, 3, group, [(0, 6)], 2, 4))
        assert [w.pairs for w in one] == [w.pairs for w in whole]


def test_a_layer_part_outside_its_slot_is_refused() -> None:
    lay = KVLayout(num_layers=4, total_kv_heads=2, head_dim=4, dtype_bytes=2, page_size=4)
    win = FakeWindow(FakeSpec("DRAM", 0), 1 << 20)
    ranges = {0: win.take(part_bytes(lay, 1, 0, 2))}
    src_len = part_bytes(lay, 1, 0, 2) - 1  # the slot is one byte short: only the last group touches it
    runs = layer_runs(lay, 2, 2, [(0, 2)], 1, 1)
    assert plan_slot_writes(3, plan(1, 1, 2), ranges.__getitem__, bytes_per_head(lay, 2), 0, src_len, runs)
    with pytest.raises(PlanError, match="chunk 3 does not fit its slots"):
        plan_slot_writes(3, plan(1, 1, 2), ranges.__getitem__, bytes_per_head(lay, 2), 0, src_len,
                         layer_runs(lay, 2, 2, [(2, 4)], 1, 1))


@pytest.mark.parametrize("layers", [[(0, 1)], [(1, 3)], [(0, 1), (2, 3)], [(0, 3)]])
def test_zero_copy_part_writes_only_its_layers_planes(layers: list[tuple[int, int]]) -> None:
    lay = KVLayout(num_layers=3, total_kv_heads=2, head_dim=4, dtype_bytes=2, page_size=4)
    slot, pool_slots = 2 * 4 * 2, 16
    src_pages, dst_pages = (2, 0), (1, 3)
    src = PagePlan(2, 5, src_pages, 0x10000, pool_slots)
    pairs = plan_page_writes(4, lay, src, 2, FakeTarget(0x80000, pool_slots, dst_pages), layers)
    planes = lay.num_layers * lay.planes
    pool = bytes(i % 253 or 1 for i in range(planes * pool_slots * slot))
    dst = bytearray(planes * pool_slots * slot)
    _apply(pairs, pool, 0x10000, dst, 0x80000)
    want = bytearray(len(dst))
    for layer in {x for lo, hi in layers for x in range(lo, hi)}:
        for p in range(layer * lay.planes, (layer + 1) * lay.planes):
            for t in range(2, 7):
                s_off = (p * pool_slots + src_pages[t // 4] * 4 + t % 4) * slot
                d_off = (p * pool_slots + dst_pages[t // 4] * 4 + t % 4) * slot
                want[d_off : d_off + slot] = pool[s_off : s_off + slot]
    assert dst == want
    assert plan_page_writes(4, lay, src, 2, FakeTarget(0x80000, pool_slots, dst_pages)) == \
        plan_page_writes(4, lay, src, 2, FakeTarget(0x80000, pool_slots, dst_pages), [(0, 3)])
