"""Worker side of the vLLM connector: gather chunks into ring slots, scatter landed chunks into blocks.

One instance per TP rank. The rank registers with its node's daemon as a prefill engine, a decode
engine, or both (``kv_both``), with its own heads: kvxferd slices heads between prefill and decode
TP sizes, so a rank only ever handles its local heads. Each registration heals by itself
(:class:`kvxfer_client._reattach.Reattach`): a daemon that restarts, or stalls and resumes, is
registered with again without restarting the engine, and while it is away every call from the
model's step fails at once (prefill: the room fails, see ``_send.py``; decode: the load fails
and vLLM's load-failure policy applies).

Loads run off the model's thread: a watcher thread takes the daemon's room events in the lists
they arrived in, scatters each chunk as it lands into the request's blocks (vLLM never touches a
request's blocks while it waits for remote KV) and watermarks what one list brought in one call.
A finished or failed room is reported by the next ``transfer_results`` call; a failed one goes to
vLLM's load-failure path (``failed_recving``). Polling the rooms is only the safety net for a
broken event stream. A load is read only from the registration (ring) it was expected with: when
that registration's daemon is gone, the load fails; it is never resumed on the next one.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from kvxfer_client._reattach import Reattach
from kvxfer_client._sync import DecodeReceiver
from kvxfer_client._sync_prefill import PrefillSender
from kvxfer_client.errors import KvxferError, NotSent
from kvxfer_client.types import Landed, RoomEvent, RoomState
from kvxfer_client.vllm._config import LoadSpec, Settings, StepPlan
from kvxfer_client.vllm._layers import scatter_chunk
from kvxfer_client.vllm._paged import CacheShape
from kvxfer_client.vllm._send import SendPath, quiet

logger = logging.getLogger(__name__)

__all__ = ["CacheShape", "ConnectorWorker"]

# With no event for this long while loads are active, the watcher polls every active room itself:
# the safety net for an event lost with a broken stream (a reconnected stream also starts a sweep).
# Events carry what a load needs (the landed chunk, the room's end), so no load waits for it.
_SWEEP_ACTIVE_S = 0.5
_SWEEP_IDLE_S = 1.0
# A step with nothing scheduled while loads are pending waits this long for one of them to end
# (it returns at once when one does). vLLM's engine loop otherwise steps every 1 ms: measured on
# 2 shared cores, a decode engine holding concurrent-leg requests spun ~0.25 of a core (an empty
# step costs ~1.2 ms of CPU) for the whole prefill, taken from the prefill engine; 10 ms still
# left ~0.12. The cost: a request arriving meanwhile is scheduled up to this much later.
IDLE_WAIT_S = 0.02


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
    # The registration the room was expected with: its ring is the only one read for this load.
    rx: DecodeReceiver | None = None
    epoch: int = -1
    # Layer-wise chunks: first layers of the groups scattered as they landed, per chunk id.
    groups_done: dict[int, set[int]] = field(default_factory=dict)


class ConnectorWorker:
    def __init__(self, settings: Settings, shape: CacheShape, tp_size: int, tp_rank: int, produce: bool,
                 consume: bool) -> None:
        self.settings = settings
        self.shape = shape
        layout = shape.layout()
        name = f"vllm-tp{tp_rank}"
        common = {"layout": layout, "tp_size": tp_size, "tp_rank": tp_rank, "ring_bytes": settings.ring_bytes,
                  "socket": settings.socket, "call_timeout": settings.call_timeout_s}
        probe = min(1.0, settings.call_timeout_s)
        self._lock = threading.Lock()
        self._loads: dict[int, _Load] = {}  # by room
        self._by_req: dict[str, int] = {}
        self._finished: list[_Load] = []
        self._releases: list[tuple[DecodeReceiver, int]] = []  # ended rooms, released by the watcher
        self._stop = threading.Event()
        self._ended = threading.Event()  # set when a load ends (wakes an idle step's wait)
        # (epoch, room events) in the lists they arrived in; None asks the watcher for a sweep.
        self._events: queue.SimpleQueue[tuple[int, list[RoomEvent]] | None] = queue.SimpleQueue()
        self.tx_link: Reattach[PrefillSender] | None = None
        self.sends: SendPath | None = None
        if produce:
            self.tx_link = Reattach(
                lambda: PrefillSender(group=settings.prefill_group, name=f"{name}-p", **common),  # type: ignore[arg-type]
                f"{settings.prefill_group} rank {tp_rank}", probe_timeout_s=probe)
            self.sends = SendPath(self.tx_link, shape, settings.acquire_timeout_s)
        self.rx_link: Reattach[DecodeReceiver] | None = None
        try:
            if consume:
                self.rx_link = Reattach(
                    # layer_parts: this worker scatters group-major slots (_layers.scatter_chunk), so
                    # a prefill engine may send its rooms as layer parts.
                    lambda: DecodeReceiver(group=settings.decode_group, name=f"{name}-d", layer_parts=True,
                                           **common),  # type: ignore[arg-type]
                    f"{settings.decode_group} rank {tp_rank}", probe_timeout_s=probe,
                    on_change=lambda up, epoch, why: self._events.put(None))
        except BaseException:
            if self.tx_link is not None:
                self.tx_link.close()
            raise
        self._watcher: threading.Thread | None = None
        if self.rx_link is not None:
            self._watcher = threading.Thread(target=self._watch_loop, name="kvxfer-vllm-load", daemon=True)
            self._watcher.start()
        logger.info("kvxferd connector rank %d/%d: %s, %d layers, %d local of %d KV heads, blocks of %d",
                    tp_rank, tp_size, "+".join(r for r, on in (("prefill", produce), ("decode", consume)) if on),
                    len(shape.layers), shape.local_heads, shape.total_kv_heads, shape.block_size)

    @property
    def tx(self) -> PrefillSender | None:
        """The prefill registration in use now (a daemon restart replaces it)."""
        return self.tx_link.current()[0] if self.tx_link is not None else None

    @property
    def rx(self) -> DecodeReceiver | None:
        """The decode registration in use now (a daemon restart replaces it)."""
        return self.rx_link.current()[0] if self.rx_link is not None else None

    def path_down(self) -> list[str]:
        """What of this rank's transfer path is down now (empty: all up)."""
        return [link.what for link in (self.tx_link, self.rx_link) if link is not None and not link.up]

    def transitions(self) -> int:
        return sum(link.transitions for link in (self.tx_link, self.rx_link) if link is not None)

    # -- prefill -------------------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        """Gathers this step's chunks into ring slots and enqueues them; the step's KV is written."""
        if self.sends is not None:
            self.sends.save(plan)

    def save_layer(self, name: str) -> None:
        """The forward wrote a layer's KV: layer-wise groups complete with it are sent."""
        if self.sends is not None:
            self.sends.save_layer(name)

    def failed_sends(self) -> dict[str, str]:
        """Request ids whose rooms failed here since the last call, with why (for the scheduler)."""
        return self.sends.take_failed() if self.sends is not None else {}

    def start_sends(self, plan: StepPlan) -> None:
        """Before the forward: slots for the step's layer-wise sends (once per plan)."""
        if self.sends is not None:
            self.sends.start(plan)

    # -- decode --------------------------------------------------------------------------------
    def start_loads(self, plan: StepPlan) -> None:
        """The step's loads expected (and layer-wise slots, if start_sends did not take them)."""
        self.start_sends(plan)
        link = self.rx_link
        if link is None:
            return
        for spec in plan.loads:
            ld = _Load(spec)
            with self._lock:
                self._loads[spec.room] = ld
                self._by_req[spec.req_id] = spec.room
            if spec.failed:
                self._finish(ld, f"the prefill side failed: {spec.failed}")
                continue
            try:
                rx, ld.epoch = link.get()
            except KvxferError as exc:
                self._finish(ld, str(exc))
                continue
            ld.rx = rx
            try:
                rx.expect(spec.room, spec.prefill_address, spec.prefill_group, spec.num_tokens,
                          deadline_ms=self.settings.deadline_ms)
            except KvxferError as exc:
                link.failed(exc, ld.epoch)
                self._finish(ld, f"ExpectRoom failed: {exc}")
            else:
                ld.expected = True

    def transfer_results(self, finished_req_ids: Iterable[str], idle: bool = False) -> tuple[set[str], set[str]]:
        """(finished loads, failed loads): request ids; failed ones are in both sets. ``idle``: the
        step scheduled nothing; with loads pending and none ended, wait up to IDLE_WAIT_S for one."""
        finished_req_ids = list(finished_req_ids)
        if idle and not finished_req_ids:
            with self._lock:
                waiting = not self._finished and any(not ld.finished for ld in self._loads.values())
                if waiting:
                    self._ended.clear()  # under the lock: a load ending after this sets it again
            if waiting:
                self._ended.wait(IDLE_WAIT_S)
        for rid in finished_req_ids:
            # A request vLLM finished (aborted) while its KV was loading: end the room; the
            # watcher reports the load once nothing writes into its blocks any more.
            with self._lock:
                room = self._by_req.get(rid)
                ld = self._loads.get(room) if room is not None else None
            if ld is not None and not ld.finished and ld.rx is not None and self.rx_link is not None:
                ld.cancelled = True
                if self.rx_link.up:
                    quiet(ld.rx.abort, ld.spec.room, "request finished on the decode engine")
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
        link = self.rx_link
        assert link is not None
        events = threading.Thread(target=self._event_loop, name="kvxfer-vllm-events", daemon=True)
        events.start()
        while not self._stop.is_set():
            self._release_ended()
            with self._lock:
                busy = any(not ld.finished for ld in self._loads.values())
            try:
                got = self._events.get(timeout=_SWEEP_ACTIVE_S if busy else _SWEEP_IDLE_S)
            except queue.Empty:
                got = None
            if self._stop.is_set():
                return
            self._fail_lost(link)
            if got is not None:
                epoch, batch = got
                try:
                    self._apply(epoch, batch)
                except Exception:  # the watcher must outlive any one list: the sweep picks up the rest
                    logger.exception("applying room events failed; polling the loads instead")
                    self._events.put(None)
                continue
            if not link.up:
                continue  # a stalled daemon: its loads wait for it (or for their deadline)
            with self._lock:
                active = [ld for ld in self._loads.values() if ld.expected and not ld.finished]
            for ld in active:
                self._advance(ld)

    def _fail_lost(self, link: Reattach[DecodeReceiver]) -> None:
        """Loads of a registration whose daemon is gone fail now: that ring will never fill."""
        lost = link.lost_epoch
        with self._lock:
            gone = [ld for ld in self._loads.values() if not ld.finished and 0 <= ld.epoch <= lost]
        for ld in gone:
            self._finish(ld, f"the decode daemon went away ({link.reason or 'registration replaced'})")

    def _event_loop(self) -> None:
        """Hands the daemon's pushed room events to the watcher; re-opens the stream if it breaks
        (and asks for a sweep: events may have been lost meanwhile), with the registration in use."""
        link = self.rx_link
        assert link is not None
        while not self._stop.is_set():
            try:
                rx, epoch = link.get()
            except KvxferError:
                self._stop.wait(0.2)  # down: the healer brings it back (or a new registration)
                continue
            try:
                # layer_progress: layer-wise chunks' groups are scattered as they land, while the
                # prefill still computes the later layers (complete chunks come as before).
                for batch in rx.watch(layer_progress=True).batches():
                    self._events.put((epoch, batch))
                    if self._stop.is_set():
                        return
            except KvxferError as exc:
                # A stream that could not open says the daemon is away or forgot the engine; one
                # that broke after opening leaves it to the sweep's polls to tell.
                if isinstance(exc, NotSent) or exc.code is not grpc.StatusCode.UNAVAILABLE:
                    link.failed(exc, epoch)
                logger.debug("room event stream ended: %s", exc)
            self._events.put(None)
            self._stop.wait(0.2)

    def _apply(self, epoch: int, batch: list[RoomEvent]) -> None:
        """Scatters the chunks a list of events announces, watermarks them in one call, and ends
        the loads whose room ended (after their chunks: the daemon sends a room's end last)."""
        read: dict[int, list[int]] = {}
        rx: DecodeReceiver | None = None
        for ev in batch:
            with self._lock:
                ld = self._loads.get(ev.room)
            if ld is None or ld.finished or ld.epoch != epoch or ld.rx is None:
                continue  # another registration's room of the same id: not this stream's
            rx = ld.rx
            c = ev.landed
            if c is not None and c.chunk_id not in ld.done_chunks:
                try:
                    if c.chunk_complete:
                        self._take(ld, c)
                    else:
                        self._take_layers(ld, c)
                except Exception as exc:
                    quiet(rx.abort, ev.room, f"decode load failed: {exc}")
                    self._finish(ld, str(exc))
                    continue
                if c.chunk_complete:
                    read.setdefault(ev.room, []).append(c.chunk_id)
            if ev.state is RoomState.FAILED:
                self._finish(ld, f"{ev.failure_code}: {ev.failure_reason}")
            elif ev.state is RoomState.SUCCESS:
                if ld.tokens == ld.spec.num_tokens:
                    self._finish(ld, "")
                else:
                    # Events were lost with a broken stream: the room's own status lists every
                    # landed chunk (the second pass ends the load once nothing is fresh).
                    self._advance(ld)
                    if not ld.finished:
                        self._advance(ld)
        # Rooms that ended were released: their chunks need no watermark (nor could take one).
        with self._lock:
            marks = [(room, ids) for room, ids in read.items() if room in self._loads]
        if not marks or rx is None:
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
                    quiet(rx.abort, room, f"decode load failed: watermark: {err}")
                    self._finish(ld, f"watermark failed: {err}")

    def _advance(self, ld: _Load) -> None:
        room, rx, link = ld.spec.room, ld.rx, self.rx_link
        assert rx is not None and link is not None
        try:
            st = rx.poll(room)
            fresh = [c for c in st.landed if c.chunk_id not in ld.done_chunks]
            for c in fresh:
                self._take(ld, c)
            if fresh:
                rx.watermark(room, [c.chunk_id for c in fresh])
            if st.state is RoomState.FAILED:
                self._finish(ld, f"{st.failure_code}: {st.failure_reason}")
            elif st.state is RoomState.SUCCESS and not fresh:
                short = ld.tokens != ld.spec.num_tokens
                self._finish(ld, f"room ended with {ld.tokens} of {ld.spec.num_tokens} tokens" if short else "")
        except Exception as exc:
            if link.failed(exc, ld.epoch):
                return  # the path is down: a lost registration fails the load, a stall leaves it
            quiet(rx.abort, room, f"decode load failed: {exc}")
            self._finish(ld, str(exc))

    def _take(self, ld: _Load, c: Landed) -> None:
        """One landed chunk of a load: into the request's blocks (unless the request was cancelled),
        then counted; a failed scatter counts nothing."""
        if not ld.cancelled:
            self._scatter(ld, c)
        ld.done_chunks.add(c.chunk_id)
        ld.tokens += c.num_tokens

    def _take_layers(self, ld: _Load, c: Landed) -> None:
        """Some layer groups of a chunk landed (not all yet): into the request's blocks now."""
        if not ld.cancelled:
            self._scatter(ld, c, c.layers(len(self.shape.layers)))

    def _scatter(self, ld: _Load, c: Landed, layers: tuple[int, int] | None = None) -> None:
        """A complete chunk (``layers`` None: its groups not scattered yet) or some of its layers."""
        s, spec, rx = self.shape, ld.spec, ld.rx
        assert rx is not None
        lo = max(c.token_start, spec.skip_tokens)
        hi = c.token_start + c.num_tokens
        if lo >= hi:
            return
        src = rx.tensor(c.offset, c.chunk_bytes)
        if 0 < c.layer_group < len(s.layers):
            done = ld.groups_done.setdefault(c.chunk_id, set())
            scatter_chunk(s, src, c, spec.block_ids, lo, layers or (0, len(s.layers)), done)
            if layers is None:
                del ld.groups_done[c.chunk_id]
            return
        if lo > c.token_start:
            # Tokens the decode engine already holds (its prefix-cache hit) stay untouched; the copy
            # takes a contiguous slot, so the rest is copied out once (only a chunk crossing skip_tokens).
            whole = src.view(s.dtype).view(s.local_heads, len(s.layers), 2, c.num_tokens, s.head_size)
            src = whole[:, :, :, lo - c.token_start :].contiguous()
        s.copy("scatter", src, spec.block_ids, 0, lo, hi)

    def _finish(self, ld: _Load, error: str) -> None:
        with self._lock:
            if ld.finished:
                return
            ld.finished, ld.error = True, error
            self._loads.pop(ld.spec.room, None)
            self._by_req.pop(ld.spec.req_id, None)
            self._finished.append(ld)
            self._ended.set()
            if ld.rx is not None:
                # Released by the watcher: a release may wait (page fence) and the step must not.
                self._releases.append((ld.rx, ld.spec.room))
        self._events.put(None)

    def _release_ended(self) -> None:
        with self._lock:
            ended, self._releases = self._releases, []
        link = self.rx_link
        for rx, room in ended:
            if link is not None and link.up and rx is link.current()[0]:
                quiet(rx.release, room)

    def close(self) -> None:
        self._stop.set()
        self._ended.set()
        self._events.put(None)
        for link in (self.tx_link, self.rx_link):
            if link is not None:
                link.close()
        if self._watcher is not None:
            self._watcher.join(timeout=2)
