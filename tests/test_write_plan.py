"""kvxferd.datapath.write_plan on fake windows: which bytes of a chunk go where, without daemons or NIXL.

A fake window is a base address and a memory kind; its ranges are carved back to back like the
credit windows of kvxferd.datapath.credits. Every plan is checked by applying its descriptors to byte
arrays and comparing each reader's bytes with the heads it must hold (kvxfer_protocol.slot_layout.plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvxfer_protocol.slot_layout import KVLayout, plan, rank_heads
from kvxferd.datapath.write_plan import PagePlan, PlanError, plan_page_writes, plan_slot_writes, slot_runs


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
