"""Fixtures of the fault tests: one shared pair of daemons per module (starting two NIXL agents
costs seconds on 2 cores), engine fleets per test."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonProc
from tests.faults.harness import Fleet, launch_pair


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """A prefill and a decode daemon with the test-only fault hook on; every test using them must
    leave zero slots and both daemons serving (each checks that itself)."""
    workdir = Path(tempfile.mkdtemp(prefix="kvxf-"))
    started: list[DaemonProc] = []
    try:
        yield launch_pair(workdir, started, "--set", "fault_injection=true")
    finally:
        for d in started:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        for d in started:
            try:
                d.proc.wait(20)
            except subprocess.TimeoutExpired:
                d.kill()
        if not os.environ.get("KVX_KEEP_LOGS"):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"daemon logs kept in {workdir}")


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        f.close()
