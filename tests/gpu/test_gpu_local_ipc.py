"""Two daemons on one host move VRAM by CUDA IPC (issue #38): the decode daemon passes its reader
engines' ring handles with the credits, the prefill daemon copies device to device into them and
notifies over NIXL (kvxferd/transports/local_ipc.py). TP 1->1, 2->2, 4->2 byte for byte on one GPU and across
two, with the device copy (one GPU) and cudaMemcpyPeer (two GPUs) of the same chunk size measured
in the same run; every byte goes by path local-ipc, none over NIXL. The per-job ratio is reported
over chunks of 4, 16 and 64 MiB, with the prefill daemon's split of each job's time (GPU copy,
launch, wait, notification: kvxferd.transports.local_ipc.stats, logged with each mapping closed)
and a device copy with one synchronize per chunk (what any one-wait-per-job copy can reach).

Skipped without CUDA. On a GPU box: ``bench/device/gpu_local_ipc.sh``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvxferd.transports.local_ipc import PATH_IPC
from tests.conftest import DaemonProc
from tests.gpu.conftest import daemon_pair, daemon_status, transfer_bytes, wait_log
from tests.gpu.harness import Case, run_case
from tests.gpu.test_gpu_e2e import check, row
from tests.gpu.test_gpu_two_gpus import copy_gbps, copy_seconds

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/device/gpu_local_ipc.sh)"),
]

TIMEOUT = 120.0
PAIRS = [(1, 1), (2, 2), (4, 2)]
CHUNK_TOKENS = [256, 1024, 4096]  # 4, 16 and 64 MiB chunks of the 16-layer layout (16 KiB a token)
_STATS = re.compile(r"local-ipc copies so far: (.*)$", re.M)


def ipc_stats(d: DaemonProc) -> dict[str, int]:
    """The prefill daemon's last logged local_ipc.stats (zeros before any)."""
    lines = _STATS.findall(d.log_text())
    return {k: int(v) for k, v in (kv.split("=") for kv in lines[-1].split())} if lines else {}


def stats_after(d: DaemonProc, before: dict[str, int], nbytes: int, timeout: float = 30.0) -> dict[str, int]:
    """The stats' growth over a case once a logged line covers its `nbytes` (mappings close as the
    decode engines go); {} if none did within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = ipc_stats(d)
        diff = {k: v - before.get(k, 0) for k, v in now.items()}
        if diff.get("bytes", 0) >= nbytes:
            return diff
        time.sleep(0.2)
    return {}


def copy_sync_gbps(nbytes: int, src: str, dst: str, reps: int = 20) -> float:
    """The same device copy with a synchronize after each chunk, in GB/s."""
    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    b.copy_(a)
    torch.cuda.synchronize(src)
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
        torch.cuda.synchronize(src)
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


@pytest.fixture(scope="module")
def daemons(request: pytest.FixtureRequest) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    yield from daemon_pair(request)


def run_ipc(case: Case, pre: DaemonProc, dec: DaemonProc, dst: str, record: Callable[..., None],
            **extra: object) -> float:
    """A case prefill on cuda:0 -> decode on `dst` through two daemons; returns the copy GB/s (the
    prefill daemon's per-job time from post to notification, summed)."""
    before, t_before = transfer_bytes(pre), copy_seconds(pre, "nixl")
    res = run_case(case, pre.socket, dec.socket, pre.peer_address, "cuda:0", decode_device=dst, timeout=TIMEOUT)
    after, t_after = transfer_bytes(pre), copy_seconds(pre, "nixl")
    copy_s = t_after - t_before
    gbps = case.decode_bytes() / copy_s / 1e9 if copy_s > 0 else 0.0
    record(row(res, PATH_IPC, gpus=f"0->{dst[-1]}", daemons=2, copy_gb_per_s=round(gbps, 3), **extra))
    check(res, pre, dec)
    assert after.get(PATH_IPC, 0) - before.get(PATH_IPC, 0) == case.decode_bytes(), (before, after)
    assert after.get("nixl", 0) == before.get("nixl", 0), (before, after)
    return gbps


@pytest.mark.timeout(600)
def test_two_daemons_vram_by_cuda_ipc(daemons: tuple[DaemonProc, DaemonProc], record: Callable[..., None]) -> None:
    pre, dec = daemons
    targets = ["cuda:0"] + (["cuda:1"] if torch.cuda.device_count() > 1 else [])
    for g, dst in enumerate(targets):
        for i, (p, d) in enumerate(PAIRS):
            run_ipc(Case(f"ipc{g}-tp{p}{d}", p, d, first_room=60_000 + 10_000 * g + 1000 * i), pre, dec, dst, record)
        # Big chunks (4, 16, 64 MiB): the copy against a device copy / cudaMemcpyPeer of one chunk.
        for j, ct in enumerate(CHUNK_TOKENS):
            big = Case(f"ipc{g}-big{ct}", 1, 1, rooms=8, tokens_per_room=16384, chunk_tokens=ct,
                       ring_bytes=256 << 20, first_room=65_000 + 10_000 * g + 1000 * j)
            chunk = big.decode_bytes() // big.rooms // len(big.chunks)
            base, synced = copy_gbps(chunk, "cuda:0", dst), copy_sync_gbps(chunk, "cuda:0", dst)
            key = "device_copy_gb_per_s" if dst == "cuda:0" else "memcpy_peer_gb_per_s"
            before = ipc_stats(pre)
            gbps = run_ipc(big, pre, dec, dst, record, chunk_bytes=chunk, **{key: round(base, 3)})
            st = stats_after(pre, before, big.decode_bytes())
            jobs = max(st.get("jobs", 0), 1)
            split = {f"{k[:-3]}_us_per_job": round(st[k] / jobs / 1e3, 2)
                     for k in ("job_ns", "gpu_ns", "launch_ns", "wait_ns", "notify_ns") if k in st}
            gpu_gbps = st["bytes"] / st["gpu_ns"] if st.get("gpu_ns") else None
            print(f"0->{dst} {chunk >> 20} MiB: copy {gbps:.1f} GB/s vs {key} {base:.1f} GB/s = {gbps / base:.2f}x "
                  f"(synced per chunk {synced:.1f}; GPU time alone {gpu_gbps} GB/s) {st} {split}")
            record({"case": f"ipc{g}-ratio-{chunk >> 20}MiB", "path": PATH_IPC, "gpus": f"0->{dst[-1]}",
                    "chunk_bytes": chunk, "copy_gb_per_s": round(gbps, 3), key: round(base, 3),
                    "ratio": round(gbps / base, 3), "device_copy_synced_per_chunk_gb_per_s": round(synced, 3),
                    "ratio_to_synced": round(gbps / synced, 3),
                    "gpu_only_gb_per_s": None if gpu_gbps is None else round(gpu_gbps, 3),
                    "jobs": st.get("jobs"), "batches": st.get("batches"), **split})
    assert {p.path for p in daemon_status(pre).peers if p.daemon_id == dec.name} == {PATH_IPC}
    assert wait_log(pre, "opened by CUDA IPC")
    # The decode engines are gone: their rings' credits came back and the mappings closed.
    assert wait_log(pre, "CUDA IPC mapping closed", timeout=30)
