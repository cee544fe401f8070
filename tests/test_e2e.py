"""Two daemons as separate processes (each its own NIXL agent) and engine processes that use
only kvxfer_client: rooms of random chunking, same and mixed TP, every byte checked."""

from __future__ import annotations

import multiprocessing as mp
import random
from typing import Any

import grpc
import pytest

from kvxfer_client import Layout
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2, engine_pb2_grpc
from tests.engine_procs import RoomPlan, decode_main, prefill_main
from tests.faults.harness import metric

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=64, dtype_bytes=2, page_size=16, dtype="bfloat16")


def status(socket: str) -> engine_pb2.DaemonStatus:
    with grpc.insecure_channel(f"unix:{socket}") as ch:
        return engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=5)


def make_rooms(rng: random.Random, first: int, n: int) -> list[RoomPlan]:
    return [
        RoomPlan(first + i, tuple(rng.randint(1, 96) for _ in range(rng.randint(1, 16)))) for i in range(n)
    ]


def run_groups(
    prefill_sock: str, decode_sock: str, prefill_addr: str, groups: list[tuple[str, int, int, list[RoomPlan]]],
    in_flight: int = 8, timeout: float = 150.0, no_wait: frozenset[str] = frozenset(),
) -> dict[tuple[str, str, int], Any]:
    """no_wait: the groups whose prefill engines enqueue without waiting for each verdict."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for name, ptp, dtp, rooms in groups:
        for r in range(dtp):
            procs.append(ctx.Process(target=decode_main, args=(
                decode_sock, f"{name}-dec", LAYOUT, dtp, r, 16 << 20, rooms, prefill_addr, f"{name}-pre", q, timeout,
            )))
        for r in range(ptp):
            procs.append(ctx.Process(target=prefill_main, args=(
                prefill_sock, f"{name}-pre", LAYOUT, ptp, r, 8 << 20, rooms, q, in_flight, timeout, name not in no_wait,
            )))
    for p in procs:
        p.start()
    results: dict[tuple[str, str, int], Any] = {}
    try:
        for _ in procs:
            role, group, rank, payload, err = q.get(timeout=timeout + 30)
            assert err is None, f"{role} {group} rank {rank} failed:\n{err}"
            results[(role, group, rank)] = payload
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return results


def test_two_hundred_rooms_same_and_mixed_tp(daemons: Any) -> None:
    pre = daemons("prefill")
    dec = daemons("decode")
    rng = random.Random(1234)
    groups = [
        ("tp11", 1, 1, make_rooms(rng, 1000, 140)),
        ("tp21", 2, 1, make_rooms(rng, 2000, 30)),
        ("tp12", 1, 2, make_rooms(rng, 3000, 30)),
    ]
    # TP 1->1 hands its chunks over without waiting (random chunk sizes: spares of the wrong size
    # are given back), the others wait for each verdict.
    results = run_groups(pre.socket, dec.socket, pre.peer_address, groups, no_wait=frozenset({"tp11"}))
    total_rooms = 0
    checked = 0
    for name, ptp, dtp, rooms in groups:
        ids = {p.room for p in rooms}
        for r in range(dtp):
            got = results[("decode", f"{name}-dec", r)]
            assert set(got["states"]) == ids
            assert all(s == "SUCCESS" for s in got["states"].values()), {
                k: v for k, v in got["states"].items() if v != "SUCCESS"}
            checked += got["checked_bytes"]
        for r in range(ptp):
            states = results[("prefill", f"{name}-pre", r)]
            assert set(states) == ids and all(s == "SUCCESS" for s in states.values()), states
        total_rooms += len(rooms)
    assert total_rooms >= 200
    assert checked > 0
    for d in (pre, dec):
        st = status(d.socket)
        assert st.slots_held == 0, f"{d.name} still holds {st.slots_held} slots"
        assert st.rooms_by_state.get("FAILED", 0) == 0
        # The path each peer's chunks took (issue #38): the other daemon over NIXL, no GPU copies here.
        other = "decode" if d is pre else "prefill"
        assert [(p.daemon_id, p.path) for p in st.peers if p.daemon_id != d.name] == [(other, "nixl")], st.peers
        assert list(st.gpu_links) == []


@pytest.mark.parametrize("ptp,dtp", [(4, 2), (2, 4), (1, 4)])
def test_mixed_tp_pairs(daemons: Any, ptp: int, dtp: int) -> None:
    pre = daemons("prefill")
    dec = daemons("decode")
    rng = random.Random(ptp * 10 + dtp)
    rooms = make_rooms(rng, 5000, 6)
    results = run_groups(pre.socket, dec.socket, pre.peer_address, [("mx", ptp, dtp, rooms)],
                         no_wait=frozenset({"mx"}) if ptp > dtp else frozenset())
    for r in range(dtp):
        assert all(s == "SUCCESS" for s in results[("decode", "mx-dec", r)]["states"].values())
    assert status(pre.socket).slots_held == 0
    assert status(dec.socket).slots_held == 0
    # One WRITE per chunk and sending writer, however many readers its heads go to (TP 1->4: four
    # parts, one WRITE): with 2 KV heads, min(ptp, 2) writers hold distinct heads, the rest are
    # replicas that send nothing.
    chunks = sum(len(p.chunks) for p in rooms)
    writes = metric(pre, "kvxferd_chunk_transfer_seconds_count")
    assert writes == chunks * min(ptp, LAYOUT.total_kv_heads), (writes, chunks)


RPCS = "kvxferd_rpc_duration_seconds_count"  # one sample per (service, method, code)


def test_a_sender_makes_one_call_per_chunk_and_gives_the_spare_slot_back(daemons: Any) -> None:
    from kvxfer_client import DecodeReceiver, PrefillSender, RoomState

    pre = daemons("prefill")
    dec = daemons("decode")
    chunks, tokens = 8, 32
    token_bytes = LAYOUT.num_layers * 2 * LAYOUT.total_kv_heads * LAYOUT.head_dim * LAYOUT.dtype_bytes
    data = [random.Random(i).randbytes(token_bytes * tokens) for i in range(chunks)]
    with PrefillSender(socket=pre.socket, group="spare-pre", layout=LAYOUT, ring_bytes=4 << 20,
                       claim_slots=False) as tx, \
            DecodeReceiver(socket=dec.socket, group="spare-dec", layout=LAYOUT, ring_bytes=4 << 20) as rx:
        rx.expect(1, pre.peer_address, "spare-pre", chunks * tokens)
        acquires = metric(pre, RPCS, 'method="AcquireSlot"')
        for cid in range(chunks):
            tx.send_chunk(1, cid, cid * tokens, tokens, data[cid], last=cid == chunks - 1)
        got, final = rx.receive(1, timeout=30)
        assert final.state is RoomState.SUCCESS
        assert [got[c] for c in range(chunks)] == data
        # One AcquireSlot for the first chunk; every later slot came with the previous EnqueueChunk.
        assert metric(pre, RPCS, 'method="AcquireSlot"') - acquires == 1
        assert metric(pre, RPCS, 'method="EnqueueChunk"') >= chunks
        tx.wait(1, timeout=10)
        st = status(pre.socket)
        # The spare is the engine's: counted on the engine, not as a slot held for a transfer.
        assert st.slots_held == 0 and [e.slots_held for e in st.engines] == [1]
        # The ring gauge is read at scrape time: it shows the spare slot, and nothing once it is back.
        used = f'ring="{tx.engine_id}"'
        assert metric(pre, "kvxferd_ring_used_bytes", used) == st.engines[0].ring_used_bytes > 0
        # A chunk of another size gives the spare back and acquires afresh.
        tx.release_slot(tx.acquire(tokens * 2))
        assert [e.slots_held for e in status(pre.socket).engines] == [0]
        tx.spare.enabled = False
        tx.release_slot(tx.acquire(tokens))
        assert [e.slots_held for e in status(pre.socket).engines] == [0]
        assert metric(pre, "kvxferd_ring_used_bytes", used) == 0


def test_a_sending_engine_hears_each_chunk_only_when_it_asks(daemons: Any) -> None:
    """A prefill engine's plain watch gets state changes once each, not an event per chunk; a
    watch with chunk_progress gets one per chunk written, counting up. cancel() ends a watch from
    another thread."""
    import threading
    import time

    from kvxfer_client import DecodeReceiver, PrefillSender, RoomState

    pre = daemons("prefill")
    dec = daemons("decode")
    chunks, tokens = 6, 16
    token_bytes = LAYOUT.num_layers * 2 * LAYOUT.total_kv_heads * LAYOUT.head_dim * LAYOUT.dtype_bytes
    with PrefillSender(socket=pre.socket, group="prog-pre", layout=LAYOUT, ring_bytes=4 << 20) as tx, \
            DecodeReceiver(socket=dec.socket, group="prog-dec", layout=LAYOUT, ring_bytes=4 << 20) as rx:
        streams = {"plain": tx.watch(), "progress": tx.watch(chunk_progress=True)}
        seen: dict[str, list[Any]] = {k: [] for k in streams}

        def follow(name: str) -> None:
            for ev in streams[name]:
                seen[name].append(ev)

        threads = [threading.Thread(target=follow, args=(k,), daemon=True) for k in streams]
        for t in threads:
            t.start()
        time.sleep(0.5)  # both streams subscribed before the room starts
        rx.expect(1, pre.peer_address, "prog-pre", chunks * tokens)
        for cid in range(chunks):
            tx.send_chunk(1, cid, cid * tokens, tokens, random.randbytes(token_bytes * tokens),
                          last=cid == chunks - 1)
        _, final = rx.receive(1, timeout=30)
        assert final.state is RoomState.SUCCESS
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(
                any(e.state is RoomState.SUCCESS for e in seen[k]) for k in streams):
            time.sleep(0.02)
        for s in streams.values():
            s.cancel()
        for t in threads:
            t.join(5)
            assert not t.is_alive(), "cancel() did not end the watch"
    plain = [e for e in seen["plain"] if e.room == 1]
    progress = [e for e in seen["progress"] if e.room == 1]
    assert plain[-1].state is RoomState.SUCCESS and plain[-1].chunks_done == chunks, plain
    # The room turning TRANSFERRING and the first chunk written; no event per later chunk.
    assert sum(e.state is RoomState.TRANSFERRING for e in plain) <= 2, plain
    done = [e.chunks_done for e in progress if e.state is RoomState.TRANSFERRING]
    assert done == sorted(done) and set(range(1, chunks + 1)) <= set(done), progress
