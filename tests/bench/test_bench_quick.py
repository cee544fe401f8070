"""The benchmark commands in --quick mode (what CI can afford): every path produced numbers and
every byte check ran and passed. No performance target is asserted here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvxferd.bench import loopback, rpc

pytestmark = pytest.mark.timeout(420)  # a loaded 2-core machine: ~60-120 s each when quiet


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_loopback_quick_every_path_measured_and_checked(tmp_path: Path) -> None:
    out = tmp_path / "loopback.json"
    png = tmp_path / "loopback.png"
    rc = loopback.main(["--quick", "--json", str(out), "--plot", str(png), "--keep-logs"])
    result = json.loads(out.read_text())
    assert rc == 0, result["failures"]
    ratios = result["ratios"]
    assert ratios["bytes_verified"] is True
    for key in ("kvxferd_over_raw_nixl", "kvxferd_over_raw_nixl_1thread", "raw_nixl_tuned_over_memcpy",
                "p99_over_p50_at_64", "mixed_tp_over_same_tp", "per_token_slowdown"):
        assert _positive(ratios[key]), (key, ratios[key])
    # The tuned pair and the memcpy ceiling ran with the daemons' transfer workers, on pools like theirs.
    workers = result["settings"]["transfer_workers"]
    assert workers >= 2
    tuned = [p for p in result["points"] if p["path"] in ("raw_nixl_tuned", "memcpy")]
    assert {p["path"] for p in tuned} == {"raw_nixl_tuned", "memcpy"} and all(p["threads"] == workers for p in tuned)
    # CPU is read in clock ticks (10 ms): a quick point may show none on one side, and then no ratio.
    cpu = ratios["cpu_s_per_gb"]
    assert set(cpu) == {"raw_nixl", "raw_nixl_tuned", "memcpy", "kvxferd"}, cpu
    assert all(v is not None and v >= 0 for v in cpu.values()), cpu
    assert (ratios["kvxferd_cpu_over_raw_nixl"] is None) == (not (cpu["raw_nixl_tuned"] and cpu["kvxferd"])), ratios
    kvx = [p for p in result["points"] if p["path"] == "kvxferd"]
    # CPU per thread name of both daemons (which part of a daemon spent it).
    assert kvx and all(sum(p["cpu_s_by_thread"]["daemon_prefill"].values()) > 0 for p in kvx)
    if ratios["kvxferd_over_mooncake"] is None:
        assert ratios["kvxferd_over_mooncake_reason"]
    else:
        assert _positive(ratios["kvxferd_over_mooncake"])
    paths = {p["path"] for p in result["points"]}
    assert {"raw_nixl", "raw_nixl_tuned", "memcpy", "kvxferd", "blocking", "kvxferd_tp4to2", "kvxferd_tp1to4",
            "per_token_tp4to2", "per_token_tp1to4"} <= paths
    for p in result["points"]:
        assert p["ok"], p["errors"]
        assert _positive(p["throughput_gbps"]) and _positive(p["latency_ms"]["p50"])
        assert p["stamps_checked"] > 0, p["path"]
    verified = {v["path"] for v in result["verification"]}
    assert {"kvxferd", "kvxferd_tp4to2", "kvxferd_tp1to4", "raw_nixl", "raw_nixl_tuned", "memcpy",
            "per_token_tp4to2"} <= verified
    assert all(v["ok"] and v["bytes_checked"] > 0 for v in result["verification"])
    assert result["machine"]["cores"] >= 1 and result["machine"]["versions"]["nixl"]
    assert png.stat().st_size > 0 and (tmp_path / "loopback-cdf.png").stat().st_size > 0


def test_rpc_quick_reports_latency_and_rates(tmp_path: Path) -> None:
    out = tmp_path / "rpc.json"
    assert rpc.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("unary_p50_us", "unary_p99_us", "batched_chunks_per_s", "streaming_chunks_per_s"):
        assert _positive(result[key]), (key, result[key])
    assert result["errors"] == 0
    assert "stubbed" in result["note"]
    assert result["unary_paced"]["calls"] > 0
    idle = result["idle"]
    assert idle["seconds"] == 2.0 and 0 <= idle["daemon_core_pct"] < 100 and idle["cpu_s"]["_wall_s"] >= 2.0
    assert result["targets"]["idle_daemon_core_pct"]["target"] == "< 1"
