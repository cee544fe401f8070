"""A small simulated fleet (bench/fleet_registry.py at CI size) through an etcd outage longer
than the 3 s that used to make every daemon re-register and re-read the fleet: every client comes
back on its old lease with its watch resumed, and no live daemon is reported gone."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.fleet_registry import run_fleet


def test_a_fleet_settles_after_an_etcd_outage_with_no_false_loss(short_tmp: Path) -> None:
    a = argparse.Namespace(records=120, engines=8, procs=2, outage=4.0, ttl=10, timeout=3.0, settle_limit=30.0,
                           setup_limit=120.0, hold=11.0, tick=0.25, start_rate=40.0, watchers=120)
    res = run_fleet(a, short_tmp)
    assert res["false_losses"] == 0, res["false_loss_sample"]
    assert res["settle_s"] <= 30.0, res
    # One reconnect per client, on its old lease, resuming its watch: nothing re-put or re-read.
    assert res["during_outage_and_recovery"] == {
        "sessions": 120, "lease_grants": 0, "leases_kept": 120, "puts": 0, "full_reads": 0, "resumes": 120,
        "gone_withdrawn": 0}, res
    # 11 s of quiet after settling (keep-alive pings included): no session ends.
    assert res["sessions_after_settling"] == 0, res
