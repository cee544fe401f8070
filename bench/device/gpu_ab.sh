#!/usr/bin/env bash
# One device call: `kvxferd bench loopback` and `kvxferd bench rpc` of two trees, interleaved in the
# same call on the GPU box's 16 cores (A/B within the noise of one machine). The trees are
# `git archive REV | tar -x -C .whl/snap-NAME` for NAME in A and B (carried under .whl/). Run from
# the repo root there:  A=base B=head WORKERS=4 ROUNDS=2 bash bench/device/gpu_ab.sh
# Writes $OUT/{loopback,rpc}-NAME-ROUND.json.
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
A=${A:-base} B=${B:-head} ROUNDS=${ROUNDS:-2} WORKERS=${WORKERS:-4}
nproc
rc=0
for r in $(seq 1 "$ROUNDS"); do
  for v in "$A" "$B"; do
    (
      cd ".whl/snap-$v" || exit 1
      export PYTHONPATH=$SITE:.:clients/python KVXFERD_WORKERS=$WORKERS
      # Trees before --workers existed take KVXFERD_WORKERS from the environment only.
      wk=(); grep -q -- '"--workers"' kvxferd/bench/loopback.py && wk=(--workers "$WORKERS")
      timeout -s INT 150 python3 -m kvxferd.bench.loopback --no-mooncake --chunk-tokens 64 --concurrency 16 \
        "${wk[@]}" --json "$OUT/loopback-$v-$r.json" > "$OUT/loopback-$v-$r.log" 2>&1 || echo "loopback $v $r rc=$?"
      timeout -s INT 90 python3 -m kvxferd.bench.rpc --json "$OUT/rpc-$v-$r.json" > "$OUT/rpc-$v-$r.log" 2>&1 \
        || echo "rpc $v $r rc=$?"
    ) || rc=1
    echo "round $r $v done at $(date +%T)"
  done
done
exit $rc
