"""Daemons as subprocesses (real NIXL) in one real etcd: rooms addressed by prefill group, a
daemon killed and restarted, a group that moves, etcd killed and restarted mid-run. Every byte
that lands is checked against the pattern the prefill side wrote."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvxfer_client import DecodeReceiver, KvxferError, Layout, PrefillSender, RoomFailed, RoomState
from kvxferd.cli import main as cli
from kvxferd.config import load_config
from kvxferd.fleet.etcd import read_fleet
from kvxferd.fleet.registry import REGISTRY_HEALTH, DaemonRecord
from tests.engine_procs import part_bytes_for
from tests.registry.conftest import Etcd, free_port, registry_args

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=64, dtype_bytes=2, page_size=16, dtype="bfloat16")
TOKENS = 48


def fleet(e: Etcd) -> dict[str, DaemonRecord]:
    cfg = load_config(None, env={}, overrides={
        "registry_backend": "etcd", "registry_endpoints": e.endpoint, "registry_timeout_s": 1,
        "socket": "/tmp/kvx-reg-test/x.sock"})
    return {r.daemon_id: r for r, _ in asyncio.run(read_fleet(cfg))}


def wait_for(cond: Any, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def sender(d: Any, group: str) -> PrefillSender:
    return PrefillSender(socket=d.socket, group=group, layout=LAYOUT, ring_bytes=4 << 20, name=group)


def send_room(tx: PrefillSender, room: int) -> None:
    tx.send_chunk(room, 0, 0, TOKENS, part_bytes_for(LAYOUT, 1, 0, room, 0, TOKENS).data, last=True, aux=b"aux-%d" % room)


def receive_exact(rx: DecodeReceiver, room: int) -> None:
    got, st = rx.receive(room, timeout=30)
    assert st.state is RoomState.SUCCESS and st.aux == b"aux-%d" % room
    assert got[0] == part_bytes_for(LAYOUT, 1, 0, room, 0, TOKENS).tobytes(), f"room {room}: bytes differ"
    rx.release(room)


def health(sock: str, service: str) -> int:
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


def metric(d: Any, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_rooms_by_group_kill_restart_and_move(etcd: Etcd, daemons: Any) -> None:
    args = registry_args(etcd, ttl=2)
    dec = daemons("dec", *args)
    pre = daemons("pre", *args)
    rx = DecodeReceiver(socket=dec.socket, group="dec", layout=LAYOUT, ring_bytes=8 << 20)
    # The decode side expects a room from a group no daemon has yet: it waits, it does not fail.
    rx.expect(1, "", "llama-pre", TOKENS)
    time.sleep(0.6)
    assert rx.poll(1).state is RoomState.BOOTSTRAPPING
    tx = sender(pre, "llama-pre")
    send_room(tx, 1)
    receive_exact(rx, 1)
    first = fleet(etcd)["pre"]
    assert [(g.group, g.role, g.ranks) for g in first.groups] == [("llama-pre", "prefill", (0,))]
    assert first.address == pre.peer_address

    # kill -9 of the prefill daemon with a room in flight: the room fails on the decode side,
    # and the dead daemon's record goes within the lease TTL.
    rx.expect(2, "", "llama-pre", TOKENS)
    wait_for(lambda: rx.poll(2).state is RoomState.WAITING_FOR_INPUT, 10, "room 2 bootstrapped")
    pre.kill()
    t_kill = time.monotonic()
    wait_for(lambda: rx.poll(2).state is RoomState.FAILED, 5, "room 2 failed")
    st = rx.poll(2)
    assert st.failure_code == "PEER_LOST", st
    rx.release(2)
    gone = wait_for(lambda: "pre" not in fleet(etcd), 6, "dead daemon's record expired") + time.monotonic() - t_kill
    # etcd sweeps expired leases every 0.5 s; polling etcd from here adds its own delay under load.
    assert gone < 2 + 3.0, f"record outlived the 2 s lease by {gone - 2:.1f} s"
    tx.close(unregister=False)

    # Restart: same daemon id, new instance id; a room by group reaches the new instance.
    pre2 = daemons("pre", *args)
    tx = sender(pre2, "llama-pre")
    wait_for(lambda: bool(fleet(etcd).get("pre") and fleet(etcd)["pre"].groups), 5, "restarted daemon registered")
    assert fleet(etcd)["pre"].instance_id != first.instance_id
    rx.expect(3, "", "llama-pre", TOKENS)
    send_room(tx, 3)
    receive_exact(rx, 3)

    # The group moves to another daemon: new rooms follow it.
    tx.close()
    other = daemons("other", *args)
    wait_for(lambda: not fleet(etcd)["pre"].groups, 5, "group left the first daemon")
    tx = sender(other, "llama-pre")
    rx.expect(4, "", "llama-pre", TOKENS)
    send_room(tx, 4)
    receive_exact(rx, 4)
    # Addresses keep working beside groups.
    rx.expect(5, other.peer_address, "llama-pre", TOKENS)
    send_room(tx, 5)
    receive_exact(rx, 5)
    tx.close()
    rx.close()


def cli_json(capsys: Any, *argv: str) -> Any:
    capsys.readouterr()
    assert cli([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_etcd_down_mid_run_then_back(etcd: Etcd, daemons: Any, capsys: Any) -> None:
    args = registry_args(etcd, ttl=2)
    pre, dec = daemons("pre", *args), daemons("dec", *args)
    tx = sender(pre, "p")
    rx = DecodeReceiver(socket=dec.socket, group="dec", layout=LAYOUT, ring_bytes=8 << 20)
    rx.expect(1, "", "p", TOKENS)
    send_room(tx, 1)
    receive_exact(rx, 1)
    assert health(dec.socket, REGISTRY_HEALTH) == health_pb2.HealthCheckResponse.SERVING

    # Rooms in flight when etcd dies, and rooms started while it is down, between known peers.
    for room in (10, 11):
        rx.expect(room, "", "p", TOKENS)
    etcd.kill()
    wait_for(lambda: health(dec.socket, REGISTRY_HEALTH) == health_pb2.HealthCheckResponse.NOT_SERVING, 10,
             "registry reported degraded")
    assert health(dec.socket, "") == health_pb2.HealthCheckResponse.SERVING, "the daemon itself is not down"
    assert metric(dec, 'kvxferd_registry_up{backend="etcd"}') == 0
    assert cli_json(capsys, "status", "--socket", dec.socket)["registry"].startswith("DEGRADED")
    assert cli(["status", "--fleet", "--endpoints", etcd.endpoint]) == 1
    assert "etcd unreachable" in capsys.readouterr().err
    for room in (12, 13):
        rx.expect(room, "", "p", TOKENS)  # served from the cache
    for room in (10, 11, 12, 13):
        send_room(tx, room)
    for room in (10, 11, 12, 13):
        receive_exact(rx, room)
    # A group nobody has seen waits (up to the room's deadline), then fails with a reason naming it.
    t0 = time.monotonic()
    rx.expect(20, "", "never-registered", TOKENS, deadline_ms=1500)
    try:
        rx.receive(20, timeout=10)
        raise AssertionError("a room of an unknown group succeeded")
    except RoomFailed as exc:
        assert "prefill group 'never-registered' is not registered" in exc.reason, exc.reason
        assert "registry degraded" in exc.reason, exc.reason
    assert 1.0 < time.monotonic() - t0 < 6.0
    rx.release(20)

    # etcd returns: both daemons re-register by themselves, with their groups.
    etcd.start()
    wait_for(lambda: {"pre", "dec"} <= set(fleet(etcd)), 15, "daemons re-registered")
    assert [g.group for g in fleet(etcd)["pre"].groups] == ["p"]
    wait_for(lambda: health(dec.socket, REGISTRY_HEALTH) == health_pb2.HealthCheckResponse.SERVING, 5, "healthy")
    assert metric(dec, 'kvxferd_registry_up{backend="etcd"}') == 1
    assert metric(dec, "kvxferd_registry_reconnects_total") >= 1
    assert cli_json(capsys, "status", "--socket", dec.socket)["registry"] == "up"
    rows = {r["daemon_id"]: r for r in cli_json(capsys, "status", "--fleet", "--endpoints", etcd.endpoint)}
    assert set(rows) == {"pre", "dec"}
    assert rows["pre"]["groups"] == [
        {"group": "p", "role": "prefill", "tp_size": 1, "ranks": [0], "layout_digest": rows["pre"]["groups"][0]["layout_digest"]}
    ]
    assert rows["dec"]["address"] == dec.peer_address and rows["dec"]["age_s"] > 0 and rows["dec"]["instance_id"]
    assert cli(["status", "--fleet", "--endpoints", etcd.endpoint]) == 0
    assert "fleet: 2 daemon(s)" in capsys.readouterr().out
    tx2 = sender(pre, "late")  # a group registered after etcd came back resolves too
    rx.expect(30, "", "late", TOKENS)
    send_room(tx2, 30)
    receive_exact(rx, 30)
    for c in (tx, tx2, rx):
        c.close()


def test_lease_expiry_fails_rooms_before_heartbeats_would(etcd: Etcd, daemons: Any) -> None:
    """Heartbeats are set to give up only after 10 s, and the prefill daemon is frozen (SIGSTOP: its
    connections stay open, so its control stream does not break): the lease (2 s) is what fails the
    room. (A kill -9 breaks the stream, which fails the room at once, before any lease could.)"""
    slow_beats = ["--set", "heartbeat_interval_s=1", "--set", "heartbeat_misses=10"]
    pre = daemons("pre", *registry_args(etcd, ttl=2), *slow_beats)
    dec = daemons("dec", *registry_args(etcd, ttl=2), *slow_beats)
    tx = sender(pre, "p")
    rx = DecodeReceiver(socket=dec.socket, group="dec", layout=LAYOUT, ring_bytes=8 << 20)
    rx.expect(1, "", "p", TOKENS)
    wait_for(lambda: rx.poll(1).state is RoomState.WAITING_FOR_INPUT, 10, "bootstrapped")
    pre.proc.send_signal(signal.SIGSTOP)
    took = wait_for(lambda: rx.poll(1).state is RoomState.FAILED, 9, "room failed by the lease")
    st = rx.poll(1)
    assert st.failure_code == "PEER_LOST" and "registry" in st.failure_reason, st
    assert took < 2 + 2.0, f"{took:.1f} s"
    pre.kill()
    tx.close(unregister=False)
    rx.close()


def test_static_mode_and_required_registry(daemons: Any) -> None:
    # Without a registry a room must name its prefill daemon, and the error says so.
    plain = daemons("plain")
    rx = DecodeReceiver(socket=plain.socket, group="dec", layout=LAYOUT, ring_bytes=8 << 20)
    try:
        rx.expect(1, "", "p", TOKENS)
        raise AssertionError("a room without an address was accepted in static mode")
    except KvxferError as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "prefill_address is required" in str(exc) and "fleet registry" in str(exc)
    rx.close()
    assert health(plain.socket, "") == health_pb2.HealthCheckResponse.SERVING
    # registry.required with etcd unreachable: exit code 2 and one line saying why.
    d = daemons("req", "--set", "registry_backend=etcd", "--set", f"registry_endpoints=127.0.0.1:{free_port()}",
                "--set", "registry_required=true", "--set", "registry_timeout_s=0.5", wait=False)
    assert d.proc.wait(30) == 2
    assert "registry is required but etcd at 127.0.0.1:" in d.log_text()


def test_a_route_to_a_dead_daemon_is_looked_up_again_until_its_record_goes(etcd: Etcd, daemons: Any) -> None:
    """The registry still names a killed prefill daemon (its lease has not lapsed) when a decode
    engine expects a room from its group: the refused dial is not the room's end. The group is
    looked up again, and the room goes to the daemon's new instance once it has registered."""
    args = registry_args(etcd, ttl=10)
    dec = daemons("dec", *args)
    pre = daemons("pre", *args)
    tx = sender(pre, "moving")
    wait_for(lambda: "pre" in fleet(etcd) and fleet(etcd)["pre"].groups, 10, "the group in the registry")
    old_address = pre.peer_address
    pre.kill()
    tx.close(unregister=False)
    rx = DecodeReceiver(socket=dec.socket, group="dec", layout=LAYOUT, ring_bytes=8 << 20)
    rx.expect(1, "", "moving", TOKENS)
    time.sleep(1.0)  # dials to the dead address are refused meanwhile
    assert rx.poll(1).state is RoomState.BOOTSTRAPPING, rx.poll(1)
    pre = daemons("pre", *args)
    assert pre.peer_address != old_address
    tx = sender(pre, "moving")
    send_room(tx, 1)
    receive_exact(rx, 1)
    tx.close()
    rx.close()
