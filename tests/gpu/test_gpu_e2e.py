"""End to end with real CUDA tensors and IPC-imported rings (issue #4, GPU done-when).

Two daemons (subprocesses, each its own NIXL agent) and one process per TP rank. Each rank's KV
pool is CUDA tensors (per layer K and V ``[num_slots, local_heads, head_dim]``) and its staging
ring a CUDA tensor the daemon imports by CUDA IPC and registers with NIXL as VRAM. Prefill ranks
gather pages into ring slots with the Triton kernel, the daemons move VRAM to VRAM with NIXL, and
decode ranks scatter landed slots into their own pools before the watermark; then every decode
page is compared byte for byte with what the prefill side held.

Skipped without CUDA. On a GPU machine: ``bench/device/gpu_e2e.sh`` (records throughput).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.conftest import DaemonProc
from tests.gpu.conftest import daemon_status, transfer_bytes, wait_log
from tests.gpu.harness import Case, CaseResult, run_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: CUDA IPC staging rings and VRAM over NIXL (run bench/device/gpu_e2e.sh on one)",
    ),
]

DEVICE = "cuda:0"  # every rank shares the visible GPU, as several engines on one node would
TIMEOUT = 90.0  # per case: a stuck transfer fails the case instead of the whole run

PAIRS = [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (1, 4)]
SHORT = {"bfloat16": "bf16", "float8_e4m3fn": "fp8"}
CASES = [
    Case(f"{SHORT[dt]}-tp{p}{d}", p, d, dtype=dt, first_room=1000 * (i + 1))
    for i, (dt, (p, d)) in enumerate((dt, pd) for dt in SHORT for pd in PAIRS)
]
MLA = Case("mla-tp24", 2, 4, dtype="bfloat16", total_kv_heads=1, mla=True, head_dim=576, first_room=50_000)


def check(res: CaseResult, pre: DaemonProc, dec: DaemonProc) -> None:
    """Every room SUCCESS on every rank, every byte equal, nothing written outside the rooms."""
    case = res.case
    assert not res.errors, "\n".join(res.errors)
    rooms = set(case.room_ids)
    for r in res.ranks:
        assert set(r.states) == rooms, f"{r.role} rank {r.rank}: rooms {sorted(r.states)}"
        bad = {k: v for k, v in r.states.items() if v != "SUCCESS"}
        assert not bad, f"{r.role} rank {r.rank}: {bad}"
    for r in res.by_role("decode"):
        assert not r.mismatches, f"decode rank {r.rank}: {r.mismatches}"
        assert r.stray_bytes == 0, f"decode rank {r.rank}: {r.stray_bytes} bytes written outside the rooms' pages"
    assert sum(r.checked_bytes for r in res.by_role("decode")) == case.decode_bytes()
    assert res.landed_bytes == case.decode_bytes()
    # Every ring was unmapped (cudaIpcCloseMemHandle) once its engine unregistered.
    for r in res.ranks:
        d = pre if r.role == "prefill" else dec
        assert wait_log(d, f"ring of engine {r.engine_id} released"), f"{d.name} kept the ring of {r.role} {r.rank}"
    for d in {id(pre): pre, id(dec): dec}.values():
        assert "closing ring of engine" not in d.log_text(), d.log_text()[-3000:]
        assert daemon_status(d).slots_held == 0


def row(res: CaseResult, path: str, **extra: Any) -> dict[str, Any]:
    c = res.case
    return {
        "case": c.name, "prefill_tp": c.ptp, "decode_tp": c.dtp, "dtype": c.dtype, "mla": c.mla,
        "kv_heads": c.total_kv_heads, "layers": c.num_layers, "head_dim": c.head_dim, "page_size": c.page_size,
        "rooms": c.rooms, "tokens_per_room": c.tokens_per_room, "chunk_tokens": c.chunk_tokens, "path": path,
        "bytes": res.landed_bytes, "seconds": round(res.seconds, 4), "gb_per_s": round(res.gbps, 3),
        "byte_exact": not res.errors and all(not r.mismatches and r.stray_bytes == 0 for r in res.ranks),
        "checked_bytes": sum(r.checked_bytes for r in res.by_role("decode")), "problems": res.problems, **extra,
    }


def run_checked(
    case: Case, pre: DaemonProc, dec: DaemonProc, record: Callable[..., None], path: str
) -> CaseResult:
    """Runs a case between two daemons, records its row, checks it: every byte over NIXL, none local."""
    before = transfer_bytes(pre)
    res = run_case(case, pre.socket, dec.socket, pre.peer_address, DEVICE, timeout=TIMEOUT)
    after = transfer_bytes(pre)
    record(row(res, path))
    check(res, pre, dec)
    assert after.get("nixl", 0) - before.get("nixl", 0) == case.decode_bytes()
    assert after.get("local", 0) == before.get("local", 0)
    return res


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", [*CASES, MLA], ids=lambda c: c.name)
def test_cross_daemon(gpu_daemons: tuple[DaemonProc, DaemonProc], record: Callable[..., None], case: Case) -> None:
    pre, dec = gpu_daemons
    run_checked(case, pre, dec, record, "nixl")


@pytest.mark.timeout(240)
def test_same_node_device_copy(gpu_daemons: tuple[DaemonProc, DaemonProc], record: Callable[..., None]) -> None:
    """Prefill and decode engines on one daemon: ExpectRoom names the daemon's own peer address,
    and the daemon copies ring to ring on the device instead of going through NIXL."""
    pre, _ = gpu_daemons
    case = Case("same-tp22", 2, 2, same_node=True, first_room=60_000)
    before = transfer_bytes(pre)
    res = run_case(case, pre.socket, pre.socket, pre.peer_address, DEVICE, timeout=TIMEOUT)
    after = transfer_bytes(pre)
    record(row(res, "local"))
    check(res, pre, pre)
    # Both rings on one GPU: the metrics path names the link (kvxferd.buffers.gpu_rings.LINK_SAME_GPU).
    assert after.get("local-gpu", 0) - before.get("local-gpu", 0) == case.decode_bytes()
    assert after.get("nixl", 0) == before.get("nixl", 0)


@pytest.mark.timeout(240)
def test_same_node_big_rooms(gpu_daemons: tuple[DaemonProc, DaemonProc], record: Callable[..., None]) -> None:
    """Issue 12 done-when: the same-node path at >= 10 GB/s for rooms of 64 MiB or more (here
    128 MiB rooms in 16 MiB chunks: the device copy is microseconds, the per-chunk control work
    is what is left to measure)."""
    pre, _ = gpu_daemons
    case = Case("same-big", 1, 1, same_node=True, rooms=8, tokens_per_room=8192, chunk_tokens=1024,
                ring_bytes=128 << 20, first_room=65_000)
    res = run_case(case, pre.socket, pre.socket, pre.peer_address, DEVICE, timeout=TIMEOUT)
    record(row(res, "local"))
    check(res, pre, pre)
    assert case.decode_bytes() // case.rooms >= 64 << 20
    # The rate (issue 12's >= 10 GB/s) is a benchmark figure, recorded above for bench/results.
    assert res.gbps > 0


@pytest.mark.timeout(420)
def test_restart_closes_ipc_mapping(gpu_daemons: tuple[DaemonProc, DaemonProc], record: Callable[..., None]) -> None:
    """An engine that dies without unregistering: its lease lapses, the daemon deregisters the ring
    from NIXL and closes the IPC mapping (the GPU memory comes back), and a new engine process on
    the same rank registers a new ring and transfers again, byte-exact."""
    pre, dec = gpu_daemons
    base = Case("restart", 1, 1, rooms=4, first_room=70_000)
    # Phase 0: a normal run, so both daemons hold their CUDA contexts before the baseline.
    res0 = run_case(base, pre.socket, dec.socket, pre.peer_address, DEVICE, timeout=TIMEOUT)
    check(res0, pre, dec)
    record(row(res0, "nixl", phase="0 first registration"))
    free_before = torch.cuda.mem_get_info(0)[0]

    # Phase 1: the prefill engine exports a 1 GiB ring, then exits without UnregisterEngine.
    big = 1 << 30
    crash = dataclasses.replace(base, first_room=71_000)
    res1 = run_case(crash, pre.socket, dec.socket, pre.peer_address, DEVICE, timeout=TIMEOUT,
                    prefill_kw={"exit_mode": "crash", "ring_bytes": big, "lease_ms": 1000})
    assert not res1.errors, "\n".join(res1.errors)
    engine = res1.by_role("prefill")[0].engine_id
    assert wait_log(pre, f"engine {engine} gone: engine lease lapsed"), pre.log_text()[-3000:]
    check(res1, pre, dec)  # includes "ring of engine ... released"
    record(row(res1, "nixl", phase="1 engine crashed, lease lapsed"))
    # A mapping the daemon kept would pin the dead engine's 1 GiB ring.
    free_after = torch.cuda.mem_get_info(0)[0]
    assert free_before - free_after < big // 2, (
        f"{(free_before - free_after) >> 20} MiB of GPU memory still held after the engine died and its ring was released"
    )

    # Phase 2: a new engine process on the same rank (and a new decode one): new rings, transfers again.
    again = dataclasses.replace(base, first_room=72_000)
    res2 = run_case(again, pre.socket, dec.socket, pre.peer_address, DEVICE, timeout=TIMEOUT)
    check(res2, pre, dec)
    record(row(res2, "nixl", phase="2 re-registered after restart",
               gpu_mib_held_after_release=round((free_before - free_after) / 2**20, 1)))
