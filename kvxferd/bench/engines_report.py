"""The results of ``kvxferd bench engines``: medians over rounds per route and concurrency, the
issue's targets (kvxferd against vLLM's NixlConnector), the rich tables and the PNG plots.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvxferd.bench._common import fmt_bytes, percentile, ratio, target_check
from kvxferd.bench.engines_servers import LABELS, REFERENCE, pair_of

# kvxferd against NixlConnector (pull) at these concurrencies: (figure, operator, limit on kvxferd / nixl).
TARGET_CONCURRENCY = (4, 16)
TARGETS: dict[str, tuple[str, str, float]] = {
    "ttft_p50_over_nixl": ("ttft_p50_ms", "<=", 0.9),
    "ttft_p99_over_nixl": ("ttft_p99_ms", "<=", 1.0),
    "requests_per_s_over_nixl": ("requests_per_s", ">=", 1.0),
}
FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "requests_per_s", "prefill_leg_p50_ms",
           "cpu_s_per_request")


def _median(values: Sequence[float | None]) -> float | None:
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return statistics.median(xs) if xs else None


def own_processes(route: str, names: Sequence[str]) -> list[str]:
    """The process trees that serve `route`: its engines, its daemons (kvxferd), the proxy."""
    if route == REFERENCE:
        mine = [f"engine_{REFERENCE}"]
    else:
        pair = pair_of(route)
        mine = [f"engine_{pair}-prefill", f"engine_{pair}-decode"]
        if pair == "kvxferd":
            mine += [n for n in names if n.startswith("daemon_")]
    return [n for n in names if n in mine or n == "proxy"]


def point_figures(p: dict[str, Any]) -> dict[str, float | None]:
    cpu = p.get("cpu_s", {})
    own = sum(cpu[n] for n in own_processes(p["route"], list(cpu)))
    return {
        "ttft_p50_ms": percentile(p["ttft_ms"], 50) if p["ttft_ms"] else None,
        "ttft_p99_ms": percentile(p["ttft_ms"], 99) if p["ttft_ms"] else None,
        "e2e_p50_ms": percentile(p["e2e_ms"], 50) if p["e2e_ms"] else None,
        "e2e_p99_ms": percentile(p["e2e_ms"], 99) if p["e2e_ms"] else None,
        "requests_per_s": p["requests_per_s"],
        "prefill_leg_p50_ms": percentile(p["prefill_leg_ms"], 50) if p["prefill_leg_ms"] else None,
        "cpu_s_per_request": own / p["completed"] if p["completed"] else None,
    }


def summarize(s: Any, points: Sequence[dict[str, Any]], checks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    routes = [*s.connectors, REFERENCE]
    by: dict[str, dict[str, Any]] = {}
    complete = bool(points)
    for route in routes:
        by[route] = {}
        for conc in s.concurrency:
            mine = [p for p in points if p["route"] == route and p["concurrency"] == conc]
            figs = [point_figures(p) for p in mine]
            row: dict[str, Any] = {k: _median([f[k] for f in figs]) for k in FIGURES}
            cpu_names = sorted({n for p in mine for n in p["cpu_s"]})
            row["cpu_s"] = {n: _median([p["cpu_s"].get(n) for p in mine]) for n in cpu_names}
            row["own_processes"] = own_processes(route, cpu_names)
            row["kv_bytes"] = mine[0]["kv_bytes"] if mine else None
            row["rounds"] = len(mine)
            row["runs"] = {k: [f[k] for f in figs] for k in ("ttft_p50_ms", "ttft_p99_ms", "requests_per_s")}
            row["tokens_match"] = bool(mine) and all(p["tokens_match"] for p in mine)
            by[route][str(conc)] = row
            needed = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "requests_per_s", "cpu_s_per_request")
            complete = complete and len(mine) == s.rounds and all(p["completed"] == p["requests"] for p in mine) \
                and all(row[k] is not None for k in needed) \
                and (route == REFERENCE or row["prefill_leg_p50_ms"] is not None)
    # The targets against every NixlConnector route run (vLLM's defaults, and tuned), so
    # the strongest baseline is judged too; the push variant gets ratios only.
    targets: dict[str, Any] = {}
    for base in ("nixl", "nixl_1t"):
        if "kvxferd" not in s.connectors or base not in s.connectors:
            continue
        for conc in TARGET_CONCURRENCY:
            if conc not in s.concurrency:
                continue
            for key, (fig, op, limit) in TARGETS.items():
                value = ratio(by["kvxferd"][str(conc)][fig], by[base][str(conc)][fig])
                name = key if base == "nixl" else key.replace("_over_nixl", f"_over_{base}")
                targets[f"{name}_at_{conc}"] = {"value": value, "target": f"{op} {limit:g}",
                                                "met": target_check(value, op, limit)}
    vs_push = {}
    if "kvxferd" in s.connectors and "nixl_push" in s.connectors:
        for conc in s.concurrency:
            vs_push[str(conc)] = {fig: ratio(by["kvxferd"][str(conc)][fig], by["nixl_push"][str(conc)][fig])
                                  for fig in ("ttft_p50_ms", "ttft_p99_ms", "requests_per_s", "cpu_s_per_request")}
    tokens_ok = bool(checks) and all(c["tokens_match"] for c in checks) and bool(points) \
        and all(p["tokens_match"] for p in points)
    return {"by_route": by, "targets": targets, "kvxferd_over_nixl_push": vs_push, "complete": complete,
            "tokens_match_all": tokens_ok}


def _fmt(v: Any, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def print_results(con: Any, result: dict[str, Any]) -> None:
    from rich.table import Table

    s = result["settings"]
    summ = result["summary"]
    t = Table(title=f"kvxferd bench engines — medians of {s['rounds']} round(s), {s['requests']} requests of "
                    f"{s['min_prompt']}-{s['max_prompt']} tokens, {s['new_tokens']} new")
    for col in ("route", "in flight", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 ms", "e2e p99 ms", "req/s",
                "prefill leg p50 ms", "KV moved", "CPU s/req (own)", "tokens = ref"):
        t.add_column(col, justify="left" if col == "route" else "right")
    for route, rows in summ["by_route"].items():
        for conc, row in rows.items():
            t.add_row(LABELS.get(route, route), conc, _fmt(row["ttft_p50_ms"]), _fmt(row["ttft_p99_ms"]),
                      _fmt(row["e2e_p50_ms"]), _fmt(row["e2e_p99_ms"]), _fmt(row["requests_per_s"], 2),
                      _fmt(row["prefill_leg_p50_ms"]), fmt_bytes(row["kv_bytes"] or 0), _fmt(row["cpu_s_per_request"], 3),
                      "[green]yes[/]" if row["tokens_match"] else "[red]NO[/]")
    con.print(t)
    if summ["targets"]:
        tt = Table(title="targets: KvxferdConnector / each NixlConnector route (nixl: vLLM defaults)")
        for col in ("ratio", "value", "target", "met"):
            tt.add_column(col)
        for key, row in summ["targets"].items():
            met = row["met"]
            tt.add_row(key, _fmt(row["value"], 2), row["target"],
                       "[green]yes[/]" if met else ("[red]no[/]" if met is False else "n/a"))
        con.print(tt)
    idle = result.get("idle_cpu_s") or {}
    wall = idle.get("_wall_s")
    if wall:
        con.print("idle CPU, % of a core: " + ", ".join(
            f"{k.removeprefix('engine_')} {100 * v / wall:.0f}" for k, v in idle.items() if not k.startswith("_")))


def cdf_png(png: str) -> str:
    p = Path(png)
    return str(p.with_name(f"{p.stem}-cdf{p.suffix or '.png'}"))


def plot(result: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = result["summary"]["by_route"]
    concs = [int(c) for c in result["settings"]["concurrency"]]
    colors = {"kvxferd": "tab:blue", "nixl": "black", "nixl_1t": "tab:gray", "nixl_push": "tab:orange",
              REFERENCE: "tab:green"}
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    panels = (("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p99_ms", "TTFT p99 (ms)"), ("requests_per_s", "requests/s"),
              ("cpu_s_per_request", "CPU s per request (route's processes)"))
    for ax, (fig_key, title) in zip(axes, panels, strict=True):
        for route, rows in summ.items():
            ys = [rows[str(c)][fig_key] for c in concs]
            ax.plot(concs, [math.nan if y is None else y for y in ys], marker="o", color=colors.get(route),
                    label=LABELS.get(route, route))
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs)
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("requests in flight")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"kvxferd bench engines — vLLM {result.get('vllm_version') or '?'} CPU, "
                 f"{m['cores']} cores, {m['cpu_model']}, commit {result['commit'][:12]}", fontsize=10)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)

    top = max(concs)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for route in summ:
        samples = sorted(x for p in result["points"] if p["route"] == route and p["concurrency"] == top
                         for x in p["ttft_ms"])
        if samples:
            ax.step(samples, [(i + 1) / len(samples) for i in range(len(samples))], where="post",
                    color=colors.get(route), label=LABELS.get(route, route))
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF, {top} in flight, every round")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(cdf_png(png), dpi=110)
    plt.close(fig)
