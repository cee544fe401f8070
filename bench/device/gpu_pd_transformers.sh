#!/usr/bin/env bash
# One device call: issue #5 on a GPU. examples/pd_transformers.py with --device cuda for every TP
# pair: model and paged KV pools on the GPU, each engine's staging ring a CUDA tensor the daemon
# imports by CUDA IPC (gather/scatter with the Triton kernels on the device), VRAM over NIXL between
# two daemons. Run from the repo root on the GPU box, carrying .whl/ (bench/device/make_wheels.sh):
#   bash bench/device/gpu_pd_transformers.sh
# STAGING=host runs the same six pairs through the pinned host path instead (host-pool rings that
# each GPU engine page-locks; DRAM over NIXL); STAGING=auto follows the daemons' data_path.
# Writes under $OUT: pd-<ptp>-<dtp>.json (the example's report) and .log, pd-gpu.json (summary).
set -uo pipefail
# shellcheck source=bench/device/_env.sh
EXTRA_WHEELS='.whl/hf/*.whl' . bench/device/_env.sh
# Same GQA shape as the CPU check (2 KV heads: TP 4 replicates them), bigger: 8 layers, head dim 64,
# prompts up to 256 tokens in chunks of 64, pages of 16, 8 rooms per dtype.
ARGS=(--arch llama --layers 8 --heads 8 --kv-heads 2 --head-dim 64 --hidden 512 --vocab 2048
      --prompt-tokens 256 --chunk-tokens 64 --page-size 16 --new-tokens 16 --rooms 8
      --dtype "bfloat16,float32" --device cuda --staging "${STAGING:-vram}" --timeout "${CASE_TIMEOUT:-170}")
# The six pairs run at once (16 cores, one GPU): rank start-up (imports) dominates a case, and the
# device time is short. Each case has its own two daemons.
rc=0
pids=()
for pair in 1:1 2:1 1:2 4:2 2:4 1:4; do
  p=${pair%:*}; d=${pair#*:}
  timeout "${CASE_TIMEOUT:-170}" python3 examples/pd_transformers.py "${ARGS[@]}" --prefill-tp "$p" --decode-tp "$d" \
    --json "$OUT/pd-$p-$d.json" > "$OUT/pd-$p-$d.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
for f in "$OUT"/pd-*-*.log; do echo "=== $f"; tail -3 "$f"; done
python3 - "$OUT" <<'PY'
import glob, json, subprocess, sys, torch
out = sys.argv[1]
rows = []
for f in sorted(glob.glob(f"{out}/pd-*-*.json")):
    r = json.load(open(f))
    c = r["config"]
    rows.append({k: r.get(k) for k in ("ok", "tokens_match", "first_mismatch", "max_abs_kv_diff", "kv_bit_identical",
                                        "bytes_moved", "bytes_gathered", "wall_s", "rooms", "staging_ring", "errors")}
                | {"prefill_tp": c["prefill_tp"], "decode_tp": c["decode_tp"]})
env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip().splitlines()[0]}
json.dump({"env": env, "args": sys.argv[2:], "cases": rows}, open(f"{out}/pd-gpu.json", "w"), indent=1)
for r in rows:
    print(f"TP {r['prefill_tp']}->{r['decode_tp']}: ok={r['ok']} tokens_match={r['tokens_match']} "
          f"max|dKV|={r['max_abs_kv_diff']} ring={r['staging_ring']} bytes={r['bytes_moved']} wall={r['wall_s']}s")
PY
exit $rc
