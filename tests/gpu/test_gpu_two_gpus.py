"""Engines on two GPUs of one node (issue #38, "GPU to GPU inside a node").

Prefill ranks on cuda:0, decode ranks on cuda:1:
* through one daemon: the daemon imports each ring on its own GPU, enables peer access between the
  two GPUs where CUDA allows it, and copies ring to ring with the source GPU's copy engines
  (``kvxferd_transfer_bytes_total{path="local-p2p"}``); TP 1->1, 2->2, 4->2 byte for byte, then
  big chunks against ``cudaMemcpyPeer`` of the same chunk size measured in this process;
* through two daemons: VRAM rings over NIXL and the pinned host path, byte for byte, against a
  device copy measured in the same run (what UCX picks between two processes: bench/device/gpu_p2p.sh).

Skipped below two GPUs. On a two-GPU machine: ``bench/device/gpu_p2p.sh``.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import torch

from kvxferd.buffers.gpu_rings import LINK_PEER, LINK_STAGED
from tests.conftest import DaemonProc
from tests.gpu.conftest import daemon_pair, daemon_status, transfer_bytes
from tests.gpu.harness import Case, CaseResult, run_case
from tests.gpu.test_gpu_e2e import check, row

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA GPUs (run bench/device/gpu_p2p.sh on a two-GPU box)"),
]

PRE, DEC = "cuda:0", "cuda:1"
TIMEOUT = 120.0
PAIRS = [(1, 1), (2, 2), (4, 2)]


@pytest.fixture(scope="module")
def daemons(request: pytest.FixtureRequest) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    # 2 GiB pools: the host-path case takes its rings out of them.
    yield from daemon_pair(request, pool="2GiB")


def expected_link() -> str:
    peer = torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)
    return LINK_PEER if peer else LINK_STAGED


def copy_seconds(d: DaemonProc, path: str) -> float:
    """Sum of kvxferd_chunk_transfer_seconds for `path`: each WRITE from post to done."""
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    m = re.search(rf'^kvxferd_chunk_transfer_seconds_sum\{{path="{path}"\}}\s+(\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def copy_gbps(nbytes: int, src: str, dst: str, reps: int = 20) -> float:
    """A device copy of `nbytes` from `src` to `dst` through torch (cudaMemcpyPeerAsync between two
    GPUs with peer access, which torch enables), back to back, in GB/s."""
    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    b.copy_(a)
    for dev in {src, dst}:
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    for dev in {src, dst}:
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    assert torch.equal(a.to(dst), b)
    return nbytes * reps / seconds / 1e9


def run_local(case: Case, pre: DaemonProc, record: Callable[..., None], **extra: object) -> CaseResult:
    """A case through one daemon, prefill on GPU 0 and decode on GPU 1: every byte over the peer link."""
    link = expected_link()
    before, t_before = transfer_bytes(pre), copy_seconds(pre, "local")
    res = run_case(case, pre.socket, pre.socket, pre.peer_address, PRE, decode_device=DEC, timeout=TIMEOUT)
    after, t_after = transfer_bytes(pre), copy_seconds(pre, "local")
    copy_s = t_after - t_before
    record(row(res, link, gpus="0->1", daemons=1,
               copy_gb_per_s=round(case.decode_bytes() / copy_s / 1e9, 3) if copy_s > 0 else None, **extra))
    check(res, pre, pre)
    assert after.get(link, 0) - before.get(link, 0) == case.decode_bytes(), (before, after)
    assert after.get("nixl", 0) == before.get("nixl", 0)
    return res


@pytest.mark.timeout(600)
def test_one_daemon_two_gpus(daemons: tuple[DaemonProc, DaemonProc], record: Callable[..., None]) -> None:
    pre, _ = daemons
    for i, (p, d) in enumerate(PAIRS):
        run_local(Case(f"p2p-tp{p}{d}", p, d, same_node=True, first_room=80_000 + 1000 * i), pre, record)
    # Big chunks (64 MiB, 256 MiB rooms): the copy against cudaMemcpyPeer of the same chunk size.
    big = Case("p2p-big", 1, 1, same_node=True, rooms=8, tokens_per_room=16384, chunk_tokens=4096,
               ring_bytes=256 << 20, first_room=85_000)
    chunk = big.decode_bytes() // big.rooms // len(big.chunks)
    peer = copy_gbps(chunk, PRE, DEC)
    res = run_local(big, pre, record, memcpy_peer_gb_per_s=round(peer, 3), chunk_bytes=chunk)
    assert res.gbps > 0
    assert f"GPU 0 <-> GPU 1: {expected_link()}" in daemon_status(pre).gpu_links


@pytest.mark.timeout(600)
def test_two_daemons_two_gpus(daemons: tuple[DaemonProc, DaemonProc], record: Callable[..., None]) -> None:
    """VRAM rings (NIXL/UCX between the daemons) and pinned host rings (the host path), GPU 0 -> GPU 1."""
    pre, dec = daemons
    device_copy = copy_gbps(64 << 20, PRE, PRE)
    peer = copy_gbps(64 << 20, PRE, DEC)
    for case in (Case("2d-vram-tp11", 1, 1, first_room=90_000),
                 Case("2d-host-tp11", 1, 1, host_path=True, first_room=91_000),
                 Case("2d-host-tp42", 4, 2, host_path=True, first_room=92_000)):
        before = transfer_bytes(pre)
        res = run_case(case, pre.socket, dec.socket, pre.peer_address, PRE, decode_device=DEC, timeout=TIMEOUT)
        after = transfer_bytes(pre)
        record(row(res, "nixl", gpus="0->1", daemons=2, device_copy_gb_per_s=round(device_copy, 3),
                   memcpy_peer_gb_per_s=round(peer, 3)))
        check(res, pre, dec)
        assert after.get("nixl", 0) - before.get("nixl", 0) == case.decode_bytes()
    assert {p.path for p in daemon_status(pre).peers if p.daemon_id == dec.name} == {"nixl"}
