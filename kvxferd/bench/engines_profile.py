"""py-spy over the processes of one route during one point of ``kvxferd bench engines --profile``:
where the engines' (and daemons') time goes, as the functions most often on CPU.

Each process tree is recorded with ``py-spy record --subprocesses --format raw`` (collapsed
stacks) until the point ends (SIGINT makes py-spy write its file); the summary keeps, per tree,
the samples and the leaf functions and the functions anywhere on the stack seen most often.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any


class Profiler:
    def __init__(self, out_dir: Path, tag: str, roots: dict[str, int], rate: int = 67) -> None:
        self.files: dict[str, Path] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # The venv's bin (where pip puts py-spy) is often not on PATH when the bench runs as `python -m`.
        beside = Path(sys.executable).with_name("py-spy")
        exe = str(beside) if beside.exists() else shutil.which("py-spy")
        self.missing = exe is None
        if exe is None:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, pid in roots.items():
            path = out_dir / f"{tag}-{name}.txt"
            self.files[name] = path
            self.procs[name] = subprocess.Popen(
                [exe, "record", "--pid", str(pid), "--subprocesses", "--format", "raw", "--rate", str(rate),
                 "--nonblocking", "--output", str(path)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> dict[str, Any]:
        if self.missing:
            return {"error": "py-spy not installed (pip install 'kvxferd[bench]')"}
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        out: dict[str, Any] = {}
        for name, proc in self.procs.items():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            out[name] = summarize_collapsed(self.files[name])
        return out


def _frame(f: str) -> str:
    # "function (path/to/file.py:123)" -> "function (file.py)": lines split one function apart.
    name, _, where = f.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].split(':')[0]})" if where else name


def summarize_collapsed(path: Path, top: int = 12) -> dict[str, Any]:
    leaf: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    total = 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {"samples": 0, "file": str(path)}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame(f) for f in stack.split(";")[1:]]  # the first entry is the process/thread
        if not frames:
            continue
        total += n
        leaf[frames[-1]] += n
        for f in set(frames):
            anywhere[f] += n
    share = (lambda c: [[k, round(v / total, 3)] for k, v in c.most_common(top)]) if total else (lambda c: [])
    return {"samples": total, "file": str(path), "top_leaf": share(leaf), "top_inclusive": share(anywhere)}
