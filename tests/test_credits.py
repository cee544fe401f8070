"""The slot-credit fence, on two subprocess daemons with real NIXL: a WRITE dispatched into a
credit that is revoked before the WRITE is posted never lands, and the revoked space is not
handed to anyone else until the prefill daemon has returned the credit."""

from __future__ import annotations

import os
import time
from typing import Any

from kvxfer_client import DecodeReceiver, PrefillSender, RoomFailed, RoomState
from tests.faults.harness import (
    LAYOUT,
    TOKEN_BYTES,
    fault_command,
    launch_pair,
    log_lines,
    metric,
    wait_no_slots,
    wait_until,
)

RING = 64 * TOKEN_BYTES
TOKENS = 16


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
            ring2 = bytes(rx2.view(0, RING))
            assert late not in ring2 and late[:4096] not in ring2
        finally:
            rx2.close()
        # The held WRITE was refused at post time, and the room that owned it failed.
        assert log_lines(pre, "destination credit revoked before the WRITE was posted")
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
