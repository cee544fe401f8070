"""KV copy kernels: paged engine KV <-> contiguous staging slots."""

from kvxfer_client.kernels.kv_copy import (
    DEFAULT_STAGING_BYTES,
    Backend,
    KVPages,
    TileConfig,
    default_tile,
    slot_nbytes,
    slot_shape,
    triton_available,
)
from kvxfer_client.kernels.oneshot import gather_kv, gather_mla, scatter_kv, scatter_mla

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "Backend",
    "KVPages",
    "TileConfig",
    "default_tile",
    "gather_kv",
    "gather_mla",
    "scatter_kv",
    "scatter_mla",
    "slot_nbytes",
    "slot_shape",
    "triton_available",
]
