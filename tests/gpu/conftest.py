"""Fixtures for the GPU end-to-end tests: one prefill and one decode daemon (subprocesses) shared by
each test, and a recorder that appends each case's numbers to $KVX_GPU_RESULTS (JSON lines).

Nothing here touches CUDA at import time, so collecting this package on a CPU-only machine works
(the tests themselves skip there).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2, engine_pb2_grpc
from tests.conftest import DaemonProc, spawn_daemon


def daemon_pair(
    request: pytest.FixtureRequest, *extra: str, pool: str = "64MiB"
) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """A prefill and a decode daemon (subprocesses, each its own NIXL agent), stopped afterwards;
    their logs are kept under $KVX_GPU_LOGDIR when it is set."""
    workdir = Path(tempfile.mkdtemp(prefix="kvxg-"))  # short: Unix socket paths
    started: list[DaemonProc] = []
    try:
        for name in ("prefill", "decode"):
            started.append(spawn_daemon(workdir, name, *extra, pool=pool))
        yield started[0], started[1]
    finally:
        for d in started:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        for d in started:
            try:
                d.proc.wait(30)
            except subprocess.TimeoutExpired:
                d.kill()
        keep = os.environ.get("KVX_GPU_LOGDIR")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            test = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)
            for d in started:
                shutil.copy(d.log, Path(keep) / f"{test}-{d.name}.log")
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def gpu_daemons(request: pytest.FixtureRequest) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """A fresh prefill daemon and decode daemon per test.

    Fresh per test so that each TP case is measured on its own; registering GPU rings on daemons
    that have already handshaken (engine restarts) is what test_restart_closes_ipc_mapping covers.
    """
    yield from daemon_pair(request)


@pytest.fixture
def record() -> Callable[[dict[str, Any]], None]:
    def put(row: dict[str, Any]) -> None:
        path = os.environ.get("KVX_GPU_RESULTS")
        if path:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")

    return put


def daemon_status(d: DaemonProc) -> engine_pb2.DaemonStatus:
    with grpc.insecure_channel(f"unix:{d.socket}") as ch:
        return engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=5)


_SAMPLE = re.compile(r'^kvxferd_transfer_bytes_total\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$')


def transfer_bytes(d: DaemonProc) -> dict[str, float]:
    """kvxferd_transfer_bytes_total summed by path ("nixl" | "local") from the daemon's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            path = re.search(r'path="([^"]*)"', m["labels"])
            key = path.group(1) if path else ""
            out[key] = out.get(key, 0.0) + float(m["value"])
    return out


def wait_log(d: DaemonProc, needle: str, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in d.log_text():
            return True
        time.sleep(0.1)
    return False
