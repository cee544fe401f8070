"""asyncio client: AsyncPrefillSender and AsyncDecodeReceiver (same calls as the blocking ones)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import grpc

from kvxfer_client._aio_lane import AioLane
from kvxfer_client._channel import Tls, aio_channel
from kvxfer_client._claims import ClaimRing, merge_batch, split_batch
from kvxfer_client._parts import PartSender, enqueue_layers_aio, seal_part
from kvxfer_client._pinned import check_can_pin, gpu_ring_for
from kvxfer_client._requests import (
    RELEASE_TIMEOUT_S,
    RING_READY_TIMEOUT_S,
    acquire_request,
    chunk_request,
    chunks_request,
    register_request,
    registration,
    retry_full_or_raise,
    room_event,
    room_pb,
    room_status,
    still_pending,
    watch_request,
    watermark_request,
)
from kvxfer_client._rings import PoolMapping, bytes_tensor, export_ring
from kvxfer_client._spare import SpareSlot
from kvxfer_client._stub import RoutedStub
from kvxfer_client._verdicts import Verdicts
from kvxfer_client.errors import ChunkRefused, KvxferError, RoomFailed, enqueue_results, wrap_rpc_error
from kvxfer_client.types import Chunk, Landed, Layout, Registration, RoomEvent, RoomState, RoomStatus, Slot
from kvxfer_protocol.pb.kvxfer.v1 import common_pb2, engine_pb2, engine_pb2_grpc


class _AsyncEngineClient:
    role = 0

    def __init__(self, *, socket: str | None = None, call_timeout: float = 10.0, tls: Tls | None = None) -> None:
        self.layout: Layout | None = None
        self._channel = aio_channel(socket, tls)
        self.stub = RoutedStub(engine_pb2_grpc.EngineStub(self._channel))
        self._timeout = call_timeout
        self.reg: Registration | None = None
        self.pool: PoolMapping | None = None
        self._renewer: asyncio.Task[None] | None = None
        self.ring_tensor: Any = None

    def _registered(self) -> None:
        """What a role sets up once the daemon answered RegisterEngine."""

    @classmethod
    async def create(
        cls, *, group: str, layout: Layout, tp_size: int = 1, tp_rank: int = 0, ring_bytes: int = 64 << 20,
        socket: str | None = None, name: str = "", lease_ms: int = 0, cuda_ring: dict[str, Any] | None = None,
        map_pool: bool = True, call_timeout: float = 10.0, ring_tensor: Any = None,
        zero_copy: bool = False, kv_device: str = "", pin_host: bool = False, tls: Tls | None = None,
        claim_slots: bool = True, layer_parts: bool = False,
    ) -> Any:
        """claim_slots (prefill engines): cut slots out of the ring in the client, with no call,
        where the daemon allows it (see ClaimRing). layer_parts: as the blocking client's."""
        self = cls(socket=socket, call_timeout=call_timeout, tls=tls)
        self.layout = layout
        # kv_device="cuda:N": the daemon says which staging is fast there, a GPU ring or a pinned host ring.
        pin = pin_host
        if kv_device.startswith("cuda") and ring_tensor is None and cuda_ring is None and not pin_host:
            ring_tensor = gpu_ring_for(kv_device, (await self.status()).gpu_data_path, ring_bytes)
            pin = ring_tensor is None
        if pin:
            check_can_pin()
        self.ring_tensor = ring_tensor
        if ring_tensor is not None and cuda_ring is None:
            cuda_ring = export_ring(ring_tensor)
        req = register_request(
            self.role, group, layout, tp_size, tp_rank, ring_bytes, name, lease_ms, cuda_ring, zero_copy=zero_copy,
            claim_slots=claim_slots and self.role == engine_pb2.ROLE_PREFILL, layer_parts=layer_parts,
        )
        deadline = time.monotonic() + RING_READY_TIMEOUT_S
        reply = await self._call(self.stub.RegisterEngine, req)
        while still_pending(req, reply, deadline):
            reply = await self._call(self.stub.RegisterEngine, req)
        self.reg = registration(reply)
        self._registered()
        if self.reg.lane_socket:
            self.stub.lane = AioLane(self.reg.lane_socket)
        if map_pool and cuda_ring is None:
            # Off the loop: receiving the pool may wait on the daemon (an in-process daemon serves
            # it on this very loop), and pinning a large mapping takes a while.
            self.pool = await asyncio.get_running_loop().run_in_executor(None, PoolMapping, self.reg, pin)
        self._renewer = asyncio.ensure_future(self._renew())
        return self

    @property
    def engine_id(self) -> str:
        assert self.reg is not None
        return self.reg.engine_id

    @property
    def peer_address(self) -> str:
        assert self.reg is not None
        return self.reg.peer_address

    async def _call(self, fn: Any, req: Any, timeout: float | None = None) -> Any:
        try:
            return await fn(req, timeout=timeout or self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise wrap_rpc_error(exc) from None

    async def _renew(self) -> None:
        assert self.reg is not None
        period = max(0.05, self.reg.lease_ms / 3000)
        while True:
            await asyncio.sleep(period)
            try:
                await self.stub.KeepAlive(engine_pb2.KeepAliveRequest(engine_id=self.engine_id), timeout=period)
            except (grpc.aio.AioRpcError, KvxferError):
                continue

    def view(self, offset: int, length: int) -> memoryview:
        if self.pool is None:
            raise RuntimeError("this engine's ring is not a host ring mapped here")
        return self.pool.view(offset, length)

    def tensor(self, offset: int, length: int) -> Any:
        """uint8 torch tensor over part of this engine's ring (GPU ring or mapped host ring)."""
        return bytes_tensor(self.ring_tensor, self.pool, offset, length)

    async def poll(self, room: int, generation: int = 0) -> RoomStatus:
        return room_status(await self._call(
            self.stub.PollRoom, engine_pb2.PollRoomRequest(engine_id=self.engine_id, room=room_pb(room, generation))))

    async def wait(self, room: int, timeout: float = 60.0, generation: int = 0, poll_s: float = 0.002) -> RoomStatus:
        deadline = time.monotonic() + timeout
        delay = poll_s / 4
        while True:
            st = await self.poll(room, generation)
            if st.state is RoomState.FAILED:
                raise RoomFailed(room, st.failure_code, st.failure_reason)
            if st.state is RoomState.SUCCESS:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"room {room} still {st.state.name} after {timeout} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, poll_s)

    async def watch(self, chunk_progress: bool = False, layer_progress: bool = False) -> AsyncIterator[RoomEvent]:
        """Events for every room of this engine (see the sync client's watch); over the lane when
        the daemon offers one."""
        req = watch_request(self.engine_id, chunk_progress, layer_progress)
        lane = self.stub.lane
        if isinstance(lane, AioLane):
            async for pb in lane.stream("WatchRooms", req, engine_pb2.RoomEvent):
                yield room_event(pb)
            return
        call = self.stub.WatchRooms(req)
        try:
            async for ev in call:
                yield room_event(ev)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise wrap_rpc_error(exc) from None
        finally:
            call.cancel()

    async def abort(self, room: int, reason: str = "", generation: int = 0) -> None:
        await self._call(self.stub.AbortRoom, engine_pb2.AbortRoomRequest(
            engine_id=self.engine_id, room=room_pb(room, generation), reason=reason))

    async def release(self, room: int, generation: int = 0) -> None:
        await self._call(self.stub.ReleaseRoom, engine_pb2.ReleaseRoomRequest(
            engine_id=self.engine_id, room=room_pb(room, generation)), max(self._timeout, RELEASE_TIMEOUT_S))

    async def status(self) -> engine_pb2.DaemonStatus:
        return await self._call(self.stub.GetStatus, engine_pb2.GetStatusRequest())

    async def close(self, unregister: bool = True) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None
        if unregister and self.reg is not None:
            try:
                await self.stub.UnregisterEngine(
                    engine_pb2.UnregisterEngineRequest(engine_id=self.engine_id), timeout=2)
            except (grpc.aio.AioRpcError, KvxferError):
                pass
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if isinstance(self.stub.lane, AioLane):
            await self.stub.lane.close()
        await self._channel.close()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncPrefillSender(_AsyncEngineClient):
    role = engine_pb2.ROLE_PREFILL

    def __init__(self, *, socket: str | None = None, call_timeout: float = 10.0, tls: Tls | None = None) -> None:
        super().__init__(socket=socket, call_timeout=call_timeout, tls=tls)
        # Each enqueue() also asks for the next slot, of the same size (see SpareSlot); set
        # `spare.enabled = False` to turn that off. Two are held for enqueue(wait=False).
        self.spare = SpareSlot(True, depth=2)
        self._verdicts = Verdicts(self.spare)
        self.claims: ClaimRing | None = None

    def _registered(self) -> None:
        assert self.reg is not None
        if self.reg.claim_slots:
            self.claims = ClaimRing(self.reg.ring_bytes, self.reg.slot_align, self.reg.token_bytes)
            self._verdicts.claims = self.claims
            self.spare.enabled = False
        assert self.layout is not None
        self._parts = PartSender(self.layout, self.claims)

    async def acquire(self, num_tokens: int, timeout: float = 30.0) -> Slot:
        """A slot for `num_tokens` tokens: with claimed slots cut out of the ring here, else a
        spare or AcquireSlot; while the ring is full the daemon holds an AcquireSlot call until
        a transfer frees space (no polling), up to `timeout`."""
        await self._settle_deferred()
        if self.claims is not None:
            return await self._cut(self.claims, num_tokens, timeout)
        spare, stale = self.spare.take(num_tokens)
        if stale is not None:
            await self._release_all([stale])
        if spare is not None:
            return spare
        deadline = time.monotonic() + timeout
        while True:
            req = acquire_request(self.engine_id, num_tokens, deadline, self._timeout)
            try:
                reply = await self._call(self.stub.AcquireSlot, req, timeout=req.wait_ms / 1000 + self._timeout)
                return Slot(reply.slot.offset, reply.slot.length, reply.chunk_bytes)
            except KvxferError as exc:
                retry_full_or_raise(exc, deadline)

    async def _cut(self, claims: ClaimRing, num_tokens: int, timeout: float) -> Slot:
        slot = claims.cut(num_tokens)
        deadline = time.monotonic() + timeout
        while slot is None:
            # The daemon holds this call until it let go of a claim (no polling).
            req = claims.wait_request(acquire_request(self.engine_id, num_tokens, deadline, self._timeout))
            try:
                reply = await self._call(self.stub.AcquireSlot, req, timeout=req.wait_ms / 1000 + self._timeout)
            except KvxferError as exc:
                retry_full_or_raise(exc, deadline)
                continue
            slot = claims.freed_then_cut(reply.freed_claims, num_tokens)
        return slot

    async def release_slot(self, slot: Slot) -> None:
        """Gives back a slot never enqueued (or whose chunk was refused); a claimed one with no call."""
        if slot.claim:
            if self.claims is None:
                raise KvxferError(grpc.StatusCode.FAILED_PRECONDITION, "this client cuts no slots of its own")
            self.claims.release(slot.claim)
            return
        await self._call(self.stub.ReleaseSlot, engine_pb2.ReleaseSlotRequest(
            engine_id=self.engine_id, slot=common_pb2.Slot(offset=slot.offset, length=slot.length)))

    async def _release_all(self, slots: Sequence[Slot]) -> None:
        """Releases spares; one that fails raises, and leaves the rest for the next call
        (SpareSlot.unreleased)."""
        for i, slot in enumerate(slots):
            try:
                await self.release_slot(slot)
            except BaseException as exc:
                self.spare.unreleased(slots, i, exc)
                raise

    def slot_view(self, slot: Slot) -> memoryview:
        return self.view(slot.offset, slot.chunk_bytes)

    async def enqueue(
        self, room: int, chunk_id: int, token_start: int, num_tokens: int, slot: Slot | None = None,
        last: bool = False, aux: bytes = b"", generation: int = 0, pages: Sequence[int] = (),
        wait: bool = True,
    ) -> None:
        """Hands a written chunk over: a slot from acquire(), or (zero-copy engines) its pool pages.

        wait=False (over the daemon's lane; over gRPC it waits anyway): returns once the request
        is written, without waiting for the daemon's verdict, as PrefillSender.enqueue does. A
        refused chunk is raised as ChunkRefused (the daemon changed nothing for it; its slot is
        still the engine's) by the next acquire() or enqueue(), before that call does anything,
        or returned by settle() (verdicts already here) or flush() (waits for them all)."""
        c = Chunk(room, chunk_id, token_start, num_tokens, slot, last, aux, generation, tuple(pages))
        await self._settle_deferred()
        req = chunk_request(self.engine_id, c)
        lane = self.stub.lane
        claims = self.claims
        claim = slot.claim if slot is not None and claims is not None else 0
        if claim:
            claims.sent(claim)  # type: ignore[union-attr]
            try:
                await self._enqueue(c, req, lane, wait)
            except BaseException as exc:
                claims.failed(claim, exc)  # type: ignore[union-attr]
                raise
            return
        await self._enqueue(c, req, lane, wait)

    async def _enqueue(self, c: Chunk, req: engine_pb2.EnqueueChunkRequest, lane: Any, wait: bool) -> None:
        if not wait and isinstance(lane, AioLane):
            # send_deferred raises only when nothing was sent (then the ask is settled here);
            # once sent, the verdict or the connection's loss reaches on_reply instead.
            # A verdict given up on (flush's timeout) that comes after all may bring a spare slot:
            # on_late gives it back rather than leave it the engine's until it unregisters.
            with self.spare.asking(req) as asked:
                await lane.send_deferred("EnqueueChunk", req, lambda got: self._verdicts.on_reply(c, asked, got),
                                         self._timeout, on_late=self._verdicts.on_late)
            return
        with self.spare.asking(req, depth=1) as asked:
            reply = await self._call(self.stub.EnqueueChunk, req)
        if req.claim:
            self.claims.verdict(req.claim, True, reply.freed_claims)  # type: ignore[union-attr]
        extra = self.spare.keep(reply, c.num_tokens, asked)
        if extra is not None:
            await self.release_slot(extra)

    async def enqueue_layers(self, parts: Sequence[Chunk], wait: bool = True) -> list[KvxferError | None]:
        """Layer parts of any rooms in one call; see PrefillSender.enqueue_layers."""
        return await enqueue_layers_aio(self, self._parts, parts, wait)

    async def seal(self, room: int, chunk_id: int, token_start: int, num_tokens: int, layer_group: int,
                   aux: bytes = b"", generation: int = 0, wait: bool = True) -> None:
        """Closes a room's last layer-wise chunk; see PrefillSender.seal."""
        assert self.layout is not None
        part = seal_part(self.layout, room, chunk_id, token_start, num_tokens, layer_group, aux, generation)
        err = (await self.enqueue_layers([part], wait))[0]
        if err is not None:
            raise err

    async def flush(self, timeout: float | None = None) -> list[ChunkRefused]:
        """Waits for the daemon's verdict on every chunk sent with enqueue(wait=False) and returns
        the refusals not raised yet, oldest first. A daemon silent for `timeout` (the call timeout
        by default) or gone refuses what is outstanding with DEADLINE_EXCEEDED or UNAVAILABLE
        (`lost`: the chunk may have been taken; the room's events say)."""
        lane = self.stub.lane
        if isinstance(lane, AioLane):
            await lane.wait_deferred(timeout or self._timeout)
        return await self.settle()

    async def settle(self) -> list[ChunkRefused]:
        """The refusals among the verdicts already here, oldest first, without waiting for the
        others: an engine that checks once per step learns of a refused chunk without a round trip."""
        await self._give_back_surplus()
        return self._verdicts.take() + self._parts.refusals.take()

    async def _give_back_surplus(self) -> None:
        await self._release_all(self.spare.surplus())

    async def _settle_deferred(self) -> None:
        """Gives back surplus spares and raises the oldest refusal not raised yet."""
        await self._give_back_surplus()
        self._verdicts.raise_oldest()

    async def close(self, unregister: bool = True) -> None:
        lane = self.stub.lane
        if isinstance(lane, AioLane):
            await lane.wait_deferred(self._timeout)  # what was sent goes in before the engine leaves
        spares = self.spare.drop()
        if not unregister and self.reg is not None:
            for spare in spares:
                try:
                    await self.release_slot(spare)
                except KvxferError:
                    pass  # the daemon frees it with the engine's lease anyway
        await super().close(unregister)

    async def enqueue_many(self, chunks: list[Chunk]) -> list[KvxferError | None]:
        claims = self.claims
        if claims is None:
            return enqueue_results(await self._call(self.stub.EnqueueChunks, chunks_request(self.engine_id, chunks)))
        tags, errors, send = split_batch(claims, chunks)
        if send == []:
            return errors
        try:
            reply = await self._call(self.stub.EnqueueChunks, chunks_request(
                self.engine_id, chunks if send is None else [chunks[i] for i in send]))
        except BaseException as exc:
            merge_batch(claims, tags, errors, send, exc)
            raise
        freed = reply.results[0].freed_claims if reply.results else ()
        return merge_batch(claims, tags, errors, send, enqueue_results(reply), freed)

    async def send_chunk(
        self, room: int, chunk_id: int, token_start: int, num_tokens: int, data: bytes | memoryview,
        last: bool = False, aux: bytes = b"", generation: int = 0, timeout: float = 30.0,
    ) -> Slot:
        slot = await self.acquire(num_tokens, timeout)
        mv = memoryview(data).cast("B")
        if mv.nbytes != slot.chunk_bytes:
            await self.release_slot(slot)
            raise ValueError(f"chunk data is {mv.nbytes} B; {num_tokens} tokens need {slot.chunk_bytes} B")
        self.slot_view(slot)[:] = mv
        try:
            await self.enqueue(room, chunk_id, token_start, num_tokens, slot, last, aux, generation)
        except KvxferError:
            await self.release_slot(slot)
            raise
        return slot


class AsyncDecodeReceiver(_AsyncEngineClient):
    role = engine_pb2.ROLE_DECODE

    async def expect(
        self, room: int, prefill_address: str, prefill_group: str, num_tokens: int, deadline_ms: int = 0,
        generation: int = 0, pages: Sequence[int] = (),
    ) -> RoomState:
        reply = await self._call(self.stub.ExpectRoom, engine_pb2.ExpectRoomRequest(
            engine_id=self.engine_id, room=room_pb(room, generation), prefill_address=prefill_address,
            prefill_group=prefill_group, num_tokens=num_tokens, deadline_ms=deadline_ms,
            pages=list(pages)))
        return RoomState(reply.state)

    def read(self, chunk: Landed) -> memoryview:
        return self.view(chunk.offset, chunk.chunk_bytes)

    async def watermark(self, room: int, chunk_ids: Iterable[int], generation: int = 0) -> None:
        await self._call(self.stub.Watermark, watermark_request(self.engine_id, room, chunk_ids, generation))

    async def watermark_many(self, marks: Sequence[tuple[int, Iterable[int]] | tuple[int, Iterable[int], int]]
                             ) -> list[KvxferError | None]:
        """Watermarks of several rooms at once (pipelined on the lane); None per accepted entry,
        else its error, in order (see the blocking client's watermark_many)."""

        async def one(req: engine_pb2.WatermarkRequest) -> KvxferError | None:
            try:
                await self._call(self.stub.Watermark, req)
            except KvxferError as exc:
                return exc
            return None

        return list(await asyncio.gather(*(one(watermark_request(self.engine_id, *m)) for m in marks)))

    async def receive(
        self, room: int, timeout: float = 60.0, generation: int = 0
    ) -> tuple[dict[int, bytes], RoomStatus]:
        got: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            st = await self.poll(room, generation)
            fresh = [c for c in st.landed if c.chunk_id not in got]
            for c in fresh:
                got[c.chunk_id] = bytes(self.read(c))
            if fresh:
                await self.watermark(room, [c.chunk_id for c in fresh], generation)
                delay = 0.0005
            if st.state is RoomState.FAILED:
                raise RoomFailed(room, st.failure_code, st.failure_reason)
            if st.state is RoomState.SUCCESS and not fresh:
                return got, st
            if time.monotonic() > deadline:
                raise TimeoutError(f"room {room} still {st.state.name} after {timeout} s")
            if not fresh:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.005)


async def async_daemon_status(socket: str | None = None, tls: Tls | None = None,
                              timeout: float = 5.0) -> engine_pb2.DaemonStatus:
    """The daemon's GetStatus (engines, peers, rooms, caps), without registering an engine."""
    async with aio_channel(socket, tls) as ch:
        try:
            return await engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise wrap_rpc_error(exc) from None
