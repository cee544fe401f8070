"""The processes of ``kvxferd bench loopback`` and their lifetime: the two daemons, the engine
processes of every TP pair with their rings, the raw NIXL and Mooncake pairs, per-process CPU
meters over them and py-spy on the daemons.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxferd.bench._common import CpuMeter, Daemon, remove_tree, short_tmpdir, start_daemon
from kvxferd.bench.loopback_engines import engine_entry
from kvxferd.bench.loopback_procs import Child
from kvxferd.bench.loopback_raw import raw_entry
from kvxferd.bench.loopback_spec import RunSpec, Settings, tp_path
from kvxferd.bench.loopback_tuned import tuned_entry
from kvxferd.config import Config


@dataclass
class EngineGroup:
    """Engine processes of one TP pair, registered on the two daemons."""

    ptp: int
    dtp: int
    prefill: list[Child] = field(default_factory=list)
    decode: list[Child] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"tp{self.ptp}to{self.dtp}"

    @property
    def path(self) -> str:
        return tp_path(self.ptp, self.dtp)


class LoopbackRig:
    """Every process of the bench; :class:`~kvxferd.bench.loopback_paths.LoopbackBench` measures on it."""

    def __init__(self, settings: Settings, keep_logs: bool = False, profile_dir: str | None = None,
                 mooncake: bool = True) -> None:
        self.s = settings
        self.keep_logs = keep_logs
        self.profile_dir = profile_dir
        self.want_mooncake = mooncake
        self.workdir = short_tmpdir("kvxb-")
        self.ctx = mp.get_context("spawn")
        self.daemons: dict[str, Daemon] = {}
        self.groups: dict[tuple[int, int], EngineGroup] = {}
        self.raw: dict[str, tuple[Child, Child]] = {}
        self.unavailable: dict[str, str] = {}
        self.failures: list[str] = []
        self.profiles: dict[str, Any] = {}
        # The daemons' transfer threads (UCX workers), and the tuned raw pair's: the same number.
        self.workers = settings.workers or Config().transfer_workers

    # ------------------------------------------------------------------ lifecycle

    def _ranks_ring(self, tp: int) -> int:
        per = self.s.ring_bytes // tp
        return max(per // (1 << 20), 1) << 20

    def start(self, status: Callable[[str], None]) -> None:
        s = self.s
        tps = [(1, 1), *s.mixed_tp]
        pool = sum(self._ranks_ring(p) * p for p, _ in tps) + (64 << 20)
        dpool = sum(self._ranks_ring(d) * d for _, d in tps) + (64 << 20)
        status("starting daemons, raw NIXL and Mooncake pairs")
        # --workers: both daemons and the tuned pair; else each daemon resolves its default as this did.
        conf = {"workers": s.workers} if s.workers else None
        self.daemons["prefill"] = start_daemon(self.workdir, "prefill", pool, conf)
        self.daemons["decode"] = start_daemon(self.workdir, "decode", dpool, conf)
        win = s.ring_bytes
        self._start_raw("nixl", win)
        self.raw["nixl_tuned"] = (
            Child(self.ctx, "nixl_tuned-initiator", tuned_entry,
                  ("initiator", win, self.workers, str(self.workdir / "nixl_tuned-initiator.log"))),
            Child(self.ctx, "nixl_tuned-target", tuned_entry,
                  ("target", win, self.workers, str(self.workdir / "nixl_tuned-target.log"))),
        )
        if self.want_mooncake:
            try:
                if importlib.util.find_spec("mooncake.engine") is None:
                    raise ImportError("mooncake.engine not found")
                self._start_raw("mooncake", win)
            except ImportError as exc:
                self.unavailable["mooncake_tcp"] = (
                    f"mooncake-transfer-engine-non-cuda is not installed ({exc}); "
                    "install the bench extra: pip install 'kvxferd[bench]'")
        else:
            self.unavailable["mooncake_tcp"] = "skipped (--no-mooncake)"
        for d in self.daemons.values():
            d.wait_ready()
        status("starting engine processes")
        for ptp, dtp in tps:
            g = EngineGroup(ptp, dtp)
            for r in range(dtp):
                g.decode.append(self._engine("decode", g, dtp, r))
            for r in range(ptp):
                g.prefill.append(self._engine("prefill", g, ptp, r))
            self.groups[(ptp, dtp)] = g
        for name, (ini, tgt) in list(self.raw.items()):
            try:
                tgt.info = tgt.recv(120)
                ini.info = ini.recv(120)
                ini.call("connect", tgt.info, timeout=60)
            except Exception as exc:
                if name != "mooncake":
                    raise
                self.unavailable["mooncake_tcp"] = f"Mooncake pair did not start: {str(exc).strip()[-600:]}"
                ini.stop()
                tgt.stop()
                del self.raw[name]
        for g in self.groups.values():
            for c in [*g.decode, *g.prefill]:
                c.info = c.recv(120)

    def _start_raw(self, backend: str, nbytes: int) -> None:
        tgt = Child(self.ctx, f"{backend}-target", raw_entry,
                     (backend, "target", nbytes, str(self.workdir / f"{backend}-target.log")))
        ini = Child(self.ctx, f"{backend}-initiator", raw_entry,
                     (backend, "initiator", nbytes, str(self.workdir / f"{backend}-initiator.log")))
        self.raw[backend] = (ini, tgt)

    def _engine(self, role: str, g: EngineGroup, tp: int, rank: int) -> Child:
        d = self.daemons[role]
        group = f"{g.name}-{role}"
        return Child(self.ctx, f"{g.name}-{role}{rank}", engine_entry, (
            role, d.socket, group, self.s.shape, tp, rank, self._ranks_ring(tp),
            str(self.workdir / f"{g.name}-{role}{rank}.log"),
        ))

    def stop(self) -> None:
        for g in self.groups.values():
            for c in [*g.prefill, *g.decode]:
                c.stop()
        for ini, tgt in self.raw.values():
            ini.stop()
            tgt.stop()
        for d in self.daemons.values():
            d.stop()
        remove_tree(self.workdir, self.keep_logs or bool(self.failures))

    def pids(self) -> dict[str, int]:
        out = {f"daemon_{k}": d.pid for k, d in self.daemons.items()}
        for g in self.groups.values():
            for c in [*g.prefill, *g.decode]:
                out[c.name] = c.pid
        for name, (ini, tgt) in self.raw.items():
            out[f"{name}_initiator"] = ini.pid
            out[f"{name}_target"] = tgt.pid
        return out

    def _meter(self, keys: Sequence[str]) -> CpuMeter:
        pids = self.pids()
        return CpuMeter({k: pids[k] for k in keys if k in pids})


    # ------------------------------------------------------------------ profiling

    def _start_profile(self, g: EngineGroup, spec: RunSpec) -> list[Any]:
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not self.profile_dir or not Path(exe).exists():
            return []
        out = Path(self.profile_dir)
        out.mkdir(parents=True, exist_ok=True)
        spies = []
        # Both daemons and the first engine of each role (engines' per-chunk client work shows too).
        targets = [(f"{name}-daemon", self.daemons[name].pid) for name in ("prefill", "decode")]
        targets += [(f"{role}-engine0", procs[0].pid) for role, procs in (("prefill", g.prefill), ("decode", g.decode))
                    if procs]
        for name, pid in targets:
            raw = out / f"{name}.{g.name}.txt"
            cmd = [exe, "record", "--pid", str(pid), "--rate", os.environ.get("KVX_PYSPY_RATE", "250"), "--format", "raw",
                   "--threads", "--nonblocking", "--output", str(raw), "--duration", str(int(spec.timeout_s)),
                   *os.environ.get("KVX_PYSPY_ARGS", "").split()]
            if "--native" in cmd:
                cmd.remove("--nonblocking")  # py-spy reads native stacks only from a paused process
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            spies.append((proc, raw))
        time.sleep(1.0)
        return spies

    def _stop_profile(self, spies: list[Any]) -> None:
        for proc, raw in spies:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            self.profiles[raw.stem] = {"file": str(raw), "top": _profile_top(raw)}


def _profile_top(raw: Path, n: int = 15) -> list[dict[str, Any]]:
    """Self time per function from py-spy's collapsed stacks ("frame;frame;... count")."""
    try:
        lines = raw.read_text(errors="replace").splitlines()
    except OSError:
        return []
    self_counts: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        c = int(count)
        total += c
        frames = stack.split(";")
        leaf = frames[-1]
        self_counts[leaf] = self_counts.get(leaf, 0) + c
        for f in set(frames):
            incl[f] = incl.get(f, 0) + c
    top = sorted(self_counts.items(), key=lambda kv: -kv[1])[:n]
    return [{"frame": f, "self_pct": round(100 * c / max(total, 1), 2),
             "incl_pct": round(100 * incl.get(f, 0) / max(total, 1), 2)} for f, c in top]
