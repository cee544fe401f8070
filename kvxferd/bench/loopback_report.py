"""The results of ``kvxferd bench loopback``: ratios between the paths at the headline point,
the targets they are held to, the rich tables and the PNG plots (throughput, latency CDF).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvxferd.bench._common import fmt_bytes, ratio, target_check
from kvxferd.bench.loopback_spec import Settings, tp_path

# Against raw NIXL tuned (the daemon's UCX workers and posting threads, its kind of buffers):
# issue #38's done-when on the 16-core box.
TARGETS: dict[str, tuple[str, float]] = {
    "kvxferd_over_raw_nixl": (">=", 0.95),
    "p99_over_p50_at_64": ("<=", 1.3),
    "kvxferd_over_mooncake": (">=", 4.0),
    "per_token_slowdown": (">=", 10.0),
    "mixed_tp_over_same_tp": (">=", 0.90),
    "kvxferd_cpu_over_raw_nixl": ("<=", 1.2),
}

PATH_LABELS = {
    "kvxferd_same_tp_ref": "kvxferd TP 1→1 (mixed-TP ref)",
    "raw_nixl": "raw NIXL, 1 thread (1 desc/chunk)",
    "raw_nixl_tuned": "raw NIXL, tuned (1 desc/chunk)",
    "memcpy": "memcpy ceiling",
    "kvxferd": "kvxferd TP 1→1",
    "mooncake_tcp": "Mooncake TCP",
    "blocking": "blocking per chunk",
    "per_token": "per-token descriptors",
}


def path_label(path: str) -> str:
    if path in PATH_LABELS:
        return PATH_LABELS[path]
    if path.startswith("kvxferd_tp"):
        p, d = path.removeprefix("kvxferd_tp").split("to")
        return f"kvxferd TP {p}→{d}"
    if path.startswith("per_token_tp"):
        p, d = path.removeprefix("per_token_tp").split("to")
        return f"per-token TP {p}→{d}"
    return path


def _all(points: Sequence[dict[str, Any]], path: str, chunk: int, conc: int) -> list[dict[str, Any]]:
    return [p for p in points if p["path"] == path and p["chunk_tokens"] == chunk and p["in_flight"] == conc]


def _find(points: Sequence[dict[str, Any]], path: str, chunk: int, conc: int) -> dict[str, Any] | None:
    """The point (the first run of a repeated one)."""
    found = _all(points, path, chunk, conc)
    return found[0] if found else None


def _median_gbps(points: Sequence[dict[str, Any]], path: str, chunk: int, conc: int) -> float | None:
    """Median throughput over the runs of a point (one run: its throughput)."""
    return _median([float(p["throughput_gbps"]) for p in _all(points, path, chunk, conc)])


def _cpu_per_gb(p: dict[str, Any]) -> float | None:
    """CPU seconds of every process of the path (both daemons and all engines; raw: initiator and
    target) per GB (1e9 B) of KV the point moved."""
    cpu = sum(v for k, v in p.get("cpu_s", {}).items() if not k.startswith("_"))
    return cpu / (p["bytes"] / 1e9) if p.get("bytes") else None


def _median_cpu_per_gb(points: Sequence[dict[str, Any]], path: str, chunk: int, conc: int) -> float | None:
    return _median([v for p in _all(points, path, chunk, conc) if (v := _cpu_per_gb(p)) is not None])


def _median(values: list[float]) -> float | None:
    vals = sorted(values)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def _gbps(p: dict[str, Any] | None) -> float | None:
    return None if p is None else float(p["throughput_gbps"])


def _mixed_runs(points: Sequence[dict[str, Any]], ptp: int, dtp: int, chunk: int, conc: int) -> list[float]:
    """Per round, mixed-TP throughput / the same-TP run made just before it."""
    return [r for p in _all(points, tp_path(ptp, dtp), chunk, conc)
            if (r := ratio(_gbps(p), p.get("same_tp_ref_gbps"))) is not None]


def _mixed_ratio(points: Sequence[dict[str, Any]], ptp: int, dtp: int, chunk: int, conc: int) -> float | None:
    """Median over the rounds of _mixed_runs."""
    return _median(_mixed_runs(points, ptp, dtp, chunk, conc))


# The baselines kvxferd is measured against (CPU per GB too), and kvxferd itself.
_BASELINES = ("raw_nixl", "raw_nixl_tuned", "memcpy", "kvxferd")


def compute_ratios(s: Settings, points: Sequence[dict[str, Any]], verified: bool,
                   unavailable: dict[str, str]) -> dict[str, Any]:
    ch, hc, tc = s.headline_chunk, s.headline_concurrency, s.tail_concurrency
    kvx = _median_gbps(points, "kvxferd", ch, hc)
    raw = _median_gbps(points, "raw_nixl_tuned", ch, hc)
    raw1 = _median_gbps(points, "raw_nixl", ch, hc)
    moon = _median_gbps(points, "mooncake_tcp", ch, hc)
    tail = _find(points, "kvxferd", ch, tc)
    mixed = {}
    per_token = {}
    for ptp, dtp in s.mixed_tp:
        # Against the same-TP run made just before it (same machine state), see run_sweep.
        mixed[f"{ptp}->{dtp}"] = _mixed_ratio(points, ptp, dtp, ch, hc)
        pt = _median_gbps(points, f"per_token_tp{ptp}to{dtp}", ch, hc)
        per_token[f"{ptp}->{dtp}"] = ratio(_median_gbps(points, tp_path(ptp, dtp), ch, hc), pt)
    cpu = {path: _median_cpu_per_gb(points, path, ch, hc) for path in _BASELINES}
    mixed_vals = [v for v in mixed.values() if v is not None]
    pt_vals = [v for v in per_token.values() if v is not None]
    out: dict[str, Any] = {
        "at": {"chunk_tokens": ch, "chunk_bytes": s.chunk_bytes(ch), "in_flight": hc, "tail_in_flight": tc},
        # The headline: kvxferd against the transport at its best here; the one-thread pair is
        # what an engine that embeds NIXL does.
        "kvxferd_over_raw_nixl": ratio(kvx, raw),
        "kvxferd_over_raw_nixl_1thread": ratio(kvx, raw1),
        "raw_nixl_tuned_over_memcpy": ratio(raw, _median_gbps(points, "memcpy", ch, hc)),
        "kvxferd_over_memcpy": ratio(kvx, _median_gbps(points, "memcpy", ch, hc)),
        "p99_over_p50_at_64": tail["latency_ms"].get("p99_over_p50") if tail else None,
        "kvxferd_over_mooncake": ratio(kvx, moon),
        "mixed_tp_over_same_tp": min(mixed_vals) if mixed_vals else None,
        "per_token_slowdown": min(pt_vals) if pt_vals else None,
        "bytes_verified": verified,
        "mixed_tp_over_same_tp_by_pair": mixed,
        "per_token_slowdown_by_pair": per_token,
        "blocking_over_kvxferd": ratio(_median_gbps(points, "blocking", ch, 1), kvx),
        "cpu_s_per_gb": cpu,
        "kvxferd_cpu_over_raw_nixl": ratio(cpu["kvxferd"], cpu["raw_nixl_tuned"]),
        "kvxferd_cpu_over_raw_nixl_1thread": ratio(cpu["kvxferd"], cpu["raw_nixl"]),
        "headline_runs": {
            path: [round(float(p["throughput_gbps"]), 4) for p in _all(points, path, ch, hc)]
            for path in (*_BASELINES, "mooncake_tcp")
        },
    }
    if out["kvxferd_over_mooncake"] is None:
        out["kvxferd_over_mooncake_reason"] = unavailable.get("mooncake_tcp", "no Mooncake number at this point")
    if tc != 64:
        out["p99_over_p50_at_64_note"] = f"measured at {tc} rooms in flight (--quick or custom sweep)"
    by_chunk: dict[str, Any] = {}
    for c in s.chunk_tokens:
        by_chunk[str(c)] = {
            "kvxferd_over_raw_nixl": ratio(_median_gbps(points, "kvxferd", c, hc),
                                           _median_gbps(points, "raw_nixl_tuned", c, hc)),
            "kvxferd_over_raw_nixl_1thread": ratio(_median_gbps(points, "kvxferd", c, hc),
                                                   _median_gbps(points, "raw_nixl", c, hc)),
            "kvxferd_cpu_over_raw_nixl": ratio(_median_cpu_per_gb(points, "kvxferd", c, hc),
                                               _median_cpu_per_gb(points, "raw_nixl_tuned", c, hc)),
            "kvxferd_cpu_over_raw_nixl_1thread": ratio(_median_cpu_per_gb(points, "kvxferd", c, hc),
                                                       _median_cpu_per_gb(points, "raw_nixl", c, hc)),
            "kvxferd_over_mooncake": ratio(_median_gbps(points, "kvxferd", c, hc),
                                           _median_gbps(points, "mooncake_tcp", c, hc)),
            "p99_over_p50_at_tail": (_find(points, "kvxferd", c, tc) or {}).get("latency_ms", {}).get("p99_over_p50"),
            "mixed_tp_over_same_tp": {f"{p}->{d}": _mixed_ratio(points, p, d, c, hc) for p, d in s.mixed_tp},
            "mixed_tp_runs": {f"{p}->{d}": [round(r, 4) for r in _mixed_runs(points, p, d, c, hc)]
                              for p, d in s.mixed_tp},
        }
    out["by_chunk_tokens"] = by_chunk
    return out


def target_table(ratios: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, (op, limit) in TARGETS.items():
        out[key] = {"value": ratios.get(key), "target": f"{op} {limit:g}", "met": target_check(ratios.get(key), op, limit)}
    return out


def print_results(con: Any, s: Settings, result: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"kvxferd bench loopback — {s.shape.describe()}, rooms of {s.room_tokens} tokens "
                    f"({fmt_bytes(s.room_bytes)})")
    for col in ("path", "chunk", "in flight", "GB/s", "p50 ms", "p90 ms", "p99 ms", "p99/p50", "rooms", "checked"):
        t.add_column(col, justify="left" if col == "path" else "right")
    for p in result["points"]:
        lat = p["latency_ms"]
        t.add_row(
            path_label(p["path"]) + (f" (run {p['repeat'] + 1})" if p.get("repeat") else ""),
            f"{p['chunk_tokens']} tok / {fmt_bytes(p['chunk_bytes'])}", str(p["in_flight"]),
            f"{p['throughput_gbps']:.2f}", f"{lat.get('p50', math.nan):.1f}", f"{lat.get('p90', math.nan):.1f}",
            f"{lat.get('p99', math.nan):.1f}", f"{lat.get('p99_over_p50', math.nan):.2f}", str(p["rooms"]),
            "[green]ok[/]" if p["ok"] else "[red]FAILED[/]",
        )
    con.print(t)
    r = result["ratios"]
    rt = Table(title=f"ratios (chunk {r['at']['chunk_tokens']} tokens = {fmt_bytes(r['at']['chunk_bytes'])}, "
                     f"{r['at']['in_flight']} rooms in flight; raw NIXL tuned = "
                     f"{result['settings']['transfer_workers']} UCX workers and posting threads, the daemons' own)")
    for col in ("ratio", "value", "target", "met", "vs 1-thread raw NIXL"):
        rt.add_column(col)

    def num(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    for key, row in result["targets"].items():
        met = row["met"]
        rt.add_row(key, num(row["value"]), row["target"],
                   "[green]yes[/]" if met else ("[red]no[/]" if met is False else "n/a"),
                   num(r.get(f"{key}_1thread")) if f"{key}_1thread" in r else "")
    for key in ("raw_nixl_tuned_over_memcpy", "kvxferd_over_memcpy"):
        rt.add_row(key, num(r.get(key)), "", "", "")
    rt.add_row("bytes_verified", str(r["bytes_verified"]), "true",
               "[green]yes[/]" if r["bytes_verified"] else "[red]no[/]", "")
    con.print(rt)
    if r.get("kvxferd_over_mooncake_reason"):
        con.print(f"[yellow]Mooncake:[/] {r['kvxferd_over_mooncake_reason']}")


def plot(result: dict[str, Any], png: str, cdf_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    s = result["settings"]
    chunks = s["chunk_tokens"]
    fig, axes = plt.subplots(1, len(chunks), figsize=(5.2 * len(chunks), 5.0), squeeze=False, sharey=True)
    styles = {"raw_nixl": ("black", "o", ":"), "raw_nixl_tuned": ("black", "o", "-"), "memcpy": ("tab:gray", "*", "--"),
              "kvxferd": ("tab:blue", "s", "-"), "mooncake_tcp": ("tab:orange", "^", "-")}
    for ax, chunk in zip(axes[0], chunks, strict=True):
        for path, (color, marker, ls) in styles.items():
            xs = sorted({p["in_flight"] for p in pts if p["path"] == path and p["chunk_tokens"] == chunk})
            ys = [_median_gbps(pts, path, chunk, x) for x in xs]
            if xs:
                label = path_label(path)
                if path in ("raw_nixl_tuned", "memcpy"):
                    label += f", {s['transfer_workers']} threads"
                ax.plot(xs, ys, color=color, marker=marker, ls=ls, label=label)
        extra = [p for p in pts if p["chunk_tokens"] == chunk and (p["path"].startswith(("kvxferd_tp", "per_token")) or p["path"] == "blocking")]
        markers = {"blocking": ("tab:red", "X"), "per_token": ("tab:purple", "v")}
        for p in extra:
            kind = "per_token" if p["path"].startswith("per_token") else p["path"]
            color, marker = markers.get(kind, ("tab:green", "D" if "4to2" in p["path"] else "P"))
            ax.scatter([p["in_flight"]], [p["throughput_gbps"]], color=color, marker=marker, s=60, zorder=5,
                       label=path_label(p["path"]))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({p["in_flight"] for p in pts}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("rooms in flight")
        ax.set_title(f"chunk {chunk} tokens ({fmt_bytes(chunk * s['bytes_per_token'])})")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("KV throughput (GB/s)")
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 5), fontsize=8)
    m = result["machine"]
    rr = result["ratios"]
    fig.suptitle(f"kvxferd bench loopback — {m['cores']} cores, {m['cpu_model']}; {s['transfer_workers']} workers; "
                 f"kvxferd / raw NIXL tuned {_fmt(rr.get('kvxferd_over_raw_nixl'))}, "
                 f"/ 1-thread {_fmt(rr.get('kvxferd_over_raw_nixl_1thread'))}", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)

    r = result["ratios"]["at"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), squeeze=False)
    for ax, conc in zip(axes[0], (r["in_flight"], r["tail_in_flight"]), strict=True):
        for p in pts:
            if (p["chunk_tokens"] != r["chunk_tokens"] or p["in_flight"] != conc or not p.get("latency_samples_ms")
                    or p.get("repeat", 0)):
                continue
            lat = np.sort(np.asarray(p["latency_samples_ms"]))
            frac = np.arange(1, len(lat) + 1) / len(lat)
            ax.step(lat, frac, where="post", label=f"{path_label(p['path'])} (p99/p50 {p['latency_ms']['p99_over_p50']:.2f})")
        ax.set_xlabel("room latency (ms)")
        ax.set_ylabel("fraction of rooms")
        ax.set_title(f"latency CDF, {conc} rooms in flight, chunk {r['chunk_tokens']} tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(cdf_png, dpi=110)
    plt.close(fig)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def cdf_path(png: str) -> str:
    p = Path(png)
    return str(p.with_name(f"{p.stem}-cdf{p.suffix or '.png'}"))
