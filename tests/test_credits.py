"""The slot-credit fence, on subprocess daemons with real NIXL: a WRITE dispatched into a credit
that is revoked (ring released, peer lost) before the WRITE is posted never lands in space anyone
else owns, and the revoked space is not handed to anyone else until the prefill daemon has
returned the credit."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from kvxfer_client import DecodeReceiver, PrefillSender, RoomFailed, RoomState
from tests.conftest import wait_ready
from tests.faults.harness import (
    LAYOUT,
    TOKEN_BYTES,
    fault_command,
    launch,
    launch_pair,
    log_lines,
    metric,
    wait_no_slots,
    wait_until,
)

RING = 64 * TOKEN_BYTES
TOKENS = 16
# Peer-loss variant: the WRITE is held HOLD_S, the prefill daemon's event loop stalls STALL_S from
# just after; the decode side loses it after 2 heartbeats (~2 s), well inside HOLD_S.
HOLD_S = 6.0
STALL_S = 8.0


def _wait_state(rx: DecodeReceiver, room: int, state: RoomState, timeout: float = 10.0) -> None:
    wait_until(lambda: rx.poll(room).state >= state, timeout, f"room {room} to reach {state.name}")


def test_write_delayed_past_a_ring_release_never_lands_in_reused_space(daemons: Any) -> None:
    pre, dec = launch_pair(daemons.workdir, daemons.started, "--set", "fault_injection=true")
    tx = PrefillSender(socket=pre.socket, group="fence-pre", layout=LAYOUT, ring_bytes=RING)
    rx1 = DecodeReceiver(socket=dec.socket, group="fence-d1", layout=LAYOUT, ring_bytes=RING)
    late = os.urandom(TOKENS * TOKEN_BYTES)
    fresh = os.urandom(TOKENS * TOKEN_BYTES)
    try:
        rx1.expect(1, pre.peer_address, "fence-pre", TOKENS)
        _wait_state(rx1, 1, RoomState.WAITING_FOR_INPUT)
        old_offset = rx1.reg.ring_offset
        # The prefill worker holds the next WRITE for 3 s: dispatched into rx1's credit, not posted.
        fault_command(pre, "delay 3")
        tx.send_chunk(1, 0, 0, TOKENS, late, last=True)
        time.sleep(0.3)
        # rx1's engine goes away: its ring is released, so its credits are revoked.
        rx1.close()
        wait_until(lambda: bool(log_lines(pre, "FAILED")), 5, "the prefill room to fail")
        # A new decode engine registers while the WRITE is still held: the revoked space is not
        # reused yet (the credit has not come back), so its ring lies elsewhere.
        rx2 = DecodeReceiver(socket=dec.socket, group="fence-d2", layout=LAYOUT, ring_bytes=RING)
        try:
            assert not (rx2.reg.ring_offset < old_offset + RING and old_offset < rx2.reg.ring_offset + RING), (
                "the released ring's space was reused while a WRITE into it could still be posted")
            rx2.expect(2, pre.peer_address, "fence-pre", TOKENS)
            _wait_state(rx2, 2, RoomState.WAITING_FOR_INPUT)
            tx.send_chunk(2, 0, 0, TOKENS, fresh, last=True)
            got, st = rx2.receive(2, timeout=30)
            assert st.state is RoomState.SUCCESS
            assert got[0] == fresh
            # Room 2's WRITE went to another transfer thread and finished while room 1's is
            # still held: wait until the held one reaches its post and is refused there, then
            # check that none of its bytes landed in the new ring.
            wait_until(lambda: bool(log_lines(pre, "destination credit revoked before the WRITE was posted")), 10,
                       "the held WRITE to be refused at post time")
            ring2 = bytes(rx2.view(0, RING))
            assert late not in ring2 and late[:4096] not in ring2
        finally:
            rx2.close()
        try:
            tx.wait(1, timeout=5)
            raise AssertionError("room 1 should have failed on the prefill side")
        except RoomFailed as exc:
            assert exc.failure_code in ("ENGINE_LOST", "TRANSFER_ERROR"), exc
        # Once the credit came back the space is free again: a third engine may get it, and the
        # late bytes are nowhere in it.
        wait_until(lambda: metric(dec, "kvxferd_credits_total") > 0, 5, "credit metrics")
        wait_no_slots(dec, timeout=15)
        rx3 = DecodeReceiver(socket=dec.socket, group="fence-d3", layout=LAYOUT, ring_bytes=RING)
        try:
            ring3 = bytes(rx3.view(0, RING))
            assert late[:4096] not in ring3
        finally:
            rx3.close()
    finally:
        tx.close()
    wait_no_slots(pre, dec)


def test_write_delayed_past_a_peer_loss_lands_only_in_space_nobody_else_owns(daemons: Any) -> None:
    """The decode daemon loses the prefill daemon (its event loop stalls: no heartbeats) while a
    WRITE into a granted window is held. The prefill daemon's worker posts it after the loss, not
    knowing of it yet: the one case where revoked space really receives late bytes. That space
    stays allocated until the prefill daemon gives the credit back, so a room another prefill
    daemon sends meanwhile lands elsewhere and keeps its bytes, and a room that later needs the
    whole ring gets it only after the return, byte-exact."""
    other = launch(daemons.workdir, "prefill2", wait=False)
    daemons.started.append(other)
    # slow_peer_limit_s=0: the stalled daemon's port accepts, and this test needs it lost at the
    # heartbeat limit (twice it), not held as slow for the default 30 s.
    pre, dec = launch_pair(daemons.workdir, daemons.started, "--set", "fault_injection=true",
                           "--set", "slow_peer_limit_s=0")
    wait_ready(other)
    # A long lease: the stalled daemon must not drop its engine for keep-alives it could not read.
    tx = PrefillSender(socket=pre.socket, group="loss-pre", layout=LAYOUT, ring_bytes=2 * RING, lease_ms=60_000)
    tx2 = PrefillSender(socket=other.socket, group="loss-pre2", layout=LAYOUT, ring_bytes=RING)
    rx = DecodeReceiver(socket=dec.socket, group="loss-d", layout=LAYOUT, ring_bytes=RING)
    warm = DecodeReceiver(socket=dec.socket, group="loss-w", layout=LAYOUT, ring_bytes=RING)
    late = os.urandom(TOKENS * TOKEN_BYTES)
    fresh = os.urandom(TOKENS * TOKEN_BYTES)
    whole = os.urandom(RING)
    try:
        # The decode daemon and prefill2 handshake before the fault (a room into another ring), so
        # that room 2 below is done in well under a second while the WRITE is held.
        warm.expect(9, other.peer_address, "loss-pre2", TOKENS)
        _wait_state(warm, 9, RoomState.WAITING_FOR_INPUT)
        tx2.send_chunk(9, 0, 0, TOKENS, os.urandom(TOKENS * TOKEN_BYTES), last=True)
        warm.receive(9, timeout=30)
        warm.release(9)

        rx.expect(1, pre.peer_address, "loss-pre", TOKENS)
        _wait_state(rx, 1, RoomState.WAITING_FOR_INPUT)
        fault_command(pre, f"delay {HOLD_S}")
        t_held = time.monotonic()
        tx.send_chunk(1, 0, 0, TOKENS, late, last=True)
        wait_until(lambda: bool(log_lines(pre, "holding a WRITE")), 5, "the WRITE to be held")
        fault_command(pre, f"stall {STALL_S}")
        with pytest.raises(RoomFailed) as lost:
            rx.wait(1, timeout=HOLD_S)
        assert lost.value.failure_code == "PEER_LOST", lost.value
        assert pre.proc.poll() is None, "the prefill daemon must be alive: lost, not gone"

        # Another prefill daemon fills the same ring while the WRITE is still held. Without the
        # fence its window would be the revoked one (first fit), right where the late bytes go.
        rx.expect(2, other.peer_address, "loss-pre2", TOKENS)
        _wait_state(rx, 2, RoomState.WAITING_FOR_INPUT)
        tx2.send_chunk(2, 0, 0, TOKENS, fresh, last=True)
        wait_until(lambda: rx.poll(2).state is RoomState.SUCCESS, 5, "room 2 to land")
        assert time.monotonic() - t_held < HOLD_S, "room 2 landed after the late WRITE: nothing was tested"
        (c2,) = rx.poll(2).landed  # not watermarked: room 2 keeps owning this space meanwhile

        # The stall ends. The held WRITE was posted while it lasted: only the stalled loop could
        # have marked the credit revoked. The prefill side learns of the loss from the decode
        # side (the abort answering its completion), so its half fails PEER_LOST too.
        with pytest.raises(RoomFailed) as lost_pre:
            tx.wait(1, timeout=STALL_S + 10)
        assert lost_pre.value.failure_code == "PEER_LOST", lost_pre.value
        assert not log_lines(pre, "destination credit revoked before the WRITE was posted")
        ring = bytes(rx.view(0, RING))
        assert ring[c2.offset:c2.offset + len(fresh)] == fresh, "late bytes landed in room 2's space"
        at = ring.find(late)
        assert at >= 0, "the late WRITE did not land: the revoked window was never written into"
        assert at + len(late) <= c2.offset or c2.offset + len(fresh) <= at, (at, c2.offset)
        rx.watermark(2, [0])
        rx.release(2)
        for eng in (tx, rx):
            eng.release(1)

        # A room that needs the whole ring: its space includes the revoked window, which is free
        # again only once the prefill daemon, reachable again, has given the credit back.
        rx.expect(3, pre.peer_address, "loss-pre", RING // TOKEN_BYTES)
        _wait_state(rx, 3, RoomState.WAITING_FOR_INPUT)
        tx.send_chunk(3, 0, 0, RING // TOKEN_BYTES, whole, last=True)
        got, st = rx.receive(3, timeout=20)
        assert st.state is RoomState.SUCCESS and got[0] == whole
        ring = bytes(rx.view(0, RING))
        assert ring == whole and late[:4096] not in ring
        # Given back, not taken back by the quarantine (30 s) as a last resort.
        assert not log_lines(dec, "not returned in")
        rx.release(3)
        tx.wait(3, timeout=10)
        tx.release(3)
    finally:
        for eng in (tx, tx2, rx, warm):
            eng.close()
    wait_no_slots(pre, dec, other)
