#!/usr/bin/env bash
# One device call on a two-GPU box (issue #38, GPU to GPU inside a node). From the repo root there:
#   KVX_COMMIT=<commit> bash bench/device/gpu_p2p.sh
# carrying .whl/ (bench/device/make_wheels.sh; grpcio/protobuf/aetcd wheels and nixl_slim.tar.xz suffice).
# Writes under $OUT: gpu-p2p.json (probe + test rows + environment), probe.log, pytest.log, topo.txt.
#  1. ucx_cuda_ipc_probe.py: what UCX moves VRAM with between two processes, for memory each side
#     cudaMalloc'd itself vs memory it imported by CUDA IPC (the daemon's rings), GPU 0->0 and 0->1;
#  2. tests/gpu/test_gpu_two_gpus.py: one daemon and two daemons, prefill on GPU 0, decode on GPU 1,
#     byte for byte, with cudaMemcpyPeer and device copies measured in the same run;
#  3. the one-GPU same-node test (its metrics path is now local-gpu).
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } \
  > "$OUT/topo.txt" 2>&1
cat "$OUT/topo.txt"
timeout 300 python3 bench/device/ucx_cuda_ipc_probe.py "$OUT/probe.json" 2>&1 | tee "$OUT/probe.log" | cut -c1-600

PYTEST=(python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfEs)
[ -n "${PROBE_ONLY:-}" ] && exit 0  # the probe alone (its JSON is $OUT/probe.json)
# PROBE_COPIES_ONLY=1: the probe skips the UCX variants (same-node copies only), the tests run.
KVX_GPU_RESULTS=$OUT/results.jsonl KVX_GPU_LOGDIR=/tmp/kvx-logs timeout -s INT -k 30 330 \
  "${PYTEST[@]}" tests/gpu/test_gpu_two_gpus.py "tests/gpu/test_gpu_e2e.py::test_same_node_device_copy" \
  2>&1 | tee "$OUT/pytest.log" | tail -30
test_rc=${PIPESTATUS[0]}
for f in /tmp/kvx-logs/*.log; do [ -e "$f" ] && { echo "--- $f"; grep -iE "GPU [0-9] <->|error|fail|traceback" "$f" | head -20; }; done > "$OUT/daemon-lines.txt"
head -c 4000 "$OUT/daemon-lines.txt"

python3 - "$OUT" <<'EOF'
import json, os, subprocess, sys, torch
out = sys.argv[1]
rows = [json.loads(line) for line in open(f"{out}/results.jsonl")] if os.path.exists(f"{out}/results.jsonl") else []
probe = json.load(open(f"{out}/probe.json")) if os.path.exists(f"{out}/probe.json") else None
env = {
    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "peer_access_0_1": torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1),
    "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()[0],
    "torch": torch.__version__, "cuda": torch.version.cuda, "nixl": "1.5.1 (nixl_cu13, UCX backend)",
}
from kvxferd.bench._common import write_json
write_json(f"{out}/gpu-p2p.json", {"command": "bash bench/device/gpu_p2p.sh", "env": env, "probe": probe, "cases": rows})
print(f"{'case':<14}{'path':<14}{'MiB':>8}{'s':>8}{'GB/s':>8}{'copy':>8}{'peer':>8}{'dev':>8}  exact")
for r in rows:
    print(f"{r['case']:<14}{r['path']:<14}{r['bytes'] / 2**20:>8.1f}{r['seconds']:>8.3f}{r['gb_per_s']:>8.3f}"
          f"{r.get('copy_gb_per_s') or 0:>8.2f}{r.get('memcpy_peer_gb_per_s') or 0:>8.1f}"
          f"{r.get('device_copy_gb_per_s') or 0:>8.1f}  {r['byte_exact']} {'; '.join(r.get('problems', []))[:200]}")
EOF
echo "pytest rc=$test_rc"
exit "$test_rc"
