"""Room behaviours engine adapters reported (issue #14): a prefill rank may poll a room of its
group before its first chunk; ReleaseRoom by one prefill rank does not forget a room another rank
has not joined yet; bootstrapping into a FAILED room reports that room's own failure, not MISMATCH.
And: a decode room answers only the engine that expects it (not another group's engine of the same
rank); a chunk part larger than the reader's whole ring fails its room at once, on both sides,
and the ring's other rooms go on.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxfer_client import DecodeReceiver, KvxferError, Layout, PrefillSender, RoomFailed, RoomState
from tests.conftest import DaemonProc, spawn_daemon, stop_all, wait_ready
from tests.faults.harness import wait_until
from tests.test_e2e import status

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16)
HEAD_TOKEN = 2 * 2 * 16 * 2  # bytes of one head for one token (layers x K/V x head_dim x dtype)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[DaemonProc, DaemonProc]]:
    wd = Path(tempfile.mkdtemp(prefix="kvxe-"))
    pre, dec = spawn_daemon(wd, "pre", wait=False), spawn_daemon(wd, "dec", wait=False)
    try:
        wait_ready(pre)
        wait_ready(dec)
        yield pre, dec
    finally:
        stop_all(pre, dec)
        shutil.rmtree(wd, ignore_errors=True)


def polled(tx: PrefillSender, room: int) -> RoomState | None:
    try:
        return tx.poll(room).state
    except KvxferError:
        return None


def test_ranks_of_a_group_see_its_rooms_before_their_first_chunk_and_release_forgets_nothing(
        pair: tuple[DaemonProc, DaemonProc]) -> None:
    pre, dec = pair
    ranks = [PrefillSender(socket=pre.socket, group="tp2", layout=LAYOUT, tp_size=2, tp_rank=r,
                           ring_bytes=1 << 20) for r in (0, 1)]
    try:
        r0, r1 = ranks
        with DecodeReceiver(socket=dec.socket, group="d1", layout=LAYOUT, ring_bytes=1 << 20) as rx:
            # Room 1: rank 1 polls the room the decode side bootstrapped, before its own first chunk.
            rx.expect(1, pre.peer_address, "tp2", 16)
            wait_until(lambda: polled(r1, 1) is not None, 10, "the bootstrapped room to be visible to rank 1")
            st = r1.poll(1)
            assert st.state in (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT) and st.chunks_done == 0
            parts = [bytes([0x10 + r]) * (16 * HEAD_TOKEN) for r in (0, 1)]
            wait_until(lambda: polled(r1, 1) is RoomState.WAITING_FOR_INPUT, 10, "room 1 to wait for input")
            r0.send_chunk(1, 0, 0, 16, parts[0], last=True)
            # Rank 0's chunk made the room TRANSFERRING; rank 1 has sent nothing, so for it the room
            # still waits for its input (sglang's scheduler sends only then).
            assert r0.poll(1).state in (RoomState.TRANSFERRING, RoomState.SUCCESS)
            st = r1.poll(1)
            assert st.state is RoomState.WAITING_FOR_INPUT and st.chunks_done == 0
            r1.send_chunk(1, 0, 0, 16, parts[1], last=True)
            got, _ = rx.receive(1, timeout=30)
            assert got[0] == parts[0] + parts[1]  # the reader's slot holds head 0, then head 1
            for tx in ranks:
                assert tx.wait(1, timeout=10).chunks_done == 1
                tx.release(1)
            rx.release(1)
            # Room 2: it fails after rank 0 joined; rank 0 releases it. Rank 1 must still find it
            # FAILED (not open a new room nobody bootstraps, holding its slots until the deadline).
            rx.expect(2, pre.peer_address, "tp2", 16)
            r0.send_chunk(2, 0, 0, 16, parts[0], last=True)
            rx.abort(2, "client went away")
            wait_until(lambda: polled(r0, 2) is RoomState.FAILED, 10, "rank 0 to see the abort")
            r0.release(2)
            st = r1.poll(2)
            assert st.state is RoomState.FAILED and st.failure_code == "ABORTED" and "client went away" in st.failure_reason
            with pytest.raises(KvxferError) as ei:
                r1.send_chunk(2, 0, 0, 16, parts[1], last=True)
            assert ei.value.code.name == "FAILED_PRECONDITION" and "client went away" in ei.value.message
            r1.release(2)
            rx.release(2)
    finally:
        for tx in ranks:
            tx.close()


def test_bootstrapping_into_a_failed_room_reports_its_own_failure(pair: tuple[DaemonProc, DaemonProc]) -> None:
    pre, dec = pair
    with PrefillSender(socket=pre.socket, group="tp1", layout=LAYOUT, ring_bytes=1 << 20) as tx, \
            DecodeReceiver(socket=dec.socket, group="d2", layout=LAYOUT, ring_bytes=1 << 20) as rx:
        tx.send_chunk(3, 0, 0, 16, b"\1" * (32 * HEAD_TOKEN), last=True)
        tx.abort(3, "prefill gave up")
        rx.expect(3, pre.peer_address, "tp1", 16)
        with pytest.raises(RoomFailed) as ei:
            rx.receive(3, timeout=30)
        assert ei.value.failure_code == "ABORTED", ei.value
        assert "prefill gave up" in ei.value.reason
        # A room the decode side gave up on before the prefill side had it: a rank's poll says so.
        rx.expect(4, pre.peer_address, "tp1", 16)
        rx.abort(4, "decode gave up")
        wait_until(lambda: polled(tx, 4) is RoomState.FAILED, 10, "the prefill rank to see room 4 FAILED")
        st = tx.poll(4)
        assert st.failure_code == "ABORTED" and "decode gave up" in st.failure_reason


def test_a_room_failed_and_released_before_its_bootstrap_fails_the_late_decode_side_at_once(
        pair: tuple[DaemonProc, DaemonProc]) -> None:
    # The prefill side failed room 6 and every rank let go of it before any decode side asked: it
    # used to be forgotten, so a late Bootstrap opened a fresh room nobody would send, and the
    # decode side waited for its deadline (120 s). Now it is remembered and the bootstrap refused.
    pre, dec = pair
    with PrefillSender(socket=pre.socket, group="tp1", layout=LAYOUT, ring_bytes=1 << 20) as tx, \
            DecodeReceiver(socket=dec.socket, group="d6", layout=LAYOUT, ring_bytes=1 << 20) as rx:
        before = dict(status(pre.socket).rooms_by_state)  # the pair is shared: earlier tests' rooms
        tx.send_chunk(6, 0, 0, 16, b"\1" * (32 * HEAD_TOKEN), last=True)
        tx.abort(6, "prefill gave up on 6")
        wait_until(lambda: polled(tx, 6) is RoomState.FAILED, 10, "room 6 FAILED on the prefill side")
        tx.release(6)
        assert tx.poll(6).state is RoomState.FAILED  # the room is gone; what is remembered is its end
        assert dict(status(pre.socket).rooms_by_state) == before
        rx.expect(6, pre.peer_address, "tp1", 16)
        with pytest.raises(RoomFailed) as ei:
            rx.receive(6, timeout=10)
        assert "prefill gave up on 6" in ei.value.reason, ei.value
        # Nothing was opened on the prefill side for it, and a new generation is a new room.
        assert dict(status(pre.socket).rooms_by_state) == before
        rx.expect(6, pre.peer_address, "tp1", 16, generation=1)
        tx.send_chunk(6, 0, 0, 16, b"\2" * (32 * HEAD_TOKEN), last=True, generation=1)
        got, final = rx.receive(6, timeout=30, generation=1)
        assert final.state is RoomState.SUCCESS and got[0] == b"\2" * (32 * HEAD_TOKEN)


def test_only_the_engine_that_expects_a_decode_room_may_poll_abort_or_release_it(
        pair: tuple[DaemonProc, DaemonProc]) -> None:
    pre, dec = pair
    data = os.urandom(16 * 2 * HEAD_TOKEN)
    with PrefillSender(socket=pre.socket, group="own", layout=LAYOUT, ring_bytes=1 << 20) as tx, \
            DecodeReceiver(socket=dec.socket, group="dA", layout=LAYOUT, ring_bytes=1 << 20) as a, \
            DecodeReceiver(socket=dec.socket, group="dB", layout=LAYOUT, ring_bytes=1 << 20) as b:
        a.expect(10, pre.peer_address, "own", 16)
        wait_until(lambda: a.poll(10).state is RoomState.WAITING_FOR_INPUT, 10, "room 10 to wait for input")
        # dB's engine has the same tp_rank (0) but expects no such room: as for an unknown room.
        for call in (lambda: b.poll(10), lambda: b.abort(10, "not mine"), lambda: b.release(10)):
            with pytest.raises(KvxferError) as ei:
                call()
            assert ei.value.code.name == "NOT_FOUND", ei.value
        assert a.poll(10).state is RoomState.WAITING_FOR_INPUT
        tx.send_chunk(10, 0, 0, 16, data, last=True)
        got, _ = a.receive(10, timeout=30)
        assert got[0] == data
        tx.release(10)
        a.release(10)


def test_a_part_larger_than_the_readers_whole_ring_fails_its_room_at_once(pair: tuple[DaemonProc, DaemonProc]) -> None:
    pre, dec = pair
    token = 2 * HEAD_TOKEN  # both KV heads of one token: the reader's part (TP 1)
    with PrefillSender(socket=pre.socket, group="big", layout=LAYOUT, ring_bytes=1 << 20) as tx, \
            DecodeReceiver(socket=dec.socket, group="d4k", layout=LAYOUT, ring_bytes=16 * token) as rx:
        rx.expect(20, pre.peer_address, "big", 64)
        rx.expect(21, pre.peer_address, "big", 16)
        for room in (20, 21):
            wait_until(lambda room=room: rx.poll(room).state is RoomState.WAITING_FOR_INPUT, 10, f"room {room}")
        # 32 tokens can never fit a 16-token ring: the room fails now, not at its deadline, and the
        # chunk queued behind it on the same ring is not stuck there.
        data = os.urandom(16 * token)
        tx.send_chunk(20, 0, 0, 32, os.urandom(32 * token), last=False)
        tx.send_chunk(21, 0, 0, 16, data, last=True)
        with pytest.raises(RoomFailed) as ei:
            rx.receive(20, timeout=10)
        assert ei.value.failure_code == "MISMATCH" and "can never fit" in ei.value.reason, ei.value
        wait_until(lambda: polled(tx, 20) is RoomState.FAILED, 10, "the prefill side to fail room 20")
        got, _ = rx.receive(21, timeout=10)
        assert got[0] == data
        for room in (20, 21):
            tx.release(room)
            rx.release(room)


@pytest.mark.parametrize(("room", "spans", "why"), [
    (30, ((0, 8), (16, 8)), "tokens [8, 16) were never sent"),
    (31, ((0, 16), (8, 16)), "tokens [8, 16) were sent twice"),
])
def test_chunks_that_leave_tokens_out_or_send_them_twice_fail_the_room(
        pair: tuple[DaemonProc, DaemonProc], room: int, spans: tuple[tuple[int, int], ...], why: str) -> None:
    # An engine bug (sglang's repeated chunk id makes one): every chunk id up to the last one
    # arrived, so the room used to be SUCCESS on both sides, with a hole in the decode side's KV.
    pre, dec = pair
    with PrefillSender(socket=pre.socket, group="tp1", layout=LAYOUT, ring_bytes=1 << 20) as tx, \
            DecodeReceiver(socket=dec.socket, group=f"d{room}", layout=LAYOUT, ring_bytes=1 << 20) as rx:
        rx.expect(room, pre.peer_address, "tp1", 24)
        for i, (start, n) in enumerate(spans):
            tx.send_chunk(room, i, start, n, bytes([i + 1]) * (n * 2 * HEAD_TOKEN), last=i == len(spans) - 1)
        for failed in (lambda: rx.receive(room, timeout=30), lambda: tx.wait(room, timeout=30)):
            with pytest.raises(RoomFailed) as ei:
                failed()
            assert ei.value.failure_code == "MISMATCH" and why in ei.value.reason, ei.value
