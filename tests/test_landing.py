"""The decode side's layer coverage (kvxferd.datapath.landing): a chunk lands only when every
expected writer covered every layer, once; whole chunks are the range [0, L)."""

from __future__ import annotations

import itertools
import random

import pytest

from kvxferd.datapath.landing import ChunkLanding, Landed, LayerMismatch, group_size, layer_span, runs, span_mask

L = 10


def test_a_whole_chunk_is_every_layer_and_lands_when_its_last_writer_does() -> None:
    c = ChunkLanding(3, L, frozenset({0, 1}))
    assert c.land(1, 0, 0, 0) == Landed(0, False)  # writer 0's heads of every layer are still out
    assert c.land(0, 0, 0, 0) == Landed(span_mask(0, L), True)
    assert c.complete and c.layer_group == L


def test_parts_land_per_group_and_the_reader_holds_a_layer_once_every_writer_brought_it() -> None:
    c = ChunkLanding(0, L, frozenset({0, 1}))
    assert c.land(0, 4, 4, 8) == Landed(0, False)
    assert c.land(1, 4, 0, 4) == Landed(0, False)
    assert c.land(1, 4, 4, 8) == Landed(span_mask(4, 8), False)
    assert c.land(0, 4, 8, 10) == Landed(0, False)  # the last group is short (10 = 4 + 4 + 2)
    assert c.land(0, 4, 0, 4) == Landed(span_mask(0, 4), False)
    assert not c.complete
    assert c.land(1, 4, 8, 10) == Landed(span_mask(8, 10), True)
    assert c.complete


def test_parts_in_any_order_complete_the_chunk_exactly_when_the_last_layer_lands() -> None:
    rng = random.Random(37)
    for _ in range(200):
        g = rng.randint(1, L)
        writers = frozenset(range(rng.randint(1, 4)))
        # Each writer sends its groups, some merged into one range, in a random order.
        entries = []
        for w in writers:
            bounds = sorted({0, L} | {b for b in range(g, L, g) if rng.random() < 0.5})
            entries += [(w, a, b) for a, b in itertools.pairwise(bounds)]
        rng.shuffle(entries)
        c = ChunkLanding(1, L, writers)
        held = 0
        for i, (w, a, b) in enumerate(entries):
            got = c.land(w, g, a, b)
            assert got.new & held == 0 and got.complete == (i == len(entries) - 1)
            held |= got.new
        assert held == span_mask(0, L) and c.complete


@pytest.mark.parametrize(("g", "first", "again", "why"), [
    (0, (0, 0), (0, 0), "layers [0, 10) of chunk 5 from writer 1 landed twice"),
    (2, (2, 6), (4, 8), "layers [4, 6) of chunk 5 from writer 1 landed twice"),
    (2, (0, 10), (8, 10), "layers [8, 10) of chunk 5 from writer 1 landed twice"),
    (10, (0, 0), (0, 10), "layers [0, 10) of chunk 5 from writer 1 landed twice"),  # kvx3 then kvx4 [0, L)
])
def test_a_writers_layers_landing_twice_is_a_mismatch_that_changes_nothing(
        g: int, first: tuple[int, int], again: tuple[int, int], why: str) -> None:
    c = ChunkLanding(5, L, frozenset({1, 2}))
    c.land(1, g, *first)
    before = dict(c.masks), c.held
    with pytest.raises(LayerMismatch) as err:
        c.land(1, g, *again)
    assert str(err.value) == why
    assert (c.masks, c.held) == before
    # The other writer's layers are its own: the same range from it counts.
    assert c.land(2, g, *again).new == span_mask(*layer_span(g, *again, L)) & c.masks[1]


@pytest.mark.parametrize(("g", "start", "end", "why"), [
    (4, 2, 6, "do not fall on groups of 4 layers"),
    (4, 4, 6, "do not fall on groups of 4 layers"),
    (4, 8, 11, "are not a part of a 10-layer chunk"),
    (4, 4, 4, "are not a part"),
    (4, 10, 10, "are not a part"),  # a seal carries no bytes: never a notification
    (4, 6, 2, "are not a part"),
])
def test_a_range_that_is_no_part_is_refused(g: int, start: int, end: int, why: str) -> None:
    c = ChunkLanding(0, L, frozenset({0}))
    with pytest.raises(LayerMismatch, match=why):
        c.land(0, g, start, end)
    assert not c.masks and c.layer_group == 0


def test_writers_of_one_chunk_must_cut_it_in_the_same_groups() -> None:
    c = ChunkLanding(7, L, frozenset({0, 1}))
    c.land(0, 4, 0, 4)
    with pytest.raises(LayerMismatch, match="writers of chunk 7 disagree on its layer group \\(2 vs 4 layers\\)"):
        c.land(1, 2, 0, 2)
    with pytest.raises(LayerMismatch, match="disagree"):
        c.land(1, 0, 0, 0)  # a whole chunk is one group of L
    assert c.land(1, 4, 0, 8).new == span_mask(0, 4)


def test_group_size_and_span_helpers() -> None:
    assert [group_size(g, L) for g in (0, 1, 9, 10, 11)] == [L, 1, 9, L, L]
    assert layer_span(0, 0, 0, L) == (0, L) and layer_span(3, 9, 10, L) == (9, 10)
    assert runs(0) == [] and runs(span_mask(0, L)) == [(0, L)]
    assert runs(0b1011_0110) == [(1, 3), (4, 6), (7, 8)]
    rng = random.Random(1)
    for _ in range(500):
        m = rng.getrandbits(80)
        assert sum(span_mask(a, b) for a, b in runs(m)) == m
