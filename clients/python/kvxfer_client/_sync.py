"""Blocking client: the engine connection both roles share, DecodeReceiver and daemon_status
(PrefillSender is in _sync_prefill.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc

from kvxfer_client._channel import Tls, sync_channel
from kvxfer_client._lane import SyncLane
from kvxfer_client._pinned import check_can_pin, gpu_ring_for
from kvxfer_client._requests import (
    RELEASE_TIMEOUT_S,
    RING_READY_TIMEOUT_S,
    register_request,
    registration,
    room_event,
    room_pb,
    room_status,
    still_pending,
    watch_request,
    watermark_request,
)
from kvxfer_client._rings import PoolMapping, bytes_tensor, export_ring
from kvxfer_client._stub import RoutedStub
from kvxfer_client.errors import KvxferError, RoomFailed, wrap_rpc_error
from kvxfer_client.types import Landed, Layout, Registration, RoomEvent, RoomState, RoomStatus
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2, engine_pb2_grpc


class EventStream:
    """RoomEvents of one WatchRooms stream (over the lane, or gRPC): iterate it; cancel() ends it
    from any thread (a generator could only be closed by the thread iterating it)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> RoomEvent:
        try:
            return room_event(next(self._stream))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise wrap_rpc_error(exc) from None

    def batches(self) -> Iterator[list[RoomEvent]]:
        """The events in lists of those that had already arrived together, so that a consumer can
        act once per list (one watermark_many for every chunk in it) instead of once per event.
        Over gRPC (no lane) each list holds one event."""
        ready = getattr(self._stream, "ready", None)
        for ev in self:
            batch = [ev]
            while ready is not None and ready():
                try:
                    batch.append(next(self))
                except StopIteration:
                    break
            yield batch

    def cancel(self) -> None:
        self._stream.cancel()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        # Dropped unfinished (a loop that broke out): the stream and its watcher slot go too.
        self._stream.cancel()

class _EngineClient:
    role = 0

    def __init__(
        self, *, group: str, layout: Layout, tp_size: int = 1, tp_rank: int = 0, ring_bytes: int = 64 << 20,
        socket: str | None = None, name: str = "", lease_ms: int = 0, cuda_ring: dict[str, Any] | None = None,
        map_pool: bool = True, call_timeout: float = 10.0, ring_tensor: Any = None,
        zero_copy: bool = False, kv_device: str = "", pin_host: bool = False, tls: Tls | None = None,
        claim_slots: bool = False, layer_parts: bool = False,
    ) -> None:
        """layer_parts (decode engines, protocol 1.1): this engine scatters group-major slots, so
        its rooms may receive chunks as layer parts (see watch(layer_progress=True))."""
        self._channel = sync_channel(socket, tls)
        self.stub = RoutedStub(engine_pb2_grpc.EngineStub(self._channel))
        self._timeout = call_timeout
        # kv_device="cuda:N": the daemon says which staging is fast there, a GPU ring or a pinned host ring.
        pin = pin_host
        if kv_device.startswith("cuda") and ring_tensor is None and cuda_ring is None and not pin_host:
            ring_tensor = gpu_ring_for(kv_device, self.status().gpu_data_path, ring_bytes)
            pin = ring_tensor is None
        if pin:
            check_can_pin()
        # A GPU staging ring: the engine keeps the tensor, the daemon imports it by IPC handle.
        self.ring_tensor = ring_tensor
        if ring_tensor is not None and cuda_ring is None:
            cuda_ring = export_ring(ring_tensor)
        self.layout = layout
        self.tp_size, self.tp_rank = tp_size, tp_rank
        req = register_request(
            self.role, group, layout, tp_size, tp_rank, ring_bytes, name, lease_ms, cuda_ring, zero_copy=zero_copy,
            claim_slots=claim_slots, layer_parts=layer_parts,
        )
        deadline = time.monotonic() + RING_READY_TIMEOUT_S
        reply = self._call(self.stub.RegisterEngine, req)
        while still_pending(req, reply, deadline):
            reply = self._call(self.stub.RegisterEngine, req)
        self.reg: Registration = registration(reply)
        self.engine_id = self.reg.engine_id
        if self.reg.lane_socket:
            self.stub.lane = SyncLane(self.reg.lane_socket)
        self.pool = PoolMapping(self.reg, pin=pin) if (map_pool and cuda_ring is None) else None
        self._closed = threading.Event()
        # Renew at a third of the lease so one lost renewal is not fatal.
        self._keepalive = threading.Thread(
            target=self._renew, name=f"kvxfer-keepalive-{self.engine_id[:8]}", daemon=True
        )
        self._keepalive.start()

    def _call(self, fn: Any, req: Any, timeout: float | None = None) -> Any:
        try:
            return fn(req, timeout=timeout or self._timeout)
        except grpc.RpcError as exc:
            raise wrap_rpc_error(exc) from None

    def _renew(self) -> None:
        period = max(0.05, self.reg.lease_ms / 3000)
        while not self._closed.wait(period):
            try:
                self.stub.KeepAlive(engine_pb2.KeepAliveRequest(engine_id=self.engine_id), timeout=period)
            except (grpc.RpcError, KvxferError):
                continue

    @property
    def daemon_id(self) -> str:
        return self.reg.daemon_id

    @property
    def peer_address(self) -> str:
        return self.reg.peer_address

    def view(self, offset: int, length: int) -> memoryview:
        if self.pool is None:
            raise RuntimeError("this engine's ring is not a host ring mapped here")
        return self.pool.view(offset, length)

    def tensor(self, offset: int, length: int) -> Any:
        """uint8 torch tensor over part of this engine's ring (GPU ring or mapped host ring)."""
        return bytes_tensor(self.ring_tensor, self.pool, offset, length)

    def poll(self, room: int, generation: int = 0) -> RoomStatus:
        return room_status(self._call(
            self.stub.PollRoom, engine_pb2.PollRoomRequest(engine_id=self.engine_id, room=room_pb(room, generation))
        ))

    def wait(self, room: int, timeout: float = 60.0, generation: int = 0, poll_s: float = 0.002) -> RoomStatus:
        """Polls until the room is finished; raises RoomFailed if it failed, TimeoutError if it takes too long."""
        deadline = time.monotonic() + timeout
        delay = poll_s / 4
        while True:
            st = self.poll(room, generation)
            if st.state is RoomState.FAILED:
                raise RoomFailed(room, st.failure_code, st.failure_reason)
            if st.state is RoomState.SUCCESS:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"room {room} still {st.state.name} after {timeout} s")
            time.sleep(delay)
            delay = min(delay * 2, poll_s)

    def watch(self, chunk_progress: bool = False, layer_progress: bool = False) -> EventStream:
        """Events for every room of this engine, as they happen (server stream).

        chunk_progress: a sending engine also hears each chunk it sent being written
        (RoomEvent.chunks_done); without it, only state changes, once each. layer_progress: a
        decode engine registered with layer_parts also hears each landed layer range of a chunk
        (``landed.layer_start``/``layer_end``; ``landed.chunk_complete`` on the one completing it).
        The stream ends when it is cancelled (from any thread) or dropped.
        """
        req = watch_request(self.engine_id, chunk_progress, layer_progress)
        lane = self.stub.lane
        if isinstance(lane, SyncLane):
            return EventStream(lane.stream("WatchRooms", req, engine_pb2.RoomEvent, self._timeout))
        return EventStream(self.stub.WatchRooms(req))

    def abort(self, room: int, reason: str = "", generation: int = 0) -> None:
        self._call(self.stub.AbortRoom, engine_pb2.AbortRoomRequest(
            engine_id=self.engine_id, room=room_pb(room, generation), reason=reason))

    def release(self, room: int, generation: int = 0) -> None:
        self._call(self.stub.ReleaseRoom, engine_pb2.ReleaseRoomRequest(
            engine_id=self.engine_id, room=room_pb(room, generation)), max(self._timeout, RELEASE_TIMEOUT_S))

    def status(self) -> engine_pb2.DaemonStatus:
        return self._call(self.stub.GetStatus, engine_pb2.GetStatusRequest())

    def close(self, unregister: bool = True) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if unregister:
            try:
                self.stub.UnregisterEngine(engine_pb2.UnregisterEngineRequest(engine_id=self.engine_id), timeout=2)
            except (grpc.RpcError, KvxferError):
                pass
        if self.pool is not None:
            self.pool.close()
        if self.stub.lane is not None:
            self.stub.lane.close()
        self._channel.close()

    def __enter__(self) -> _EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DecodeReceiver(_EngineClient):
    """A decode engine rank: expect a room, read landed chunks, watermark them, release."""

    role = engine_pb2.ROLE_DECODE

    def expect(
        self, room: int, prefill_address: str, prefill_group: str, num_tokens: int, deadline_ms: int = 0,
        generation: int = 0, pages: Sequence[int] = (),
    ) -> RoomState:
        reply = self._call(self.stub.ExpectRoom, engine_pb2.ExpectRoomRequest(
            engine_id=self.engine_id, room=room_pb(room, generation), prefill_address=prefill_address,
            prefill_group=prefill_group, num_tokens=num_tokens, deadline_ms=deadline_ms,
            pages=list(pages)))
        return RoomState(reply.state)

    def read(self, chunk: Landed) -> memoryview:
        """The landed chunk's bytes, in place in the ring (valid until watermarked)."""
        return self.view(chunk.offset, chunk.chunk_bytes)

    def watermark(self, room: int, chunk_ids: Iterable[int], generation: int = 0) -> None:
        self._call(self.stub.Watermark, watermark_request(self.engine_id, room, chunk_ids, generation))

    def watermark_many(self, marks: Sequence[tuple[int, Iterable[int]] | tuple[int, Iterable[int], int]]
                       ) -> list[KvxferError | None]:
        """Watermarks of several rooms, (room, chunk_ids) or (room, chunk_ids, generation) each:
        over the lane they leave in one write and come back in one (one wake-up of the daemon for
        all of them). Returns None per accepted entry, else its error, in order."""
        eid = self.engine_id
        reqs = [watermark_request(eid, *m) for m in marks]
        lane = self.stub.lane
        if isinstance(lane, SyncLane):
            replies = lane.call_pipelined("Watermark", reqs, self._timeout, one_write=True)
            return [r if isinstance(r, KvxferError) else None for r in replies]
        out: list[KvxferError | None] = []
        for req in reqs:
            try:
                self._call(self.stub.Watermark, req)
                out.append(None)
            except KvxferError as exc:
                out.append(exc)
        return out

    def receive(self, room: int, timeout: float = 60.0, generation: int = 0) -> tuple[dict[int, bytes], RoomStatus]:
        """Convenience: copy out every chunk as it lands, watermark it, until SUCCESS.

        Returns ({chunk_id: bytes}, final status). Raises RoomFailed / TimeoutError.
        """
        got: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            st = self.poll(room, generation)
            fresh = [c for c in st.landed if c.chunk_id not in got]
            for c in fresh:
                got[c.chunk_id] = bytes(self.read(c))
            if fresh:
                self.watermark(room, [c.chunk_id for c in fresh], generation)
                delay = 0.0005
            if st.state is RoomState.FAILED:
                raise RoomFailed(room, st.failure_code, st.failure_reason)
            if st.state is RoomState.SUCCESS and not fresh:
                return got, st
            if time.monotonic() > deadline:
                raise TimeoutError(f"room {room} still {st.state.name} after {timeout} s")
            if not fresh:
                time.sleep(delay)
                delay = min(delay * 2, 0.005)


def daemon_status(socket: str | None = None, tls: Tls | None = None, timeout: float = 5.0) -> engine_pb2.DaemonStatus:
    """The daemon's GetStatus (engines, peers, rooms, caps), without registering an engine."""
    with sync_channel(socket, tls) as ch:
        try:
            return engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise wrap_rpc_error(exc) from None
