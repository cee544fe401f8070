"""Daemon lifecycle and the engine API surface, against real daemons."""

from __future__ import annotations

import asyncio
import ctypes
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvxfer_client import KvxferError, Layout, PrefillSender
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from kvxferd.config import Config
from tests.conftest import ROOT

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16)


async def _health(target: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(target) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(reply.status)


async def test_health_reflection_metrics(inproc: Any) -> None:
    d = await inproc()
    assert await _health(f"unix:{d.socket}") == health_pb2.HealthCheckResponse.SERVING
    assert await _health(f"unix:{d.socket}", "kvxfer.v1.Engine") == health_pb2.HealthCheckResponse.SERVING
    assert await _health(d.peer_address, "kvxfer.v1.Peer") == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(f"unix:{d.socket}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)

        async def reqs():  # type: ignore[no-untyped-def]
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        services = []
        async for resp in stub.ServerReflectionInfo(reqs()):
            services = [s.name for s in resp.list_services_response.service]
    assert "kvxfer.v1.Engine" in services and "grpc.health.v1.Health" in services
    url = f"http://127.0.0.1:{d.metrics_port}/metrics"
    # The daemon shares this event loop: fetch from a thread.
    body = (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())).decode()
    for name in ("kvxferd_rooms", "kvxferd_rpc_duration_seconds", "kvxferd_ring_used_bytes", "kvxferd_peers",
                 "kvxferd_build_info"):
        assert name in body, name


async def test_unknown_engine_and_room_rejected_without_changes(inproc: Any) -> None:
    d = await inproc()
    async with grpc.aio.insecure_channel(f"unix:{d.socket}") as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.PollRoom(engine_pb2.PollRoomRequest(engine_id="nope", room=common_pb2.RoomKey(id=1)))
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.RegisterEngine(engine_pb2.RegisterEngineRequest(role=engine_pb2.ROLE_PREFILL, group="g"))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "layout" in (ei.value.details() or "")
        reg = await stub.RegisterEngine(engine_pb2.RegisterEngineRequest(
            role=engine_pb2.ROLE_PREFILL, group="g", layout=common_pb2.KVLayout(
                num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16),
            parallel=common_pb2.Parallelism(tp_size=1), ring_bytes=1 << 20))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.PollRoom(engine_pb2.PollRoomRequest(engine_id=reg.engine_id, room=common_pb2.RoomKey(id=77)))
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        # An offset that is not a slot this engine acquired: refused, nothing created.
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.EnqueueChunk(engine_pb2.EnqueueChunkRequest(
                engine_id=reg.engine_id, room=common_pb2.RoomKey(id=5), chunk_id=0, num_tokens=4,
                slot=common_pb2.Slot(offset=(1 << 20) + 4096, length=4096), last=True))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        st = await stub.GetStatus(engine_pb2.GetStatusRequest())
        assert dict(st.rooms_by_state) == {}
        assert st.slots_held == 0


async def test_status_cli_against_daemon(inproc: Any) -> None:
    d = await inproc()
    proc = await _run_cli("status", "--socket", d.socket, "--json")
    assert proc[0] == 0, proc
    data = json.loads(proc[1])
    assert data["daemon_id"] == d.daemon_id and data["serving"] is True
    assert data["peer_auth"] == "host-secret"
    # The caps are the config's defaults (a 1,000-node mesh fits max_peers), not other numbers.
    cfg = Config()
    assert {c["name"]: int(c["limit"]) for c in data["peer_caps"]} == {
        "peers": cfg.max_peers, "peer_addresses": 2 * cfg.max_peers, "pending_handshakes": cfg.max_pending_handshakes,
        "peer_metadata_bytes": cfg.max_peer_metadata_bytes, "peer_batch_msgs": cfg.max_peer_batch_msgs}
    assert cfg.max_peers >= 2000
    proc = await _run_cli("status", "--socket", d.socket)
    assert proc[0] == 0 and "rooms by state" in proc[1] and "peer caps" in proc[1] and "host-secret" in proc[1]


async def _run_cli(*args: str) -> tuple[int, str, str]:
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvxferd", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT
    )
    out, err = await asyncio.wait_for(p.communicate(), 60)
    return int(p.returncode or 0), out.decode(), err.decode()


def test_version() -> None:
    out = subprocess.run([sys.executable, "-m", "kvxferd", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.startswith("kvxferd 0.")


def test_bad_config_exits_nonzero_with_one_line(short_tmp: Path) -> None:
    cfg = short_tmp / "bad.toml"
    cfg.write_text('workers = 300\n')
    out = subprocess.run([sys.executable, "-m", "kvxferd", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["kvxferd: error: bad configuration: workers must be 0 (auto) or 1..256, got 300"]


def test_port_in_use_exits_nonzero(daemons: Any) -> None:
    a = daemons("a")
    b = daemons("b", "--peer-listen", a.peer_address, wait=False)
    assert b.proc.wait(60) == 2
    lines = [ln for ln in b.log_text().splitlines() if ln.startswith("kvxferd: error")]
    # One line naming the address and what a second daemon on one host needs (kvxferd.cli's probe).
    assert len(lines) == 1 and a.peer_address in lines[0] and "already in use" in lines[0], lines
    # The kernel chose a's port, so it lies in the ephemeral range: the error says why that is fragile.
    assert "inside the ephemeral range" in lines[0] and "ip_local_reserved_ports" in lines[0], lines[0]


def test_sigterm_drains_and_exits_zero(daemons: Any) -> None:
    d = daemons("solo", "--set", "drain_grace_s=2")
    # No spare slot: the acquire after SIGTERM must reach the daemon to be refused.
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20, prefetch_slots=False,
                       claim_slots=False) as tx:
        slot = tx.acquire(8)
        assert slot.chunk_bytes == 2 * 2 * 8 * 16 * 2 * 2
        # A room nobody bootstraps keeps the drain busy for the whole grace period.
        tx.enqueue(1, 0, 0, 8, slot, last=True)
        d.proc.send_signal(signal.SIGTERM)
        with grpc.insecure_channel(f"unix:{d.socket}") as ch:
            hstub = health_pb2_grpc.HealthStub(ch)
            for _ in range(100):
                if hstub.Check(health_pb2.HealthCheckRequest(), timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
                    break
                time.sleep(0.01)
            assert hstub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(KvxferError) as ei:
            tx.acquire(8, timeout=0.1)
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE
        assert "draining" in ei.value.message
        assert tx.poll(1).state.name in ("BOOTSTRAPPING",)
        tx.close(unregister=False)
    assert d.proc.wait(30) == 0
    log = d.log_text()
    assert "drain grace over: failing 1 unfinished room(s)" in log and "drained in" in log
    assert not Path(d.socket).exists()


def test_socket_is_private(daemons: Any) -> None:
    d = daemons("perm")
    assert (Path(d.socket).stat().st_mode & 0o777) == 0o600


def test_second_sigint_forces_exit(daemons: Any) -> None:
    d = daemons("force", "--set", "drain_grace_s=60")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        tx.enqueue(9, 0, 0, 4, tx.acquire(4), last=True)  # never bootstrapped: the drain would wait 60 s
        d.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert d.proc.poll() is None, "the first SIGINT must drain, not exit"
        d.proc.send_signal(signal.SIGINT)
        assert d.proc.wait(10) == 130
        tx.close(unregister=False)


async def test_gpu_ring_import_runs_off_the_event_loop(inproc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon's first CUDA IPC import creates its CUDA context and registers VRAM with NIXL
    (seconds on a busy GPU box). On the event loop that starved heartbeats and the peer declared the
    daemon lost; it must leave the daemon answering meanwhile. The importer here blocks for 1.5 s,
    as a slow import does, then fails as an import on a machine without CUDA does."""
    import kvxferd.app
    from kvxferd.errors import FailedPrecondition

    calls: list[float] = []

    def slow_importer(transport: Any) -> Any:
        def imp(spec: Any) -> Any:
            calls.append(time.monotonic())
            time.sleep(1.5)
            raise FailedPrecondition("cannot open the engine's CUDA IPC ring: test importer")

        return imp

    monkeypatch.setattr(kvxferd.app, "_cuda_importer", slow_importer)
    d = await inproc()
    async with grpc.aio.insecure_channel(f"unix:{d.socket}") as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        req = engine_pb2.RegisterEngineRequest(
            role=engine_pb2.ROLE_PREFILL, group="g", layout=common_pb2.KVLayout(
                num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16),
            parallel=common_pb2.Parallelism(tp_size=1),
            cuda_ring=engine_pb2.CudaIpcRing(handle=b"\1" * 64, device_uuid="GPU-test", size=1 << 20))
        reg = asyncio.ensure_future(stub.RegisterEngine(req, timeout=30))
        while not calls:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        st = await stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=5)
        answered = time.monotonic() - t0
        assert st.serving
        assert not reg.done(), "the import finished before the status call: the test proves nothing"
        assert answered < 0.75, f"GetStatus took {answered:.2f} s while a GPU ring was being imported"
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await reg
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "test importer" in (ei.value.details() or "")
        assert len(calls) == 1
        # Bad input fails before the importer runs: nothing touches the GPU for it.
        bad = engine_pb2.RegisterEngineRequest()
        bad.CopyFrom(req)
        bad.parallel.tp_rank = 3
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.RegisterEngine(bad, timeout=5)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(calls) == 1


async def test_registration_answers_while_the_gpu_ring_imports(inproc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight ranks registering GPU rings at once queue their imports; RegisterEngine must still
    answer within a short call deadline (here 1 s, for a 2.5 s import), and the client must get its
    engine once the ring is ready, with no call outliving the import."""
    import kvxferd.app
    from kvxferd.buffers.host_pool import RingAllocator
    from kvxferd.core.engines import Ring
    from kvxferd.errors import FailedPrecondition

    imported: list[float] = []
    buf = bytearray(1 << 20)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))

    def slow_importer(transport: Any) -> Any:
        def imp(spec: Any) -> Any:
            time.sleep(2.5)
            if spec.name == "bad-ring":
                raise FailedPrecondition("cannot open the engine's CUDA IPC ring: test importer")
            imported.append(time.monotonic())
            # A ring in this process's memory stands in for the imported VRAM.
            return Ring(name="", kind="cuda", base_addr=addr, size=len(buf), pool_offset=0, mem="DRAM", device=0,
                        alloc=RingAllocator(len(buf)))

        return imp

    monkeypatch.setattr(kvxferd.app, "_cuda_importer", slow_importer)
    d = await inproc()
    ring = {"handle": b"\1" * 64, "device_uuid": "GPU-test", "size": 1 << 20}
    t0 = time.monotonic()
    tx = await asyncio.to_thread(
        PrefillSender, socket=d.socket, group="g", layout=LAYOUT, cuda_ring=ring, map_pool=False, call_timeout=1.0
    )
    try:
        took = time.monotonic() - t0
        assert imported and took >= 2.5, took
        assert tx.engine_id and tx.reg.ring_bytes == 1 << 20
        st = await asyncio.to_thread(tx.status)
        assert [e.engine_id for e in st.engines] == [tx.engine_id]
        # A registration id nobody started is refused, not waited for.
        async with grpc.aio.insecure_channel(f"unix:{d.socket}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await engine_pb2_grpc.EngineStub(ch).RegisterEngine(engine_pb2.RegisterEngineRequest(
                    role=engine_pb2.ROLE_PREFILL, group="g", layout=LAYOUT.to_pb(),
                    parallel=common_pb2.Parallelism(tp_size=1), registration_id="nope"), timeout=5)
            assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        # An import that fails after the first answer reaches the client as the import's error.
        with pytest.raises(KvxferError) as kei:
            await asyncio.to_thread(PrefillSender, socket=d.socket, group="g2", layout=LAYOUT, cuda_ring=ring,
                                    map_pool=False, call_timeout=1.0, name="bad-ring")
        assert kei.value.code == grpc.StatusCode.FAILED_PRECONDITION and "test importer" in kei.value.message
    finally:
        await asyncio.to_thread(tx.close)
