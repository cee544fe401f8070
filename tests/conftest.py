"""Fixtures that start real daemons: in-process through serve() and as subprocesses."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.readiness import Budget

ROOT = Path(__file__).resolve().parent.parent
# Tests that run real vLLM or sglang engines: each start takes both cores for tens of seconds, so
# under `make test`'s two xdist workers they run one after another on one worker while the other
# works through the rest of the suite.
_ENGINE_TESTS = ("tests/engines/", "tests/bench/test_bench_engines.py")

if importlib.util.find_spec("xdist") is not None:
    from xdist.scheduler import LoadScopeScheduling

    class _EnginesTogether(LoadScopeScheduling):
        """--dist loadscope as xdist does it (a module's tests on one worker, in order: they share
        module fixtures, and some need the ones before them), except that all real-engine tests are
        one unit. (xdist's own xdist_group marks do nothing under pytest 9.2: it renames a node by
        a field pytest no longer reads.)"""

        def _split_scope(self, nodeid: str) -> str:
            return "engines" if nodeid.startswith(_ENGINE_TESTS) else nodeid.split("::", 1)[0]

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadScopeScheduling | None:
        return _EnginesTogether(config, log) if config.getvalue("dist") == "loadscope" else None


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory: Unix socket paths must stay under 108 bytes."""
    d = Path(tempfile.mkdtemp(prefix="kvx-"))
    yield d
    # KVX_KEEP_LOGS=1 keeps daemon logs of a failing run for a look.
    if not os.environ.get("KVX_KEEP_LOGS"):
        shutil.rmtree(d, ignore_errors=True)


@dataclass
class DaemonProc:
    name: str
    proc: subprocess.Popen[bytes]
    socket: str
    log: Path
    ready_file: Path
    args: list[str]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def peer_address(self) -> str:
        return str(self.info["peer_address"])

    @property
    def metrics_port(self) -> int:
        return int(self.info["metrics_port"])

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise AssertionError(
                    f"daemon {self.name} did not exit within {timeout} s:\n{self.log_text()[-4000:]}"
                ) from None
        return int(self.proc.returncode)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def daemon_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a daemon subprocess: this one's, unbuffered, plus `env`. The daemon rejects
    unknown KVXFERD_* settings, so a developer's shell must not change what a test starts."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("KVXFERD_")}
    return {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}


def spawn_daemon(
    workdir: Path, name: str, *extra: str, env: dict[str, str] | None = None, wait: bool = True,
    peer_listen: str = "127.0.0.1:0", pool: str = "64MiB",
) -> DaemonProc:
    sock = str(workdir / f"{name}.sock")
    ready = workdir / f"{name}.ready"
    log = workdir / f"{name}.log"
    ready.unlink(missing_ok=True)
    args = [
        sys.executable, "-m", "kvxferd", "serve", "--socket", sock, "--peer-listen", peer_listen,
        "--metrics-port", "0", "--host-pool-bytes", pool, "--daemon-id", name, "--ready-file", str(ready),
        "--log-format", "text", "--set", "heartbeat_interval_s=0.5", *extra,
    ]
    with open(log, "ab") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=daemon_env(env), cwd=ROOT)
    d = DaemonProc(name, proc, sock, log, ready, args)
    if wait:
        wait_ready(d)
    return d


def stop_all(*ds: DaemonProc, timeout: float = 30.0) -> None:
    """SIGTERM to every daemon at once (each drains on its own), then waits for each."""
    for d in ds:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
    for d in ds:
        d.stop(timeout=timeout)


def wait_ready(d: DaemonProc, base_s: float = 60.0) -> None:
    """Until the daemon writes its ready file; ``base_s`` on a quiet box, scaled with the load."""
    b = Budget(f"daemon {d.name} (ready file {d.ready_file.name})", base_s)
    while not b.expired():
        if d.ready_file.exists():
            d.info = json.loads(d.ready_file.read_text())
            return
        if d.proc.poll() is not None:
            raise AssertionError(f"daemon {d.name} exited with {d.proc.returncode}:\n{d.log_text()[-4000:]}")
        time.sleep(0.02)
    d.kill()
    raise AssertionError(f"{b.failure()}:\n{d.log_text()[-4000:]}")


@pytest.fixture
def daemons(short_tmp: Path) -> Iterator[Any]:
    """Factory: daemons(name, *args) starts a subprocess daemon; all are stopped at the end."""
    started: list[DaemonProc] = []

    def make(name: str, *extra: str, **kw: Any) -> DaemonProc:
        d = spawn_daemon(short_tmp, name, *extra, **kw)
        started.append(d)
        return d

    make.workdir = short_tmp  # type: ignore[attr-defined]
    make.started = started  # type: ignore[attr-defined]
    yield make
    for d in started:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
    for d in started:
        try:
            d.proc.wait(15)
        except subprocess.TimeoutExpired:
            d.kill()


@dataclass
class InProcDaemon:
    socket: str
    peer_address: str
    metrics_port: int
    daemon_id: str
    stop: asyncio.Event
    task: asyncio.Task[int]


@pytest.fixture
async def inproc(short_tmp: Path) -> AsyncIterator[Any]:
    """Factory for daemons running in this test's event loop through serve()."""
    from kvxferd.app import Ready, serve
    from kvxferd.config import load_config

    running: list[InProcDaemon] = []

    async def make(name: str = "d0", **overrides: Any) -> InProcDaemon:
        values: dict[str, Any] = {
            "socket": str(short_tmp / f"{name}.sock"), "peer_listen": "127.0.0.1:0", "metrics_port": 0,
            "host_pool_bytes": "32MiB", "daemon_id": name, "heartbeat_interval_s": 0.5, "drain_grace_s": 5,
        }
        values.update(overrides)
        cfg = load_config(None, env={}, overrides=values)
        got: asyncio.Future[Ready] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        task = asyncio.ensure_future(serve(cfg, stop, ready=lambda r: got.set_result(r)))
        b = Budget(f"in-process daemon {name}", 60.0)
        done, _ = await asyncio.wait([got, task], timeout=b.limit(), return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()
            raise AssertionError("daemon exited before it was ready")
        if not done:
            raise AssertionError(b.failure())
        r = got.result()
        d = InProcDaemon(r.socket, r.peer_address, r.metrics_port, r.daemon_id, stop, task)
        running.append(d)
        return d

    yield make
    for d in running:
        d.stop.set()
    for d in running:
        try:
            await asyncio.wait_for(d.task, 30)
        except Exception:
            pass
