"""The asyncio engine's lane: one connection to the daemon's Unix socket, calls pipelined and
matched to their replies by id (the frames are kvxfer_client._lane's)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from kvxfer_client._lane import _STATUS, REPLY, STREAM_MORE, _client_closed, _frame, _result, _settler
from kvxfer_client.errors import KvxferError, NotSent, ReplyLost


async def _read_frame_async(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    """_read_frame for asyncio streams; a closed connection raises IncompleteReadError."""
    length, call_id, code = REPLY.unpack(await reader.readexactly(REPLY.size))
    return call_id, code, (await reader.readexactly(length) if length else b"")


class _AioConn:
    """One connection of an AioLane: its writer, the calls whose replies it is to bring, and the
    calls given up on (wait_deferred's timeout) whose late replies still have somewhere to go."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self.late: dict[int, Callable[[Any], None]] = {}
        self.lost: KvxferError | None = None  # why this client dropped it, for the calls it fails
        self.closed = False
        self.reader: asyncio.Future[None] | None = None  # held: the loop keeps only weak references

    def usable(self) -> bool:
        return not self.closed and not self.writer.is_closing()

    def drop(self, error: KvxferError) -> None:
        """Closes the connection now, unsent bytes and all (close() would wait to flush them to
        a daemon that may never read them): its reader fails what is pending with `error`."""
        if self.lost is None:
            self.lost = error
        self.writer.transport.abort()


class AioLane:
    """One connection; calls are pipelined and matched to replies by id."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._ids = itertools.count(1)
        self._conn: _AioConn | None = None
        # Calls sent with send_deferred whose replies have not come: what wait_deferred waits for,
        # with their connection and what takes a reply that comes after wait_deferred gave up.
        self._deferred: dict[int, tuple[asyncio.Future[tuple[int, bytes]], _AioConn, Callable[[Any], None] | None]] = {}
        self._connecting: asyncio.Lock | None = None
        self._closed = False

    async def _connected(self, timeout: float | None = None) -> _AioConn:
        conn = self._conn
        if conn is not None and conn.usable():
            return conn
        if self._closed:
            raise _client_closed()
        self._connecting = self._connecting or asyncio.Lock()
        async with self._connecting:
            conn = self._conn
            if conn is None or not conn.usable():
                try:
                    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), timeout)
                except asyncio.TimeoutError:  # before OSError: TimeoutError is one
                    raise NotSent(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"the daemon's lane {self.path} took no connection within {timeout} s") from None
                except OSError as exc:
                    raise NotSent(grpc.StatusCode.UNAVAILABLE,
                                  f"cannot reach the daemon's lane {self.path}: {exc}") from None
                conn = _AioConn(writer)
                if self._closed:
                    conn.drop(_client_closed())
                    raise _client_closed()
                self._conn = conn
                conn.reader = asyncio.ensure_future(self._read(conn, reader))
            return conn

    async def _read(self, conn: _AioConn, reader: asyncio.StreamReader) -> None:
        why = "the daemon's lane closed"
        try:
            while True:
                call_id, code, payload = await _read_frame_async(reader)
                fut = conn.pending.get(call_id)
                if fut is not None and not fut.done():
                    fut.set_result((code, payload))
                    continue
                late = conn.late.pop(call_id, None)
                if late is not None:  # on the loop, as on_reply is: its failure is not the reader's
                    asyncio.get_running_loop().call_soon(late, (code, payload))
        except (asyncio.IncompleteReadError, OSError) as exc:
            why = f"the daemon's lane closed: {exc!r}"
        finally:
            # Only this connection's calls: a later connection may already carry others.
            conn.closed = True
            if self._conn is conn:
                self._conn = None
            conn.late.clear()
            if self._closed:
                error: KvxferError = ReplyLost(grpc.StatusCode.CANCELLED, "the client is closed")
            else:
                error = conn.lost or ReplyLost(grpc.StatusCode.UNAVAILABLE, why)
            for fut in list(conn.pending.values()):
                if not fut.done():
                    fut.set_exception(type(error)(error.code, error.message))

    async def call(self, name: str, req: Any, timeout: float | None = None) -> Any:
        conn = await self._connected(timeout)
        call_id = next(self._ids) & 0xFFFFFFFF
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        conn.pending[call_id] = fut
        try:
            conn.writer.write(_frame(name, call_id, timeout, req))
            try:
                code, payload = await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                raise KvxferError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{name}: no reply within {timeout} s") from None
        finally:
            conn.pending.pop(call_id, None)
        return _result(name, code, payload)

    async def send_deferred(self, name: str, req: Any, on_reply: Callable[[Any], None],
                            timeout: float | None = None,
                            on_late: Callable[[Any], None] | None = None) -> None:
        """Sends one call of `name` and returns once it is written, without waiting for its reply:
        the connection's reader hands the reply, or its KvxferError (ReplyLost if the connection
        goes first), to on_reply on the loop. wait_deferred() waits for every such reply. Raises
        only when the call could not be sent (NotSent: no connection within `timeout`, the client
        closed): on_reply is then never called.

        A daemon that stops reading stalls the write: after `timeout` the connection is dropped,
        and this call and the others on it get ReplyLost DEADLINE_EXCEEDED. on_late: gets the
        reply (message or KvxferError) should it come after wait_deferred gave up on the call."""
        conn = await self._connected(timeout)
        call_id = next(self._ids) & 0xFFFFFFFF
        frame = _frame(name, call_id, None, req)
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        conn.pending[call_id] = fut
        self._deferred[call_id] = (fut, conn, _settler(name, on_late) if on_late is not None else None)
        settle = _settler(name, on_reply)

        def done(f: asyncio.Future[tuple[int, bytes]]) -> None:
            conn.pending.pop(call_id, None)
            self._deferred.pop(call_id, None)
            if f.cancelled():
                settle(ReplyLost(grpc.StatusCode.CANCELLED, f"{name}: cancelled before its reply"))
            else:
                settle(f.exception() or f.result())

        fut.add_done_callback(done)
        conn.writer.write(frame)
        if not conn.writer.transport.get_write_buffer_size():
            return  # all in the socket: drain() would return at once (wait_for costs a task a call)
        try:
            # Backpressure only: returns at once unless the daemon has stopped reading.
            await asyncio.wait_for(conn.writer.drain(), timeout)
        except asyncio.TimeoutError:  # before OSError: TimeoutError is one
            # Every call on the connection fails with this, whatever its name.
            conn.drop(ReplyLost(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the daemon stopped reading its lane: a write waited {timeout} s, "
                                f"the connection was dropped"))
        except OSError:
            pass  # the connection went: the reader fails this call (ReplyLost) through on_reply

    def deferred(self) -> int:
        """Deferred calls whose replies have not come yet."""
        return len(self._deferred)

    async def wait_deferred(self, timeout: float | None = None) -> None:
        """Waits until every deferred call has its reply (each goes to its on_reply); those still
        without one after `timeout` get ReplyLost DEADLINE_EXCEEDED. A reply that comes later goes
        to the call's on_late, if it had one, else nowhere."""
        waiting = [fut for fut, _, _ in self._deferred.values()]
        if not waiting:
            return
        _, unanswered = await asyncio.wait(waiting, timeout=timeout)
        for call_id, (fut, conn, on_late) in list(self._deferred.items()):
            if fut in unanswered and not fut.done():
                if on_late is not None and not conn.closed:
                    conn.late[call_id] = on_late
                fut.set_exception(ReplyLost(grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {timeout} s"))
        # Done-callbacks run in a later loop turn: every on_reply has run when this returns.
        await asyncio.sleep(0)

    async def stream(self, name: str, req: Any, reply_cls: Any) -> AsyncIterator[Any]:
        """A server stream on a connection of its own; closing the generator (or cancelling its
        task) closes the connection, which ends the stream on the daemon."""
        try:
            reader, writer = await asyncio.open_unix_connection(self.path)
        except OSError as exc:
            raise KvxferError(grpc.StatusCode.UNAVAILABLE, f"cannot reach the daemon's lane {self.path}: {exc}") from None
        try:
            writer.write(_frame(name, 1, None, req))
            while True:
                try:
                    _, code, payload = await _read_frame_async(reader)
                except (asyncio.IncompleteReadError, OSError) as exc:
                    raise KvxferError(grpc.StatusCode.UNAVAILABLE,
                                      f"the daemon's lane closed the stream: {exc!r}") from None
                if code == STREAM_MORE:
                    yield reply_cls.FromString(payload)
                    continue
                if code:
                    raise KvxferError(_STATUS.get(code, grpc.StatusCode.UNKNOWN), payload.decode(errors="replace"))
                return
        finally:
            writer.close()

    async def close(self) -> None:
        """Closes the connection; calls still waiting on it get CANCELLED, as do later ones."""
        self._closed = True
        conn = self._conn
        if conn is not None:
            conn.drop(_client_closed())
            if conn.reader is not None:
                await asyncio.wait({conn.reader}, timeout=1.0)  # its calls are failed on return
