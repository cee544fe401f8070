"""Which layers of a chunk have landed for one reader (the decode half of issue #37's layer parts).

A chunk may come as layer parts: each notification entry names a writer and a layer range
`[layer_start, layer_end)` of the chunk's slot, cut in groups of `layer_group` layers. The reader
holds a chunk only when every writer it expects (the head slices of `plan()`) has covered
`[0, L)`; a layer that lands twice from one writer is a bug on the prefill side (NIXL does not
replay a WRITE and a forgery lacks the room's token), so it fails the room rather than being
ignored: counting it once could hide a missing part of another. A whole chunk (a `kvx3` entry,
or layer fields all 0) is the range `[0, L)`, so it takes the same path with one entry per writer.

Pure: no I/O, no room; the receiver owns one `ChunkLanding` per (reader, chunk) and fails the
room with `LayerMismatch`'s text. Masks are Python ints, bit i = layer i (L <= MAX_LAYERS).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class LayerMismatch(Exception):
    """An entry that contradicts what landed before: its text says why (the room fails MISMATCH).
    `twice`: layers landed twice (counted apart: a bug on the prefill side, not a bad range)."""

    def __init__(self, why: str, twice: bool = False) -> None:
        super().__init__(why)
        self.twice = twice


def group_size(layer_group: int, num_layers: int) -> int:
    """Layers per group: 0 (a client older than layer parts) or >= L mean the whole chunk is one group."""
    return num_layers if layer_group <= 0 or layer_group >= num_layers else layer_group


def layer_span(layer_group: int, layer_start: int, layer_end: int, num_layers: int) -> tuple[int, int]:
    """The layers an entry brings, checked: `[0, L)` for a whole chunk (both bounds 0), else a
    non-empty range inside `[0, L)` whose bounds fall on group boundaries (the end may be L, the
    last group being short). A seal (`start == end == L`) carries no bytes and never lands."""
    if layer_start == layer_end == 0:
        return 0, num_layers
    g = group_size(layer_group, num_layers)
    if not 0 <= layer_start < layer_end <= num_layers:
        raise LayerMismatch(f"layers [{layer_start}, {layer_end}) are not a part of a {num_layers}-layer chunk")
    if layer_start % g or (layer_end % g and layer_end != num_layers):
        raise LayerMismatch(f"layers [{layer_start}, {layer_end}) do not fall on groups of {g} layers")
    return layer_start, layer_end


def span_mask(start: int, end: int) -> int:
    return ((1 << (end - start)) - 1) << start


def runs(mask: int) -> list[tuple[int, int]]:
    """The contiguous ranges `[a, b)` of set bits, ascending."""
    out = []
    pos = 0
    while mask:
        skip = (mask & -mask).bit_length() - 1  # trailing zeros
        mask >>= skip
        pos += skip
        width = (~mask & (mask + 1)).bit_length() - 1  # trailing ones
        out.append((pos, pos + width))
        mask >>= width
        pos += width
    return out


def _bounds(mask: int) -> tuple[int, int]:
    return (mask & -mask).bit_length() - 1, mask.bit_length()


@dataclass(eq=False, slots=True)
class ChunkLanding:
    """The layers of one (reader, chunk) landed so far, per expected writer."""

    chunk_id: int
    num_layers: int
    expected: frozenset[int]
    # Layers per group, fixed by the chunk's first entry (every writer cuts the same slot).
    layer_group: int = 0
    masks: dict[int, int] = field(default_factory=dict)
    # Layers every expected writer holds.
    held: int = 0

    @property
    def complete(self) -> bool:
        return self.held == (1 << self.num_layers) - 1

    def land(self, writer: int, layer_group: int, layer_start: int, layer_end: int) -> tuple[int, bool]:
        """Takes one entry of `writer` (one the reader expects: the receiver drops others before)
        and returns (new, complete): the layers every expected writer now holds that some did not
        before (bit i = layer i; 0 while other writers' heads of them are on the way), and whether
        this entry completed the chunk. Raises LayerMismatch, changing nothing, for a range that
        cannot be or landed before. Per notification entry on the event loop: a plain tuple, and
        whole chunks take the short way."""
        n = self.num_layers
        full = (1 << n) - 1
        if layer_start == layer_end == 0:
            g, mask = n, full
        else:
            start, end = layer_span(layer_group, layer_start, layer_end, n)
            g, mask = group_size(layer_group, n), span_mask(start, end)
        if self.layer_group and g != self.layer_group:
            raise LayerMismatch(
                f"writers of chunk {self.chunk_id} disagree on its layer group ({g} vs {self.layer_group} layers)")
        had = self.masks.get(writer, 0)
        if twice := had & mask:
            a, b = _bounds(twice)
            raise LayerMismatch(f"layers [{a}, {b}) of chunk {self.chunk_id} from writer {writer} landed twice", True)
        self.layer_group = g
        self.masks[writer] = had = had | mask
        if len(self.expected) > 1:
            for e in self.expected:
                had &= self.masks.get(e, 0)
        new, self.held = had & ~self.held, had
        return new, had == full and new != 0
