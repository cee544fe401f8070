"""Pairs that heal (issue #41), on one pair of subprocess daemons (real NIXL between them), in order:

- a decode room that fails before its bootstrap reached the prefill daemon (the pair's first room:
  the handshake is still running) frees the prefill side's slots at once, not at its deadline;
- a transport error that breaks the pair's NIXL connection (as NIXL_ERR_REMOTE_DISCONNECT did in the
  field, where only a restart healed it): the pair shows down while it is broken, its connection is
  rebuilt once the cause has passed, and the next rooms succeed, with no restart;
- a 3 s SIGSTOP of either daemon under load fails no room (slow is not dead);
- a 20 s SIGSTOP of the decode daemon (default slow_peer_limit_s) loses none of its engines, which
  renew after it resumes; a room whose deadline falls inside the stop fails DEADLINE at that
  deadline, the room beside it whose deadline allows completes after the stop, and new rooms work.

Every room that succeeds has every byte checked by the decode engine.
"""

from __future__ import annotations

import signal
import time

import grpc
import numpy as np

from kvxfer_client import DecodeReceiver, KvxferError, PrefillSender, RoomState
from tests.conftest import DaemonProc
from tests.engine_procs import part_bytes_for
from tests.faults.harness import (
    LAYOUT,
    TOKEN_BYTES,
    Fleet,
    Job,
    assert_alive,
    fault_command,
    jobs,
    log_lines,
    metric,
    peer_state,
    plans,
    record_timing,
    status,
    wait_no_slots,
    wait_until,
)

Pair = tuple[DaemonProc, DaemonProc]


def outcomes(fleet: Fleet, p: Job, d: Job) -> dict[int, str]:
    """room -> SUCCESS (both sides, every byte checked by the decode engine) or the failure code."""
    plan = {r.room: r for r in d.rooms}
    got_p, got_d = fleet.rooms(p.who), fleet.rooms(d.who)
    out = {}
    for r, e in got_d.items():
        if e["state"] == "SUCCESS":
            assert e["bytes"] == plan[r].num_tokens * TOKEN_BYTES, e
            assert got_p[r]["state"] == "SUCCESS", got_p.get(r)
            out[r] = "SUCCESS"
        else:
            out[r] = e["code"] or e["state"]
    return out


def both_up(pre: DaemonProc, dec: DaemonProc) -> bool:
    return peer_state(pre, "decode") == "up" and peer_state(dec, "prefill") == "up"


def test_a_decode_failure_before_the_bootstrap_frees_the_prefill_slots_at_once(pair: Pair) -> None:
    pre, dec = pair
    with PrefillSender(socket=pre.socket, group="early-pre", layout=LAYOUT, ring_bytes=1 << 20,
                       claim_slots=False) as tx, \
            DecodeReceiver(socket=dec.socket, group="early-dec", layout=LAYOUT, ring_bytes=1 << 20) as rx:
        for cid in range(2):
            data = part_bytes_for(LAYOUT, 1, 0, 9, cid, 16)
            tx.send_chunk(9, cid, 16 * cid, 16, data.data, last=False)
        assert status(pre.socket).slots_held == 2
        # The pair's first room: the decode daemon is still handshaking with the prefill daemon when
        # the engine aborts, so the room fails before its bootstrap went out.
        rx.expect(9, pre.peer_address, "early-pre", 64)
        t_abort = time.monotonic()
        rx.abort(9, "test: the engine gives up before the bootstrap")
        wait_until(lambda: status(pre.socket).slots_held == 0, 5, "the prefill daemon to free the room's slots")
        took = time.monotonic() - t_abort
        assert took < 1.0, took
        st = tx.poll(9)
        assert st.state is RoomState.FAILED and "decode side" in st.failure_reason, st
        record_timing("decode room aborted before its bootstrap reached the prefill daemon",
                      "prefill side's slots freed after AbortRoom", [took], "120 s (the deadline) before")
        tx.release(9)
        rx.release(9)
    wait_no_slots(pre, dec)
    assert_alive(pre, dec)


def test_a_transport_error_heals_without_a_restart(pair: Pair, fleet: Fleet) -> None:
    pre, dec = pair
    p, d = jobs(pre, dec, "heal", plans(100, 40, [16] * 4), in_flight=2, chunk_delay_s=0.03)
    fleet.start(d)
    fleet.start(p)
    fleet.wait_for(lambda: sum(1 for e in fleet.rooms(d.who).values() if e["state"] == "SUCCESS") >= 3, 60,
                   "three rooms to succeed before the fault")
    before = metric(pre, "kvxferd_peer_reconnects_total")
    # The next WRITE breaks the connection; rebuilding it fails for 1.5 s (the cause lasts that long).
    fault_command(pre, "break 1.5")
    wait_until(lambda: peer_state(pre, "decode") == "down" and metric(pre, "kvxferd_peers", 'state="down"') == 1,
               10, "the broken pair to show down in GetStatus and kvxferd_peers")
    t_down = time.monotonic()
    wait_until(lambda: peer_state(pre, "decode") == "up", 15, "the pair to be rebuilt")
    record_timing("transport error that breaks the pair (fault `break 1.5`)", "pair up again after it showed down",
                  [time.monotonic() - t_down], "the cause lasts 1.5 s; rebuilds retried with back-off")
    assert metric(pre, "kvxferd_peers", 'state="up"') == 1
    assert metric(pre, "kvxferd_peer_reconnects_total") == before + 1
    fleet.finish()
    got = outcomes(fleet, p, d)
    assert set(got) == {r.room for r in d.rooms}, got
    failed = {r for r, c in got.items() if c != "SUCCESS"}
    assert failed and all(got[r] == "TRANSFER_ERROR" for r in failed), got
    # The next rooms on the pair succeed, every byte checked, with no restart: it healed.
    p2, d2 = jobs(pre, dec, "healed", plans(150, 8, [16] * 4), in_flight=2)
    fleet.start(d2)
    fleet.start(p2)
    fleet.finish(p2.who, d2.who)
    assert outcomes(fleet, p2, d2) == {r.room: "SUCCESS" for r in d2.rooms}
    assert log_lines(pre, "NIXL connection rebuilt")
    assert pre.proc.poll() is None and dec.proc.poll() is None
    wait_no_slots(pre, dec)
    assert_alive(pre, dec)


def test_a_3s_stop_of_either_daemon_fails_no_room(pair: Pair, fleet: Fleet) -> None:
    pre, dec = pair
    wait_until(lambda: both_up(pre, dec), 15, "both daemons to see each other up")
    p, d = jobs(pre, dec, "stop", plans(300, 24, [16] * 6), in_flight=3, chunk_delay_s=0.05)
    fleet.start(d)
    fleet.start(p)
    for victim in (dec, pre):
        n = sum(1 for e in fleet.rooms(d.who).values() if e["state"] == "SUCCESS")
        fleet.wait_for(lambda n=n: sum(1 for e in fleet.rooms(d.who).values() if e["state"] == "SUCCESS") >= n + 2,
                       60, "two more rooms to succeed before the stop")
        victim.proc.send_signal(signal.SIGSTOP)
        try:
            fleet.pump(3.0)
        finally:
            victim.proc.send_signal(signal.SIGCONT)
    fleet.finish()
    got = outcomes(fleet, p, d)
    assert got == {r.room: "SUCCESS" for r in d.rooms}, got
    for side in (pre, dec):
        assert not log_lines(side, ") lost: "), log_lines(side, ") lost: ")
    # Each side saw the other slow, not dead, and its own pause for what it was.
    assert log_lines(pre, "slow, not lost") and log_lines(dec, "slow, not lost")
    assert log_lines(pre, "did not run for") and log_lines(dec, "did not run for")
    wait_no_slots(pre, dec)
    assert_alive(pre, dec)


def test_a_20s_stop_loses_no_engine_that_renews_after_it(pair: Pair) -> None:
    pre, dec = pair
    wait_until(lambda: both_up(pre, dec), 15, "both daemons to see each other up")
    with PrefillSender(socket=pre.socket, group="long-pre", layout=LAYOUT, ring_bytes=1 << 20, lease_ms=2000,
                       claim_slots=False) as tx, \
            DecodeReceiver(socket=dec.socket, group="long-dec", layout=LAYOUT, ring_bytes=1 << 20,
                           lease_ms=2000) as rx:
        # Two rooms wait for the prefill engine's chunks through the stop: the deadline of one (4 s)
        # falls inside it, the other's (60 s) allows it.
        rx.expect(12, pre.peer_address, "long-pre", 32, deadline_ms=4000)
        rx.expect(13, pre.peer_address, "long-pre", 32, deadline_ms=60_000)
        wait_until(lambda: all(sent_state(tx, r) is RoomState.WAITING_FOR_INPUT for r in (12, 13)), 15,
                   "both rooms bootstrapped on the prefill side")
        t_stop = time.monotonic()
        dec.proc.send_signal(signal.SIGSTOP)
        try:
            # The prefill daemon, still running, holds the silent decode daemon as slow, not lost
            # (slow_peer_limit_s, 30 s by default): the short room fails at its own deadline.
            wait_until(lambda: tx.poll(12).state is RoomState.FAILED, 15, "the 4 s room to fail at its deadline")
            failed_after = time.monotonic() - t_stop
            assert tx.poll(12).failure_code == "DEADLINE", tx.poll(12)
            assert tx.poll(13).state is RoomState.WAITING_FOR_INPUT, tx.poll(13)
            time.sleep(max(0.0, t_stop + 20 - time.monotonic()))
        finally:
            dec.proc.send_signal(signal.SIGCONT)
        t_cont = time.monotonic()
        record_timing("20 s SIGSTOP of the decode daemon", "a 4 s room FAILED DEADLINE (prefill side, from the stop)",
                      [failed_after], "the 60 s room beside it then succeeded")
        wait_until(lambda: both_up(pre, dec), 30, "both daemons to see each other up after the stop")
        wait_until(lambda: rx.poll(12).state is RoomState.FAILED, 10, "the 4 s room failed on the decode side")
        assert rx.poll(12).failure_code == "DEADLINE", rx.poll(12)
        tx.release(12)
        rx.release(12)
        # The room whose deadline allowed it completes after the stop, every byte checked.
        move_checked(tx, rx, 13)
        # More than a whole lease after the resume: an engine expired by the paused clock is gone by now.
        time.sleep(max(0.0, t_cont + 3.0 - time.monotonic()))
        assert rx.engine_id in {e.engine_id for e in status(dec.socket).engines}
        assert not log_lines(dec, "engine lease lapsed")
        assert log_lines(dec, "keep their leases")
        for side in (pre, dec):
            assert not log_lines(side, ") lost: "), log_lines(side, ") lost: ")
        # The same engines move a new room, every byte checked.
        rx.expect(11, pre.peer_address, "long-pre", 32)
        move_checked(tx, rx, 11)
    wait_no_slots(pre, dec)
    assert_alive(pre, dec)


def sent_state(tx: PrefillSender, room: int) -> RoomState | None:
    """The room's state on the prefill side; None until its bootstrap has reached the prefill daemon
    (which knows no room before that: on a loaded machine the first poll can come first)."""
    try:
        return tx.poll(room).state
    except KvxferError as exc:
        if exc.code is grpc.StatusCode.NOT_FOUND:
            return None
        raise


def move_checked(tx: PrefillSender, rx: DecodeReceiver, room: int) -> None:
    """Sends an expected room's two chunks of 16 tokens and checks every byte and the aux that land."""
    want = []
    for cid in range(2):
        data = part_bytes_for(LAYOUT, 1, 0, room, cid, 16)
        want.append(data)
        tx.send_chunk(room, cid, 16 * cid, 16, data.data, last=cid == 1, aux=b"a" if cid == 1 else b"")
    chunks, final = rx.receive(room, timeout=30)
    assert final.state is RoomState.SUCCESS and final.aux == b"a", final
    for cid, w in enumerate(want):
        assert np.array_equal(np.frombuffer(chunks[cid], dtype=np.uint8), w), cid
    tx.wait(room, timeout=10)
    tx.release(room)
    rx.release(room)
