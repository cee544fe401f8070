"""Issue #38, one GPU and two daemons: does a copy wait for another process's kernels on its GPU?

The local-ipc jobs of tests/gpu/test_gpu_local_ipc.py wait 120-180 us beyond their copies' own GPU
time when prefill and decode engines share the GPU, and about nothing beyond it when the decode
engines are on the other GPU. Processes' CUDA contexts time-share a GPU (no MPS), so a copy queued
while another process's kernels run may start only at its context's next time slice. This times
a copy with one event wait each, from this process, alone and then while a second process keeps
the same GPU (and, as a control, the other GPU) busy with small kernels, like an engine.
Run on the GPU box: python3 bench/device/ctx_share_probe.py  -> one JSON line.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import sys
import time

import torch

MIB = 1 << 20


def busy(device: str, seconds: float, ready: mp.synchronize.Event) -> None:
    a = torch.randn(2048, 2048, device=device)
    ready.set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)  # ~50-100 us kernels back to back, as an engine's forward
        torch.cuda.synchronize(device)


def copies(nbytes: int, reps: int = 40) -> dict[str, float]:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    stream = torch.cuda.Stream("cuda:0", priority=-1)
    walls, gpus = [], []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        with torch.cuda.stream(stream):
            e0.record()
            dst.copy_(src)
            e1.record()
        e1.synchronize()
        walls.append((time.perf_counter() - t) * 1e6)
        gpus.append(e0.elapsed_time(e1) * 1e3)
    return {"wall_us": round(statistics.median(walls), 1), "gpu_us": round(statistics.median(gpus), 1)}


def main() -> None:
    ctx = mp.get_context("spawn")
    out: dict[str, object] = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    for mib in (4, 64):
        n = mib * MIB
        copies(n, 5)
        row = {"alone": copies(n)}
        for other in ["cuda:0"] + (["cuda:1"] if torch.cuda.device_count() > 1 else []):
            ready = ctx.Event()
            p = ctx.Process(target=busy, args=(other, 8.0, ready))
            p.start()
            ready.wait(60)
            time.sleep(0.5)
            row[f"busy_process_on_{other}"] = copies(n)
            p.join()
        out[f"{mib}MiB"] = row
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
