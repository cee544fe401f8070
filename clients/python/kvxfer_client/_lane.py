"""The engine side of the daemon's fast lane (kvxferd/lane.py): the same unary calls and
messages as gRPC, framed by hand on a Unix socket, at a fraction of the CPU per call.

A client uses the lane when RegisterEngineReply.lane_socket names one; `RoutedStub` sends the
calls the lane serves there and everything else (EnqueueStream, RegisterEngine) over gRPC. The
sync client's WatchRooms goes over the lane too, on a connection of its own (`LaneStream`).
Errors come back as KvxferError with the same status codes and messages as over gRPC.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import struct
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from google.protobuf.message_factory import GetMessageClass

from kvxfer_client._common import KvxferError, ReplyLost
from kvxfer_client._pb.kvxfer.v1 import engine_pb2

REQUEST = struct.Struct("<IIIB")
REPLY = struct.Struct("<IIB")
STREAM_MORE = 0xFF  # a message of a server stream; more follow
_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Engine"]
_STATUS = {sc.value[0]: sc for sc in grpc.StatusCode}
# Every unary call but RegisterEngine (which hands out the lane).
LANE_METHODS = frozenset(
    m.name for m in _SERVICE.methods if not m.client_streaming and not m.server_streaming and m.name != "RegisterEngine"
)


_REPLY_CLASSES = {name: GetMessageClass(_SERVICE.methods_by_name[name].output_type) for name in LANE_METHODS}


def _frame(name: str, call_id: int, timeout: float | None, req: Any) -> bytes:
    nb = name.encode()
    body = req.SerializeToString()
    ms = min(0xFFFFFFFF, int(timeout * 1000)) if timeout else 0
    return REQUEST.pack(len(nb) + len(body), call_id, ms, len(nb)) + nb + body


def _frame_end(buf: bytearray) -> int:
    """Where the first reply frame in `buf` ends, or 0 while it is incomplete."""
    if len(buf) < REPLY.size:
        return 0
    end = REPLY.size + REPLY.unpack_from(buf)[0]
    return end if len(buf) >= end else 0


def _read_frame(sock: socket.socket, buf: bytearray) -> tuple[int, int, bytes]:
    """The next reply frame on `sock` as (call id, status code, payload). `buf` keeps what arrived
    beyond it; a closed connection raises ConnectionResetError."""
    while True:
        end = _frame_end(buf)
        if end:
            _, call_id, code = REPLY.unpack_from(buf)
            payload = bytes(buf[REPLY.size:end])
            del buf[:end]
            return call_id, code, payload
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionResetError("connection closed by the daemon")
        buf += data


async def _read_frame_async(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    """_read_frame for asyncio streams; a closed connection raises IncompleteReadError."""
    length, call_id, code = REPLY.unpack(await reader.readexactly(REPLY.size))
    return call_id, code, (await reader.readexactly(length) if length else b"")


def _result(name: str, code: int, payload: bytes) -> Any:
    if code:
        raise KvxferError(_STATUS.get(code, grpc.StatusCode.UNKNOWN), payload.decode(errors="replace"))
    return _REPLY_CLASSES[name].FromString(payload)


def _settler(name: str, on_reply: Callable[[Any], None]) -> Callable[[Any], None]:
    """What a deferred call's reply frame, (code, payload), or the KvxferError of its lost
    connection goes through: on_reply gets the reply message or a KvxferError."""
    def settle(got: Any) -> None:
        if not isinstance(got, KvxferError):
            try:
                got = _result(name, *got)
            except KvxferError as exc:
                got = exc
        on_reply(got)
    return settle


class _Conn:
    """One thread's connection: its socket, the bytes read past the last whole reply, and the
    calls sent without waiting (send_deferred) whose replies are still to be read."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()
        self.buf = bytearray()
        self.deferred: dict[int, Callable[[Any], None]] = {}


class SyncLane:
    """One connection per calling thread (a waiting AcquireSlot holds only its own thread)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._local = threading.local()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        # Weak: a watch dropped unfinished (already shut down by its EventStream) is freed with its
        # socket, not kept until the client closes.
        self._streams: weakref.WeakSet[LaneStream] = weakref.WeakSet()
        self._closed = False

    def _current(self) -> _Conn | None:
        """This thread's connection, if it opened one in this process."""
        conn: _Conn | None = getattr(self._local, "conn", None)
        return conn if conn is not None and conn.pid == os.getpid() else None

    def _conn(self) -> _Conn:
        conn = self._current()
        if conn is not None:
            return conn
        if self._closed:
            raise KvxferError(grpc.StatusCode.CANCELLED, "the client is closed")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise KvxferError(grpc.StatusCode.UNAVAILABLE, f"cannot reach the daemon's lane {self.path}: {exc}") from None
        conn = self._local.conn = _Conn(sock)
        with self._lock:
            self._open.add(sock)
        return conn

    def _lose(self, conn: _Conn, exc: OSError, what: str, timeout: float | None) -> ReplyLost:
        """Closes a connection that timed out (out of step now: its replies may still come) or
        failed; its deferred calls, and the caller, get the error returned."""
        if isinstance(exc, TimeoutError):
            error = ReplyLost(grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}no reply within {timeout} s")
        else:
            error = ReplyLost(grpc.StatusCode.UNAVAILABLE, f"{what}the daemon's lane closed: {exc}")
        self._local.conn = None
        with self._lock:
            self._open.discard(conn.sock)
        conn.sock.close()
        deferred, conn.deferred = conn.deferred, {}
        for on_reply in deferred.values():
            on_reply(error)
        return error

    def call(self, name: str, req: Any, timeout: float | None = None) -> Any:
        (out,) = self.call_pipelined(name, (req,), timeout)
        if isinstance(out, KvxferError):
            raise out
        return out

    def call_pipelined(self, name: str, reqs: Iterable[Any], timeout: float | None = None,
                       one_write: bool = False) -> list[Any]:
        """Several calls of `name` on this thread's connection without waiting between them: each
        request leaves as soon as it is serialised, so the daemon works on one while the next is
        built (a batch costs max(client, daemon) rather than their sum). Returns, in order, each
        call's reply or its KvxferError; a stalled or dead connection raises KvxferError
        (DEADLINE_EXCEEDED, UNAVAILABLE) and is dropped.

        one_write: small requests leave together in one write instead, so the daemon reads them
        in one wake-up and answers them in one write."""
        conn = self._conn()
        sock = conn.sock
        want: dict[int, int] = {}
        held: list[bytes] = []
        try:
            sock.settimeout(timeout)
            for req in reqs:
                call_id = next(self._ids) & 0xFFFFFFFF
                want[call_id] = len(want)
                frame = _frame(name, call_id, timeout, req)
                if one_write:
                    held.append(frame)
                else:
                    sock.sendall(frame)
            if held:
                sock.sendall(b"".join(held))
            out: list[Any] = [None] * len(want)
            left = len(want)
            while left:
                got_id, code, payload = _read_frame(sock, conn.buf)
                i = want.pop(got_id, None)
                if i is None:
                    self._settle(conn, got_id, code, payload)  # an earlier deferred call's reply
                    continue
                left -= 1
                try:
                    out[i] = _result(name, code, payload)
                except KvxferError as exc:
                    out[i] = exc
        except OSError as exc:
            raise self._lose(conn, exc, f"{name}: ", timeout) from None
        return out

    # ------------------------------------------------------------------ calls not waited for

    def send_deferred(self, name: str, req: Any, on_reply: Callable[[Any], None],
                      timeout: float | None = None) -> None:
        """Sends one call of `name` without waiting for its reply: on_reply gets the reply or its
        KvxferError later, from whichever of this thread's calls reads it (any call, poll_deferred
        or wait_deferred). The daemon serves a connection's calls in order, so a later call's
        reply always comes after it."""
        conn = self._conn()
        call_id = next(self._ids) & 0xFFFFFFFF
        conn.deferred[call_id] = _settler(name, on_reply)
        try:
            conn.sock.settimeout(timeout)
            conn.sock.sendall(_frame(name, call_id, timeout, req))
        except OSError as exc:
            self._lose(conn, exc, f"{name}: ", timeout)

    def deferred(self) -> int:
        """This thread's deferred calls whose replies are not read yet."""
        conn = self._current()
        return len(conn.deferred) if conn is not None else 0

    def poll_deferred(self) -> None:
        """Reads, without blocking, every reply already here for this thread's deferred calls."""
        conn = self._current()
        if conn is None or not conn.deferred:
            return
        try:
            # A socket with a timeout waits for readability before every recv, MSG_DONTWAIT or
            # not: only a zero timeout makes this read return at once when nothing is there.
            conn.sock.settimeout(0.0)
            while True:
                data = conn.sock.recv(1 << 16)
                if not data:
                    raise ConnectionResetError("connection closed by the daemon")
                conn.buf += data
                if len(data) < 1 << 16:
                    break
        except BlockingIOError:
            pass
        except OSError as exc:
            self._lose(conn, exc, "", None)
            return
        while _frame_end(conn.buf):
            got_id, code, payload = _read_frame(conn.sock, conn.buf)
            self._settle(conn, got_id, code, payload)

    def wait_deferred(self, timeout: float | None = None) -> None:
        """Blocks until every deferred call of this thread has its reply (each goes to its
        on_reply); a daemon that stays silent for `timeout` fails them DEADLINE_EXCEEDED."""
        conn = self._current()
        if conn is None:
            return
        try:
            conn.sock.settimeout(timeout)
            while conn.deferred:
                got_id, code, payload = _read_frame(conn.sock, conn.buf)
                self._settle(conn, got_id, code, payload)
        except OSError as exc:
            self._lose(conn, exc, "", timeout)

    @staticmethod
    def _settle(conn: _Conn, call_id: int, code: int, payload: bytes) -> None:
        on_reply = conn.deferred.pop(call_id, None)
        if on_reply is not None:  # else not ours (cannot happen: one thread, one connection)
            on_reply((code, payload))

    def stream(self, name: str, req: Any, reply_cls: Any) -> LaneStream:
        """A server stream on a connection of its own (a watcher blocks its thread in recv)."""
        if self._closed:
            raise KvxferError(grpc.StatusCode.CANCELLED, "the client is closed")
        st = LaneStream(self.path, name, req, reply_cls, self._streams_done)
        with self._lock:
            self._streams.add(st)
        return st

    def _streams_done(self, st: LaneStream) -> None:
        with self._lock:
            self._streams.discard(st)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            socks, self._open = self._open, set()
            streams, self._streams = list(self._streams), weakref.WeakSet()
        for sock in socks:
            sock.close()
        for st in streams:
            st.cancel()


class LaneStream:
    """The messages of one server stream, read by the thread that iterates it; cancel() ends it
    from any thread (the reader sees the connection shut and stops)."""

    def __init__(self, path: str, name: str, req: Any, reply_cls: Any, done: Any) -> None:
        self._cls = reply_cls
        self._done = done
        self._buf = bytearray()
        self._cancelled = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(path)
            self._sock.sendall(_frame(name, 1, None, req))
        except OSError as exc:
            self._sock.close()
            raise KvxferError(grpc.StatusCode.UNAVAILABLE, f"cannot reach the daemon's lane {path}: {exc}") from None

    def __iter__(self) -> LaneStream:
        return self

    def __next__(self) -> Any:
        try:
            _, code, payload = _read_frame(self._sock, self._buf)
        except OSError as exc:  # the daemon closed the connection, or cancel() shut it
            self._finish()
            if self._cancelled:
                raise StopIteration from None
            raise KvxferError(grpc.StatusCode.UNAVAILABLE, f"the daemon's lane closed the stream: {exc}") from None
        if code == STREAM_MORE:
            return self._cls.FromString(payload)
        self._finish()
        if code == 0:
            raise StopIteration
        raise KvxferError(_STATUS.get(code, grpc.StatusCode.UNKNOWN), payload.decode(errors="replace"))

    def ready(self) -> bool:
        """Is the next message already here (reading it will not block)?"""
        if _frame_end(self._buf):
            return True
        try:
            data = self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except OSError:  # nothing waiting, or the connection is gone: the next read tells which
            return False
        if not data:
            return False  # closed: left for the next read to report
        self._buf += data
        return bool(_frame_end(self._buf))

    def cancel(self) -> None:
        self._cancelled = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in recv; it closes
        except OSError:
            pass

    def _finish(self) -> None:
        self._sock.close()
        self._done(self)


class AioLane:
    """One connection; calls are pipelined and matched to replies by id."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        # Calls sent with send_deferred whose replies have not come: what wait_deferred waits for.
        self._deferred: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._connecting: asyncio.Lock | None = None

    async def _connected(self) -> asyncio.StreamWriter:
        if self._writer is not None and not self._writer.is_closing():
            return self._writer
        self._connecting = self._connecting or asyncio.Lock()
        async with self._connecting:
            if self._writer is None or self._writer.is_closing():
                try:
                    reader, writer = await asyncio.open_unix_connection(self.path)
                except OSError as exc:
                    raise KvxferError(grpc.StatusCode.UNAVAILABLE,
                                      f"cannot reach the daemon's lane {self.path}: {exc}") from None
                self._writer = writer
                self._reader_task = asyncio.ensure_future(self._read(reader))
            return self._writer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "the daemon's lane closed"
        try:
            while True:
                call_id, code, payload = await _read_frame_async(reader)
                fut = self._pending.get(call_id)
                if fut is not None and not fut.done():
                    fut.set_result((code, payload))
        except (asyncio.IncompleteReadError, OSError) as exc:
            why = f"the daemon's lane closed: {exc!r}"
        finally:
            self._writer = None
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ReplyLost(grpc.StatusCode.UNAVAILABLE, why))

    async def call(self, name: str, req: Any, timeout: float | None = None) -> Any:
        writer = await self._connected()
        call_id = next(self._ids) & 0xFFFFFFFF
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        try:
            writer.write(_frame(name, call_id, timeout, req))
            try:
                code, payload = await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                raise KvxferError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{name}: no reply within {timeout} s") from None
        finally:
            self._pending.pop(call_id, None)
        return _result(name, code, payload)

    async def send_deferred(self, name: str, req: Any, on_reply: Callable[[Any], None]) -> None:
        """Sends one call of `name` and returns once it is written, without waiting for its reply:
        the connection's reader hands the reply, or its KvxferError (ReplyLost if the connection
        goes first), to on_reply on the loop. wait_deferred() waits for every such reply. Raises
        only when the call could not be sent (no connection): on_reply is then never called."""
        writer = await self._connected()
        call_id = next(self._ids) & 0xFFFFFFFF
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = self._deferred[call_id] = fut
        settle = _settler(name, on_reply)

        def done(f: asyncio.Future[tuple[int, bytes]]) -> None:
            self._pending.pop(call_id, None)
            self._deferred.pop(call_id, None)
            if f.cancelled():
                settle(ReplyLost(grpc.StatusCode.CANCELLED, f"{name}: cancelled before its reply"))
            else:
                settle(f.exception() or f.result())

        fut.add_done_callback(done)
        writer.write(_frame(name, call_id, None, req))
        try:
            # Backpressure only: returns at once unless the daemon has stopped reading.
            await writer.drain()
        except OSError:
            pass  # the connection went: the reader fails this call (ReplyLost) through on_reply

    def deferred(self) -> int:
        """Deferred calls whose replies have not come yet."""
        return len(self._deferred)

    async def wait_deferred(self, timeout: float | None = None) -> None:
        """Waits until every deferred call has its reply (each goes to its on_reply); those still
        without one after `timeout` get ReplyLost DEADLINE_EXCEEDED (a reply that comes later
        finds no call and is dropped)."""
        waiting = list(self._deferred.values())
        if not waiting:
            return
        _, late = await asyncio.wait(waiting, timeout=timeout)
        for fut in late:
            if not fut.done():
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
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()


class RoutedStub:
    """An EngineStub look-alike: `stub.X(req, timeout=...)` goes over the lane when the lane
    serves X, else over gRPC."""

    def __init__(self, grpc_stub: Any, lane: SyncLane | AioLane | None = None) -> None:
        self._grpc = grpc_stub
        self.lane = lane

    def __getattr__(self, name: str) -> Any:
        lane = self.lane
        if lane is not None and name in LANE_METHODS:
            return lambda req, timeout=None: lane.call(name, req, timeout)
        return getattr(self._grpc, name)
