"""One-shot forms of :class:`~kvxfer_client.kernels.kv_copy.KVPages` copies.

Each call validates the layers and builds the per-layer address table again; hot paths should
keep one :class:`KVPages` per engine and call its ``gather``/``scatter`` per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvxfer_client.kernels.kv_copy import DEFAULT_STAGING_BYTES, Backend, KVPages, TileConfig

__all__ = ["gather_kv", "gather_mla", "scatter_kv", "scatter_mla"]


def gather_kv(
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor] | None,
    page_ids: torch.Tensor,
    num_tokens: int,
    page_size: int,
    out: torch.Tensor,
    head_start: int = 0,
    num_heads: int | None = None,
    *,
    token_offset: int = 0,
    backend: Backend = "auto",
    tile: TileConfig | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> torch.Tensor:
    """Copy a chunk's KV from engine pages into a slot, all layers at once.

    One-shot form of :meth:`KVPages.gather` (which hot paths should use).

    Args:
        k_layers: per-layer K ``[num_slots, local_heads, head_dim]``, or the MLA latent.
        v_layers: per-layer V, same shape as K; ``None`` for MLA (one plane).
        page_ids: the chunk's pages in token order (int32/int64, any order,
            on the KV device or CPU), starting with the page that holds its first
            token; extra ids beyond those needed are ignored.
        num_tokens: tokens in the chunk; the first and last page may be partial.
        page_size: slots per page.
        out: contiguous slot of exactly ``slot_nbytes(num_heads, layers, planes,
            num_tokens, head_dim, kv dtype)`` bytes, any dtype; on the KV's GPU,
            in (preferably pinned) host memory, or on CPU for CPU KV.
        head_start, num_heads: local head sub-range to gather (default: all).
        token_offset: where the chunk's first token sits in its first page
            (``token_start % page_size`` for a chunk of a paged sequence).
        backend: ``"auto"``, ``"triton"`` (raise if it cannot run) or ``"torch"``.
        tile: launch shape for the triton kernels (default: tuned per direction).
        staging_bytes: GPU staging for host slots (0: kernel writes host memory directly).

    Returns ``out``. Asynchronous on the current CUDA stream for GPU KV.
    """
    kv = KVPages(k_layers, v_layers, staging_bytes=staging_bytes)
    return kv.gather(
        page_ids,
        num_tokens,
        page_size,
        out,
        head_start,
        num_heads,
        token_offset=token_offset,
        backend=backend,
        tile=tile,
    )


def scatter_kv(
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor] | None,
    page_ids: torch.Tensor,
    num_tokens: int,
    page_size: int,
    src: torch.Tensor,
    head_start: int = 0,
    num_heads: int | None = None,
    *,
    token_offset: int = 0,
    backend: Backend = "auto",
    tile: TileConfig | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> None:
    """Inverse of :func:`gather_kv`: write a slot's tokens into engine pages.

    Only the slots of the chunk's tokens and the heads ``[head_start,
    head_start + num_heads)`` are written; everything else in the KV (the other
    tokens of a partial first or last page included) is untouched.
    """
    kv = KVPages(k_layers, v_layers, staging_bytes=staging_bytes)
    kv.scatter(
        page_ids,
        num_tokens,
        page_size,
        src,
        head_start,
        num_heads,
        token_offset=token_offset,
        backend=backend,
        tile=tile,
    )


def gather_mla(
    latent_layers: Sequence[torch.Tensor],
    page_ids: torch.Tensor,
    num_tokens: int,
    page_size: int,
    out: torch.Tensor,
    *,
    token_offset: int = 0,
    backend: Backend = "auto",
    tile: TileConfig | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> torch.Tensor:
    """MLA gather: one latent buffer per layer, slot ``[1, layers, 1, tokens, width]``."""
    return gather_kv(
        latent_layers,
        None,
        page_ids,
        num_tokens,
        page_size,
        out,
        token_offset=token_offset,
        backend=backend,
        tile=tile,
        staging_bytes=staging_bytes,
    )


def scatter_mla(
    latent_layers: Sequence[torch.Tensor],
    page_ids: torch.Tensor,
    num_tokens: int,
    page_size: int,
    src: torch.Tensor,
    *,
    token_offset: int = 0,
    backend: Backend = "auto",
    tile: TileConfig | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> None:
    """MLA scatter, inverse of :func:`gather_mla`."""
    scatter_kv(
        latent_layers,
        None,
        page_ids,
        num_tokens,
        page_size,
        src,
        token_offset=token_offset,
        backend=backend,
        tile=tile,
        staging_bytes=staging_bytes,
    )
