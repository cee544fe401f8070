"""Soak: many tiny rooms through two daemons; memory and file descriptors stay flat, nothing is
left held. CI runs KVX_SOAK_ROOMS (default 1,000) rooms; the full run is `kvxferd bench soak`
(100,000 rooms; its measured result is in docs/faults.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvxferd.bench.soak import run
from tests.conftest import ROOT


@pytest.mark.slow
def test_soak_memory_and_fds_flat_no_slots_left() -> None:
    rooms = int(os.environ.get("KVX_SOAK_ROOMS", "1000"))
    res = run(rooms, window=128, batch=64, warmup=0.2)
    assert "error" not in res, res["error"] + "\n" + json.dumps(res.get("logs", {}), indent=1)[-3000:]
    summary = {k: res[k] for k in ("memory_and_fds", "slots_held", "rooms_left", "rooms_per_s")}
    assert res["checks"]["all_rooms_success"], res["engines"]
    assert res["checks"]["bytes_checked"], res["engines"]["decode"]
    for check in ("rss_flat", "fds_flat", "no_slots_held", "no_rooms_left"):
        assert res["checks"][check], (check, summary)
    assert res["exit_codes"] == {"prefill": 0, "decode": 0}, res["exit_codes"]
    print("soak", json.dumps(summary))


def test_soak_command_is_wired() -> None:
    # `kvxferd bench soak` reaches the soak's own parser (which refuses zero rooms).
    out = subprocess.run([sys.executable, "-m", "kvxferd", "bench", "soak", "--rooms", "0"], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "kvxferd bench soak" in out.stderr and "--rooms" in out.stderr, out
