"""Worker side of the vLLM connector: gather chunks into ring slots, scatter landed chunks into blocks.

One instance per TP rank. The rank registers with its node's daemon as a prefill engine, a decode
engine, or both (``kv_both``), with its own heads: kvxferd slices heads between prefill and decode
TP sizes, so a rank only ever handles its local heads.

Loads run off the model's thread: a watcher thread takes the daemon's room events in the lists
they arrived in, scatters each chunk as it lands into the request's blocks (vLLM never touches a
request's blocks while it waits for remote KV) and watermarks what one list brought in one call.
A finished or failed room is reported by the next ``transfer_results`` call; a failed one goes to
vLLM's load-failure path (``failed_recving``). Polling the rooms is only the safety net for a
broken event stream.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvxfer_client._common import ChunkRefused, KvxferError, Landed, Layout, RoomEvent, RoomState
from kvxfer_client._sync import DecodeReceiver
from kvxfer_client._sync_prefill import PrefillSender
from kvxfer_client.vllm import _paged
from kvxfer_client.vllm._config import LoadSpec, SendChunk, Settings, StepPlan

logger = logging.getLogger(__name__)

# With no event for this long while loads are active, the watcher polls every active room itself:
# the safety net for an event lost with a broken stream (a reconnected stream also starts a sweep).
# Events carry what a load needs (the landed chunk, the room's end), so no load waits for it.
_SWEEP_ACTIVE_S = 0.5
_SWEEP_IDLE_S = 1.0


@dataclass(frozen=True)
class CacheShape:
    """What a rank's registered caches look like; built from vLLM's config and layers."""

    layers: list[str]
    planes: list[_paged.Planes]
    total_kv_heads: int
    local_heads: int
    head_size: int
    block_size: int  # the scheduler's block (what block ids count)
    kernel_block_size: int  # tokens per block of the cache tensors
    dtype: torch.dtype

    def layout(self) -> Layout:
        return Layout(
            num_layers=len(self.layers), total_kv_heads=self.total_kv_heads, head_dim=self.head_size,
            dtype_bytes=torch.empty((), dtype=self.dtype).element_size(), page_size=self.block_size,
            dtype=str(self.dtype).removeprefix("torch."),
        )


@dataclass
class _Load:
    spec: LoadSpec
    done_chunks: set[int] = field(default_factory=set)
    tokens: int = 0
    error: str = ""
    finished: bool = False
    # Set once ExpectRoom returned: before that the daemon does not know the room, and a sweep's
    # PollRoom would fail the load with NOT_FOUND (events name it only after ExpectRoom anyway).
    expected: bool = False
    cancelled: bool = False


class ConnectorWorker:
    def __init__(self, settings: Settings, shape: CacheShape, tp_size: int, tp_rank: int, produce: bool,
                 consume: bool) -> None:
        self.settings = settings
        self.shape = shape
        layout = shape.layout()
        name = f"vllm-tp{tp_rank}"
        self.tx = PrefillSender(
            group=settings.prefill_group, name=f"{name}-p", layout=layout, tp_size=tp_size, tp_rank=tp_rank,
            ring_bytes=settings.ring_bytes, socket=settings.socket,
        ) if produce else None
        self.rx = DecodeReceiver(
            group=settings.decode_group, name=f"{name}-d", layout=layout, tp_size=tp_size, tp_rank=tp_rank,
            ring_bytes=settings.ring_bytes, socket=settings.socket,
        ) if consume else None
        self._lock = threading.Lock()
        self._loads: dict[int, _Load] = {}  # by room
        self._by_req: dict[str, int] = {}
        self._finished: list[_Load] = []
        self._stop = threading.Event()
        # Room events in the lists they arrived in; None asks the watcher for a sweep.
        self._events: queue.SimpleQueue[list[RoomEvent] | None] = queue.SimpleQueue()
        self._watcher: threading.Thread | None = None
        if self.rx is not None:
            self._watcher = threading.Thread(target=self._watch_loop, name="kvxfer-vllm-load", daemon=True)
            self._watcher.start()
        logger.info("kvxferd connector rank %d/%d: %s, %d layers, %d local of %d KV heads, blocks of %d",
                    tp_rank, tp_size, "+".join(r for r, on in (("prefill", produce), ("decode", consume)) if on),
                    len(shape.layers), shape.local_heads, shape.total_kv_heads, shape.block_size)

    # -- prefill -------------------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        """Gathers this step's chunks into ring slots and enqueues them; the step's KV is written."""
        tx = self.tx
        if tx is None:
            return
        for room in plan.aborts:
            self._quiet(tx.abort, room, "request ended before its prompt was computed")
        for c in plan.sends:
            while True:
                try:
                    self._send(tx, c)
                except ChunkRefused as exc:
                    # An earlier chunk of this step, refused; this one was not sent: again.
                    self._refused(tx, exc)
                    continue
                except Exception as exc:
                    # The decode side must hear of it now, not at the room deadline.
                    logger.error("request %s room %d chunk %d: %s", c.req_id, c.room, c.chunk_id, exc)
                    self._quiet(tx.abort, c.room, f"prefill gather/enqueue failed: {exc}")
                break
        # The step's chunks went without waiting for each verdict: all of them, in one round trip.
        for refused in tx.flush():
            self._refused(tx, refused)

    def _refused(self, tx: PrefillSender, exc: ChunkRefused) -> None:
        logger.error("room %d chunk %d: %s", exc.room, exc.chunk_id, exc)
        if exc.slot is not None and not exc.lost:
            self._quiet(tx.release_slot, exc.slot)  # still ours: the daemon took nothing
        self._quiet(tx.abort, exc.room, f"prefill enqueue refused: {exc.message}")

    def _send(self, tx: PrefillSender, c: SendChunk) -> None:
        n = c.end - c.start
        s = self.shape
        slot = tx.acquire(n, timeout=self.settings.acquire_timeout_s)
        try:
            dst = _paged.slot_view(tx.tensor(slot.offset, slot.chunk_bytes), s.local_heads, len(s.layers), n,
                                   s.head_size, s.dtype)
            blocks, offsets = _paged.token_index(c.block_ids, c.first_block, c.start, c.end, s.block_size, s.kernel_block_size,
                                                 s.planes[0].k.device)
            _paged.gather(s.planes, blocks, offsets, dst)
            tx.enqueue(c.room, c.chunk_id, c.start, n, slot, last=c.last, wait=False)
        except BaseException:
            self._quiet(tx.release_slot, slot)
            raise

    # -- decode --------------------------------------------------------------------------------
    def start_loads(self, plan: StepPlan) -> None:
        rx = self.rx
        if rx is None:
            return
        for spec in plan.loads:
            ld = _Load(spec)
            with self._lock:
                self._loads[spec.room] = ld
                self._by_req[spec.req_id] = spec.room
            try:
                rx.expect(spec.room, spec.prefill_address, spec.prefill_group, spec.num_tokens,
                          deadline_ms=self.settings.deadline_ms)
            except KvxferError as exc:
                self._finish(ld, f"ExpectRoom failed: {exc}")
            else:
                ld.expected = True

    def transfer_results(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """(finished loads, failed loads): request ids; failed ones are in both sets."""
        for rid in finished_req_ids:
            # A request vLLM finished (aborted) while its KV was loading: end the room; the
            # watcher reports the load once nothing writes into its blocks any more.
            with self._lock:
                room = self._by_req.get(rid)
                ld = self._loads.get(room) if room is not None else None
            if ld is not None and not ld.finished and self.rx is not None:
                ld.cancelled = True
                self._quiet(self.rx.abort, ld.spec.room, "request finished on the decode engine")
                self._events.put(None)  # the room's end is also pushed; a sweep costs little here
        with self._lock:
            done, self._finished = self._finished, []
        ok = {ld.spec.req_id for ld in done}
        failed = {ld.spec.req_id for ld in done if ld.error}
        for ld in done:
            if ld.error and not ld.cancelled:
                logger.warning("request %s: KV load from room %d failed: %s", ld.spec.req_id, ld.spec.room, ld.error)
        return ok, failed

    def _watch_loop(self) -> None:
        """The one thread that touches loads: applies event lists, sweeps when told or when idle."""
        rx = self.rx
        assert rx is not None
        events = threading.Thread(target=self._event_loop, name="kvxfer-vllm-events", daemon=True)
        events.start()
        while not self._stop.is_set():
            with self._lock:
                busy = any(not ld.finished for ld in self._loads.values())
            try:
                batch = self._events.get(timeout=_SWEEP_ACTIVE_S if busy else _SWEEP_IDLE_S)
            except queue.Empty:
                batch = None
            if self._stop.is_set():
                return
            if batch is not None:
                try:
                    self._apply(rx, batch)
                except Exception:  # the watcher must outlive any one list: the sweep picks up the rest
                    logger.exception("applying room events failed; polling the loads instead")
                    self._events.put(None)
                continue
            with self._lock:
                active = [ld for ld in self._loads.values() if ld.expected and not ld.finished]
            for ld in active:
                self._advance(rx, ld)

    def _event_loop(self) -> None:
        """Hands the daemon's pushed room events to the watcher; re-opens the stream if it breaks
        (and asks for a sweep: events may have been lost meanwhile)."""
        rx = self.rx
        assert rx is not None
        while not self._stop.is_set():
            try:
                for batch in rx.watch().batches():
                    self._events.put(batch)
                    if self._stop.is_set():
                        return
            except KvxferError as exc:
                logger.debug("room event stream ended: %s", exc)
            self._events.put(None)
            self._stop.wait(0.2)

    def _apply(self, rx: DecodeReceiver, batch: list[RoomEvent]) -> None:
        """Scatters the chunks a list of events announces, watermarks them in one call, and ends
        the loads whose room ended (after their chunks: the daemon sends a room's end last)."""
        read: dict[int, list[int]] = {}
        for ev in batch:
            with self._lock:
                ld = self._loads.get(ev.room)
            if ld is None or ld.finished:
                continue
            c = ev.landed
            if c is not None and c.chunk_id not in ld.done_chunks:
                try:
                    self._take(rx, ld, c)
                except Exception as exc:
                    self._quiet(rx.abort, ev.room, f"decode load failed: {exc}")
                    self._finish(ld, str(exc))
                    continue
                read.setdefault(ev.room, []).append(c.chunk_id)
            if ev.state is RoomState.FAILED:
                self._finish(ld, f"{ev.failure_code}: {ev.failure_reason}")
            elif ev.state is RoomState.SUCCESS:
                if ld.tokens == ld.spec.num_tokens:
                    self._finish(ld, "")
                else:
                    # Events were lost with a broken stream: the room's own status lists every
                    # landed chunk (the second pass ends the load once nothing is fresh).
                    self._advance(rx, ld)
                    if not ld.finished:
                        self._advance(rx, ld)
        # Rooms that ended were released: their chunks need no watermark (nor could take one).
        with self._lock:
            marks = [(room, ids) for room, ids in read.items() if room in self._loads]
        if not marks:
            return
        try:
            errors = rx.watermark_many(marks)
        except KvxferError as exc:  # the lane itself failed: every room of the call is affected
            errors = [exc] * len(marks)
        for (room, _), err in zip(marks, errors, strict=True):
            if err is not None:
                with self._lock:
                    ld = self._loads.get(room)
                if ld is not None:
                    self._quiet(rx.abort, room, f"decode load failed: watermark: {err}")
                    self._finish(ld, f"watermark failed: {err}")

    def _advance(self, rx: DecodeReceiver, ld: _Load) -> None:
        room = ld.spec.room
        try:
            st = rx.poll(room)
            fresh = [c for c in st.landed if c.chunk_id not in ld.done_chunks]
            for c in fresh:
                self._take(rx, ld, c)
            if fresh:
                rx.watermark(room, [c.chunk_id for c in fresh])
            if st.state is RoomState.FAILED:
                self._finish(ld, f"{st.failure_code}: {st.failure_reason}")
            elif st.state is RoomState.SUCCESS and not fresh:
                short = ld.tokens != ld.spec.num_tokens
                self._finish(ld, f"room ended with {ld.tokens} of {ld.spec.num_tokens} tokens" if short else "")
        except Exception as exc:
            self._quiet(rx.abort, room, f"decode load failed: {exc}")
            self._finish(ld, str(exc))

    def _take(self, rx: DecodeReceiver, ld: _Load, c: Landed) -> None:
        """One landed chunk of a load: into the request's blocks (unless the request was cancelled),
        then counted; a failed scatter counts nothing."""
        if not ld.cancelled:
            self._scatter(rx, ld.spec, c)
        ld.done_chunks.add(c.chunk_id)
        ld.tokens += c.num_tokens

    def _scatter(self, rx: DecodeReceiver, spec: LoadSpec, c: Landed) -> None:
        s = self.shape
        lo = max(c.token_start, spec.skip_tokens)
        hi = c.token_start + c.num_tokens
        if lo >= hi:
            return
        src = _paged.slot_view(rx.tensor(c.offset, c.chunk_bytes), s.local_heads, len(s.layers), c.num_tokens,
                               s.head_size, s.dtype)[:, :, :, lo - c.token_start : hi - c.token_start]
        blocks, offsets = _paged.token_index(spec.block_ids, 0, lo, hi, s.block_size, s.kernel_block_size,
                                             s.planes[0].k.device)
        _paged.scatter(s.planes, blocks, offsets, src)

    def _finish(self, ld: _Load, error: str) -> None:
        with self._lock:
            if ld.finished:
                return
            ld.finished, ld.error = True, error
            self._loads.pop(ld.spec.room, None)
            self._by_req.pop(ld.spec.req_id, None)
            self._finished.append(ld)
        if self.rx is not None:
            self._quiet(self.rx.release, ld.spec.room)

    @staticmethod
    def _quiet(fn: object, *args: object) -> None:
        try:
            fn(*args)  # type: ignore[operator]
        except Exception as exc:
            logger.debug("%s%s: %s", getattr(fn, "__name__", fn), args, exc)

    def close(self) -> None:
        self._stop.set()
        self._events.put(None)
        for client in (self.tx, self.rx):
            if client is not None:
                client.close()
        if self._watcher is not None:
            self._watcher.join(timeout=2)

