"""Prefill-side scheduler: turns an accepted chunk into WRITEs, with no task and no round trip.

A chunk waits for exactly two things, each as a callback, never as a parked coroutine: its
room's bootstrap (every reader known), and a destination range per reader carved from the
credits the decode daemon granted (`CreditWindow.take`). A reader ring with no free credit
makes only the chunks bound for it wait; other rooms go on. The worker pool spreads the WRITEs
over its threads (see kvxferd.datapath.workers).
A layer-wise chunk waits and goes the same way: its destination ranges are cut at its first part,
sized for the whole chunk, and each post writes the layers queued since the last one (one WRITE,
one notification entry per reader and contiguous layer range). Later parts are posted at the end
of the loop turn that admitted them (`submit_soon`): parts of one room that one turn admitted
(several lane frames read at once) leave as one WRITE, and none waits past that turn.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence

from kvxfer_protocol.slot_layout import HeadSlice, bytes_per_head, layer_bytes, part_bytes, part_runs, rank_heads
from kvxferd.core.peer_port import Link
from kvxferd.core.rooms import Dest, OutChunk, SendRoom
from kvxferd.core.types import FailureCode
from kvxferd.datapath.credits import CreditWindow, HeldRange
from kvxferd.datapath.notif import MAX_PARTS, encode_notif, join_notifs, part_entry, part_head
from kvxferd.datapath.parts import ranges_of
from kvxferd.datapath.workers import TransferJob, WorkerPool, by_ipc, transport_error
from kvxferd.datapath.write_plan import PagePlan, PlanError, plan_page_writes, plan_slot_writes
from kvxferd.ops.metrics import Metrics
from kvxferd.transports.interface import XferState

logger = logging.getLogger(__name__)

_WHOLE = ((0, 0),)  # the layers of a whole chunk (write_plan's convention)

# A reader's range, its runs for layers [lo, hi) (offsets in the writer's slot and the range), and
# its notification entry's head; the WRITE of the slices whose ranges lie in one memory: its memory
# kind, device, the chunk's layer_group field and those slices.
_SlicePost = tuple[HeldRange, Callable[[int, int], tuple[tuple[int, int, int], ...]], bytes]
_PartPost = tuple[str, int, int, tuple[_SlicePost, ...]]
# One WRITE to post: memory kind, device, ranges written, (src, dst, length) pairs, bytes, entries.
_Write = tuple[str, int, list[HeldRange], Sequence[tuple[int, int, int]], int, list[bytes]]


def _shifted(cut: Callable[..., tuple[tuple[int, int, int], ...]], per_layer: int, src_heads: int, dst_heads: int,
             src_head: int, dst_head: int, num_heads: int, lo: int, hi: int) -> tuple[tuple[int, int, int], ...]:
    return cut(lo, hi, per_layer, src_heads, dst_heads, src_head, dst_head, num_heads)


def _part_writes(cid: int, posts: Sequence[_PartPost], layers: Sequence[tuple[int, int]], src_base: int,
                 src_len: int) -> list[_Write]:
    """The WRITEs of the layer ranges `layers` of a layer-wise chunk: one per memory its readers'
    ranges lie in, one notification entry per reader and range. Raises PlanError, as
    plan_slot_writes, for a run outside the slot or the range."""
    out: list[_Write] = []
    for mem, device, group, parts in posts:
        pairs: list[tuple[int, int, int]] = []
        entries = []
        for r, runs, head in parts:
            dst, room_len = r.address, r.length
            for lo, hi in layers:
                for o, d, n in runs(lo, hi):
                    if d + n > room_len or o + n > src_len:
                        raise PlanError(f"chunk {cid} does not fit its slots")
                    pairs.append((src_base + o, dst + d, n))
                entries.append(part_entry(head, group, lo, hi))
        out.append((mem, device, [r for r, _, _ in parts], tuple(pairs), sum(p[2] for p in pairs), entries))
    return out


class Scheduler:
    def __init__(
        self, workers: WorkerPool, metrics: Metrics, window: Callable[[Link], CreditWindow],
        chunk_done: Callable[[SendRoom, OutChunk], None], fail: Callable[[SendRoom, FailureCode, str], None],
        local_notif: Callable[[bytes], None],
        transport_failed: Callable[[Link, str, float], None] | None = None,
    ) -> None:
        self._workers = workers
        self._metrics = metrics
        self._window = window
        self._chunk_done = chunk_done
        self._fail = fail
        self._local_notif = local_notif
        # The peer layer rebuilds a pair's NIXL connection after a transport error (kvxferd.peer.heal).
        self._transport_failed = transport_failed
        self._waiting = 0
        # Read when scraped rather than set per chunk: a Gauge.set takes a lock, and per chunk it
        # was 3.5 % of the prefill loop's GIL-held samples at TP 4->2 with 5 MiB chunks (16 cores).
        metrics.queue_depth.labels(queue="waiting_slot").set_function(lambda: self._waiting)
        metrics.queue_depth.labels(queue="workers").set_function(lambda: workers.in_flight)
        # Label children looked up once: labels() costs several µs and would run per chunk.
        self._write_seconds = {p: metrics.chunk_transfer.labels(path=p) for p in ("local", "nixl")}
        self._parts_written = metrics.layer_parts.labels(role="prefill", event="written")
        self._parts_per_write = metrics.parts_per_write.labels()
        self._soon: list[tuple[SendRoom, OutChunk]] = []

    # ------------------------------------------------------------------ admission

    def submit(self, room: SendRoom, chunk: OutChunk) -> None:
        if room.finished:
            self._chunk_done(room, chunk)
        elif not room.bootstrapped:
            room.pending.append(chunk)
        else:
            self._schedule(room, chunk)

    def submit_soon(self, room: SendRoom, chunk: OutChunk) -> None:
        """A later part of a layer-wise chunk: posted once this loop turn's other callbacks ran,
        with every part of the chunk admitted meanwhile (LayerMask.add leaves it queued)."""
        if not self._soon:
            try:
                asyncio.get_running_loop().call_soon(self._flush_soon)
            except RuntimeError:  # no loop (a synchronous caller): nothing to wait for
                self.submit(room, chunk)
                return
        self._soon.append((room, chunk))

    def _flush_soon(self) -> None:
        soon, self._soon = self._soon, []
        for room, chunk in soon:
            self.submit(room, chunk)

    def room_ready(self, room: SendRoom) -> None:
        """Every reader bootstrapped: the chunks that were enqueued before go."""
        pending, room.pending = room.pending, []
        for chunk in pending:
            self.submit(room, chunk)

    def room_failed(self, room: SendRoom) -> None:
        """Chunks of a failed room stop waiting (for bootstrap or credits) and give back their slots."""
        pending, room.pending = room.pending, []
        for chunk in pending:
            self._chunk_done(room, chunk)
        if room.peer is not None and not room.zero_copy:
            self._window(room.peer).cancel_room(room.key)

    def _slices(self, room: SendRoom, chunk: OutChunk) -> list[HeadSlice]:
        assert room.plan is not None
        return [s for s in room.plan if s.writer == chunk.writer]

    def _schedule(self, room: SendRoom, chunk: OutChunk) -> None:
        try:
            if chunk.layers is not None and chunk.layers.posts is not None:
                # A later post of a layer-wise chunk: its slices and ranges were settled at its first.
                self._dispatch(room, chunk, ())
                return
            slices = self._slices(room, chunk)
            if not slices:  # a GQA replica or an MLA rank other than 0: nothing to send
                if chunk.layers is not None:
                    chunk.layers.written |= chunk.layers.take()[0]
                self._chunk_done(room, chunk)
            elif room.zero_copy:
                self._dispatch_pages(room, chunk, slices)
            else:
                self._need_dests(room, chunk, slices)
        except Exception as exc:
            logger.exception("room %s: scheduling chunk %d failed", room.key, chunk.spec.chunk_id)
            self._fail(room, FailureCode.TRANSFER_ERROR, f"internal error scheduling a chunk: {exc!r}")
            self._chunk_done(room, chunk)

    # ------------------------------------------------------------------ destinations

    def _need_dests(self, room: SendRoom, chunk: OutChunk, slices: list[HeadSlice]) -> None:
        assert room.peer is not None and room.layout is not None and room.decode_tp is not None
        spec = chunk.spec
        window = self._window(room.peer)
        missing = False
        for reader in sorted({s.reader for s in slices}):
            key = (spec.chunk_id, reader)
            dest = room.dest.get(key)
            if dest is None:
                dest = room.dest[key] = Dest(spec.token_start, spec.num_tokens)
                ring = room.reader_rings.get(reader, "")
                nbytes = part_bytes(room.layout, room.decode_tp, reader, spec.num_tokens)
                got = window.take(ring, nbytes, room.key, functools.partial(self._dest_ready, room, key))
                if got is None:
                    self._waiting += 1
                dest.range = got
            elif (dest.token_start, dest.num_tokens) != (spec.token_start, spec.num_tokens):
                self._fail(room, FailureCode.MISMATCH,
                           f"chunk {spec.chunk_id}: writers disagree on its tokens "
                           f"([{dest.token_start}, +{dest.num_tokens}) vs [{spec.token_start}, +{spec.num_tokens}))")
                self._chunk_done(room, chunk)
                return
            if dest.range is None:
                dest.waiting.append(chunk)
                missing = True
        if not missing:
            self._dispatch(room, chunk, slices)

    def _dest_ready(self, room: SendRoom, key: tuple[int, int], r: HeldRange | None) -> None:
        self._waiting -= 1
        dest = room.dest.get(key)
        if dest is None:
            return
        waiting, dest.waiting = dest.waiting, []
        if r is None or room.finished:
            if r is not None and room.peer is not None:
                # Carved for a room that ended meanwhile: nothing was or will be written there.
                self._window(room.peer).release([(r.held.spec.id, r.offset)], [])
            if r is None and not room.finished:
                self._fail(room, FailureCode.PEER_LOST, f"no destination space for chunk {key[0]} reader {key[1]}")
            for chunk in waiting:
                if chunk.in_flight == 0:
                    self._chunk_done(room, chunk)
            return
        dest.range = r
        for chunk in waiting:
            slices = self._slices(room, chunk)
            if all(room.dest[(chunk.spec.chunk_id, s.reader)].range is not None for s in slices):
                self._dispatch(room, chunk, slices)

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self, room: SendRoom, chunk: OutChunk, slices: Sequence[HeadSlice]) -> None:
        assert room.layout is not None and room.peer is not None
        if room.finished:
            self._chunk_done(room, chunk)
            return
        spec = chunk.spec
        ring = chunk.engine.ring
        dest = room.dest
        cid = spec.chunk_id

        def range_of(reader: int) -> HeldRange:
            r = dest[(cid, reader)].range
            assert r is not None
            return r

        taken = self._take_layers(chunk)
        if taken is None:
            return
        layers, bits, nparts = taken
        src_base, src_len = ring.base_addr + spec.slot.offset, ring.alloc.slot_length(spec.slot.offset) or 0
        try:
            if bits:
                assert chunk.layers is not None
                posts = chunk.layers.posts
                if posts is None:
                    posts = chunk.layers.posts = self._part_posts(room, chunk, slices, range_of)
                writes = _part_writes(cid, posts, layers, src_base, src_len)
            else:
                # The parts of this chunk for readers on one daemon (TP 1->4: four) go as one WRITE with
                # one notification naming them all: a job, a post and a completion per chunk, not per part.
                writes = [(w.mem, w.device, [r for _, r in w.parts], w.pairs, w.nbytes,
                           [encode_notif(room.key, spec, s.writer, s.reader, r.held.spec.id, r.offset,
                                         token=room.notif_token) for s, r in w.parts])
                          for w in plan_slot_writes(cid, slices, range_of, bytes_per_head(room.layout, spec.num_tokens),
                                                    src_base, src_len)]
        except PlanError as exc:
            self._fail(room, FailureCode.MISMATCH, str(exc))
            self._chunk_done(room, chunk)
            return
        peer = room.peer
        window = self._window(peer)
        jobs = []
        for mem, device, ranges, pairs, nbytes, entries in writes:
            if bits and len(entries) > MAX_PARTS:
                self._fail(room, FailureCode.MISMATCH, f"chunk {cid}: {len(entries)} notification entries in "
                           f"one WRITE, over {MAX_PARTS}: send its layers in fewer ranges")
                self._chunk_done(room, chunk)
                return
            jobs.append(by_ipc(TransferJob(
                remote="" if peer.is_self else peer.agent_name, pairs=pairs, notif=join_notifs(entries),
                on_done=self._on_done, local_mem=ring.mem, remote_mem=mem, local_device=ring.device,
                remote_device=device, tag=(room, chunk, ranges, bits, nparts), nbytes=nbytes,
                credits=[r.held for r in ranges], merge_key=room.key,
            ), peer.daemon_id, peer.instance_id))
            for r in ranges:
                window.write_started(r)
            nparts = 0  # counted once, with the first WRITE
        self._submit(room, chunk, jobs)

    @staticmethod
    def _part_posts(room: SendRoom, chunk: OutChunk, slices: Sequence[HeadSlice],
                    range_of: Callable[[int], HeldRange]) -> tuple[_PartPost, ...]:
        """A layer-wise chunk's WRITEs, settled at its first post (its slices, their reader ranges
        and notification heads do not change): each later post only cuts its layers' runs."""
        layout, spec = room.layout, chunk.spec
        assert layout is not None and chunk.layers is not None
        total, mla = layout.total_kv_heads, layout.mla
        per_layer = layer_bytes(layout, spec.num_tokens)
        cut = functools.partial(part_runs, layout.num_layers, chunk.layers.group)
        groups: dict[tuple[str, int], list[_SlicePost]] = {}
        for s in slices:
            r = range_of(s.reader)
            src_heads = rank_heads(total, room.prefill_tp, s.writer, mla).count
            dst_heads = rank_heads(total, room.decode_tp or 0, s.reader, mla).count
            runs = functools.partial(_shifted, cut, per_layer, src_heads, dst_heads, s.src_head, s.dst_head,
                                     s.num_heads)
            head = part_head(room.key, spec, s.writer, s.reader, r.held.spec.id, r.offset, token=room.notif_token)
            groups.setdefault((r.held.spec.mem, r.held.spec.device), []).append((r, runs, head))
        return tuple((mem, device, spec.layer_group, tuple(parts)) for (mem, device), parts in groups.items())

    def _dispatch_pages(self, room: SendRoom, chunk: OutChunk, slices: list[HeadSlice]) -> None:
        """Zero-copy: pool pages to pool pages (kvxferd.datapath.write_plan.plan_page_writes), one WRITE per reader."""
        assert room.layout is not None and room.peer is not None
        spec = chunk.spec
        eng = chunk.engine
        src = PagePlan(spec.token_start, spec.num_tokens, spec.pages, eng.ring.base_addr, eng.pool_slots)
        taken = self._take_layers(chunk)
        if taken is None:
            return
        layers, bits, nparts = taken
        jobs = []
        for s in slices:
            target = room.zc_targets.get(s.reader)
            try:
                if target is None:
                    raise PlanError(f"reader {s.reader} has no zero-copy target")
                pairs = plan_page_writes(spec.chunk_id, room.layout, src, s.num_heads, target, layers)
            except PlanError as exc:
                self._fail(room, FailureCode.MISMATCH, str(exc))
                self._chunk_done(room, chunk)
                return
            notif = join_notifs([encode_notif(room.key, spec, s.writer, s.reader, token=room.notif_token,
                                              layers=lay if bits else None) for lay in layers])
            jobs.append(TransferJob(
                remote="" if room.peer.is_self else room.peer.agent_name, pairs=pairs, notif=notif,
                on_done=self._on_done, local_mem=eng.ring.mem, remote_mem=target.mem, local_device=eng.ring.device,
                remote_device=target.device, tag=(room, chunk, [], bits, nparts), nbytes=sum(p[2] for p in pairs),
            ))
            nparts = 0
        self._submit(room, chunk, jobs)

    @staticmethod
    def _take_layers(chunk: OutChunk) -> tuple[Sequence[tuple[int, int]], int, int] | None:
        """What this post writes: a whole chunk's layers (bits 0), or the layer ranges queued since the
        last post with their bits and part count; None if an earlier post took them already (they
        queued beside it)."""
        if chunk.layers is None:
            return _WHOLE, 0, 0
        bits, nparts = chunk.layers.take()
        return (ranges_of(bits), bits, nparts) if bits else None

    def _submit(self, room: SendRoom, chunk: OutChunk, jobs: list[TransferJob]) -> None:
        # += : a layer-wise chunk's earlier posts may still be in flight.
        chunk.parts_pending += len(jobs)
        chunk.in_flight += len(jobs)
        room.in_flight += len(jobs)
        for job in jobs:
            self._workers.submit(job)

    def _on_done(self, job: TransferJob, state: XferState, error: str) -> None:
        room, chunk, ranges, bits, nparts = job.tag
        chunk.in_flight -= 1
        chunk.parts_pending -= 1
        room.in_flight -= 1
        peer = room.peer
        for r in ranges:
            self._window(peer).write_done(r)
        if state is XferState.DONE:
            path = "local" if peer.is_self else "nixl"
            self._metrics.peer_series.labels(self._metrics.transfer_bytes, peer.daemon_id,
                                             job.link or path).inc(job.nbytes)
            self._write_seconds[path].observe(job.finished_at - job.posted_at)
            if chunk.layers is not None:
                chunk.layers.written |= bits
                if nparts:
                    self._parts_written.inc(nparts)
                    self._parts_per_write.observe(nparts)
            if peer.is_self:
                self._local_notif(job.notif)
        else:
            self._metrics.peer_series.labels(self._metrics.nixl_errors, peer.daemon_id).inc()
            if self._transport_failed is not None and not peer.is_self and transport_error(error):
                self._transport_failed(peer, error, job.posted_at)
            self._fail(room, FailureCode.TRANSFER_ERROR,
                       f"chunk {chunk.spec.chunk_id}: transfer to {peer.daemon_id}: {error}")
        if chunk.in_flight == 0 and (chunk.parts_pending == 0 or room.finished):
            self._chunk_done(room, chunk)

