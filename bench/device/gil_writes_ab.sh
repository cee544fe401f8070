#!/usr/bin/env bash
# Two builds of kvxferd interleaved, three rounds: TP 1->1, 4->2 and 1->4, 16 rooms in flight,
# 8 GiB a point, two points each (bench/device/tp_points.py). Landing 16 compared the loop's
# socket writes with the GIL held (A: 800e549) against os.write with the GIL released (B: a2d41d3,
# reverted): bench/results/gil-writes-ab-h100box.json. A and B are trees holding kvxferd/ and
# clients/python/, e.g. `git archive 800e549 kvxferd clients/python | tar -x -C .whl/a` (.whl/ is
# carried to the GPU box). On the GPU box:
#   A=.whl/a B=.whl/b [CHUNK=16] [REPS=3] bash bench/device/gil_writes_ab.sh   (CHUNK: tokens a chunk, 64 = 20 MiB)
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
REPO=$PWD
A=$(realpath "${A:-.whl/a}")
B=$(realpath "${B:-.}")
for r in 1 2 3; do
  for build in A B; do
    echo "== round $r, build $build"
    if [ "$build" = A ]; then tree=$A; else tree=$B; fi
    # From a neutral directory: `python -m kvxferd` (the daemons) puts the current directory first.
    (cd /tmp && PYTHONPATH=$SITE:$tree:$tree/clients/python PAIRS=11,42,14 GB=8 REPS=${REPS:-2} timeout 200 \
      python3 "$REPO/bench/device/tp_points.py" "${CHUNK:-64}" 2>&1 | grep "^TP ")
  done
done
