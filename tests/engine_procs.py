"""Engine processes for end-to-end tests: they use only kvxfer_client.

Chunk bytes are a pure function of (room, chunk, global head), so every replica
of a GQA head writes identical bytes and a reader can compute exactly what each
of its heads must contain, whatever the prefill/decode TP pair.
"""

from __future__ import annotations

import hashlib
import time
import traceback
from typing import Any

import numpy as np

from kvxfer_client import DecodeReceiver, Layout, PrefillSender, RoomState
from kvxfer_protocol.slot_layout import KVLayout, bytes_per_head, rank_heads
from kvxferd.bench.loopback_spec import RoomPlan


def klayout(layout: Layout) -> KVLayout:
    return KVLayout(layout.num_layers, layout.total_kv_heads, layout.head_dim, layout.dtype_bytes,
                    layout.page_size, layout.mla)


def head_block(room: int, chunk: int, head: int, nbytes: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(b"%d/%d/%d" % (room, chunk, head), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def part_bytes_for(layout: Layout, tp: int, rank: int, room: int, chunk: int, tokens: int) -> np.ndarray:
    kl = klayout(layout)
    rh = rank_heads(kl.total_kv_heads, tp, rank, kl.mla)
    bph = bytes_per_head(kl, tokens)
    return np.concatenate([head_block(room, chunk, rh.start + h, bph) for h in range(rh.count)])


def prefill_main(
    socket: str, group: str, layout: Layout, tp: int, rank: int, ring_bytes: int, rooms: list[RoomPlan],
    result: Any, in_flight: int = 8, timeout: float = 120.0, wait: bool = True,
) -> None:
    """Sends every chunk of every room; keeps `in_flight` rooms unfinished at once. wait=False:
    without waiting for each chunk's verdict (PrefillSender.enqueue), all checked at the end."""
    try:
        with PrefillSender(socket=socket, group=group, layout=layout, tp_size=tp, tp_rank=rank,
                           ring_bytes=ring_bytes, name=f"{group}-p{rank}") as tx:
            pending: list[int] = []
            states: dict[int, str] = {}
            deadline = time.monotonic() + timeout

            def settle(limit: int) -> None:
                while len(pending) > limit:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"prefill rank {rank}: rooms unfinished: {pending[:5]}")
                    for r in list(pending):
                        st = tx.poll(r)
                        if st.finished:
                            states[r] = st.state.name if st.state is RoomState.SUCCESS else (
                                f"FAILED {st.failure_code}: {st.failure_reason}")
                            tx.release(r)
                            pending.remove(r)
                    time.sleep(0.002)

            for plan in rooms:
                start = 0
                for cid, ntok in enumerate(plan.chunks):
                    data = part_bytes_for(layout, tp, rank, plan.room, cid, ntok)
                    last = cid == len(plan.chunks) - 1
                    aux = b"aux-%d" % plan.room if last else b""
                    tx.send_chunk(plan.room, cid, start, ntok, data.data, last=last, aux=aux, timeout=timeout,
                                  wait=wait)
                    start += ntok
                pending.append(plan.room)
                settle(in_flight)
            settle(0)
            refused = tx.flush()
            if refused:
                raise RuntimeError(f"prefill rank {rank}: chunks refused: {refused}")
            result.put(("prefill", group, rank, states, None))
    except Exception:
        result.put(("prefill", group, rank, {}, traceback.format_exc()))


def decode_main(
    socket: str, group: str, layout: Layout, tp: int, rank: int, ring_bytes: int, rooms: list[RoomPlan],
    prefill_address: str, prefill_group: str, result: Any, timeout: float = 120.0, expect_ahead: int = 1 << 30,
) -> None:
    """Expects rooms, verifies every landed byte against the pattern, watermarks, releases."""
    try:
        with DecodeReceiver(socket=socket, group=group, layout=layout, tp_size=tp, tp_rank=rank,
                            ring_bytes=ring_bytes, name=f"{group}-d{rank}") as rx:
            by_id = {p.room: p for p in rooms}
            todo = list(rooms)
            active: dict[int, set[int]] = {}
            states: dict[int, str] = {}
            checked_bytes = 0
            deadline = time.monotonic() + timeout
            while todo or active:
                while todo and len(active) < expect_ahead:
                    p = todo.pop(0)
                    rx.expect(p.room, prefill_address, prefill_group, p.num_tokens)
                    active[p.room] = set()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"decode rank {rank}: rooms unfinished: {list(active)[:5]}")
                progressed = False
                for r in list(active):
                    st = rx.poll(r)
                    plan = by_id[r]
                    starts = np.cumsum((0, *plan.chunks))
                    for c in st.landed:
                        if c.chunk_id in active[r]:
                            continue
                        want = part_bytes_for(layout, tp, rank, r, c.chunk_id, plan.chunks[c.chunk_id])
                        got = np.frombuffer(rx.read(c), dtype=np.uint8)
                        if c.token_start != starts[c.chunk_id] or c.num_tokens != plan.chunks[c.chunk_id]:
                            raise AssertionError(f"room {r} chunk {c.chunk_id}: wrong token range {c}")
                        if got.shape != want.shape or not np.array_equal(got, want):
                            bad = int(np.argmax(got != want)) if got.shape == want.shape else -1
                            raise AssertionError(f"room {r} chunk {c.chunk_id} rank {rank}: bytes differ at {bad}")
                        checked_bytes += want.nbytes
                        active[r].add(c.chunk_id)
                        rx.watermark(r, [c.chunk_id])
                        progressed = True
                    if st.finished and not any(c.chunk_id not in active[r] for c in st.landed):
                        if st.state is RoomState.SUCCESS:
                            if len(active[r]) != len(plan.chunks):
                                raise AssertionError(f"room {r}: SUCCESS with {len(active[r])}/{len(plan.chunks)} chunks")
                            if st.aux != b"aux-%d" % r:
                                raise AssertionError(f"room {r}: aux {st.aux!r}")
                            states[r] = "SUCCESS"
                        else:
                            states[r] = f"FAILED {st.failure_code}: {st.failure_reason}"
                        rx.release(r)
                        del active[r]
                        progressed = True
                if not progressed:
                    time.sleep(0.002)
            result.put(("decode", group, rank, {"states": states, "checked_bytes": checked_bytes}, None))
    except Exception:
        result.put(("decode", group, rank, {}, traceback.format_exc()))
