#!/usr/bin/env bash
# merge_writes on and off, interleaved, three runs each, TP 1->1, 1->4 and 4->2 at 5 and 20 MiB
# chunks (bench/results/merge-writes-h100box.json). On the GPU box, carrying .whl/:
#   bash bench/device/merge_ab.sh
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
for c in 16 64; do
  for _ in 1 2 3; do
    for m in true false; do
      echo "== chunk $c, merge_writes=$m"
      KVXFERD_MERGE_WRITES=$m PAIRS=11,14,42 GB=6 timeout 200 python3 bench/device/tp_points.py "$c" 2>&1 | grep "^TP "
    done
  done
done
