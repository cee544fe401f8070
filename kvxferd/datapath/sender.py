"""The send (prefill) side: send rooms, chunks enqueued by prefill engines (whole, or as layer parts
closed by a seal: kvxferd.datapath.parts), bootstraps from decode daemons, completion, failures, and
tombstones of rooms the decode side gave up on early (kvxferd.datapath.tombstones).

Everything here runs on the event loop and talks to peers only through `ports.Link`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvxfer_protocol.limits import MAX_AUX_BYTES, MAX_CHUNK_ID
from kvxfer_protocol.slot_layout import KVLayout, plan
from kvxferd.config import Config
from kvxferd.core.caps import MAX_GROUP, ROOMS_PER_ENGINE, ROOMS_PER_PEER, TOMBSTONES
from kvxferd.core.engines import MAX_TOKENS, Engine, EngineTable
from kvxferd.core.peer_port import Link
from kvxferd.core.room_events import EventHub, RoomClock, count_finished, deadline_reason
from kvxferd.core.rooms import OutChunk, RoomBase, SendRoom, WriterState
from kvxferd.core.types import ChunkSpec, FailureCode, Role, RoomKey, RoomState, ZeroCopyTarget
from kvxferd.datapath.admission import check_group, check_part_joins, check_reader
from kvxferd.datapath.notif import TOKEN_BYTES
from kvxferd.datapath.parts import missing_layers, new_mask
from kvxferd.datapath.scheduler import Scheduler
from kvxferd.datapath.tombstones import Tombstones
from kvxferd.errors import AlreadyExists, FailedPrecondition, InvalidArgument, KvxferError, NotFound, Unavailable
from kvxferd.ops.metrics import Metrics

logger = logging.getLogger(__name__)


class SendSide:
    def __init__(self, config: Config, engines: EngineTable, hub: EventHub, clock: RoomClock, metrics: Metrics,
                 refresh: Callable[[], None]) -> None:
        self.config = config
        self.engines = engines
        self.hub = hub
        self.clock = clock
        self.metrics = metrics
        self.refresh = refresh
        self.rooms: dict[int, SendRoom] = {}
        self.scheduler: Scheduler  # set by the node once the workers exist
        self._tombstones = Tombstones()
        self._part_events = {e: metrics.layer_parts.labels("prefill", e) for e in ("enqueued", "sealed", "refused")}

    # ------------------------------------------------------------------ rooms

    def _new_room(self, key: RoomKey, group: str) -> SendRoom:
        spec = self.engines.group_spec(group, Role.PREFILL)
        if spec is None:
            raise NotFound(f"no prefill engine of group {group!r} is registered on this daemon")
        room = SendRoom(key, self.config.room_deadline_s, group, spec.parallel.tp_size, spec.layout)
        self.rooms[key.id] = room
        self.clock.arm_deadline(room, self.config.room_deadline_s, self._deadline)
        logger.debug("room %s: prefill side created (group %s)", key, group)
        return room

    def _room_for(self, key: RoomKey, group: str) -> SendRoom:
        room = self.rooms.get(key.id)
        if room is not None:
            if key.generation < room.key.generation:
                raise FailedPrecondition(f"room {key}: stale generation (current generation is {room.key.generation})")
            if key.generation > room.key.generation:
                self.fail(room, FailureCode.SUPERSEDED, f"room id reused with generation {key.generation}")
                self._forget(room)
                room = None
            elif room.group != group:
                raise InvalidArgument(f"room {key} belongs to prefill group {room.group!r}, not {group!r}")
        return room if room is not None else self._new_room(key, group)

    def _admit_room(self, key: RoomKey, group: str, room: SendRoom | None) -> SendRoom:
        """The room a chunk goes to when it is not the current generation of a room of its group:
        a new room, a newer generation, or a refusal (draining, tombstoned, stale, other group)."""
        if room is None or room.key.generation < key.generation:
            if not self.engines.serving:
                raise Unavailable("daemon is draining and accepts no new rooms")
            dead = self._tombstones.get(key)
            if dead is not None:
                raise FailedPrecondition(f"room {key} is FAILED ({dead[0].name}) on the decode side: {dead[1]}")
        return self._room_for(key, group)

    def owes_chunks(self, eng: Engine) -> bool:
        """Does an unfinished room still wait for chunks from this engine's rank?"""
        for room in self.rooms.values():
            if room.finished or room.group != eng.spec.group:
                continue
            w = room.writers.get(eng.rank)
            if w is None or (w.engine is eng and w.last_id is None):
                return True
        return False

    # ------------------------------------------------------------------ chunks from engines

    def _check_chunk(self, eng: Engine, chunk: ChunkSpec, with_slot: bool = True) -> None:
        """`with_slot`: check the slot (or pages) too; False for a seal and a layer part after the
        first (the chunk's slot is the daemon's already: they must name the same, parts.py)."""
        if not 0 <= chunk.chunk_id < MAX_CHUNK_ID:
            raise InvalidArgument(f"chunk_id must be < {MAX_CHUNK_ID}, got {chunk.chunk_id}")
        if not 1 <= chunk.num_tokens <= MAX_TOKENS or chunk.token_start + chunk.num_tokens > MAX_TOKENS:
            raise InvalidArgument(f"token range [{chunk.token_start}, +{chunk.num_tokens}) is invalid")
        if len(chunk.aux) > MAX_AUX_BYTES:
            raise InvalidArgument(f"aux is {len(chunk.aux)} B; at most {MAX_AUX_BYTES} B")
        if chunk.aux and not chunk.last:
            raise InvalidArgument("aux may only accompany the last chunk")
        if not with_slot:
            return
        if eng.spec.zero_copy:
            # A chunk may start mid-page: its pages are those its tokens touch, from the one holding
            # token_start (which the previous chunk may have sent part of).
            offset = chunk.token_start % eng.spec.layout.page_size
            self.engines.check_pages(eng, chunk.pages, offset + chunk.num_tokens, "chunk")
            return
        if chunk.pages:
            raise InvalidArgument("pages are only for zero-copy engines; this engine sends slots")
        slot = chunk.slot
        if chunk.claim:
            self.engines.check_claim(eng, slot, eng.token_bytes * chunk.num_tokens)
            return
        if slot.offset not in eng.acquired:
            raise InvalidArgument(
                f"slot at offset {slot.offset} is not a slot this engine acquired (or it was already enqueued)"
            )
        held = eng.ring.alloc.slot_length(slot.offset) or 0
        need = eng.token_bytes * chunk.num_tokens
        if slot.length > held:
            raise InvalidArgument(f"slot length {slot.length} exceeds the acquired {held} B")
        if need > held:
            raise InvalidArgument(f"{chunk.num_tokens} tokens need {need} B but the slot holds {held} B")

    def _prior(self, eng: Engine, chunk: ChunkSpec) -> OutChunk | None:
        """What this engine enqueued before of a part's chunk (its first part), if anything."""
        room = self.rooms.get(chunk.room.id)
        if room is None or room.key != chunk.room or room.group != eng.spec.group:
            return None
        w = room.writers.get(eng.rank)
        return w.chunks.get(chunk.chunk_id) if w is not None and w.engine is eng else None

    def enqueue(self, engine_id: str, chunk: ChunkSpec) -> None:
        eng = self.engines.get(engine_id, Role.PREFILL)
        key = chunk.room
        prior = self._prior(eng, chunk) if chunk.is_part else None
        try:
            self._check_chunk(eng, chunk, with_slot=prior is None and not chunk.is_seal)
            self._enqueue(eng, key, chunk, prior)
        except KvxferError:
            if chunk.is_part:
                self._part_events["refused"].inc()
            raise

    def _enqueue(self, eng: Engine, key: RoomKey, chunk: ChunkSpec, prior: OutChunk | None) -> None:
        if key.id not in eng.send_rooms:
            self.engines.limits.check(ROOMS_PER_ENGINE, len(eng.send_rooms), f" for engine {eng.id}")
        room = self.rooms.get(key.id)
        if room is None or room.key.generation != key.generation or room.group != eng.spec.group:
            room = self._admit_room(key, eng.spec.group, room)
        if room.finished:
            raise FailedPrecondition(
                f"room {key} is {room.state.name}" + (f": {room.failure_reason}" if room.state is RoomState.FAILED else "")
            )
        if room.num_tokens is not None and chunk.token_start + chunk.num_tokens > room.num_tokens:
            raise InvalidArgument(
                f"room {key}: tokens [{chunk.token_start}, {chunk.token_start + chunk.num_tokens}) "
                f"exceed the room's {room.num_tokens} tokens"
            )
        rank = eng.rank
        w = room.writers.get(rank)
        if w is not None and w.engine is not eng:
            raise FailedPrecondition(f"room {key}: rank {rank} is already sending from another engine")
        if w is None:
            w = WriterState(eng)
        if chunk.is_part:
            check_part_joins(room, rank, chunk, prior)
        elif chunk.chunk_id in w.chunks:
            raise AlreadyExists(f"room {key}: chunk {chunk.chunk_id} was already enqueued by rank {rank}")
        elif room.has_parts:
            check_group(room, chunk)
        if w.last_id is not None and chunk.chunk_id > w.last_id:
            raise InvalidArgument(f"room {key}: chunk {chunk.chunk_id} comes after the last chunk {w.last_id}")
        if chunk.last and w.chunks and max(w.chunks) > chunk.chunk_id:
            raise InvalidArgument(f"room {key}: last chunk {chunk.chunk_id} precedes chunk {max(w.chunks)}")
        # Accepted: from here on the daemon owns the slot.
        room.writers[rank] = w
        eng.send_rooms.add(key.id)
        if chunk.is_part:
            self._part_events["sealed" if chunk.is_seal else "enqueued"].inc()
            if prior is not None:
                self._next_part(room, w, chunk, prior)
                return
        if chunk.claim:
            self.engines.take_claim(eng, chunk.slot, chunk.claim)
        else:
            eng.acquired.discard(chunk.slot.offset)
        out = OutChunk(rank, eng, chunk, slot_freed=eng.spec.zero_copy)
        if chunk.is_part:
            assert room.layout is not None
            out.layers = new_mask(chunk, room.layout.num_layers)
            out.layers.add(chunk.layer_start, chunk.layer_end)
            room.has_parts = True
        w.chunks[chunk.chunk_id] = out
        if chunk.last:
            w.last_id = chunk.chunk_id
            w.aux = chunk.aux
        if room.first_chunk_at is None:
            room.first_chunk_at = time.monotonic()
        if room.bootstrapped and room.state < RoomState.TRANSFERRING and room.advance(RoomState.TRANSFERRING):
            self.hub.send_state(room)
        self.scheduler.submit(room, out)
        self.refresh()

    def _next_part(self, room: SendRoom, w: WriterState, chunk: ChunkSpec, out: OutChunk) -> None:
        """A seal, or a part of a chunk whose first part brought its slot."""
        assert out.layers is not None
        if chunk.is_seal:
            out.layers.sealed = True
            w.last_id, w.aux = chunk.chunk_id, chunk.aux
            assert room.layout is not None
            why = missing_layers({c: o.layers for c, o in w.chunks.items()}, room.layout.num_layers)
            if why:  # as a token gap at completion: the room fails on both sides, MISMATCH
                self.fail(room, FailureCode.MISMATCH, f"prefill rank {out.writer} sealed, but {why}")
            else:
                self._maybe_complete(room)  # every layer may have been written before the seal
        elif out.layers.add(chunk.layer_start, chunk.layer_end):
            self.scheduler.submit_soon(room, out)
        self.refresh()

    # ------------------------------------------------------------------ bootstrap from a decode daemon

    def bootstrap(
        self, peer: Link, key: RoomKey, group: str, reader: int, decode_tp: int, layout: KVLayout, num_tokens: int,
        deadline_unix_ms: int, reader_ring: str, zero_copy: ZeroCopyTarget | None = None, notif_token: bytes = b"",
    ) -> SendRoom:
        if len(notif_token) != TOKEN_BYTES:
            raise InvalidArgument(f"room {key}: the Bootstrap carries no {TOKEN_BYTES}-byte notif_token (a decode "
                                  "daemon older than this one: upgrade both)")
        if not 1 <= decode_tp <= 1024 or not 0 <= reader < decode_tp:
            raise InvalidArgument(f"reader rank {reader} must be in [0, decode_tp={decode_tp})")
        if not 1 <= num_tokens <= MAX_TOKENS:
            raise InvalidArgument(f"num_tokens must be 1..{MAX_TOKENS}")
        if len(group) > MAX_GROUP or len(reader_ring) > MAX_GROUP:
            raise InvalidArgument(f"group and reader_ring are names of at most {MAX_GROUP} characters")
        room = self.rooms.get(key.id)
        fresh = room is None or room.key.generation < key.generation  # a new room, or a newer generation
        if fresh:
            self.engines.require_serving()
            dead = self.tombstoned(key)
            if dead is not None:
                # Failed (here, or by a decode side) and let go of: nobody will send it again.
                raise FailedPrecondition(f"room {key} failed before this bootstrap ({dead[0].name}): {dead[1]}")
        if room is None or fresh or not room.cap_peer:
            # Checked before anything is created: a peer at its cap changes nothing here.
            self.engines.limits.check(ROOMS_PER_PEER, self.engines.limits.peer_rooms.get(peer.address, 0),
                                      f" for peer {peer.address}")
        if room is not None and not fresh:
            self._check_joinable(peer, key, group, room)
            if room.notif_token and room.notif_token != notif_token:
                raise InvalidArgument(f"room {key}: readers name different notification tokens")
        engines = self.engines.group(group, Role.PREFILL)
        if not engines:
            raise NotFound(f"no prefill engine of group {group!r} is registered on this daemon")
        # Every check runs before a room is created or an older generation superseded, so a refused
        # bootstrap leaves no room behind. The decode side fails its half on the refusal: a room
        # this one would join fails with it, and a room we do not have yet is tombstoned (as if the
        # decode side had aborted it), so neither waits for its deadline.
        try:
            check_reader(None if fresh else room, engines[0].spec, key, reader, decode_tp, layout, num_tokens,
                               zero_copy)
        except KvxferError as exc:
            why = f"bootstrap of decode reader {reader} refused: {exc}"
            if room is not None and not fresh:
                self.fail(room, FailureCode.MISMATCH, why, push=False)
            else:
                self.peer_abort(peer, key, FailureCode.MISMATCH, why)
            raise
        room = self._room_for(key, group)
        assert room.layout is not None
        if zero_copy is not None:
            room.zero_copy = True
            room.zc_targets[reader] = zero_copy
        room.peer = peer
        room.notif_token = notif_token
        if not room.cap_peer:
            self.engines.limits.peer_room_added(peer.address)
            room.cap_peer = peer.address
        room.decode_tp = decode_tp
        room.num_tokens = num_tokens
        room.readers.add(reader)
        room.reader_rings[reader] = reader_ring
        if deadline_unix_ms:
            remaining = deadline_unix_ms / 1000 - time.time()
            self.clock.arm_deadline(room, max(0.0, remaining), self._deadline)
        if len(room.readers) == decode_tp and not room.bootstrapped:
            room.plan = plan(room.prefill_tp, decode_tp, room.layout.total_kv_heads, room.layout.mla)
            room.bootstrapped = True
            room.advance(RoomState.WAITING_FOR_INPUT)
            if room.writers:
                room.advance(RoomState.TRANSFERRING)
            logger.debug("room %s: bootstrapped by %d reader(s) of %s", key, decode_tp, peer.daemon_id)
            self.hub.send_state(room)
            self.scheduler.room_ready(room)
        self.refresh()
        return room

    def _check_joinable(self, peer: Link, key: RoomKey, group: str, room: SendRoom) -> None:
        """Refusals that leave the room as it is: an old generation, another group, a room that
        ended (its own failure goes to the decode side), a room another decode daemon bootstraps."""
        if key.generation < room.key.generation:
            raise FailedPrecondition(f"room {key}: stale generation (current generation is {room.key.generation})")
        if room.group != group:
            raise InvalidArgument(f"room {key} belongs to prefill group {room.group!r}, not {group!r}")
        if room.finished:
            if room.state is RoomState.FAILED:
                # The decode side learns the room's own failure (code and reason), not a refusal.
                peer.send_abort(room.key, room.failure_code, room.failure_reason, quiesced=room.in_flight == 0)
            raise FailedPrecondition(f"room {key} is already {room.state.name}: {room.failure_reason}")
        if room.peer is not None and room.peer is not peer:
            raise InvalidArgument(f"room {key} is bootstrapped by another decode daemon")

    # ------------------------------------------------------------------ progress and completion

    def chunk_done(self, room: SendRoom, chunk: OutChunk) -> None:
        """All parts of a chunk are written (or the room failed): give back the source slot."""
        if room.owe_quiesced and room.in_flight == 0:
            self._quiesced(room)
        complete = chunk.complete  # a layer-wise chunk keeps its slot until every layer is written
        if not chunk.slot_freed and chunk.in_flight == 0 and (complete or room.finished):
            chunk.slot_freed = True
            self.engines.free_slot(chunk.engine, chunk.spec.slot.offset)
        if room.finished or chunk.done or chunk.parts_pending or not complete:
            self.refresh()
            return
        chunk.done = True
        w = room.writers[chunk.writer]
        w.done.add(chunk.spec.chunk_id)
        self.hub.chunk_written(room, chunk.writer)
        self._maybe_complete(room)

    def _maybe_complete(self, room: SendRoom) -> None:
        """Every writer sent and wrote its last chunk (a layer-wise one: sealed): Complete goes."""
        if room.all_writers_finished() and not room.complete_sent:
            last_ids = {w.last_id for w in room.writers.values()}
            if len(last_ids) != 1:
                self.fail(room, FailureCode.MISMATCH, f"writers disagree on the last chunk: {last_ids}")
                return
            why = room.token_gap()
            if why:
                self.fail(room, FailureCode.MISMATCH, why)
                return
            assert room.peer is not None and room.decode_tp is not None
            room.complete_sent = True
            last = last_ids.pop()
            assert last is not None
            aux = room.writers[0].aux if 0 in room.writers else b""
            room.acks_pending = set(range(room.decode_tp))
            for r in range(room.decode_tp):
                room.peer.send_complete(room.key, r, last + 1, aux)

    def complete_ack(self, peer: Link, key: RoomKey, reader: int, code: int, message: str) -> None:
        room = self.rooms.get(key.id)
        if room is None or room.key != key or room.peer is not peer or room.finished:
            return
        if code:
            self.fail(room, FailureCode.MISMATCH, f"decode side refused completion: {message}", push=False)
            return
        room.acks_pending.discard(reader)
        if room.complete_sent and not room.acks_pending and room.advance(RoomState.SUCCESS):
            count_finished(self.metrics, room)
            logger.debug("room %s: prefill side SUCCESS", room.key)
            self.hub.send_state(room)
            self.clock.arm_gc(room, self._gc)
            self.refresh()

    # ------------------------------------------------------------------ failure

    def fail(self, room: SendRoom, code: FailureCode, reason: str, push: bool = True) -> None:
        if not room.fail(code, reason):
            return
        logger.warning("room %s: prefill side FAILED (%s): %s", room.key, code.name, reason)
        self.metrics.room_failures.labels(reason=code.name).inc()
        count_finished(self.metrics, room)
        self.scheduler.room_failed(room)
        for w in room.writers.values():
            for c in w.chunks.values():
                if c.in_flight == 0 and not c.slot_freed:
                    c.slot_freed = True
                    self.engines.free_slot(c.engine, c.spec.slot.offset)
        if push and room.peer is not None and room.peer.up:
            room.peer.send_abort(room.key, code, reason, quiesced=room.in_flight == 0)
        if room.zero_copy and room.in_flight:
            room.owe_quiesced = True
        self.hub.send_state(room)
        self.clock.arm_gc(room, self._gc)
        self.refresh()

    def _quiesced(self, room: SendRoom) -> None:
        room.owe_quiesced = False
        if room.peer is not None and room.peer.up:
            logger.debug("room %s: no WRITE in flight any more; telling the decode side", room.key)
            room.peer.send_abort(room.key, room.failure_code, room.failure_reason, quiesced=True)

    def _deadline(self, room: RoomBase) -> None:
        assert isinstance(room, SendRoom)
        if not room.finished:
            self.fail(room, FailureCode.DEADLINE, deadline_reason(room))

    def _gc(self, room: RoomBase) -> None:
        assert isinstance(room, SendRoom)
        if room.in_flight:
            self.clock.rearm_gc(room, self._gc)
            return
        self._forget(room)
        self.refresh()

    def _forget(self, room: SendRoom) -> None:
        if self.rooms.get(room.key.id) is room:
            del self.rooms[room.key.id]
        if room.cap_peer:
            self.engines.limits.peer_room_gone(room.cap_peer)
            room.cap_peer = ""
        for w in room.writers.values():
            w.engine.send_rooms.discard(room.key.id)
        self.clock.cancel(room)


    # ------------------------------------------------------------------ peers and engines

    def peer_abort(self, peer: Link, key: RoomKey, code: FailureCode, reason: str, remember: bool = True,
                   quiesced: bool = True) -> bool:
        """The decode side failed a room; False if no room of ours matches (then, with `remember`,
        the room is tombstoned). `quiesced` False: an abort from the decode side, which a
        zero-copy room answers once quiesced."""
        room = self.rooms.get(key.id)
        # A room no decode daemon has bootstrapped (its engines' chunks and slots wait for one) is
        # failed by the first decode daemon that gives up on it (kvxferd.core.rooms.abort_unseen).
        if room is not None and room.key == key and (room.peer is peer or room.peer is None):
            self.fail(room, code, f"decode side: {reason}", push=False)
            if room.zero_copy and not quiesced:
                # The decode side fences the room's pages until we answer (again, if it asks
                # after a lost session): at once, or when the last WRITE is reported.
                if room.in_flight:
                    room.owe_quiesced = True
                else:
                    self._quiesced(room)
            return True
        if remember and (room is None or room.key.generation < key.generation):
            # The decode side gave up on a room before any prefill rank sent a chunk (its deadline,
            # an abort): remember it, or the first chunk would open a room nobody bootstraps,
            # holding the engine's slots until our own deadline.
            self._remember(key, code, reason)
        return False

    def _remember(self, key: RoomKey, code: FailureCode, reason: str) -> None:
        """A tombstone: a failed room we do not hold (kvxferd.datapath.tombstones)."""
        self._tombstones.remember(key, code, reason, self.engines.limits.limit(TOMBSTONES))

    def peer_lost(self, peer: Link, reason: str) -> None:
        for room in list(self.rooms.values()):
            if room.peer is peer and not room.finished:
                self.fail(room, FailureCode.PEER_LOST, reason, push=False)

    def engine_gone(self, eng: Engine, code: FailureCode, reason: str) -> None:
        for rid in list(eng.send_rooms):
            room = self.rooms.get(rid)
            if room is not None:
                self.fail(room, code, f"{reason} (prefill rank {eng.rank})")
        if eng.role is not Role.PREFILL:
            return
        # Rooms of its group that this rank had not joined yet can never get its part now.
        for room in list(self.rooms.values()):
            if room.group == eng.spec.group and not room.finished and eng.rank not in room.writers:
                self.fail(room, code, f"{reason} (prefill rank {eng.rank}, before its first chunk)")

    def release(self, eng: Engine, room: SendRoom) -> None:
        eng.send_rooms.discard(room.key.id)
        room.released_by.add(eng.rank)
        # Forgotten only once every rank of the group let go: a rank that has not sent its first
        # chunk yet must find the room (and its outcome), not open a new one nobody bootstraps.
        # Otherwise the finished room's collection timer forgets it.
        if len(room.released_by) == room.prefill_tp and not any(
                room.key.id in w.engine.send_rooms for w in room.writers.values()):
            if room.state is RoomState.FAILED:
                # A decode side that bootstraps it later must learn the outcome, not open a room
                # no engine will send (it would wait for its deadline).
                self._remember(room.key, room.failure_code, room.failure_reason)
            self._forget(room)

    def own(self, eng: Engine, key: RoomKey) -> SendRoom:
        """A room of this engine's group: a rank may ask about it before its own first chunk."""
        room = self.rooms.get(key.id)
        if room is None or room.key.generation != key.generation or room.group != eng.spec.group:
            raise NotFound(f"room {key} has no chunks from this engine's group")
        return room

    def tombstones(self) -> int:
        return len(self._tombstones)

    def tombstoned(self, key: RoomKey) -> tuple[FailureCode, str] | None:
        """The decode side's failure of a room we never had, while remembered."""
        return self._tombstones.get(key)
