"""The engine lane (kvxferd/engine_api/lane.py) and the fd-passed huge-page pool (kvxferd/buffers/hugepool.py,
kvxferd/engine_api/pool_socket.py), against real daemons: same answers as gRPC, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvxfer_client import DecodeReceiver, KvxferError, Layout, PrefillSender
from kvxfer_protocol.lane_frames import REPLY, REQUEST
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from kvxferd.buffers.hugepool import Unavailable, private_huge_file

LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=16, dtype_bytes=2, page_size=16)


def _private_huge_possible() -> bool:
    try:
        os.close(private_huge_file(2 << 20))
    except Unavailable:
        return False
    return True


def _raw_call(path: str, name: str, body: bytes, call_id: int = 7, name_len: int | None = None) -> tuple[int, int, bytes]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        nb = name.encode()
        s.sendall(REQUEST.pack(len(nb) + len(body), call_id, 5000, len(nb) if name_len is None else name_len) + nb + body)
        buf = b""
        while len(buf) < REPLY.size:
            buf += s.recv(65536)
        length, got, code = REPLY.unpack_from(buf)
        while len(buf) < REPLY.size + length:
            buf += s.recv(65536)
        return got, code, buf[REPLY.size:]


def test_the_lane_answers_as_grpc_does(daemons: Any) -> None:
    d = daemons("lane")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        assert tx.reg.lane_socket == d.socket + ".lane" and tx.stub.lane is not None
        slot = tx.acquire(8)
        # The same bad calls, through the lane (the client's default) and through gRPC.
        bad = [
            engine_pb2.EnqueueChunkRequest(engine_id=tx.engine_id, room=common_pb2.RoomKey(id=1), chunk_id=0,
                                           token_start=0, num_tokens=8,
                                           slot=common_pb2.Slot(offset=slot.offset + 256, length=slot.length)),
            engine_pb2.EnqueueChunkRequest(engine_id="nobody@x", room=common_pb2.RoomKey(id=1), num_tokens=8),
        ]
        with grpc.insecure_channel(f"unix:{d.socket}") as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            for req in bad:
                with pytest.raises(KvxferError) as via_lane:
                    tx._call(tx.stub.EnqueueChunk, req)
                with pytest.raises(grpc.RpcError) as via_grpc:
                    stub.EnqueueChunk(req, timeout=5)
                assert via_lane.value.code == via_grpc.value.code() != grpc.StatusCode.OK
                assert via_lane.value.message == via_grpc.value.details()
        # A refused call changed nothing: the slot is still ours and a good enqueue goes through.
        tx.enqueue(1, 0, 0, 8, slot, last=True)
        assert tx.poll(1).state.name == "BOOTSTRAPPING"

        path = tx.reg.lane_socket
        got, code, msg = _raw_call(path, "EnqueueStream", b"")
        assert (got, code) == (7, grpc.StatusCode.UNIMPLEMENTED.value[0]) and b"not served on the lane" in msg
        # A stream the lane serves refuses as gRPC does: an engine that is not registered.
        watch = engine_pb2.WatchRoomsRequest(engine_id="nobody@x")
        got, code, msg = _raw_call(path, "WatchRooms", watch.SerializeToString())
        with grpc.insecure_channel(f"unix:{d.socket}") as ch, pytest.raises(grpc.RpcError) as via_grpc:
            list(engine_pb2_grpc.EngineStub(ch).WatchRooms(watch, timeout=5))
        assert got == 7 and code == via_grpc.value.code().value[0] != 0 and msg.decode() == via_grpc.value.details()
        got, code, msg = _raw_call(path, "PollRoom", b"\xff\xff\xff")
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"does not parse" in msg
        # A frame over max_message_bytes ends that connection only.
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(REQUEST.pack(1 << 30, 1, 0, 4) + b"Poll")
            assert s.recv(100) == b""
        assert tx.poll(1).state.name == "BOOTSTRAPPING"


def test_engines_use_grpc_when_the_lane_is_off(daemons: Any) -> None:
    d = daemons("nolane", "--set", "engine_lane=false")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        assert tx.reg.lane_socket == "" and tx.stub.lane is None
        assert not Path(d.socket + ".lane").exists()
        tx.enqueue(1, 0, 0, 8, tx.acquire(8), last=True)
        assert tx.poll(1).state.name == "BOOTSTRAPPING"


@pytest.mark.skipif(not _private_huge_possible(), reason="this kernel or container refuses a private tmpfs mount")
def test_the_pool_is_handed_out_by_fd_on_huge_pages_and_leaves_nothing(daemons: Any, tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    d = daemons("hp", "--set", f"shm_dir={shm}", pool="16MiB")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        st = tx.status()
        assert st.pool_backing == "private-huge-tmpfs"
        assert st.pool_huge_bytes == st.pool_bytes == 16 << 20  # prefaulted, all on 2 MiB pages
        assert tx.reg.pool_path == "" and tx.reg.pool_socket == d.socket + ".pool"
        assert os.listdir(shm) == []  # named nowhere
        # What the engine writes into its slot is what the daemon's mapping holds: one file.
        slot = tx.acquire(8)
        pattern = np.random.default_rng(1).integers(0, 255, slot.chunk_bytes, dtype=np.uint8)
        tx.view(slot.offset, slot.chunk_bytes)[:] = pattern.tobytes()
        with DecodeReceiver(socket=d.socket, group="h", layout=LAYOUT, ring_bytes=1 << 20) as rx:
            rx.expect(5, d.peer_address, "g", 8)
            tx.enqueue(5, 0, 0, 8, slot, last=True)
            got, _ = rx.receive(5, timeout=30)
            assert got[0] == pattern.tobytes()
        # The pool socket checks nothing the engine must not know: its header names the pool.
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(tx.reg.pool_socket)
            msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
        try:
            header = json.loads(msg)
            assert header == {"protocol": "kvxferd-pool/1", "instance": tx.engine_id.split("@")[1],
                              "bytes": 16 << 20}
            assert os.fstat(fds[0]).st_size == 16 << 20
        finally:
            for fd in fds:
                os.close(fd)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    for suffix in ("", ".pool", ".lane", ".lock"):
        assert not Path(d.socket + suffix).exists(), suffix
    assert os.listdir(shm) == []


def test_pool_backing_shm_dir_keeps_a_named_file(daemons: Any, tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    d = daemons("named", "--set", f"shm_dir={shm}", "--set", "pool_backing=shm_dir", pool="8MiB")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        assert tx.status().pool_backing == "tmpfs" and tx.reg.pool_socket == ""
        assert Path(tx.reg.pool_path).parent == shm and not Path(d.socket + ".pool").exists()
        tx.view(0, 4)[:] = b"kvx!"
        with open(tx.reg.pool_path, "rb") as fh:
            fh.seek(tx.reg.ring_offset)
            assert fh.read(4) == b"kvx!"


def test_a_bad_pool_backing_is_refused(daemons: Any) -> None:
    d = daemons("badbacking", "--set", "pool_backing=ramdisk", wait=False)
    assert d.proc.wait(30) == 2
    assert "pool_backing must be one of auto, private, shm_dir" in d.log_text()


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_room_events_arrive_over_the_lane_or_grpc_alike(daemons: Any, lane: bool) -> None:
    """WatchRooms over the lane (the default) and over gRPC deliver the same events; cancel() from
    another thread ends either."""
    import threading

    from kvxfer_client._lane import LaneStream

    d = daemons("watch", "--set", f"engine_lane={str(lane).lower()}")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:
        stream = tx.watch()
        assert isinstance(stream._stream, LaneStream) is lane
        got: list[Any] = []
        reader = threading.Thread(target=lambda: got.extend(stream), daemon=True)
        reader.start()
        time.sleep(0.3)  # subscribed
        tx.enqueue(3, 0, 0, 8, tx.acquire(8), last=True)
        tx.abort(3, "test abort")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e.state.name == "FAILED" for e in got):
            time.sleep(0.02)
        stream.cancel()
        reader.join(5)
        assert not reader.is_alive()
        failed = [e for e in got if e.room == 3 and e.state.name == "FAILED"]
        assert len(failed) == 1 and "test abort" in failed[0].failure_reason, got


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
async def test_async_clients_watch_over_the_lane_or_grpc_alike(daemons: Any, lane: bool) -> None:
    """The asyncio client's watch: the same events over either transport; leaving the loop ends it."""
    import asyncio

    from kvxfer_client import AsyncPrefillSender

    d = daemons("awatch", "--set", f"engine_lane={str(lane).lower()}")
    tx = await AsyncPrefillSender.create(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20)
    try:
        got: list[Any] = []

        async def follow() -> None:
            async for ev in tx.watch():
                got.append(ev)
                if ev.room == 3 and ev.state.name == "FAILED":
                    return

        task = asyncio.ensure_future(follow())
        await asyncio.sleep(0.3)  # subscribed
        assert [c.used for c in (await tx.status()).caps if c.name == "open_streams"] == [1]
        await tx.enqueue(3, 0, 0, 8, await tx.acquire(8), last=True)
        await tx.abort(3, "test abort")
        await asyncio.wait_for(task, 10)
        failed = [e for e in got if e.room == 3 and e.state.name == "FAILED"]
        assert len(failed) == 1 and "test abort" in failed[0].failure_reason, got
        # The stream is gone from the daemon once the loop left it: no watcher stays counted.
        for _ in range(50):
            if not [c for c in (await tx.status()).caps if c.name == "open_streams" and c.used]:
                break
            await asyncio.sleep(0.05)
        assert not [c for c in (await tx.status()).caps if c.name == "open_streams" and c.used]
    finally:
        await tx.close()


def test_a_dropped_watch_frees_its_connection_and_the_daemons_stream(daemons: Any) -> None:
    import gc

    d = daemons("dropw")
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=1 << 20) as tx:

        def open_streams() -> list[int]:
            return [c.used for c in tx.status().caps if c.name == "open_streams"]

        w = tx.watch()
        time.sleep(0.3)  # subscribed
        assert open_streams() == [1] and len(tx.stub.lane._streams) == 1
        del w
        gc.collect()
        assert len(tx.stub.lane._streams) == 0
        deadline = time.monotonic() + 5
        while open_streams() != [0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert open_streams() == [0]


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_a_large_batched_enqueue_is_pipelined_on_the_lane_and_answers_per_chunk(
    daemons: Any, lane: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """enqueue_many of 300 chunks: over the lane it leaves as pipelined calls of PIPELINE_PART
    chunks (over gRPC, one call); either way each chunk gets its own answer at its own index, in
    order, and the daemon holds exactly the accepted chunks."""
    from kvxfer_client import Chunk
    from kvxfer_client._lane import SyncLane
    from kvxfer_client._requests import PIPELINE_PART
    from kvxfer_protocol.limits import MAX_BATCH_CHUNKS

    d = daemons("batch", "--set", f"engine_lane={str(lane).lower()}")
    calls: list[int] = []
    real = SyncLane.call_pipelined

    def counted(self: SyncLane, name: str, reqs: Any, timeout: float | None = None) -> list[Any]:
        reqs = list(reqs)
        if name == "EnqueueChunks":  # unary calls go through call_pipelined too, one request each
            calls.append(len(reqs))
        return real(self, name, reqs, timeout)

    monkeypatch.setattr(SyncLane, "call_pipelined", counted)
    with PrefillSender(socket=d.socket, group="g", layout=LAYOUT, ring_bytes=8 << 20) as tx:
        slots = [tx.acquire(1) for _ in range(300)]
        chunks = [Chunk(room=100 + i // 30, chunk_id=i % 30, token_start=i % 30, num_tokens=1, slot=s)
                  for i, s in enumerate(slots)]
        # Two refusals in different parts: a chunk id its room already has, and a slot never acquired.
        chunks[70] = Chunk(room=102, chunk_id=9, token_start=9, num_tokens=1, slot=slots[70])
        bogus = type(slots[0])(offset=slots[-1].offset + (1 << 20), length=slots[0].length,
                               chunk_bytes=slots[0].chunk_bytes)
        chunks[250] = Chunk(room=108, chunk_id=10, token_start=10, num_tokens=1, slot=bogus)
        res = tx.enqueue_many(chunks)
        assert calls == ([-(-300 // PIPELINE_PART)] if lane else [])
        assert len(res) == 300
        bad = {i: r for i, r in enumerate(res) if r is not None}
        assert set(bad) == {70, 250}, bad
        assert bad[70].code == grpc.StatusCode.ALREADY_EXISTS
        assert bad[250].code == grpc.StatusCode.INVALID_ARGUMENT and "not a slot this engine acquired" in bad[250].message
        for room in range(100, 110):
            assert tx.poll(room).state.name == "BOOTSTRAPPING"
        # The daemon holds what it accepted (its slots are no longer ours to enqueue) and nothing it
        # refused: the refused chunk's slot is still ours and fills room 108's gap.
        again = tx.enqueue_many([chunks[0], chunks[299]])
        assert all(r is not None and r.code == grpc.StatusCode.INVALID_ARGUMENT and "already enqueued" in r.message
                   for r in again), again
        assert tx.enqueue_many([Chunk(room=108, chunk_id=10, token_start=10, num_tokens=1, slot=slots[70])]) == [None]
        # More than the daemon takes in one call is refused before anything is sent.
        with pytest.raises(KvxferError) as exc:
            tx.enqueue_many([chunks[0]] * (MAX_BATCH_CHUNKS + 1))
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
        if lane:
            # A call the daemon refuses as a whole answers at its own place; the others still go.
            ok = engine_pb2.EnqueueChunksRequest(chunks=[])
            too_many = engine_pb2.EnqueueChunksRequest(chunks=[engine_pb2.EnqueueChunkRequest()] * (MAX_BATCH_CHUNKS + 1))
            out = real(tx.stub.lane, "EnqueueChunks", [ok, too_many, ok], 10)
            assert isinstance(out[0], engine_pb2.EnqueueChunksReply) and isinstance(out[2], engine_pb2.EnqueueChunksReply)
            assert isinstance(out[1], KvxferError) and out[1].code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_events_come_in_batches_and_watermarks_of_many_rooms_go_in_one_call(daemons: Any, lane: bool) -> None:
    """Three rooms move over real NIXL while nobody reads the decode engine's events. batches()
    then hands over what had arrived together (over the lane, every event at once; over gRPC, one
    per list), the landed bytes are the sent ones, and watermark_many answers each room on its
    own: a bad entry is refused with its own error and changes nothing, good ones take effect."""
    flag = f"engine_lane={str(lane).lower()}"
    pre, dec = daemons("wm-pre", "--set", flag), daemons("wm-dec", "--set", flag)
    tokens = 8
    token_bytes = 2 * LAYOUT.num_layers * LAYOUT.total_kv_heads * LAYOUT.head_dim * LAYOUT.dtype_bytes
    with PrefillSender(socket=pre.socket, group="wp", layout=LAYOUT, ring_bytes=1 << 20) as tx, \
            DecodeReceiver(socket=dec.socket, group="wd", layout=LAYOUT, ring_bytes=1 << 20) as rx:
        stream = rx.watch()
        time.sleep(0.3)  # subscribed
        sent: dict[tuple[int, int], bytes] = {}
        for room in (1, 2, 3):
            rx.expect(room, pre.peer_address, "wp", 2 * tokens)
        for room in (1, 2, 3):
            deadline = time.monotonic() + 20
            while rx.poll(room).state.name != "WAITING_FOR_INPUT" and time.monotonic() < deadline:
                time.sleep(0.02)
            for cid in (0, 1):
                data = os.urandom(tokens * token_bytes)
                tx.send_chunk(room, cid, cid * tokens, tokens, data, last=cid == 1)
                sent[(room, cid)] = data
        for room in (1, 2, 3):
            deadline = time.monotonic() + 20
            while rx.poll(room).state.name != "SUCCESS" and time.monotonic() < deadline:
                time.sleep(0.02)
            assert rx.poll(room).state.name == "SUCCESS"
        events: list[Any] = []
        sizes: list[int] = []
        for batch in stream.batches():
            sizes.append(len(batch))
            events += batch
            if sum(e.state.name == "SUCCESS" for e in events) == 3:
                break
        stream.cancel()
        landed = {(e.room, e.landed.chunk_id): e.landed for e in events if e.landed is not None}
        assert set(landed) == set(sent)
        for key, chunk in landed.items():
            assert bytes(rx.read(chunk)) == sent[key], key
        if lane:
            assert sizes == [len(events)], sizes  # all had arrived: one list
        else:
            assert set(sizes) == {1}, sizes

        res = rx.watermark_many([(1, [0, 1]), (2, [0]), (99, [0])])
        assert res[:2] == [None, None], res
        assert isinstance(res[2], KvxferError) and res[2].code == grpc.StatusCode.NOT_FOUND, res
        # Room 2's second entry names chunk 0 again: refused whole, so chunk 1 is still unconsumed.
        again = rx.watermark_many([(1, [0], 0), (2, [1, 0], 0), (3, [0, 1], 0)])
        assert [e.code if e else None for e in again] == [
            grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.ALREADY_EXISTS, None], again
        rx.watermark(2, [1])
        with pytest.raises(KvxferError) as twice:
            rx.watermark(3, [1])
        assert twice.value.code == grpc.StatusCode.ALREADY_EXISTS
