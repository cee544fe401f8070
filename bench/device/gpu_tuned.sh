#!/usr/bin/env bash
# One device call (issue #38): kvxferd against the transport at its best on the GPU box's 16 cores.
# `kvxferd bench loopback` at the daemon's default worker count, then at 8, 4, 6 and 12 workers while
# the call's time allows, each with the tuned raw NIXL pair (as many UCX workers and posting threads as
# the daemons, pools like theirs), the memcpy ceiling and mixed TP; bytes verified in every run.
# The headline chunk (64 tokens = 20 MiB) and 256 tokens (80 MiB: TP 4->2 parts of 20 MiB, which tells a
# per-WRITE cost from a per-byte one) at 16 rooms in flight keep a run at ~40 s (H200 box, 16 cores), so
# the call's wall time is predictable, ~3 min, well under 9 (each run is cut at RUN_S; a run is only
# started if it fits in BUDGET_S).
# Run from the repo root on the GPU box, carrying .whl/ (bench/device/make_wheels.sh):
#   bash bench/device/gpu_tuned.sh
# Writes under $OUT (8 files: a device call returns only a few): loopback-wN.json per worker count,
# the PNG and latency CDF of the default count's run, tuned.log (every run's output) and tuned.json
# (a summary row per worker count), and prints that summary.
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
BUDGET_S=${BUDGET_S:-520}
RUN_S=${RUN_S:-150}
nproc
default=$(python3 -c 'from kvxferd.config import Config; print(Config().transfer_workers)') || exit 1
echo "default workers here: $default"
rc=0
for n in "$default" 8 4 6 12; do
  [ -e "$OUT/loopback-w$n.json" ] && continue  # the default is one of the others
  if (( SECONDS + RUN_S > BUDGET_S )); then
    echo "skipping $n workers: ${SECONDS}s gone of ${BUDGET_S}s"
    continue
  fi
  echo "=== $n workers (t=${SECONDS}s)"
  plot=()
  [ "$n" = "$default" ] && plot=(--plot "$OUT/loopback-w$n.png")
  timeout -s INT "$RUN_S" python3 -m kvxferd.bench.loopback --no-mooncake --no-reference --workers "$n" \
    --chunk-tokens 64,256 --concurrency 16 --json "$OUT/loopback-w$n.json" "${plot[@]}" >"$OUT/run.log" 2>&1
  r=$?
  { echo "=== $n workers"; cat "$OUT/run.log"; } >>"$OUT/tuned.log"
  tail -16 "$OUT/run.log"
  rm -f "$OUT/run.log"
  echo "$n workers: rc=$r (t=${SECONDS}s)"
  (( r != 0 )) && rc=1
done
DEFAULT_WORKERS=$default python3 - "$OUT" <<'EOF'
import glob, json, os, sys
rows = []
for f in glob.glob(os.path.join(sys.argv[1], "loopback-w*.json")):
    r = json.load(open(f))
    ra, s = r["ratios"], r["settings"]
    med = lambda path: (lambda v: sorted(v)[len(v) // 2] if v else None)(ra["headline_runs"].get(path, []))
    rows.append({
        "workers": s["transfer_workers"], "default": s["transfer_workers"] == int(os.environ["DEFAULT_WORKERS"]),
        "kvxferd_gbps": med("kvxferd"), "raw_tuned_gbps": med("raw_nixl_tuned"),
        "raw_1thread_gbps": med("raw_nixl"), "memcpy_gbps": med("memcpy"),
        **{k: ra.get(k) for k in ("kvxferd_over_raw_nixl", "kvxferd_over_raw_nixl_1thread",
                                  "raw_nixl_tuned_over_memcpy", "mixed_tp_over_same_tp", "mixed_tp_over_same_tp_by_pair",
                                  "kvxferd_cpu_over_raw_nixl", "cpu_s_per_gb", "bytes_verified")},
        "mixed_tp_80MiB_chunks": ra["by_chunk_tokens"].get("256", {}).get("mixed_tp_over_same_tp"),
        "runtime_s": r["runtime_s"], "failures": len(r["failures"]),
    })
rows.sort(key=lambda x: x["workers"])
json.dump({"cores": os.cpu_count(), "rows": rows}, open(os.path.join(sys.argv[1], "tuned.json"), "w"), indent=2)
fmt = lambda v: "-" if v is None else f"{v:.2f}"
print("workers  kvxferd  raw-tuned  raw-1thr  memcpy  kvx/tuned  kvx/1thr  tuned/memcpy  mixedTP  cpu/tuned  verified"
      "  mixedTP by pair (20 MiB chunks; 80 MiB chunks)")
for x in rows:
    print(f"{x['workers']:>3}{'*' if x['default'] else ' '}    {fmt(x['kvxferd_gbps']):>7}  {fmt(x['raw_tuned_gbps']):>9}  "
          f"{fmt(x['raw_1thread_gbps']):>8}  {fmt(x['memcpy_gbps']):>6}  {fmt(x['kvxferd_over_raw_nixl']):>9}  "
          f"{fmt(x['kvxferd_over_raw_nixl_1thread']):>8}  {fmt(x['raw_nixl_tuned_over_memcpy']):>12}  "
          f"{fmt(x['mixed_tp_over_same_tp']):>7}  {fmt(x['kvxferd_cpu_over_raw_nixl']):>9}  {x['bytes_verified']!s:>8}"
          f"  {x['mixed_tp_over_same_tp_by_pair']}; {x['mixed_tp_80MiB_chunks']}")
EOF
echo "tuned rc=$rc (t=${SECONDS}s)"
exit $rc
