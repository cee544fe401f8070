"""Engines start in any order: decode ranks may expect rooms before the prefill group registered.

Two in-process daemons and asyncio clients; a decode TP group expects its rooms first, the prefill
group registers only after a delay longer than the old 5 s grace, and every room still succeeds
with every byte as sent. A group that never registers fails the room at its deadline, with a
reason naming the group.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvxfer_client import AsyncDecodeReceiver, AsyncPrefillSender, Layout, RoomFailed
from kvxfer_protocol.slot_layout import KVLayout, part_bytes

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16, dtype="bfloat16")
KLAYOUT = KVLayout(2, 2, 16, 2, 16)
ROOMS = {7001: 40, 7002: 17, 7003: 64}
CHUNK = 24  # not a multiple of the page size: chunk boundaries fall mid-page


def _payload(room: int, rank: int, chunk: int, nbytes: int) -> bytes:
    seed = (room * 31 + rank * 7 + chunk) % 251
    return bytes((seed + i) % 256 for i in range(nbytes))


async def _prefill_rank(d: Any, tp: int, rank: int) -> None:
    async with await AsyncPrefillSender.create(
        socket=d.socket, group="late-pre", layout=LAYOUT, tp_size=tp, tp_rank=rank, ring_bytes=1 << 20,
    ) as tx:
        for room, tokens in ROOMS.items():
            starts = list(range(0, tokens, CHUNK))
            for c, start in enumerate(starts):
                n = min(CHUNK, tokens - start)
                data = _payload(room, rank, c, part_bytes(KLAYOUT, tp, rank, n))
                await tx.send_chunk(room, c, start, n, data, last=c == len(starts) - 1, aux=b"a" * (c == len(starts) - 1))
        for room in ROOMS:
            st = await tx.wait(room, timeout=30, poll_s=0.01)
            assert st.state.name == "SUCCESS", st


async def _pair(inproc: Any, name: str) -> tuple[Any, AsyncDecodeReceiver]:
    pre = await inproc(f"{name}-p")
    dec = await inproc(f"{name}-d")
    rx = await AsyncDecodeReceiver.create(socket=dec.socket, group=f"{name}-dec", layout=LAYOUT, ring_bytes=1 << 20)
    return pre, rx


async def test_decode_first_prefill_group_registers_late(inproc: Any) -> None:
    # prefill TP 2 -> decode TP 1: the decode rank holds both heads, one from each writer.
    pre, rx = await _pair(inproc, "late")
    try:
        t0 = time.monotonic()
        for room, tokens in ROOMS.items():
            await rx.expect(room, pre.peer_address, "late-pre", tokens, deadline_ms=30_000)
        # Longer than the old fixed 5 s grace for a missing group.
        await asyncio.sleep(6.0)
        for room in ROOMS:
            st = await rx.poll(room)
            assert st.state.name == "BOOTSTRAPPING", (room, st)
        senders = asyncio.gather(*(_prefill_rank(pre, 2, r) for r in range(2)))
        for room, tokens in ROOMS.items():
            got, st = await rx.receive(room, timeout=30)
            assert st.state.name == "SUCCESS" and st.aux == b"a"
            assert sorted(got) == list(range(-(-tokens // CHUNK)))
            for c, data in got.items():
                n = min(CHUNK, tokens - c * CHUNK)
                # Writer w's part holds head w: it lands at head w's offset of the reader's slot.
                want = b"".join(_payload(room, w, c, part_bytes(KLAYOUT, 2, w, n)) for w in range(2))
                assert data == want, (room, c)
            await rx.release(room)
        await asyncio.wait_for(senders, 30)
        assert time.monotonic() - t0 > 6.0
    finally:
        await rx.close()


async def test_group_that_never_registers_fails_at_the_deadline(inproc: Any) -> None:
    pre, rx = await _pair(inproc, "never")
    try:
        t0 = time.monotonic()
        await rx.expect(7100, pre.peer_address, "nobody", 16, deadline_ms=1500)
        try:
            await rx.receive(7100, timeout=10)
            raise AssertionError("a room whose prefill group never registered succeeded")
        except RoomFailed as exc:
            failed = exc
        waited = time.monotonic() - t0
        assert "DEADLINE" in str(failed.failure_code), failed
        assert "'nobody'" in failed.reason and "not registered" in failed.reason, failed.reason
        assert 1.2 < waited < 5.0, waited
    finally:
        await rx.close()
