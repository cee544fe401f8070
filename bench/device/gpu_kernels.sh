#!/usr/bin/env bash
# One device call: GPU kernel tests (compiled, not interpreted), the CUDA IPC
# two-process test, then `kvxferd bench kernels`. Run from the repo root on the
# GPU box: bash bench/device/gpu_kernels.sh [bench args...]
# Writes pytest.log, bench.log and kernels.json under $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/kvxferd-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
# --confcutdir keeps other modules' conftests (and their imports) out of this run.
python3 -m pytest tests/kernels tests/test_layout.py -q -p no:cacheprovider --confcutdir=tests/kernels \
  -o addopts="" 2>&1 | tee "$OUT/pytest.log" | tail -25
test_rc=${PIPESTATUS[0]}
python3 -m kvxferd.bench.kernels --json "$OUT/kernels.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v " INFO "
bench_rc=${PIPESTATUS[0]}
echo "pytest rc=$test_rc bench rc=$bench_rc"
exit $(( test_rc != 0 || bench_rc != 0 ))
