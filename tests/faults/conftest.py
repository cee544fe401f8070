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

# The shared pair's daemons while it is up: a failed test's report ends with the tail of their logs,
# which a CI failure would otherwise take away with the temp dir (a flaky pause test's did).
_LIVE: list[DaemonProc] = []
LOG_TAIL = 80


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    if not rep.failed:
        return
    for d in _LIVE:
        try:
            lines = d.log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
        except OSError as exc:
            lines = [f"(log unreadable: {exc})"]
        rep.sections.append((f"{d.name} daemon log, last {LOG_TAIL} lines", "\n".join(lines)))


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """A prefill and a decode daemon with the test-only fault hook on; every test using them must
    leave zero slots and both daemons serving (each checks that itself)."""
    workdir = Path(tempfile.mkdtemp(prefix="kvxf-"))
    started: list[DaemonProc] = []
    try:
        launched = launch_pair(workdir, started, "--set", "fault_injection=true")
        _LIVE[:] = started
        yield launched
    finally:
        _LIVE.clear()
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
