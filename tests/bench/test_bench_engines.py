"""``kvxferd bench engines --quick`` on real vLLM CPU servers: every connector's tokens equal the
reference engine's for every request, and the report is complete. No performance target is
asserted here (the full run's numbers are in bench/results/engines-*)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvxferd.bench import engines
from kvxferd.bench.engines_model import request_mix
from kvxferd.bench.engines_servers import DEFAULT_CONNECTORS, REFERENCE


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_request_mix_is_seeded_spans_the_range_and_never_fills_the_last_block() -> None:
    a = request_mix(40, 64, 3000, 128, 2048, 4, seed=7)
    assert a == request_mix(40, 64, 3000, 128, 2048, 4, seed=7)
    assert a != request_mix(40, 64, 3000, 128, 2048, 4, seed=8)
    lengths = sorted(len(r.prompt) for r in a)
    assert 64 <= lengths[0] <= 66 and lengths[-1] == 3000
    assert all(n % 128 for n in lengths) and len(set(lengths)) > 20
    assert all(3 <= t < 2048 for r in a for t in r.prompt)
    with pytest.raises(ValueError):
        request_mix(4, 100, 50, 128, 2048, 4, seed=0)


@pytest.mark.timeout(1200)  # five engines start at once: ~2-4 min on a loaded 2-core machine
def test_engines_quick_every_connector_gives_the_reference_tokens(tmp_path: Path) -> None:
    out = tmp_path / "engines.json"
    png = tmp_path / "engines.png"
    rc = engines.main(["--quick", "--json", str(out), "--plot", str(png)])
    result = json.loads(out.read_text())
    assert rc == 0, result["failures"]
    summary = result["summary"]
    assert summary["tokens_match_all"] is True and summary["complete"] is True
    # The warm-up pass checked every connector's tokens on every request too.
    assert sorted(c["route"] for c in result["checks"]) == sorted(DEFAULT_CONNECTORS)
    assert all(c["tokens_match"] and c["requests"] == result["settings"]["requests"] for c in result["checks"])
    for route in (*DEFAULT_CONNECTORS, REFERENCE):
        for conc in ("1", "4"):
            row = summary["by_route"][route][conc]
            assert row["tokens_match"] and row["rounds"] == 1, (route, conc)
            for key in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "requests_per_s", "cpu_s_per_request"):
                assert _positive(row[key]), (route, conc, key, row[key])
            assert row["ttft_p99_ms"] >= row["ttft_p50_ms"] and row["e2e_p50_ms"] >= row["ttft_p50_ms"]
            if route == REFERENCE:
                assert row["kv_bytes"] == 0 and row["prefill_leg_p50_ms"] is None
            else:
                assert _positive(row["kv_bytes"]) and _positive(row["prefill_leg_p50_ms"])
    for p in result["points"]:
        assert p["completed"] == p["requests"] and not p["errors"] and p["tokens_match"], p
        assert set(p["cpu_s"]) >= {"engine_reference", "engine_kvxferd-prefill", "daemon_prefill", "proxy", "_wall_s"}
    # The daemons moved the kvxferd route's KV: they spent CPU in its points.
    kvx = [p for p in result["points"] if p["route"] == "kvxferd"]
    assert kvx and all(p["cpu_s"]["daemon_prefill"] + p["cpu_s"]["daemon_decode"] > 0 for p in kvx)
    assert set(summary["targets"]) == {"ttft_p50_over_nixl_at_4", "ttft_p99_over_nixl_at_4",
                                       "requests_per_s_over_nixl_at_4"}
    assert all(_positive(t["value"]) for t in summary["targets"].values())
    assert result["command"].startswith("kvxferd bench engines --quick") and result["commit"] != "unknown"
    assert result["machine"]["cores"] >= 1 and result["vllm_version"]
    assert _positive(result["idle_cpu_s"]["_wall_s"])
    assert png.stat().st_size > 0 and (tmp_path / "engines-cdf.png").stat().st_size > 0
