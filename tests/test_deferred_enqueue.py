"""PrefillSender.enqueue(wait=False): chunks handed over without waiting for the daemon's
verdict, against real daemons moving real bytes; refusals still reach the engine, name their
chunk and change nothing; a silent daemon does not hang the engine."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import grpc
import pytest

from kvxfer_client import (
    AsyncDecodeReceiver,
    AsyncPrefillSender,
    ChunkRefused,
    DecodeReceiver,
    Layout,
    PrefillSender,
    RoomState,
    Slot,
)
from kvxfer_client._aio_lane import AioLane
from tests.faults.harness import metric
from tests.test_e2e import status

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=64, dtype_bytes=2, page_size=16, dtype="bfloat16")
TOKEN_BYTES = LAYOUT.num_layers * 2 * LAYOUT.total_kv_heads * LAYOUT.head_dim * LAYOUT.dtype_bytes
RPCS = "kvxferd_rpc_duration_seconds_count"


def test_chunks_sent_without_waiting_land_byte_exact(daemons: Any) -> None:
    pre = daemons("prefill")
    dec = daemons("decode")
    chunks, tokens = 24, 32
    data = [random.Random(i).randbytes(TOKEN_BYTES * tokens) for i in range(chunks)]
    # Slots from the daemon, with spares (the claimed-slot client is tests/test_claimed_slots.py).
    with PrefillSender(socket=pre.socket, group="dw-pre", layout=LAYOUT, ring_bytes=4 << 20,
                       claim_slots=False) as tx, \
            DecodeReceiver(socket=dec.socket, group="dw-dec", layout=LAYOUT, ring_bytes=4 << 20) as rx:
        rx.expect(1, pre.peer_address, "dw-pre", chunks * tokens)
        for cid in range(chunks):
            slot = tx.acquire(tokens)
            tx.slot_view(slot)[:] = data[cid]
            assert tx.enqueue(1, cid, cid * tokens, tokens, slot, last=cid == chunks - 1, wait=False) is None
        assert tx.flush() == []
        assert tx.stub.lane is not None and tx.stub.lane.deferred() == 0
        got, final = rx.receive(1, timeout=30)
        assert final.state is RoomState.SUCCESS
        assert [got[c] for c in range(chunks)] == data
        assert tx.wait(1, timeout=10).state is RoomState.SUCCESS
        # One EnqueueChunk per chunk and no AcquireSlot for most of them: after an AcquireSlot
        # every earlier verdict has been read, and two spares are held ahead, so at worst every
        # other chunk asks.
        assert metric(pre, RPCS, 'method="EnqueueChunk"') == chunks
        assert 1 <= metric(pre, RPCS, 'method="AcquireSlot"') <= chunks // 2 + 1
        # The spares are the engine's (at most two), and go back when it leaves.
        held = [e.slots_held for e in status(pre.socket).engines]
        assert held == [len(tx.spare._held)] and held[0] <= 2
        assert status(pre.socket).slots_held == 0
    assert status(pre.socket).engines == []


def test_a_refused_chunk_reaches_the_engine_and_changes_nothing(daemons: Any) -> None:
    d = daemons("defer-refused")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        slot = tx.acquire(8)
        bad = Slot(slot.offset + 256, slot.length, slot.chunk_bytes)
        tx.enqueue(1, 0, 0, 8, bad, last=True, wait=False)
        (refused,) = tx.flush()
        assert isinstance(refused, ChunkRefused)
        assert (refused.room, refused.chunk_id, refused.slot) == (1, 0, bad)
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "room 1 chunk 0" in str(refused)
        assert not refused.lost  # the daemon's verdict: the slot is still ours
        assert tx.flush() == []  # returned once
        # Nothing changed: the room does not exist, the slot is still the engine's and goes in.
        assert status(d.socket).rooms_by_state.get("BOOTSTRAPPING", 0) == 0
        tx.enqueue(1, 0, 0, 8, slot, last=True, wait=False)
        assert tx.flush() == []
        assert tx.poll(1).state is RoomState.BOOTSTRAPPING

        # Not flushed: the next acquire() raises it before doing anything. poll() reads the
        # verdict on its way (the daemon answers a connection's calls in order).
        held = status(d.socket).engines[0].slots_held
        tx.enqueue(2, 0, 0, 8, bad, last=True, wait=False)
        tx.poll(1)
        try:
            tx.acquire(8)
        except ChunkRefused as exc:
            assert (exc.room, exc.chunk_id) == (2, 0) and exc.code == grpc.StatusCode.INVALID_ARGUMENT
        else:
            raise AssertionError("the refusal of room 2 was not raised")
        assert status(d.socket).engines[0].slots_held == held
        assert tx.flush() == []


def test_settle_hands_over_the_refusals_already_read_without_waiting(daemons: Any) -> None:
    d = daemons("defer-settle")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        assert tx.settle() == []  # nothing sent: returns at once
        slot = tx.acquire(8)
        bad = Slot(slot.offset + 256, slot.length, slot.chunk_bytes)
        tx.enqueue(3, 0, 0, 8, bad, last=True, wait=False)
        # A call that waits reads the verdict on its way (replies come in order); settle() then
        # returns it without a round trip of its own.
        assert tx.status().daemon_id
        assert tx.stub.lane is not None and tx.stub.lane.deferred() == 0
        (refused,) = tx.settle()
        assert (refused.room, refused.chunk_id, refused.slot) == (3, 0, bad)
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and not refused.lost
        assert tx.settle() == [] and tx.flush() == []  # returned once
        tx.enqueue(3, 0, 0, 8, slot, last=True, wait=False)
        assert tx.flush() == []
        assert tx.poll(3).state is RoomState.BOOTSTRAPPING  # the slot was still ours: it went in


def test_reading_the_verdicts_already_here_never_waits_for_one(daemons: Any) -> None:
    """settle() (and acquire()/enqueue(), which read the same way) take what has arrived and
    return; a verdict still on its way stays outstanding on a connection that stays open."""
    d = daemons("defer-nowait")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20, call_timeout=5.0) as tx:
        slot = tx.acquire(8)
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            tx.enqueue(1, 0, 0, 8, slot, last=True, wait=False)
            t0 = time.monotonic()
            assert tx.settle() == []
            assert time.monotonic() - t0 < 1.0  # not the call timeout (5 s)
            assert tx.stub.lane is not None and tx.stub.lane.deferred() == 1
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert tx.flush() == []  # the same connection: the verdict comes in, an acceptance
        assert tx.poll(1).state is RoomState.BOOTSTRAPPING


def test_a_silent_daemon_does_not_hang_the_engine(daemons: Any) -> None:
    d = daemons("defer-silent")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        slot = tx.acquire(8)
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            tx.enqueue(1, 0, 0, 8, slot, last=True, wait=False)  # the request sits in the socket
            (lost,) = tx.flush(timeout=0.5)
            assert lost.code == grpc.StatusCode.DEADLINE_EXCEEDED and (lost.room, lost.chunk_id) == (1, 0)
            assert lost.lost  # no verdict: the daemon may have taken the chunk
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        # The connection that fell out of step is gone; the next calls open another.
        tx.enqueue(2, 0, 0, 8, tx.acquire(8), last=True)
        assert tx.poll(2).state is RoomState.BOOTSTRAPPING


# ------------------------------------------------------------------ the asyncio client


async def test_async_chunks_sent_without_waiting_land_byte_exact(daemons: Any) -> None:
    pre = daemons("adefer-pre")
    dec = daemons("adefer-dec")
    chunks, tokens = 24, 32
    data = [random.Random(100 + i).randbytes(TOKEN_BYTES * tokens) for i in range(chunks)]
    tx = await AsyncPrefillSender.create(socket=pre.socket, group="adw-pre", layout=LAYOUT, ring_bytes=4 << 20)
    rx = await AsyncDecodeReceiver.create(socket=dec.socket, group="adw-dec", layout=LAYOUT, ring_bytes=4 << 20)
    try:
        await rx.expect(1, pre.peer_address, "adw-pre", chunks * tokens)
        for cid in range(chunks):
            slot = await tx.acquire(tokens)
            tx.slot_view(slot)[:] = data[cid]
            await tx.enqueue(1, cid, cid * tokens, tokens, slot, last=cid == chunks - 1, wait=False)
        assert await tx.flush() == []
        assert isinstance(tx.stub.lane, AioLane) and tx.stub.lane.deferred() == 0
        got, final = await rx.receive(1, timeout=30)
        assert final.state is RoomState.SUCCESS
        assert [got[c] for c in range(chunks)] == data
        assert (await tx.wait(1, timeout=10)).state is RoomState.SUCCESS
        # One EnqueueChunk per chunk and nothing else: the slots are cut in the client (claimed)
        # and the ring never filled.
        assert tx.claims is not None
        assert metric(pre, RPCS, 'method="EnqueueChunk"') == chunks
        assert metric(pre, RPCS, 'method="AcquireSlot"') == 0
        assert [e.slots_held for e in status(pre.socket).engines] == [0]
    finally:
        await rx.close()
        await tx.close()
    assert status(pre.socket).engines == []


async def test_async_refusals_reach_the_engine_and_change_nothing(daemons: Any) -> None:
    d = daemons("adefer-refused")
    tx = await AsyncPrefillSender.create(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20)
    try:
        assert await tx.settle() == [] and await tx.flush() == []  # nothing sent: at once
        slot = await tx.acquire(8)
        bad = Slot(slot.offset + 256, slot.length, slot.chunk_bytes)
        await tx.enqueue(1, 0, 0, 8, bad, last=True, wait=False)
        (refused,) = await tx.flush()
        assert isinstance(refused, ChunkRefused)
        assert (refused.room, refused.chunk_id, refused.slot) == (1, 0, bad)
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "room 1 chunk 0" in str(refused)
        assert not refused.lost  # the daemon's verdict: the slot is still ours
        assert await tx.flush() == []  # returned once
        assert status(d.socket).rooms_by_state.get("BOOTSTRAPPING", 0) == 0
        await tx.enqueue(1, 0, 0, 8, slot, last=True, wait=False)
        assert await tx.flush() == []
        assert (await tx.poll(1)).state is RoomState.BOOTSTRAPPING

        # Not flushed: a call that waits lets the reader take the verdict in; settle() returns it.
        await tx.enqueue(2, 0, 0, 8, bad, last=True, wait=False)
        await tx.poll(1)
        (refused,) = await tx.settle()
        assert (refused.room, refused.chunk_id) == (2, 0) and refused.code == grpc.StatusCode.INVALID_ARGUMENT
        # Nor settled: the next acquire() raises it before doing anything.
        held = status(d.socket).engines[0].slots_held
        await tx.enqueue(3, 0, 0, 8, bad, last=True, wait=False)
        await tx.poll(1)
        with pytest.raises(ChunkRefused) as info:
            await tx.acquire(8)
        assert (info.value.room, info.value.chunk_id) == (3, 0)
        assert status(d.socket).engines[0].slots_held == held
        assert await tx.flush() == []
    finally:
        await tx.close()


async def test_async_silent_daemon_does_not_hang_the_engine(daemons: Any) -> None:
    d = daemons("adefer-silent")
    tx = await AsyncPrefillSender.create(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20)
    try:
        slot = await tx.acquire(8)
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            await tx.enqueue(1, 0, 0, 8, slot, last=True, wait=False)  # the request sits in the socket
            (lost,) = await tx.flush(timeout=0.5)
            assert lost.code == grpc.StatusCode.DEADLINE_EXCEEDED and (lost.room, lost.chunk_id) == (1, 0)
            assert lost.lost  # no verdict: the daemon may have taken the chunk
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        # The late verdict finds no call waiting for it; the connection goes on.
        await tx.enqueue(2, 0, 0, 8, await tx.acquire(8), last=True)
        assert (await tx.poll(2)).state is RoomState.BOOTSTRAPPING
        assert await tx.flush() == []
    finally:
        await tx.close()
