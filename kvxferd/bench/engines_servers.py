"""The processes of ``kvxferd bench engines``: vLLM OpenAI servers (one per role and connector),
the kvxferd daemons the KvxferdConnector engines talk to, and the PD proxy; and the CPU seconds
each one (with every process it started) used.

Every server is ``python -m vllm.entrypoints.openai.api_server`` in a session of its own on
127.0.0.1 with ports picked free (HTTP and, for NIXL, the side channel), stopped by its process
group. Nothing here imports vLLM: the servers do.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What a route is called in tables and files, and what it runs.
CONNECTORS = ("kvxferd", "kvxferd_layerwise", "nixl", "nixl_1t", "nixl_push")
# Routes served by the one kvxferd engine pair (and its daemons): kvxferd_layerwise is the same
# engines asked per request (kv_transfer_params kvxfer_layerwise) to send layer parts.
KVXFERD_ROUTES = ("kvxferd", "kvxferd_layerwise")
# NixlPushConnector is not run by default: with vLLM 0.32's CPU build here the decode engine
# handshakes with the prefill engine and registers its blocks, the prefill engine never writes, and
# each request waits out push_registration_timeout (480 s), with or without --no-freeze.
# `--connectors kvxferd,nixl,nixl_push` runs it anyway.
DEFAULT_CONNECTORS = ("kvxferd", "nixl")
REFERENCE = "reference"
LABELS = {
    "kvxferd": "KvxferdConnector",
    "kvxferd_layerwise": "KvxferdConnector (layer-wise)",
    "nixl": "NixlConnector (pull)",
    "nixl_1t": "NixlConnector (pull, 1 UCX thread)",
    "nixl_push": "NixlPushConnector",
    REFERENCE: "one engine (reference)",
}
# vLLM's connector names for the NIXL routes.
_NIXL_CLASS = {"nixl": "NixlConnector", "nixl_1t": "NixlConnector", "nixl_push": "NixlPushConnector"}
# NixlConnector tuned for a small node: vLLM gives its NIXL agent 4 UCX threads by default
# (num_threads), which on 2 cores compete with the engine's own compute; "nixl_1t" gives it one,
# as kvxferd's daemon sizes its transfer threads to the cores.
_NIXL_EXTRA = {"nixl_1t": {"num_threads": 1}}

# Environment of every server. The engine core's executor stays in the engine core process
# (VLLM_ENABLE_V1_MULTIPROCESSING=0): the multiprocess executor adds a worker process whose
# message queue polls a core busy while idle, which on a shared 2-core machine would be most of
# what the bench measures. No hub, no usage reports, no thread pinning (engines share the cores).
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}


@dataclass(frozen=True)
class EngineConfig:
    """What every server of a run shares (only the connector differs)."""

    model: str
    max_model_len: int
    block_size: int
    kv_cache_bytes: int
    max_batched_tokens: int
    dtype: str


def free_port() -> int:
    """A port free right now on 127.0.0.1 (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The kvxferd prefill engine's group as its daemon knows it (KvxferdConnector's Settings.prefill_group
# of transfer_config's group): what a decode leg sent before the prefill answers must name.
KVXFERD_PREFILL_GROUP = "bench-prefill-prefill"


def pair_of(route: str) -> str:
    """The name of the server pair (and of its daemons' routes) that serves `route`."""
    return "kvxferd" if route in KVXFERD_ROUTES else route


def transfer_config(connector: str, role: str, daemon_socket: str) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM's --kv-transfer-config for one engine of a PD pair, and the environment it needs."""
    if connector == "kvxferd":
        return {
            "kv_connector": "KvxferdConnector", "kv_connector_module_path": "kvxfer_client.vllm",
            "kv_role": "kv_both",
            # 128 MiB ring: a few 2k-token prefill steps (16 MiB each at the default model) in flight.
            "kv_connector_extra_config": {"socket": daemon_socket, "group": f"bench-{role}", "ring_bytes": 128 << 20},
        }, {}
    if connector in _NIXL_CLASS:
        # CPU platform: the KV cache is DRAM, registered with NIXL as is (kv_buffer_device "cpu");
        # UCX backend. Each engine answers NIXL handshakes on its own side-channel port.
        return {
            "kv_connector": _NIXL_CLASS[connector], "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": "cpu", "kv_connector_extra_config": {"backends": ["UCX"], **_NIXL_EXTRA.get(connector, {})},
        }, {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    raise ValueError(f"unknown connector {connector!r}")


class Server:
    """One vLLM OpenAI server in a session of its own."""

    def __init__(self, name: str, workdir: Path, cfg: EngineConfig, ktc: dict[str, Any] | None,
                 env: Mapping[str, str]) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"{name}.log"
        self.ktc = ktc
        self.env = dict(env)
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model,
            "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len), "--block-size", str(cfg.block_size),
            "--max-num-batched-tokens", str(cfg.max_batched_tokens), "--kv-cache-memory-bytes", str(cfg.kv_cache_bytes),
            # Every run must prefill and move every prompt: no prefix cache across rounds.
            "--seed", "0", "--enforce-eager", "--no-enable-prefix-caching", "--uvicorn-log-level", "warning",
            "--disable-log-stats",
        ]
        if ktc is not None:
            args += ["--kv-transfer-config", json.dumps(ktc)]
        self.args = args
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **ENGINE_ENV, **self.env})

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return int(r.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def freeze(self, frozen: bool) -> None:
        """Freezes (SIGSTOP) or thaws (SIGCONT) the whole server, API process and engine core at once.

        An idle NIXL engine does not sleep: a thread of its engine core (the NIXL agent's UCX
        progress thread) polls a core; paused while other routes are measured, it does not take
        their CPU. Both engines of a pair freeze and thaw together, so neither sees the other silent.
        """
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after `timeout`."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def wait_all_healthy(servers: list[Server], timeout: float, progress: Callable[[str], None]) -> dict[str, float]:
    """Waits until every server answers /health; seconds from now each took. Servers start in
    parallel (engine start-up dominates a run)."""
    t0 = time.monotonic()
    ready: dict[str, float] = {}
    while len(ready) < len(servers):
        for s in servers:
            if s.name not in ready and s.healthy():
                ready[s.name] = round(time.monotonic() - t0, 1)
        waiting = [s.name for s in servers if s.name not in ready]
        if waiting and time.monotonic() - t0 > timeout:
            raise RuntimeError(f"servers not healthy after {timeout:.0f} s: {waiting}\n"
                               + "\n".join(f"--- {s.name}:\n{s.log_tail(1500)}" for s in servers if s.name in waiting))
        progress(f"engines starting: {len(ready)}/{len(servers)} up ({time.monotonic() - t0:.0f} s)")
        time.sleep(1.0)
    return ready


class Proxy:
    """The PD proxy (kvxferd.bench.engines_proxy) as a process of its own."""

    def __init__(self, workdir: Path, routes: dict[str, dict[str, Any]]) -> None:
        self.routes_file = workdir / "routes.json"
        self.routes_file.write_text(json.dumps(routes, indent=1))
        self.ready_file = workdir / "proxy.ready"
        self.log = workdir / "proxy.log"
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvxferd.bench.engines_proxy", "--routes", str(self.routes_file),
                 "--ready-file", str(self.ready_file)],
                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = ""

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited with {self.proc.returncode}:\n{self.log.read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"proxy not listening after {timeout:.0f} s")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{json.loads(self.ready_file.read_text())['port']}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# --------------------------------------------------------------------------- CPU per process tree


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(entry))
    return out


def tree_pids(root: int) -> list[int]:
    """`root` and every process under it (a vLLM server's engine core, resource tracker, ...)."""
    kids = _children()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def _cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class TreeCpuMeter:
    """CPU seconds (user + system) of named process trees between start() and stop()."""

    def __init__(self, roots: Mapping[str, int]) -> None:
        self.roots = dict(roots)
        self._before: dict[str, dict[int, float]] = {}
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._before = {name: {p: _cpu(p) for p in tree_pids(root)} for name, root in self.roots.items()}

    def stop(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, root in self.roots.items():
            before = self._before.get(name, {})
            # A process that appeared during the phase counts whole; one that ended is lost (none do here).
            out[name] = round(sum(_cpu(p) - before.get(p, 0.0) for p in tree_pids(root)), 3)
        out["_wall_s"] = round(time.monotonic() - self._t0, 3)
        return out
