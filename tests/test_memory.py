from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvxferd.buffers.host_pool import HostPool, RingAllocator
from kvxferd.errors import InvalidArgument


def test_ring_out_of_order_free_coalesces() -> None:
    r = RingAllocator(4096, align=256)
    a, b, c = r.alloc(1000), r.alloc(1000), r.alloc(1000)
    assert (a, b, c) == (0, 1024, 2048)
    assert r.alloc(2000) is None
    r.free(b)  # a stalled slot (a) must not block reuse of b's space
    assert r.alloc(1000) == 1024
    r.free(a)
    r.free(1024)
    r.free(c)
    assert r.used_bytes == 0 and r.watermark().largest_free == 4096
    assert r.watermark().sequence == 4


def test_ring_random_never_overlaps() -> None:
    rng = random.Random(7)
    r = RingAllocator(1 << 20)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.5:
            off = rng.choice(list(live))
            r.free(off)
            del live[off]
        else:
            n = rng.randint(1, 50_000)
            off = r.alloc(n)
            if off is None:
                continue
            assert off + n <= r.size
            for o, ln in live.items():
                assert off + n <= o or o + ln <= off, "overlapping slots"
            live[off] = n
    assert r.slots_held == len(live)


def test_ring_rejects_bad_free() -> None:
    r = RingAllocator(4096)
    with pytest.raises(InvalidArgument):
        r.free(123)
    with pytest.raises(InvalidArgument):
        r.alloc(0)


def test_host_pool_shared_mapping(tmp_path: Path) -> None:
    pool = HostPool(str(tmp_path), 1 << 20, "t", backing="shm_dir")
    try:
        off = pool.allocate_region(8192)
        pool.view(off, 4)[:] = b"abcd"
        with open(pool.path, "rb") as fh:
            fh.seek(off)
            assert fh.read(4) == b"abcd"
        with pytest.raises(InvalidArgument):
            pool.view(pool.size - 2, 4)
    finally:
        pool.close()
    assert not Path(pool.path).exists()
