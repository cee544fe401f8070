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
strided views over the engine's own memory; :class:`kvxfer_client.kernels.KVPages` copies them (the
one paged-KV copy the sglang adapter uses too), so the copies never depend on the backend.

A kvxferd slot holds one rank's part of a chunk as ``[local_heads, layers, 2, tokens, head_dim]``
(see ``kvxfer_protocol.slot_layout``); that is the layout written and read here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvxfer_client.kernels import Backend, KVPages
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


def chunk_pages(block_ids: Sequence[int], first_block: int, start: int, end: int, block_size: int,
                kernel_block_size: int) -> tuple[torch.Tensor, int]:
    """Cache (kernel) blocks holding tokens [start, end), from the one holding ``start``, and
    ``start``'s offset in it: what :meth:`KVPages.gather`/``scatter`` take as pages.

    ``block_ids`` are the scheduler's blocks, ``block_ids[0]`` holding token ``first_block * block_size``;
    a scheduler block may span several cache blocks of ``kernel_block_size`` tokens.
    """
    if block_size % kernel_block_size:
        raise ValueError(f"block size {block_size} is not a multiple of the cache's {kernel_block_size}")
    base = first_block * block_size
    if not block_ids or start < base or end <= start or end > base + len(block_ids) * block_size:
        raise ValueError(f"tokens [{start}, {end}) are outside the {len(block_ids)} blocks given from block {first_block}")
    per = block_size // kernel_block_size
    first, last = (start - base) // kernel_block_size, (end - 1 - base) // kernel_block_size
    table = torch.tensor(list(block_ids), dtype=torch.int64)
    # Host ids: the kernels check their bounds without waiting on the engine's stream.
    kernel = (table[:, None] * per + torch.arange(per)).reshape(-1)[first : last + 1]
    return kernel, (start - base) % kernel_block_size


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

    def __post_init__(self) -> None:
        # Checked when the caches are registered: a cache the copy cannot take stops the engine at
        # start, not at its first transfer.
        _ = self.pages

    @functools.cached_property
    def pages(self) -> KVPages:
        """The client's one paged-KV copy over every layer's planes (the sglang adapter's too)."""
        return KVPages([p.k for p in self.planes], [p.v for p in self.planes])

    def copy(self, kind: Literal["gather", "scatter"], slot: torch.Tensor, block_ids: Sequence[int],
             first_block: int, start: int, end: int, kv: KVPages | None = None) -> None:
        """Tokens [start, end) of a request's blocks into a slot ``[H, L, 2, T, D]`` or back;
        ``kv``: a layer group's pages (``pages.layers``) and its part of a group-major slot."""
        ids, offset = chunk_pages(block_ids, first_block, start, end, self.block_size, self.kernel_block_size)
        kv = kv if kv is not None else self.pages
        # Triton on a GPU cache; on CPU it would only run interpreted: the byte-exact torch reference.
        backend: Backend = "auto" if kv.device.type == "cuda" else "torch"
        fn = kv.gather if kind == "gather" else kv.scatter
        fn(ids, end - start, self.kernel_block_size, slot, token_offset=offset, backend=backend)
        # GPU copies are asynchronous; the caller hands the slot to the daemon (or frees it) next.
        kv.settle()

    def layout(self) -> Layout:
        return Layout(
            num_layers=len(self.layers), total_kv_heads=self.total_kv_heads, head_dim=self.head_size,
            dtype_bytes=torch.empty((), dtype=self.dtype).element_size(), page_size=self.block_size,
            dtype=str(self.dtype).removeprefix("torch."),
        )
