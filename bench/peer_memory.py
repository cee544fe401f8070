"""Memory per idle peer: what a daemon pays for each peer it knows (handshaken, control stream
up, heartbeats only), to size `max_peers` for a fleet.

One process runs a star of in-process daemons (LocalTransport, so no NIXL agent per daemon): a
hub and `--peers` spokes. RSS is read with every daemon started but none linked, then with every
spoke linked to the hub (each link is a handshake and a control stream, dialled by the spoke,
accepted by the hub) after `--idle` seconds of heartbeats. A link has two sides (the spoke's and
the hub's), so the RSS delta / (2 x peers) is the cost of one peer on one daemon, averaged over
the dialling and the accepting side. NIXL's own per-remote-agent state (the peer's metadata,
loaded into the agent) comes on top with the nixl transport and is not in this number.

    .venv/bin/python bench/peer_memory.py --peers 200 --json bench/results/peer-memory-2core-$(date +%F).json
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvxferd.app import Ready, serve  # noqa: E402
from kvxferd.config import load_config  # noqa: E402
from kvxferd.peer.manager import PeerManager  # noqa: E402


def rss_mb() -> float:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages back first: only what is held counts
    except OSError:
        pass
    with open("/proc/self/status") as fh:
        kb = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    return kb / 1024


async def start(tmp: Path, name: str, max_peers: int) -> tuple[Ready, asyncio.Event, asyncio.Task[int]]:
    cfg = load_config(None, env={}, overrides={
        "socket": str(tmp / f"{name}.sock"), "peer_listen": "127.0.0.1:0", "metrics_port": -1, "daemon_id": name,
        "host_pool_bytes": "4MiB", "transport": "local", "max_peers": max_peers})
    got: asyncio.Future[Ready] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.ensure_future(serve(cfg, stop, ready=lambda r: got.set_result(r)))
    await asyncio.wait_for(got, 120)
    return got.result(), stop, task


async def run(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    hub, *_ = daemons = [await start(tmp, "hub", a.peers + 8)]
    for i in range(a.peers):
        daemons.append(await start(tmp, f"spoke{i:04d}", 8))
    managers = {pm.ident.daemon_id: pm for pm in gc.get_objects() if isinstance(pm, PeerManager)}
    await asyncio.sleep(a.idle)
    before = rss_mb()
    t0 = time.monotonic()
    for i in range(a.peers):
        for attempt in range(3):  # a handshake can time out on a loaded 2-core box; the link is what counts
            try:
                await managers[f"spoke{i:04d}"].connect(hub[0].peer_address)
                break
            except Exception:
                if attempt == 2:
                    raise
    link_s = time.monotonic() - t0
    hub_pm = managers["hub"]

    def up() -> int:
        return sum(1 for i in range(a.peers) if (h := hub_pm.known(f"spoke{i:04d}")) is not None and h.up)

    await asyncio.sleep(a.idle)
    after = rss_mb()
    known_up = up()
    for _, stop, _ in daemons:
        stop.set()
    await asyncio.gather(*(t for _, _, t in daemons), return_exceptions=True)
    delta = after - before
    return {
        "peers": a.peers, "idle_s": a.idle, "rss_mb_unlinked": round(before, 1), "rss_mb_linked": round(after, 1),
        "links_up_at_hub_after_idle": known_up, "link_all_s": round(link_s, 2),
        "kib_per_peer_per_daemon": round(delta * 1024 / (2 * a.peers), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=200)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of heartbeats before each reading")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="kvx-pm-") as tmp:
        res = asyncio.run(run(a, Path(tmp)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    res = {"what": "memory per idle peer (bench/peer_memory.py)", "commit": commit.strip(),
           "machine": f"{platform.node()} {os.cpu_count()} cores", "command": " ".join(["python", *sys.argv]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **res}
    print(json.dumps(res, indent=2))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0 if res["links_up_at_hub_after_idle"] == a.peers else 1


if __name__ == "__main__":
    sys.exit(main())
