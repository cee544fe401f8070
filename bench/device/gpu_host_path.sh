#!/usr/bin/env bash
# One device call: issue 12 on a GPU, the pinned host path and ranks starting together.
#   1. tests/gpu/test_gpu_host_path.py: kv_device follows the daemon's data_path, the host ring is
#      page-locked, every TP pair GPU -> pinned host -> NIXL DRAM -> pinned host -> GPU byte-exact
#      (chunks of 200 tokens over pages of 16), and GPU -> GPU through the host path against raw
#      NIXL DRAM -> DRAM on the same bytes, in the same run (done-when: >= 0.8x).
#   2. examples/pd_transformers.py, the six TP pairs started at once, with CUDA-IPC rings and then
#      through the pinned host path (done-when: 6 of 6 each, tokens identical).
# Run from the repo root on the GPU box, carrying .whl/ (bench/device/make_wheels.sh); each part fits
# one 10-minute device call:
#   bash bench/device/gpu_host_path.sh tests      # part 1 (~5 min)
#   bash bench/device/gpu_host_path.sh pd         # part 2 (~6 min)
# Writes under $OUT: host-path.json (one row per case), pytest.log, pd-vram/ and pd-host/.
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
PART=${1:-tests}
test_rc=0
pd_rc=0
if [ "$PART" = tests ]; then
PYTEST=(python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfEs)
rm -f "$OUT/host-path.jsonl"
KVX_GPU_RESULTS=$OUT/host-path.jsonl timeout -s INT -k 30 330 "${PYTEST[@]}" tests/gpu/test_gpu_host_path.py \
  2>&1 | tee "$OUT/pytest.log" | tail -30
test_rc=${PIPESTATUS[0]}
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = [json.loads(line) for line in open(f"{out}/host-path.jsonl")] if os.path.exists(f"{out}/host-path.jsonl") else []
from kvxferd.bench._common import write_json  # adds commit (KVX_COMMIT), machine, command
write_json(f"{out}/host-path.json", {"command": "bash bench/device/gpu_host_path.sh", "cases": rows})
for r in rows:
    extra = f"  raw NIXL DRAM {r['raw_nixl_dram_gb_per_s']} GB/s, ratio {r['host_over_raw']}" if "host_over_raw" in r else ""
    print(f"{r['case']:<14}{r['bytes'] / 2**20:>9.1f} MiB {r['gb_per_s']:>7.3f} GB/s byte-exact={r['byte_exact']}{extra}")
PY
fi
if [ "$PART" = pd ]; then
for staging in vram host; do
  echo "=== pd_transformers, six pairs at once, staging=$staging"
  OUT=$OUT/pd-$staging STAGING=$staging CASE_TIMEOUT=${CASE_TIMEOUT:-200} bash bench/device/gpu_pd_transformers.sh \
    | tail -8 || pd_rc=1
done
fi
echo "host-path pytest rc=$test_rc pd rc=$pd_rc"
exit $(( test_rc != 0 || pd_rc != 0 ))
