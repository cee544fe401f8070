"""Faults of whole daemons: kill -9 of the decode and of the prefill daemon mid-transfer and their
restart, a network cut between two daemons in their own network namespaces and its repair, and
SIGTERM under load. Every test starts its own daemons (subprocesses, real NIXL) and engine
processes; rooms that succeed have every byte checked by the decode engine.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProc, wait_ready
from tests.faults.harness import (
    HEARTBEAT_S,
    TOKEN_BYTES,
    Fleet,
    Job,
    NetPair,
    assert_alive,
    failures_in_log,
    launch,
    launch_pair,
    log_lines,
    make_netpair,
    netns_unavailable,
    peer_state,
    pinned_listen,
    plans,
    record_timing,
    restart,
    wait_no_slots,
    wait_until,
)

# Peer loss is declared after heartbeat_misses (2) x interval of silence.
LOSS_S = 2 * HEARTBEAT_S
# Detection happens at a heartbeat tick: allow one RPC round and scheduling on a loaded machine.
SLACK_S = 0.3


def pair_jobs(pre: DaemonProc, dec: DaemonProc, group: str, rooms: Any, **kw: Any) -> tuple[Job, Job]:
    both = {k: v for k, v in kw.items() if not k.startswith(("p_", "d_"))}
    p = Job("prefill", pre.socket, f"{group}-pre", rooms, **{**both, **{k[2:]: v for k, v in kw.items() if k[:2] == "p_"}})
    d = Job("decode", dec.socket, f"{group}-dec", rooms, prefill_address=pre.peer_address, prefill_group=f"{group}-pre",
            **{**both, **{k[2:]: v for k, v in kw.items() if k[:2] == "d_"}})
    return p, d


def successes(fleet: Fleet, p: Job, d: Job) -> set[int]:
    """Rooms SUCCESS on both sides; the decode engine checked every byte of them."""
    plan = {r.room: r for r in d.rooms}
    ok = set()
    for r, e in fleet.rooms(d.who).items():
        if e["state"] == "SUCCESS":
            assert e["bytes"] == plan[r].num_tokens * TOKEN_BYTES, e
            assert fleet.rooms(p.who)[r]["state"] == "SUCCESS", fleet.rooms(p.who).get(r)
            ok.add(r)
    return ok


def mid_transfer(fleet: Fleet, d: Job, n: int) -> None:
    """At least one room already succeeded and n rooms are well inside their transfer (some
    chunks landed, at least 3 still to come)."""
    total = {r.room: len(r.chunks) for r in d.rooms}

    def ready() -> bool:
        landed: dict[int, int] = {}
        for e in fleet.of_kind("landed", d.who):
            landed[e["room"]] = landed.get(e["room"], 0) + 1
        done = fleet.rooms(d.who)
        middle = [r for r, k in landed.items() if r not in done and 2 <= k <= total[r] - 3]
        return len(middle) >= n and any(e["state"] == "SUCCESS" for e in done.values())

    fleet.wait_for(ready, 60, f"a room to succeed and {n} rooms to be mid-transfer")


def fresh_rooms_work(fleet: Fleet, pre: DaemonProc, dec: DaemonProc, group: str, first: int, n: int = 10) -> None:
    p, d = pair_jobs(pre, dec, group, plans(first, n, [16, 24, 8]), in_flight=3)
    fleet.start(d)
    fleet.start(p)
    fleet.finish(p.who, d.who)
    assert successes(fleet, p, d) == set(range(first, first + n))


@pytest.fixture
def workdir(daemons: Any) -> Path:
    return Path(daemons.workdir)


def test_kill9_decode_daemon_mid_transfer_then_restart(daemons: Any, fleet: Fleet) -> None:
    pre = launch(daemons.workdir, "prefill", wait=False)
    dec = launch(daemons.workdir, "decode", peer_listen=pinned_listen(), wait=False)  # restarts on it
    daemons.started += [pre, dec]
    wait_ready(pre)
    wait_ready(dec)
    p, d = pair_jobs(pre, dec, "a", plans(1000, 12, [16] * 10), chunk_delay_s=0.1, p_in_flight=3, d_in_flight=6)
    fleet.start(d)
    fleet.start(p)
    mid_transfer(fleet, d, 2)
    fleet.stop(p)  # rooms started after the kill could only wait for their deadline
    old_agent = log_lines(pre, "peer decode ")[-1]
    t_kill = time.time()
    dec.kill()
    fleet.finish(p.who, d.who)
    assert fleet.exits[d.who]["daemon_gone"]
    lost = {r: e for r, e in fleet.rooms(p.who).items() if e["state"] != "SUCCESS"}
    assert len(lost) >= 2, fleet.rooms(p.who)
    for e in lost.values():
        # The control stream's reset, heartbeats or the next AllocSlot to the dead daemon, whichever
        # comes first; or a WRITE in flight, which NIXL may fail before the stream's reset is read.
        if e["code"] == "TRANSFER_ERROR":
            assert e["state"] == "FAILED" and "NIXL_ERR_REMOTE_DISCONNECT" in e["reason"], e
            continue
        assert e["state"] == "FAILED" and e["code"] == "PEER_LOST", e
        assert "peer decode lost" in e["reason"] or "UNAVAILABLE" in e["reason"], e
    delays = [e["t"] - t_kill for e in lost.values()]
    assert max(delays) < LOSS_S + SLACK_S, delays
    record_timing("kill -9 of the decode daemon mid-transfer", "prefill side FAILED after the kill", delays,
                  f"heartbeat {HEARTBEAT_S} s x 2 misses")
    assert successes(fleet, p, d), "no room succeeded before the kill"
    # The prefill daemon gave back every source slot and kept serving.
    wait_no_slots(pre)
    assert_alive(pre)
    # Heartbeats declare it down within 2 intervals, whatever failed the rooms first.
    wait_until(lambda: peer_state(pre, "decode") == "down", max(0.0, t_kill + LOSS_S + SLACK_S - time.time()),
               "the prefill daemon to mark the dead peer down")
    # Restart on the same address: heartbeats find it, the prefill daemon re-handshakes and
    # loads its new NIXL metadata (a new agent), and new rooms work.
    restart(dec)
    wait_until(lambda: peer_state(pre, "decode") == "up", 4 * HEARTBEAT_S + 5, "the restarted peer to be up")
    new_agent = log_lines(pre, "peer decode ")[-1]
    assert "is up, NIXL agent" in new_agent and new_agent.split()[-1] != old_agent.split()[-1], (old_agent, new_agent)
    fresh_rooms_work(fleet, pre, dec, "b", 1100)
    wait_no_slots(pre, dec)
    assert_alive(pre, dec)
    assert not log_lines(pre, "Traceback") and not log_lines(pre, " ERROR ")


def test_kill9_prefill_daemon_mid_transfer_then_restart_elsewhere(daemons: Any, fleet: Fleet) -> None:
    pre, dec = launch_pair(daemons.workdir, daemons.started)
    p, d = pair_jobs(pre, dec, "a", plans(2000, 12, [16] * 10), chunk_delay_s=0.1, p_in_flight=3, d_in_flight=3)
    fleet.start(d)
    fleet.start(p)
    mid_transfer(fleet, d, 2)
    fleet.stop(d)
    t_kill = time.time()
    pre.kill()
    fleet.finish(p.who, d.who)
    lost = {r: e for r, e in fleet.rooms(d.who).items() if e["state"] != "SUCCESS"}
    assert len(lost) >= 2, fleet.rooms(d.who)
    for e in lost.values():
        assert e["state"] == "FAILED" and e["code"] == "PEER_LOST" and "peer prefill lost" in e["reason"], e
    delays = [e["t"] - t_kill for e in lost.values()]
    assert max(delays) < LOSS_S + SLACK_S, delays
    record_timing("kill -9 of the prefill daemon mid-transfer", "decode side FAILED after the kill", delays,
                  f"heartbeat {HEARTBEAT_S} s x 2 misses")
    # Slots of chunks that never landed go back at once: a dead daemon writes nothing more.
    wait_no_slots(dec)
    assert_alive(dec)
    # The prefill daemon comes back on another port (a rescheduled pod): same daemon id, new
    # address, new NIXL agent. Decode engines name the new address; rooms work again.
    restart(pre)
    fresh_rooms_work(fleet, pre, dec, "b", 2100)
    wait_no_slots(pre, dec)
    assert_alive(pre, dec)


def test_sigterm_under_load_drains_without_losing_rooms(daemons: Any, fleet: Fleet) -> None:
    pre, dec = launch_pair(daemons.workdir, daemons.started, "--set", "drain_grace_s=20")
    p, d = pair_jobs(pre, dec, "a", plans(3000, 40, [16] * 6), chunk_delay_s=0.05, p_in_flight=4, d_in_flight=6)
    fleet.start(d)
    fleet.start(p)
    mid_transfer(fleet, d, 2)
    t_term = time.time()
    pre.proc.send_signal(signal.SIGTERM)
    fleet.finish(p.who, d.who)
    rc = pre.proc.wait(30)
    t_exit = time.time()
    assert rc == 0, pre.log_text()[-3000:]
    started = {e["room"] for e in fleet.of_kind("sent", p.who)}
    refused = {r for r, e in fleet.rooms(p.who).items() if e["state"] == "REFUSED"}
    assert refused, "the draining daemon accepted every new room"
    assert all(e["code"] == "UNAVAILABLE" for r, e in fleet.rooms(p.who).items() if r in refused)
    # Nothing lost: every room the prefill engine had started before SIGTERM finished, with
    # every byte checked; the decode side failed only rooms that never started (and said why).
    ok = successes(fleet, p, d)
    assert started and started <= ok, (sorted(started - ok), fleet.rooms(p.who))
    for r, e in fleet.rooms(d.who).items():
        if r not in ok:
            assert r not in started and e["state"] in ("FAILED", "REFUSED") and e["reason"], e
    assert t_exit - t_term < 20, "the drain waited for its whole grace period"
    assert "drain grace over" not in pre.log_text()
    wait_no_slots(dec)
    assert_alive(dec)
    record_timing("SIGTERM of the prefill daemon under load", "time to drain and exit 0", [t_exit - t_term],
                  f"{len(started)} rooms in flight finished, {len(refused)} refused")


@pytest.fixture
def netpair() -> Any:
    why = netns_unavailable()
    if why:
        pytest.skip(f"network cut test needs its own network namespaces: {why}")
    pair = make_netpair("c")
    try:
        yield pair
    finally:
        pair.close()


def test_network_cut_between_namespaced_daemons_and_repair(daemons: Any, fleet: Fleet, netpair: NetPair) -> None:
    wd = daemons.workdir
    # Off loopback, unauthenticated peers must be allowed explicitly (the namespaces are private).
    insecure = ("--set", "insecure_peers=true")
    pre = launch(wd, "prefill", *insecure, prefix=netpair.prefix(0), peer_listen=f"{netpair.ips[0]}:0", wait=False)
    dec = launch(wd, "decode", *insecure, prefix=netpair.prefix(1), peer_listen=f"{netpair.ips[1]}:0", wait=False)
    daemons.started.extend([pre, dec])
    from tests.conftest import wait_ready

    wait_ready(pre)
    wait_ready(dec)
    assert pre.peer_address.startswith(netpair.ips[0])
    p, d = pair_jobs(pre, dec, "a", plans(4000, 12, [16] * 10), chunk_delay_s=0.1, p_in_flight=3, d_in_flight=6)
    fleet.start(d)
    fleet.start(p)
    mid_transfer(fleet, d, 2)
    fleet.stop(p, d)
    t_cut = time.time()
    netpair.cut()
    fleet.finish(p.who, d.who)
    before = successes(fleet, p, d)
    assert before, "no room succeeded before the cut"
    delays: dict[str, list[float]] = {}
    for job, peer in ((p, "decode"), (d, "prefill")):
        lost = {r: e for r, e in fleet.rooms(job.who).items() if e["state"] != "SUCCESS"}
        assert len(lost) >= 2, (job.who, fleet.rooms(job.who))
        for e in lost.values():
            assert e["state"] == "FAILED" and e["code"] == "PEER_LOST" and f"peer {peer} lost" in e["reason"], e
        delays[job.role] = [e["t"] - t_cut for e in lost.values()]
    for role, ds in delays.items():
        # A cut is only seen by heartbeats timing out: up to 2 intervals of silence, then the
        # beat that notices it (its own timeout is one interval).
        assert max(ds) < LOSS_S + SLACK_S, (role, ds)
        record_timing("network cut between the daemons (netns + veth, silent drop)", f"{role} side FAILED after the cut",
                      ds, f"heartbeat {HEARTBEAT_S} s x 2 misses")
    assert_alive(pre, dec)
    # Repair: heartbeats get through again, both sides re-handshake, new rooms work.
    t_fix = time.time()
    netpair.restore()
    wait_until(lambda: peer_state(dec, "prefill") == "up" and peer_state(pre, "decode") == "up", 30,
               "both daemons to see each other up again")
    record_timing("network cut between the daemons (netns + veth, silent drop)", "both peers up again after the repair",
                  [time.time() - t_fix], "not a failure time: recovery")
    fresh_rooms_work(fleet, pre, dec, "b", 4100)
    wait_no_slots(pre, dec, timeout=30)
    assert_alive(pre, dec)
    assert failures_in_log(pre, "prefill") and failures_in_log(dec, "decode")
