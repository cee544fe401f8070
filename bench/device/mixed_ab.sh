#!/usr/bin/env bash
# One device call (issue #38, mixed TP at 8 workers): kvxferd TP 1->1 and TP 4->2 points of two trees,
# interleaved, on 16 of the box's cores (taskset: numbers compare with the 16-core box's), then
# bench/device/gpu_tuned.sh of tree B at the default worker count (8 on 16 cores) for the headline
# ratios. The trees are `git archive REV | tar -x -C .whl/snap-NAME` (carried under .whl/).
# Run from the repo root there:  A=mixbase B=mixnew ROUNDS=2 bash bench/device/mixed_ab.sh
# (TREES="t1 t2 t3" interleaves more trees; B is the one gpu_tuned.sh measures).
# Writes $OUT/ab.log (one line per point), the gpu_tuned.sh files of tree B, and prints a summary.
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
A=${A:-mixbase} B=${B:-mixnew} ROUNDS=${ROUNDS:-2} WORKERS=${WORKERS:-8} GB=${GB:-8} CHUNK=${CHUNK:-64}
PIN=(taskset -c 0-15)
nproc; "${PIN[@]}" nproc
rc=0
for r in $(seq 1 "$ROUNDS"); do
  for v in ${TREES:-$A $B}; do
    (
      cd ".whl/snap-$v" || exit 1
      export PYTHONPATH=$SITE:.:clients/python KVXFERD_WORKERS=$WORKERS PAIRS=11,42 GB REPS=1
      timeout -s INT 120 "${PIN[@]}" python3 bench/device/tp_points.py "$CHUNK" 2>&1 | grep -E '^TP|Error' \
        | sed "s|^|$v round $r: |" | tee -a "$OUT/ab.log"
    ) || rc=1
  done
done
python3 - "$OUT/ab.log" <<'EOF'
import re, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\S+) round (\d+): TP (\d)->(\d) chunk \d+ tok: ([\d.]+) GB/s, cpu \{'daemon_prefill': ([\d.]+)", line)
    if m:
        runs.setdefault((m[1], m[2]), {})[f"{m[3]}->{m[4]}"] = (float(m[5]), float(m[6]))
for tree in sorted({t for t, _ in runs}):
    ratios = [p["4->2"][0] / p["1->1"][0] for (t, _), p in sorted(runs.items()) if t == tree and len(p) == 2]
    gb = [p["4->2"][0] for (t, _), p in runs.items() if t == tree and "4->2" in p]
    print(f"{tree}: TP 4->2 over 1->1 {['%.2f' % x for x in ratios]} (median {statistics.median(ratios):.2f}); "
          f"4->2 GB/s {['%.1f' % x for x in gb]}" if ratios else f"{tree}: no complete round")
EOF
if [ "${TUNED:-1}" = 1 ]; then
  (cd ".whl/snap-$B" && BUDGET_S=${TUNED_BUDGET_S:-200} RUN_S=150 OUT=$OUT "${PIN[@]}" bash bench/device/gpu_tuned.sh) || rc=1
fi
exit $rc
