"""Layer-wise streaming on a GPU (issue #37, docs/design/layerwise.md §5 "same, GPU"):
examples/pd_transformers.py --layerwise --device cuda. Forward hooks on the GPU model copy each
layer's K/V into the rank's GPU pool and gather each layer group into the slot on the GPU; a sender
thread enqueues each group once its CUDA event passed; decode ranks scatter every landed range.
Both stagings: CUDA IPC rings on the GPU (VRAM over NIXL) and pinned host-pool rings (DRAM over
NIXL). Tokens identical to the one-process reference and every byte of every decode rank's KV
bit-identical, bf16 and fp32.

Skipped without CUDA. On a GPU machine: ``bench/device/gpu_layerwise.sh`` (runs this first).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run bench/device/gpu_layerwise.sh)"),
]

LAYERS = 8
GROUP = 3  # 8 layers in groups of 3: the last group is short
# 4 KV heads: at 4->2 and 2->4 some rank's slot holds several heads, where group-major and
# whole-chunk layouts differ (with one head they agree, and a layout mix-up would pass).
MODEL = ["--arch", "llama", "--layers", str(LAYERS), "--heads", "8", "--kv-heads", "4", "--head-dim", "64",
         "--hidden", "512", "--vocab", "2048", "--prompt-tokens", "200", "--chunk-tokens", "64", "--page-size", "16",
         "--new-tokens", "8", "--rooms", "6", "--dtype", "bfloat16,float32", "--device", "cuda",
         "--layerwise", "--layer-group", str(GROUP), "--timeout", "150"]


@pytest.mark.parametrize(("staging", "ptp", "dtp"), [("vram", 4, 2), ("host", 2, 4)])
def test_layerwise_on_gpu_every_byte(staging: str, ptp: int, dtp: int) -> None:
    out = Path(tempfile.mkdtemp(prefix="kvx-lwg-")) / "report.json"
    proc = subprocess.run(
        [sys.executable, "examples/pd_transformers.py", *MODEL, "--staging", staging, "--prefill-tp", str(ptp),
         "--decode-tp", str(dtp), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    printed = proc.stdout + proc.stderr
    assert proc.returncode == 0, printed[-6000:]
    rep = json.loads(out.read_text())
    assert rep["errors"] == [] and rep["ok"] is True, printed[-6000:]
    assert rep["tokens_match"] is True and rep["kv_bit_identical"] is True and rep["max_abs_kv_diff"] == 0
    assert rep["staging_ring"] == ("cuda-ipc" if staging == "vram" else "host-pinned (host)")
    rooms = rep["per_room"]
    assert len(rooms) == rep["rooms"] == 12
    assert all(r["mode"] == "layerwise" and r["tokens"] == r["reference_tokens"] for r in rooms)
    groups = -(-LAYERS // GROUP)
    chunks = sum(r["chunks"] for r in rooms)
    # Every prefill rank gathered every group of every chunk (a sender thread may merge adjacent
    # groups that were ready together into one part); each decode rank copied each group once.
    assert rep["layer_groups_sent"] == ptp * chunks * groups
    assert chunks * ptp <= rep["layer_parts_sent"] <= rep["layer_groups_sent"]
    assert rep["groups_scattered"] == dtp * chunks * groups
    print(f"\nlayerwise {staging} {ptp}->{dtp}: parts {rep['layer_parts_sent']} for {rep['layer_groups_sent']} groups, "
          f"{rep['layer_groups_early']} groups scattered before their chunk completed, wall {rep['wall_s']} s")
