"""Group-major slots of layer parts (docs/design/layerwise.md §1): part validation and the byte runs
of a head slice, checked against the layout written out element by element."""

from __future__ import annotations

import itertools

import pytest

from kvxfer_protocol.limits import MAX_LAYERS
from kvxfer_protocol.slot_layout import check_part, group_of, group_span, part_runs

PER_LAYER = 3  # bytes of one head's one layer: small, every byte is checked


def _offset(num_layers: int, g: int, heads: int, head: int, layer: int, byte: int) -> int:
    """Where (head, layer, byte) sits in a group-major part, from the definition: groups of g
    layers one after another, each [heads, layers_in_group, bytes]."""
    j, within = divmod(layer, g)
    g_j = min(g, num_layers - j * g)
    return j * g * heads * PER_LAYER + (head * g_j + within) * PER_LAYER + byte


def _apply(runs: tuple[tuple[int, int, int], ...], src: list[object], dst: list[object]) -> None:
    for s, d, n in runs:
        assert dst[d:d + n] == [None] * n, "a byte written twice"
        dst[d:d + n] = src[s:s + n]


@pytest.mark.parametrize("num_layers,group", [(1, 1), (4, 1), (5, 2), (6, 3), (7, 7), (7, 0), (7, 100), (32, 4)])
@pytest.mark.parametrize("src_heads,dst_heads,src_head,dst_head,k",
                         [(1, 1, 0, 0, 1), (2, 4, 0, 2, 2), (4, 2, 2, 0, 2), (2, 2, 0, 0, 2), (8, 8, 3, 3, 4)])
def test_runs_copy_exactly_the_part(num_layers: int, group: int, src_heads: int, dst_heads: int, src_head: int,
                                    dst_head: int, k: int) -> None:
    g = group_of(num_layers, group)
    bounds = sorted({*range(0, num_layers, g), num_layers})
    for lo, hi in itertools.combinations(bounds, 2):
        assert check_part(num_layers, group or num_layers, lo, hi) == ""
        src: list[object] = [None] * (src_heads * num_layers * PER_LAYER)
        for h, layer, b in itertools.product(range(src_heads), range(num_layers), range(PER_LAYER)):
            src[_offset(num_layers, g, src_heads, h, layer, b)] = (h, layer, b)
        assert None not in src
        dst: list[object] = [None] * (dst_heads * num_layers * PER_LAYER)
        runs = part_runs(num_layers, group, lo, hi, PER_LAYER, src_heads, dst_heads, src_head, dst_head, k)
        _apply(runs, src, dst)
        want: list[object] = [None] * len(dst)
        for i, layer, b in itertools.product(range(k), range(lo, hi), range(PER_LAYER)):
            want[_offset(num_layers, g, dst_heads, dst_head + i, layer, b)] = (src_head + i, layer, b)
        assert dst == want, (lo, hi, runs)
        # One run a group at most; whole heads of contiguous groups are one run.
        groups = -(-hi // g) - lo // g
        assert len(runs) == (1 if k == src_heads == dst_heads else groups)


def test_whole_chunk_is_todays_single_run() -> None:
    # 0/0 layers, or one group, is [heads, layers, ...]: head h at h * layers * per_layer.
    for group in (0, 8, 9):
        assert part_runs(8, group, 0, 0, 10, 4, 2, 2, 0, 2) == ((2 * 8 * 10, 0, 2 * 8 * 10),)
        assert part_runs(8, group, 0, 8, 10, 4, 2, 2, 0, 2) == ((2 * 8 * 10, 0, 2 * 8 * 10),)


def test_group_span_and_short_last_group() -> None:
    assert [group_span(10, 4, j) for j in range(3)] == [(0, 4), (4, 4), (8, 2)]
    assert group_span(10, 0, 0) == (0, 10) == group_span(10, 64, 0)
    with pytest.raises(ValueError):
        group_span(10, 4, 3)


@pytest.mark.parametrize("group,start,end,why", [
    (0, 0, 0, ""), (4, 0, 4, ""), (4, 8, 10, ""), (4, 0, 10, ""), (4, 10, 10, ""), (100, 0, 10, ""),
    (4, 2, 6, "groups of 4"), (4, 0, 6, "groups of 4"), (4, 4, 4, "non-empty"), (4, 8, 12, "non-empty"),
    (4, 6, 2, "non-empty"), (0, 0, 4, "layer_group"), (MAX_LAYERS + 1, 0, 10, "layer_group"),
])
def test_check_part(group: int, start: int, end: int, why: str) -> None:
    got = check_part(10, group, start, end)
    assert (why in got and got) if why else got == "", got


def test_check_part_caps_the_model() -> None:
    assert str(MAX_LAYERS) in check_part(MAX_LAYERS + 1, 4, 0, 4)
    assert check_part(MAX_LAYERS + 1, 0, 0, 0) == ""  # whole chunks of any model, as before
