"""KVPages on block-major planes ``[pages, heads, page_size, D]`` with any strides: the shapes
vLLM's caches have as ``kvxfer_client.vllm._paged.kv_planes`` sees them (CPU_ATTN's transposed K,
head-major V, and token-major GPU pages). Every byte is checked against per-token indexing."""

from __future__ import annotations

import pytest
import torch

from kvxfer_client.kernels import KVPages, triton_available

PAGES, HEADS, SIZE, D, LAYERS = 6, 3, 4, 8, 2


def _raw(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """bf16 of random raw bits (NaN patterns too), so a value-converting copy would show."""
    return torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)


def _planes(layout: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V views over one cache tensor, laid out as the named backend does."""
    if layout == "cpu_attn":  # per (page, head): K transposed [D, SIZE], then V [SIZE, D]
        cache = _raw((PAGES, HEADS, 2, SIZE * D), gen)
        return cache[:, :, 0].view(PAGES, HEADS, D, SIZE).transpose(2, 3), cache[:, :, 1].view(PAGES, HEADS, SIZE, D)
    if layout == "head_major":  # [pages, heads, size, 2D]: K and V split per token
        cache = _raw((PAGES, HEADS, SIZE, 2 * D), gen)
        return cache[..., :D], cache[..., D:]
    cache = _raw((PAGES, SIZE, HEADS, 2 * D), gen).permute(0, 2, 1, 3)  # token-major pages
    return cache[..., :D], cache[..., D:]


def _ids_offsets(pages: list[int], offset: int, n: int) -> list[tuple[int, int]]:
    return [(pages[(offset + i) // SIZE], (offset + i) % SIZE) for i in range(n)]


LAYOUTS = ["cpu_attn", "head_major", "token_major"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_and_scatter_match_per_token_indexing(layout: str) -> None:
    gen = torch.Generator().manual_seed(3)
    layers = [_planes(layout, gen) for _ in range(LAYERS)]
    kv = KVPages([k for k, _ in layers], [v for _, v in layers])
    pages, offset, n, h0, nh = [4, 1, 5], 3, 7, 1, 2
    slot = torch.empty(nh, LAYERS, 2, n, D, dtype=torch.bfloat16)
    kv.gather(torch.tensor(pages), n, SIZE, slot, h0, nh, token_offset=offset, backend="torch")
    for t, (p, o) in enumerate(_ids_offsets(pages, offset, n)):
        for layer, planes in enumerate(layers):
            for which, plane in enumerate(planes):
                got, want = slot[:, layer, which, t], plane[p, h0 : h0 + nh, o]
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (t, layer, which)

    before = [tuple(x.clone() for x in planes) for planes in layers]
    fresh = _raw(tuple(slot.shape), gen)
    kv.scatter(torch.tensor(pages), n, SIZE, fresh, h0, nh, token_offset=offset, backend="torch")
    written = set(_ids_offsets(pages, offset, n))
    for layer, (planes, old) in enumerate(zip(layers, before, strict=True)):
        for which, (plane, was) in enumerate(zip(planes, old, strict=True)):
            for p in range(PAGES):
                for o in range(SIZE):
                    for h in range(HEADS):
                        if (p, o) in written and h0 <= h < h0 + nh:
                            t = _ids_offsets(pages, offset, n).index((p, o))
                            want = fresh[h - h0, layer, which, t]
                        else:
                            want = was[p, h, o]  # other tokens and heads keep their bytes
                        assert torch.equal(plane[p, h, o].view(torch.int16), want.view(torch.int16))


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_token_major_pages_take_the_kernel_others_refuse_it() -> None:
    gen = torch.Generator().manual_seed(4)
    k, v = _planes("token_major", gen)
    kv = KVPages([k], [v], staging_bytes=0)
    ids = torch.tensor([2, 0, 3])
    out, ref = (torch.empty(HEADS, 1, 2, 9, D, dtype=torch.bfloat16) for _ in range(2))
    kv.gather(ids, 9, SIZE, out, token_offset=2, backend="triton")
    kv.gather(ids, 9, SIZE, ref, token_offset=2, backend="torch")
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    k, v = _planes("cpu_attn", gen)
    with pytest.raises(ValueError, match="not \\[slot, head, D\\] rows"):
        KVPages([k], [v]).gather(ids, 9, SIZE, out, token_offset=2, backend="triton")


def test_block_major_refusals() -> None:
    gen = torch.Generator().manual_seed(5)
    k, v = _planes("head_major", gen)
    kv = KVPages([k], [v])
    out = torch.empty(HEADS, 1, 2, 4, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="page_size 2 is not the 4 tokens"):
        kv.gather(torch.tensor([0, 1]), 4, 2, out)
    with pytest.raises(ValueError, match="page ids must be in"):
        kv.gather(torch.tensor([PAGES]), 4, SIZE, out)
    with pytest.raises(ValueError, match="share shape"):
        KVPages([k, k[:, :2]], None)
