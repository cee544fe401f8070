"""A fleet on loopback: KVX_FLEET_DAEMONS (default 8) daemons in one etcd, half serving a prefill
group each and half a decode group, rooms routed by group between every pair, one prefill
daemon killed (-9) and restarted mid-run. Rooms not involving it succeed byte-exact, its rooms
fail fast with PEER_LOST, nothing leaks."""

from __future__ import annotations

import os
import time
from typing import Any

import grpc
import pytest

from kvxfer_client import DecodeReceiver, RoomState
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2, engine_pb2_grpc
from tests.conftest import wait_ready
from tests.registry.conftest import Etcd, registry_args
from tests.registry.test_fleet_e2e import LAYOUT, receive_exact, send_room, sender, wait_for

pytestmark = pytest.mark.slow


def status(sock: str) -> engine_pb2.DaemonStatus:
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        return engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=5)


def test_fleet_run(etcd: Etcd, daemons: Any) -> None:
    n = int(os.environ.get("KVX_FLEET_DAEMONS", "8"))
    half = n // 2
    args = registry_args(etcd, ttl=2)
    t0 = time.monotonic()
    procs = [daemons(f"p{i}", *args, wait=False, pool="16MiB") for i in range(half)]
    procs += [daemons(f"d{i}", *args, wait=False, pool="16MiB") for i in range(half)]
    for d in procs:
        wait_ready(d)
    started = time.monotonic() - t0
    pre, dec = procs[:half], procs[half:]
    tx = [sender(p, f"pg{i}") for i, p in enumerate(pre)]
    rx = [DecodeReceiver(socket=d.socket, group=f"dg{i}", layout=LAYOUT, ring_bytes=4 << 20) for i, d in enumerate(dec)]
    pairs = [(i, j) for i in range(half) for j in range(half)]  # (prefill group, decode daemon)

    def room_id(rnd: int, i: int, j: int) -> int:
        return rnd * 10_000 + i * 100 + j

    def full_round(rnd: int) -> None:
        """Every decode daemon receives from every prefill group, by group name, byte-exact."""
        for i, j in pairs:
            rx[j].expect(room_id(rnd, i, j), "", f"pg{i}", 48)
        for i, j in pairs:
            send_room(tx[i], room_id(rnd, i, j))
        for i, j in pairs:
            receive_exact(rx[j], room_id(rnd, i, j))

    # Round 1: all pairs.
    t1 = time.monotonic()
    full_round(1)
    round1 = time.monotonic() - t1

    # Round 2: every room bootstrapped, then p0 is killed before it sends.
    for i, j in pairs:
        rx[j].expect(room_id(2, i, j), "", f"pg{i}", 48)
    for i, j in pairs:
        wait_for(lambda i=i, j=j: rx[j].poll(room_id(2, i, j)).state is RoomState.WAITING_FOR_INPUT, 20,
                 f"room {room_id(2, i, j)} bootstrapped")
    pre[0].kill()
    t_kill = time.monotonic()
    for i, j in pairs:
        if i != 0:
            send_room(tx[i], room_id(2, i, j))
    fail_s = []
    for i, j in pairs:
        if i != 0:
            receive_exact(rx[j], room_id(2, i, j))
            continue
        wait_for(lambda i=i, j=j: rx[j].poll(room_id(2, i, j)).state is RoomState.FAILED, 10, "p0's room failed")
        fail_s.append(time.monotonic() - t_kill)
        assert rx[j].poll(room_id(2, i, j)).failure_code == "PEER_LOST"
        rx[j].release(room_id(2, i, j))
    tx[0].close(unregister=False)

    # p0 comes back (same daemon id, new instance): its group is routed to it again.
    pre[0] = daemons("p0", *args, pool="16MiB")
    tx[0] = sender(pre[0], "pg0")
    full_round(3)

    # Lookup latency is measured by the fleet bench (bench/device/gpu_fleet.sh), not here: a fresh
    # grpc.aio registry client in a new event loop of this test process, after earlier tests' loops,
    # hung in 3 of 4 suite runs (never alone; daemons run one loop per process).
    for c in (*tx, *rx):
        c.close()
    # Nothing leaks: no slot held and no room left on any daemon once the engines are gone.
    for d in (*pre, *dec):
        wait_for(lambda d=d: status(d.socket).slots_held == 0, 10, f"{d.name} slots released")
        st = status(d.socket)
        active = {k: v for k, v in st.rooms_by_state.items() if v and k not in ("SUCCESS", "FAILED")}
        assert not active, f"{d.name}: rooms left {active}"
    print(f"\nfleet run: {n} daemons started in {started:.1f} s; round 1: {len(pairs)} rooms in {round1:.2f} s; "
          f"rooms of the killed daemon failed {min(fail_s):.2f}-{max(fail_s):.2f} s after kill -9")
    assert max(fail_s) < 3.0
