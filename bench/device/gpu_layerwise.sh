#!/usr/bin/env bash
# One device call: issue #37's layer-wise TTFT on a GPU (docs/design/layerwise.md §5). Run from the
# repo root on the GPU box, carrying .whl/ (bench/device/make_wheels.sh; its hf/ wheels too):
#   KVX_COMMIT=<commit, from this checkout> bash bench/device/gpu_layerwise.sh   (the copy there has no .git)
# 1. tests/gpu/test_gpu_layerwise.py first (fail fast): --layerwise --device cuda, CUDA IPC and
#    pinned host rings, small model, every byte.
# 2. examples/pd_transformers.py --layerwise-compare --timing at 1k, 4k and 8k tokens, a random-weight
#    Llama of 8B shape (32 layers, 32 heads, 8 KV heads x 128, 4096 hidden, 14336 MLP, 128256 vocab),
#    bf16, one chunk a prompt, TP 1->1, through the pinned host path and through CUDA IPC rings: per
#    prompt whole chunks, layer-wise and compute-only interleaved, 3 reps (+ one warm-up round).
#    TTFT = prefill forward begins -> the decode's last scatter synced.
# Targets, reported not asserted: TTFT layer-wise <= compute + 15 %; exposed transfer (TTFT - compute)
# cut >= 70 % against whole chunks.
# Writes under $OUT: pytest.log, compare-<staging>.json/.log and layerwise-gpu-<card>.json (the summary,
# for bench/results/).
set -uo pipefail
# shellcheck source=bench/device/_env.sh
EXTRA_WHEELS='.whl/hf/*.whl' . bench/device/_env.sh
t0=$(date +%s)

# Both stagings' cases at once: correctness only (GPU contention does not matter), half the wall time.
# SKIP_TESTS=1: straight to the timing (when the same commit's tests passed in an earlier call).
pids=()
[ -n "${SKIP_TESTS:-}" ] && echo "gpu tests skipped (SKIP_TESTS)" > "$OUT/pytest-skipped.log"
tests="vram host"
[ -n "${SKIP_TESTS:-}" ] && tests=""
for k in $tests; do
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfEs -s \
    tests/gpu/test_gpu_layerwise.py -k "$k" > "$OUT/pytest-$k.log" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
cat "$OUT"/pytest-*.log > "$OUT/pytest.log"
tail -n 5 "$OUT"/pytest-*.log
echo "gpu tests: rc=$rc after $(( $(date +%s) - t0 )) s"
[ "$rc" = 0 ] || [ -n "${KVX_LW_BENCH_ANYWAY:-}" ] || exit 1

ARGS=(--arch llama --layers 32 --heads 32 --kv-heads 8 --head-dim 128 --hidden 4096 --intermediate 14336
      --vocab 128256 --dtype bfloat16 --prompt-lengths "${LENGTHS:-1024,4096,8192}" --chunk-tokens 8192
      --page-size 16 --new-tokens 4 --device cuda --layerwise-compare --reps "${REPS:-3}" --timeout 240)
# One staging at a time: each owns the GPU while it is timed. STAGINGS: which (default both).
for s in ${STAGINGS:-host vram}; do
  timeout "${CMP_TIMEOUT:-280}" python3 examples/pd_transformers.py "${ARGS[@]}" --staging "$s" \
    --json "$OUT/compare-$s.json" > "$OUT/compare-$s.log" 2>&1 || rc=1
  tail -6 "$OUT/compare-$s.log"
  echo "compare $s: after $(( $(date +%s) - t0 )) s"
done

python3 - "$OUT" "${ARGS[@]}" <<'PY'
import json, os, subprocess, sys, torch
out, args = sys.argv[1], sys.argv[2:]
name = torch.cuda.get_device_name()
card = next((c for c in ("h200", "h100", "a100", "l40") if c in name.lower()), "gpu")
smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                     text=True).stdout.strip().splitlines()
tests = open(f"{out}/pytest.log").read().splitlines()
res = {"bench": "layerwise-gpu", "commit": os.environ.get("KVX_COMMIT", "unknown"),
       "machine": {"gpu": name, "driver": smi[0] if smi else "", "torch": torch.__version__, "cuda": torch.version.cuda,
                   "cpus": os.cpu_count()},
       "command": "bash bench/device/gpu_layerwise.sh: examples/pd_transformers.py " + " ".join(args)
                  + " --staging host|vram",
       "gpu_tests": [ln for ln in tests if "passed" in ln or "failed" in ln or ln.startswith("layerwise ")],
       "targets": "TTFT layer-wise <= compute-only + 15 %; exposed (TTFT - compute) cut >= 70 % vs whole chunks",
       "stagings": {}}
for s in ("host", "vram"):
    try:
        r = json.load(open(f"{out}/compare-{s}.json"))
    except (OSError, ValueError) as exc:
        res["stagings"][s] = {"error": str(exc)}
        continue
    res["stagings"][s] = {k: r.get(k) for k in ("ok", "tokens_match", "kv_bit_identical", "staging_ring", "errors",
                                                "layer_groups_sent", "layer_parts_sent", "layer_groups_early",
                                                "wall_s", "compare", "timing")}
json.dump(res, open(f"{out}/layerwise-gpu-{card}.json", "w"), indent=1)
for s, r in res["stagings"].items():
    print(f"== {s}: ok={r.get('ok')} errors={r.get('errors')}")
    for c in r.get("compare") or []:
        print(f"  {c['prompt_tokens']:>5} tok: compute {c['compute_ms']} ms (hooked {c['compute_in_layerwise_ms']}), "
              f"TTFT whole {c['ttft_whole_ms']} layer-wise {c['ttft_layerwise_ms']} (x{c['layerwise_over_compute']}), "
              f"exposed {c['exposed_whole_ms']} -> {c['exposed_layerwise_ms']} ms, cut {c['exposed_cut']}")
PY
echo "total $(( $(date +%s) - t0 )) s"
exit $rc
