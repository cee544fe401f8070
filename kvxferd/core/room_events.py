"""The room clock (deadlines, garbage collection of finished rooms) and room events to engines.

Engines never poll: every state change and every landed chunk is pushed to the engine's
watchers (WatchRooms streams) as it happens. Layer ranges of a chunk (layer parts) go only to
watchers that asked (layer_progress), merged per loop turn: the parts one NIXL poll delivered
cost one event, not one each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from kvxferd.core.caps import WATCH_BACKLOG, WATCHERS_PER_ENGINE
from kvxferd.core.engines import Engine, EngineTable
from kvxferd.core.rooms import InSlot, ReaderState, RecvRoom, RoomBase, SendRoom, WriterState, landed_view
from kvxferd.core.types import RoomEvent, RoomState
from kvxferd.datapath.landing import runs
from kvxferd.errors import CapExceeded, KvxferError
from kvxferd.ops.metrics import Metrics

logger = logging.getLogger(__name__)

FINISHED_ROOM_TTL_S = 60.0


class RoomClock:
    """Per-room timers. A room has at most one deadline and one GC timer; finishing a room swaps
    its deadline for the GC timer."""

    def __init__(self) -> None:
        self._loop = asyncio.get_event_loop()

    def arm_deadline(self, room: RoomBase, seconds: float, fire: Callable[[RoomBase], None]) -> None:
        if room.deadline_handle is not None:
            room.deadline_handle.cancel()
        room.deadline_handle = self._loop.call_later(seconds, fire, room)

    def arm_gc(self, room: RoomBase, fire: Callable[[RoomBase], None], seconds: float = FINISHED_ROOM_TTL_S) -> None:
        if room.deadline_handle is not None:
            room.deadline_handle.cancel()
            room.deadline_handle = None
        if room.gc_handle is None:
            room.gc_handle = self._loop.call_later(seconds, fire, room)

    def rearm_gc(self, room: RoomBase, fire: Callable[[RoomBase], None]) -> None:
        room.gc_handle = self._loop.call_later(FINISHED_ROOM_TTL_S, fire, room)

    @staticmethod
    def cancel(room: RoomBase) -> None:
        for h in (room.deadline_handle, room.gc_handle):
            if h is not None:
                h.cancel()
        room.deadline_handle = room.gc_handle = None


def deadline_reason(room: RoomBase) -> str:
    return f"deadline passed after {time.monotonic() - room.created:.1f} s in state {room.state.name}"


def count_finished(metrics: Metrics, room: RoomBase) -> None:
    """A room reached SUCCESS or FAILED: counted once, by role and state, with its duration."""
    metrics.rooms_finished.labels(role=room.role, state=room.state.name).inc()
    if room.state is RoomState.SUCCESS:
        metrics.room_duration.labels(role=room.role).observe(time.monotonic() - room.created)


class EventHub:
    """Fans room events out to the watchers of the engines a room concerns."""

    def __init__(self, engines: EngineTable) -> None:
        self._engines = engines
        # Layers of chunks that landed this loop turn and did not complete their chunk, per
        # (room id, reader rank, chunk id), for layer_progress watchers; sent at the turn's end.
        self._layers: dict[tuple[int, int, int], tuple[RecvRoom, ReaderState, InSlot, int]] = {}
        self._flush_soon: asyncio.Handle | None = None

    def watch(self, engine_id: str, chunk_progress: bool = False,
              layer_progress: bool = False) -> asyncio.Queue[RoomEvent | KvxferError | None]:
        eng = self._engines.get(engine_id)
        self._engines.limits.check(WATCHERS_PER_ENGINE, len(eng.watchers), f" for engine {engine_id}")
        q: asyncio.Queue[RoomEvent | KvxferError | None] = asyncio.Queue()
        eng.watchers.add(q)
        if chunk_progress:
            eng.progress_watchers.add(q)
        if layer_progress:
            eng.layer_watchers.add(q)
        return q

    def unwatch(self, engine_id: str, q: asyncio.Queue[RoomEvent | KvxferError | None]) -> None:
        eng = self._engines.engines.get(engine_id)
        if eng is not None:
            eng.watchers.discard(q)
            eng.progress_watchers.discard(q)
            eng.layer_watchers.discard(q)

    def publish(self, eng: Engine, ev: RoomEvent, progress_only: bool = False,
                to: set[asyncio.Queue[RoomEvent | KvxferError | None]] | None = None) -> None:
        """`to`: these watchers of the engine (default: every one, or those asking progress)."""
        backlog = self._engines.limits.limit(WATCH_BACKLOG)
        for q in list(to if to is not None else eng.progress_watchers if progress_only else eng.watchers):
            if q.qsize() < backlog:
                q.put_nowait(ev)
                continue
            # A watcher that stopped reading would otherwise grow its queue for ever: its stream ends
            # (RESOURCE_EXHAUSTED); the engine's other watchers and calls are untouched.
            eng.watchers.discard(q)
            eng.progress_watchers.discard(q)
            eng.layer_watchers.discard(q)
            q.put_nowait(CapExceeded(
                f"{WATCH_BACKLOG.name} cap reached for engine {eng.id}: {backlog} events unread "
                f"(config {WATCH_BACKLOG.key}); this stream is closed, open another and read it"))
            logger.warning("engine %s: a WatchRooms reader fell %d events behind (room %s); stream closed",
                           eng.id, backlog, ev.room)

    def backlog(self) -> int:
        """The longest queue of any watcher (the watch_backlog cap's figure)."""
        return max((q.qsize() for e in self._engines.engines.values() for q in e.watchers), default=0)

    @staticmethod
    def _writer_event(room: SendRoom, w: WriterState) -> RoomEvent:
        return RoomEvent(room.key, room.state, room.failure_code, room.failure_reason, chunks_done=len(w.done))

    def send_state(self, room: SendRoom) -> None:
        for w in room.writers.values():
            self.publish(w.engine, self._writer_event(room, w))

    def chunk_written(self, room: SendRoom, writer: int) -> None:
        """A writer's chunk is written. The first one is news to every watcher of that engine (a
        writer that joined after the room went TRANSFERRING has not heard so); later ones only to
        watchers that asked for progress: an event per chunk costs a stream write here and a
        wake-up of the engine's watcher, for a state it already knows."""
        w = room.writers[writer]
        self.publish(w.engine, self._writer_event(room, w), progress_only=len(w.done) > 1)

    def recv_state(self, room: RecvRoom, aux: bytes = b"") -> None:
        self.flush_layers()  # a room's layer events come before its end
        ev = RoomEvent(room.key, room.state, room.failure_code, room.failure_reason, aux=aux,
                       pages_fenced=room.pages_fenced)
        for rs in room.readers.values():
            self.publish(rs.engine, ev)

    def landed(self, room: RecvRoom, rs: ReaderState, cid: int, slot: InSlot, new: int, complete: bool) -> None:
        """Layers of a chunk that the reader now holds (`new`, never 0). A chunk's completion
        goes out at once (with its layers not sent yet, to layer_progress watchers), as whole
        chunks always did: SUCCESS may follow in the same call and must come after it."""
        eng = rs.engine
        key = (room.key.id, eng.rank, cid)
        if not complete:
            if eng.layer_watchers:
                held = self._layers.pop(key, (room, rs, slot, 0))[3]
                self._layers[key] = (room, rs, slot, held | new)
                if self._flush_soon is None:
                    self._flush_soon = asyncio.get_running_loop().call_soon(self.flush_layers)
            return
        held = self._layers.pop(key, (room, rs, slot, 0))[3] | new
        self.flush_layers()
        if eng.layer_watchers:
            self._publish_layers(room, rs, cid, slot, held)
            plain = eng.watchers - eng.layer_watchers
        else:
            plain = eng.watchers
        if plain:
            self.publish(eng, RoomEvent(room.key, room.state, landed=landed_view(cid, slot)), to=plain)

    def flush_layers(self) -> None:
        """Sends the layer ranges gathered this loop turn, one event per contiguous range and chunk."""
        if self._flush_soon is not None:
            self._flush_soon.cancel()
            self._flush_soon = None
        pending, self._layers = self._layers, {}
        for (_, _, cid), (room, rs, slot, held) in pending.items():
            if not room.finished:
                self._publish_layers(room, rs, cid, slot, held)

    def _publish_layers(self, room: RecvRoom, rs: ReaderState, cid: int, slot: InSlot, held: int) -> None:
        to, spans = rs.engine.layer_watchers, runs(held)
        for i, span in enumerate(spans):
            view = landed_view(cid, slot, span)
            if view.chunk_complete and i < len(spans) - 1:  # only the last range completes the chunk
                view = dataclasses.replace(view, chunk_complete=False)
            self.publish(rs.engine, RoomEvent(room.key, room.state, landed=view), to=to)
