"""What a newcomer meets on the command line: each bench's own --help, `kvxferd status` pointed at a
peer port, and a port another process holds (one clear line, nothing started)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvxferd.cli import main as cli
from tests.conftest import ROOT, daemon_env

# An option only that bench has: the usage printed must be the bench's own, not `kvxferd bench`'s.
BENCH_OPTIONS = {"loopback": "--chunk-tokens", "rpc": "--rate", "soak": "--window", "engines": "--connectors"}


@pytest.mark.parametrize("name", sorted(BENCH_OPTIONS))
def test_bench_name_help_prints_that_benchs_options(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli(["bench", name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvxferd bench {name} ")
    assert BENCH_OPTIONS[name] in out


def test_bench_without_name_lists_the_benches(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BENCH_OPTIONS)
    assert cli(["bench"]) == 2


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxferd", "serve", *args], capture_output=True, text=True,
                          env=daemon_env(), cwd=ROOT, timeout=timeout)


def test_status_at_peer_port_and_port_clash(daemons: Any) -> None:
    d = daemons("a")
    # status at the peer port: one line naming what the port is and where the engine API is
    st = subprocess.run([sys.executable, "-m", "kvxferd", "status", "--socket", d.peer_address],
                        capture_output=True, text=True, env=daemon_env(), cwd=ROOT, timeout=120)
    assert st.returncode == 2, st.stderr
    assert "is a kvxferd peer port" in st.stderr and "engine API" in st.stderr
    assert "UNIMPLEMENTED" not in st.stderr
    # a second daemon on the first one's peer port, then on its metrics port: one line each, exit 2,
    # no gRPC core log line, and it stops before making a pool or a socket
    work = Path(daemons.workdir)
    for flags, what in ((["--peer-listen", d.peer_address, "--metrics-port", "-1"], "peer service"),
                        (["--peer-listen", "127.0.0.1:0", "--metrics-port", str(d.metrics_port)], "metrics")):
        res = _serve("--socket", str(work / "b.sock"), "--log-format", "text", *flags)
        assert res.returncode == 2, res.stderr
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1, res.stderr
        assert lines[0].startswith("kvxferd: error: ") and what in lines[0] and "already in use" in lines[0]
        assert "--peer-listen" in lines[0]
        assert not (work / "b.sock").exists()
    assert d.proc.poll() is None, "the first daemon must be untouched"


def test_port_clash_with_a_plain_listener(short_tmp: Path) -> None:
    """Any process, not only a kvxferd: a listening socket on the metrics port stops the start."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        res = _serve("--socket", str(short_tmp / "c.sock"), "--peer-listen", "127.0.0.1:0",
                     "--metrics-port", str(port))
    assert res.returncode == 2
    assert f"127.0.0.1:{port} for the metrics (metrics_port) is already in use" in res.stderr
