"""The engine API's unary calls over a plain Unix socket: the per-chunk fast lane.

Why: on the 2-core VM a gRPC unary call over a Unix socket costs about 430 µs of CPU in a
grpc.aio server and 280 µs in a sync client (a health check, measured); a chunk takes at least
two such calls (EnqueueChunk, Watermark), which on a loaded node is the core the copy needs.
The same request and reply messages, framed by hand on a Unix socket, cost about 25 µs a side.

Only the transport differs: every call is served by the same EngineServicer method (same
validation, same error mapping, same metrics), so the lane can never accept what gRPC refuses.
Engines find it in RegisterEngineReply.lane_socket and fall back to gRPC when it is absent.

The frame format is kvxfer_protocol.lane_frames (the client frames with the same definitions).
Server streams (WatchRooms) go as reply frames with status STREAM_MORE: a landed chunk costs the
daemon one frame instead of a gRPC stream message, and the engine one read (measured on the
2-core VM: the gRPC message was most of both sides' CPU per chunk after the calls themselves).

Replies made in one turn of the event loop go out in one write: each write wakes the engine,
and on a loaded node the writer pays for that wake-up inside the syscall.

A unary call runs in the loop turn that read it, and the replies of what one read brought are
written at its end; only calls that may wait (AcquireSlot) start as tasks. A task per call cost
the daemon about 4-7 µs of CPU and two more loop turns before the reply left (2-core VM: unary
back to back 11.9-12.5k -> 13.0-13.6k calls/s, p99 at 1000/s 324-343 -> 240-254 µs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from typing import Any

import grpc

from kvxfer_protocol.lane_frames import REQUEST, STREAM_MORE, reply_frame
from kvxferd.ops.listener_bounds import RefusalLog
from kvxferd.ops.owned_files import bind_unix_socket

logger = logging.getLogger(__name__)

MAX_CALLS_PER_CONNECTION = 1024
# Work one connection may do in one loop turn: a client that pipelines hundreds of calls (each
# GetStatus costs milliseconds) gets the rest served in later turns, reading paused meanwhile, so
# every other client and the daemon's own timers get the loop in between. A chunk's calls (tens of
# microseconds each) never come near it.
TURN_CALLS = 64
TURN_S = 0.005
# The largest frame a connection may send before one call of it was served: what a stranger can
# make one connection buffer (an engine's first call is small; a batch of ~10k chunks would fit).
UNPROVEN_FRAME = 1 << 20
# What every lane connection together may hold in incomplete frames, in frames of the largest size:
# over it, the connection holding the most is closed.
BUFFERED_FRAMES = 8

Handler = Callable[[Any, Any], Awaitable[Any]]
StreamHandler = Callable[[Any, Any], AsyncIterator[Any]]


class LaneAbort(grpc.aio.AbortError):
    """What LaneContext.abort raises: the servicer's error mapping ends here, as it does in gRPC."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class LaneContext:
    """The part of grpc.aio.ServicerContext that EngineServicer uses."""

    def __init__(self, timeout_ms: int) -> None:
        self._deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms else None

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise LaneAbort(code, details)


class LaneServer:
    def __init__(self, path: str, methods: Mapping[str, tuple[Handler, Any]],
                 streams: Mapping[str, tuple[StreamHandler, Any]], max_frame_bytes: int,
                 waiting: frozenset[str] = frozenset(), max_connections: int = 1088) -> None:
        """methods: name -> (bound servicer method, request message class); streams: the same for
        server-streaming methods; waiting: the unary methods that may wait (for ring space, say),
        served as tasks from the start, while the others run in the loop turn that read them;
        max_connections: over it, a new connection evicts the oldest that never had a call served
        (engines' connections are never evicted for a newcomer), else it is closed."""
        self.path = path
        self._methods = dict(methods)
        self._waiting = waiting
        self._streams = dict(streams)
        self._max_frame = max_frame_bytes
        self._server: asyncio.AbstractServer | None = None
        self._conns: dict[_LaneConnection, None] = {}  # oldest first
        self._max_conns = max_connections
        self.buffered = 0  # bytes of incomplete frames, all connections together
        self.budget = BUFFERED_FRAMES * max_frame_bytes
        self.refusals = RefusalLog("engine lane")

    async def start(self, mode: int, gid: int = -1) -> None:
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: _LaneConnection(self), sock=bind_unix_socket(self.path, mode, gid))

    async def close(self) -> None:
        """Closes the listener and every connection; the daemon removes the socket file with
        the others next to its socket."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.close()
        self.refusals.close()

    def admit(self, conn: _LaneConnection) -> bool:
        """A new connection: room is made by evicting the oldest one never served, if any."""
        if len(self._conns) >= self._max_conns:
            idle = next((c for c in self._conns if not c.proven), None)
            if idle is None:
                self.refusals(f"connection refused: {self._max_conns} open, all served")
                return False
            self.refusals(f"unserved connection evicted: {self._max_conns} open")
            idle.abort()
            self._conns.pop(idle, None)
        self._conns[conn] = None
        return True

    def over_budget(self) -> None:
        """Incomplete frames over the budget: the connection holding the most is closed."""
        if not self._conns:
            return
        worst = max(self._conns, key=lambda c: len(c.buf))
        self.refusals(f"connection closed: {self.buffered} B of incomplete frames (budget {self.budget})")
        worst.abort()


class _LaneConnection(asyncio.Protocol):
    def __init__(self, server: LaneServer) -> None:
        self._server = server
        self.buf = bytearray()
        self.proven = False  # a call of it was served: an engine's, never evicted for a newcomer
        self._busy = False  # frames left for a later loop turn (reading paused meanwhile)
        self._transport: asyncio.Transport | None = None
        self._calls: set[asyncio.Task[None]] = set()
        self._out: list[bytes] = []
        # Cleared while the engine reads slower than we write: streams stop taking events, so
        # their queues (and the watch_backlog cap) bound what a slow reader costs us.
        self._writable = asyncio.Event()
        self._writable.set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport
        if not self._server.admit(self):
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._conns.pop(self, None)
        self._server.buffered -= len(self.buf)
        self.buf = bytearray()
        self._transport = None
        self._writable.set()
        for task in self._calls:
            task.cancel()  # e.g. an AcquireSlot waiting for space, or a stream: its caller is gone

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Cuts a connection we refuse: nothing of it is worth waiting for."""
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._server.buffered += len(data)
        if not self._busy:
            self._work()

    def _work(self) -> None:
        """Serves the complete frames buffered, up to a turn's worth (TURN_CALLS, TURN_S)."""
        buf, server = self.buf, self._server
        pos = calls = 0
        more = False
        began = time.monotonic()
        while len(buf) - pos >= REQUEST.size:
            length, call_id, timeout_ms, name_len = REQUEST.unpack_from(buf, pos)
            limit = server._max_frame if self.proven else min(server._max_frame, UNPROVEN_FRAME)
            if length > limit or name_len > length:
                server.refusals(f"frame over {limit} B or malformed header: connection closed")
                self.abort()
                return
            end = pos + REQUEST.size + length
            if len(buf) < end:
                break
            if calls >= TURN_CALLS or (calls and time.monotonic() - began > TURN_S):
                more = True
                break
            start = pos + REQUEST.size
            name = bytes(buf[start : start + name_len]).decode("ascii", "replace")
            body = bytes(buf[start + name_len : end])
            pos = end
            calls += 1
            self._dispatch(call_id, timeout_ms, name, body)
        if more:
            self._later()
        else:
            self._resume()
        del buf[:pos]
        server.buffered -= pos
        if server.buffered > server.budget:
            server.over_budget()
        if self._out:
            self._flush()  # the replies of the calls just served, in one write, without another turn

    def _later(self) -> None:
        if not self._busy and self._transport is not None:
            self._busy = True
            self._transport.pause_reading()
        asyncio.get_running_loop().call_soon(self._work_on)

    def _work_on(self) -> None:
        if self._transport is not None:
            self._work()

    def _resume(self) -> None:
        if self._busy:
            self._busy = False
            if self._transport is not None:
                self._transport.resume_reading()

    def _dispatch(self, call_id: int, timeout_ms: int, name: str, body: bytes) -> None:
        entry: tuple[Any, Any] | None = self._server._methods.get(name)
        streaming = entry is None and name in self._server._streams
        if streaming:
            entry = self._server._streams[name]
        if entry is None:
            self._reply(call_id, grpc.StatusCode.UNIMPLEMENTED, f"{name!r} is not served on the lane".encode())
            return
        if len(self._calls) >= MAX_CALLS_PER_CONNECTION:
            self._reply(call_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"more than {MAX_CALLS_PER_CONNECTION} calls outstanding on one lane connection".encode())
            return
        handler, request_cls = entry
        try:
            request = request_cls.FromString(body)
        except Exception:
            self._server.refusals(f"{name}: undecodable request")
            self._reply(call_id, grpc.StatusCode.INVALID_ARGUMENT, f"{name}: the request does not parse".encode())
            return
        self.proven = True
        ctx = LaneContext(timeout_ms)
        if streaming:
            self._track(asyncio.ensure_future(self._serve(call_id, name, self._stream(call_id, handler, request, ctx))))
            return
        call = self._serve(call_id, name, self._unary(handler, request, ctx))
        if name in self._server._waiting:
            self._track(asyncio.ensure_future(call))
            return
        # The other unary calls (EnqueueChunk, Watermark, ...) finish without waiting for anything:
        # they run here, in the loop turn that read them. A task per call cost two more loop turns
        # before the reply left, and on a loaded node each turn waits behind the other ready
        # callbacks. Should one wait after all, it goes on in a task from where it stopped.
        try:
            waiting_on = call.send(None)
        except StopIteration:
            return
        self._track(asyncio.ensure_future(_resume(call, waiting_on)))

    def _track(self, task: asyncio.Task[None]) -> None:
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _serve(self, call_id: int, name: str, work: Awaitable[bytes]) -> None:
        """Runs one call's body and sends its final frame: the reply, or the status it ended with."""
        try:
            payload = await work
        except LaneAbort as exc:
            self._reply(call_id, exc.code, exc.details.encode())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the servicer maps every error it knows; this is a bug
            logger.exception("lane: %s failed", name)
            self._reply(call_id, grpc.StatusCode.INTERNAL, f"internal error: {exc!r}".encode())
        else:
            self._reply(call_id, grpc.StatusCode.OK, payload)

    @staticmethod
    async def _unary(handler: Handler, request: Any, ctx: LaneContext) -> bytes:
        return bytes((await handler(request, ctx)).SerializeToString())

    async def _stream(self, call_id: int, handler: StreamHandler, request: Any, ctx: LaneContext) -> bytes:
        async for msg in handler(request, ctx):
            await self._writable.wait()
            self._send(call_id, STREAM_MORE, msg.SerializeToString())
        return b""

    def _reply(self, call_id: int, code: grpc.StatusCode, payload: bytes) -> None:
        self._send(call_id, code.value[0], payload)

    def _send(self, call_id: int, code: int, payload: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(reply_frame(call_id, code, payload))

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(out))


async def _resume(call: Coroutine[Any, Any, None], waiting_on: Any) -> None:
    """Drives, inside a task, a call that was started outside one and is waiting on `waiting_on`
    (a future, or None after a bare yield). Cancelling the task cancels the call where it waits."""
    while True:
        try:
            if waiting_on is None:
                await asyncio.sleep(0)
            else:
                # The call's own await marked the future as yielded to a task; as a task's step
                # would, clear the mark so that this await can yield it again.
                waiting_on._asyncio_future_blocking = False
                await waiting_on
        except BaseException as exc:  # CancelledError included: the call sees it where it waits
            try:
                waiting_on = call.throw(exc)
            except StopIteration:
                return
            continue
        try:
            waiting_on = call.send(None)
        except StopIteration:
            return
