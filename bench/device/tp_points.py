"""Longer kvxferd points of `kvxferd bench loopback`, for A/B runs of one setting.

The loopback bench's default points move 2 GiB, a fraction of a second on the 16-core box, and
their ratios swing by +-10 % from run to run. This runs only kvxferd points (same TP and the
mixed pairs), at one chunk size and 16 rooms in flight, with as many bytes per point as asked,
and prints GB/s and CPU per process; the daemons take their settings from KVXFERD_* variables,
so two settings are compared by running this twice, interleaved (bench/device/merge_ab.sh).

  PAIRS=11,14,42 GB=6 REPS=1 python3 bench/device/tp_points.py 16
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

from kvxferd.bench.loopback_paths import LoopbackBench
from kvxferd.bench.loopback_spec import DEFAULT


def main() -> None:
    chunk = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    pairs = [(int(x[0]), int(x[1])) for x in os.environ.get("PAIRS", "11,42").split(",")]
    reps = int(os.environ.get("REPS", "1"))
    s = replace(DEFAULT, chunk_tokens=(chunk,), headline_chunk=chunk, concurrency=(16,), headline_concurrency=16,
                mixed_tp=tuple(p for p in pairs if p != (1, 1)), point_bytes=int(os.environ.get("GB", "4")) << 30)
    b = LoopbackBench(s, mooncake=False)
    try:
        b.start(lambda m: None)
        b.warm_up(lambda m: None)
        for _ in range(reps):
            for p in pairs:
                pt = b.kvx_point(b.groups[p], chunk, 16)
                ok = "ok" if pt["ok"] else f"FAILED {pt['errors']}"
                print(f"TP {p[0]}->{p[1]} chunk {chunk} tok: {pt['throughput_gbps']:.2f} GB/s, cpu {pt['cpu_s']}, {ok}",
                      flush=True)
    finally:
        b.stop()


if __name__ == "__main__":
    main()
