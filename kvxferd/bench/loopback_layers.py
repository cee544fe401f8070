"""``kvxferd bench loopback --layer-parts N``: the control-plane stress of layer-wise streaming
(issue #37, docs/design/layerwise.md §4-5): rooms of one ~5 MiB chunk sent as N layer parts
(layer group 1), 16 rooms in flight, against raw NIXL posting the same parts.

Arms, interleaved in every round (the order turns each round), all TP 1->1 on one machine:

* ``kvxferd_parts``: engine processes over two daemons; a prefill step sends layer k of every
  ready room in one ``enqueue_layers`` call, k = 0..N-1, then the seals; the decode engine
  watches with ``layer_progress`` (an event per landed range) and checks the complete chunk;
* ``raw_parts``: the tuned raw NIXL pair (as many UCX workers and posting threads as the
  daemons' transfer workers, pools like theirs) posting every part as one WRITE with a
  notification, rooms of N parts in the same closed loop;
* ``kvxferd_whole`` / ``raw_whole``: the same bytes as one chunk a room (no parts), so the
  per-part overhead shows.

Every timed part carries stamps at its start and end (room, layer), checked on the receiving
side; a verification pass per arm compares every byte with a pattern. Reported per arm: GB/s,
parts/s, CPU seconds per GB per process (and per daemon thread name: the per-part-costs method,
µs of CPU a part), the daemons' ``kvxferd_parts_per_write`` (how many queued parts of a room one
WRITE carried) and medians over the rounds; ratios kvxferd / raw on the same parts.
"""

from __future__ import annotations

import math
import statistics
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvxferd.bench._common import fmt_bytes, machine_info, rounded, start_daemon, write_json
from kvxferd.bench.loopback_layer_engines import LAYERS_PREFIX, layer_engine_entry
from kvxferd.bench.loopback_paths import LoopbackBench
from kvxferd.bench.loopback_procs import Child
from kvxferd.bench.loopback_raw import RawSpec
from kvxferd.bench.loopback_setup import EngineGroup
from kvxferd.bench.loopback_spec import ModelShape, Settings
from kvxferd.bench.loopback_tuned import tuned_entry

CHUNK_BYTES = 5 << 20  # issue #37: "80 layers x 5 MiB-chunk rooms"
ARMS = ("kvxferd_parts", "raw_parts", "kvxferd_whole", "raw_whole")


def layer_settings(parts: int, quick: bool, workers: int, point_bytes: int, in_flight: int) -> Settings:
    """N layers of 8 KV heads x 128 x bf16 (4 KiB a token and layer); chunk tokens for ~5 MiB."""
    if not 1 <= parts <= 1024:
        raise SystemExit(f"kvxferd bench loopback: --layer-parts must be 1..1024, got {parts}")
    shape = ModelShape(layers=parts, kv_heads=8, head_dim=128, dtype_bytes=2, page_size=16)
    tokens = max(1, CHUNK_BYTES // shape.bytes_per_token)
    if quick:
        tokens = max(1, (256 << 10) // shape.bytes_per_token)  # CI: a small chunk, every path, every check
    chunk = tokens * shape.bytes_per_token
    ring = max(16 * chunk * 3, 64 << 20) if not quick else max(4 * in_flight * chunk, 16 << 20)
    return Settings(shape=shape, room_tokens=tokens, chunk_tokens=(tokens,), headline_chunk=tokens,
                    concurrency=(in_flight,), headline_concurrency=in_flight, tail_concurrency=in_flight,
                    mixed_tp=(), ring_bytes=-(-ring // (1 << 20)) << 20,
                    point_bytes=point_bytes or ((24 << 20) if quick else (1 << 30)),
                    rooms_per_in_flight=2, headline_repeats=1, timeout_s=90.0 if quick else 240.0,
                    quick=quick, workers=workers)


def _scrape(port: int) -> dict[str, float]:
    """The daemon's layer-part series: parts per write (sum, count, buckets) and part events."""
    out: dict[str, float] = {}
    if port <= 0:
        return out
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith(("kvxferd_parts_per_write", "kvxferd_layer_parts_total")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


class LayerPartsBench(LoopbackBench):
    """One TP 1->1 engine pair (layer-aware engines) and the tuned raw NIXL pair, on two daemons."""

    def __init__(self, settings: Settings, keep_logs: bool = False, profile_dir: str | None = None) -> None:
        super().__init__(settings, keep_logs, profile_dir, mooncake=False)
        self.parts = settings.shape.layers
        self.metric_ports: dict[str, int] = {}
        self.rounds: list[dict[str, Any]] = []

    def start(self, status: Callable[[str], None]) -> None:
        s = self.s
        status("starting daemons and the tuned raw NIXL pair")
        conf: dict[str, object] = {"metrics_port": 0}  # ephemeral: kvxferd_parts_per_write is read per point
        if s.workers:
            conf["workers"] = s.workers
        for role in ("prefill", "decode"):
            self.daemons[role] = start_daemon(self.workdir, role, s.ring_bytes + (64 << 20), conf)
        win = s.ring_bytes
        self.raw["nixl_tuned"] = tuple(  # type: ignore[assignment]
            Child(self.ctx, f"nixl_tuned-{role}", tuned_entry,
                  (role, win, self.workers, str(self.workdir / f"nixl_tuned-{role}.log")))
            for role in ("initiator", "target"))
        for name, d in self.daemons.items():
            d.wait_ready()
            self.metric_ports[name] = int(d.info.get("metrics_port") or 0)
        status("starting engine processes")
        g = EngineGroup(1, 1)
        for role, procs in (("decode", g.decode), ("prefill", g.prefill)):
            d = self.daemons[role]
            procs.append(Child(self.ctx, f"{g.name}-{role}0", layer_engine_entry, (
                role, d.socket, f"{g.name}-{role}", s.shape, s.ring_bytes, str(self.workdir / f"{g.name}-{role}0.log"))))
        self.groups[(1, 1)] = g
        ini, tgt = self.raw["nixl_tuned"]
        tgt.info = tgt.recv(120)
        ini.info = ini.recv(120)
        ini.call("connect", tgt.info, timeout=60)
        for c in [*g.decode, *g.prefill]:
            c.info = c.recv(120)

    # ------------------------------------------------------------------ arms

    def _part_spec(self, tag: str, rooms: int, full: bool) -> RawSpec:
        """The same parts as raw WRITEs: one descriptor (and notification) per layer part."""
        s = self.s
        part = s.chunk_bytes(s.headline_chunk) // self.parts
        return RawSpec(tag=tag, src_slot=part, dst_slot=part, slots=max(s.ring_bytes // part, 1), rooms=rooms,
                       chunks_per_room=self.parts, in_flight=s.headline_concurrency, full=full,
                       timeout_s=s.timeout_s, chunk_bytes=part, head_block=part)

    def arm(self, name: str, rooms: int, full: bool = False, repeat: int = 0, profile: bool = False) -> dict[str, Any]:
        s = self.s
        g = self.groups[(1, 1)]
        n = s.headline_concurrency if not full else min(s.headline_concurrency, rooms)
        mode = "full" if full else "stamp"
        before = {k: _scrape(p) for k, p in self.metric_ports.items()}
        if name == "kvxferd_parts":
            out = self.kvx_run(g, self._plans(rooms, (s.headline_chunk,)), n, LAYERS_PREFIX + mode, profile)
        elif name == "kvxferd_whole":
            out = self.kvx_run(g, self._plans(rooms, (s.headline_chunk,)), n, mode)
        elif name == "raw_parts":
            out = self.raw_run("nixl_tuned", replace(self._part_spec(name, rooms, full), in_flight=n))
        else:
            out = self.raw_run("nixl_tuned", self.raw_spec(name, s.headline_chunk, n, rooms, full))
        if name.startswith("kvxferd"):
            out["metrics"] = {k: _delta(_scrape(p), before[k]) for k, p in self.metric_ports.items()}
        parts = rooms * (self.parts if name.endswith("_parts") else 1)
        out["parts"] = parts
        out["parts_per_s"] = parts / max(out["seconds"], 1e-9)
        gb = out["bytes"] / 1e9
        cpu = {k: v for k, v in out["cpu_s"].items() if not k.startswith("_")}
        out["cpu_s_per_gb"] = sum(cpu.values()) / gb
        out["cpu_s_per_gb_by_process"] = {k: v / gb for k, v in cpu.items()}
        # The per-part-costs method: µs of CPU a part, per process and per daemon thread name.
        out["cpu_us_per_part"] = {k: 1e6 * v / parts for k, v in cpu.items()}
        out["cpu_us_per_part_by_thread"] = {
            d: {t: round(1e6 * v / parts, 2) for t, v in threads.items()}
            for d, threads in out.get("cpu_s_by_thread", {}).items()}
        out.pop("latency_samples_ms", None)
        return self._record(name, s.headline_chunk, n, out, repeat=repeat, layer_parts=self.parts)

    def verify_all(self, status: Callable[[str], None]) -> None:
        """Every byte of every arm against the pattern (more rooms than posting threads)."""
        rooms = max(3, self.workers)
        for name in ARMS:
            status(f"verify every byte: {name}")
            out = self.arm(name, rooms, full=True)
            self.points.remove(out)  # points are the timed rounds only
            self._verified(name, out)

    def warm(self, status: Callable[[str], None]) -> None:
        """Every ring page touched through each path, so first-touch faults stay out of the rounds."""
        if self.s.quick:
            return
        rooms = max(math.ceil(1.5 * self.s.ring_bytes / self.s.room_bytes), 4)
        for name in ARMS:
            status(f"warm-up: {name}")
            self.points.remove(self.arm(name, rooms))

    def run_rounds(self, rounds: int, step: Callable[[str], None]) -> None:
        s = self.s
        rooms = self._rooms_for(s.headline_concurrency, s.point_bytes, s.room_bytes)
        for r in range(rounds):
            order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
            row: dict[str, Any] = {"round": r, "order": list(order), "loadavg_before": _loadavg()}
            for name in order:
                step(f"round {r + 1}/{rounds}: {name}")
                # py-spy (--profile) samples the daemons and engines in the last round's parts arm only.
                p = self.arm(name, rooms, repeat=r, profile=r == rounds - 1 and name == "kvxferd_parts")
                row[name] = {"gbps": p["throughput_gbps"], "parts_per_s": p["parts_per_s"],
                             "cpu_s_per_gb": p["cpu_s_per_gb"], "ok": p["ok"]}
            row["loadavg_after"] = _loadavg()
            self.rounds.append(row)


def _loadavg() -> list[float]:
    with open("/proc/loadavg") as fh:
        return [float(x) for x in fh.read().split()[:3]]


def _median(points: list[dict[str, Any]], arm: str, key: str) -> float | None:
    vals = [p[key] for p in points if p["path"] == arm and p.get(key) is not None]
    return statistics.median(vals) if vals else None


def summary(bench: LayerPartsBench) -> dict[str, Any]:
    """Medians per arm over the rounds and the ratios the issue's target is stated in."""
    pts = bench.points
    med = {a: {k: _median(pts, a, k) for k in ("throughput_gbps", "parts_per_s", "cpu_s_per_gb")} for a in ARMS}
    per_part: dict[str, dict[str, float]] = {}
    for a in ARMS:
        rows = [p["cpu_us_per_part"] for p in pts if p["path"] == a]
        per_part[a] = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0]} if rows else {}
    threads: dict[str, list[float]] = {}
    for p in pts:
        if p["path"] == "kvxferd_parts":
            for d, t in p["cpu_us_per_part_by_thread"].items():
                for name, v in t.items():
                    threads.setdefault(f"{d}/{name}", []).append(v)
    ppw: list[float] = []
    for p in pts:
        m = p.get("metrics", {}).get("prefill", {}) if p["path"] == "kvxferd_parts" else {}
        if m.get("kvxferd_parts_per_write_count"):
            ppw.append(m["kvxferd_parts_per_write_sum"] / m["kvxferd_parts_per_write_count"])

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    kp, rp, kw, rw = (med[a] for a in ARMS)
    return {
        "median": med,
        "cpu_us_per_part_median": per_part,
        "cpu_us_per_part_by_daemon_thread_median": {k: statistics.median(v) for k, v in sorted(threads.items())},
        "parts_per_write_mean_by_round": ppw,
        "kvxferd_over_raw_parts": ratio(kp["throughput_gbps"], rp["throughput_gbps"]),
        "kvxferd_cpu_per_gb_over_raw_parts": ratio(kp["cpu_s_per_gb"], rp["cpu_s_per_gb"]),
        "kvxferd_over_raw_whole": ratio(kw["throughput_gbps"], rw["throughput_gbps"]),
        "kvxferd_cpu_per_gb_over_raw_whole": ratio(kw["cpu_s_per_gb"], rw["cpu_s_per_gb"]),
        "parts_over_whole_kvxferd": ratio(kp["throughput_gbps"], kw["throughput_gbps"]),
        "parts_cpu_per_gb_over_whole_kvxferd": ratio(kp["cpu_s_per_gb"], kw["cpu_s_per_gb"]),
        "parts_over_whole_raw": ratio(rp["throughput_gbps"], rw["throughput_gbps"]),
        "target_16core": "kvxferd_over_raw_parts >= 0.9 and kvxferd_cpu_per_gb_over_raw_parts <= 1.5",
        "bytes_verified": bool(bench.verification) and all(v["ok"] for v in bench.verification)
        and all(p["ok"] for p in pts) and not bench.failures,
    }


def run(parts: int, rounds: int, quick: bool, workers: int, point_bytes: int, in_flight: int, json_path: str | None,
        keep_logs: bool, profile_dir: str | None = None) -> int:
    from rich.console import Console

    s = layer_settings(parts, quick, workers, point_bytes, in_flight)
    con = Console(width=150)
    t0 = time.monotonic()
    bench = LayerPartsBench(s, keep_logs=keep_logs, profile_dir=profile_dir)
    chunk = s.chunk_bytes(s.headline_chunk)
    con.print(f"[bold]kvxferd bench loopback --layer-parts {parts}[/] — {s.shape.describe()}; rooms of one "
              f"{fmt_bytes(chunk)} chunk ({s.headline_chunk} tokens) as {parts} parts of {fmt_bytes(chunk // parts)}; "
              f"{s.headline_concurrency} rooms in flight; {rounds} rounds; {bench.workers} transfer workers; "
              f"load {_loadavg()}")
    rc = 0
    try:
        bench.start(lambda m: con.print(f"  {m}"))
        bench.verify_all(lambda m: con.print(f"  {m}"))
        bench.warm(lambda m: con.print(f"  {m}"))
        bench.run_rounds(rounds, lambda m: con.print(f"  {m}"))
    except Exception:
        bench.failures.append(traceback.format_exc())
        con.print_exception()
        rc = 1
    finally:
        bench.stop()
    res = summary(bench) if bench.points else {"bytes_verified": False}
    result = rounded({
        "bench": "loopback-layer-parts",
        "generated_unix": int(time.time()),
        "runtime_s": round(time.monotonic() - t0, 1),
        "machine": machine_info(),
        "settings": {"layer_parts": parts, "layer_group": 1, "chunk_bytes": chunk, "part_bytes": chunk // parts,
                     "chunk_tokens": s.headline_chunk, "in_flight": s.headline_concurrency, "rounds": rounds,
                     "point_bytes": s.point_bytes, "ring_bytes": s.ring_bytes, "transfer_workers": bench.workers,
                     "shape": s.shape.describe(), "quick": quick},
        "method": __doc__,
        "summary": res,
        "rounds": bench.rounds,
        "verification": bench.verification,
        "points": bench.points,
        "profiles": bench.profiles,
        "failures": [f[-2000:] for f in bench.failures],
    }, 5)
    _print(con, result)
    if json_path:
        write_json(json_path, result)
        con.print(f"wrote {json_path}")
    if bench.failures or not res.get("bytes_verified"):
        con.print(f"[red]failures:[/] {len(bench.failures)}; logs kept in {bench.workdir}")
        rc = 1
    return rc


def _print(con: Any, result: dict[str, Any]) -> None:
    res = result["summary"]
    if "median" not in res:
        return

    def f(v: float | None, d: int = 2) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    con.print("arm              GB/s   parts/s   CPU s/GB   (medians over rounds)")
    for a, m in res["median"].items():
        con.print(f"{a:<15} {f(m['throughput_gbps']):>6} {f(m['parts_per_s'], 0):>9} {f(m['cpu_s_per_gb']):>10}")
    con.print(f"kvxferd/raw on parts: {f(res['kvxferd_over_raw_parts'])} (CPU/GB {f(res['kvxferd_cpu_per_gb_over_raw_parts'])}x); "
              f"whole chunks: {f(res['kvxferd_over_raw_whole'])} (CPU/GB {f(res['kvxferd_cpu_per_gb_over_raw_whole'])}x); "
              f"parts/whole kvxferd {f(res['parts_over_whole_kvxferd'])}, raw {f(res['parts_over_whole_raw'])}")
    con.print(f"parts per WRITE (mean per round): {[round(x, 2) for x in res['parts_per_write_mean_by_round']]}")
    con.print(f"µs CPU a part (kvxferd_parts): {res['cpu_us_per_part_median'].get('kvxferd_parts')}")
    con.print(f"bytes verified: {res['bytes_verified']}; runtime {result['runtime_s']:.0f} s")
