"""Prefill-side scheduler: admits enqueued chunks, gets destination slots, dispatches to workers.

Every chunk waits on its own (bootstrap, destination slot) without blocking any
other room; a chunk whose destination ring is full is re-tried when the decode
daemon pushes a watermark. Work is sharded by destination peer over the workers
so one slow peer only occupies its own worker.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from typing import TYPE_CHECKING

import grpc

from kvxferd.domain import FailureCode
from kvxferd.layout import HeadSlice, bytes_per_head
from kvxferd.metrics import Metrics
from kvxferd.rooms import DestSlot, OutChunk, SendRoom
from kvxferd.transport import XferState
from kvxferd.workers import TransferJob, WorkerPool

if TYPE_CHECKING:
    from kvxferd.node import Node

logger = logging.getLogger(__name__)

# Fallback re-try for a full destination ring if a watermark push was lost.
_SLOT_RETRY_S = 0.25


class Scheduler:
    def __init__(self, node: Node, workers: WorkerPool, metrics: Metrics) -> None:
        self._node = node
        self._workers = workers
        self._metrics = metrics
        self._admitted = 0
        self._waiting_slot = 0
        # Label children looked up once: labels() costs several µs and runs per chunk.
        self._q_admit = metrics.queue_depth.labels(queue="admit")
        self._q_waiting = metrics.queue_depth.labels(queue="waiting_slot")
        self._q_workers = metrics.queue_depth.labels(queue="workers")

    def submit(self, room: SendRoom, chunk: OutChunk) -> None:
        self._admitted += 1
        self._q_admit.set(self._admitted)
        self._node.spawn(self._run(room, chunk), f"chunk {room.key}/{chunk.spec.chunk_id}")

    def room_failed(self, room: SendRoom) -> None:
        """Chunks of a failed room wake up from their waits and give back their slots."""

    async def _run(self, room: SendRoom, chunk: OutChunk) -> None:
        try:
            await room.bootstrapped.wait()
            if room.finished or room.plan is None:
                return
            slices = [s for s in room.plan if s.writer == chunk.writer]
            if room.zero_copy:
                if slices:
                    self._dispatch_pages(room, chunk, slices)
                return
            readers = sorted({s.reader for s in slices})
            dests: dict[int, DestSlot] = {}
            for reader in readers:
                dest = await self._dest(room, chunk, reader)
                if dest is None:
                    return
                dests[reader] = dest
            if room.finished:
                return
            self._dispatch(room, chunk, slices, dests)
        except Exception as exc:
            logger.exception("room %s: scheduling chunk %d failed", room.key, chunk.spec.chunk_id)
            self._node.fail_send_room(room, FailureCode.TRANSFER_ERROR, f"internal error scheduling a chunk: {exc!r}")
        finally:
            self._admitted -= 1
            self._q_admit.set(self._admitted)
            if chunk.parts_pending == 0 and chunk.in_flight == 0:
                self._node.writer_chunk_done(room, chunk)

    async def _dest(self, room: SendRoom, chunk: OutChunk, reader: int) -> DestSlot | None:
        spec = chunk.spec
        key = (spec.chunk_id, reader)
        fut = room.dest.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            room.dest[key] = fut
            self._node.spawn(self._alloc(room, chunk, reader, fut), f"alloc {room.key}/{spec.chunk_id}/{reader}")
        try:
            dest = await asyncio.shield(fut)
        except asyncio.CancelledError:
            if room.finished:
                return None
            raise
        if (dest.token_start, dest.num_tokens) != (spec.token_start, spec.num_tokens):
            self._node.fail_send_room(
                room, FailureCode.MISMATCH,
                f"chunk {spec.chunk_id}: writers disagree on its tokens "
                f"([{dest.token_start}, +{dest.num_tokens}) vs [{spec.token_start}, +{spec.num_tokens}))",
            )
            return None
        return dest

    async def _alloc(self, room: SendRoom, chunk: OutChunk, reader: int, fut: asyncio.Future[DestSlot]) -> None:
        spec = chunk.spec
        peer = room.peer
        assert peer is not None
        waiting = False
        try:
            while not room.finished:
                space = peer.space_event()
                try:
                    got = await peer.alloc_slot(
                        room.key, spec.chunk_id, reader, spec.token_start, spec.num_tokens, spec.last
                    )
                except Exception as exc:
                    # "CODE: details", not the RPC error's multi-line repr: both sides show it.
                    code: grpc.StatusCode | None = None
                    why = repr(exc)
                    if isinstance(exc, grpc.aio.AioRpcError):
                        code = exc.code()
                        why = f"{code.name}: {exc.details()}"
                    lost = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                    self._node.fail_send_room(
                        room, FailureCode.PEER_LOST if lost else FailureCode.MISMATCH,
                        f"destination slot for chunk {spec.chunk_id} reader {reader}: {why}",
                    )
                    return
                if got is not None:
                    if not fut.done():
                        fut.set_result(DestSlot(*got, token_start=spec.token_start, num_tokens=spec.num_tokens))
                    return
                if not waiting:
                    waiting = True
                    self._waiting_slot += 1
                    self._q_waiting.set(self._waiting_slot)
                try:
                    await asyncio.wait_for(space.wait(), _SLOT_RETRY_S)
                except asyncio.TimeoutError:
                    pass
        finally:
            if waiting:
                self._waiting_slot -= 1
                self._q_waiting.set(self._waiting_slot)
            if not fut.done():
                fut.cancel()

    def _dispatch(self, room: SendRoom, chunk: OutChunk, slices: list[HeadSlice], dests: dict[int, DestSlot]) -> None:
        assert room.layout is not None and room.peer is not None
        from kvxferd.node import encode_notif

        spec = chunk.spec
        bph = bytes_per_head(room.layout, spec.num_tokens)
        ring = chunk.engine.ring
        src_base = ring.base_addr + spec.slot.offset
        peer = room.peer
        jobs = []
        src_len = ring.alloc.slot_length(spec.slot.offset) or 0
        for s in slices:
            dest = dests[s.reader]
            length = s.num_heads * bph
            # The decode side sized the slot for exactly these tokens; never write past it.
            if (s.dst_head * bph + length > dest.length
                    or s.src_head * bph + length > src_len):
                self._node.fail_send_room(room, FailureCode.MISMATCH, f"chunk {spec.chunk_id} does not fit its slots")
                return
            jobs.append(TransferJob(
                remote="" if peer.is_self else peer.agent_name,
                pairs=[(src_base + s.src_head * bph, dest.address + s.dst_head * bph, length)],
                notif=encode_notif(room.key, spec, s.writer, s.reader),
                on_done=self._on_done,
                local_mem=ring.mem, remote_mem=dest.mem,
                local_device=ring.device, remote_device=dest.device,
                tag=(room, chunk), nbytes=length,
            ))
        self._submit(room, chunk, jobs)

    def _dispatch_pages(self, room: SendRoom, chunk: OutChunk, slices: list[HeadSlice]) -> None:
        """Zero-copy: pool pages to pool pages, one descriptor per (layer, K/V, contiguous run of token
        slots). A chunk may start and end mid-page: only its own tokens' slots are written, so a page
        two chunks share is filled by both, each at its token offsets."""
        from kvxferd.node import encode_notif

        assert room.layout is not None and room.peer is not None
        lay = room.layout
        spec = chunk.spec
        eng = chunk.engine
        ps = lay.page_size
        first_page = spec.token_start // ps
        jobs = []
        for s in slices:
            target = room.zc_targets.get(s.reader)
            if target is None:
                self._node.fail_send_room(room, FailureCode.MISMATCH, f"reader {s.reader} has no zero-copy target")
                return
            dst_pages = target.pages[first_page : first_page + len(spec.pages)]
            if len(dst_pages) != len(spec.pages):
                self._node.fail_send_room(room, FailureCode.MISMATCH, f"chunk {spec.chunk_id} exceeds the decode pages")
                return
            # Same TP (or MLA): writer and reader hold the same heads, so a token slot has the same size.
            slot_bytes = s.num_heads * lay.head_dim * lay.dtype_bytes
            runs = slot_runs(spec.pages, dst_pages, spec.token_start % ps, spec.num_tokens, ps)
            pairs = []
            for layer in range(lay.num_layers):
                for plane in range(lay.planes):
                    src_plane = eng.ring.base_addr + (layer * lay.planes + plane) * eng.pool_slots * slot_bytes
                    dst_plane = target.address + (layer * lay.planes + plane) * target.num_slots * slot_bytes
                    for ss, ds, n in runs:
                        pairs.append((src_plane + ss * slot_bytes, dst_plane + ds * slot_bytes, n * slot_bytes))
            jobs.append(TransferJob(
                remote="" if room.peer.is_self else room.peer.agent_name, pairs=pairs,
                notif=encode_notif(room.key, spec, s.writer, s.reader), on_done=self._on_done,
                local_mem=eng.ring.mem, remote_mem=target.mem, local_device=eng.ring.device,
                remote_device=target.device, tag=(room, chunk), nbytes=sum(p[2] for p in pairs),
            ))
        self._submit(room, chunk, jobs)

    def _submit(self, room: SendRoom, chunk: OutChunk, jobs: list[TransferJob]) -> None:
        assert room.peer is not None
        shard = zlib.crc32(room.peer.daemon_id.encode())
        chunk.parts_pending = len(jobs)
        chunk.in_flight = len(jobs)
        room.in_flight += len(jobs)
        for job in jobs:
            self._workers.submit(job, shard)
        self._q_workers.set(self._workers.in_flight)

    def _on_done(self, job: TransferJob, state: XferState, error: str) -> None:
        room, chunk = job.tag
        chunk.in_flight -= 1
        chunk.parts_pending -= 1
        room.in_flight -= 1
        peer = room.peer
        self._q_workers.set(self._workers.in_flight)
        if state is XferState.DONE:
            path = "local" if peer.is_self else "nixl"
            self._metrics.transfer_bytes.labels(peer=peer.daemon_id, path=path).inc(job.nbytes)
            self._metrics.chunk_transfer.labels(path=path).observe(job.finished_at - job.posted_at)
            if peer.is_self:
                self._node.on_notifs([("", job.notif)])
        else:
            self._metrics.nixl_errors.labels(peer=peer.daemon_id).inc()
            self._node.fail_send_room(
                room, FailureCode.TRANSFER_ERROR, f"chunk {chunk.spec.chunk_id}: transfer to {peer.daemon_id}: {error}"
            )
        if chunk.in_flight == 0 and (chunk.parts_pending == 0 or room.finished):
            self._node.writer_chunk_done(room, chunk)


def coalesce(src: tuple[int, ...] | list[int], dst: tuple[int, ...] | list[int]) -> list[tuple[int, int, int]]:
    """(src_page, dst_page, pages) runs where both sides are consecutive: one descriptor per run."""
    runs: list[tuple[int, int, int]] = []
    for sp, dp in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == sp and runs[-1][1] + runs[-1][2] == dp:
            a, b, n = runs[-1]
            runs[-1] = (a, b, n + 1)
        else:
            runs.append((sp, dp, 1))
    return runs


def slot_runs(
    src_pages: tuple[int, ...] | list[int], dst_pages: tuple[int, ...] | list[int], offset: int, num_tokens: int,
    page_size: int,
) -> list[tuple[int, int, int]]:
    """(src_slot, dst_slot, slots) runs for tokens [offset, offset + num_tokens) of a page list
    (token ``offset`` is the first page's slot ``offset``), where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    pos = 0  # page-list-relative slot of the first page of the current run
    for sp, dp, n in coalesce(src_pages, dst_pages):
        lo, hi = max(pos, offset), min(pos + n * page_size, offset + num_tokens)
        if lo < hi:
            runs.append((sp * page_size + lo - pos, dp * page_size + lo - pos, hi - lo))
        pos += n * page_size
    return runs
