"""``kvxferd bench loopback``: kvxferd against raw NIXL, per-token descriptors, blocking
per-chunk transfers and Mooncake, on one machine, over the same bytes and chunking.

What runs (all on 127.0.0.1, every process on this machine):

* two daemons (``python -m kvxferd serve``), prefill and decode, each with its own NIXL agent,
* engine processes that use only :mod:`kvxfer_client`: one per prefill rank and one per decode
  rank, for TP 1→1 (same TP) and the mixed pairs 4→2 and 1→4,
* raw NIXL tuned, the headline's baseline (:mod:`~kvxferd.bench.loopback_tuned`): an initiator and a
  target with as many UCX workers and posting threads as the daemons' transfer workers (``--workers``
  sets both), over pools made like the daemons' (huge pages where they get them), one descriptor per
  chunk: the transport at its best here; and the memcpy ceiling (the same threads copying the same
  chunks between two such pools),
* a one-thread raw NIXL initiator/target pair (one UCX worker, plain buffers: what an engine that
  embeds NIXL does; the ratio's second column), and the per-token descriptor path (one descriptor
  per (layer, K/V, token, head slice), as an in-engine mixed-TP fallback posts them),
* a Mooncake Transfer Engine pair over TCP loopback (P2PHANDSHAKE metadata), if installed.

A *room* is one request's KV (``room_tokens`` tokens of the model layout), cut into chunks of
``chunk_tokens``. "N rooms in flight" is a closed loop: N rooms are admitted, each admitted
room's chunks are produced in order (waiting for ring space), and a finished room admits the
next. Room latency runs from admission to the moment the decode side sees the room complete
(raw paths: the last chunk's WRITE completes). Throughput counts KV bytes of the rooms that
finish after the first ``min(N, rooms/4)`` rooms (the pipeline is full by then), over the time
from that point to the last room.

Bytes are checked twice: every timed chunk carries stamps (room, chunk, global head, at the
start and end of every head block; raw paths: a sequence number per descriptor), which the
receiver checks; and a verification pass per path (ragged chunk sizes for kvxferd) compares
every byte with a deterministic pattern. ``ratios.bytes_verified`` is true only if both held
everywhere.

This module is the command (flags, settings, the run's phases, the result file). The rest:
:mod:`~kvxferd.bench.loopback_spec` (shapes, settings, patterns), :mod:`~kvxferd.bench.loopback_setup`
(the processes), :mod:`~kvxferd.bench.loopback_engines` and :mod:`~kvxferd.bench.loopback_raw`
(what runs in them), :mod:`~kvxferd.bench.loopback_paths` (the measured paths and the sweep) and
:mod:`~kvxferd.bench.loopback_report` (ratios, targets, tables, plots).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import asdict, replace
from typing import Any

from kvxfer_protocol.slot_layout import plan
from kvxferd.bench._common import fmt_bytes, machine_info, rounded, write_json
from kvxferd.bench.loopback_paths import LoopbackBench, reference_raw_nixl, run_sweep, sweep_steps
from kvxferd.bench.loopback_report import cdf_path, compute_ratios, plot, print_results, target_table
from kvxferd.bench.loopback_spec import DEFAULT, QUICK, ModelShape, Settings
from kvxferd.config import parse_size


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def build_settings(args: argparse.Namespace) -> Settings:
    s = QUICK if args.quick else DEFAULT
    shape = s.shape
    shape = ModelShape(
        layers=args.layers or shape.layers, kv_heads=args.kv_heads or shape.kv_heads,
        head_dim=args.head_dim or shape.head_dim, dtype_bytes=args.dtype_bytes or shape.dtype_bytes,
        page_size=args.page_size or shape.page_size,
    )
    s = replace(s, shape=shape)
    if args.room_tokens:
        s = replace(s, room_tokens=args.room_tokens)
    if args.chunk_tokens:
        chunks = _ints(args.chunk_tokens)
        s = replace(s, chunk_tokens=chunks, headline_chunk=chunks[len(chunks) // 2] if s.headline_chunk not in chunks else s.headline_chunk)
    if args.concurrency:
        conc = _ints(args.concurrency)
        s = replace(s, concurrency=conc, headline_concurrency=16 if 16 in conc else conc[len(conc) // 2],
                    tail_concurrency=max(conc))
    if args.ring_bytes:
        s = replace(s, ring_bytes=parse_size(args.ring_bytes))
    if args.point_bytes:
        s = replace(s, point_bytes=parse_size(args.point_bytes))
    if args.enqueue_wait:
        s = replace(s, enqueue_wait=True)
    if args.workers is not None:
        if not 1 <= args.workers <= 256:
            raise SystemExit(f"kvxferd bench loopback: --workers must be 1..256, got {args.workers}")
        s = replace(s, workers=args.workers)
    if (shape.head_dim * shape.dtype_bytes) % 8:
        raise SystemExit("kvxferd bench loopback: head_dim x dtype_bytes must be a multiple of 8")
    for c in s.chunk_tokens:
        if s.room_tokens % c:
            raise SystemExit(f"kvxferd bench loopback: room tokens {s.room_tokens} must be a multiple of chunk {c}")
        if s.chunk_bytes(c) > s.ring_bytes // 4:
            raise SystemExit(f"kvxferd bench loopback: a {c}-token chunk ({fmt_bytes(s.chunk_bytes(c))}) "
                             "needs --ring-bytes of at least 4 chunks")
    for p, d in s.mixed_tp:
        plan(p, d, shape.kv_heads)
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxferd bench loopback", description=__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("--json", help="write every figure, the settings and the machine here")
    ap.add_argument("--plot", help="throughput plot (PNG); the latency CDF goes next to it as NAME-cdf.png")
    ap.add_argument("--quick", action="store_true", help="small layout and few rooms (CI): every path, every check")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--dtype-bytes", type=int)
    ap.add_argument("--page-size", type=int)
    ap.add_argument("--room-tokens", type=int, help="tokens per room (default 256; --quick 64)")
    ap.add_argument("--chunk-tokens", help="chunk sizes to sweep, comma-separated (default 16,64,256)")
    ap.add_argument("--concurrency", help="rooms in flight to sweep (default 1,4,16,64)")
    ap.add_argument("--ring-bytes", help="ring per TP pair and side, also the raw window (default 768MiB)")
    ap.add_argument("--point-bytes", help="KV bytes at least per timed point (default 8GiB)")
    ap.add_argument("--enqueue-wait", action="store_true",
                    help="prefill engines wait for each EnqueueChunk's reply (default: they do not; "
                         "PrefillSender.enqueue(wait=False))")
    ap.add_argument("--workers", type=int,
                    help="transfer workers of both daemons, and the UCX workers and posting threads of the tuned "
                         "raw NIXL pair and the memcpy ceiling (default: the daemon's default here, "
                         "Config.transfer_workers)")
    ap.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake pair")
    ap.add_argument("--no-reference", action="store_true", help="skip the kvxferd.bench.raw_nixl cross-check")
    ap.add_argument("--profile", metavar="DIR", help="py-spy both daemons during the headline kvxferd point and the mixed-TP points at the headline chunk")
    ap.add_argument("--keep-logs", action="store_true", help="keep daemon and process logs (kept anyway on failure)")
    ap.add_argument("--layer-parts", type=int, metavar="N",
                    help="issue #37's control-plane stress instead of the sweep: rooms of one ~5 MiB chunk as N layer "
                         "parts, against raw NIXL posting the same parts and both sending whole chunks "
                         "(kvxferd.bench.loopback_layers; honours --quick, --workers, --point-bytes, --json)")
    ap.add_argument("--rounds", type=int, default=3, help="--layer-parts: interleaved rounds of every arm (default 3)")
    args = ap.parse_args(argv)
    if args.layer_parts is not None:
        from kvxferd.bench.loopback_layers import run as layer_run

        return layer_run(args.layer_parts, max(1, args.rounds), args.quick, args.workers or 0,
                         parse_size(args.point_bytes) if args.point_bytes else 0, 16, args.json, args.keep_logs,
                         args.profile)
    s = build_settings(args)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    con = Console() if sys.stdout.isatty() else Console(width=150)
    t0 = time.monotonic()
    bench = LoopbackBench(s, keep_logs=args.keep_logs, profile_dir=args.profile, mooncake=not args.no_mooncake)
    con.print(f"[bold]kvxferd bench loopback[/] — {s.shape.describe()}; rooms of {s.room_tokens} tokens; "
              f"chunks {', '.join(map(str, s.chunk_tokens))} tokens; {', '.join(map(str, s.concurrency))} rooms in flight"
              f"{' (quick)' if s.quick else ''}")
    con.print(f"logs: {bench.workdir}; {bench.workers} transfer workers (daemons, tuned raw NIXL, memcpy)")
    result: dict[str, Any] = {}
    phases: dict[str, float] = {}
    rc = 0
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=con, transient=False) as prog:
            setup = prog.add_task("setting up", total=None)
            ts = time.monotonic()
            bench.start(lambda m: prog.update(setup, description=m))
            phases["start_s"] = time.monotonic() - ts
            ts = time.monotonic()
            bench.verify(lambda m: prog.update(setup, description=m))
            phases["verify_s"] = time.monotonic() - ts
            ts = time.monotonic()
            bench.warm_up(lambda m: prog.update(setup, description=m))
            phases["warm_up_s"] = time.monotonic() - ts
            ts = time.monotonic()
            prog.update(setup, description="set up, verified, warmed up", total=1, completed=1)
            task = prog.add_task("sweep", total=sweep_steps(s, "mooncake" in bench.raw))

            def step(desc: str, advance: bool) -> None:
                if desc:
                    prog.update(task, description=desc)
                if advance and not desc:
                    prog.advance(task)

            run_sweep(bench, step)
            phases["sweep_s"] = time.monotonic() - ts
            prog.update(task, description="sweep done")
    except Exception:
        bench.failures.append(traceback.format_exc())
        con.print_exception()
        rc = 1
    finally:
        bench.stop()
    reference: dict[str, Any] = {"available": False, "reason": "skipped (--quick or --no-reference)"}
    if rc == 0 and not s.quick and not args.no_reference:
        reference = reference_raw_nixl(s)
    verified = (rc == 0 and not bench.failures and all(v["ok"] for v in bench.verification)
                and all(p["ok"] for p in bench.points) and bool(bench.verification))
    ratios = compute_ratios(s, bench.points, verified, bench.unavailable)
    settings = asdict(s)
    settings["bytes_per_token"] = s.shape.bytes_per_token
    settings["room_bytes"] = s.room_bytes
    settings["transfer_workers"] = bench.workers
    result = {
        "bench": "loopback",
        "generated_unix": int(time.time()),
        "runtime_s": round(time.monotonic() - t0, 1),
        "phases_s": {k: round(v, 1) for k, v in phases.items()},
        "machine": machine_info(),
        "settings": settings,
        "method": {
            "throughput": "KV bytes of rooms finishing after the first min(N, rooms/4) rooms, over the time from "
                          "then to the last room; GB/s = 1e9 B/s",
            "latency": "room admission to room complete on the decode side (raw paths: last WRITE complete); "
                       "rooms admitted after the first N only",
            "checks": "timed chunks: stamps at every head block's start and end (raw: per descriptor); "
                      "verification pass: every byte against a pattern (kvxferd with ragged chunk sizes)",
            "engines": "kvxfer_client in processes of their own: a prefill rank acquires, stamps and enqueues "
                       "each chunk " + ("waiting for each reply" if s.enqueue_wait else
                                        "without waiting for its reply (verdicts checked at the end of a run)")
                       + "; a decode rank watches, checks each landed chunk and watermarks per batch of events",
            "daemons": "python -m kvxferd serve with the default config except socket, ephemeral 127.0.0.1 ports, "
                       "host_pool_bytes sized for the rings, metrics off" + (f", workers {s.workers}" if s.workers else ""),
            "baselines": "raw NIXL, tuned (the headline's): as many UCX workers and posting threads as the daemons' "
                         "transfer workers, host pools made like the daemons' (huge pages where they get them); "
                         "raw NIXL, 1 thread: one UCX worker, one posting thread, plain buffers (an engine that "
                         "embeds NIXL); memcpy: the tuned initiator's threads copying the same chunks between two "
                         "such pools",
        },
        "ratios": ratios,
        # What the headline's baseline ran with: the daemons' worker count, buffers like their pools.
        "raw_nixl_tuned": {role: {k: c.info.get(k) for k in ("workers", "backing", "page_size", "huge_bytes")}
                           for role, c in zip(("initiator", "target"), bench.raw.get("nixl_tuned", ()), strict=False)},
        "targets": target_table(ratios),
        "unavailable": bench.unavailable,
        "verification": bench.verification,
        "points": bench.points,
        "raw_nixl_reference": reference,
        "profiles": bench.profiles,
        "failures": [f[-2000:] for f in bench.failures],
    }
    result = rounded(result, 5)
    if bench.points:
        print_results(con, s, result)
    con.print(f"runtime {result['runtime_s']:.0f} s; bytes verified: {ratios['bytes_verified']}")
    if args.json:
        write_json(args.json, result)
        con.print(f"wrote {args.json}")
    if args.plot and bench.points:
        plot(result, args.plot, cdf_path(args.plot))
        con.print(f"wrote {args.plot} and {cdf_path(args.plot)}")
    if bench.failures:
        con.print(f"[red]failures:[/] {len(bench.failures)}; logs kept in {bench.workdir}")
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
