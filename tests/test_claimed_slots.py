"""Claimed slots: a prefill engine cuts its slots out of its own ring with no call, and the daemon
says which it let go of in the replies it sends anyway. Against real daemons moving real bytes:
chunks land byte-exact through a ring they wrap many times; the daemon refuses a claim that
overlaps a slot it holds (or lies outside the ring) and changes nothing; a report of freed slots
that never reached the engine is repaired by the next wait; a refused chunk's slot goes back with
no call. ClaimRing and RingAllocator.claim are also checked on their own."""

from __future__ import annotations

import random
from typing import Any

import grpc
import pytest

from kvxfer_client import ChunkRefused, DecodeReceiver, KvxferError, Layout, PrefillSender, RoomState, Slot
from kvxfer_client._claims import HELD, LOCAL, LOST, SENT, ClaimRing
from kvxfer_client.errors import NotSent, ReplyLost
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2
from kvxferd.buffers.host_pool import RingAllocator
from tests.faults.harness import metric
from tests.test_e2e import status

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=64, dtype_bytes=2, page_size=16, dtype="bfloat16")
TOKEN_BYTES = LAYOUT.num_layers * 2 * LAYOUT.total_kv_heads * LAYOUT.head_dim * LAYOUT.dtype_bytes
RPCS = "kvxferd_rpc_duration_seconds_count"


def _send_room(tx: PrefillSender, room: int, data: list[bytes], tokens: int) -> None:
    for cid, blob in enumerate(data):
        slot = tx.acquire(tokens, timeout=30)
        assert slot.claim > 0
        tx.slot_view(slot)[:] = blob
        tx.enqueue(room, cid, cid * tokens, tokens, slot, last=cid == len(data) - 1, wait=False)
    assert tx.flush() == []


@pytest.mark.parametrize("ring_kib", [256, 8192])
def test_claimed_chunks_land_byte_exact_and_the_ring_comes_back_whole(daemons: Any, ring_kib: int) -> None:
    pre = daemons(f"claim-{ring_kib}-p")
    dec = daemons(f"claim-{ring_kib}-d")
    chunks, tokens, rooms = 24, 32, 3  # 32 KiB chunks: 2.3 MiB through a 256 KiB ring wraps it ~9 times
    with PrefillSender(socket=pre.socket, group="cl-pre", layout=LAYOUT, ring_bytes=ring_kib << 10) as tx, \
            DecodeReceiver(socket=dec.socket, group="cl-dec", layout=LAYOUT, ring_bytes=4 << 20) as rx:
        assert tx.claims is not None and tx.reg.token_bytes == TOKEN_BYTES
        for room in range(1, rooms + 1):
            data = [random.Random(room * 100 + i).randbytes(TOKEN_BYTES * tokens) for i in range(chunks)]
            rx.expect(room, pre.peer_address, "cl-pre", chunks * tokens)
            _send_room(tx, room, data, tokens)
            got, final = rx.receive(room, timeout=30)
            assert final.state is RoomState.SUCCESS
            assert [got[c] for c in range(chunks)] == data
            assert tx.wait(room, timeout=10).state is RoomState.SUCCESS
        assert metric(pre, RPCS, 'method="EnqueueChunk"') == chunks * rooms
        assert metric(pre, RPCS, 'method="ReleaseSlot"') == 0
        waits = metric(pre, RPCS, 'method="AcquireSlot"')
        if ring_kib == 8192:
            assert waits == 0  # the ring never filled: not one call for a slot
        else:
            assert 0 < waits < chunks * rooms // 2  # only while the small ring is full
        # Every slot went back: the daemon holds none, and the engine can cut the whole ring again
        # (the last frees come with the wait that asks for it).
        assert status(pre.socket).slots_held == 0
        whole = tx.acquire((ring_kib << 10) // TOKEN_BYTES, timeout=5)
        assert (whole.offset, whole.length) == (0, ring_kib << 10)
        tx.release_slot(whole)
        assert tx.claims.free_bytes() == ring_kib << 10
        assert metric(pre, RPCS, 'method="ReleaseSlot"') == 0


def test_the_daemon_refuses_a_bad_claim_and_changes_nothing(daemons: Any) -> None:
    d = daemons("claim-bad")
    ring = 1 << 20
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=ring) as tx, \
            PrefillSender(socket=d.socket, group="g2", layout=LAYOUT, ring_bytes=ring, claim_slots=False) as old:
        assert old.claims is None and not old.reg.claim_slots
        held = tx.acquire(8)
        tx.slot_view(held)[:] = b"\x01" * held.chunk_bytes
        tx.enqueue(1, 0, 0, 8, held)  # room 1 waits for its decode side: the daemon holds the slot
        assert status(d.socket).slots_held == 1
        before = status(d.socket)

        def claim(slot: Slot, tag: int, engine: PrefillSender = tx, tokens: int = 8) -> KvxferError:
            req = engine_pb2.EnqueueChunkRequest(
                engine_id=engine.engine_id, room=common_pb2.RoomKey(id=2), chunk_id=0, token_start=0,
                num_tokens=tokens, slot=common_pb2.Slot(offset=slot.offset, length=slot.length), last=True, claim=tag)
            with pytest.raises(KvxferError) as err:
                engine._call(engine.stub.EnqueueChunk, req)
            return err.value

        overlap = claim(Slot(held.offset, held.length, held.chunk_bytes), 999)
        assert overlap.code == grpc.StatusCode.FAILED_PRECONDITION and "overlaps" in str(overlap)
        inside = claim(Slot(held.offset + 256, 1024, 1024), 998, tokens=1)
        assert inside.code == grpc.StatusCode.FAILED_PRECONDITION and "overlaps" in str(inside)
        past_end = claim(Slot(ring - 256, 8 * TOKEN_BYTES, 8 * TOKEN_BYTES), 997)
        assert past_end.code == grpc.StatusCode.INVALID_ARGUMENT and "ring" in str(past_end)
        unaligned = claim(Slot(ring // 2 + 8, 8 * TOKEN_BYTES, 8 * TOKEN_BYTES), 996)
        assert unaligned.code == grpc.StatusCode.INVALID_ARGUMENT and "aligned" in str(unaligned)
        short = claim(Slot(ring // 2, 4 * TOKEN_BYTES, 4 * TOKEN_BYTES), 995)
        assert short.code == grpc.StatusCode.INVALID_ARGUMENT and "needs" in str(short)
        not_allowed = claim(Slot(0, 8 * TOKEN_BYTES, 8 * TOKEN_BYTES), 994, engine=old)
        assert not_allowed.code == grpc.StatusCode.FAILED_PRECONDITION and "claim_slots" in str(not_allowed)
        after = status(d.socket)
        assert (after.slots_held, dict(after.rooms_by_state)) == (before.slots_held, dict(before.rooms_by_state))
        # The free space next to the held slot is still free: a good claim there goes in.
        nxt = tx.acquire(8)
        assert nxt.offset >= held.offset + held.length
        tx.enqueue(3, 0, 0, 8, nxt, last=True)
        assert status(d.socket).slots_held == 2


def test_freed_news_that_never_reached_the_engine_is_repaired_by_the_next_wait(daemons: Any) -> None:
    pre = daemons("claim-lost-p")
    dec = daemons("claim-lost-d")
    ring, tokens = 512 << 10, 64
    with PrefillSender(socket=pre.socket, group="lp", layout=LAYOUT, ring_bytes=ring) as tx, \
            DecodeReceiver(socket=dec.socket, group="ld", layout=LAYOUT, ring_bytes=4 << 20) as rx:
        data = [random.Random(i).randbytes(TOKEN_BYTES * tokens) for i in range(6)]
        rx.expect(1, pre.peer_address, "lp", 6 * tokens)
        for cid, blob in enumerate(data):
            slot = tx.acquire(tokens)
            tx.slot_view(slot)[:] = blob
            tx.enqueue(1, cid, cid * tokens, tokens, slot, last=cid == 5)  # waits: every claim is HELD
        got, final = rx.receive(1, timeout=30)
        assert final.state is RoomState.SUCCESS and [got[c] for c in range(6)] == data
        assert tx.wait(1, timeout=10).state is RoomState.SUCCESS
        assert status(pre.socket).slots_held == 0
        # Take the daemon's news away from the engine, as a reply lost with its connection would.
        news = tx._call(tx.stub.AcquireSlot, engine_pb2.AcquireSlotRequest(
            engine_id=tx.engine_id, claims=True, wait_ms=1000))
        assert len(news.freed_claims) >= 1
        assert tx.claims is not None and tx.claims.states()[HELD] >= 1
        # The engine still believes some slots held; asking for the whole ring sends that belief,
        # and the daemon answers that it holds none of them.
        whole = tx.acquire(ring // TOKEN_BYTES, timeout=5)
        assert (whole.offset, whole.length) == (0, ring)
        assert tx.claims.states() == {LOCAL: 1, SENT: 0, HELD: 0, LOST: 0}


def test_a_refused_claimed_chunk_keeps_its_slot_and_goes_back_with_no_call(daemons: Any) -> None:
    d = daemons("claim-refused")
    ring = 1 << 20
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=ring) as tx:
        slot = tx.acquire(8)
        tx.enqueue(1, 0, 0, 8, slot, last=False, aux=b"x", wait=False)  # aux only with the last chunk
        (refused,) = tx.flush()
        assert isinstance(refused, ChunkRefused) and refused.slot == slot
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
        assert tx.claims is not None and tx.claims.states()[LOCAL] == 1
        # Still the engine's: it may go in after all...
        tx.enqueue(1, 0, 0, 8, slot, last=True)
        assert status(d.socket).slots_held == 1
        with pytest.raises(KvxferError) as err:
            tx.release_slot(slot)  # ...and once taken, it is not the engine's to give back
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        # A refused synchronous enqueue leaves the slot the engine's too; it goes back with no call.
        other = tx.acquire(8)
        with pytest.raises(KvxferError):
            tx.enqueue(2, 0, 0, 8, other, last=False, aux=b"x")
        tx.release_slot(other)
        assert metric(d, RPCS, 'method="ReleaseSlot"') == 0
        assert metric(d, RPCS, 'method="AcquireSlot"') == 0
        assert tx.claims.free_bytes() == ring - slot.length


# ---------------------------------------------------------------------------- the parts alone


def test_claim_ring_cuts_frees_and_coalesces() -> None:
    r = ClaimRing(4096, 256, 100)
    a, b, c = r.cut(3), r.cut(3), r.cut(3)  # 300 B -> 512 B slots
    assert a and b and c and [s.offset for s in (a, b, c)] == [0, 512, 1024]
    assert len({a.claim, b.claim, c.claim}) == 3 and a.chunk_bytes == 300
    for s in (a, b, c):
        r.sent(s.claim)
    r.verdict(a.claim, True)
    r.verdict(b.claim, True, freed=[a.claim])  # another reply's news may come first
    r.failed(c.claim, KvxferError(grpc.StatusCode.INVALID_ARGUMENT, "refused"))
    assert r.believed() == [b.claim]
    assert r.states() == {LOCAL: 1, SENT: 0, HELD: 1, LOST: 0}
    r.release(c.claim)
    assert r.cut(2).offset == 0  # type: ignore[union-attr]  # a's space, coalesced with c's after b
    r.freed([b.claim, b.claim, 12345])  # twice, and a tag never cut: harmless
    assert r.free_bytes() == 4096 - 256
    with pytest.raises(KvxferError):
        r.cut(41)  # larger than the ring
    assert r.cut(39) is None  # 3900 B: does not fit beside the 256 B held at 0


def test_claim_ring_keeps_a_lost_claim_out_until_the_daemon_lets_it_go() -> None:
    r = ClaimRing(1024, 256, 256)
    a, b = r.cut(1), r.cut(1)
    assert a and b
    r.sent(a.claim)
    r.sent(b.claim)
    r.failed(a.claim, ReplyLost(grpc.StatusCode.UNAVAILABLE, "gone"))
    r.failed(b.claim, NotSent(grpc.StatusCode.UNAVAILABLE, "never left"))
    r.release(a.claim)  # a no-op: the daemon may have it
    r.release(b.claim)
    assert r.states() == {LOCAL: 0, SENT: 0, HELD: 0, LOST: 1}
    assert r.believed() == []  # never offered as "believed held": only the daemon's word frees it
    assert r.free_bytes() == 768
    # It may be sent again; refused (the first went in after all: an overlap), it is LOST again.
    r.sent(a.claim)
    r.failed(a.claim, KvxferError(grpc.StatusCode.FAILED_PRECONDITION, "overlaps a slot the daemon holds"))
    assert r.states()[LOST] == 1
    # A batch sends only the claims that are the engine's to send, and says why not for the others.
    c = r.cut(1)
    assert c is not None
    errs = r.sent_many([c.claim, 0, c.claim, 777])
    assert errs[0] is None and errs[1] is None
    assert [e.code for e in errs[2:] if e is not None] == [grpc.StatusCode.INVALID_ARGUMENT] * 2
    r.settle_many([c.claim], [None])
    assert r.believed() == [c.claim]
    r.freed([c.claim])
    r.freed([a.claim])
    assert r.free_bytes() == 1024
    with pytest.raises(KvxferError):
        r.sent(a.claim)  # gone: not the engine's to enqueue


def test_ring_allocator_claim_takes_only_free_aligned_ranges() -> None:
    r = RingAllocator(4096, 256)
    assert r.claim(1024, 300)  # 512 B
    assert r.holds(1024, 300) and r.used_bytes == 512
    assert not r.claim(1024 + 256, 256)  # inside the held slot
    assert not r.claim(768, 512)  # overlaps its start
    assert not r.claim(100, 256)  # unaligned
    assert not r.claim(3840, 512)  # past the end
    assert r.is_free(0, 1024) and not r.is_free(0, 1025)
    assert r.claim(0, 1024) and r.claim(1536, 2560)
    assert r.alloc(1) is None and r.used_bytes == 4096
    r.free(1024)
    assert r.alloc(512) == 1024
