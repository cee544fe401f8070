"""``KVPages.layers(lo, hi)`` and ``group_view``: layer groups of a group-major slot
``[groups, heads, layers_in_group, planes, tokens, head_dim]`` (docs/design/layerwise.md §1).

Every byte of a slot filled group by group is checked against today's whole-chunk layout
rearranged by hand, and every byte of the KV after a group-by-group scatter against a
whole-chunk scatter of the same data; group size L must be today's bytes exactly.
"""

from __future__ import annotations

import pytest
import torch

from kvxfer_client.kernels import KVPages, slot_nbytes, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")

LAYERS, SLOTS, DIM, PAGE = 5, 32, 8, 4


def _raw(shape: tuple[int, ...], device: str, gen: torch.Generator) -> torch.Tensor:
    """bf16 of random raw bits (NaN patterns too): a value-converting copy would show."""
    return torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16).to(device)


def _groups(layer_group: int) -> list[tuple[int, int]]:
    return [(lo, min(LAYERS, lo + layer_group)) for lo in range(0, LAYERS, layer_group)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


# (name, local heads, head_start, num_heads, planes): 4 heads whole; a GQA reader's slice of
# 2 of 4 heads at an offset; MLA's one latent plane of width DIM.
SHAPES = [("mha", 4, 0, 4, 2), ("gqa_slice", 4, 1, 2, 2), ("mla", 1, 0, 1, 1)]


@pytest.mark.parametrize("layer_group", [1, 3, LAYERS], ids=lambda g: f"g{g}")
@pytest.mark.parametrize(("name", "heads", "h0", "nh", "planes"), SHAPES, ids=[s[0] for s in SHAPES])
def test_groups_gather_and_scatter_every_byte(
    placement: tuple[str, str, int | None], layer_group: int, name: str, heads: int, h0: int, nh: int, planes: int
) -> None:
    dev, where, staging = placement
    gen = torch.Generator().manual_seed(layer_group * 10 + heads + planes)
    k = [_raw((SLOTS, heads, DIM), dev, gen) for _ in range(LAYERS)]
    v = [_raw((SLOTS, heads, DIM), dev, gen) for _ in range(LAYERS)] if planes == 2 else None
    kv = KVPages(k, v, **({} if staging is None else {"staging_bytes": staging}))
    pages, tokens, offset = torch.tensor([5, 2, 7], dtype=torch.int64), 9, 2
    nbytes = slot_nbytes(nh, LAYERS, planes, tokens, DIM, torch.bfloat16)

    # Today's layout [heads, layers, planes, tokens, D], by the torch reference.
    whole = torch.empty(nh, LAYERS, planes, tokens, DIM, dtype=torch.bfloat16)
    kv.gather(pages, tokens, PAGE, whole, h0, nh, token_offset=offset, backend="torch")
    want = torch.cat([whole[:, lo:hi].reshape(-1) for lo, hi in _groups(layer_group)])

    # Group by group (out of order) into a poisoned slot in the placement under test.
    slot = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    slot = slot.pin_memory() if where == "pinned" else slot.to("cpu" if where == "pageable" else where)
    for lo, hi in reversed(_groups(layer_group)):
        part = kv.layers(lo, hi)
        assert part.num_layers == hi - lo and part.planes == planes
        part.gather(pages, tokens, PAGE, kv.group_view(slot, lo, hi, tokens, nh), h0, nh,
                    token_offset=offset, backend="triton")
    kv.settle()
    assert torch.equal(_bits(slot), _bits(want)), f"{name} g={layer_group}: group-major gather differs"
    if layer_group == LAYERS:
        assert torch.equal(_bits(slot), _bits(whole)), "one group is not today's whole-chunk bytes"

    # Scatter: fresh data, group by group into one cache, whole-chunk into a reference copy.
    fresh = _raw((nbytes // 2,), "cpu", gen)
    fresh_dev = fresh.pin_memory() if where == "pinned" else fresh.to("cpu" if where == "pageable" else where)
    k2, v2 = [t.clone() for t in k], None if v is None else [t.clone() for t in v]
    kv2 = KVPages(k2, v2, **({} if staging is None else {"staging_bytes": staging}))
    for lo, hi in _groups(layer_group):
        kv2.layers(lo, hi).scatter(pages, tokens, PAGE, kv2.group_view(fresh_dev, lo, hi, tokens, nh), h0, nh,
                                   token_offset=offset, backend="triton")
    kv2.settle()
    # The same bytes in today's layout: group j's [nh, g_j, planes, T, D] back into its layers.
    per_layer = fresh.numel() // LAYERS
    as_whole = torch.empty(nh, LAYERS, planes, tokens, DIM, dtype=torch.bfloat16)
    for lo, hi in _groups(layer_group):
        as_whole[:, lo:hi] = fresh[lo * per_layer : hi * per_layer].view(nh, hi - lo, planes, tokens, DIM)
    kv.scatter(pages, tokens, PAGE, as_whole, h0, nh, token_offset=offset, backend="torch")
    for i in range(LAYERS):
        assert torch.equal(_bits(k2[i]), _bits(k[i])), f"{name} g={layer_group}: K of layer {i}"
        if v is not None and v2 is not None:
            assert torch.equal(_bits(v2[i]), _bits(v[i])), f"{name} g={layer_group}: V of layer {i}"


def test_layers_are_cached_share_the_stager_and_refuse_bad_input() -> None:
    gen = torch.Generator().manual_seed(1)
    kv = KVPages([_raw((SLOTS, 2, DIM), "cpu", gen) for _ in range(LAYERS)],
                 [_raw((SLOTS, 2, DIM), "cpu", gen) for _ in range(LAYERS)])
    assert kv.layers(0, 3) is kv.layers(0, 3)
    assert kv.layers(0, LAYERS) is kv
    assert kv.layers(2, 4)._stager is kv._stager
    for lo, hi in [(3, 3), (-1, 2), (3, LAYERS + 1), (4, 2)]:
        with pytest.raises(ValueError, match="layer range"):
            kv.layers(lo, hi)
    slot = torch.empty(kv.slot_nbytes(5), dtype=torch.uint8)
    view = kv.group_view(slot, 2, 5, 5)
    per_layer = slot.numel() // LAYERS
    assert view.data_ptr() == slot.data_ptr() + 2 * per_layer and view.numel() == 3 * per_layer
    with pytest.raises(ValueError, match="bytes"):
        kv.group_view(slot[:-1], 0, 3, 5)
    # A group's slot of the wrong size is refused by the sub-view's own check, naming its layers.
    with pytest.raises(ValueError, match=r"\[2, 3, 2, 5, 8\]"):
        kv.layers(0, 3).gather(torch.tensor([0, 1]), 5, PAGE, slot)


def test_block_major_planes_keep_their_page_size() -> None:
    gen = torch.Generator().manual_seed(2)
    k = [_raw((6, 2, PAGE, DIM), "cpu", gen) for _ in range(3)]
    v = [_raw((6, 2, PAGE, DIM), "cpu", gen) for _ in range(3)]
    kv = KVPages(k, v)
    part = kv.layers(1, 3)
    assert part.page_size == PAGE
    with pytest.raises(ValueError, match="page_size"):
        part.gather(torch.tensor([1, 2]), 5, PAGE * 2, torch.empty(part.slot_nbytes(5), dtype=torch.uint8))
    out = torch.empty(2, 2, 2, 5, DIM, dtype=torch.bfloat16)
    part.gather(torch.tensor([4, 0]), 5, PAGE, out, backend="torch")
    for t, (p, o) in enumerate([(4, 0), (4, 1), (4, 2), (4, 3), (0, 0)]):
        for j, layer in enumerate((1, 2)):
            assert torch.equal(out[:, j, 0, t].view(torch.int16), k[layer][p, :, o].view(torch.int16))
            assert torch.equal(out[:, j, 1, t].view(torch.int16), v[layer][p, :, o].view(torch.int16))
