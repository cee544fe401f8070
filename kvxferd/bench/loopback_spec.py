"""What ``kvxferd bench loopback`` moves: the model shape, the sweep settings, room plans and the
byte patterns and stamps that the receiving side of every path checks.

Engine and raw-pair processes import this module: it imports neither NIXL nor the client.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

from kvxfer_protocol.slot_layout import KVLayout
from kvxferd.bench._common import fmt_bytes


@dataclass(frozen=True)
class ModelShape:
    layers: int = 80
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    page_size: int = 16

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.dtype_bytes

    def kv_layout(self) -> KVLayout:
        return KVLayout(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes, self.page_size)

    def describe(self) -> str:
        return (f"{self.layers} layers x {self.kv_heads} KV heads x head dim {self.head_dim} x "
                f"{self.dtype_bytes} B, page {self.page_size} ({fmt_bytes(self.bytes_per_token)}/token)")


@dataclass(frozen=True)
class Settings:
    shape: ModelShape = ModelShape()
    room_tokens: int = 256
    chunk_tokens: tuple[int, ...] = (16, 64, 256)
    headline_chunk: int = 64
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    headline_concurrency: int = 16
    tail_concurrency: int = 64
    mixed_tp: tuple[tuple[int, int], ...] = ((4, 2), (1, 4))
    ring_bytes: int = 768 << 20  # per TP pair and side, split over the ranks; also the raw window
    # At least this many KV bytes per timed point: 2 GiB lasted ~0.15 s on the 16-core box, where
    # the drain of the last rooms in flight weighed on a point and ratios swung by 10-30 %.
    point_bytes: int = 8 << 30
    mooncake_point_bytes: int = 1 << 30
    per_token_bytes: int = 192 << 20
    rooms_per_in_flight: int = 2  # rooms per point >= (this + 1) x in flight (latency samples)
    # Each chunk size's point at the headline concurrency, and each chunk size's mixed-TP round
    # (its same-TP reference, then each pair), run this often, interleaved; ratios use medians.
    headline_repeats: int = 3
    timeout_s: float = 240.0
    quick: bool = False
    enqueue_wait: bool = False  # prefill engines wait for each EnqueueChunk's verdict
    # Transfer threads of both daemons and posting threads / UCX workers of the tuned raw pair;
    # 0: the daemon's default for this machine (Config.transfer_workers).
    workers: int = 0

    @property
    def room_bytes(self) -> int:
        return self.room_tokens * self.shape.bytes_per_token

    def chunk_bytes(self, chunk_tokens: int) -> int:
        return chunk_tokens * self.shape.bytes_per_token


DEFAULT = Settings()
# --quick: a small layout and few rooms; every path still runs and every byte check still happens.
QUICK = Settings(
    shape=ModelShape(layers=4, kv_heads=8, head_dim=128, dtype_bytes=2, page_size=16),
    room_tokens=64, chunk_tokens=(32,), headline_chunk=32, concurrency=(1, 16, 64),
    ring_bytes=64 << 20, point_bytes=48 << 20, mooncake_point_bytes=24 << 20, per_token_bytes=2 << 20,
    rooms_per_in_flight=2, headline_repeats=1, timeout_s=90.0, quick=True,
)


def tp_path(ptp: int, dtp: int) -> str:
    return "kvxferd" if (ptp, dtp) == (1, 1) else f"kvxferd_tp{ptp}to{dtp}"


@dataclass(frozen=True)
class RoomPlan:
    room: int
    chunks: tuple[int, ...]  # tokens per chunk

    @property
    def num_tokens(self) -> int:
        return sum(self.chunks)


@dataclass(frozen=True)
class RunSpec:
    """One kvxferd run, sent to every engine rank of a TP pair."""

    tag: str
    plans: tuple[RoomPlan, ...]
    in_flight: int
    mode: str  # "stamp" | "full" | "blocking"
    timeout_s: float
    enqueue_wait: bool = False


_MUL = np.uint64(0x9E3779B97F4A7C15)
_HEAD_MAGIC = 0x4B565848
_TAIL_MAGIC = 0x4B565854
STAMP_BYTES = 16


def pattern_words(seed: int, start: int, count: int) -> np.ndarray:
    """A deterministic pseudo-random uint64 sequence: word i is a function of (seed, start + i)."""
    return pattern_at(seed, np.arange(start, start + count, dtype=np.uint64))


def pattern_at(seed: int, index: np.ndarray) -> np.ndarray:
    """The pattern's words at the given word indices."""
    x = index.astype(np.uint64, copy=True)
    x += np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
    x *= _MUL
    x ^= x >> np.uint64(29)
    return x


def pattern_bytes(seed: int, nbytes: int) -> np.ndarray:
    return pattern_words(seed, 0, (nbytes + 7) // 8).view(np.uint8)[:nbytes]


def head_seed(room: int, chunk: int, head: int) -> int:
    h = hashlib.blake2b(b"%d/%d/%d" % (room, chunk, head), digest_size=8).digest()
    return int.from_bytes(h, "little")


def head_stamp(room: int, chunk: int, head: int) -> bytes:
    return struct.pack("<4I", _HEAD_MAGIC, head, room & 0xFFFFFFFF, chunk)


def tail_stamp(room: int, chunk: int, head: int) -> bytes:
    return struct.pack("<4I", _TAIL_MAGIC, head, room & 0xFFFFFFFF, chunk)
