"""The page fence of zero-copy rooms (kvxferd.datapath.fence), on subprocess daemons with real NIXL: a
decode room that fails while a prefill WRITE toward its pages is held (fault hook `delay`) is
FAILED at once, with its pages fenced; release() returns only once that WRITE is over, so pages
the engine reuses after it never take late bytes. Before the fence, release() returned at once
and the held WRITE landed in the released pages about a second later."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from kvxfer_client import DecodeReceiver, Layout, PrefillSender, RoomEvent, RoomFailed, RoomState
from tests.faults.harness import fault_command, launch, launch_pair, log_lines, metric, wait_until

PS = 16
LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=PS)
POOL_SLOTS = 16 * PS
POOL_BYTES = LAYOUT.num_layers * 2 * POOL_SLOTS * LAYOUT.total_kv_heads * LAYOUT.head_dim * 2
TOKENS = 40
PPAGES, DPAGES = [1, 2, 3], [9, 4, 12]
HOLD_S = 2.5
# Peer loss: the prefill daemon's loop stalls while its WRITE is held; the decode side loses it
# after two missed heartbeats (~2 s), inside the hold, and hears from it again after the stall.
LOSS_HOLD_S, STALL_S = 6.0, 5.0


def _pool(client: Any) -> np.ndarray:
    """The engine's pool as [layers, K/V, slots, bytes per token slot], mapped in place."""
    raw = np.frombuffer(client.view(0, POOL_BYTES), dtype=np.uint8)
    return raw.reshape(LAYOUT.num_layers, 2, POOL_SLOTS, -1)


def _room_slots(pages: list[int]) -> list[int]:
    return [p * PS + i for p in pages for i in range(PS)][:TOKENS]


class _Events:
    """A decode engine's WatchRooms stream, read on a thread, each event with its arrival time."""

    def __init__(self, rx: DecodeReceiver) -> None:
        self.got: list[tuple[float, RoomEvent]] = []
        self._stream = rx.watch()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for ev in self._stream:
            self.got.append((time.monotonic(), ev))

    def failed(self, fenced: bool) -> list[tuple[float, RoomEvent]]:
        return [(t, e) for t, e in self.got if e.state is RoomState.FAILED and e.pages_fenced is fenced]

    def close(self) -> None:
        self._stream.cancel()


def _setup(pre_socket: str, dec_socket: str, pre_address: str) -> tuple[PrefillSender, DecodeReceiver]:
    tx = PrefillSender(socket=pre_socket, group="zf-pre", layout=LAYOUT, zero_copy=True, ring_bytes=POOL_BYTES,
                       lease_ms=60_000)
    rx = DecodeReceiver(socket=dec_socket, group="zf-dec", layout=LAYOUT, zero_copy=True, ring_bytes=POOL_BYTES,
                        lease_ms=60_000)
    _pool(tx)[:] = np.random.default_rng(3).integers(0, 256, _pool(tx).shape, dtype=np.uint8)
    _pool(rx)[:] = 0xAB
    rx.expect(1, pre_address, "zf-pre", TOKENS, pages=DPAGES)
    wait_until(lambda: rx.poll(1).state >= RoomState.WAITING_FOR_INPUT, 10, "the room to bootstrap")
    return tx, rx


def _hold_a_write(pre: Any, tx: PrefillSender, seconds: float) -> float:
    """The room's one chunk is handed over and its WRITE held `seconds`; returns when it began."""
    fault_command(pre, f"delay {seconds}")
    tx.enqueue(1, 0, 0, TOKENS, pages=PPAGES, last=True)
    wait_until(lambda: bool(log_lines(pre, "holding a WRITE")), 5, "the WRITE to be held")
    return time.monotonic()


def _close(events: _Events, tx: PrefillSender, rx: DecodeReceiver) -> None:
    events.close()
    tx.close()
    rx.close()


def _check_release_waits(pre: Any, tx: PrefillSender, rx: DecodeReceiver, events: _Events, t_fail: float,
                         held_until: float) -> None:
    """The room is FAILED with its pages fenced; release() waits for the held WRITE."""
    st = rx.poll(1)
    assert st.state is RoomState.FAILED and st.pages_fenced, st
    wait_until(lambda: bool(events.failed(True)), 5, "the FAILED event")
    (t_ev, _), = events.failed(True)
    assert t_ev - t_fail < 1.0, "the failure must reach the engine at once, not after the held WRITE"
    rx.release(1)
    released = time.monotonic()
    assert released >= held_until - 0.3, f"release() returned {held_until - released:.2f} s before the WRITE ended"
    # The held WRITE was posted and landed before release() returned (it was what the fence
    # waited for); nothing changes in the pages after it.
    dst, src = _pool(rx), _pool(tx)
    assert log_lines(pre, "holding a WRITE")
    assert np.array_equal(dst[:, :, _room_slots(DPAGES)], src[:, :, _room_slots(PPAGES)]), (
        "the held WRITE did not land before release(): nothing was fenced")
    after = dst.copy()
    time.sleep(0.5)
    assert np.array_equal(_pool(rx), after), "bytes landed in the room's pages after release()"
    outside = [s for s in range(POOL_SLOTS) if s not in set(_room_slots(DPAGES))]
    assert (dst[:, :, outside] == 0xAB).all(), "a page outside the room was written"
    wait_until(lambda: bool(events.failed(False)), 5, "the event that lifts the fence")


@pytest.mark.parametrize("same_daemon", [False, True])
def test_pages_stay_fenced_until_a_held_write_is_over(daemons: Any, same_daemon: bool) -> None:
    pre, dec = launch_pair(daemons.workdir, daemons.started, "--set", "fault_injection=true")
    if same_daemon:
        dec = pre
    tx, rx = _setup(pre.socket, dec.socket, pre.peer_address)
    events = _Events(rx)
    try:
        held_at = _hold_a_write(pre, tx, HOLD_S)
        rx.abort(1, "the request was cancelled")
        t_fail = time.monotonic()
        _check_release_waits(pre, tx, rx, events, t_fail, held_at + HOLD_S)
        with pytest.raises(RoomFailed):
            tx.wait(1, timeout=10)
        assert metric(dec, "kvxferd_page_fences_total", 'event="lifted"') >= 1
        assert metric(dec, "kvxferd_page_fences_total", 'event="expired"') == 0
    finally:
        _close(events, tx, rx)


def test_pages_stay_fenced_across_a_lost_session_until_the_prefill_side_answers(daemons: Any) -> None:
    """The decode side loses the prefill daemon (its loop stalls) while a WRITE toward the
    room's pages is held: the room fails PEER_LOST at once, fenced. The session comes back with
    the same instance; the decode side asks again, and the prefill side answers once its WRITE
    is over. Only then does release() return."""
    # slow_peer_limit_s=0: a stalled loop's port accepts; lost at the heartbeat limit, not held as slow.
    pre, dec = launch_pair(daemons.workdir, daemons.started, "--set", "fault_injection=true",
                           "--set", "slow_peer_limit_s=0")
    tx, rx = _setup(pre.socket, dec.socket, pre.peer_address)
    events = _Events(rx)
    try:
        held_at = _hold_a_write(pre, tx, LOSS_HOLD_S)
        fault_command(pre, f"stall {STALL_S}")
        with pytest.raises(RoomFailed) as lost:
            rx.wait(1, timeout=LOSS_HOLD_S)
        assert lost.value.failure_code == "PEER_LOST", lost.value
        t_fail = time.monotonic()
        assert t_fail < held_at + LOSS_HOLD_S - 1, "the peer loss came too late: nothing was tested"
        _check_release_waits(pre, tx, rx, events, t_fail, held_at + LOSS_HOLD_S)
        assert metric(dec, "kvxferd_page_fences_total", 'event="expired"') == 0
    finally:
        _close(events, tx, rx)


def test_a_failure_before_any_write_and_a_success_are_not_fenced(daemons: Any) -> None:
    pre = launch(daemons.workdir, "zfone")
    daemons.started.append(pre)
    tx, rx = _setup(pre.socket, pre.socket, pre.peer_address)
    try:
        tx.enqueue(1, 0, 0, TOKENS, pages=PPAGES, last=True)
        st = rx.wait(1, timeout=10)
        assert st.state is RoomState.SUCCESS and not st.pages_fenced
        rx.release(1)
        tx.release(1)
        # Failed by its deadline with nothing sent: the prefill side answers the abort at once.
        rx.expect(2, pre.peer_address, "zf-pre", TOKENS, pages=DPAGES, deadline_ms=300)
        with pytest.raises(RoomFailed):
            rx.wait(2, timeout=10)
        wait_until(lambda: not rx.poll(2).pages_fenced, 2, "the fence of a room nothing was written to")
        t0 = time.monotonic()
        rx.release(2)
        assert time.monotonic() - t0 < 1.0
    finally:
        tx.close()
        rx.close()
