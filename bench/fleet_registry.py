"""A simulated fleet in one real etcd, through an etcd outage: does the registry settle, and does
any live daemon get reported gone?

Each simulated daemon is a real `EtcdRegistry` client (lease, record, watch of the whole fleet,
cache) publishing a record with one group of `--engines` ranks; `--procs` worker processes hold
`--records / --procs` clients each in one event loop. Once every client is up and every cache
holds the whole fleet, etcd is killed (-9) for `--outage` seconds and started again on the same
data dir. Settled means: every client is up again and every cache holds the whole fleet with
every daemon's exact instance id. A false loss is any "instance gone" a client reports (no
simulated daemon dies). `--hold` seconds after settling cover the window in which deletes seen
while recovering are held.

    .venv/bin/python bench/fleet_registry.py --records 1000 --engines 8 --procs 4 --outage 10 \\
        --json bench/results/fleet-2core-$(date +%F).json

Also times a group lookup in a 1,000 x 8 cache: the (group, role) index against a fleet scan.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvxferd import __version__  # noqa: E402
from kvxferd.config import load_config  # noqa: E402
from kvxferd.fleet.etcd import EtcdRegistry  # noqa: E402
from kvxferd.fleet.registry import DaemonRecord, FleetCache, GroupLocation, GroupRecord  # noqa: E402
from kvxferd.ops.metrics import Metrics  # noqa: E402

COUNTS = ("sessions", "lease_grants", "leases_kept", "puts", "full_reads", "resumes", "gone_withdrawn")


def record(i: int, run: str, engines: int) -> DaemonRecord:
    role = "prefill" if i % 2 == 0 else "decode"
    return DaemonRecord(
        f"node-{i:04d}:7471", f"{run}-{i}", f"10.{i // 250}.{i % 250}.1:7471", f"node-{i:04d}", __version__,
        1.8e9 + i, (GroupRecord(f"model-{i // 2}-{role}", role, engines, tuple(range(engines)), "9c1e0a4b77d2"),),
    )


# ---------------------------------------------------------------------------------------- worker

async def worker(a: argparse.Namespace) -> None:
    """Runs clients [first, first + count) and prints a JSON status line every `--tick` seconds;
    stops them (revoking their leases) when stdin closes."""
    cfg = load_config(None, env={}, overrides={
        "registry_backend": "etcd", "registry_endpoints": a.endpoint, "registry_lease_ttl_s": a.ttl,
        "registry_timeout_s": a.timeout, "socket": "/tmp/kvx-fleet-bench/x.sock"})
    metrics = Metrics()  # shared: per-client gauges would only overwrite each other
    gone: list[tuple[str, str, str, str]] = []
    clients: list[EtcdRegistry] = []
    every = max(1, a.records // max(1, a.watchers))
    for i in range(a.first, a.first + a.count):
        rec = record(i, a.run, a.engines)
        clients.append(EtcdRegistry(cfg, lambda rec=rec: rec,
                                    lambda d, inst, why, me=rec.daemon_id: gone.append((me, d, inst, why)), metrics,
                                    watch=i % every == 0))
    watchers = [c for c in clients if c._watching]
    async def rolling_start() -> None:
        for c in clients:  # as a fleet's pods come up, not all in one instant
            await c.start()
            await asyncio.sleep(1 / a.start_rate)

    starting = asyncio.ensure_future(rolling_start())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
    want = {r.daemon_id: r.instance_id for r in (record(i, a.run, a.engines) for i in range(a.records))}
    while not stop.is_set():
        st = [c.status() for c in clients]
        complete = sum(1 for c, x in zip(clients, st, strict=True) if x["daemons"] == a.records or not c._watching)
        exact = None
        if complete == len(clients) and all(c.up for c in clients):
            # Only once complete: every cached record is the daemon's own instance.
            exact = all(all(want.get(r.daemon_id) == r.instance_id for r in c.cache.records()) for c in watchers)
        line = {"up": sum(1 for c in clients if c.up), "complete": complete, "exact": exact, "gone": len(gone),
                "gone_sample": gone[:3], "rss_mb": rss_mb(),
                **{k: sum(int(x.get(k, 0)) for x in st) for k in COUNTS}}  # type: ignore[call-overload]
        print(json.dumps(line), flush=True)
        try:
            await asyncio.wait_for(stop.wait(), a.tick)
        except asyncio.TimeoutError:
            pass
    starting.cancel()
    await asyncio.gather(*(c.stop() for c in clients))


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return round(int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


# ------------------------------------------------------------------------------------ controller

class Workers:
    """The worker processes and the latest status line of each."""

    def __init__(self, endpoint: str, a: argparse.Namespace, run: str) -> None:
        self.latest: list[dict[str, Any]] = []
        self.procs: list[subprocess.Popen[str]] = []
        per = -(-a.records // a.procs)
        for p in range(a.procs):
            first, count = p * per, max(0, min(per, a.records - p * per))
            proc = subprocess.Popen(
                [sys.executable, __file__, "worker", "--endpoint", endpoint, "--first", str(first), "--count",
                 str(count), "--records", str(a.records), "--engines", str(a.engines), "--ttl", str(a.ttl),
                 "--timeout", str(a.timeout), "--run", run, "--tick", str(a.tick),
                 "--start-rate", str(a.start_rate / a.procs), "--watchers", str(a.watchers)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
            self.procs.append(proc)
            self.latest.append({})
            threading.Thread(target=self._read, args=(p, proc), daemon=True).start()

    def _read(self, p: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.latest[p] = json.loads(line)

    def total(self, key: str) -> int:
        return sum(int(s.get(key, 0)) for s in self.latest)

    def settled(self, records: int) -> bool:
        return (all(s.get("exact") for s in self.latest) and self.total("up") == records
                and self.total("complete") == records)

    def wait(self, cond: Any, timeout: float, what: str) -> float:
        t0 = last = time.monotonic()
        while not cond():
            if time.monotonic() - last > 5:
                last = time.monotonic()
                print(f"{time.monotonic() - t0:6.1f} s waiting for {what}: {self.snapshot()}", file=sys.stderr)
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a worker exited with {proc.returncode} while waiting for {what}")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"not within {timeout} s: {what} ({self.snapshot()})")
            time.sleep(0.05)
        return time.monotonic() - t0

    def snapshot(self) -> dict[str, Any]:
        return {k: self.total(k) for k in ("up", "complete", "gone", *COUNTS)} | {
            "rss_mb": round(sum(float(s.get("rss_mb", 0)) for s in self.latest), 1),
            "gone_sample": [g for s in self.latest for g in s.get("gone_sample", [])][:5]}

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_fleet(a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The outage scenario; returns its numbers (raises if setup or settling runs past its limit)."""
    from tests.registry.conftest import Etcd, free_port

    etcd = Etcd(workdir / "etcd-data", free_port(), free_port(), workdir / "etcd.log", heartbeat_ms=100, election_ms=1000)
    etcd.start()
    workers = Workers(etcd.endpoint, a, run=f"r{os.getpid()}")
    try:
        setup_s = workers.wait(lambda: workers.settled(a.records), a.setup_limit, "every client up and complete")
        before = workers.snapshot()
        etcd.kill()
        t_kill = time.monotonic()
        workers.wait(lambda: workers.total("up") == 0, 30, "every client notices etcd is gone")
        noticed_s = time.monotonic() - t_kill
        time.sleep(max(0.0, a.outage - noticed_s))
        etcd.start()
        back = time.monotonic()
        outage_s = back - t_kill
        up_s = workers.wait(lambda: workers.total("up") == a.records, a.settle_limit * 3, "every client up")
        settle_s = workers.wait(lambda: workers.settled(a.records), a.settle_limit * 3, "settled") + up_s
        settled = workers.snapshot()
        time.sleep(a.hold)
        after = workers.snapshot()
    finally:
        workers.close()
        etcd.stop()
    delta = {k: after[k] - before[k] for k in COUNTS}
    return {
        "records": a.records, "watchers": min(a.records, a.watchers), "engines_per_record": a.engines,
        "procs": a.procs, "lease_ttl_s": a.ttl,
        "setup_s": round(setup_s, 2), "outage_s": round(outage_s, 2), "noticed_down_s": round(noticed_s, 2),
        "all_up_after_etcd_back_s": round(up_s, 2), "settle_s": round(settle_s, 2), "hold_s": a.hold,
        "false_losses_during_setup": before["gone"],
        "false_losses": after["gone"] - before["gone"], "false_loss_sample": after["gone_sample"],
        "during_outage_and_recovery": delta, "sessions_after_settling": after["sessions"] - settled["sessions"],
        "worker_rss_mb": after["rss_mb"], "met": settle_s <= a.settle_limit and after["gone"] == 0,
    }


def lookup_times(records: int = 1000, groups: int = 8, n: int = 20000) -> dict[str, float]:
    """One group lookup in a cache of `records` x `groups`: the index against a fleet scan."""
    cache = FleetCache()
    cache.replace_all(DaemonRecord(f"d{i}", "x", "a", "n", "v", float(i), tuple(
        GroupRecord(f"g{i}-{k}", "prefill", 1, (0,), "abc") for k in range(groups))) for i in range(records))

    def scan(group: str, role: str) -> list[GroupLocation]:
        return [GroupLocation(r.daemon_id, r.instance_id, r.address, g)
                for r in cache._records.values() for g in r.groups if g.group == group and g.role == role]

    out = {}
    for name, fn, reps in (("index_us", cache.find, n), ("scan_us", scan, max(1, n // 100))):
        t0 = time.perf_counter()
        for j in range(reps):
            fn(f"g{j % records}-{j % groups}", "prefill")
        out[name] = round((time.perf_counter() - t0) / reps * 1e6, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="run", choices=("run", "worker"))
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--outage", type=float, default=10.0)
    ap.add_argument("--ttl", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--settle-limit", type=float, default=30.0)
    ap.add_argument("--setup-limit", type=float, default=900.0)
    ap.add_argument("--hold", type=float, default=25.0, help="seconds watched for false losses after settling")
    ap.add_argument("--tick", type=float, default=0.5)
    # Every real daemon watches; here the watchers' Python work (each decodes every record) shares
    # 2 cores, so by default one client in 10 watches the whole fleet and the rest only hold a lease
    # and a record (etcd still serves 1,000 sessions, leases and records).
    ap.add_argument("--watchers", type=int, default=100, help="clients that watch the whole fleet")
    # A whole fleet's first reads and puts fan out to every watcher; in a few processes on 2 shared
    # cores a faster start starves the clients' event loops past their keep-alive timeout.
    ap.add_argument("--start-rate", type=float, default=6.0, help="clients started per second, in all")
    ap.add_argument("--json", type=Path)
    # worker only
    ap.add_argument("--endpoint")
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--run", default="r")
    a = ap.parse_args(argv)
    if a.mode == "worker":
        logging.basicConfig(level=logging.ERROR)  # every client logs each blip; the counts say it
        asyncio.run(worker(a))
        return 0
    with tempfile.TemporaryDirectory(prefix="kvx-fleet-") as tmp:
        res = run_fleet(a, Path(tmp))
    res["lookup_1000x8"] = lookup_times()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvxferd/fleet/registry.py", "kvxferd/fleet/etcd.py",
                            "kvxferd/fleet/etcd_wire.py", "bench/fleet_registry.py"],
                           capture_output=True, text=True, cwd=ROOT).stdout
    res = {"what": "fleet registry through an etcd outage (bench/fleet_registry.py)", "commit": commit.strip(),
           "registry_code_dirty": bool(dirty.strip()), "machine": f"{platform.node()} {os.cpu_count()} cores",
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           **res}
    print(json.dumps(res, indent=2))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0 if res["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
