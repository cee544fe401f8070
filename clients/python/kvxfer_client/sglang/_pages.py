"""sglang's token-to-KV pool as byte tensors, and copies between its pages and kvxferd slots.

sglang hands a transfer backend raw buffers (``KVArgs``): for an MHA pool, one buffer per layer
for K, then one per layer for V, each ``[slots, local_heads, head_dim]`` (NHD rows), one page
being ``page_size`` consecutive slots (``kv_item_lens`` = bytes of one page). For MLA there is one
latent buffer per layer. Pages move whole, as sglang's own backends move them.

A kvxferd slot holds one rank's part of a chunk as ``[local_heads, layers, planes, tokens, bytes of
one head]``; everything here is dtype-agnostic bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvxfer_client.kernels import Backend, KVPages

logger = logging.getLogger(__name__)


class _Interface:
    """A raw buffer torch can wrap without copying (host or CUDA memory)."""

    def __init__(self, ptr: int, nbytes: int, cuda: bool) -> None:
        desc = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}
        if cuda:
            self.__cuda_array_interface__ = desc
        else:
            self.__array_interface__ = desc


def wrap(ptr: int, nbytes: int, device: str = "cpu") -> torch.Tensor:
    """uint8 tensor over ``nbytes`` at ``ptr`` in this process (the engine owns the memory)."""
    if device.startswith("cuda"):
        return torch.as_tensor(_Interface(ptr, nbytes, True), device=device)
    import numpy as np

    return torch.from_numpy(np.asarray(_Interface(ptr, nbytes, False)))


class PagedBuffers:
    """Per (plane, layer) byte views ``[pages, page_size, heads, head_bytes]`` of sglang's pool."""

    def __init__(self, ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int], planes: int,
                 page_size: int, heads: int, device: str = "cpu") -> None:
        if len(ptrs) % planes or not ptrs:
            raise ValueError(f"{len(ptrs)} KV buffers do not split into {planes} planes")
        self.layers = len(ptrs) // planes
        self.planes = planes
        self.page_size, self.heads = page_size, heads
        item = item_lens[0]
        if any(i != item for i in item_lens) or item % (page_size * heads):
            raise ValueError(f"page bytes {list(item_lens)} do not fit pages of {page_size} x {heads} heads")
        self.head_bytes = item // (page_size * heads)
        self.views: list[list[torch.Tensor]] = []
        for p in range(planes):
            row = []
            for layer in range(self.layers):
                i = p * self.layers + layer
                pages = lens[i] // item
                row.append(wrap(ptrs[i], pages * item, device).view(pages, page_size, heads, self.head_bytes))
            self.views.append(row)
        # The client's one paged-KV copy (kvxfer_client.kernels, what `kvxferd bench kernels`
        # measures): one Triton launch for every layer and plane on a GPU pool; its byte-exact torch
        # reference on CPU pools, where Triton would only run interpreted.
        slots = [[v.view(-1, heads, self.head_bytes) for v in row] for row in self.views]
        self.kv = KVPages(slots[0], slots[1] if planes == 2 else None)
        self._backend: Backend = "auto" if self.kv.device.type == "cuda" else "torch"

    def slot(self, flat: torch.Tensor, tokens: int) -> torch.Tensor:
        return flat.view(self.heads, self.layers, self.planes, tokens, self.head_bytes)

    def gather(self, pages: Sequence[int], dst: torch.Tensor) -> None:
        """Pages (every layer and plane) into a slot ``[H, L, planes, T, head_bytes]``."""
        self.kv.gather(self._ids(pages), len(pages) * self.page_size, self.page_size, dst, backend=self._backend)
        # GPU copies are asynchronous; the slot goes to the daemon right after.
        self.kv.settle()

    def scatter(self, pages: Sequence[int], src: torch.Tensor) -> None:
        self.kv.scatter(self._ids(pages), len(pages) * self.page_size, self.page_size, src, backend=self._backend)
        # GPU copies are asynchronous; the slot is watermarked (freed) right after.
        self.kv.settle()

    @staticmethod
    def _ids(pages: Sequence[int]) -> torch.Tensor:
        # Host ids: the kernels check their bounds without waiting on the engine's stream.
        return torch.as_tensor(list(pages), dtype=torch.int64)


def dtype_bytes(kv_cache_dtype_str: str, fallback: Any = None) -> int:
    """Element size for sglang's KV dtype names (``auto`` takes the fallback torch dtype)."""
    name = kv_cache_dtype_str.lower().removeprefix("torch.")
    if name.startswith(("fp8", "float8")):
        return 1
    if name in ("bfloat16", "bf16", "float16", "fp16", "half"):
        return 2
    if name in ("float32", "fp32", "float"):
        return 4
    if fallback is not None:
        return int(torch.empty((), dtype=fallback).element_size())
    raise ValueError(f"unknown KV cache dtype {kv_cache_dtype_str!r}")
