#!/usr/bin/env bash
# One device call (issue #38): kvxferd / tuned raw NIXL with the noise of the box taken out as far as
# one call can: every run pinned to the same 16 cores (taskset; on a 32-core two-GPU host the
# default worker count is then the 16-core one), RUNS runs of `kvxferd bench loopback` at each
# worker count of WORKERS, each run 3 rounds with the arms interleaved (kvxferd, raw tuned, raw
# 1-thread, memcpy; loopback_paths), the ratio taken per round (the arms of one round ran back to
# back), then the median and the spread over all rounds. PROFILE=1 adds one py-spy'd run at the
# first worker count afterwards (py-spy at $PYSPY, kept out of the measured runs: sampling costs
# the daemons CPU).
# Run from the repo root there, carrying .whl/ (bench/device/make_wheels.sh):
#   WORKERS="default 8" RUNS=2 bash bench/device/gpu_tuned_rounds.sh
# Writes $OUT/rounds.json (every round, medians, spreads), loopback-wN-rK.json, rounds.log.
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
PIN=(taskset -c "${CORES:-0-15}")
RUNS=${RUNS:-2}
RUN_S=${RUN_S:-110}
"${PIN[@]}" nproc
default=$("${PIN[@]}" python3 -c 'from kvxferd.config import Config; print(Config().transfer_workers)') || exit 1
counts=()
for n in ${WORKERS:-default 8}; do
  [ "$n" = default ] && n=$default
  [[ " ${counts[*]} " == *" $n "* ]] || counts+=("$n")
done
echo "default workers on the pinned cores: $default; counts: ${counts[*]}"
rc=0
one_run() {  # workers, tag, extra args
  local n=$1 tag=$2
  shift 2
  timeout -s INT "$RUN_S" "${PIN[@]}" python3 -m kvxferd.bench.loopback --no-mooncake --no-reference --workers "$n" \
    --chunk-tokens 64 --concurrency 16 --json "$OUT/loopback-w$n-$tag.json" "$@" >"$OUT/run.log" 2>&1
  local r=$?
  { echo "=== $n workers $tag rc=$r"; cat "$OUT/run.log"; } >>"$OUT/rounds.log"
  grep -E "kvxferd|raw|memcpy" "$OUT/run.log" | tail -6
  echo "$n workers $tag: rc=$r (t=${SECONDS}s)"
  return $r
}
for k in $(seq 1 "$RUNS"); do
  for n in "${counts[@]}"; do
    one_run "$n" "r$k" || rc=1
  done
done
if [ "${PROFILE:-0}" = 1 ] && [ -f "${PYSPY:-}" ]; then
  mkdir -p /tmp/pyspy-bin && cp "$PYSPY" /tmp/pyspy-bin/py-spy && chmod +x /tmp/pyspy-bin/py-spy
  PATH=/tmp/pyspy-bin:$PATH one_run "${counts[0]}" profiled --profile /tmp/kvx-prof || rc=1
fi
DEFAULT_WORKERS=$default python3 - "$OUT" <<'EOF'
import glob, json, os, re, statistics, sys
out, rows = sys.argv[1], {}
for f in sorted(glob.glob(os.path.join(out, "loopback-w*-r*.json"))):
    n = int(re.search(r"-w(\d+)-r", f)[1])
    r = json.load(open(f))
    runs, cpu = r["ratios"]["headline_runs"], r["ratios"].get("cpu_s_per_gb") or {}
    row = rows.setdefault(n, {"workers": n, "default": n == int(os.environ["DEFAULT_WORKERS"]), "rounds": [],
                              "cpu_s_per_gb_runs": [], "failures": 0})
    row["failures"] += len(r["failures"])
    for kv, raw, one, mem in zip(runs["kvxferd"], runs["raw_nixl_tuned"], runs["raw_nixl"], runs["memcpy"]):
        row["rounds"].append({"file": os.path.basename(f), "kvxferd": kv, "raw_tuned": raw, "raw_1thread": one,
                              "memcpy": mem, "ratio": round(kv / raw, 4)})
    row["cpu_s_per_gb_runs"].append(cpu)
summary = []
for n, row in sorted(rows.items()):
    ratios = [x["ratio"] for x in row["rounds"]]
    med = lambda key: statistics.median(x[key] for x in row["rounds"])
    cpu_k = [c["kvxferd"] for c in row["cpu_s_per_gb_runs"] if c.get("kvxferd")]
    cpu_r = [c["raw_nixl_tuned"] for c in row["cpu_s_per_gb_runs"] if c.get("raw_nixl_tuned")]
    row.update({
        "ratio_median": round(statistics.median(ratios), 4), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "kvxferd_gbps_median": med("kvxferd"), "raw_tuned_gbps_median": med("raw_tuned"),
        "raw_tuned_spread": [min(x["raw_tuned"] for x in row["rounds"]), max(x["raw_tuned"] for x in row["rounds"])],
        "kvxferd_spread": [min(x["kvxferd"] for x in row["rounds"]), max(x["kvxferd"] for x in row["rounds"])],
        "cpu_over_raw_tuned": round(statistics.median(cpu_k) / statistics.median(cpu_r), 4) if cpu_k and cpu_r else None,
    })
    summary.append(row)
prof = sorted(glob.glob(os.path.join(out, "loopback-w*-profiled.json")))
top = json.load(open(prof[0])).get("profiles", {}) if prof else {}
json.dump({"cores": len(os.sched_getaffinity(0)), "pinned": True, "rows": summary, "profile_top": top},
          open(os.path.join(out, "rounds.json"), "w"), indent=1)
for name, p in sorted(top.items()):
    if "daemon" in name:
        print(f"py-spy top of {name}:")
        for f in p.get("top", [])[:int(os.environ.get("PROFILE_TOP", "12"))]:
            print(f"  self {f['self_pct']:5.1f}%  incl {f['incl_pct']:5.1f}%  {f['frame'][:150]}")
for x in summary:
    print(f"{x['workers']}{'*' if x['default'] else ''} workers: kvxferd/tuned median {x['ratio_median']:.3f} "
          f"(min {x['ratio_min']:.3f} max {x['ratio_max']:.3f}, {len(x['rounds'])} rounds); kvxferd "
          f"{x['kvxferd_gbps_median']:.1f} GB/s {x['kvxferd_spread']}, raw tuned {x['raw_tuned_gbps_median']:.1f} GB/s "
          f"{x['raw_tuned_spread']}; CPU/GB over tuned {x['cpu_over_raw_tuned']}; failures {x['failures']}")
EOF
echo "rounds rc=$rc (t=${SECONDS}s)"
exit $rc
