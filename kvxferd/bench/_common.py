"""Helpers shared by the ``kvxferd bench`` commands: machine facts, latency statistics,
daemons as subprocesses, per-process CPU accounting, JSON output.

Nothing here imports NIXL or torch: engine and client processes of the benches import
this module and must start fast.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from kvxferd import __version__

# Distributions whose versions go into every result file.
VERSIONED = (
    "nixl", "grpcio", "protobuf", "numpy", "uvloop", "mooncake-transfer-engine-non-cuda", "matplotlib", "rich",
)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mem_total_bytes() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"kvxferd": __version__, "python": platform.python_version()}
    for dist in VERSIONED:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 0
    return {
        "loadavg": list(os.getloadavg()),
        "cores": usable,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "memory_bytes": mem_total_bytes(),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "versions": versions(),
    }


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty sequence."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def latency_summary(seconds: Sequence[float], scale: float = 1e3) -> dict[str, float | int]:
    """p50/p90/p99/mean/max (in ms by default) and the p99/p50 spread of a latency sample."""
    if not seconds:
        return {"n": 0}
    p50 = percentile(seconds, 50)
    p99 = percentile(seconds, 99)
    return {
        "n": len(seconds),
        "p50": p50 * scale,
        "p90": percentile(seconds, 90) * scale,
        "p99": p99 * scale,
        "mean": sum(seconds) / len(seconds) * scale,
        "max": max(seconds) * scale,
        "p99_over_p50": p99 / p50 if p50 > 0 else math.nan,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


# --------------------------------------------------------------------------- processes


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process (all its threads) has used; 0.0 if gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    # After the comm field: state is fields[0]; utime, stime are stat fields 14, 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / ticks


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds per OS thread name of a live process (threads of one name summed); {} if gone.

    The daemon names its threads (kvx-worker-N, kvx-notif, ...), so this says which part of a
    daemon spent the CPU: the event loop (the process's own name), the copies, the pollers.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                head, rest = fh.read().rsplit(")", 1)
        except OSError:
            continue
        name = re.sub(r"\d+$", "N", head.split("(", 1)[1])
        fields = rest.split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def system_busy_seconds() -> float:
    """CPU seconds all cores of this machine spent busy (not idle/iowait) since boot."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds used by named processes between start() and stop(), and by everything else.

    ``_other_s`` is the machine's busy CPU time minus ours: load from processes that are not
    part of the bench (a shared machine), which the numbers of that point competed with.
    """

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)
        self._t0: dict[str, float] = {}
        self._wall0 = 0.0
        self._busy0 = 0.0
        self._threads0: dict[str, dict[str, float]] = {}
        self.threads: dict[str, dict[str, float]] = {}

    def start(self) -> None:
        self._wall0 = time.monotonic()
        self._busy0 = system_busy_seconds()
        self._t0 = {k: proc_cpu_seconds(p) for k, p in self.pids.items()}
        self._threads0 = {k: thread_cpu_seconds(p) for k, p in self.pids.items() if k.startswith("daemon")}

    def stop(self) -> dict[str, float]:
        wall = max(time.monotonic() - self._wall0, 1e-9)
        out = {k: round(proc_cpu_seconds(p) - self._t0.get(k, 0.0), 4) for k, p in self.pids.items()}
        ours = sum(out.values())
        # Per thread name, daemons only (threads that ended during the run are not counted).
        self.threads = {}
        for k, before in self._threads0.items():
            now = thread_cpu_seconds(self.pids[k])
            self.threads[k] = {n: round(v - before.get(n, 0.0), 3) for n, v in sorted(now.items())
                               if v - before.get(n, 0.0) >= 0.005}
        out["_wall_s"] = round(wall, 4)
        out["_other_s"] = round(max(0.0, system_busy_seconds() - self._busy0 - ours), 4)
        return out


def short_tmpdir(prefix: str) -> Path:
    """A directory with a short path: Unix socket paths must stay under 108 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@dataclass
class Daemon:
    """A `kvxferd serve` subprocess started by a bench."""

    name: str
    proc: subprocess.Popen[bytes]
    socket: str
    log: Path
    ready_file: Path
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    @property
    def peer_address(self) -> str:
        return str(self.info["peer_address"])

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                text = self.ready_file.read_text()
                if text.strip():
                    self.info = json.loads(text)
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"daemon {self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass


def start_daemon(
    workdir: Path, name: str, pool_bytes: int, settings: Mapping[str, object] | None = None,
    log_level: str = "info",
) -> Daemon:
    """Starts `python -m kvxferd serve` on a socket in `workdir`, peer service on 127.0.0.1 (ephemeral)."""
    sock = str(workdir / f"{name}.sock")
    ready = workdir / f"{name}.ready"
    log = workdir / f"{name}.log"
    ready.unlink(missing_ok=True)
    args = [
        sys.executable, "-m", "kvxferd", "serve", "--socket", sock, "--peer-listen", "127.0.0.1:0",
        "--metrics-port", "-1", "--host-pool-bytes", str(pool_bytes), "--daemon-id", name,
        "--ready-file", str(ready), "--log-format", "text", "--log-level", log_level,
    ]
    for key, value in (settings or {}).items():
        args += ["--set", f"{key}={value}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Daemon(name, proc, sock, log, ready)


def remove_tree(path: Path, keep: bool) -> None:
    if not keep:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- output


REPO = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    """The commit the bench ran from (``-dirty`` with uncommitted changes in tracked files);
    KVX_COMMIT names it where the tree has no .git (a copy run on a GPU box, bench/device/)."""
    if os.environ.get("KVX_COMMIT"):
        return os.environ["KVX_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def provenance() -> dict[str, Any]:
    """What every result file must say it came from: a number without its commit, machine and
    command cannot be compared with the next one (bench/results/INDEX.md lists them)."""
    argv = [Path(sys.argv[0]).name if sys.argv and sys.argv[0].endswith("kvxferd") else sys.argv[0], *sys.argv[1:]]
    return {"commit": git_commit(), "machine": machine_info(), "command": shlex.join(argv)}


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """`data` as strict JSON at `path`; a result dict gets commit, machine and command if it has none."""
    if isinstance(data, dict):
        data = {**{k: v for k, v in provenance().items() if k not in data}, **data}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=2, sort_keys=False, allow_nan=False) + "\n")
    tmp.replace(p)


def _jsonable(obj: Any) -> Any:
    """NaN/inf become null so the file is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def rounded(obj: Any, digits: int = 4) -> Any:
    """Floats rounded to `digits` significant decimals for readable JSON."""
    if isinstance(obj, float):
        if not math.isfinite(obj) or obj == 0:
            return obj
        mag = math.floor(math.log10(abs(obj)))
        return round(obj, max(0, digits - 1 - mag))
    if isinstance(obj, Mapping):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rounded(v, digits) for v in obj]
    return obj


def target_check(value: float | None, op: str, limit: float) -> bool | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    checks = {">=": value >= limit, ">": value > limit, "<=": value <= limit, "<": value < limit}
    if op not in checks:
        raise ValueError(f"unknown target operator {op!r}")
    return checks[op]


def iter_chunks(total: int, size: int) -> Iterable[int]:
    """Sizes of consecutive pieces of `total` of at most `size`."""
    left = total
    while left > 0:
        n = min(size, left)
        yield n
        left -= n
