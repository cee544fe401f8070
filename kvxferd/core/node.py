"""The daemon's domain, as one facade: it builds the parts and routes each call to its owner.

- engines.EngineTable: engines, rings, leases, source slots;
- events.RoomClock / EventHub: room timers, events pushed to engines;
- sender.SendSide + scheduler.Scheduler: prefill rooms, chunks, dispatch to the workers;
- receiver.RecvSide + credits.CreditLedger: decode rooms, granted credits, landed chunks.

The peer layer calls in through the `PeerInbox` methods at the bottom; the servicer through the
engine methods. Nothing here holds state of its own beyond the parts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from kvxferd import __version__
from kvxferd.buffers.host_pool import HostPool, Watermark
from kvxferd.config import Config
from kvxferd.core.caps import (
    CAPS,
    ENGINES,
    OPEN_STREAMS,
    ROOMS_PER_ENGINE,
    ROOMS_PER_PEER,
    STREAMS_PER_ENGINE,
    TOMBSTONES,
    WATCH_BACKLOG,
    WATCHERS_PER_ENGINE,
    CapUsage,
    StreamTicket,
)
from kvxferd.core.engines import Engine, EngineTable, Ring
from kvxferd.core.peer_port import BootstrapAnswer, BootstrapMsg, Identity, Link
from kvxferd.core.room_events import EventHub, RoomClock
from kvxferd.core.rooms import RecvRoom, RoomBase, SendRoom, landed_view
from kvxferd.core.types import ChunkSpec, EngineSpec, FailureCode, Role, RoomKey, RoomState, RoomView, SlotRef
from kvxferd.datapath.credits import CreditLedger, CreditWindow
from kvxferd.datapath.receiver import RecvSide
from kvxferd.datapath.scheduler import Scheduler
from kvxferd.datapath.sender import SendSide
from kvxferd.datapath.workers import WorkerPool
from kvxferd.errors import KvxferError, NotFound
from kvxferd.fleet.registry import Registry
from kvxferd.ops.metrics import Metrics

logger = logging.getLogger(__name__)

QUARANTINE_S = 30.0


class Node:
    def __init__(self, config: Config, pool: HostPool, metrics: Metrics, ident: Identity) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.ident = ident
        self.started = time.monotonic()
        self._loop = asyncio.get_event_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._metrics_pending = False
        self.engines = EngineTable(config, pool, metrics, ident, self.spawn)
        self.hub = EventHub(self.engines)
        self.clock = RoomClock()
        self.ledger = CreditLedger(config.credit_split, QUARANTINE_S, metrics, self.engines.free_slot)
        self.send = SendSide(config, self.engines, self.hub, self.clock, metrics, self.refresh_metrics)
        self.recv = RecvSide(config, self.engines, self.hub, self.clock, metrics, self.ledger, self.refresh_metrics,
                             self.spawn)
        self.engines.on_engine_gone = self._engine_gone
        self.engines.owes_chunks = self.send.owes_chunks
        self.peers_view: Callable[[], list[Link]] = list

    def attach(self, workers: WorkerPool, window: Callable[[Link], CreditWindow],
               connect: Callable[[str], Awaitable[Link]], peers: Callable[[], list[Link]],
               transport_failed: Callable[[Link, str, float], None] | None = None) -> None:
        """Wires in the worker pool and the peer layer, which are built after the node."""
        self.engines.run_blocking = workers.run_blocking
        self.send.scheduler = Scheduler(workers, self.metrics, window, self.send.chunk_done, self.send.fail,
                                        self.recv.local_notif, transport_failed)
        self.recv.connect = connect
        self.peers_view = peers
        workers.expecting = lambda: self.recv.unfinished > 0
        self.refresh_metrics()  # caps and their limits are exported from the start

    def set_registry(self, registry: Registry) -> None:
        self.recv.registry = registry
        self.engines.on_change = registry.groups_changed

    # ------------------------------------------------------------------ plumbing

    @property
    def serving(self) -> bool:
        return self.engines.serving

    @serving.setter
    def serving(self, value: bool) -> None:
        self.engines.serving = value

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def _done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                logger.error("background task %s failed: %r", what, t.exception())

        task.add_done_callback(_done)

    def refresh_metrics(self) -> None:
        """Gauges are recounted at most every 100 ms: recounting per call would cost O(rooms) each."""
        if not self._metrics_pending:
            self._metrics_pending = True
            self._loop.call_later(0.1, self._recount)

    def _recount(self) -> None:
        self._metrics_pending = False
        m = self.metrics
        for role, rooms in (("prefill", self.send.rooms), ("decode", self.recv.rooms)):
            counts = dict.fromkeys(RoomState, 0)
            for room in rooms.values():
                counts[room.state] += 1
            for st, n in counts.items():
                m.rooms.labels(role=role, state=st.name).set(n)
        for role in ("prefill", "decode"):
            m.engines.labels(role=role).set(
                sum(1 for e in self.engines.engines.values() if e.role.name.lower() == role))
        m.slots_held.set(self.slots_held())
        for cap in self.caps():
            m.cap_used.labels(cap=cap.name).set(cap.used)
            m.cap_limit.labels(cap=cap.name).set(cap.limit)

    def _engine_gone(self, eng: Engine, code: FailureCode, reason: str) -> None:
        self.send.engine_gone(eng, code, reason)
        self.recv.engine_gone(eng, code, reason)
        self.refresh_metrics()

    # ------------------------------------------------------------------ engine API

    async def register_engine_async(self, spec: EngineSpec, importer: Callable[[EngineSpec], Ring] | None) -> Engine:
        eng = await self.engines.register_async(spec, importer)
        self.refresh_metrics()
        return eng

    def register_engine(self, spec: EngineSpec, importer: Callable[[EngineSpec], Ring] | None) -> Engine:
        eng = self.engines.register(spec, importer)
        self.refresh_metrics()
        return eng

    def unregister_engine(self, engine_id: str) -> None:
        self.engines.unregister(engine_id)

    def keep_alive(self, engine_id: str) -> float:
        return self.engines.keep_alive(engine_id)

    def lease_s(self, eng: Engine) -> float:
        return self.engines.lease_s(eng)

    def expire_leases(self) -> None:
        self.engines.expire_leases()

    def acquire_slot(self, engine_id: str, num_tokens: int) -> tuple[SlotRef, int]:
        got = self.engines.acquire_slot(engine_id, num_tokens)
        self.refresh_metrics()
        return got

    async def acquire_slot_wait(self, engine_id: str, num_tokens: int, wait_s: float) -> tuple[SlotRef, int]:
        got = await self.engines.acquire_slot_wait(engine_id, num_tokens, wait_s)
        self.refresh_metrics()
        return got

    def release_slot(self, engine_id: str, slot: SlotRef) -> None:
        self.engines.release_slot(engine_id, slot)
        self.refresh_metrics()

    def take_freed(self, engine_id: str) -> list[int]:
        return self.engines.take_freed(engine_id)

    async def wait_freed(self, engine_id: str, believed: list[int], wait_s: float) -> list[int]:
        return await self.engines.wait_freed(engine_id, believed, wait_s)

    def enqueue_chunk(self, engine_id: str, chunk: ChunkSpec) -> None:
        self.send.enqueue(engine_id, chunk)

    def expect_room(self, engine_id: str, key: RoomKey, prefill_address: str, prefill_group: str, num_tokens: int,
                    deadline_ms: int, pages: tuple[int, ...] = ()) -> RecvRoom:
        return self.recv.expect(engine_id, key, prefill_address, prefill_group, num_tokens, deadline_ms, pages)

    def watermark(self, engine_id: str, key: RoomKey, chunk_ids: Iterable[int]) -> Watermark:
        wm = self.recv.watermark(engine_id, key, chunk_ids)
        self.refresh_metrics()
        return wm

    def _own_room(self, eng: Engine, key: RoomKey) -> RoomBase:
        return self.send.own(eng, key) if eng.role.name == "PREFILL" else self.recv.own(eng, key)

    def poll_room(self, engine_id: str, key: RoomKey) -> RoomView:
        eng = self.engines.get(engine_id)
        try:
            room = self._own_room(eng, key)
        except NotFound:
            dead = self.send.tombstoned(key) if eng.role is Role.PREFILL else None
            if dead is None:
                raise
            return RoomView(key, RoomState.FAILED, dead[0], f"decode side: {dead[1]}")
        if isinstance(room, SendRoom):
            w = room.writers.get(eng.rank)
            mine = w is not None and w.engine is eng
            state = room.state
            if not mine and state is RoomState.TRANSFERRING:
                # Other ranks' chunks made the room TRANSFERRING; this rank has sent nothing, so for
                # it the room waits for its input. Engines send once they see WAITING_FOR_INPUT
                # (sglang's scheduler does): TRANSFERRING here left such a rank waiting forever.
                state = RoomState.WAITING_FOR_INPUT
            return RoomView(room.key, state, room.failure_code, room.failure_reason,
                            chunks_done=len(w.done) if mine and w is not None else 0)
        assert isinstance(room, RecvRoom)
        rs = room.readers[eng.rank]
        landed = tuple(
            landed_view(cid, s) for cid, s in sorted(rs.slots.items()) if s.landed and not s.consumed and not s.freed
        )
        return RoomView(room.key, room.state, room.failure_code, room.failure_reason, landed,
                        room.aux if room.state is RoomState.SUCCESS else b"", pages_fenced=room.pages_fenced)

    def abort_room(self, engine_id: str, key: RoomKey, reason: str) -> None:
        eng = self.engines.get(engine_id)
        room = self._own_room(eng, key)
        why = f"aborted by engine {eng.spec.name or eng.id}" + (f": {reason[:200]}" if reason else "")
        if isinstance(room, SendRoom):
            self.send.fail(room, FailureCode.ABORTED, why)
        elif isinstance(room, RecvRoom):
            self.recv.fail(room, FailureCode.ABORTED, why)

    async def release_room(self, engine_id: str, key: RoomKey) -> None:
        eng = self.engines.get(engine_id)
        room = self._own_room(eng, key)
        if not room.finished:
            self.abort_room(engine_id, key, "released before it finished")
        if isinstance(room, RecvRoom) and room.pages_fenced:
            # The engine reuses the room's pages once this returns: not while a WRITE may land there.
            await self.recv.fence.wait(room.key)
            try:
                eng = self.engines.get(engine_id)
                room = self._own_room(eng, key)
            except NotFound:
                return  # released meanwhile (a second call), or the engine is gone
        if isinstance(room, SendRoom):
            self.send.release(eng, room)
        elif isinstance(room, RecvRoom):
            self.recv.release(eng, room)
        self.refresh_metrics()

    def watch(self, engine_id: str, chunk_progress: bool = False, layer_progress: bool = False) -> asyncio.Queue[Any]:
        return self.hub.watch(engine_id, chunk_progress, layer_progress)

    def open_stream(self) -> StreamTicket:
        """A server stream opens: counted (open_streams cap) until its ticket is closed."""
        ticket = self.engines.limits.open_stream()
        self.refresh_metrics()
        return ticket

    def close_stream(self, ticket: StreamTicket) -> None:
        ticket.close()
        self.refresh_metrics()

    def stream_join(self, ticket: StreamTicket, engine_id: str) -> None:
        """A stream names an engine: counted against it (streams_per_engine cap)."""
        self.engines.get(engine_id)
        ticket.join(engine_id)

    def unwatch(self, engine_id: str, q: asyncio.Queue[Any]) -> None:
        self.hub.unwatch(engine_id, q)

    # ------------------------------------------------------------------ status and shutdown

    def active_rooms(self) -> int:
        return sum(1 for r in self.send.rooms.values() if not r.finished) + self.recv.unfinished

    def unread_rooms(self) -> int:
        """Finished rooms that a live engine has not released yet (it may not know the outcome)."""
        n = sum(
            1 for r in self.send.rooms.values()
            if r.finished and any(not w.engine.closing and r.key.id in w.engine.send_rooms for w in r.writers.values())
        )
        return n + sum(
            1 for rr in self.recv.rooms.values()
            if rr.finished and any(not rs.released and not rs.engine.closing for rs in rr.readers.values())
        )

    def fail_all(self, code: FailureCode, reason: str) -> None:
        for sroom in list(self.send.rooms.values()):
            self.send.fail(sroom, code, reason)
        for rroom in list(self.recv.rooms.values()):
            self.recv.fail(rroom, code, reason)

    def slots_held(self) -> int:
        return self.engines.source_slots_held() + self.ledger.slots_held()

    def rooms_with(self, peer: Link) -> int:
        return sum(1 for r in [*self.send.rooms.values(), *self.recv.rooms.values()]
                   if r.peer is peer and not r.finished)

    def caps(self) -> list[CapUsage]:
        """Every cap's figure: per-caller caps report the caller closest to its limit."""
        lim = self.engines.limits
        engines = list(self.engines.engines.values())
        used = {
            ENGINES: len(engines),
            ROOMS_PER_ENGINE: max((len(e.send_rooms) + len(e.recv_rooms) for e in engines), default=0),
            ROOMS_PER_PEER: max(lim.peer_rooms.values(), default=0),
            OPEN_STREAMS: lim.open_streams,
            WATCHERS_PER_ENGINE: max((len(e.watchers) for e in engines), default=0),
            STREAMS_PER_ENGINE: max(lim.engine_streams.values(), default=0),
            WATCH_BACKLOG: self.hub.backlog(),
            TOMBSTONES: self.send.tombstones(),
        }
        return [CapUsage(cap.name, used[cap], lim.limit(cap)) for cap in CAPS]

    def status(self) -> dict[str, object]:
        counts: dict[str, int] = {}
        for r in [*self.send.rooms.values(), *self.recv.rooms.values()]:
            counts[r.state.name] = counts.get(r.state.name, 0) + 1
        return {
            "daemon_id": self.ident.daemon_id,
            "version": __version__,
            "serving": self.serving,
            "engines": list(self.engines.engines.values()),
            "peers": self.peers_view(),
            "rooms_by_state": counts,
            "slots_held": self.slots_held(),
            "pool_bytes": self.pool.size,
            "pool_backing": self.pool.backing,
            "pool_huge_bytes": self.pool.huge_bytes(),
            "uptime_s": time.monotonic() - self.started,
            "peer_address": self.ident.address,
            "caps": self.caps(),
        }

    # ------------------------------------------------------------------ PeerInbox: what peers send us

    def on_bootstrap(self, peer: Link, m: BootstrapMsg) -> BootstrapAnswer:
        known = self.send.rooms.get(m.room.id)
        if known is not None and known.key == m.room:
            # Before bootstrap() hands the room's waiting parts to the scheduler (they are checked
            # against it then); a refused bootstrap adds no reader, so this counts for nothing.
            known.note_layer_parts(m.reader, m.layer_parts)
        try:
            room = self.send.bootstrap(peer, m.room, m.group, m.reader, m.decode_tp, m.layout, m.num_tokens,
                                       m.deadline_unix_ms, m.reader_ring, m.zero_copy, m.notif_token)
        except KvxferError as exc:
            return BootstrapAnswer(m.room, m.reader, exc.code, str(exc))
        room.note_layer_parts(m.reader, m.layer_parts)  # a room this bootstrap created
        assert room.layout is not None
        return BootstrapAnswer(m.room, m.reader, 0, "", room.prefill_tp, room.layout, room.zero_copy)

    def on_bootstrap_reply(self, peer: Link, ans: BootstrapAnswer) -> None:
        self.recv.bootstrap_reply(peer, ans)

    def on_credit_request(self, peer: Link, ring: str, nbytes: int) -> None:
        self.recv.credit_request(peer, ring, nbytes)

    def on_credit_return(self, peer: Link, ids: list[int]) -> None:
        self.ledger.returned(peer, ids)

    def on_complete(self, peer: Link, key: RoomKey, reader: int, num_chunks: int, aux: bytes) -> tuple[int, str]:
        try:
            self.recv.complete(peer, key, reader, num_chunks, aux)
        except KvxferError as exc:
            return exc.code, str(exc)
        return 0, ""

    def on_complete_ack(self, peer: Link, key: RoomKey, reader: int, code: int, message: str) -> None:
        self.send.complete_ack(peer, key, reader, code, message)

    def on_abort(self, peer: Link, key: RoomKey, code: FailureCode, reason: str, quiesced: bool) -> None:
        # Both sides are asked: on this daemon's own link one room id has a send and a receive half.
        # A room the receive side has is never tombstoned for the send side (an abort meant for it).
        got_recv = self.recv.peer_abort(peer, key, code, reason, quiesced)
        got_send = self.send.peer_abort(peer, key, code, reason, remember=not got_recv, quiesced=quiesced)
        if not got_recv and not got_send and peer.up:
            # A room neither side has: the prefill side may reuse whatever it cut for it, and
            # nothing of ours can be writing into the decode side's pages for it.
            peer.send_release(rooms=[key])
            if not quiesced:
                peer.send_abort(key, code, reason, quiesced=True)

    def on_peer_back(self, peer: Link, old_instance: str) -> None:
        self.ledger.peer_back(peer, old_instance)
        self.recv.fence.peer_back(peer, old_instance)

    def on_peer_gone(self, peer: Link, instance: str) -> None:
        self.ledger.peer_gone(peer, instance)
        self.recv.fence.peer_gone(peer, instance)

    def on_notifs(self, notifs: Iterable[tuple[str, bytes]]) -> None:
        self.recv.on_notifs(notifs)

    def on_peer_lost(self, peer: Link, reason: str) -> None:
        self.send.peer_lost(peer, reason)
        self.recv.peer_lost(peer, reason)
        self.refresh_metrics()

