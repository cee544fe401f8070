"""Launch tiles and tensor helpers of :mod:`kvxfer_client.kernels.kv_copy`'s copy paths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvxfer_client.kernels._staged import Kind

INT_BY_WIDTH: dict[int, torch.dtype] = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
VEC_BYTES = 16  # widest global load/store a thread can issue


@dataclass(frozen=True)
class TileConfig:
    """Launch shape; exposed so the benchmark can sweep it."""

    target_tile_bytes: int = 16384
    lp_per_prog: int = 4
    num_warps: int = 4


# From `kvxferd bench kernels` on an H200 (bench/results/kernels-h200.json):
# device-slot shapes (GPU ring, and the staged host path's kernels) are the
# sweep's fastest, though all candidates were within ~2%; the direct host path
# is PCIe-bound and every shape tried measured the same.
_DEFAULT_TILES: dict[tuple[Kind, bool], TileConfig] = {
    ("gather", True): TileConfig(),
    ("scatter", True): TileConfig(),
    ("gather", False): TileConfig(target_tile_bytes=8192, lp_per_prog=1, num_warps=4),
    ("scatter", False): TileConfig(target_tile_bytes=16384, lp_per_prog=1, num_warps=4),
}


def default_tile(kind: Kind, slot_on_host: bool) -> TileConfig:
    return _DEFAULT_TILES[(kind, slot_on_host)]


def as_3d(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() != 3:
        raise ValueError(
            f"{what} must be [num_slots, heads, head_dim] (or [num_slots, width] for MLA), got {tuple(t.shape)}"
        )
    return t


def flat_pages(t: torch.Tensor) -> torch.Tensor:
    """A ``[pages, heads, page_size, D]`` plane as ``[slots, heads, D]`` when its pages are token
    rows of one stride (token-major pages, e.g. ``[blocks, block_size, heads, D]`` permuted): the
    Triton kernels address slots, not (page, head, token). Else the plane itself."""
    pages, heads, size, dim = t.shape
    if t.stride(0) == size * t.stride(2):
        return t.as_strided((pages * size, heads, dim), (t.stride(2), t.stride(1), t.stride(3)))
    return t


def check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def as_int(t: torch.Tensor) -> torch.Tensor:
    # Same-width integer view: byte-exact and supported by index ops for every dtype (fp8 included).
    return t.view(INT_BY_WIDTH[t.element_size()])


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        # Pinned staging makes the upload asynchronous; torch's host allocator
        # keeps the staging block alive until the copy has run.
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
