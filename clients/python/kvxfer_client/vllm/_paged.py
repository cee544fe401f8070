"""vLLM's paged KV cache seen as K and V planes, and copies between it and kvxferd's slot layout.

vLLM hands the connector one tensor per attention layer whose logical shape is
``[num_blocks, kv_heads, block_size, 2 * head_size]``, but backends read that last dimension two
ways, so the bytes of a token's K sit in different places:

* ``CPU_ATTN`` splits each (block, head) page in two halves, K then V (its ``forward``:
  ``view(..., block_size * 2, -1).chunk(2)``), and its cache-write op stores K transposed,
  ``[head_size, block_size]``, and V as ``[block_size, head_size]`` (measured; the connector
  checks it against the op at start, see ``KvxferdConnector.register_kv_caches``).
* the GPU backends (``FLASH_ATTN``, ``TRITON_ATTN``, ...) split the last dimension:
  ``[..., :head_size]`` is K and the rest is V, token by token.

:func:`kv_planes` returns, per layer, K and V as ``[num_blocks, kv_heads, block_size, head_size]``
strided views over the engine's own memory, so gather and scatter below never depend on the backend.

A kvxferd slot holds one rank's part of a chunk as ``[local_heads, layers, 2, tokens, head_dim]``
(see ``kvxfer_protocol.slot_layout``); that is the layout written and read here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvxfer_client.types import Layout

logger = logging.getLogger(__name__)

# Backends whose per-(block, head) page is K rows then V rows; everything else splits per token.
PLANE_MAJOR_BACKENDS = frozenset({"CPU_ATTN"})


@dataclass(frozen=True)
class Planes:
    """One layer's K and V, each ``[num_blocks, kv_heads, block_size, head_size]`` (views)."""

    k: torch.Tensor
    v: torch.Tensor


def kv_planes(cache: torch.Tensor, backend: str, head_size: int) -> Planes:
    """K and V views of one layer's cache tensor, for the named attention backend."""
    if cache.dim() != 4:
        raise ValueError(f"expected a [blocks, heads, block_size, 2*head_size] cache, got shape {tuple(cache.shape)}")
    blocks, heads, block_size, content = cache.shape
    if content != 2 * head_size:
        raise ValueError(f"last dim {content} is not 2 x head_size {head_size} (MLA caches are not supported)")
    if backend in PLANE_MAJOR_BACKENDS:
        pages = cache.view(blocks, heads, 2, block_size * head_size)
        k = pages[:, :, 0].view(blocks, heads, head_size, block_size).transpose(2, 3)
        return Planes(k, pages[:, :, 1].view(blocks, heads, block_size, head_size))
    return Planes(cache[..., :head_size], cache[..., head_size:])


def token_index(block_ids: Sequence[int], first_block: int, start: int, end: int, block_size: int,
                kernel_block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache block, offset in it) of tokens [start, end).

    ``block_ids`` are the scheduler's blocks, ``block_ids[0]`` holding token ``first_block * block_size``;
    a scheduler block may span several cache (kernel) blocks of ``kernel_block_size`` tokens.
    """
    if block_size % kernel_block_size:
        raise ValueError(f"block size {block_size} is not a multiple of the cache's {kernel_block_size}")
    tokens = torch.arange(start, end, dtype=torch.int64)
    local = tokens // block_size - first_block
    if len(block_ids) == 0 or int(local.min()) < 0 or int(local.max()) >= len(block_ids):
        raise ValueError(f"tokens [{start}, {end}) are outside the {len(block_ids)} blocks given from block {first_block}")
    table = torch.tensor(list(block_ids), dtype=torch.int64)
    per = block_size // kernel_block_size
    kernel_blocks = table[local] * per + (tokens % block_size) // kernel_block_size
    return kernel_blocks.to(device), (tokens % kernel_block_size).to(device)


def slot_view(slot_bytes: torch.Tensor, heads: int, layers: int, tokens: int, head_size: int,
              dtype: torch.dtype) -> torch.Tensor:
    """A uint8 slot as ``[heads, layers, 2, tokens, head_size]`` of the cache's dtype."""
    return slot_bytes.view(dtype).view(heads, layers, 2, tokens, head_size)


def gather(planes: Sequence[Planes], blocks: torch.Tensor, offsets: torch.Tensor, slot: torch.Tensor) -> None:
    """Copies the tokens at (blocks, offsets) of every layer into ``slot`` ([H, L, 2, T, D])."""
    for layer, p in enumerate(planes):
        # Advanced indices on dims 0 and 2 around a slice put the token dim first: [T, H, D].
        slot[:, layer, 0].copy_(p.k[blocks, :, offsets].permute(1, 0, 2))
        slot[:, layer, 1].copy_(p.v[blocks, :, offsets].permute(1, 0, 2))


def scatter(planes: Sequence[Planes], blocks: torch.Tensor, offsets: torch.Tensor, slot: torch.Tensor) -> None:
    """Writes ``slot`` ([H, L, 2, T, D]) into the tokens at (blocks, offsets) of every layer."""
    for layer, p in enumerate(planes):
        p.k[blocks, :, offsets] = slot[:, layer, 0].permute(1, 0, 2).to(p.k.device)
        p.v[blocks, :, offsets] = slot[:, layer, 1].permute(1, 0, 2).to(p.v.device)


@dataclass(frozen=True)
class CacheShape:
    """What a rank's registered caches look like; built from vLLM's config and layers."""

    layers: list[str]
    planes: list[Planes]
    total_kv_heads: int
    local_heads: int
    head_size: int
    block_size: int  # the scheduler's block (what block ids count)
    kernel_block_size: int  # tokens per block of the cache tensors
    dtype: torch.dtype

    def layout(self) -> Layout:
        return Layout(
            num_layers=len(self.layers), total_kv_heads=self.total_kv_heads, head_dim=self.head_size,
            dtype_bytes=torch.empty((), dtype=self.dtype).element_size(), page_size=self.block_size,
            dtype=str(self.dtype).removeprefix("torch."),
        )
