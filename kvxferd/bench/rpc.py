"""``kvxferd bench rpc``: control-plane load on the engine API's Unix socket.

One daemon (``python -m kvxferd serve``, default config apart from socket, ports and pool size)
and one prefill engine using :mod:`kvxfer_client` in this process. Measured:

* unary ``EnqueueChunk`` latency (p50/p90/p99/max) at a fixed offered rate (default 1000/s,
  open loop: call i is sent at t0 + i/rate as a gRPC future whether or not earlier calls have
  answered; latency is reply minus send; the lateness of each send and the latency from the
  schedule are reported too, so a client that fell behind cannot hide it),
* unary ``EnqueueChunk`` back to back (closed loop, one outstanding call): the most one caller gets,
* the sustained chunk-enqueue rate with the batched form (``EnqueueChunks``, batches of
  64/256/1024) and the streaming form (``EnqueueStream``, one bidirectional stream).

**The data plane is stubbed out in this mode only**: the rooms are never bootstrapped (no decode
side expects them), so every accepted chunk is validated, owned by the daemon and parked by the
scheduler on its room's bootstrap, exactly as a real chunk that arrives before its decode side;
no AllocSlot, no NIXL. The daemon runs with its default configuration; nothing in it knows about
this bench. Slots are acquired before each timed phase (AcquireSlot is unary only) and the rooms
released after it, so each timed phase measures enqueues alone.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from kvxferd.bench._common import (
    CpuMeter,
    Daemon,
    latency_summary,
    machine_info,
    remove_tree,
    rounded,
    short_tmpdir,
    start_daemon,
    target_check,
    write_json,
)

STUB_NOTE = ("data plane stubbed out (this bench only): rooms are never bootstrapped, so accepted chunks "
             "are validated and parked by the scheduler; no AllocSlot, no NIXL. Daemon config is the default.")

# A long engine lease: on a loaded machine the keep-alive thread may starve for seconds while
# the bench saturates the daemon; a lapsed lease would end the run, not measure anything.
LEASE_MS = 120_000

TARGETS: dict[str, tuple[str, float]] = {
    "unary_p50_us": ("<=", 300.0),
    "unary_p99_us": ("<=", 1000.0),
    "batched_chunks_per_s": (">=", 20_000.0),
    "idle_daemon_core_pct": ("<", 1.0),
}


@dataclass(frozen=True)
class RpcSettings:
    rate: float = 1000.0
    unary_seconds: float = 10.0
    closed_loop_calls: int = 3000
    batch_sizes: tuple[int, ...] = (64, 256, 1024)
    headline_batch: int = 256
    batched_chunks: int = 20_000
    stream_chunks: int = 20_000
    chunks_per_room: int = 8
    ring_bytes: int = 128 << 20
    # An idle daemon (this bench's engine registered and watching, no rooms) is metered this long.
    idle_seconds: float = 10.0
    quick: bool = False


DEFAULT = RpcSettings()
QUICK = RpcSettings(unary_seconds=1.0, closed_loop_calls=500, batch_sizes=(256,), batched_chunks=3000,
                    stream_chunks=3000, idle_seconds=2.0, quick=True)


class RpcBench:
    def __init__(self, s: RpcSettings, keep_logs: bool = False) -> None:
        from kvxfer_client import Layout

        self.s = s
        self.keep_logs = keep_logs
        self.workdir = short_tmpdir("kvxr-")
        # The smallest real layout: one 1-token chunk is one 256-byte slot.
        self.layout = Layout(num_layers=1, total_kv_heads=1, head_dim=64, dtype_bytes=2, page_size=16)
        self.daemon: Daemon | None = None
        self.tx: Any = None
        self._room = 1
        self.failed = False

    def start(self) -> None:
        from kvxfer_client import PrefillSender

        self.daemon = start_daemon(self.workdir, "rpc", self.s.ring_bytes + (32 << 20))
        self.daemon.wait_ready()
        self.tx = PrefillSender(socket=self.daemon.socket, group="bench-rpc", layout=self.layout,
                                ring_bytes=self.s.ring_bytes, name="bench-rpc-p0", call_timeout=30.0,
                                lease_ms=LEASE_MS)

    def stop(self) -> None:
        if self.tx is not None:
            try:
                self.tx.close()
            except Exception:
                pass
        if self.daemon is not None:
            self.daemon.stop()
        remove_tree(self.workdir, self.keep_logs or self.failed)

    def meter(self) -> CpuMeter:
        import os

        assert self.daemon is not None
        return CpuMeter({"daemon": self.daemon.pid, "client": os.getpid()})

    # ------------------------------------------------------------------ helpers

    def chunks(self, n: int, tick: Callable[[int], None]) -> tuple[list[Any], list[float]]:
        """n acquired 1-token slots as client Chunks (rooms of chunks_per_room), and acquire latencies."""
        from kvxfer_client import Chunk

        out = []
        lat = []
        per = self.s.chunks_per_room
        for i in range(n):
            t0 = time.perf_counter()
            slot = self.tx.acquire(1)
            lat.append(time.perf_counter() - t0)
            cid = i % per
            room = self._room + i // per
            last = cid == per - 1 or i == n - 1
            out.append(Chunk(room=room, chunk_id=cid, token_start=cid, num_tokens=1, slot=slot, last=last))
            if i % 500 == 499:
                tick(500)
        tick(n % 500)
        self._room += math.ceil(n / per) + 1
        return out, lat

    def release(self, chunks: list[Any]) -> None:
        """Releases (aborts) the parked rooms: their slots go back to the ring."""
        from kvxfer_client import KvxferError

        for room in sorted({c.room for c in chunks}):
            try:
                self.tx.release(room)
            except KvxferError:
                pass

    # ------------------------------------------------------------------ phases

    def unary_paced(self, chunks: list[Any], tick: Callable[[int], None], via: str = "lane") -> dict[str, Any]:
        """Open loop: call i leaves at t0 + i/rate whether or not earlier calls have answered
        (grpc futures), so the offered rate holds even when one call takes longer than 1/rate.

        via="lane": what the client uses when the daemon serves its lane (kvxferd.engine_api.lane); the calls
        are synchronous, so a late one delays the next: latency_from_schedule_us counts that."""
        from kvxfer_client._requests import chunk_request

        if via == "lane" and self.tx.stub.lane is not None:
            return self._unary_paced_lane(chunks, tick)
        stub, eid = self.tx.stub._grpc, self.tx.engine_id
        period = 1.0 / self.s.rate
        n = len(chunks)
        sent = [0.0] * n
        done = [0.0] * n
        due_at = [0.0] * n
        bad = [0]

        def finished(i: int, fut: Any) -> None:
            done[i] = time.perf_counter()
            try:
                if fut.result().code != 0:
                    bad[0] += 1
            except Exception:
                bad[0] += 1

        futures = []
        meter = self.meter()
        meter.start()
        t0 = time.perf_counter() + 0.01
        for i, c in enumerate(chunks):
            due = due_at[i] = t0 + i * period
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
            req = chunk_request(eid, c)
            sent[i] = time.perf_counter()
            f = stub.EnqueueChunk.future(req, timeout=30)
            f.add_done_callback(lambda fut, i=i: finished(i, fut))
            futures.append(f)
            if i % 200 == 199:
                tick(200)
        send_wall = time.perf_counter() - t0
        for f in futures:
            try:
                f.result(timeout=60)
            except Exception:
                pass
        deadline = time.perf_counter() + 5
        while not all(done) and time.perf_counter() < deadline:
            time.sleep(0.01)  # callbacks run on gRPC's thread, just after result() returns
        return self._paced_result("grpc", due_at, sent, done, bad[0], send_wall, meter.stop())

    def _paced_result(self, via: str, due_at: list[float], sent: list[float], done: list[float], bad: int,
                      send_wall: float, cpu: dict[str, float]) -> dict[str, Any]:
        """A paced phase's figures; done[i] == 0 means call i never answered (an error)."""
        n = len(sent)
        lat = [d - s for s, d in zip(sent, done, strict=True) if d]
        late = [max(0.0, s - due) for s, due in zip(sent, due_at, strict=True)]
        corrected = [d - due for d, due in zip(done, due_at, strict=True) if d]
        return {
            "via": via, "offered_rate": self.s.rate, "calls": n, "achieved_send_rate": n / max(send_wall, 1e-9),
            "completed": len(lat), "errors": bad + (n - len(lat)),
            "latency_us": latency_summary(lat, 1e6), "send_lateness_us": latency_summary(late, 1e6),
            "latency_from_schedule_us": latency_summary(corrected, 1e6), "cpu_s": cpu,
        }

    def _unary_paced_lane(self, chunks: list[Any], tick: Callable[[int], None]) -> dict[str, Any]:
        from kvxfer_client._requests import chunk_request

        stub, eid = self.tx.stub, self.tx.engine_id
        period = 1.0 / self.s.rate
        sent: list[float] = []
        done: list[float] = []
        due_at: list[float] = []
        bad = 0
        meter = self.meter()
        meter.start()
        t0 = time.perf_counter() + 0.01
        for i, c in enumerate(chunks):
            due = t0 + i * period
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
            req = chunk_request(eid, c)
            due_at.append(due)
            sent.append(time.perf_counter())
            try:
                if stub.EnqueueChunk(req, timeout=30).code != 0:
                    bad += 1
            except Exception:
                bad += 1
            done.append(time.perf_counter())
            if i % 200 == 199:
                tick(200)
        send_wall = sent[-1] - t0 if sent else 1.0
        return self._paced_result("lane", due_at, sent, done, bad, send_wall, meter.stop())

    def unary_closed(self, chunks: list[Any]) -> dict[str, Any]:
        meter = self.meter()
        meter.start()
        lat = []
        t0 = time.perf_counter()
        for c in chunks:
            s = time.perf_counter()
            self.tx.enqueue(c.room, c.chunk_id, c.token_start, c.num_tokens, c.slot, last=c.last)
            lat.append(time.perf_counter() - s)
        wall = time.perf_counter() - t0
        return {"calls": len(chunks), "chunks_per_s": len(chunks) / wall, "latency_us": latency_summary(lat, 1e6),
                "cpu_s": meter.stop()}

    def idle(self, seconds: float) -> dict[str, Any]:
        """The daemon's CPU with the engine registered (keep-alives) and a WatchRooms stream open,
        and no rooms: what a node pays for a daemon that has nothing to move."""
        import threading

        stream = self.tx.watch()
        reader = threading.Thread(target=lambda: [None for _ in stream], name="bench-idle-watch", daemon=True)
        reader.start()
        time.sleep(0.5)  # subscribed, start-up work done
        meter = self.meter()
        meter.start()
        time.sleep(seconds)
        cpu = meter.stop()
        stream.cancel()
        reader.join(5)
        return {"seconds": seconds, "cpu_s": cpu, "daemon_core_pct": 100 * cpu["daemon"] / cpu["_wall_s"]}

    def health_floor(self, n: int) -> dict[str, Any]:
        """grpc.health.v1 Check on the same socket: what any unary RPC costs here (the floor)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.tx._channel)
        req = health_pb2.HealthCheckRequest(service="")
        meter = self.meter()
        meter.start()
        lat = []
        for _ in range(n):
            s = time.perf_counter()
            stub.Check(req, timeout=10)
            lat.append(time.perf_counter() - s)
        return {"calls": n, "latency_us": latency_summary(lat, 1e6), "cpu_s": meter.stop()}

    def batched(self, chunks: list[Any], batch: int) -> dict[str, Any]:
        meter = self.meter()
        meter.start()
        lat = []
        errors = 0
        t0 = time.perf_counter()
        for i in range(0, len(chunks), batch):
            s = time.perf_counter()
            res = self.tx.enqueue_many(chunks[i:i + batch])
            lat.append(time.perf_counter() - s)
            errors += sum(r is not None for r in res)
        wall = time.perf_counter() - t0
        return {"batch": batch, "chunks": len(chunks), "chunks_per_s": len(chunks) / wall, "errors": errors,
                "call_latency_us": latency_summary(lat, 1e6), "cpu_s": meter.stop()}

    def streaming(self, chunks: list[Any]) -> dict[str, Any]:
        from kvxfer_client._requests import chunk_request

        eid = self.tx.engine_id

        def requests() -> Iterator[Any]:
            for c in chunks:
                yield chunk_request(eid, c)

        meter = self.meter()
        meter.start()
        t0 = time.perf_counter()
        n = errors = 0
        for reply in self.tx.stub.EnqueueStream(requests(), timeout=120):
            n += 1
            errors += reply.code != 0
        wall = time.perf_counter() - t0
        return {"chunks": len(chunks), "replies": n, "chunks_per_s": n / wall, "errors": errors,
                "cpu_s": meter.stop()}


def _print(con: Any, result: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title="kvxferd bench rpc — engine API on the Unix socket")
    t.add_column("measure")
    t.add_column("value", justify="right")
    u = result["unary_paced"]
    t.add_row(f"unary EnqueueChunk at {u['offered_rate']:.0f}/s ({u.get('via', 'grpc')}): p50 / p90 / p99 / max",
              f"{u['latency_us']['p50']:.0f} / {u['latency_us']['p90']:.0f} / {u['latency_us']['p99']:.0f} / "
              f"{u['latency_us']['max']:.0f} µs")
    t.add_row("  achieved send rate, send lateness p99",
              f"{u['achieved_send_rate']:.0f}/s, {u['send_lateness_us']['p99']:.0f} µs")
    h = result["health_check_floor"]
    t.add_row("grpc health Check back to back (floor): p50 / p99",
              f"{h['latency_us']['p50']:.0f} / {h['latency_us']['p99']:.0f} µs")
    if "unary_paced_grpc" in result:
        g = result["unary_paced_grpc"]["latency_us"]
        t.add_row("  same over gRPC (the lane off): p50 / p90 / p99 / max",
                  f"{g['p50']:.0f} / {g['p90']:.0f} / {g['p99']:.0f} / {g['max']:.0f} µs")
    c = result["unary_closed_loop"]
    t.add_row("unary back to back (one caller)", f"{c['chunks_per_s']:.0f} chunks/s (p50 {c['latency_us']['p50']:.0f} µs)")
    for b in result["batched"]:
        t.add_row(f"EnqueueChunks, batches of {b['batch']}", f"{b['chunks_per_s']:.0f} chunks/s")
    t.add_row("EnqueueStream (one stream)", f"{result['streaming']['chunks_per_s']:.0f} chunks/s")
    how = "cut in the client" if result.get("acquire_claims_slots") else "AcquireSlot"
    t.add_row(f"acquire() back to back ({how}), p50", f"{result['acquire_latency_us']['p50']:.0f} µs")
    t.add_row(f"idle daemon (engine registered and watching), {result['idle']['seconds']:.0f} s",
              f"{result['idle']['daemon_core_pct']:.2f} % of a core")
    con.print(t)
    tt = Table(title="targets")
    for col in ("figure", "value", "target", "met"):
        tt.add_column(col)
    for k, row in result["targets"].items():
        v = row["value"]
        tt.add_row(k, "n/a" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.2f}", row["target"],
                   "[green]yes[/]" if row["met"] else "[red]no[/]")
    con.print(tt)
    con.print(f"[yellow]note:[/] {STUB_NOTE}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxferd bench rpc", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--json", help="write every figure and the machine here")
    ap.add_argument("--quick", action="store_true", help="short phases (CI)")
    ap.add_argument("--rate", type=float, help="offered unary rate per second (default 1000)")
    ap.add_argument("--seconds", type=float, help="length of the paced unary phase (default 10; --quick 2)")
    ap.add_argument("--chunks", type=int, help="chunks per batched / streaming phase (default 20000)")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args(argv)
    s = QUICK if args.quick else DEFAULT
    from dataclasses import replace

    if args.rate:
        s = replace(s, rate=args.rate)
    if args.seconds:
        s = replace(s, unary_seconds=args.seconds)
    if args.chunks:
        s = replace(s, batched_chunks=args.chunks, stream_chunks=args.chunks)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    con = Console() if sys.stdout.isatty() else Console(width=150)
    t_start = time.monotonic()
    n_unary = int(s.rate * s.unary_seconds)
    total = (2 * n_unary + s.closed_loop_calls + s.batched_chunks * len(s.batch_sizes) + s.stream_chunks) * 2
    bench = RpcBench(s, keep_logs=args.keep_logs)
    con.print(f"[bold]kvxferd bench rpc[/]{' (quick)' if s.quick else ''} — {STUB_NOTE}")
    result: dict[str, Any] = {}
    rc = 0
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=con) as prog:
            task = prog.add_task("starting the daemon", total=total)
            bench.start()
            prog.update(task, description=f"idle daemon, {s.idle_seconds:.0f} s")
            result["idle"] = bench.idle(s.idle_seconds)
            acq: list[float] = []

            def tick(n: int) -> None:
                prog.advance(task, n)

            def prepared(n: int, what: str) -> list[Any]:
                prog.update(task, description=f"acquiring {n} slots for {what}")
                chunks, lat = bench.chunks(n, tick)
                acq.extend(lat)
                prog.update(task, description=what)
                return chunks

            chunks = prepared(n_unary, f"unary EnqueueChunk at {s.rate:.0f}/s")
            result["unary_paced"] = bench.unary_paced(chunks, tick)
            if bench.tx.stub.lane is not None:
                prog.update(task, description=f"unary EnqueueChunk at {s.rate:.0f}/s over gRPC")
                chunks = prepared(n_unary, f"unary EnqueueChunk at {s.rate:.0f}/s over gRPC")
                result["unary_paced_grpc"] = bench.unary_paced(chunks, tick, via="grpc")
            bench.release(chunks)
            prog.update(task, description="health Check back to back (the unary floor)")
            result["health_check_floor"] = bench.health_floor(s.closed_loop_calls)
            chunks = prepared(s.closed_loop_calls, "unary EnqueueChunk back to back")
            result["unary_closed_loop"] = bench.unary_closed(chunks)
            tick(len(chunks))
            bench.release(chunks)
            result["batched"] = []
            for b in s.batch_sizes:
                chunks = prepared(s.batched_chunks, f"EnqueueChunks, batches of {b}")
                result["batched"].append(bench.batched(chunks, b))
                tick(len(chunks))
                bench.release(chunks)
            chunks = prepared(s.stream_chunks, "EnqueueStream")
            result["streaming"] = bench.streaming(chunks)
            tick(len(chunks))
            bench.release(chunks)
            result["acquire_latency_us"] = latency_summary(acq, 1e6)
            # Claimed slots are cut in the client (no call) until the ring is full.
            result["acquire_claims_slots"] = bench.tx is not None and bench.tx.claims is not None
            prog.update(task, description="done", completed=total)
    except Exception:
        bench.failed = True
        con.print_exception()
        result["failure"] = traceback.format_exc()[-3000:]
        rc = 1
    finally:
        bench.stop()
    if rc == 0:
        head = next((b for b in result["batched"] if b["batch"] == s.headline_batch), result["batched"][0])
        result.update({
            "unary_p50_us": result["unary_paced"]["latency_us"]["p50"],
            "unary_p99_us": result["unary_paced"]["latency_us"]["p99"],
            "batched_chunks_per_s": head["chunks_per_s"],
            "batched_batch_size": head["batch"],
            "streaming_chunks_per_s": result["streaming"]["chunks_per_s"],
            "idle_daemon_core_pct": result["idle"]["daemon_core_pct"],
            "errors": result["unary_paced"]["errors"] + sum(b["errors"] for b in result["batched"])
            + result["streaming"]["errors"],
        })
        result["targets"] = {
            k: {"value": result.get(k), "target": f"{op} {lim:g}", "met": target_check(result.get(k), op, lim)}
            for k, (op, lim) in TARGETS.items()
        }
        if result["errors"]:
            rc = 1
    out = {
        "bench": "rpc",
        "generated_unix": int(time.time()),
        "runtime_s": round(time.monotonic() - t_start, 1),
        "note": STUB_NOTE,
        "machine": machine_info(),
        "settings": asdict(s),
        **result,
    }
    out = rounded(out, 5)
    if rc == 0:
        _print(con, out)
    if args.json:
        write_json(args.json, out)
        con.print(f"wrote {args.json}")
    con.print(f"runtime {out['runtime_s']:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
