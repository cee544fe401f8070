"""Zero-copy path on a GPU: each engine's whole KV pool is a CUDA tensor the daemon imports by CUDA IPC
and registers with NIXL as VRAM; pages go from the prefill pool straight into the decode pool (runs of
consecutive pages coalesced into one descriptor), with no staging ring and no kernel.

Skipped without CUDA. On a GPU machine: ``bench/device/gpu_e2e.sh``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvxfer_client import DecodeReceiver, Layout, PrefillSender, RoomState
from tests.conftest import DaemonProc
from tests.gpu.conftest import daemon_status, transfer_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: pools imported by CUDA IPC"),
]

PS = 16
DEVICE = "cuda:0"


@pytest.mark.parametrize("mla,ptp,dtp", [(False, 1, 1), (False, 2, 2), (True, 1, 2)], ids=["tp11", "tp22", "mla-tp12"])
def test_zero_copy_gpu_pools(
    gpu_daemons: tuple[DaemonProc, DaemonProc], record: Callable[[dict[str, Any]], None], mla: bool, ptp: int, dtp: int
) -> None:
    pre, dec = gpu_daemons
    # 70B-like per-token shape, fewer layers: 8 KV heads x 128 x bf16 per layer and plane.
    layout = Layout(num_layers=8, total_kv_heads=1 if mla else 8, head_dim=576 if mla else 128, dtype_bytes=2,
                    page_size=PS, mla=mla)
    planes = 1 if mla else 2
    heads_p = 1 if mla else layout.total_kv_heads // ptp
    heads_d = 1 if mla else layout.total_kv_heads // dtp
    slots = 512 * PS
    tok_p = heads_p * layout.head_dim * 2
    tok_d = heads_d * layout.head_dim * 2
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    ppools = [torch.randint(0, 256, (layout.num_layers, planes, slots, tok_p), dtype=torch.uint8, device=DEVICE,
                            generator=gen) for _ in range(ptp)]
    dpools = [torch.full((layout.num_layers, planes, slots, tok_d), 0xAB, dtype=torch.uint8, device=DEVICE)
              for _ in range(dtp)]
    torch.cuda.synchronize()
    txs = [PrefillSender(socket=pre.socket, group="gzp", layout=layout, tp_size=ptp, tp_rank=r, zero_copy=True,
                         ring_bytes=p.numel(), ring_tensor=p) for r, p in enumerate(ppools)]
    rxs = [DecodeReceiver(socket=dec.socket, group="gzd", layout=layout, tp_size=dtp, tp_rank=r, zero_copy=True,
                          ring_bytes=d.numel(), ring_tensor=d) for r, d in enumerate(dpools)]
    try:
        tokens = 64 * PS - 5
        npages = -(-tokens // PS)
        # Long runs (coalesced) and scattered single pages, on both sides.
        ppages = [*range(10, 10 + npages // 2), *range(400, 400 + npages - npages // 2 - 3), 3, 77, 250]
        dpages = [*range(100, 100 + npages - 3), 5, 6, 300]
        assert len(ppages) == len(dpages) == npages
        half = (npages // 2) * PS
        before = transfer_bytes(pre).get("nixl", 0.0)
        for rx in rxs:
            rx.expect(1, pre.peer_address, "gzp", tokens, pages=dpages)
        for tx in txs:
            tx.enqueue(1, 0, 0, half, pages=ppages[: npages // 2])
            tx.enqueue(1, 1, half, tokens - half, pages=ppages[npages // 2:], last=True, aux=b"gz")
        for tx in txs:
            assert tx.wait(1, timeout=60).state is RoomState.SUCCESS
        moved = transfer_bytes(pre).get("nixl", 0.0) - before
        idx_p = torch.tensor([p * PS + o for p in ppages for o in range(PS)][:tokens], device=DEVICE)
        idx_d = torch.tensor([p * PS + o for p in dpages for o in range(PS)][:tokens], device=DEVICE)
        for r, rx in enumerate(rxs):
            st = rx.wait(1, timeout=60)
            assert st.state is RoomState.SUCCESS and st.aux == b"gz"
            d = dpools[r]
            src = ppools[0 if mla else r]  # same TP: rank r holds the same heads; MLA: writer 0 feeds all
            assert torch.equal(d[:, :, idx_d], src[:, :, idx_p]), f"reader {r}: landed pages differ"
            # Every page outside the room stays as it was.
            mask = torch.ones(slots, dtype=torch.bool, device=DEVICE)
            for p in dpages:
                mask[p * PS:(p + 1) * PS] = False
            assert bool((d[:, :, mask] == 0xAB).all()), f"reader {r}: bytes outside the room's pages changed"
            rx.watermark(1, [0, 1])
            rx.release(1)
        for tx in txs:
            tx.release(1)
        # Exactly the room's token slots move: a page's unused tail is not sent (chunks may end
        # mid-page, and the next chunk fills the rest of that page at its own offsets).
        expect = tokens * layout.num_layers * planes * tok_d * dtp
        assert moved == expect, (moved, expect)
        record({"case": f"zero-copy-{'mla' if mla else 'gqa'}-tp{ptp}{dtp}", "path": "zero-copy", "bytes": int(moved),
                "seconds": 0.0, "gb_per_s": 0.0, "byte_exact": True, "prefill_tp": ptp, "decode_tp": dtp, "mla": mla})
    finally:
        for c in [*txs, *rxs]:
            c.close()
    for dmn in (pre, dec):
        assert daemon_status(dmn).slots_held == 0
