"""Zero-copy path: pages go straight from the prefill KV pool to the decode KV pool."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvxfer_client import DecodeReceiver, KvxferError, Layout, PrefillSender, RoomState
from kvxferd.datapath.write_plan import coalesce, slot_runs

PS = 16


def pool_view(client: Any, layout: Layout, heads: int) -> np.ndarray:
    """The engine's pool as [layers, planes, slots, bytes per token slot], mapped in place."""
    planes = 1 if layout.mla else 2
    tok = heads * layout.head_dim * layout.dtype_bytes
    raw = np.frombuffer(client.view(0, client.reg.ring_bytes), dtype=np.uint8)
    return raw.reshape(layout.num_layers, planes, -1, tok)


def test_coalesce_runs() -> None:
    assert coalesce([4, 5, 6, 9, 10], [0, 1, 3, 4, 5]) == [(4, 0, 2), (6, 3, 1), (9, 4, 2)]
    assert coalesce([], []) == []


def test_slot_runs_cover_exactly_the_chunk_tokens() -> None:
    # Pages of 4; tokens [3, 3 + 7) of the page list [5, 6, 2]: slot 23, then 24..27, then 8..9.
    assert slot_runs([5, 6, 2], [1, 2, 9], 3, 7, 4) == [(23, 7, 5), (8, 36, 2)]
    assert slot_runs([5], [1], 1, 2, 4) == [(21, 5, 2)]
    assert slot_runs([0, 1], [4, 5], 0, 8, 4) == [(0, 16, 8)]


def test_layout_chunk_pages() -> None:
    layout = Layout(num_layers=1, total_kv_heads=1, head_dim=8, dtype_bytes=2, page_size=16)
    assert layout.chunk_pages([7, 3, 9, 1], 40, 8) == ([9], 8)
    assert layout.chunk_pages([7, 3, 9, 1], 40, 10) == ([9, 1], 8)
    assert layout.chunk_pages([7, 3, 9, 1], 12, 30) == ([7, 3, 9], 12)
    assert layout.chunk_pages([7, 3, 9, 1], 0, 64) == ([7, 3, 9, 1], 0)
    with pytest.raises(ValueError, match="need 5 pages"):
        layout.chunk_pages([7, 3, 9, 1], 60, 10)


# split: where chunk 1 starts; 40 is mid-page (page 2 is filled by both chunks), 48 a page boundary.
@pytest.mark.parametrize("mla,ptp,dtp,split", [(False, 1, 1, 40), (False, 2, 2, 40), (True, 1, 2, 48)])
def test_zero_copy_pages_byte_exact(daemons: Any, mla: bool, ptp: int, dtp: int, split: int) -> None:
    pre = daemons("zpre")
    dec = daemons("zdec")
    layout = Layout(num_layers=3, total_kv_heads=1 if mla else 4, head_dim=16, dtype_bytes=2, page_size=PS, mla=mla)
    heads_p = 1 if mla else layout.total_kv_heads // ptp
    heads_d = 1 if mla else layout.total_kv_heads // dtp
    planes = 1 if mla else 2
    slots = 32 * PS
    rng = np.random.default_rng(5)
    txs = [PrefillSender(socket=pre.socket, group="zp", layout=layout, tp_size=ptp, tp_rank=r, zero_copy=True,
                         ring_bytes=layout.num_layers * planes * slots * heads_p * layout.head_dim * 2)
           for r in range(ptp)]
    rxs = [DecodeReceiver(socket=dec.socket, group="zd", layout=layout, tp_size=dtp, tp_rank=r, zero_copy=True,
                          ring_bytes=layout.num_layers * planes * slots * heads_d * layout.head_dim * 2)
           for r in range(dtp)]
    try:
        ppools = [pool_view(t, layout, heads_p) for t in txs]
        dpools = [pool_view(r, layout, heads_d) for r in rxs]
        for p in ppools:
            p[:] = rng.integers(0, 256, p.shape, dtype=np.uint8)
        for d in dpools:
            d[:] = 0xAB  # guard: pages outside the room must stay untouched
        tokens = 100
        npages = -(-tokens // PS)
        ppages = [3, 4, 5, 11, 0, 1, 20]  # runs of 3, 1 and 2 pages, then 1
        dpages = [7, 8, 2, 3, 4, 30, 31]
        assert len(ppages) == len(dpages) == npages
        for rx in rxs:
            rx.expect(1, pre.peer_address, "zp", tokens, pages=dpages)
        for tx in txs:
            # Each chunk names the pages its tokens touch, from the one holding its first token.
            tx.enqueue(1, 0, 0, split, pages=layout.chunk_pages(ppages, 0, split)[0])
            tx.enqueue(1, 1, split, tokens - split, pages=layout.chunk_pages(ppages, split, tokens - split)[0],
                       last=True, aux=b"zc")
        for tx in txs:
            assert tx.wait(1, timeout=30).state is RoomState.SUCCESS
        for r, rx in enumerate(rxs):
            st = rx.wait(1, timeout=30)
            assert st.aux == b"zc"
            assert sorted(c.chunk_id for c in st.landed) == [0, 1]
            d = dpools[r]
            # Which prefill rank and head range feeds this reader (same TP: rank r; MLA: writer 0).
            src = ppools[0 if mla else r]
            for t in range(tokens):
                pi, off = divmod(t, PS)
                assert np.array_equal(d[:, :, dpages[pi] * PS + off], src[:, :, ppages[pi] * PS + off]), (r, t)
            untouched = [pg for pg in range(slots // PS) if pg not in dpages]
            for pg in untouched:
                assert (d[:, :, pg * PS:(pg + 1) * PS] == 0xAB).all(), f"page {pg} outside the room was written"
            rx.watermark(1, [0, 1])
            rx.release(1)
        for tx in txs:
            tx.release(1)
    finally:
        for c in [*txs, *rxs]:
            c.close()


def test_zero_copy_rejects_bad_pages(daemons: Any) -> None:
    pre = daemons("zbad")
    layout = Layout(num_layers=1, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=PS)
    with PrefillSender(socket=pre.socket, group="zb", layout=layout, zero_copy=True,
                       ring_bytes=1 * 2 * 64 * 2 * 16 * 2) as tx:
        for pages, tstart, why in (([4, 0], 0, "outside the engine's pool"), ([0, 0], 0, "twice"),
                                   ([0], 0, "need 2 pages"), ([0], 13, "need 3 pages")):
            with pytest.raises(KvxferError) as ei:
                tx.enqueue(1, 0, tstart, 20, pages=pages)
            assert ei.value.code.name == "INVALID_ARGUMENT" and why in ei.value.message, ei.value.message
        with pytest.raises(KvxferError) as ei:
            tx.acquire(4)
        assert ei.value.code.name == "FAILED_PRECONDITION"
        assert tx.status().rooms_by_state == {}
    with pytest.raises(KvxferError) as ei:
        PrefillSender(socket=pre.socket, group="zb2", layout=layout, zero_copy=True, ring_bytes=1000)
    assert "whole number of pages" in ei.value.message
