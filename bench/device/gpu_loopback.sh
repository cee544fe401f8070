#!/usr/bin/env bash
# One device call: the control-plane and loopback benchmarks on the GPU box's 16 cores (where a
# user's node is), kvxferd against raw NIXL measured in the same run, bytes verified.
# Run from the repo root on the GPU box, carrying .whl/ (bench/device/make_wheels.sh):
#   bash bench/device/gpu_loopback.sh
# Writes under $OUT: rpc.json, loopback.json, loopback.png, loopback-cdf.png and the logs.
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
nproc
timeout -s INT 240 python3 -m kvxferd.bench.rpc --json "$OUT/rpc.json" 2>&1 | tee "$OUT/rpc.log" | tail -25
rpc_rc=${PIPESTATUS[0]}
timeout -s INT 330 python3 -m kvxferd.bench.loopback --no-mooncake --chunk-tokens 16,64 --concurrency 1,16 \
  --json "$OUT/loopback.json" --plot "$OUT/loopback.png" 2>&1 | tee "$OUT/loopback.log" | tail -40
lb_rc=${PIPESTATUS[0]}
echo "rpc rc=$rpc_rc loopback rc=$lb_rc"
exit $(( rpc_rc != 0 || lb_rc != 0 ))
