"""The asyncio client's EnqueueChunk, waited for (enqueue()) against not (enqueue(wait=False)):
one real daemon, one AsyncPrefillSender on its lane, chunks of one token (control cost only),
interleaved rounds. The rooms are never bootstrapped, so the daemon validates and parks each chunk
(as `kvxferd bench rpc` does); every chunk must be accepted (flush() returns no refusal).
--client sync measures the blocking PrefillSender the same way.

    .venv/bin/python bench/aio_enqueue.py --chunks 20000 --rounds 3 --json bench/results/x.json

Reports chunks per second and the engine process's CPU per chunk (the daemon's is the same work
either way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvxfer_client import AsyncPrefillSender, Layout, PrefillSender  # noqa: E402
from kvxferd.bench._common import start_daemon, write_json  # noqa: E402

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=32, dtype_bytes=2, page_size=16, dtype="bfloat16")
CHUNKS_PER_ROOM = 50  # rooms_per_engine caps parked rooms; 50 chunks a room stays far below it


async def one_run(socket: str, wait: bool, chunks: int, base_room: int) -> dict[str, Any]:
    tx = await AsyncPrefillSender.create(socket=socket, group=f"aio-{base_room}", layout=LAYOUT,
                                         ring_bytes=256 << 20)

    async def send(room0: int, n: int) -> None:
        for i in range(n):
            cid = i % CHUNKS_PER_ROOM
            await tx.enqueue(room0 + i // CHUNKS_PER_ROOM, cid, cid, 1, await tx.acquire(1),
                             last=cid == CHUNKS_PER_ROOM - 1, wait=wait)
        refused = await tx.flush()
        assert not refused, refused[:2]

    try:
        await send(base_room + 900_000, 200)  # warm-up: connection, spares
        cpu0, t0 = time.process_time(), time.perf_counter()
        await send(base_room, chunks)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        await tx.close()
    return {"wait": wait, "chunks": chunks, "chunks_per_s": round(chunks / wall),
            "engine_cpu_us_per_chunk": round(cpu / chunks * 1e6, 1)}


def one_sync_run(socket: str, wait: bool, chunks: int, base_room: int) -> dict[str, Any]:
    tx = PrefillSender(socket=socket, group=f"sync-{base_room}", layout=LAYOUT, ring_bytes=256 << 20)

    def send(room0: int, n: int) -> None:
        for i in range(n):
            cid = i % CHUNKS_PER_ROOM
            tx.enqueue(room0 + i // CHUNKS_PER_ROOM, cid, cid, 1, tx.acquire(1),
                       last=cid == CHUNKS_PER_ROOM - 1, wait=wait)
        refused = tx.flush()
        assert not refused, refused[:2]

    try:
        send(base_room + 900_000, 200)
        cpu0, t0 = time.process_time(), time.perf_counter()
        send(base_room, chunks)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        tx.close()
    return {"client": "sync", "wait": wait, "chunks": chunks, "chunks_per_s": round(chunks / wall),
            "engine_cpu_us_per_chunk": round(cpu / chunks * 1e6, 1)}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--client", choices=("aio", "sync"), default="aio")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvx-aio-"))
    d = start_daemon(workdir, "d", 1 << 30)
    deadline = time.monotonic() + 60
    while not d.ready_file.exists():
        if time.monotonic() > deadline or d.proc.poll() is not None:
            raise SystemExit(f"daemon did not start; see {d.log}")
        await asyncio.sleep(0.1)
    runs = []
    try:
        for r in range(args.rounds):
            for wait in (True, False):
                base = (2 * r + int(wait) + 1) * 1_000_000
                if args.client == "sync":
                    res = one_sync_run(d.socket, wait, args.chunks, base)
                else:
                    res = await one_run(d.socket, wait, args.chunks, base)
                res["round"] = r
                print(json.dumps(res), flush=True)
                runs.append(res)
    finally:
        d.proc.terminate()
        d.proc.wait(10)
    if args.json:
        write_json(args.json, {"host": f"{platform.node()} ({os.cpu_count()} cpus)", "runs": runs})


if __name__ == "__main__":
    asyncio.run(main())
