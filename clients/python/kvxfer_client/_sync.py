"""Blocking client: PrefillSender and DecodeReceiver."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc

from kvxfer_client._claims import ClaimRing, merge_batch, split_batch
from kvxfer_client._common import (
    MAX_BATCH_CHUNKS,
    PIPELINE_PART,
    RING_READY_TIMEOUT_S,
    Chunk,
    ChunkRefused,
    KvxferError,
    Landed,
    Layout,
    PoolMapping,
    Registration,
    RoomEvent,
    RoomFailed,
    RoomState,
    RoomStatus,
    Slot,
    SpareSlot,
    Tls,
    acquire_request,
    bytes_tensor,
    chunk_request,
    chunks_request,
    enqueue_results,
    export_ring,
    register_request,
    registration,
    room_event,
    room_pb,
    room_status,
    still_pending,
    sync_channel,
    watermark_request,
    wrap_rpc_error,
)
from kvxfer_client._lane import SyncLane
from kvxfer_client._pb.kvxfer.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from kvxfer_client._pinned import check_can_pin, gpu_ring_for
from kvxfer_client._stub import RoutedStub
from kvxfer_client._verdicts import Verdicts

_RETRYABLE_FULL = grpc.StatusCode.RESOURCE_EXHAUSTED



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
        claim_slots: bool = False,
    ) -> None:
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
            claim_slots=claim_slots,
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

    def watch(self, chunk_progress: bool = False) -> EventStream:
        """Events for every room of this engine, as they happen (server stream).

        chunk_progress: a sending engine also hears each chunk it sent being written
        (RoomEvent.chunks_done); without it, only state changes, once each. The stream ends when
        it is cancelled (from any thread) or dropped.
        """
        req = engine_pb2.WatchRoomsRequest(engine_id=self.engine_id, chunk_progress=chunk_progress)
        lane = self.stub.lane
        if isinstance(lane, SyncLane):
            return EventStream(lane.stream("WatchRooms", req, engine_pb2.RoomEvent, self._timeout))
        return EventStream(self.stub.WatchRooms(req))

    def abort(self, room: int, reason: str = "", generation: int = 0) -> None:
        self._call(self.stub.AbortRoom, engine_pb2.AbortRoomRequest(
            engine_id=self.engine_id, room=room_pb(room, generation), reason=reason))

    def release(self, room: int, generation: int = 0) -> None:
        self._call(self.stub.ReleaseRoom, engine_pb2.ReleaseRoomRequest(
            engine_id=self.engine_id, room=room_pb(room, generation)))

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


class PrefillSender(_EngineClient):
    """A prefill engine rank: get a slot, write the chunk's KV into it, enqueue, poll."""

    role = engine_pb2.ROLE_PREFILL

    def __init__(self, *, prefetch_slots: bool = True, claim_slots: bool = True, **kwargs: Any) -> None:
        """claim_slots: cut slots out of the ring here, with no call (see ClaimRing), where the
        daemon allows it (a slot ring; an older daemon does not know it). Else, prefetch_slots:
        each enqueue() also asks for a next slot, of the same size (see SpareSlot)."""
        self.spare = SpareSlot(prefetch_slots, depth=2)
        self._verdicts = Verdicts(self.spare)
        super().__init__(claim_slots=claim_slots and not kwargs.get("zero_copy", False), **kwargs)
        self.claims: ClaimRing | None = None
        if self.reg.claim_slots:
            self.claims = ClaimRing(self.reg.ring_bytes, self.reg.slot_align, self.reg.token_bytes)
            self._verdicts.claims = self.claims
            self.spare.enabled = False

    def acquire(self, num_tokens: int, timeout: float = 30.0) -> Slot:
        """A slot for `num_tokens` tokens. With claimed slots: cut out of the ring here (the
        verdicts already here are read first, without waiting: they say which slots the daemon
        let go of); while none fits, the daemon holds an AcquireSlot call until one comes free.
        Else a spare one in hand, or AcquireSlot. Either way no polling, up to `timeout`."""
        self._settle_deferred()
        if self.claims is not None:
            return self._cut(num_tokens, timeout)
        spare, stale = self.spare.take(num_tokens)
        if stale is not None:
            self._release_all([stale])
        if spare is not None:
            return spare
        deadline = time.monotonic() + timeout
        while True:
            req = acquire_request(self.engine_id, num_tokens, deadline, self._timeout)
            try:
                reply = self._call(self.stub.AcquireSlot, req, timeout=req.wait_ms / 1000 + self._timeout)
                return Slot(reply.slot.offset, reply.slot.length, reply.chunk_bytes)
            except KvxferError as exc:
                if exc.code != _RETRYABLE_FULL or time.monotonic() >= deadline:
                    raise

    def _cut(self, num_tokens: int, timeout: float) -> Slot:
        claims = self.claims
        assert claims is not None
        slot = claims.cut(num_tokens)
        deadline = time.monotonic() + timeout
        while slot is None:
            # The daemon holds this call until it let go of a claim (no polling).
            req = claims.wait_request(acquire_request(self.engine_id, num_tokens, deadline, self._timeout))
            try:
                reply = self._call(self.stub.AcquireSlot, req, timeout=req.wait_ms / 1000 + self._timeout)
            except KvxferError as exc:
                claims.retry_or_raise(exc, deadline)
                continue
            slot = claims.freed_then_cut(reply.freed_claims, num_tokens)
        return slot

    def release_slot(self, slot: Slot) -> None:
        """Gives back a slot never enqueued (or whose chunk was refused). A claimed slot goes
        back here, with no call."""
        if slot.claim:
            if self.claims is None:
                raise KvxferError(grpc.StatusCode.FAILED_PRECONDITION, "this client cuts no slots of its own")
            self.claims.release(slot.claim)
            return
        self._call(self.stub.ReleaseSlot, engine_pb2.ReleaseSlotRequest(
            engine_id=self.engine_id, slot=common_pb2.Slot(offset=slot.offset, length=slot.length)))

    def _release_all(self, slots: Sequence[Slot]) -> None:
        """Releases spares; one that fails raises, and leaves the rest for the next call
        (SpareSlot.unreleased)."""
        for i, slot in enumerate(slots):
            try:
                self.release_slot(slot)
            except BaseException as exc:
                self.spare.unreleased(slots, i, exc)
                raise

    def slot_view(self, slot: Slot) -> memoryview:
        return self.view(slot.offset, slot.chunk_bytes)

    def enqueue(
        self, room: int, chunk_id: int, token_start: int, num_tokens: int, slot: Slot | None = None,
        last: bool = False, aux: bytes = b"", generation: int = 0, pages: Sequence[int] = (),
        wait: bool = True,
    ) -> None:
        """Hands a written chunk over: a slot from acquire(), or (zero-copy engines) its pool pages.

        wait=False (over the daemon's lane; over gRPC it waits anyway): returns once the request
        is written, without waiting for the daemon's verdict. The engine then fills its next
        chunk while the daemon takes this one, and a slot for the next chunk comes back with
        the verdict (two are held ahead; acquire() with none in hand asks the daemon rather than
        wait for a verdict). A refused chunk
        is raised as ChunkRefused (its room, chunk and slot; the daemon changed nothing for it
        and the slot is still the engine's) by this thread's next acquire() or enqueue(),
        before that call does anything, or returned by flush(). Every call of this client
        that reads from the lane also reads the verdicts that are there. A chunk that cannot
        be sent at all (no connection to the daemon's lane within the call timeout) raises
        KvxferError at once; the daemon saw nothing of it."""
        c = Chunk(room, chunk_id, token_start, num_tokens, slot, last, aux, generation, tuple(pages))
        self._settle_deferred()
        req = chunk_request(self.engine_id, c)
        lane = self.stub.lane
        claim = slot.claim if slot is not None and self.claims is not None else 0
        if claim:
            self.claims.sent(claim)  # type: ignore[union-attr]
        if not wait and isinstance(lane, SyncLane):
            # send_deferred raises only when nothing was sent (then the ask is settled here);
            # once sent, the verdict or the connection's loss reaches on_reply instead.
            with self.spare.asking(req) as asked, self._unsent_on_raise(claim):
                lane.send_deferred("EnqueueChunk", req, lambda got: self._verdicts.on_reply(c, asked, got),
                                   self._timeout)
            return
        with self.spare.asking(req, depth=1) as asked:
            try:
                reply = self._call(self.stub.EnqueueChunk, req)
            except BaseException as exc:
                if claim:
                    self.claims.failed(claim, exc)  # type: ignore[union-attr]
                raise
        if claim:
            self.claims.verdict(claim, True, reply.freed_claims)  # type: ignore[union-attr]
        extra = self.spare.keep(reply, num_tokens, asked)
        if extra is not None:
            self.release_slot(extra)

    @contextlib.contextmanager
    def _unsent_on_raise(self, claim: int) -> Iterator[None]:
        """Around a deferred send: one that raises sent nothing, and the claim stays the engine's."""
        try:
            yield
        except BaseException:
            if claim:
                self.claims.unsent(claim)  # type: ignore[union-attr]
            raise

    def flush(self, timeout: float | None = None) -> list[ChunkRefused]:
        """Waits for the daemon's verdict on every chunk this thread sent with enqueue(wait=False)
        and returns the refusals not raised yet, oldest first (an engine that sends a batch
        of chunks this way and flushes once learns every verdict for one round trip). A daemon
        that stays silent for `timeout` (the call timeout by default) or goes away refuses
        what is outstanding with DEADLINE_EXCEEDED or UNAVAILABLE."""
        lane = self.stub.lane
        if isinstance(lane, SyncLane):
            lane.wait_deferred(timeout or self._timeout)
        return self._verdicts.take()

    def settle(self) -> list[ChunkRefused]:
        """The refusals among the verdicts already here for this thread's enqueue(wait=False)
        chunks, oldest first, without waiting for the others (flush() waits for them all): an
        engine that checks once per scheduler step learns of a refused chunk without a round trip."""
        self._read_verdicts()
        return self._verdicts.take()

    def _settle_deferred(self) -> None:
        """Reads the verdicts that are already here, gives back surplus spares, raises a refusal."""
        self._read_verdicts()
        self._verdicts.raise_oldest()

    def _read_verdicts(self) -> None:
        """Reads, without waiting, the verdicts already here; gives back the spares they made surplus."""
        lane = self.stub.lane
        if isinstance(lane, SyncLane):
            lane.poll_deferred()  # returns at once when nothing was sent without waiting
        surplus = self.spare.surplus()
        if surplus:
            self._release_all(surplus)

    def close(self, unregister: bool = True) -> None:
        lane = self.stub.lane
        if isinstance(lane, SyncLane) and not self._closed.is_set():
            lane.wait_deferred(self._timeout)  # what was sent goes in before the engine leaves
        spares = self.spare.drop()
        if not unregister and not self._closed.is_set():
            for spare in spares:
                try:
                    self.release_slot(spare)
                except KvxferError:
                    break  # the daemon frees it with the engine's lease anyway
        super().close(unregister)

    def enqueue_many(self, chunks: Sequence[Chunk]) -> list[KvxferError | None]:
        """Many chunks at once; returns None per accepted chunk, else its error.

        Over the lane, a large batch goes as several calls pipelined on one connection (the
        daemon accepts the first part while the next is serialised), in order; over gRPC, as one
        EnqueueChunks call. A part the daemon refuses as a whole (it is draining, say) gives each
        of its chunks that error."""
        lane = self.stub.lane
        if len(chunks) > MAX_BATCH_CHUNKS:
            raise KvxferError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"at most {MAX_BATCH_CHUNKS} chunks per call, got {len(chunks)}")
        claims = self.claims
        if claims is None:
            return self._enqueue_batch(chunks, lane)
        tags, errors, send = split_batch(claims, chunks)
        try:
            got = self._enqueue_batch(chunks if send is None else [chunks[i] for i in send], lane) if send != [] else []
        except BaseException as exc:
            merge_batch(claims, tags, errors, send, exc)
            raise
        return merge_batch(claims, tags, errors, send, got)

    def _enqueue_batch(self, chunks: Sequence[Chunk], lane: Any) -> list[KvxferError | None]:
        if not isinstance(lane, SyncLane) or len(chunks) < 2 * PIPELINE_PART:
            reply = self._call(self.stub.EnqueueChunks, chunks_request(self.engine_id, chunks))
            self._batch_freed([reply])
            return enqueue_results(reply)
        eid = self.engine_id
        parts = [chunks[i:i + PIPELINE_PART] for i in range(0, len(chunks), PIPELINE_PART)]
        replies = lane.call_pipelined("EnqueueChunks", (
            chunks_request(eid, part) for part in parts
        ), self._timeout)
        self._batch_freed(replies)
        out: list[KvxferError | None] = []
        for part, reply in zip(parts, replies, strict=True):
            out += [reply] * len(part) if isinstance(reply, KvxferError) else enqueue_results(reply)
        return out

    def _batch_freed(self, replies: Sequence[Any]) -> None:
        """The claims the daemon let go of, which a batch reply carries in its first result."""
        if self.claims is not None:
            for reply in replies:
                if not isinstance(reply, KvxferError) and reply.results and reply.results[0].freed_claims:
                    self.claims.freed(reply.results[0].freed_claims)

    def send_chunk(
        self, room: int, chunk_id: int, token_start: int, num_tokens: int, data: bytes | memoryview,
        last: bool = False, aux: bytes = b"", generation: int = 0, timeout: float = 30.0, wait: bool = True,
    ) -> Slot:
        """Convenience: acquire a slot, copy `data` (the chunk in slot layout) into it, enqueue.
        A chunk refused at once gives its slot back; with wait=False the refusal comes later
        (see enqueue) with the slot, which is then the engine's to release."""
        slot = self.acquire(num_tokens, timeout)
        mv = memoryview(data).cast("B")
        if mv.nbytes != slot.chunk_bytes:
            self.release_slot(slot)
            raise ValueError(f"chunk data is {mv.nbytes} B; {num_tokens} tokens need {slot.chunk_bytes} B")
        self.slot_view(slot)[:] = mv
        try:
            self.enqueue(room, chunk_id, token_start, num_tokens, slot, last, aux, generation, wait=wait)
        except KvxferError:
            self.release_slot(slot)
            raise
        return slot


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
