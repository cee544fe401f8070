#!/usr/bin/env bash
# The loop's socket writes with the GIL held (uvloop transport.write, before) against
# kvxferd.sockio.DirectWriter (os.write, GIL released), interleaved, three rounds: TP 1->1, 4->2
# and 1->4 at 20 MiB chunks, 16 rooms in flight (bench/results/gil-writes-ab-h100box.json).
# OLD: a tree with the earlier build's kvxferd/ and clients/python/ (here: git archive 800e549
# kvxferd clients/python, unpacked under .whl/old). On the GPU box, carrying .whl/:
#   OLD=.whl/old bash bench/device/gil_writes_ab.sh
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
REPO=$PWD
OLD=$(realpath "${OLD:-.whl/old}")
for r in 1 2 3; do
  for build in before directwriter; do
    echo "== round $r, $build"
    if [ "$build" = before ]; then tree=$OLD; else tree=$REPO; fi
    # From a neutral directory: `python -m kvxferd` (the daemons) puts the current directory first.
    (cd /tmp && PYTHONPATH=$SITE:$tree:$tree/clients/python PAIRS=11,42,14 GB=8 REPS=2 timeout 200 \
      python3 "$REPO/bench/device/tp_points.py" 64 2>&1 | grep "^TP ")
  done
done
