"""The sglang backend (kvxfer_client.sglang) driven as sglang's scheduler drives it, for a number:
prefill and decode ranks (tests/engines/sglang_ranks.py: sglang's real base classes over CPU
tensors in sglang's pool layout) on two real daemons, many rooms of several chunks each, every
byte checked. Reports rooms per second, the backend's poll() calls (one per request per scheduler
step in sglang) and the PollRoom calls they cost the daemon, and CPU seconds per process.

    .venv/bin/python bench/sglang_adapter.py --rooms 200 --chunks 8 --json bench/results/x.json

Control overhead is what it measures: the layout is tiny, so bytes cost next to nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvxferd.bench._common import proc_cpu_seconds, write_json  # noqa: E402
from tests.conftest import spawn_daemon  # noqa: E402
from tests.engines import sglang_ranks as sr  # noqa: E402


def run(rooms: int, chunks: int, prefill_tp: int, decode_tp: int) -> dict[str, Any]:
    # sglang imported here first, outside the timed span: the ranks fork from this process, and
    # the first pair of a run otherwise paid for the import (~2 s on 2 cores) in its wall time.
    import kvxfer_client.sglang._bootstrap  # noqa: F401

    work = Path(tempfile.mkdtemp(prefix="sgb", dir="/tmp"))
    p, d = spawn_daemon(work, "sgb-p"), spawn_daemon(work, "sgb-d")
    pages = 2  # per chunk
    plans = [sr.RoomPlan(room=920_000 + i, tokens=chunks * pages * sr.PAGE, chunk_pages=(pages,) * chunks)
             for i in range(rooms)]
    daemons = {"daemon_prefill": p.proc.pid, "daemon_decode": d.proc.pid}
    cpu0 = {k: proc_cpu_seconds(v) for k, v in daemons.items()}
    t0 = time.monotonic()
    try:
        got = sr.run_pair(p.socket, d.socket, prefill_tp, decode_tp, plans, timeout=600)
        wall = time.monotonic() - t0
        cpu = {k: round(proc_cpu_seconds(v) - cpu0[k], 3) for k, v in daemons.items()}
    finally:
        for dm in (p, d):
            dm.proc.terminate()
            dm.proc.wait(15)
    errors = [g[3] for g in got if g[3]]
    if errors:
        raise SystemExit("\n".join(errors))
    ranks = []
    for role, rank, res, _ in got:
        bad = {r: s for r, s in res["rooms"].items() if s != "Success"}
        if bad:
            raise SystemExit(f"{role} {rank}: rooms not successful: {list(bad.items())[:3]}")
        ranks.append({"role": role, "rank": rank, "seconds": round(res["seconds"], 3), "polls": res["polls"],
                      "daemon_polls": res["daemon_polls"], **({"checked_bytes": res["checked_bytes"]}
                                                               if role == "decode" else {})})
    return {"rooms": rooms, "chunks_per_room": chunks, "tp": f"{prefill_tp}->{decode_tp}", "wall_s": round(wall, 3),
            "rooms_per_s": round(rooms / wall, 1), "daemon_cpu_s": cpu, "ranks": ranks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rooms", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--tp", default="1->1,2->1", help="prefill->decode TP pairs, comma-separated")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    for pair in args.tp.split(","):
        ptp, dtp = (int(x) for x in pair.split("->"))
        r = run(args.rooms, args.chunks, ptp, dtp)
        results.append(r)
        polls = sum(x["polls"] for x in r["ranks"])
        dpolls = sum(x["daemon_polls"] for x in r["ranks"])
        print(f"TP {r['tp']}: {r['rooms']} rooms x {r['chunks_per_room']} chunks in {r['wall_s']:.2f} s "
              f"({r['rooms_per_s']:.0f} rooms/s); backend poll() {polls}, PollRoom {dpolls}; "
              f"daemon CPU {r['daemon_cpu_s']}")
    if args.json:
        write_json(args.json, {"bench": "sglang_adapter", "results": results})  # with commit, machine, command
    return 0


if __name__ == "__main__":
    sys.exit(main())
