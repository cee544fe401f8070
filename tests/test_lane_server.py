"""kvxferd.engine_api.lane's server on its own, with small handlers: calls that finish at once, calls that wait
although they were not declared as waiting (they go on from where they stopped), calls declared
as waiting (run as tasks, so task-bound helpers such as asyncio.timeout work), and a dropped
connection cancelling a call where it waits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from kvxfer_protocol.lane_frames import REPLY, REQUEST, reply_frame
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2
from kvxferd.engine_api.lane import LaneContext, LaneServer


class Handlers:
    def __init__(self) -> None:
        self.gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.cancelled = asyncio.Event()

    async def Echo(self, req: common_pb2.RoomKey, ctx: LaneContext) -> common_pb2.RoomKey:
        return common_pb2.RoomKey(id=req.id + 1, generation=req.generation)

    async def Refuse(self, req: common_pb2.RoomKey, ctx: LaneContext) -> common_pb2.RoomKey:
        await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"room {req.id} refused")
        raise AssertionError("abort returned")

    async def Late(self, req: common_pb2.RoomKey, ctx: LaneContext) -> common_pb2.RoomKey:
        """Not declared as waiting, waits anyway: on a future, then after a bare yield."""
        try:
            extra = await self.gate
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        await asyncio.sleep(0)
        if extra < 0:
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "gate said no")
        return common_pb2.RoomKey(id=req.id + extra)

    async def Timed(self, req: common_pb2.RoomKey, ctx: LaneContext) -> common_pb2.RoomKey:
        async with asyncio.timeout(5):  # needs a current task: declared as waiting
            await asyncio.sleep(0.01)
        return common_pb2.RoomKey(id=req.id * 2)

    async def Never(self, req: common_pb2.RoomKey, ctx: LaneContext) -> AsyncIterator[common_pb2.RoomKey]:
        yield req


@pytest.fixture
async def lane(tmp_path: Path) -> AsyncIterator[tuple[str, Handlers]]:
    h = Handlers()
    methods = {name: (getattr(h, name), common_pb2.RoomKey) for name in ("Echo", "Refuse", "Late", "Timed")}
    server = LaneServer(str(tmp_path / "s.lane"), methods, {"Never": (h.Never, common_pb2.RoomKey)}, 1 << 20,
                        waiting=frozenset({"Timed"}))
    await server.start(0o600)
    try:
        yield server.path, h
    finally:
        await server.close()


async def _send(w: asyncio.StreamWriter, call_id: int, name: str, room: int) -> None:
    body = common_pb2.RoomKey(id=room).SerializeToString()
    w.write(REQUEST.pack(len(name) + len(body), call_id, 0, len(name)) + name.encode() + body)
    await w.drain()


async def _reply(r: asyncio.StreamReader) -> tuple[int, int, bytes]:
    length, call_id, code = REPLY.unpack(await asyncio.wait_for(r.readexactly(REPLY.size), 10))
    return call_id, code, await r.readexactly(length)


async def test_calls_that_finish_at_once_answer_in_order(lane: tuple[str, Handlers]) -> None:
    r, w = await asyncio.open_unix_connection(lane[0])
    for i in range(5):
        await _send(w, i, "Echo" if i != 3 else "Refuse", 10 * i)
    got = [await _reply(r) for _ in range(5)]
    assert [g[0] for g in got] == [0, 1, 2, 3, 4]
    for call_id, code, payload in got:
        if call_id == 3:
            assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and payload == b"room 30 refused"
        else:
            assert code == 0 and common_pb2.RoomKey.FromString(payload).id == 10 * call_id + 1
    w.close()


async def test_a_call_that_waits_unannounced_goes_on_where_it_stopped(lane: tuple[str, Handlers]) -> None:
    path, h = lane
    r, w = await asyncio.open_unix_connection(path)
    await _send(w, 1, "Late", 5)
    await _send(w, 2, "Echo", 7)
    # The quick call is not held behind the waiting one.
    call_id, code, payload = await _reply(r)
    assert (call_id, code, common_pb2.RoomKey.FromString(payload).id) == (2, 0, 8)
    h.gate.set_result(100)
    call_id, code, payload = await _reply(r)
    assert (call_id, code, common_pb2.RoomKey.FromString(payload).id) == (1, 0, 105)
    # An error raised after the wait still maps to its status code.
    h.gate = asyncio.get_running_loop().create_future()
    await _send(w, 3, "Late", 5)
    await asyncio.sleep(0.05)
    h.gate.set_result(-1)
    call_id, code, payload = await _reply(r)
    assert (call_id, code, payload) == (3, grpc.StatusCode.FAILED_PRECONDITION.value[0], b"gate said no")
    w.close()


async def test_a_waiting_call_runs_in_a_task(lane: tuple[str, Handlers]) -> None:
    r, w = await asyncio.open_unix_connection(lane[0])
    await _send(w, 9, "Timed", 21)
    call_id, code, payload = await _reply(r)
    assert (call_id, code, common_pb2.RoomKey.FromString(payload).id) == (9, 0, 42)
    w.close()


async def test_a_dropped_connection_cancels_a_call_where_it_waits(lane: tuple[str, Handlers]) -> None:
    path, h = lane
    _, w = await asyncio.open_unix_connection(path)
    await _send(w, 1, "Late", 5)
    await asyncio.sleep(0.05)
    w.close()
    await asyncio.wait_for(h.cancelled.wait(), 5)
    assert not h.gate.done() or h.gate.cancelled()


def test_client_frames_are_what_the_server_parses() -> None:
    # One definition (kvxfer_protocol.lane_frames) for both sides: a request the client frames is
    # what the server unpacks, a reply the server frames is what the client takes.
    from kvxfer_client._lane import _frame, _take_frame

    body = common_pb2.RoomKey(id=7, generation=2)
    frame = _frame("PollRoom", 9, 1.5, body)
    length, call_id, ms, name_len = REQUEST.unpack_from(frame)
    start = REQUEST.size + name_len
    assert (length, call_id, ms) == (len(frame) - REQUEST.size, 9, 1500)
    assert frame[REQUEST.size:start] == b"PollRoom" and frame[start:] == body.SerializeToString()
    buf = bytearray(reply_frame(9, 5, b"gone") + b"next")
    assert _take_frame(buf) == (9, 5, b"gone")
    assert buf == b"next"
