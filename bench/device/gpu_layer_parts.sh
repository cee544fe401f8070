#!/usr/bin/env bash
# One device call, CPU only (issue #37 done-when: "80 layers x 5 MiB-chunk rooms at 16 rooms in flight:
# kvxferd / raw NIXL on the same parts >= 0.9 on 16 cores, CPU per GB <= 1.5x raw"). No GPU is used:
# the box is the 16-core machine the target is stated on. Every run pinned to the same 16 cores (taskset,
# as gpu_tuned_rounds.sh), the daemon's default worker count there unless WORKERS names others;
# `kvxferd bench loopback --layer-parts 80`: kvxferd parts, raw NIXL tuned posting the same parts (one
# WRITE each, as many UCX workers/posting threads as the daemons), and both sending whole 5 MiB chunks,
# ROUNDS interleaved rounds of 2 GiB points, every byte verified per arm. PROFILE=1 adds a py-spy'd
# pass of the daemons afterwards (kept out of the measured run).
# Run from the repo root on the box, carrying .whl/ (bench/device/make_wheels.sh), commit passed in:
#   KVX_COMMIT=$(git rev-parse HEAD) bash bench/device/gpu_layer_parts.sh
# Writes $OUT/layer-parts-16core-wN.json per worker count, layer_parts.log, and prints the summary.
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
PIN=(taskset -c "${CORES:-0-15}")
ROUNDS=${ROUNDS:-3}
RUN_S=${RUN_S:-240}
POINT=${POINT:-2GiB}
BUDGET_S=${BUDGET_S:-540}
"${PIN[@]}" nproc
uptime
default=$("${PIN[@]}" python3 -c 'from kvxferd.config import Config; print(Config().transfer_workers)') || exit 1
echo "default workers on the pinned cores: $default"
rc=0
for n in ${WORKERS:-$default}; do
  if (( SECONDS + RUN_S > BUDGET_S )); then
    echo "skipping $n workers: ${SECONDS}s gone of ${BUDGET_S}s"
    continue
  fi
  echo "=== $n workers (t=${SECONDS}s)"
  timeout -s INT "$RUN_S" "${PIN[@]}" python3 -m kvxferd.bench.loopback --layer-parts 80 --rounds "$ROUNDS" \
    --workers "$n" --point-bytes "$POINT" --json "$OUT/layer-parts-16core-w$n.json" >"$OUT/run.log" 2>&1
  r=$?
  { echo "=== $n workers rc=$r"; cat "$OUT/run.log"; } >>"$OUT/layer_parts.log"
  tail -12 "$OUT/run.log"
  rm -f "$OUT/run.log"
  echo "$n workers: rc=$r (t=${SECONDS}s)"
  (( r != 0 )) && rc=1
done
if [ "${PROFILE:-0}" = 1 ] && (( SECONDS + 120 < BUDGET_S )); then
  PYSPY=${PYSPY:-$(command -v py-spy || echo /tmp/site/bin/py-spy)}
  echo "=== py-spy pass (t=${SECONDS}s)"
  PATH=$(dirname "$PYSPY"):$PATH timeout -s INT 150 "${PIN[@]}" python3 -m kvxferd.bench.loopback --layer-parts 80 \
    --rounds 1 --profile "$OUT/profile" --point-bytes "$POINT" --json "$OUT/layer-parts-profiled.json" >>"$OUT/layer_parts.log" 2>&1 || true
fi
echo "layer parts rc=$rc (t=${SECONDS}s)"
exit $rc
