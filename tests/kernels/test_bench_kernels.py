from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvxfer_client.kernels import triton_available
from kvxferd.bench import kernels as bench

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


def test_tiny_bench_writes_consistent_json(tmp_path: Path) -> None:
    out = tmp_path / "k.json"
    assert bench.main(["--json", str(out), "--tiny", "--repeats", "2", "--inner", "1"]) == 0
    result = json.loads(out.read_text())
    shape = bench.SHAPE_TINY
    n_cases = len(bench.DTYPES) * len(shape.tokens) * len(shape.page_sizes) * 2
    rows = result["rows"]
    assert len(rows) == len(bench.OPS) * n_cases
    assert {r["op"] for r in rows} == set(bench.OPS)
    for name, op in {**bench.RATIO_OPS, **bench.EXTRA_RATIO_OPS}.items():
        ratios = result["ratios"] if name in bench.RATIO_OPS else result["extra_ratios"]
        assert ratios[name] == min(r["ratio"] for r in rows if r["op"] == op)
    for name in bench.RATIO_OPS:
        assert result["meets_targets"][name] == (result["ratios"][name] >= bench.TARGETS[name])
    for r in rows:
        assert r["ms"] > 0 and r["ratio"] == pytest.approx(r["baseline_ms"] / r["ms"])
        assert len(r["samples_ms"]) == 2
    assert set(result["tiles"]) == {"ring_gather", "ring_scatter"}
    assert len(result["tile_sweep"]) == 2 * len(bench.TILE_CANDIDATES)
    assert result["device"]
    assert result["skipped"] == []
    for name in {**bench.RATIO_OPS, **bench.EXTRA_RATIO_OPS}:
        w = result["worst"][name]
        assert w["ratio"] == min(r["ratio"] for r in rows if r["op"] == w["op"])


def test_quick_run_tunes_on_a_case_it_has_buffers_for() -> None:
    """--quick sizes its buffers for the short token count only; tuning on the sweep's longest one
    overran the slot (the GPU crash of issue 12). Several token counts, quick: must run."""
    shape = bench.Shape(layers=2, kv_heads=2, head_dim=16, tokens=(9, 70), page_sizes=(8,))
    result = bench.run(shape, quick=True, repeats=1, inner=1, tune=True, device=bench.torch.device("cpu"))
    assert {r["tokens"] for r in result["rows"]} == {9}
    assert result["tile_sweep"]


def test_budget_skips_the_rest_and_says_so() -> None:
    shape = bench.Shape(layers=1, kv_heads=1, head_dim=16, tokens=(5,), page_sizes=(4,))
    result = bench.run(shape, quick=False, repeats=1, inner=1, tune=False, device=bench.torch.device("cpu"),
                       budget_s=0.0)
    n_cases = len(bench.DTYPES) * 2
    assert len(result["skipped"]) == n_cases - 1  # the first case always runs: a report needs a row
    assert {r["op"] for r in result["rows"]} == set(bench.OPS)


def test_bench_refuses_full_run_without_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.main(["--json", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()
