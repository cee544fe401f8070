from __future__ import annotations

import itertools
from functools import cache

import pytest

from kvxfer_protocol.slot_layout import (
    HeadSlice,
    KVLayout,
    RankHeads,
    bytes_per_head,
    part_bytes,
    plan,
    rank_heads,
)

MAX_TP = 16
MAX_HEADS = 64


@cache
def _ref_held(total: int, tp: int) -> tuple[tuple[int, ...], ...]:
    """Global heads per rank, derived from the placement rule written out longhand."""
    held: list[tuple[int, ...]] = []
    for r in range(tp):
        if total >= tp:
            # Even split: head g lives on the rank whose share covers it.
            held.append(tuple(g for g in range(total) if g * tp // total == r))
        else:
            held.append((r * total // tp,))
    return tuple(held)


def _ref_triples(ptp: int, dtp: int, total: int) -> set[tuple[int, int, int]]:
    writers = _ref_held(total, ptp)
    senders: dict[int, int] = {}
    for g in range(total):
        holders = [w for w, heads in enumerate(writers) if g in heads]
        assert holders, f"head {g} held by no prefill rank"
        senders[g] = min(holders)
    return {(senders[g], r, g) for r, heads in enumerate(_ref_held(total, dtp)) for g in heads}


def _valid(total: int, tp: int) -> bool:
    return total < tp or total % tp == 0


def _expand(slices: tuple[HeadSlice, ...], ptp: int, dtp: int, total: int) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for s in slices:
        wr = rank_heads(total, ptp, s.writer)
        rd = rank_heads(total, dtp, s.reader)
        assert s.num_heads >= 1
        assert s.src_head >= 0 and s.src_head + s.num_heads <= wr.count, s
        assert s.dst_head >= 0 and s.dst_head + s.num_heads <= rd.count, s
        for i in range(s.num_heads):
            src_global = wr.start + s.src_head + i
            dst_global = rd.start + s.dst_head + i
            assert src_global == dst_global, f"{s} moves head {src_global} into head {dst_global}"
            out.append((s.writer, s.reader, dst_global))
    return out


def test_plan_matches_bruteforce_exhaustive() -> None:
    checked = invalid = 0
    for ptp, dtp, total in itertools.product(range(1, MAX_TP + 1), range(1, MAX_TP + 1), range(1, MAX_HEADS + 1)):
        if not (_valid(total, ptp) and _valid(total, dtp)):
            with pytest.raises(ValueError, match="divisible"):
                plan(ptp, dtp, total)
            invalid += 1
            continue
        slices = plan(ptp, dtp, total)
        triples = _expand(slices, ptp, dtp, total)
        # No duplicates: every reader head covered exactly once.
        assert len(triples) == len(set(triples)), (ptp, dtp, total)
        assert set(triples) == _ref_triples(ptp, dtp, total), (ptp, dtp, total)
        per_reader_local: dict[int, list[int]] = {}
        for s in slices:
            per_reader_local.setdefault(s.reader, []).extend(range(s.dst_head, s.dst_head + s.num_heads))
        for r in range(dtp):
            assert sorted(per_reader_local[r]) == list(range(rank_heads(total, dtp, r).count)), (
                ptp,
                dtp,
                total,
                r,
            )
        checked += 1
    assert checked > 2500 and invalid > 10_000


def test_rank_heads_matches_reference() -> None:
    for tp, total in itertools.product(range(1, MAX_TP + 1), range(1, MAX_HEADS + 1)):
        if not _valid(total, tp):
            continue
        for r, heads in enumerate(_ref_held(total, tp)):
            rh = rank_heads(total, tp, r)
            assert rh.count >= 1
            assert tuple(range(rh.start, rh.start + rh.count)) == heads


@pytest.mark.parametrize(
    ("ptp", "dtp", "total", "expected"),
    [
        # 8 heads, TP8 → TP2: reader 0 pulls one head from each of writers 0..3.
        (
            8,
            2,
            8,
            [HeadSlice(w, 0, 0, w, 1) for w in range(4)] + [HeadSlice(4 + w, 1, 0, w, 1) for w in range(4)],
        ),
        # TP2 → TP4: each writer feeds two readers.
        (
            2,
            4,
            8,
            [
                HeadSlice(0, 0, 0, 0, 2),
                HeadSlice(0, 1, 2, 0, 2),
                HeadSlice(1, 2, 0, 0, 2),
                HeadSlice(1, 3, 2, 0, 2),
            ],
        ),
        # 2 heads replicated over TP4 prefill: ranks 0 and 2 are the senders.
        (4, 1, 2, [HeadSlice(0, 0, 0, 0, 1), HeadSlice(2, 0, 0, 1, 1)]),
        # Same TP: identity.
        (2, 2, 4, [HeadSlice(0, 0, 0, 0, 2), HeadSlice(1, 1, 0, 0, 2)]),
    ],
)
def test_plan_examples(ptp: int, dtp: int, total: int, expected: list[HeadSlice]) -> None:
    assert list(plan(ptp, dtp, total)) == expected


def test_mla_writer0_feeds_every_reader() -> None:
    for ptp, dtp in itertools.product(range(1, 9), range(1, 9)):
        slices = plan(ptp, dtp, 1, mla=True)
        assert slices == tuple(HeadSlice(0, r, 0, 0, 1) for r in range(dtp))
        for r in range(ptp):
            assert rank_heads(1, ptp, r, mla=True) == RankHeads(0, 1)


def test_mla_rejects_multiple_heads() -> None:
    with pytest.raises(ValueError, match="MLA"):
        plan(2, 2, 4, mla=True)
    with pytest.raises(ValueError, match="MLA"):
        KVLayout(num_layers=2, total_kv_heads=2, head_dim=576, dtype_bytes=2, page_size=64, mla=True)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_plan_rejects_non_positive(bad: object) -> None:
    with pytest.raises(ValueError):
        plan(bad, 2, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        plan(2, bad, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        plan(2, 2, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", [-1, 4, 1.0])
def test_rank_heads_rejects_bad_rank(rank: object) -> None:
    with pytest.raises(ValueError, match="rank"):
        rank_heads(8, 4, rank)  # type: ignore[arg-type]


def test_rank_heads_indivisible_message() -> None:
    with pytest.raises(ValueError, match=r"total_kv_heads=6.*tp_size=4"):
        rank_heads(6, 4, 0)


def test_layout_bytes() -> None:
    gqa = KVLayout(num_layers=80, total_kv_heads=8, head_dim=128, dtype_bytes=2, page_size=16)
    assert gqa.planes == 2
    assert bytes_per_head(gqa, 4096) == 80 * 2 * 4096 * 128 * 2
    assert part_bytes(gqa, 4, 1, 4096) == 2 * bytes_per_head(gqa, 4096)
    # Replicated heads: each rank still holds exactly one.
    assert part_bytes(gqa, 16, 15, 10) == bytes_per_head(gqa, 10)
    mla = KVLayout(num_layers=61, total_kv_heads=1, head_dim=576, dtype_bytes=1, page_size=64, mla=True)
    assert mla.planes == 1
    assert part_bytes(mla, 8, 7, 100) == 61 * 1 * 100 * 576 * 1
    with pytest.raises(ValueError):
        bytes_per_head(gqa, 0)


@pytest.mark.parametrize("field", ["num_layers", "total_kv_heads", "head_dim", "dtype_bytes", "page_size"])
def test_layout_validates(field: str) -> None:
    kwargs: dict[str, int] = {
        "num_layers": 2,
        "total_kv_heads": 2,
        "head_dim": 64,
        "dtype_bytes": 2,
        "page_size": 16,
    }
    kwargs[field] = 0
    with pytest.raises(ValueError, match=field):
        KVLayout(**kwargs)  # type: ignore[arg-type]
