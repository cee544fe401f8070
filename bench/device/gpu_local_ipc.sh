#!/usr/bin/env bash
# One device call (issue #38): two daemons on one host move VRAM by CUDA IPC (kvxferd/transports/local_ipc.py).
# From the repo root there, carrying the small wheels of .whl/ (grpcio, grpcio-health-checking,
# grpcio-reflection, protobuf, aetcd, nixl_slim.tar.xz; bench/device/make_wheels.sh):
#   KVX_COMMIT=<commit> bash bench/device/gpu_local_ipc.sh
# Runs tests/gpu/test_gpu_local_ipc.py (TP 1->1, 2->2, 4->2 and 4/16/64 MiB chunks, GPU 0 -> GPU 0 and,
# with two GPUs, GPU 0 -> GPU 1, every byte checked, device copy / cudaMemcpyPeer measured in the
# same run). Writes $OUT/gpu-local-ipc.json (commit, machine, command, env, cases), pytest.log.
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } \
  > "$OUT/topo.txt" 2>&1
head -4 "$OUT/topo.txt"
KVX_GPU_RESULTS=$OUT/results.jsonl KVX_GPU_LOGDIR=/tmp/kvx-logs timeout -s INT -k 20 "${TEST_S:-240}" \
  python3 -m pytest -q -s -p no:cacheprovider -o addopts="" -rfEs tests/gpu/test_gpu_local_ipc.py \
  2>&1 | tee "$OUT/pytest.log" | grep -vE "^\s*$" | tail -40
test_rc=${PIPESTATUS[0]}
for f in /tmp/kvx-logs/*.log; do
  [ -e "$f" ] && { echo "--- $f"; grep -iE "CUDA IPC|same host|this host|error|warn|traceback" "$f" | head -12; }
done > "$OUT/daemon-lines.txt"
head -c 3000 "$OUT/daemon-lines.txt"

python3 - "$OUT" <<'PY'
import json, os, subprocess, sys, torch
out = sys.argv[1]
rows = [json.loads(line) for line in open(f"{out}/results.jsonl")] if os.path.exists(f"{out}/results.jsonl") else []
env = {
    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "peer_access_0_1": torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1),
    "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()[0],
    "torch": torch.__version__, "cuda": torch.version.cuda,
}
from kvxferd.bench._common import write_json
write_json(f"{out}/gpu-local-ipc.json", {"command": "bash bench/device/gpu_local_ipc.sh", "env": env, "cases": rows})
for r in rows:
    print({k: r[k] for k in ("case", "gb_per_s", "copy_gb_per_s", "device_copy_gb_per_s", "memcpy_peer_gb_per_s",
                             "device_copy_synced_per_chunk_gb_per_s", "gpu_only_gb_per_s", "ratio", "ratio_to_synced",
                             "jobs", "batches", "job_us_per_job", "gpu_us_per_job", "launch_us_per_job",
                             "wait_us_per_job", "notify_us_per_job", "byte_exact", "problems") if k in r})
PY
echo "pytest rc=$test_rc"
exit "$test_rc"
