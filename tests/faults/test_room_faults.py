"""Faults inside rooms and engines, on one pair of subprocess daemons (real NIXL between them):
an abort mid-room, an injected NIXL error, a chunk outside the ring, a slow and a stalled decode
consumer, and kill -9 of a prefill and of a decode engine. Each test checks that the affected rooms
end FAILED on both sides with a reason, every other room succeeds with every byte checked, no slot
stays held and both daemons keep serving; time-to-FAILED goes to record_timing.
"""

from __future__ import annotations

import time

import grpc
import pytest

from kvxfer_client import DecodeReceiver, PrefillSender, RoomState
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.conftest import DaemonProc
from tests.faults.harness import (
    HEARTBEAT_S,
    LAYOUT,
    TOKEN_BYTES,
    Fleet,
    Job,
    assert_alive,
    failures_in_log,
    fault_command,
    inject_transfer_errors,
    jobs,
    log_lines,
    metric,
    plans,
    record_timing,
    status,
    wait_no_slots,
    wait_until,
)

Pair = tuple[DaemonProc, DaemonProc]
# A failure on one side reaches the other within this (the bound: 2 heartbeat intervals).
BOTH_SIDES_S = 2 * HEARTBEAT_S


def assert_success(fleet: Fleet, p: Job, d: Job, rooms: set[int]) -> None:
    """These rooms succeeded on both sides and the decode engine checked all of their bytes."""
    got_d = fleet.rooms(d.who)
    got_p = fleet.rooms(p.who)
    plan = {r.room: r for r in d.rooms}
    for r in rooms:
        assert got_d[r]["state"] == "SUCCESS", (r, got_d[r])
        assert got_p[r]["state"] == "SUCCESS", (r, got_p[r])
        assert got_d[r]["bytes"] == plan[r].num_tokens * TOKEN_BYTES // d.tp, (r, got_d[r])


def failed_both(fleet: Fleet, p: Job, d: Job, room: int, code: str) -> tuple[float, float]:
    """The room is FAILED with `code` and a reason on both sides; returns (prefill t, decode t)."""
    rp, rd = fleet.rooms(p.who)[room], fleet.rooms(d.who)[room]
    for side in (rp, rd):
        assert side["state"] == "FAILED" and side["code"] == code and side["reason"], side
    return rp["t"], rd["t"]


def test_abort_mid_room_fails_both_sides_and_frees_slots(pair: Pair, fleet: Fleet) -> None:
    pre, dec = pair
    rooms = plans(100, 6, [32] * 8)
    victim = 102
    # 0.3 s between chunks: in one loaded CI rehearsal the prefill side ended SUCCESS (at 0.1 s, the decode
    # engine likely saw its second chunk only after the
    # prefill engine had sent all eight, so the room was whole before the abort).
    p, d = jobs(pre, dec, "abort", rooms, in_flight=3, chunk_delay_s=0.3, abort_after=((victim, 2),))
    fleet.start(d)  # expecting before the prefill side sends, so chunks flow as they are sent
    fleet.start(p)
    fleet.finish()
    (ab,) = fleet.of_kind("aborted", d.who)
    tp, _ = failed_both(fleet, p, d, victim, "ABORTED")
    assert "aborted by engine" in fleet.rooms(p.who)[victim]["reason"]
    # Mid-room: the prefill engine had not handed over every chunk when the room ended.
    assert len([e for e in fleet.of_kind("sent", p.who) if e["room"] == victim]) < 8
    assert_success(fleet, p, d, {r.room for r in rooms} - {victim})
    assert tp - ab["t"] < BOTH_SIDES_S, tp - ab["t"]
    record_timing("abort mid-room (decode engine aborts)", "prefill side FAILED after AbortRoom", [tp - ab["t"]])
    wait_no_slots(pre, dec)
    assert_alive(pre, dec)


def test_injected_nixl_error_fails_one_room_only(pair: Pair, fleet: Fleet) -> None:
    pre, dec = pair
    rooms = plans(200, 14, [16] * 4)
    p, d = jobs(pre, dec, "nixl", rooms, in_flight=2, chunk_delay_s=0.02)
    fleet.start(d)
    fleet.start(p)
    fleet.wait_for(lambda: sum(1 for e in fleet.rooms(d.who).values() if e["state"] == "SUCCESS") >= 3, 60,
                   "three rooms to succeed before the fault")
    t_inject = time.time()
    inject_transfer_errors(pre, 1)
    fleet.finish()
    failed = {r: e for r, e in fleet.rooms(p.who).items() if e["state"] != "SUCCESS"}
    assert len(failed) == 1, failed
    (victim,) = failed
    tp, td = failed_both(fleet, p, d, victim, "TRANSFER_ERROR")
    assert "NIXL" in fleet.rooms(p.who)[victim]["reason"] or "ERR" in fleet.rooms(p.who)[victim]["reason"]
    assert_success(fleet, p, d, {r.room for r in rooms} - {victim})
    assert abs(td - tp) < BOTH_SIDES_S, (tp, td)
    assert tp - t_inject < 2.0, "the injected error must hit one of the next posts"
    record_timing("injected NIXL error (FaultInjector.fail_next(1))", "prefill side FAILED after the hook was armed",
                  [tp - t_inject], "includes waiting for the next post (control file polled every 50 ms)")
    record_timing("injected NIXL error (FaultInjector.fail_next(1))", "decode side FAILED after the prefill side",
                  [max(0.0, td - tp)])
    wait_no_slots(pre, dec)
    assert_alive(pre, dec)


def test_peer_memory_changes_while_rooms_are_in_flight(pair: Pair, fleet: Fleet) -> None:
    """The decode daemon registers and releases memory mid-run (as importing and releasing an
    engine's GPU ring does, at reused addresses too): each time, the prefill daemon replaces the
    decode daemon's NIXL entry while WRITEs of other rooms are flowing, and no room notices."""
    pre, dec = pair
    rooms = plans(300, 40, [16] * 4)
    p, d = jobs(pre, dec, "remd", rooms, in_flight=3, chunk_delay_s=0.03)
    before = metric(pre, "kvxferd_peer_metadata_reloads_total")
    fleet.start(d)
    fleet.start(p)
    done = lambda n: lambda: sum(1 for e in fleet.rooms(d.who).values() if e["state"] == "SUCCESS") >= n  # noqa: E731
    cycles = ["register 1048576", "release", "register 2097152", "register 65536", "release", "release",
              "register 1048576", "release"]
    for i, command in enumerate(cycles):
        fleet.wait_for(done(2 + 4 * i), 60, f"{2 + 4 * i} rooms to succeed")
        fault_command(dec, command)
    fleet.finish()
    assert_success(fleet, p, d, {r.room for r in rooms})
    # Every change reached the prefill daemon before a later room needed it (rooms keep starting).
    reloads = metric(pre, "kvxferd_peer_metadata_reloads_total") - before
    assert reloads >= 3, (reloads, log_lines(pre, "metadata"))
    assert not log_lines(pre, "loading its new NIXL metadata failed")
    wait_no_slots(pre, dec)
    assert_alive(pre, dec)


def test_chunk_outside_ring_is_rejected_and_nothing_written(pair: Pair) -> None:
    pre, dec = pair
    ring = 256 << 10
    with PrefillSender(socket=pre.socket, group="oob-pre", layout=LAYOUT, ring_bytes=ring,
                       claim_slots=False) as tx, \
            DecodeReceiver(socket=dec.socket, group="oob-dec", layout=LAYOUT, ring_bytes=ring) as rx:
        guard = bytes([0xA5]) * ring
        rx.view(0, ring)[:] = guard
        rx.expect(7, pre.peer_address, "oob-pre", 32)
        wait_until(lambda: rx.poll(7).state is RoomState.WAITING_FOR_INPUT, 10, "room 7 to bootstrap")
        slot = tx.acquire(32)
        tx.slot_view(slot)[:] = bytes(slot.chunk_bytes)
        bad = {
            "just past the ring": (ring, slot.length),
            "far outside the ring": (ring + (1 << 20), slot.length),
            "at the top of u64": ((1 << 64) - 4096, 4096),
            "inside the ring, not a slot": (slot.offset + 256, 256),
            "longer than the acquired slot": (slot.offset, slot.length + 4096),
        }
        with grpc.insecure_channel(f"unix:{pre.socket}") as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            for what, (off, length) in bad.items():
                req = engine_pb2.EnqueueChunkRequest(
                    engine_id=tx.engine_id, room=common_pb2.RoomKey(id=7), chunk_id=0, token_start=0, num_tokens=32,
                    slot=common_pb2.Slot(offset=off, length=length), last=True,
                )
                with pytest.raises(grpc.RpcError) as ei:
                    stub.EnqueueChunk(req, timeout=5)
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, ei.value)
                # The batch RPC gives the same answer per chunk.
                (res,) = stub.EnqueueChunks(engine_pb2.EnqueueChunksRequest(chunks=[req]), timeout=5).results
                assert res.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], (what, res)
        time.sleep(0.3)  # anything wrongly accepted would have landed by now
        assert bytes(rx.view(0, ring)) == guard, "a rejected chunk wrote into the decode ring"
        st = rx.poll(7)
        assert st.state is RoomState.WAITING_FOR_INPUT and st.landed == ()
        # The prefill room exists (bootstrapped) but holds no chunk of this engine: a rank of its group
        # sees it all the same (issue #14), with nothing done.
        pst = tx.poll(7)
        assert pst.state is RoomState.WAITING_FOR_INPUT and pst.chunks_done == 0
        # Only the slot acquired above, which the engine holds, not a transfer.
        st = status(pre.socket)
        assert st.slots_held == 0 and [e.slots_held for e in st.engines] == [1]
        # The good slot still works: the room completes with the right bytes.
        tx.enqueue(7, 0, 0, 32, slot, last=True, aux=b"ok")
        chunks, final = rx.receive(7, timeout=20)
        assert final.aux == b"ok" and chunks[0] == bytes(slot.chunk_bytes)
        tx.wait(7, timeout=10)
        tx.release(7)
        rx.release(7)
    wait_no_slots(pre, dec)
    assert_alive(pre, dec)


def test_slow_consumer_makes_prefill_wait_without_stalling_other_rooms(pair: Pair, fleet: Fleet) -> None:
    pre, dec = pair
    chunk = 32  # tokens: 32 KiB per chunk; the slow reader's ring holds exactly two
    delay = 0.5
    slow = plans(300, 1, [chunk] * 8)
    fast = plans(310, 12, [16] * 4)
    ps, ds = jobs(pre, dec, "slow", slow, d_ring_bytes=2 * chunk * TOKEN_BYTES, d_consume_delay_s=delay)
    pf, df = jobs(pre, dec, "fast", fast, in_flight=2, p_wait_go=True)
    fleet.start(ds, df)  # readers first, so chunks flow as they are sent
    fleet.start(ps, pf)
    # The other reader's rooms start once the slow room is waiting for watermarks (ring full).
    fleet.wait_for(lambda: len(fleet.of_kind("landed", ds.who)) >= 2, 30, "the slow room to fill its reader's ring")
    fleet.go(pf)
    fleet.finish()
    assert_success(fleet, ps, ds, {300})
    assert_success(fleet, pf, df, {r.room for r in fast})
    t_slow_end = fleet.rooms(ds.who)[300]["t"]
    landed = sorted(e["t"] for e in fleet.of_kind("landed", ds.who))
    # Two slots: chunks land in pairs, each pair only after the previous pair was watermarked.
    assert landed[-1] - landed[1] >= 3 * delay * 0.9, landed
    # Every chunk was handed over at once (EnqueueChunk never waits); the daemon held them back.
    sent = sorted(e["t"] for e in fleet.of_kind("sent", ps.who))
    assert sent[-1] - sent[0] < 2 * delay, "the prefill engine itself was blocked"
    # The other reader's rooms went through while the slow room was waiting for watermarks.
    fast_ends = [e["t"] for e in fleet.rooms(df.who).values()]
    assert max(fast_ends) < t_slow_end, "a room of another reader waited behind the slow consumer"
    during = [t for t in fast_ends if landed[1] < t < landed[-1]]
    assert len(during) >= len(fast) // 2, (landed, sorted(fast_ends))
    wait_no_slots(pre, dec)
    assert_alive(pre, dec)


def test_stalled_consumer_fails_by_deadline_and_others_proceed(pair: Pair, fleet: Fleet) -> None:
    pre, dec = pair
    chunk = 32
    stalled = plans(400, 1, [chunk] * 6)
    others = plans(410, 10, [16] * 4)
    deadline_ms = 4000
    ps, ds = jobs(pre, dec, "stall", stalled, d_ring_bytes=2 * chunk * TOKEN_BYTES, d_stall=frozenset({400}),
                  d_deadline_ms=deadline_ms)
    po, do = jobs(pre, dec, "other", others, in_flight=2)
    # Prefill engines first: the 4 s deadline runs from ExpectRoom and must not be spent waiting
    # for a prefill process to start (seconds on a loaded machine).
    fleet.start(ps, po)
    fleet.start(ds, do)
    fleet.finish()
    assert_success(fleet, po, do, {r.room for r in others})
    tp, td = failed_both(fleet, ps, ds, 400, "DEADLINE")
    # Producers waited: all six chunks were handed over, only the two that fit landed.
    assert len(fleet.of_kind("sent", ps.who)) == 6
    assert len(fleet.of_kind("landed", ds.who)) == 2
    assert fleet.rooms(ds.who)[400]["chunks"] == 2
    other_end = max(e["t"] for e in fleet.rooms(do.who).values())
    assert other_end < min(tp, td), "other rooms waited behind the stalled one"
    assert abs(tp - td) < BOTH_SIDES_S, (tp, td)
    (exp,) = fleet.of_kind("expected", ds.who)
    due = exp["t"] + deadline_ms / 1000
    assert -0.1 < min(tp, td) - due < BOTH_SIDES_S, (tp - due, td - due)
    record_timing("stalled decode consumer (no watermark), 4 s room deadline",
                  "FAILED after the deadline passed (decode side, prefill side)", [td - due, tp - due],
                  "deadline counted from the ExpectRoom call as the decode engine saw it")
    wait_no_slots(pre, dec)
    assert_alive(pre, dec)


@pytest.mark.parametrize("victim_role", ["prefill", "decode"])
def test_kill9_engine_mid_room(pair: Pair, fleet: Fleet, victim_role: str) -> None:
    """A dead engine's lease lapses: its rooms fail on both sides, its ring is released, the
    rooms of other engines are untouched."""
    pre, dec = pair
    lease_ms = 2000  # 1 s lapsed for live engines starved of CPU on a loaded 2-core machine
    g = f"k{victim_role[0]}"
    rooms = plans(500 if victim_role == "prefill" else 600, 12, [16] * 8)
    # A room takes ~6 s to send, longer than the lease: it cannot finish before the lease lapses, nor
    # in the seconds a loaded CI worker may take between seeing it mid-transfer and the kill (at
    # ~3 s a room, every room in flight once finished first under two xdist workers).
    pv, dv = jobs(pre, dec, g, rooms, lease_ms=lease_ms, chunk_delay_s=0.8, p_in_flight=3, d_in_flight=6)
    others = plans(700 if victim_role == "prefill" else 800, 16, [16] * 4)
    po, do = jobs(pre, dec, f"{g}o", others, in_flight=2, chunk_delay_s=0.05)
    fleet.start(dv, do)
    fleet.start(pv, po)
    victim, survivor = (pv, dv) if victim_role == "prefill" else (dv, pv)
    vdaemon = pre if victim_role == "prefill" else dec
    fleet.wait_for(lambda: len(fleet.landed_rooms(dv.who) - set(fleet.rooms(dv.who))) >= 2, 30,
                   "two rooms to be mid-transfer")
    engine_id = fleet.ready[victim.who]["engine_id"]
    fleet.stop(pv, dv)  # no new rooms in this group: the survivor would wait for a partner that is gone
    t_kill = fleet.kill(victim.who)
    fleet.finish(survivor.who, do.who, po.who)
    # The survivor's unfinished rooms failed with ENGINE_LOST and a reason naming the dead rank.
    lost = {r: e for r, e in fleet.rooms(survivor.who).items() if e["state"] != "SUCCESS"}
    assert len(lost) >= 2, fleet.rooms(survivor.who)
    for e in lost.values():
        assert e["state"] == "FAILED" and e["code"] == "ENGINE_LOST", e
        assert f"{victim_role} rank 0" in e["reason"], e
    # The dead engine's side logged the same rooms FAILED, with the lease as the reason.
    dead_side = failures_in_log(vdaemon, victim_role)
    for r in lost:
        assert r in dead_side and dead_side[r][1] == "ENGINE_LOST" and "lease lapsed" in dead_side[r][2], (r, dead_side)
    assert_success(fleet, po, do, {r.room for r in others})
    # Its ring went back and the engine is gone from the daemon's view.
    wait_until(lambda: any(f"ring of engine {engine_id} released" in ln for ln in vdaemon.log_text().splitlines()),
               10, "the dead engine's ring to be released")
    assert engine_id not in {e.engine_id for e in status(vdaemon.socket).engines}
    local = [dead_side[r][0] - t_kill for r in lost]
    remote = [lost[r]["t"] - dead_side[r][0] for r in lost]
    assert max(local) < lease_ms / 1000 + 0.25 + BOTH_SIDES_S, local  # lease + sweep period (+ slack)
    assert max(remote) < BOTH_SIDES_S, remote
    record_timing(f"kill -9 of a {victim_role} engine mid-room (lease 2 s)", "its own daemon FAILED the rooms after the kill",
                  local, "lease 2 s + 0.25 s sweep; time from the daemon log (ms resolution)")
    record_timing(f"kill -9 of a {victim_role} engine mid-room (lease 2 s)", "the other side FAILED after its own daemon",
                  remote)
    wait_no_slots(pre, dec)
    assert_alive(pre, dec)
