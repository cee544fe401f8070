"""The engine client when things go wrong around the daemon's lane, against real daemons (stopped
with SIGSTOP, their lane socket moved away, their listen queue filled): a call that could not be
sent leaves no spare-slot ask behind, a release that fails leaves the other spares to the next
call, nothing waits forever on a stalled daemon, close() wakes the threads blocked on it, and
verdicts that did arrive are never reported lost."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvxfer_client import AsyncPrefillSender, ChunkRefused, KvxferError, Layout, PrefillSender
from kvxfer_client._lane import SyncLane
from kvxfer_client.errors import NotSent, ReplyLost
from kvxfer_protocol.lane_frames import REPLY, REQUEST
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2
from tests.test_e2e import status

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=64, dtype_bytes=2, page_size=16, dtype="bfloat16")


def _in_thread(fn: Any, limit: float = 15.0) -> tuple[Any, BaseException | None, float]:
    """fn() on a thread of its own (one with no lane connection yet): (result, exception, seconds).
    Fails the test if it is still running after `limit`."""
    out: dict[str, Any] = {"exc": None, "result": None}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["result"] = fn()
        except BaseException as exc:  # handed to the test
            out["exc"] = exc
        out["took"] = time.monotonic() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    assert not th.is_alive(), f"still blocked after {limit} s"
    return out["result"], out["exc"], out["took"]


@contextmanager
def _lane_moved(path: str) -> Iterator[None]:
    """The daemon's lane socket under another name: new connections fail (ENOENT), the daemon
    and the connections it has go on."""
    os.rename(path, path + ".away")
    try:
        yield
    finally:
        os.rename(path + ".away", path)


@contextmanager
def _stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _slots_held(sock: str) -> int:
    (eng,) = status(sock).engines
    return int(eng.slots_held)


# ------------------------------------------------------------------ spare slots


def test_a_deferred_chunk_that_could_not_be_sent_leaves_no_spare_ask(daemons: Any) -> None:
    """enqueue(wait=False) raising before anything left (no connection) settles its spare ask:
    two such failures used to leave the depth-2 ask budget spent for good."""
    d = daemons("ask-unsent")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20, claim_slots=False) as tx:
        slot = tx.acquire(8)
        with _lane_moved(tx.reg.lane_socket):
            for cid in (0, 1):
                _, exc, _ = _in_thread(lambda cid=cid: tx.enqueue(1, cid, cid * 8, 8, slot, wait=False))
                assert isinstance(exc, NotSent) and exc.code == grpc.StatusCode.UNAVAILABLE, exc
                assert "cannot reach the daemon's lane" in exc.message
        assert tx.spare._asked == 0
        # Spares are asked for again: chunks sent without waiting bring them.
        for cid in range(3):
            tx.enqueue(1, cid, cid * 8, 8, slot if cid == 0 else tx.acquire(8), last=cid == 2, wait=False)
        assert tx.flush() == []
        assert tx.spare._asked == 0 and len(tx.spare._held) >= 1


def test_a_release_that_fails_leaves_the_other_spares_to_the_next_call(daemons: Any) -> None:
    d = daemons("surplus")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20, claim_slots=False) as tx:
        slots = [tx.acquire(8) for _ in range(3)]
        tx.release_slot(slots[0])  # behind the client's back: the daemon refuses it from now on
        for s in slots:
            tx.spare.give_back(s)
        with pytest.raises(KvxferError) as info:
            tx.settle()
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert _slots_held(d.socket) == 2
        assert tx.settle() == []  # the two after it go now; the refused one is not tried again
        assert _slots_held(d.socket) == 0 and tx.spare.surplus() == []

        # A release that never left (no connection) keeps that slot too.
        slots = [tx.acquire(8) for _ in range(2)]
        for s in slots:
            tx.spare.give_back(s)
        with _lane_moved(tx.reg.lane_socket):
            _, exc, _ = _in_thread(tx.settle)
        assert isinstance(exc, NotSent) and exc.code == grpc.StatusCode.UNAVAILABLE, exc
        assert _slots_held(d.socket) == 2
        assert tx.settle() == []
        assert _slots_held(d.socket) == 0

        # A stale spare (another chunk size) that the daemon refuses to take back is not retried.
        tx.enqueue(2, 0, 0, 8, tx.acquire(8), last=True)  # brings a spare of 8 tokens
        ((_, spare),) = tx.spare._held
        tx.release_slot(spare)
        with pytest.raises(KvxferError) as info:
            tx.acquire(16)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        tx.release_slot(tx.acquire(16))


async def test_async_a_release_that_fails_leaves_the_other_spares_to_the_next_call(daemons: Any) -> None:
    d = daemons("asurplus")
    tx = await AsyncPrefillSender.create(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20,
                                         claim_slots=False)
    try:
        slots = [await tx.acquire(8) for _ in range(3)]
        await tx.release_slot(slots[0])
        for s in slots:
            tx.spare.give_back(s)
        with pytest.raises(KvxferError) as info:
            await tx.settle()
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert _slots_held(d.socket) == 2
        assert await tx.settle() == []
        assert _slots_held(d.socket) == 0 and tx.spare.surplus() == []
    finally:
        await tx.close()


async def test_async_a_late_verdict_gives_back_the_slot_it_brings(daemons: Any) -> None:
    """flush(timeout) gives up on a verdict (DEADLINE_EXCEEDED, lost); the daemon, woken, takes
    the chunk and hands out a spare with it. That slot goes back with the next call instead of
    staying the engine's until it unregisters."""
    d = daemons("alate")
    tx = await AsyncPrefillSender.create(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20)
    try:
        slot = await tx.acquire(8)
        with _stopped(d.proc.pid):
            await tx.enqueue(1, 0, 0, 8, slot, last=True, wait=False)  # asks for a spare
            (lost,) = await tx.flush(timeout=0.5)
            assert lost.lost and lost.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert tx.spare._asked == 0
        # Served after the chunk: its late verdict has been read when this returns.
        assert (await tx.poll(1)).state.name == "BOOTSTRAPPING"  # it went in after all
        assert await tx.settle() == []
        assert tx.spare._held == [] and tx.spare.surplus() == []
        assert _slots_held(d.socket) == 1  # the chunk's own slot, queued in its room; no spare
    finally:
        await tx.close()


# ------------------------------------------------------------------ a stalled daemon


def test_a_full_listen_queue_does_not_hang_a_call(daemons: Any) -> None:
    """A stopped daemon accepts no connections: once its lane's listen queue is full, connect()
    waits for room. A thread with no connection yet gets DEADLINE_EXCEEDED after the call
    timeout, also when signals cut that wait short; once the daemon is back, calls go through."""
    d = daemons("backlog")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20, call_timeout=1.0) as tx:
        path = tx.reg.lane_socket
        fillers: list[socket.socket] = []
        try:
            with _stopped(d.proc.pid):
                while True:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.setblocking(False)
                    try:
                        s.connect(path)
                    except BlockingIOError:
                        s.close()
                        break
                    fillers.append(s)
                    assert len(fillers) < 100_000
                _, exc, took = _in_thread(tx.status)
                assert isinstance(exc, KvxferError) and exc.code == grpc.StatusCode.DEADLINE_EXCEEDED, exc
                assert "listen queue is full" in exc.message and 0.9 <= took < 5, (exc, took)
                # The same on this thread, with a signal interrupting connect() every 0.2 s.
                old = signal.signal(signal.SIGUSR1, lambda *_: None)
                me, done = threading.get_ident(), threading.Event()

                def poke() -> None:
                    while not done.wait(0.2):
                        signal.pthread_kill(me, signal.SIGUSR1)

                poker = threading.Thread(target=poke)
                poker.start()
                t0 = time.monotonic()
                try:
                    with pytest.raises(KvxferError) as info:
                        tx.status()
                finally:
                    done.set()
                    poker.join()
                    signal.signal(signal.SIGUSR1, old)
                assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
                assert 0.9 <= time.monotonic() - t0 < 5
        finally:
            for s in fillers:
                s.close()
        assert tx.status().daemon_id == "backlog"


def test_close_wakes_a_thread_blocked_in_a_lane_call(daemons: Any) -> None:
    """A thread waiting in AcquireSlot on a full ring, when another closes the client, returns at
    once with CANCELLED "the client is closed" (not after the call timeout, as a misleading
    UNAVAILABLE); later calls of a thread that had a connection get the same."""
    d = daemons("closewake")
    tx = PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20, call_timeout=10.0)
    try:
        while True:  # fill the ring
            try:
                tx.acquire(256, timeout=0)
            except KvxferError as exc2:
                assert exc2.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                break
        blocked: dict[str, Any] = {}
        started = threading.Event()

        def wait_for_space() -> None:
            started.set()
            t0 = time.monotonic()
            try:
                tx.acquire(256, timeout=30)
            except KvxferError as e:
                blocked["exc"] = e
            blocked["after_close"] = time.monotonic() - t0

        waiter = threading.Thread(target=wait_for_space, daemon=True)
        waiter.start()
        started.wait(5)
        time.sleep(0.5)  # in recv, the daemon holding its AcquireSlot
        assert waiter.is_alive()
        t0 = time.monotonic()
        tx.close(unregister=False)
        waiter.join(5)
        assert not waiter.is_alive() and time.monotonic() - t0 < 3
        exc = blocked["exc"]
        assert exc.code == grpc.StatusCode.CANCELLED and "the client is closed" in exc.message, exc
        with pytest.raises(KvxferError) as info:
            tx.status()  # this thread had a connection
        assert info.value.code == grpc.StatusCode.CANCELLED and "the client is closed" in info.value.message
    finally:
        tx.close()


def test_a_thread_s_unread_verdicts_are_lost_when_the_client_closes(daemons: Any) -> None:
    """Deferred calls of a thread whose connection close() shut: the verdicts are lost
    (CANCELLED; the daemon may have taken the chunk), and their spare asks settled."""
    d = daemons("closeverdict")
    tx = PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20)
    sent, closed = threading.Event(), threading.Event()
    got: list[Any] = []

    def engine_thread() -> None:
        slot = tx.acquire(8)
        tx.enqueue(1, 0, 0, 8, slot, last=True, wait=False)  # asks for a spare too
        sent.set()
        closed.wait(30)
        got.append(tx.settle())
        got.append(tx.spare._asked)

    th = threading.Thread(target=engine_thread, daemon=True)
    try:
        th.start()
        assert sent.wait(10)
        tx.close(unregister=False)
        closed.set()
        th.join(10)
        (refused,), asked = got
        assert isinstance(refused, ChunkRefused) and refused.lost and refused.code == grpc.StatusCode.CANCELLED
        assert "the client is closed" in refused.message and asked == 0
    finally:
        closed.set()
        tx.close()


async def test_async_a_daemon_that_stops_reading_does_not_hang_enqueue(daemons: Any) -> None:
    """enqueue(wait=False) returns once the request is written; a stopped daemon that reads
    nothing stalls that write. After the call timeout the connection is dropped and the chunk
    is refused as lost; once the daemon is back, the next call opens another."""
    d = daemons("adrain")
    tx = await AsyncPrefillSender.create(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20,
                                         call_timeout=1.0)
    try:
        slot = await tx.acquire(8)
        with _stopped(d.proc.pid):
            t0 = time.monotonic()
            # 2 MiB of aux: more than the socket and the transport's buffer take.
            await asyncio.wait_for(
                tx.enqueue(1, 0, 0, 8, slot, last=True, aux=bytes(2 << 20), wait=False), 10)
            assert 0.9 <= time.monotonic() - t0 < 5
            (lost,) = await asyncio.wait_for(tx.flush(timeout=5), 10)
            assert lost.lost and lost.code == grpc.StatusCode.DEADLINE_EXCEEDED and (lost.room, lost.chunk_id) == (1, 0)
            assert "stopped reading" in lost.message, lost
        assert tx.spare._asked == 0
        await tx.enqueue(1, 0, 0, 8, slot, last=True)  # the slot is still ours: nothing went in
        assert (await tx.poll(1)).state.name == "BOOTSTRAPPING"
    finally:
        await tx.close()


# ------------------------------------------------------------------ the lane's own reads


def _read_requests(peer: socket.socket, n: int) -> list[int]:
    """The call ids of the next n request frames on `peer`."""
    buf = b""
    ids: list[int] = []
    while len(ids) < n:
        buf += peer.recv(65536)
        while len(buf) >= REQUEST.size:
            length, call_id, _, _ = REQUEST.unpack_from(buf)
            if len(buf) < REQUEST.size + length:
                break
            ids.append(call_id)
            buf = buf[REQUEST.size + length:]
    return ids


def test_verdicts_read_before_the_connection_fails_still_reach_their_calls(short_tmp: Path) -> None:
    """poll_deferred reads what has arrived in 64 KiB reads; a read that then finds the
    connection gone loses only the call whose reply had not come whole. (A scripted lane:
    exactly 64 KiB of replies before the end, which a real daemon does not do on demand.)"""
    path = str(short_tmp / "scripted.lane")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    lane = SyncLane(path)
    got: list[Any] = []
    try:
        for i in range(4):
            lane.send_deferred("PollRoom", engine_pb2.PollRoomRequest(engine_id=f"e{i}"), got.append, 5)
        peer, _ = srv.accept()
        with peer:
            ids = _read_requests(peer, 4)
            part = 1 << 14  # three whole replies of 16 KiB, then 16 KiB of a fourth, then the end
            for call_id in ids[:3]:
                peer.sendall(REPLY.pack(part - REPLY.size, call_id, grpc.StatusCode.NOT_FOUND.value[0])
                             + b"n" * (part - REPLY.size))
            peer.sendall((REPLY.pack(part, ids[3], 0) + bytes(part))[:part])
        lane.poll_deferred()
        assert len(got) == 4 and lane.deferred() == 0
        for verdict in got[:3]:
            assert type(verdict) is KvxferError and verdict.code == grpc.StatusCode.NOT_FOUND, verdict
        assert isinstance(got[3], ReplyLost) and got[3].code == grpc.StatusCode.UNAVAILABLE
    finally:
        lane.close()
        srv.close()


# ------------------------------------------------------------------ verdicts belong to their thread


def test_a_refusal_reaches_only_the_thread_that_sent_the_chunk(daemons: Any) -> None:
    """A deferred refusal is raised by, or returned to, the thread whose enqueue(wait=False) it
    answers. It used to sit in one list for the whole client, so another thread's next call could
    raise it (about a chunk it never sent) or its settle() take it away from its owner."""
    d = daemons("owner")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        read = threading.Event()
        release = threading.Event()
        got: dict[str, Any] = {}

        def sender() -> None:
            slot = tx.acquire(8)
            tx.enqueue(1, 0, 0, 8, slot, last=False, aux=b"x", wait=False)  # aux only with the last chunk
            lane = tx.stub.lane
            assert isinstance(lane, SyncLane)
            lane.wait_deferred(10)  # the verdict is read here, not handed over yet
            read.set()
            release.wait(10)
            got["flush"] = tx.flush()

        t = threading.Thread(target=sender, name="owner-sender")
        t.start()
        assert read.wait(10)
        # Another thread: nothing of the sender's refusal reaches it.
        assert tx.settle() == []
        other = tx.acquire(8)
        tx.enqueue(2, 0, 0, 8, other, last=True)  # raises nothing
        release.set()
        t.join(10)
        (refused,) = got["flush"]
        assert isinstance(refused, ChunkRefused) and (refused.room, refused.chunk_id) == (1, 0)
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
