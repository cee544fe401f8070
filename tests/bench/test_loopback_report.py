"""The loopback report's arithmetic on hand-made points: repeated runs give medians, and each
mixed-TP run is set against the same-TP run made just before it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvxferd.bench.loopback_report import compute_ratios
from kvxferd.bench.loopback_spec import DEFAULT, tp_path

S = replace(DEFAULT, chunk_tokens=(16, 64), headline_chunk=64, concurrency=(16,), headline_concurrency=16,
            tail_concurrency=16, mixed_tp=((4, 2),))


def _pt(path: str, chunk: int, gbps: float, repeat: int = 0, **extra: Any) -> dict[str, Any]:
    return {"path": path, "chunk_tokens": chunk, "in_flight": 16, "throughput_gbps": gbps, "repeat": repeat,
            "bytes": 10**9, "cpu_s": {"a": 0.1}, "latency_ms": {"p99_over_p50": 1.1}, **extra}


def test_ratios_are_medians_of_interleaved_runs() -> None:
    points = []
    for chunk in (16, 64):
        # One slow kvxferd run and one slow raw run: neither may decide the ratio.
        for rep, (raw, kvx) in enumerate([(10.0, 2.0), (10.0, 9.0), (4.0, 8.0)]):
            # The tuned pair (the headline's baseline) ran at twice the one-thread pair.
            points += [_pt("raw_nixl", chunk, raw, rep), _pt("raw_nixl_tuned", chunk, 2 * raw, rep),
                       _pt("memcpy", chunk, 4 * raw, rep), _pt("kvxferd", chunk, kvx, rep)]
        # Rounds of (same-TP reference, mixed TP): ratios 0.5, 0.9 and 0.95; the first round's
        # reference ran on a quiet machine, which the old single-run ratio reported alone.
        for rep, (ref, mixed) in enumerate([(20.0, 10.0), (10.0, 9.0), (10.0, 9.5)]):
            points += [_pt("kvxferd_same_tp_ref", chunk, ref, rep),
                       _pt(tp_path(4, 2), chunk, mixed, rep, same_tp_ref_gbps=ref)]
    r = compute_ratios(S, points, True, {})
    assert r["kvxferd_over_raw_nixl"] == 0.4  # median 8.0 over the tuned pair's median 20.0
    assert r["kvxferd_over_raw_nixl_1thread"] == 0.8  # median 8.0 over median 10.0
    assert r["raw_nixl_tuned_over_memcpy"] == 0.5 and r["kvxferd_over_memcpy"] == 0.2
    assert r["by_chunk_tokens"]["16"]["kvxferd_over_raw_nixl"] == 0.4
    assert r["by_chunk_tokens"]["16"]["kvxferd_over_raw_nixl_1thread"] == 0.8
    assert r["mixed_tp_over_same_tp"] == 0.9
    assert r["mixed_tp_over_same_tp_by_pair"] == {"4->2": 0.9}
    assert r["by_chunk_tokens"]["16"]["mixed_tp_over_same_tp"] == {"4->2": 0.9}
    assert r["by_chunk_tokens"]["64"]["mixed_tp_runs"] == {"4->2": [0.5, 0.9, 0.95]}
    assert r["headline_runs"]["kvxferd"] == [2.0, 9.0, 8.0]


def test_a_missing_mixed_run_leaves_no_ratio() -> None:
    points = [_pt("raw_nixl", 64, 10.0), _pt("kvxferd", 64, 9.0)]
    r = compute_ratios(S, points, True, {})
    assert r["mixed_tp_over_same_tp"] is None and r["mixed_tp_over_same_tp_by_pair"] == {"4->2": None}
    assert r["kvxferd_over_raw_nixl_1thread"] == 0.9
    # No tuned run: no headline ratio, rather than one against the one-thread pair.
    assert r["kvxferd_over_raw_nixl"] is None and r["kvxferd_cpu_over_raw_nixl"] is None
