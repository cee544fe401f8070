"""`kvxferd bench soak`: many tiny rooms through two daemons; does anything leak?

Two daemons (`kvxferd serve` subprocesses, real NIXL between them) and two engine processes that
use only kvxfer_client's asyncio API: the prefill engine acquires a slot per room and hands rooms
over in batches (EnqueueChunks), the decode engine expects rooms ahead, checks every landed byte,
watermarks and releases; both follow their rooms through WatchRooms (with a polling fallback).
The bench samples each daemon's resident memory (VmRSS) and open file descriptors all along.

Pass: every room SUCCESS on both sides with its bytes intact; after warm-up (the first
--warmup fraction of rooms) RSS and FDs at the end stay within --tolerance of their value at
the end of warm-up; no slot and no room left on either daemon. Exit 0 on pass, 1 on fail.

    kvxferd bench soak --rooms 100000 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

TOKENS = 4  # per room (one chunk): 1 KiB with the layout below
# Rooms are followed through WatchRooms; one still open after this long is polled instead (a room
# can end before its engine's watch is registered). Polling every open room would double the RPCs.
STRAGGLER_S = 5.0
# The soak looks for leaks, not for dead engines: a long lease keeps a CPU-starved engine (other
# jobs on the machine) from being declared dead mid-run.
LEASE_MS = 60_000


@dataclass(frozen=True)
class Plan:
    rooms: int
    window: int  # rooms open at once, per side
    batch: int  # chunks per EnqueueChunks call
    socket_pre: str = ""
    socket_dec: str = ""
    prefill_address: str = ""


def _layout() -> Any:
    from kvxfer_client import Layout

    return Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16)


def payload(room: int, nbytes: int) -> bytes:
    """The bytes of a room's chunk: its id repeated, so a misplaced or stale chunk shows."""
    word = (room * 2654435761 + 12345).to_bytes(8, "little")
    return (word * (nbytes // 8 + 1))[:nbytes]


def _run(coro_fn: Any, *args: Any) -> None:
    try:
        import uvloop

        uvloop.run(coro_fn(*args))
    except ImportError:
        asyncio.run(coro_fn(*args))


# --------------------------------------------------------------------------- engines (own processes)


def prefill_engine(plan: Plan, q: Any, leave: Any) -> None:
    _run(_prefill, plan, q, leave)


async def _prefill(plan: Plan, q: Any, leave: Any) -> None:
    from kvxfer_client import AsyncPrefillSender, Chunk, RoomState

    try:
        tx = await AsyncPrefillSender.create(socket=plan.socket_pre, group="soak-pre", layout=_layout(),
                                             ring_bytes=16 << 20, name="soak-prefill", call_timeout=30,
                                             lease_ms=LEASE_MS)
        window = asyncio.Semaphore(plan.window)
        opened: dict[int, float] = {}
        ended: dict[str, int] = {"SUCCESS": 0, "FAILED": 0}
        failures: list[str] = []
        tasks: set[asyncio.Task[None]] = set()

        async def finish(room: int, state: RoomState, reason: str) -> None:
            if opened.pop(room, None) is None:
                return  # seen twice (event and sweep)
            ended[state.name] += 1
            if state is RoomState.FAILED and len(failures) < 5:
                failures.append(f"room {room}: {reason}")
            await tx.release(room)
            window.release()

        def spawn(coro: Any) -> None:
            t = asyncio.ensure_future(coro)
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        async def watch() -> None:
            async for ev in tx.watch():
                if ev.state in (RoomState.SUCCESS, RoomState.FAILED):
                    spawn(finish(ev.room, ev.state, ev.failure_reason))

        async def sweep() -> None:
            while True:
                await asyncio.sleep(1.0)
                old = [r for r, t in list(opened.items()) if time.monotonic() - t > STRAGGLER_S]
                for r in old:
                    st = await tx.poll(r)
                    if st.finished:
                        await finish(r, st.state, st.failure_reason)

        watcher = asyncio.ensure_future(watch())
        sweeper = asyncio.ensure_future(sweep())
        room = 0
        while room < plan.rooms:
            k = min(plan.batch, plan.rooms - room)
            for _ in range(k):
                await window.acquire()
            slots = await asyncio.gather(*(tx.acquire(TOKENS) for _ in range(k)))
            chunks = []
            for i, slot in enumerate(slots):
                tx.slot_view(slot)[:] = payload(room + i, slot.chunk_bytes)
                opened[room + i] = time.monotonic()
                chunks.append(Chunk(room + i, 0, 0, TOKENS, slot, last=True))
            errors = await tx.enqueue_many(chunks)
            for i, err in enumerate(errors):
                if err is not None:
                    raise RuntimeError(f"room {room + i} refused: {err}")
            room += k
        while opened:
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        q.put(("prefill", {"rooms": ended, "failures": failures}, None))
        await asyncio.get_running_loop().run_in_executor(None, leave.wait, 600)
        watcher.cancel()
        sweeper.cancel()
        await tx.close()
    except Exception:
        q.put(("prefill", None, traceback.format_exc()))


def decode_engine(plan: Plan, q: Any, leave: Any, done: Any) -> None:
    _run(_decode, plan, q, leave, done)


async def _decode(plan: Plan, q: Any, leave: Any, done: Any) -> None:
    from kvxfer_client import AsyncDecodeReceiver, RoomState

    try:
        rx = await AsyncDecodeReceiver.create(socket=plan.socket_dec, group="soak-dec", layout=_layout(),
                                              ring_bytes=16 << 20, name="soak-decode", call_timeout=30,
                                              lease_ms=LEASE_MS)
        window = asyncio.Semaphore(plan.window)
        opened: dict[int, float] = {}
        consumed: dict[int, asyncio.Task[None]] = {}  # room -> its watermark, until released
        closing: set[int] = set()
        ended: dict[str, int] = {"SUCCESS": 0, "FAILED": 0}
        failures: list[str] = []
        checked = 0
        bad: list[str] = []
        tasks: set[asyncio.Task[None]] = set()

        def spawn(coro: Any) -> asyncio.Task[None]:
            t = asyncio.ensure_future(coro)
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            return t

        def land(room: int, landed: Any) -> None:
            nonlocal checked
            if room in consumed or room not in opened:
                return
            got = bytes(rx.read(landed))
            if got != payload(room, landed.chunk_bytes) and len(bad) < 5:
                bad.append(f"room {room}: landed bytes differ")
            checked += len(got)
            consumed[room] = spawn(rx.watermark(room, [landed.chunk_id]))

        async def finish(room: int, state: RoomState, reason: str) -> None:
            if room not in opened or room in closing:
                return
            closing.add(room)
            wm = consumed.get(room)
            if wm is not None:
                await wm  # release only after the watermark went in
            elif state is RoomState.SUCCESS:
                bad.append(f"room {room}: SUCCESS without a landed chunk")
            del opened[room]
            consumed.pop(room, None)
            closing.discard(room)
            ended[state.name] += 1
            if state is RoomState.FAILED and len(failures) < 5:
                failures.append(f"room {room}: {reason}")
            await rx.release(room)
            with done.get_lock():
                done.value += 1
            window.release()

        async def watch() -> None:
            async for ev in rx.watch():
                if ev.landed is not None:
                    land(ev.room, ev.landed)
                if ev.state in (RoomState.SUCCESS, RoomState.FAILED):
                    spawn(finish(ev.room, ev.state, ev.failure_reason))

        async def sweep() -> None:
            while True:
                await asyncio.sleep(1.0)
                old = [r for r, t in list(opened.items()) if time.monotonic() - t > STRAGGLER_S]
                for r in old:
                    st = await rx.poll(r)
                    for c in st.landed:
                        land(r, c)
                    if st.finished:
                        await finish(r, st.state, st.failure_reason)

        watcher = asyncio.ensure_future(watch())
        sweeper = asyncio.ensure_future(sweep())
        room = 0
        while room < plan.rooms:
            k = min(32, plan.rooms - room)
            for _ in range(k):
                await window.acquire()
            for i in range(k):
                opened[room + i] = time.monotonic()
            await asyncio.gather(*(rx.expect(room + i, plan.prefill_address, "soak-pre", TOKENS) for i in range(k)))
            room += k
        while opened:
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        q.put(("decode", {"rooms": ended, "failures": failures, "checked_bytes": checked, "bad": bad}, None))
        await asyncio.get_running_loop().run_in_executor(None, leave.wait, 600)
        watcher.cancel()
        sweeper.cancel()
        await rx.close()
    except Exception:
        q.put(("decode", None, traceback.format_exc()))


# --------------------------------------------------------------------------- the bench


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def daemon_status(socket: str) -> Any:
    import grpc

    from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2, engine_pb2_grpc

    with grpc.insecure_channel(f"unix:{socket}") as ch:
        return engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=10)


def run(rooms: int, window: int = 64, batch: int = 64, warmup: float = 0.1, tolerance: float = 0.05,
        sample_s: float = 0.5, keep_logs: bool = False, timeout_s: float = 3600.0,
        progress: Any = None, settings: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs the soak and returns its result (see the module docstring); never raises on a fail."""
    from kvxferd.bench._common import machine_info, remove_tree, short_tmpdir, start_daemon

    work = short_tmpdir("kvxsoak-")
    # Warnings only: at info level each room logs five lines, which would measure the log, not us.
    daemons = [start_daemon(work, n, 64 << 20, settings=settings, log_level="warning") for n in ("prefill", "decode")]
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    result: dict[str, Any] = {"rooms": rooms, "window": window, "batch": batch, "tolerance": tolerance,
                              "settings": settings or {}, "machine": machine_info()}
    try:
        for d in daemons:
            d.wait_ready()
        pre, dec = daemons
        plan = Plan(rooms, window, batch, pre.socket, dec.socket, pre.peer_address)
        q = ctx.Queue()
        leave = ctx.Event()
        done = ctx.Value("q", 0)
        procs = [ctx.Process(target=decode_engine, args=(plan, q, leave, done), daemon=True),
                 ctx.Process(target=prefill_engine, args=(plan, q, leave), daemon=True)]
        for p in procs:
            p.start()
        samples: list[dict[str, float]] = []
        reports: dict[str, Any] = {}
        t0 = time.monotonic()
        while len(reports) < 2:
            try:
                role, report, err = q.get(timeout=sample_s)
            except queue.Empty:
                pass
            else:
                if err:
                    raise RuntimeError(f"{role} engine failed:\n{err}")
                reports[role] = report
            samples.append({
                "t": round(time.monotonic() - t0, 3), "rooms_done": done.value,
                "rss_prefill": rss_bytes(pre.pid), "rss_decode": rss_bytes(dec.pid),
                "fds_prefill": open_fds(pre.pid), "fds_decode": open_fds(dec.pid),
            })
            if progress is not None:
                progress(done.value, rooms)
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"soak still running after {timeout_s:.0f} s ({done.value}/{rooms} rooms)")
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"an engine process died: {[p.exitcode for p in procs]}")
        elapsed = time.monotonic() - t0
        # The end point: every room released, engines still connected (their sockets count as FDs).
        time.sleep(1.0)
        end = {"rss_prefill": rss_bytes(pre.pid), "rss_decode": rss_bytes(dec.pid),
               "fds_prefill": open_fds(pre.pid), "fds_decode": open_fds(dec.pid)}
        st = {d.name: daemon_status(d.socket) for d in daemons}
        leave.set()
        for p in procs:
            p.join(30)
        base = next((s for s in samples if s["rooms_done"] >= warmup * rooms), samples[-1])
        after = [s for s in samples if s["t"] >= base["t"]]
        growth = {}
        for key in ("rss_prefill", "rss_decode", "fds_prefill", "fds_decode"):
            growth[key] = {
                "after_warmup": base[key], "end": end[key], "max_after_warmup": max(s[key] for s in after),
                "growth": (end[key] - base[key]) / base[key] if base[key] else 0.0,
            }
        ok_rooms = reports["decode"]["rooms"]["SUCCESS"] == rooms and reports["prefill"]["rooms"]["SUCCESS"] == rooms
        held = {n: s.slots_held for n, s in st.items()}
        left = {n: sum(s.rooms_by_state.values()) for n, s in st.items()}
        checks = {
            "all_rooms_success": ok_rooms and not reports["decode"]["bad"],
            "bytes_checked": reports["decode"]["checked_bytes"] == rooms * TOKENS * 256,
            "rss_flat": all(growth[k]["growth"] <= tolerance for k in ("rss_prefill", "rss_decode")),
            "fds_flat": all(growth[k]["growth"] <= tolerance for k in ("fds_prefill", "fds_decode")),
            "no_slots_held": all(v == 0 for v in held.values()),
            "no_rooms_left": all(v == 0 for v in left.values()),
        }
        result.update({
            "elapsed_s": round(elapsed, 2), "rooms_per_s": round(rooms / elapsed, 1),
            "warmup_rooms": int(warmup * rooms), "baseline_at_s": base["t"], "memory_and_fds": growth,
            "slots_held": held, "rooms_left": left, "engines": reports, "checks": checks,
            "pass": all(checks.values()), "samples": samples[:: max(1, len(samples) // 200)],
        })
        for d in daemons:
            result.setdefault("exit_codes", {})[d.name] = d.stop()
    except Exception:
        result.update({"pass": False, "error": traceback.format_exc(),
                       "logs": {d.name: d.log_tail(2000) for d in daemons}})
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for d in daemons:
            d.kill()
        remove_tree(work, keep_logs)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxferd bench soak", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rooms", type=int, default=100_000, help="rooms to send (default 100000)")
    ap.add_argument("--window", type=int, default=64, help="rooms open at once per side (default 64)")
    ap.add_argument("--batch", type=int, default=64, help="chunks per EnqueueChunks call (default 64)")
    ap.add_argument("--warmup", type=float, default=0.1, help="fraction of rooms before the baseline (default 0.1)")
    ap.add_argument("--tolerance", type=float, default=0.05, help="allowed RSS/FD growth after warm-up (default 0.05)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="daemon setting for both daemons (repeatable), e.g. heartbeat_interval_s=2")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args(argv)
    if args.rooms < 1 or args.window < 1 or args.batch < 1 or not 0 <= args.warmup < 1:
        ap.error("--rooms, --window and --batch must be positive and --warmup in [0, 1)")
    settings = dict(item.partition("=")[::2] for item in args.set)
    if any(not k or not v for k, v in settings.items()):
        ap.error("--set expects KEY=VALUE")

    last = [0.0]

    def progress(done: int, total: int) -> None:
        if time.monotonic() - last[0] >= 5:
            last[0] = time.monotonic()
            print(f"  {done}/{total} rooms", file=sys.stderr, flush=True)

    print(f"kvxferd bench soak: {args.rooms} rooms, window {args.window}, batch {args.batch}", flush=True)
    res = run(args.rooms, args.window, args.batch, args.warmup, args.tolerance, keep_logs=args.keep_logs,
              progress=progress, settings=settings)
    if args.json:
        from kvxferd.bench._common import write_json

        write_json(args.json, res)
    if "error" in res:
        print(res["error"], file=sys.stderr)
        for name, tail in res.get("logs", {}).items():
            print(f"--- {name} log tail ---\n{tail}", file=sys.stderr)
        return 1
    mb = 1 << 20
    for key, g in res["memory_and_fds"].items():
        unit, div = ("MiB", mb) if key.startswith("rss") else ("", 1)
        print(f"  {key:12s} after warm-up {g['after_warmup'] / div:8.1f}{unit}  end {g['end'] / div:8.1f}{unit}"
              f"  max {g['max_after_warmup'] / div:8.1f}{unit}  growth {g['growth'] * 100:+.2f}%")
    print(f"  {res['rooms']} rooms in {res['elapsed_s']} s ({res['rooms_per_s']} rooms/s); slots held "
          f"{res['slots_held']}; rooms left {res['rooms_left']}")
    for name, ok in res["checks"].items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    print("PASS" if res["pass"] else "FAIL", flush=True)
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

