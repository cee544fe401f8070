"""The byte checks of ``kvxferd bench loopback --layer-parts`` (kvxferd.bench.loopback_layer_engines):
what the decode engine accepts is exactly what the prefill engine wrote for that room and chunk, in
both modes; a stamp or a byte of another room, chunk or block is reported. The bench itself (two
daemons, engines, the raw pair) is too slow for CI: bench/results/layer-parts-2core-*.json."""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.bench.loopback_layer_engines import base_mode, check_blocks, fill_blocks, is_layered

BLOCK, N = 4096, 5


@pytest.mark.parametrize("full", [False, True])
def test_blocks_round_trip_and_every_corruption_is_named(full: bool) -> None:
    buf = bytearray(BLOCK * N)
    fill_blocks(memoryview(buf), 7, 2, BLOCK, N, full)
    assert check_blocks(memoryview(buf), 7, 2, BLOCK, N, full) == []
    assert check_blocks(memoryview(buf), 8, 2, BLOCK, N, full)  # another room's stamps/pattern
    assert check_blocks(memoryview(buf), 7, 3, BLOCK, N, full)  # another chunk
    short = check_blocks(memoryview(buf)[:-1], 7, 2, BLOCK, N, full)
    assert short and "landed" in short[0]
    # A block's last byte (a stamp's in stamp mode) differs: that block and only it is named.
    bad = bytearray(buf)
    bad[3 * BLOCK - 1] ^= 0xFF
    errors = check_blocks(memoryview(bad), 7, 2, BLOCK, N, full)
    assert len(errors) == 1 and "block 2" in errors[0], errors
    if full:  # every byte counts in full mode, not only the stamps
        mid = bytearray(buf)
        mid[BLOCK + BLOCK // 2] ^= 1
        assert check_blocks(memoryview(mid), 7, 2, BLOCK, N, full) == [f"room 7 chunk 2 block 1: byte {BLOCK // 2} differs"]
    # Blocks differ from each other (a part landing at another layer's offset is caught).
    arr = np.frombuffer(bytes(buf), dtype=np.uint8).reshape(N, BLOCK)
    assert not np.array_equal(arr[0], arr[1])


def test_modes() -> None:
    assert is_layered("layers-stamp") and base_mode("layers-full") == "full"
    assert not is_layered("stamp") and base_mode("stamp") == "stamp"
