"""The receive (decode) side: rooms decode engines expect, bootstraps to prefill daemons, credits
granted to them, landed notifications, completion, watermarks and failures.

Landed chunks and room ends are pushed to the decode engine (events.EventHub); a chunk's range
goes back to the prefill side as soon as the engine watermarks it, or when the room ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Literal

from kvxfer_protocol.limits import MAX_AUX_BYTES, MAX_CHUNK_ID
from kvxfer_protocol.slot_layout import part_bytes, plan
from kvxferd.buffers.host_pool import Watermark
from kvxferd.config import Config, _valid_hostport
from kvxferd.core.caps import MAX_ADDRESS, MAX_GROUP, ROOMS_PER_ENGINE, check_len
from kvxferd.core.engines import MAX_TOKENS, Engine, EngineTable
from kvxferd.core.peer_port import BootstrapAnswer, BootstrapMsg, Link
from kvxferd.core.room_events import EventHub, RoomClock, count_finished, deadline_reason
from kvxferd.core.rooms import InSlot, ReaderState, RecvRoom, RoomBase, abort_unseen
from kvxferd.core.types import FailureCode, Role, RoomKey, RoomState, ZeroCopyTarget
from kvxferd.datapath.admission import layouts_compatible
from kvxferd.datapath.credits import CreditLedger
from kvxferd.datapath.fence import PageFence
from kvxferd.datapath.landing import ChunkLanding, LayerMismatch
from kvxferd.datapath.notif import NO_CREDIT, Notif, NotifDrops, from_writers
from kvxferd.datapath.ranges import let_go, release_all
from kvxferd.errors import AlreadyExists, FailedPrecondition, InvalidArgument, KvxferError, NotFound, PermissionDenied
from kvxferd.fleet.registry import NoRegistry, Registry
from kvxferd.ops.metrics import Metrics

logger = logging.getLogger(__name__)

# grpc.StatusCode.NOT_FOUND: the prefill group is not registered (yet) on the prefill daemon.
_NOT_FOUND = 5
_BOOT_RETRY_MIN_S, _BOOT_RETRY_MAX_S = 0.05, 1.0
MAX_EARLY_NOTIFS = 4096
RESOLVE_MARGIN_MIN_S, RESOLVE_MARGIN_MAX_S = 0.25, 1.0


class RecvSide:
    def __init__(self, config: Config, engines: EngineTable, hub: EventHub, clock: RoomClock, metrics: Metrics,
                 ledger: CreditLedger, refresh: Callable[[], None],
                 spawn: Callable[[Coroutine[Any, Any, Any], str], None]) -> None:
        self.config, self.engines = config, engines
        self.hub = hub
        self.clock = clock
        self.metrics = metrics
        self.ledger = ledger
        self.refresh = refresh
        self._spawn = spawn
        self.rooms: dict[int, RecvRoom] = {}
        self.fence = PageFence(hub, ledger.quarantine_s, metrics)
        self.drops = NotifDrops(metrics)
        self._parts_landed = metrics.layer_parts.labels(role="decode", event="landed")
        self._parts_twice = metrics.layer_parts.labels(role="decode", event="duplicate")
        # Rooms not finished yet: read by the notification poller thread to choose its pace.
        self.unfinished = 0
        self.connect: Callable[[str], Awaitable[Link]]  # set by the node: a peer with a live session
        self.registry: Registry = NoRegistry()  # set by app when [registry] is on
        self._boot_waits: dict[tuple[RoomKey, int], asyncio.Future[BootstrapAnswer]] = {}

    # ------------------------------------------------------------------ expect and bootstrap

    def expect(self, engine_id: str, key: RoomKey, prefill_address: str, prefill_group: str, num_tokens: int,
               deadline_ms: int, pages: tuple[int, ...] = ()) -> RecvRoom:
        self.engines.require_serving()
        eng = self.engines.get(engine_id, Role.DECODE)
        if eng.spec.zero_copy:
            self.engines.check_pages(eng, pages, num_tokens, "ExpectRoom")
        elif pages:
            raise InvalidArgument("pages are only for zero-copy engines")
        check_len("prefill_address", prefill_address, MAX_ADDRESS)
        if prefill_address and not _valid_hostport(prefill_address):
            raise InvalidArgument("prefill_address must be HOST:PORT of the prefill daemon's peer service")
        if not prefill_address and not self.registry.enabled:
            raise InvalidArgument("prefill_address is required (HOST:PORT) unless a fleet registry is configured")
        check_len("prefill_group", prefill_group, MAX_GROUP, required=True)
        if not 1 <= num_tokens <= MAX_TOKENS:
            raise InvalidArgument(f"num_tokens must be 1..{MAX_TOKENS}, got {num_tokens}")
        if deadline_ms and not 10 <= deadline_ms <= 86_400_000:
            raise InvalidArgument(f"deadline_ms must be 10..86400000, got {deadline_ms}")
        p = eng.spec.parallel
        limits = self.engines.limits
        if key.id not in eng.recv_rooms:
            limits.check(ROOMS_PER_ENGINE, len(eng.recv_rooms), f" for engine {eng.id}")
        room = self.rooms.get(key.id)
        if room is not None:
            if key.generation < room.key.generation:
                raise FailedPrecondition(f"room {key}: stale generation (current {room.key.generation})")
            if key.generation > room.key.generation:
                self.fail(room, FailureCode.SUPERSEDED, f"room id reused with generation {key.generation}")
                self._forget(room)
                room = None
        if room is None:
            # Counted against the daemon it names (by group while a registry resolves the address).
            cap_peer = prefill_address or f"group {prefill_group}"
            limits.peer_room_added(cap_peer)
            deadline_s = deadline_ms / 1000 if deadline_ms else self.config.room_deadline_s
            room = RecvRoom(key, deadline_s, prefill_address, prefill_group, num_tokens, p.tp_size, eng.spec.layout)
            room.cap_peer = cap_peer
            self.rooms[key.id] = room
            self.unfinished += 1
            self.clock.arm_deadline(room, deadline_s, self._deadline)
            logger.debug("room %s: decode side created (prefill %s/%s)", key, prefill_address, prefill_group)
        else:
            if room.finished:
                raise FailedPrecondition(f"room {key} is already {room.state.name}")
            if ("" if room.by_group else room.prefill_address, room.prefill_group, room.num_tokens, room.decode_tp) != (
                prefill_address, prefill_group, num_tokens, p.tp_size
            ):
                raise InvalidArgument(f"room {key}: other readers expect a different prefill source or size")
            if room.layout != eng.spec.layout:
                raise InvalidArgument(f"room {key}: readers have different layouts")
        if eng.rank in room.readers:
            raise AlreadyExists(f"room {key}: decode rank {eng.rank} already expects it")
        room.readers[eng.rank] = ReaderState(eng, pages=pages)
        eng.recv_rooms.add(key.id)
        self._spawn(self._bootstrap_reader(room, eng.rank), f"bootstrap {key}")
        self.refresh()
        return room

    async def _bootstrap_reader(self, room: RecvRoom, reader: int) -> None:
        assert room.layout is not None
        deadline_ms = int((time.time() + room.deadline_s - (time.monotonic() - room.created)) * 1000)
        backoff = _BOOT_RETRY_MIN_S
        # A registry route may name a daemon that died or restarted elsewhere: its record stays
        # until its lease lapses, so an unreachable route is looked up again for one lease TTL.
        redial_until = min(time.monotonic() + self.config.registry_lease_ttl_s, room.created + room.deadline_s - 0.1)
        while not room.finished:
            rs = room.readers.get(reader)
            if rs is None:
                return
            try:
                if room.by_group:
                    room.prefill_address = await self._resolve_prefill(room)
                peer = await self.connect(room.prefill_address)
            except KvxferError as exc:  # the registry could not place the group
                self.fail(room, FailureCode.PEER_LOST, str(exc), push=False)
                return
            except Exception as exc:
                if room.by_group and time.monotonic() < redial_until:
                    room.resolving = None
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _BOOT_RETRY_MAX_S)
                    continue
                self.fail(room, FailureCode.PEER_LOST, f"bootstrap with {room.prefill_address} failed: {exc}",
                          push=False)
                return
            if room.finished:
                return
            if room.peer is not None and room.peer is not peer:
                self.fail(room, FailureCode.PEER_LOST, "the prefill daemon changed during bootstrap", push=False)
                return
            room.peer = peer
            target = None
            if rs.engine.spec.zero_copy:
                ring = rs.engine.ring
                target = ZeroCopyTarget(ring.base_addr, rs.engine.pool_slots, ring.mem, ring.device, rs.pages)
            else:
                self.ledger.ensure(peer, rs.engine, part_bytes(room.layout, room.decode_tp, reader, room.num_tokens or 1))
            fut: asyncio.Future[BootstrapAnswer] = asyncio.get_running_loop().create_future()
            self._boot_waits[(room.key, reader)] = fut
            peer.send_bootstrap(BootstrapMsg(
                room.key, room.prefill_group, reader, room.decode_tp, room.layout, room.num_tokens or 0,
                deadline_ms, rs.engine.id, target, room.notif_token, rs.engine.spec.layer_parts,
            ))
            try:
                ans = await fut
            except asyncio.CancelledError:
                if room.finished:
                    return
                raise
            finally:
                self._boot_waits.pop((room.key, reader), None)
            if ans.code == 0:
                self._bootstrapped(room, reader, ans)
                return
            if ans.code == _NOT_FOUND:
                room.resolving = None  # a group addressed by name may have moved: look again
                # The prefill engines may not have registered yet (start-up, restart, scaling): wait
                # for them, with back-off, until just before the room's deadline, so the failure
                # names what the room waited for.
                left = room.created + room.deadline_s - 0.1 - time.monotonic()
                if left > 0:
                    await asyncio.sleep(min(backoff, left))
                    backoff = min(backoff * 2, _BOOT_RETRY_MAX_S)
                    continue
                self.fail(room, FailureCode.DEADLINE,
                          f"prefill group {room.prefill_group!r} was not registered on {room.prefill_address} within "
                          f"the room's deadline ({room.deadline_s:g} s): {ans.message}", push=False)
                return
            self.fail(room, FailureCode.MISMATCH, f"bootstrap with {room.prefill_address} refused: {ans.message}",
                      push=False)
            return

    async def _resolve_prefill(self, room: RecvRoom) -> str:
        """One registry lookup per room (every reader must reach the same daemon); it waits for the
        group to register until just before the room's deadline, so the failure names it."""
        if room.resolving is None:
            margin = min(RESOLVE_MARGIN_MAX_S, max(RESOLVE_MARGIN_MIN_S, 0.2 * room.deadline_s))
            until = room.created + room.deadline_s - margin
            room.resolving = asyncio.ensure_future(self._resolved_address(room.prefill_group, until))
        return await asyncio.shield(room.resolving)

    async def _resolved_address(self, group: str, until: float) -> str:
        return (await self.registry.resolve_group(group, "prefill", until)).address

    def bootstrap_reply(self, peer: Link, ans: BootstrapAnswer) -> None:
        fut = self._boot_waits.get((ans.room, ans.reader))
        room = self.rooms.get(ans.room.id)
        if fut is None or fut.done() or room is None or room.peer is not peer:
            return
        fut.set_result(ans)

    def _bootstrapped(self, room: RecvRoom, reader: int, ans: BootstrapAnswer) -> None:
        assert room.layout is not None
        if ans.layout is None:
            self.fail(room, FailureCode.MISMATCH, "bootstrap reply carries no layout")
            return
        why = layouts_compatible(ans.layout, room.layout)
        if why:
            self.fail(room, FailureCode.MISMATCH, f"layout mismatch: {why}")
            return
        if room.prefill_tp is None:
            if not 1 <= ans.prefill_tp <= 1024:
                self.fail(room, FailureCode.MISMATCH, f"bootstrap reply names prefill tp {ans.prefill_tp}")
                return
            room.prefill_tp = ans.prefill_tp
            room.plan = plan(ans.prefill_tp, room.decode_tp, room.layout.total_kv_heads, room.layout.mla)
        rs = room.readers.get(reader)
        if rs is None:
            return
        rs.bootstrapped = True
        early, room.early = room.early, []
        for n in early:
            self.landed(n)
        if len(room.readers) == room.decode_tp and all(r.bootstrapped for r in room.readers.values()) \
                and room.advance(RoomState.WAITING_FOR_INPUT):
            logger.debug("room %s: decode side bootstrapped (prefill tp %d)", room.key, ans.prefill_tp)
            self.hub.recv_state(room)
        self.refresh()

    # ------------------------------------------------------------------ credits

    def credit_request(self, peer: Link, ring: str, nbytes: int) -> None:
        eng = self.engines.engines.get(ring)
        if eng is None or eng.closing or eng.role is not Role.DECODE or eng.spec.zero_copy or nbytes <= 0:
            return
        # Only a peer that bootstraps rooms of this reader may ask for its space.
        rooms = [r for rid in eng.recv_rooms if (r := self.rooms.get(rid)) is not None and r.peer is peer]
        if rooms and eng.ring.alloc.fits_ever(nbytes):
            self.ledger.request(peer, eng, nbytes)
            return
        # A chunk part larger than the whole ring never gets space (and chunks behind it would wait
        # too): the rooms it may be for, with that many tokens still to come here, fail on both sides.
        tokens = -(-nbytes // part_bytes(eng.spec.layout, eng.spec.parallel.tp_size, eng.rank, 1))
        why = f"a chunk part of {nbytes} B can never fit the {eng.ring.size} B ring of decode rank {eng.rank}"
        for r in rooms:
            if not r.finished and r.tokens_left(eng.rank) >= tokens:
                self.fail(r, FailureCode.MISMATCH, why)

    # ------------------------------------------------------------------ landed chunks

    def _room(self, key: RoomKey) -> RecvRoom:
        room = self.rooms.get(key.id)
        if room is None or room.key.generation != key.generation:
            raise NotFound(f"room {key} is not expected on this daemon")
        return room

    def on_notifs(self, notifs: Iterable[tuple[str, bytes]], local: bool = False) -> None:
        """From NIXL, each with the agent that sent it (`local`: the hand-off between our engines);
        landed() takes those the room's writer sent."""
        for n in from_writers(notifs, local, self._writer_of, self.drops):
            self.landed(n)

    def _writer_of(self, key: RoomKey) -> tuple[Link | None, bytes] | Literal[False]:
        room = self.rooms.get(key.id)
        return False if room is None or room.key != key or room.finished else (room.peer, room.notif_token)

    def local_notif(self, msg: bytes) -> None:
        self.on_notifs([("", msg)], local=True)

    def landed(self, n: Notif) -> None:
        key, chunk_id, writer, reader = n.room, n.chunk_id, n.writer, n.reader
        room = self.rooms.get(key.id)
        if room is None or room.key.generation != key.generation or room.finished:
            return
        rs = room.readers.get(reader)
        if room.plan is None and rs is not None:
            # The WRITE's notification can overtake the bootstrap reply (it travels on NIXL, the
            # reply on the control stream): keep it until the reply is in.
            if len(room.early) < MAX_EARLY_NOTIFS:
                room.early.append(n)
            return
        if (rs is None or room.plan is None or room.layout is None or room.num_tokens is None or n.num_tokens < 1
                or n.token_start + n.num_tokens > room.num_tokens or not 0 <= chunk_id < MAX_CHUNK_ID):
            self.drops.drop("range", key, f"out of range: {n}")
            return
        slot = rs.slots.get(chunk_id)
        expected = slot.expected_writers if slot is not None else frozenset(s.writer for s in room.plan if s.reader == reader)
        if writer not in expected:  # (before a new slot takes a range)
            self.drops.drop("writer", key, f"unexpected writer {writer} for chunk {chunk_id} reader {reader}")
            return
        if slot is None:
            layers = ChunkLanding(chunk_id, room.layout.num_layers, expected)
            if rs.engine.spec.zero_copy:
                # Zero-copy: the chunk lands in the reader's own pages.
                slot = InSlot(-1, 0, n.token_start, n.num_tokens, n.last, 0, layers)
            else:
                nbytes = part_bytes(room.layout, room.decode_tp, reader, n.num_tokens)
                g = None if n.credit_id == NO_CREDIT or room.peer is None else self.ledger.valid(
                    n.credit_id, room.peer, rs.engine, n.offset, nbytes)
                if g is None or n.offset in g.live:  # (live: another chunk holds that range)
                    self.drops.drop("credit" if g is None else "held", key, f"chunk {chunk_id} at offset {n.offset}")
                    return
                slot = InSlot(g.offset + n.offset, nbytes, n.token_start, n.num_tokens, n.last, nbytes, layers,
                              credit_id=n.credit_id, credit_offset=n.offset)
                self.ledger.hold(g, n.offset)
            rs.slots[chunk_id] = slot
        elif ((slot.token_start, slot.num_tokens) != (n.token_start, n.num_tokens)
              or (slot.credit_id, slot.credit_offset) != (n.credit_id, n.offset)):
            self.fail(room, FailureCode.MISMATCH, f"writers of chunk {chunk_id} disagree on its tokens or slot")
            return
        try:  # every layer of every writer once; whole chunks are layers [0, L)
            new, complete = slot.layers.land(writer, n.layer_group, n.layer_start, n.layer_end)
        except LayerMismatch as exc:
            if exc.twice:
                self._parts_twice.inc()
            self.fail(room, FailureCode.MISMATCH, str(exc))
            return
        if n.layer_group:
            self._parts_landed.inc()
        if new:
            slot.landed = complete
            room.advance(RoomState.TRANSFERRING)
            self.hub.landed(room, rs, chunk_id, slot, new, complete)
            self._check_done(room)

    def complete(self, peer: Link, key: RoomKey, reader: int, num_chunks: int, aux: bytes) -> None:
        room = self._room(key)
        if room.peer is not peer:
            raise PermissionDenied(f"room {key} is not bootstrapped with daemon {peer.daemon_id!r}")
        if room.finished:
            if room.state is RoomState.FAILED and room.failure_code is FailureCode.PEER_LOST:
                # We lost this peer and failed the room without telling it (it was unreachable).
                # The same instance is back and never saw a loss (a stalled event loop does
                # that): it learns the room's failure now, with our code and reason, instead of
                # failing its half as a refused completion (MISMATCH). The abort goes out before
                # the refusal, on the same stream.
                peer.send_abort(key, room.failure_code, room.failure_reason, quiesced=False)
            raise FailedPrecondition(f"room {key} is {room.state.name}")
        rs = room.readers.get(reader)
        if rs is None:
            raise NotFound(f"room {key}: no reader {reader}")
        if not 1 <= num_chunks <= MAX_CHUNK_ID:
            raise InvalidArgument(f"num_chunks {num_chunks} out of range")
        if len(aux) > MAX_AUX_BYTES:
            raise InvalidArgument(f"aux over {MAX_AUX_BYTES} bytes")
        if any(c >= num_chunks for c in rs.slots):
            self.fail(room, FailureCode.MISMATCH, "more chunks arrived than the prefill side reports")
            raise FailedPrecondition(f"room {key}: chunk count mismatch")
        rs.num_chunks = num_chunks
        room.aux = aux
        self._check_done(room)

    def _check_done(self, room: RecvRoom) -> None:
        if room.finished or len(room.readers) != room.decode_tp:
            return
        if all(r.complete for r in room.readers.values()):
            why = room.token_gap()
            if why:
                self.fail(room, FailureCode.MISMATCH, f"the prefill side completed the room, but {why}")
                return
            room.advance(RoomState.SUCCESS)
            self.unfinished -= 1
            count_finished(self.metrics, room)
            logger.debug("room %s: decode side SUCCESS", room.key)
            self.hub.recv_state(room, aux=room.aux)
            self.refresh()

    # ------------------------------------------------------------------ consumption

    def watermark(self, engine_id: str, key: RoomKey, chunk_ids: Iterable[int]) -> Watermark:
        eng = self.engines.get(engine_id, Role.DECODE)
        room = self._room(key)
        rs = room.readers.get(eng.rank)
        if rs is None or rs.engine is not eng:
            raise PermissionDenied(f"room {key} has no reader for this engine")
        ids = list(chunk_ids)
        if not ids:
            raise InvalidArgument("chunk_ids is empty")
        for cid in ids:
            slot = rs.slots.get(cid)
            if slot is None or not slot.landed:
                raise InvalidArgument(f"room {key}: chunk {cid} has not landed for this reader")
            if slot.consumed:
                raise AlreadyExists(f"room {key}: chunk {cid} was already watermarked")
        for cid in ids:
            rs.slots[cid].consumed = True
        let_go(self.ledger, room, [rs.slots[cid] for cid in ids])
        return eng.ring.alloc.watermark()

    # ------------------------------------------------------------------ failure and release

    def fail(self, room: RecvRoom, code: FailureCode, reason: str, push: bool = True, fence: bool = True) -> None:
        if not room.fail(code, reason):
            return
        if fence and room.peer is not None and room.zero_copy:
            self.fence.close(room)
        self.unfinished -= 1
        logger.warning("room %s: decode side FAILED (%s): %s", room.key, code.name, reason)
        self.metrics.room_failures.labels(reason=code.name).inc()
        count_finished(self.metrics, room)
        for (key, _), fut in list(self._boot_waits.items()):
            if key == room.key and not fut.done():
                fut.cancel()
        if push and room.peer is not None and room.peer.up:
            room.peer.send_abort(room.key, code, reason, quiesced=False)
        elif push and room.peer is None and room.prefill_address:
            self._spawn(abort_unseen(self.connect, room, code, reason), f"room {room.key}: tell the prefill side")
        release_all(self.ledger, room)
        self.hub.recv_state(room)
        self.clock.arm_gc(room, self._gc)
        self.refresh()

    def _deadline(self, room: RoomBase) -> None:
        assert isinstance(room, RecvRoom)
        if not room.finished:
            self.fail(room, FailureCode.DEADLINE, deadline_reason(room))

    def _gc(self, room: RoomBase) -> None:
        assert isinstance(room, RecvRoom)
        if room.pages_fenced:
            self.clock.rearm_gc(room, self._gc)
            return
        self._forget(room)
        self.refresh()

    def _forget(self, room: RecvRoom) -> None:
        if self.rooms.get(room.key.id) is room:
            del self.rooms[room.key.id]
        if room.cap_peer:
            self.engines.limits.peer_room_gone(room.cap_peer)
            room.cap_peer = ""
        for rs in room.readers.values():
            rs.engine.recv_rooms.discard(room.key.id)
        # A SUCCESS room released before every chunk was watermarked would hold its ranges for ever.
        release_all(self.ledger, room)
        self.clock.cancel(room)

    def release(self, eng: Engine, room: RecvRoom) -> None:
        room.readers[eng.rank].released = True
        eng.recv_rooms.discard(room.key.id)
        if all(r.released for r in room.readers.values()):
            self._forget(room)

    def own(self, eng: Engine, key: RoomKey) -> RecvRoom:
        room = self.rooms.get(key.id)
        rs = room.readers.get(eng.rank) if room is not None and room.key.generation == key.generation else None
        if room is None or rs is None or rs.engine is not eng:  # another group's (or a dead) engine of its rank too
            raise NotFound(f"room {key} is not expected by this engine")
        return room

    def peer_abort(self, peer: Link, key: RoomKey, code: FailureCode, reason: str, quiesced: bool) -> bool:
        """The prefill side failed a room (`quiesced`: and has no WRITE in flight for it); False
        if no room of ours matches."""
        if quiesced:
            self.fence.quiesced(peer, key)
        room = self.rooms.get(key.id)
        if room is None or room.key != key or room.peer is not peer:
            return False
        if room.state is not RoomState.SUCCESS:
            # A SUCCESS room stays: every byte landed and the engine may still be reading unconsumed
            # chunks, so a late failure on the prefill side (a completion ack lost) must not free them.
            self.fail(room, code, f"prefill side: {reason}", push=False, fence=not quiesced)
        return True

    def peer_lost(self, peer: Link, reason: str) -> None:
        self.ledger.peer_lost(peer)
        for room in list(self.rooms.values()):
            if room.peer is peer and not room.finished:
                self.fail(room, FailureCode.PEER_LOST, reason, push=False)  # also ends its bootstrap wait

    def engine_gone(self, eng: Engine, code: FailureCode, reason: str) -> None:
        for rid in list(eng.recv_rooms):
            room = self.rooms.get(rid)
            if room is not None:
                self.fail(room, code, f"{reason} (decode rank {eng.rank})")
                if room.state is RoomState.SUCCESS:
                    # No timer ends a SUCCESS room: the slots this engine can no longer watermark go
                    # back now, and the room is forgotten once every reader let go.
                    let_go(self.ledger, room, room.readers[eng.rank].slots.values())
                    self.release(eng, room)
        if eng.role is Role.DECODE:
            # Rooms of its group that this rank had not expected yet can never get its part now.
            group = eng.spec.group
            for room in list(self.rooms.values()):
                if (not room.finished and eng.rank not in room.readers
                        and any(rs.engine.spec.group == group for rs in room.readers.values())):
                    self.fail(room, code, f"{reason} (decode rank {eng.rank}, before it expected the room)")
            self.ledger.revoke_ring(eng, reason)
