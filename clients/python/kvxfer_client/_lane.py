"""The engine side of the daemon's fast lane (kvxferd/engine_api/lane.py): the same unary calls and
messages as gRPC, framed by hand on a Unix socket, at a fraction of the CPU per call.

A client uses the lane when RegisterEngineReply.lane_socket names one; `RoutedStub` sends the
calls the lane serves there and everything else (EnqueueStream, RegisterEngine) over gRPC. The
sync client's WatchRooms goes over the lane too, on a connection of its own (`LaneStream`).
Errors come back as KvxferError with the same status codes and messages as over gRPC.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.protobuf.message_factory import GetMessageClass

from kvxfer_client.errors import KvxferError, NotSent, ReplyLost
from kvxfer_protocol.lane_frames import REPLY, STREAM_MORE, request_frame
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2

_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Engine"]
_STATUS = {sc.value[0]: sc for sc in grpc.StatusCode}
# Every unary call but RegisterEngine (which hands out the lane).
LANE_METHODS = frozenset(
    m.name for m in _SERVICE.methods if not m.client_streaming and not m.server_streaming and m.name != "RegisterEngine"
)


_REPLY_CLASSES = {name: GetMessageClass(_SERVICE.methods_by_name[name].output_type) for name in LANE_METHODS}


def _frame(name: str, call_id: int, timeout: float | None, req: Any) -> bytes:
    ms = min(0xFFFFFFFF, int(timeout * 1000)) if timeout else 0
    return request_frame(name.encode(), call_id, ms, req.SerializeToString())


def _frame_end(buf: bytearray) -> int:
    """Where the first reply frame in `buf` ends, or 0 while it is incomplete."""
    if len(buf) < REPLY.size:
        return 0
    end = REPLY.size + REPLY.unpack_from(buf)[0]
    return end if len(buf) >= end else 0


def _take_frame(buf: bytearray) -> tuple[int, int, bytes] | None:
    """The first reply frame in `buf` as (call id, status code, payload), taken out of it; None
    while it is incomplete."""
    end = _frame_end(buf)
    if not end:
        return None
    _, call_id, code = REPLY.unpack_from(buf)
    payload = bytes(buf[REPLY.size:end])
    del buf[:end]
    return call_id, code, payload


def _read_frame(sock: socket.socket, buf: bytearray) -> tuple[int, int, bytes]:
    """The next reply frame on `sock` as (call id, status code, payload). `buf` keeps what arrived
    beyond it; a closed connection raises ConnectionResetError."""
    while True:
        frame = _take_frame(buf)
        if frame is not None:
            return frame
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionResetError("connection closed by the daemon")
        buf += data


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


_NO_LIMIT = struct.pack("@ll", 0, 0)  # a struct timeval of zero: SO_SNDTIMEO's "no limit"


def _timeval(seconds: float) -> bytes:
    """A struct timeval for SO_SNDTIMEO; never all zero (that would mean no limit)."""
    sec = int(seconds)
    usec = max(0, int((seconds - sec) * 1e6))
    return struct.pack("@ll", max(0, sec), usec if sec > 0 else max(1, usec))


def _connect(path: str, timeout: float | None) -> socket.socket:
    """A blocking connection to the lane at `path`, made within `timeout` (None: no limit).

    A daemon that has stopped accepting (hung, stopped) fills its listen queue, and connect()
    on a Unix socket then waits for room in it. A socket timeout does not bound that wait (a
    non-blocking connect fails at once with EAGAIN, even when the queue frees up a moment later):
    SO_SNDTIMEO on the blocking socket does, and lets connect() through as soon as there is
    room. Raises NotSent: DEADLINE_EXCEEDED when no room came in time, else UNAVAILABLE."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            if deadline is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(deadline - time.monotonic()))
            sock.connect(path)
            try:
                sock.getpeername()
                break
            except OSError as exc:
                # A signal cut the wait short and Python took that for a connection: wait again,
                # for what is left of the time.
                if exc.errno != errno.ENOTCONN:
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError from None
        if deadline is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _NO_LIMIT)
    except OSError as exc:
        sock.close()
        if isinstance(exc, (BlockingIOError, TimeoutError)):
            raise NotSent(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"the daemon's lane {path} took no connection within {timeout} s "
                          f"(its listen queue is full: is the daemon stalled?)") from None
        raise NotSent(grpc.StatusCode.UNAVAILABLE, f"cannot reach the daemon's lane {path}: {exc}") from None
    return sock


def _client_closed() -> NotSent:
    return NotSent(grpc.StatusCode.CANCELLED, "the client is closed")


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
        """This thread's connection, if it opened one in this process and the client is open.
        Once the client is closed the connection is dropped here: its deferred calls get
        CANCELLED (ReplyLost: the daemon may have served them)."""
        conn: _Conn | None = getattr(self._local, "conn", None)
        if conn is None or conn.pid != os.getpid():
            return None
        if self._closed:
            self._lose(conn, None, "", None)
            return None
        return conn

    def _conn(self, timeout: float | None) -> _Conn:
        """This thread's connection, opened within `timeout` if it has none (NotSent if not)."""
        conn = self._current()
        if conn is not None:
            return conn
        if self._closed:
            raise _client_closed()
        sock = _connect(self.path, timeout)
        with self._lock:
            if self._closed:  # close() ran while this thread connected: it would not see this socket
                sock.close()
                raise _client_closed()
            self._open.add(sock)
        conn = self._local.conn = _Conn(sock)
        return conn

    def _lose(self, conn: _Conn, exc: OSError | None, what: str, timeout: float | None) -> ReplyLost:
        """Closes a connection that timed out (out of step now: its replies may still come) or
        failed, or that close() shut; its deferred calls, and the caller, get the error returned."""
        if self._closed:  # close() shut it under this thread's call (EOF, EPIPE or EBADF here)
            error = ReplyLost(grpc.StatusCode.CANCELLED, f"{what}the client is closed")
        elif isinstance(exc, TimeoutError):
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
        conn = self._conn(timeout)
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
        reply always comes after it. Raises only when nothing was sent (NotSent: no connection,
        the client closed): on_reply is then never called; once it returns, on_reply is."""
        conn = self._conn(timeout)
        call_id = next(self._ids) & 0xFFFFFFFF
        frame = _frame(name, call_id, timeout, req)
        conn.deferred[call_id] = _settler(name, on_reply)
        try:
            conn.sock.settimeout(timeout)
            conn.sock.sendall(frame)
        except OSError as exc:
            self._lose(conn, exc, f"{name}: ", timeout)

    def deferred(self) -> int:
        """This thread's deferred calls whose replies are not read yet."""
        conn = self._current()
        return len(conn.deferred) if conn is not None else 0

    def poll_deferred(self) -> None:
        """Reads, without blocking, every reply already here for this thread's deferred calls. A
        connection that fails while they are read loses only the calls whose replies had not
        come whole: the replies read before the failure still reach their calls."""
        conn = self._current()
        if conn is None or not conn.deferred:
            return
        failed: OSError | None = None
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
            failed = exc
        while (frame := _take_frame(conn.buf)) is not None:
            self._settle(conn, *frame)
        if failed is not None:
            self._lose(conn, failed, "", None)

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

    def stream(self, name: str, req: Any, reply_cls: Any, timeout: float | None = None) -> LaneStream:
        """A server stream on a connection of its own (a watcher blocks its thread in recv),
        opened within `timeout`; the stream itself has no time limit."""
        if self._closed:
            raise _client_closed()
        st = LaneStream(self.path, name, req, reply_cls, self._streams_done, timeout)
        with self._lock:
            closed = self._closed  # close() ran while this thread connected: it would not see st
            if not closed:
                self._streams.add(st)
        if closed:
            st.cancel()
            st._finish()
            raise _client_closed()
        return st

    def _streams_done(self, st: LaneStream) -> None:
        with self._lock:
            self._streams.discard(st)

    def close(self) -> None:
        """Closes every connection. A thread blocked in a call on one (a waiting AcquireSlot,
        a silent daemon) wakes at once and gets CANCELLED "the client is closed", as do later
        calls from any thread; their deferred calls are lost (ReplyLost CANCELLED)."""
        with self._lock:
            self._closed = True
            socks, self._open = self._open, set()
            streams, self._streams = list(self._streams), weakref.WeakSet()
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it; close() alone would not
            except OSError:
                pass
            sock.close()
        for st in streams:
            st.cancel()


class LaneStream:
    """The messages of one server stream, read by the thread that iterates it; cancel() ends it
    from any thread (the reader sees the connection shut and stops)."""

    def __init__(self, path: str, name: str, req: Any, reply_cls: Any, done: Any,
                 timeout: float | None = None) -> None:
        self._cls = reply_cls
        self._done = done
        self._buf = bytearray()
        self._cancelled = False
        self._sock = _connect(path, timeout)
        try:
            self._sock.sendall(_frame(name, 1, None, req))  # a fresh connection's buffer takes it
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
