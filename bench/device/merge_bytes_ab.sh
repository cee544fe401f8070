#!/usr/bin/env bash
# merge_max_bytes 16 MiB (the old cap) against 64 MiB (the new default), interleaved, three pairs:
# `kvxferd bench loopback` at 5 and 20 MiB chunks, 1 and 16 rooms in flight, every TP pair, bytes
# verified (bench/results/merge-bytes-ab-h100box.json). On the GPU box, carrying .whl/:
#   bash bench/device/merge_bytes_ab.sh
set -uo pipefail
# shellcheck source=bench/device/_env.sh
. bench/device/_env.sh
for r in 1 2 3; do
  for mb in 16MiB 64MiB; do
    echo "== round $r, merge_max_bytes=$mb"
    KVXFERD_MERGE_MAX_BYTES=$mb timeout -s INT 150 python3 -m kvxferd.bench.loopback --no-mooncake --no-reference \
      --chunk-tokens 16,64 --concurrency 1,16 --json "$OUT/ab-$mb-r$r.json" > "$OUT/ab-$mb-r$r.log" 2>&1
    echo "rc=$? $(grep -E 'kvxferd_over_raw|mixed_tp|cpu_over' "$OUT/ab-$mb-r$r.log" | tr -s ' ' | tr '\n' ' ')"
  done
done
