"""The daemon's domain state: engines, rings, rooms of both roles, and the operations
the servicers call. Everything here runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from kvxferd import __version__
from kvxferd.config import Config, _valid_hostport
from kvxferd.domain import (
    ChunkSpec,
    DaemonRef,
    EngineSpec,
    FailureCode,
    LandedChunk,
    Role,
    RoomEvent,
    RoomKey,
    RoomState,
    RoomView,
    SlotRef,
    ZeroCopyTarget,
)
from kvxferd.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KvxferError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from kvxferd.layout import KVLayout, part_bytes, plan, rank_heads
from kvxferd.memory import HostPool, RingAllocator, Watermark
from kvxferd.metrics import Metrics
from kvxferd.registry import NoRegistry, Registry
from kvxferd.rooms import InSlot, OutChunk, ReaderState, RecvRoom, RoomBase, SendRoom, WriterState

if TYPE_CHECKING:
    from kvxferd.peer import PeerHandle, PeerManager
    from kvxferd.scheduler import Scheduler
    from kvxferd.transport import Transport

logger = logging.getLogger(__name__)

MAX_CHUNK_ID = 1 << 20
MAX_AUX_BYTES = 64 << 10
MAX_TOKENS = 1 << 24
FINISHED_ROOM_TTL_S = 60.0
QUARANTINE_S = 30.0
MAX_TOMBSTONES = 65536
NOTIF_PREFIX = b"kvx1"
BOOTSTRAP_RETRY_S = 5.0
RESOLVE_MARGIN_MIN_S, RESOLVE_MARGIN_MAX_S = 0.25, 1.0
_PEER_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


@dataclass(eq=False)
class Ring:
    name: str
    kind: str  # "host" | "cuda"
    base_addr: int
    size: int
    pool_offset: int
    mem: str  # NIXL memory type: "DRAM" | "VRAM"
    device: int
    alloc: RingAllocator
    close: Callable[[], None] | None = None


@dataclass(eq=False)
class Engine:
    id: str
    spec: EngineSpec
    ring: Ring
    lease_deadline: float
    acquired: set[int] = field(default_factory=set)
    watchers: set[asyncio.Queue[RoomEvent | None]] = field(default_factory=set)
    send_rooms: set[int] = field(default_factory=set)
    recv_rooms: set[int] = field(default_factory=set)
    closing: bool = False
    # Zero-copy engines: token slots per (layer, plane) in the pool held by the ring.
    pool_slots: int = 0

    @property
    def role(self) -> Role:
        return self.spec.role

    @property
    def rank(self) -> int:
        return self.spec.parallel.tp_rank


def encode_notif(key: RoomKey, spec: ChunkSpec, writer: int, reader: int) -> bytes:
    return b"%s %d %d %d %d %d %d %d %d" % (
        NOTIF_PREFIX, key.id, key.generation, spec.chunk_id, writer, reader, spec.token_start, spec.num_tokens,
        int(spec.last),
    )


@dataclass(frozen=True)
class Notif:
    room: RoomKey
    chunk_id: int
    writer: int
    reader: int
    token_start: int
    num_tokens: int
    last: bool


def decode_notif(msg: bytes) -> Notif | None:
    parts = msg.split()
    if len(parts) != 9 or parts[0] != NOTIF_PREFIX:
        return None
    try:
        rid, gen, chunk, writer, reader, tstart, ntok, last = (int(p) for p in parts[1:])
    except ValueError:
        return None
    return Notif(RoomKey(rid, gen), chunk, writer, reader, tstart, ntok, bool(last))


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def layouts_compatible(a: KVLayout, b: KVLayout) -> str:
    """Empty string if prefill and decode layouts can exchange KV, else why not."""
    for name in ("num_layers", "total_kv_heads", "head_dim", "dtype_bytes", "mla"):
        if getattr(a, name) != getattr(b, name):
            return f"{name} differs: prefill {getattr(a, name)} vs decode {getattr(b, name)}"
    return ""


def _ring_size(spec: EngineSpec) -> int:
    return spec.cuda_ring.size if spec.cuda_ring is not None else spec.ring_bytes


def _zero_copy_slot_bytes(spec: EngineSpec) -> int:
    """Bytes of one token slot across a zero-copy pool's [layers, K/V] planes, for this rank's heads."""
    lay, p = spec.layout, spec.parallel
    heads = rank_heads(lay.total_kv_heads, p.tp_size, p.tp_rank, lay.mla).count
    return lay.num_layers * lay.planes * heads * lay.head_dim * lay.dtype_bytes


async def _run_inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class Node:
    def __init__(self, config: Config, transport: Transport, pool: HostPool, metrics: Metrics) -> None:
        self.config = config
        self.transport = transport
        self.pool = pool
        self.metrics = metrics
        self.instance_id = uuid.uuid4().hex
        self.daemon_id = config.daemon_id
        self.address = ""
        self.started = time.monotonic()
        self.serving = True
        self.engines: dict[str, Engine] = {}
        self.send_rooms: dict[int, SendRoom] = {}
        self.recv_rooms: dict[int, RecvRoom] = {}
        self.peers: PeerManager  # set by app
        self.scheduler: Scheduler  # set by app
        self.registry: Registry = NoRegistry()  # set by app when [registry] is on
        # Runs a slow blocking call (CUDA IPC import, NIXL VRAM registration) off the event loop;
        # set by app to WorkerPool.run_blocking. Inline by default (unit tests without workers).
        self.run_blocking: Callable[..., Awaitable[Any]] = _run_inline
        self._loop = asyncio.get_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        # Engines gone whose rings still have slots a transfer may touch.
        self._closing_rings: list[Engine] = []
        # room id -> (key, code, reason, expiry): rooms the decode side failed before we had them.
        self._tombstones: dict[int, tuple[RoomKey, FailureCode, str, float]] = {}
        self._metrics_pending = False
        # Bumped when memory is registered with NIXL after start (GPU rings): peers must get
        # our metadata again before they can WRITE into it (PeerManager.connect re-handshakes).
        self.md_epoch = 0

    # ------------------------------------------------------------------ helpers

    @property
    def ref(self) -> DaemonRef:
        return DaemonRef(self.daemon_id, self.instance_id, self.address)

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def _done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                logger.error("background task %s failed: %r", what, t.exception())

        task.add_done_callback(_done)

    def _engine(self, engine_id: str, role: Role | None = None) -> Engine:
        eng = self.engines.get(engine_id)
        if eng is None or eng.closing:
            raise NotFound(f"unknown engine {engine_id!r} (not registered, unregistered, or its lease lapsed)")
        if role is not None and eng.role is not role:
            raise FailedPrecondition(f"engine {engine_id!r} is a {eng.role.name.lower()} engine")
        return eng

    def _require_serving(self) -> None:
        if not self.serving:
            raise Unavailable("daemon is draining and accepts no new work")

    def refresh_metrics(self) -> None:
        """Gauges are recounted at most every 100 ms: recounting per RPC would cost O(rooms) each."""
        if not self._metrics_pending:
            self._metrics_pending = True
            self._loop.call_later(0.1, self._recount)

    def _recount(self) -> None:
        self._metrics_pending = False
        m = self.metrics
        for role, rooms in (("prefill", self.send_rooms), ("decode", self.recv_rooms)):
            counts = dict.fromkeys(RoomState, 0)
            for room in rooms.values():
                counts[room.state] += 1
            for st, n in counts.items():
                m.rooms.labels(role=role, state=st.name).set(n)
        for r in Role:
            m.engines.labels(role=r.name.lower()).set(sum(1 for e in self.engines.values() if e.role is r))
        m.slots_held.set(self.slots_held())

    def slots_held(self) -> int:
        n = sum(e.ring.alloc.slots_held for e in self.engines.values())
        return n + sum(e.ring.alloc.slots_held for e in self._closing_rings)

    def _ring_metrics(self, ring: Ring) -> None:
        self.metrics.ring_used.labels(ring=ring.name).set(ring.alloc.used_bytes)

    # ------------------------------------------------------------------ engines

    def check_engine_spec(self, spec: EngineSpec) -> None:
        """Every check of RegisterEngine that needs no ring; raises InvalidArgument/FailedPrecondition."""
        self._require_serving()
        p = spec.parallel
        if spec.role not in (Role.PREFILL, Role.DECODE):
            raise InvalidArgument("role must be PREFILL or DECODE")
        if not spec.group or len(spec.group) > 128:
            raise InvalidArgument("group must be a non-empty name of at most 128 characters")
        if not 1 <= p.tp_size <= 1024 or not 0 <= p.tp_rank < p.tp_size:
            raise InvalidArgument(f"tp_rank {p.tp_rank} must be in [0, tp_size={p.tp_size})")
        if not 1 <= p.pp_size <= 1024 or not 0 <= p.pp_rank < p.pp_size:
            raise InvalidArgument(f"pp_rank {p.pp_rank} must be in [0, pp_size={p.pp_size})")
        try:
            rank_heads(spec.layout.total_kv_heads, p.tp_size, p.tp_rank, spec.layout.mla)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        # One group = one serving instance: every rank must agree on layout and TP.
        for other in self.engines.values():
            if other.closing or other.spec.group != spec.group or other.role is not spec.role:
                continue
            if other.spec.layout != spec.layout or other.spec.parallel.tp_size != p.tp_size:
                raise InvalidArgument(
                    f"group {spec.group!r} already has engines with another layout or tp_size; "
                    "use one group name per serving instance"
                )
        if spec.lease_ms and not 100 <= spec.lease_ms <= 3_600_000:
            raise InvalidArgument(f"lease_ms must be 100..3600000, got {spec.lease_ms}")
        if spec.zero_copy:
            lay = spec.layout
            per_slot, want = _zero_copy_slot_bytes(spec), _ring_size(spec)
            if want <= 0 or want % (per_slot * lay.page_size):
                raise InvalidArgument(
                    f"zero-copy pool of {want} B is not a whole number of pages of "
                    f"{per_slot * lay.page_size} B ([layers, K/V, slots, local_heads, head_dim])"
                )

    async def register_engine_async(
        self, spec: EngineSpec, cuda_importer: Callable[[EngineSpec], Ring] | None
    ) -> Engine:
        """register_engine, with a GPU ring imported off the event loop: a daemon's first CUDA IPC
        import creates its CUDA context and registers VRAM with NIXL, which took seconds on the GPU
        box with several engines starting at once; on the loop that starved heartbeats and the
        peer daemon declared this one lost."""
        if spec.cuda_ring is None or cuda_importer is None:
            return self.register_engine(spec, cuda_importer)
        self.check_engine_spec(spec)  # bad input fails before anything touches the GPU
        ring: Ring = await self.run_blocking(cuda_importer, spec)
        try:
            return self.register_engine(spec, lambda _: ring)
        except BaseException:
            if ring.close is not None:
                await self.run_blocking(ring.close)
            raise

    def register_engine(self, spec: EngineSpec, cuda_importer: Callable[[EngineSpec], Ring] | None) -> Engine:
        # Checked again after register_engine_async's import: the daemon may have started draining,
        # or another rank registered the group with another layout, while the import ran.
        self.check_engine_spec(spec)
        p = spec.parallel
        if spec.cuda_ring is not None:
            if cuda_importer is None:
                raise FailedPrecondition("this daemon cannot import CUDA IPC rings (no CUDA available)")
            ring = cuda_importer(spec)
            self.md_epoch += 1
        else:
            if spec.ring_bytes <= 0:
                raise InvalidArgument("ring_bytes must be positive for a host ring")
            one_token = part_bytes(spec.layout, p.tp_size, p.tp_rank, 1)
            if spec.ring_bytes < one_token:
                raise InvalidArgument(f"ring_bytes {spec.ring_bytes} cannot hold even one token ({one_token} B)")
            offset = self.pool.allocate_region(spec.ring_bytes)
            size = self.pool.regions.slot_length(offset) or spec.ring_bytes
            ring = Ring(
                name="", kind="host", base_addr=self.pool.base_addr + offset, size=size, pool_offset=offset,
                mem="DRAM", device=0, alloc=RingAllocator(size),
            )
        pool_slots = 0
        if spec.zero_copy:
            pool_slots = _ring_size(spec) // _zero_copy_slot_bytes(spec)  # whole pages: check_engine_spec
        # A restarted engine process re-registers the same rank: the old
        # registration is dead (its rooms fail, its mappings go).
        for other in list(self.engines.values()):
            if (
                other.spec.group == spec.group and other.role is spec.role
                and other.rank == p.tp_rank and other.spec.parallel.pp_rank == p.pp_rank
            ):
                logger.warning("engine %s replaced by a new registration of the same rank", other.id)
                self.drop_engine(other, FailureCode.ENGINE_LOST, "engine re-registered (restarted)")
        engine_id = uuid.uuid4().hex
        ring.name = engine_id
        lease_s = spec.lease_ms / 1000 if spec.lease_ms else self.config.engine_lease_s
        eng = Engine(engine_id, spec, ring, time.monotonic() + lease_s, pool_slots=pool_slots)
        self.engines[engine_id] = eng
        self.metrics.ring_capacity.labels(ring=engine_id).set(ring.size)
        self._ring_metrics(ring)
        self.refresh_metrics()
        logger.info(
            "engine %s registered: %s group=%s tp=%d/%d ring=%s %d B", engine_id, spec.role.name.lower(),
            spec.group, p.tp_rank, p.tp_size, ring.kind, ring.size,
        )
        self.registry.groups_changed()
        return eng

    async def _close_ring(self, engine_id: str, close: Callable[[], None]) -> None:
        try:
            await self.run_blocking(close)
        except Exception as exc:
            logger.warning("closing ring of engine %s failed: %s", engine_id, exc)
        else:
            logger.info("ring of engine %s released", engine_id)

    def lease_s(self, eng: Engine) -> float:
        return eng.spec.lease_ms / 1000 if eng.spec.lease_ms else self.config.engine_lease_s

    def keep_alive(self, engine_id: str) -> float:
        eng = self._engine(engine_id)
        eng.lease_deadline = time.monotonic() + self.lease_s(eng)
        return self.lease_s(eng)

    def unregister_engine(self, engine_id: str) -> None:
        eng = self._engine(engine_id)
        self.drop_engine(eng, FailureCode.ENGINE_LOST, "engine unregistered")

    def drop_engine(self, eng: Engine, code: FailureCode, reason: str) -> None:
        if eng.closing:
            return
        eng.closing = True
        logger.info("engine %s gone: %s", eng.id, reason)
        for rid in list(eng.send_rooms):
            room = self.send_rooms.get(rid)
            if room is not None:
                self.fail_send_room(room, code, f"{reason} (prefill rank {eng.rank})")
        for rid in list(eng.recv_rooms):
            rroom = self.recv_rooms.get(rid)
            if rroom is not None:
                self.fail_recv_room(rroom, code, f"{reason} (decode rank {eng.rank})")
        # Rooms of its group that this rank had not joined yet (bootstrapped by the decode side
        # before the first chunk, or expected by other decode ranks first) can never get its
        # part now: fail them too, or they would wait for their deadline.
        group = eng.spec.group
        for sroom in list(self.send_rooms.values()):
            if (eng.role is Role.PREFILL and sroom.group == group and not sroom.finished
                    and eng.rank not in sroom.writers):
                self.fail_send_room(sroom, code, f"{reason} (prefill rank {eng.rank}, before its first chunk)")
        for rroom in list(self.recv_rooms.values()):
            if (not rroom.finished and eng.rank not in rroom.readers and eng.role is Role.DECODE
                    and any(rs.engine.spec.group == group for rs in rroom.readers.values())):
                self.fail_recv_room(rroom, code, f"{reason} (decode rank {eng.rank}, before it expected the room)")
        for off in list(eng.acquired):
            eng.ring.alloc.free(off)
        eng.acquired.clear()
        for q in list(eng.watchers):
            q.put_nowait(None)
        self.engines.pop(eng.id, None)
        self._closing_rings.append(eng)
        self._maybe_close_ring(eng)
        self.refresh_metrics()
        self.registry.groups_changed()

    def _maybe_close_ring(self, eng: Engine) -> None:
        """A ring goes back only when no transfer can touch it any more."""
        if not eng.closing or eng.ring.alloc.slots_held or eng not in self._closing_rings:
            return
        self._closing_rings.remove(eng)
        ring = eng.ring
        if ring.kind == "host":
            self.pool.free_region(ring.pool_offset)
        if ring.kind == "cuda":
            # Peers still hold the released ring in their copy of our NIXL metadata; the next
            # handshake replaces it, before a ring imported at the same address can be written.
            self.md_epoch += 1
        if ring.close is not None:
            # Deregistering VRAM and closing the IPC mapping can take long: not on the loop.
            self.spawn(self._close_ring(eng.id, ring.close), f"close ring {eng.id}")
        else:
            logger.info("ring of engine %s released", eng.id)
        self.metrics.ring_capacity.remove(ring.name)
        self.metrics.ring_used.remove(ring.name)

    def expire_leases(self) -> None:
        now = time.monotonic()
        for eng in list(self.engines.values()):
            if eng.lease_deadline < now:
                self.drop_engine(eng, FailureCode.ENGINE_LOST, "engine lease lapsed")

    def free_slot(self, eng: Engine, offset: int) -> None:
        eng.ring.alloc.free(offset)
        self._ring_metrics(eng.ring)
        if eng.closing:
            self._maybe_close_ring(eng)

    # ------------------------------------------------------------------ prefill: slots and chunks

    def _owes_chunks(self, eng: Engine) -> bool:
        """Does an unfinished room still wait for chunks from this engine's rank?"""
        for room in self.send_rooms.values():
            if room.finished or room.group != eng.spec.group:
                continue
            w = room.writers.get(eng.rank)
            if w is None or (w.engine is eng and w.last_id is None):
                return True
        return False

    def acquire_slot(self, engine_id: str, num_tokens: int) -> tuple[SlotRef, int]:
        eng = self._engine(engine_id, Role.PREFILL)
        # Draining refuses new rooms (EnqueueChunk), but rooms already under way get their
        # grace period only if their remaining chunks can still get slots.
        if not self.serving and not self._owes_chunks(eng):
            raise Unavailable("daemon is draining and accepts no new work")
        if eng.spec.zero_copy:
            raise FailedPrecondition("zero-copy engines address chunks by pages; they have no slots")
        if not 1 <= num_tokens <= MAX_TOKENS:
            raise InvalidArgument(f"num_tokens must be 1..{MAX_TOKENS}, got {num_tokens}")
        p = eng.spec.parallel
        nbytes = part_bytes(eng.spec.layout, p.tp_size, p.tp_rank, num_tokens)
        if not eng.ring.alloc.fits_ever(nbytes):
            raise InvalidArgument(f"a chunk of {num_tokens} tokens needs {nbytes} B; the ring has {eng.ring.size} B")
        off = eng.ring.alloc.alloc(nbytes)
        if off is None:
            raise ResourceExhausted(
                f"ring full: {eng.ring.alloc.used_bytes}/{eng.ring.size} B held by {eng.ring.alloc.slots_held} slots"
            )
        eng.acquired.add(off)
        self._ring_metrics(eng.ring)
        self.refresh_metrics()
        return SlotRef(off, eng.ring.alloc.slot_length(off) or nbytes), nbytes

    def release_slot(self, engine_id: str, slot: SlotRef) -> None:
        eng = self._engine(engine_id, Role.PREFILL)
        if slot.offset not in eng.acquired:
            raise InvalidArgument(f"offset {slot.offset} is not a slot this engine acquired and still holds")
        eng.acquired.discard(slot.offset)
        self.free_slot(eng, slot.offset)
        self.refresh_metrics()

    @staticmethod
    def _check_pages(eng: Engine, pages: tuple[int, ...], num_tokens: int, what: str) -> None:
        """Page ids must cover exactly the tokens and lie inside the engine's registered pool."""
        ps = eng.spec.layout.page_size
        if len(pages) != pages_for(num_tokens, ps):
            raise InvalidArgument(f"{what}: {num_tokens} tokens need {pages_for(num_tokens, ps)} pages, got {len(pages)}")
        limit = eng.pool_slots // ps
        bad = [pg for pg in pages if pg >= limit]
        if bad:
            raise InvalidArgument(f"{what}: page {bad[0]} is outside the engine's pool of {limit} pages")
        if len(set(pages)) != len(pages):
            raise InvalidArgument(f"{what}: a page appears twice")

    def _group_engines(self, group: str, role: Role) -> list[Engine]:
        return [e for e in self.engines.values() if e.spec.group == group and e.role is role and not e.closing]

    def _new_send_room(self, key: RoomKey, group: str) -> SendRoom:
        engines = self._group_engines(group, Role.PREFILL)
        if not engines:
            raise NotFound(f"no prefill engine of group {group!r} is registered on this daemon")
        spec = engines[0].spec
        room = SendRoom(key, self.config.room_deadline_s, group, spec.parallel.tp_size, spec.layout)
        self.send_rooms[key.id] = room
        self._arm_deadline(room, self.config.room_deadline_s)
        logger.info("room %s: prefill side created (group %s)", key, group)
        return room

    def _send_room_for(self, key: RoomKey, group: str, create: bool) -> SendRoom | None:
        room = self.send_rooms.get(key.id)
        if room is not None:
            if key.generation < room.key.generation:
                raise FailedPrecondition(
                    f"room {key}: stale generation (current generation is {room.key.generation})"
                )
            if key.generation > room.key.generation:
                self.fail_send_room(room, FailureCode.SUPERSEDED, f"room id reused with generation {key.generation}")
                self._forget_send_room(room)
                room = None
            elif room.group != group:
                raise InvalidArgument(f"room {key} belongs to prefill group {room.group!r}, not {group!r}")
        if room is None and create:
            room = self._new_send_room(key, group)
        return room

    def enqueue_chunk(self, engine_id: str, chunk: ChunkSpec) -> None:
        eng = self._engine(engine_id, Role.PREFILL)
        key = chunk.room
        if not 0 <= chunk.chunk_id < MAX_CHUNK_ID:
            raise InvalidArgument(f"chunk_id must be < {MAX_CHUNK_ID}, got {chunk.chunk_id}")
        if not 1 <= chunk.num_tokens <= MAX_TOKENS or chunk.token_start + chunk.num_tokens > MAX_TOKENS:
            raise InvalidArgument(f"token range [{chunk.token_start}, +{chunk.num_tokens}) is invalid")
        if len(chunk.aux) > MAX_AUX_BYTES:
            raise InvalidArgument(f"aux is {len(chunk.aux)} B; at most {MAX_AUX_BYTES} B")
        if chunk.aux and not chunk.last:
            raise InvalidArgument("aux may only accompany the last chunk")
        if eng.spec.zero_copy:
            self._check_pages(eng, chunk.pages, chunk.num_tokens, "chunk")
            if chunk.token_start % eng.spec.layout.page_size:
                raise InvalidArgument(
                    f"zero-copy chunks start on a page boundary; token_start {chunk.token_start} is not a multiple "
                    f"of page_size {eng.spec.layout.page_size}"
                )
        else:
            if chunk.pages:
                raise InvalidArgument("pages are only for zero-copy engines; this engine sends slots")
            if chunk.slot.offset not in eng.acquired:
                raise InvalidArgument(
                    f"slot at offset {chunk.slot.offset} is not a slot this engine acquired (or it was already enqueued)"
                )
            held = eng.ring.alloc.slot_length(chunk.slot.offset) or 0
            p = eng.spec.parallel
            need = part_bytes(eng.spec.layout, p.tp_size, p.tp_rank, chunk.num_tokens)
            if chunk.slot.length != 0 and chunk.slot.length > held:
                raise InvalidArgument(f"slot length {chunk.slot.length} exceeds the acquired {held} B")
            if need > held:
                raise InvalidArgument(f"{chunk.num_tokens} tokens need {need} B but the slot holds {held} B")
        room = self.send_rooms.get(key.id)
        if (room is None or room.key.generation < key.generation) and not self.serving:
            raise Unavailable("daemon is draining and accepts no new rooms")
        if room is None or room.key.generation < key.generation:
            dead = self._tombstones.get(key.id)
            if dead is not None and dead[0] == key and dead[3] > time.monotonic():
                raise FailedPrecondition(f"room {key} is FAILED ({dead[1].name}) on the decode side: {dead[2]}")
        room = self._send_room_for(key, eng.spec.group, create=True)
        assert room is not None
        if room.finished:
            raise FailedPrecondition(
                f"room {key} is {room.state.name}"
                + (f": {room.failure_reason}" if room.state is RoomState.FAILED else "")
            )
        if room.num_tokens is not None and chunk.token_start + chunk.num_tokens > room.num_tokens:
            raise InvalidArgument(
                f"room {key}: tokens [{chunk.token_start}, {chunk.token_start + chunk.num_tokens}) "
                f"exceed the room's {room.num_tokens} tokens"
            )
        w = room.writers.get(eng.rank)
        if w is not None and w.engine is not eng:
            raise FailedPrecondition(f"room {key}: rank {eng.rank} is already sending from another engine")
        if w is None:
            w = WriterState(eng)
        if chunk.chunk_id in w.chunks:
            raise AlreadyExists(f"room {key}: chunk {chunk.chunk_id} was already enqueued by rank {eng.rank}")
        if w.last_id is not None and chunk.chunk_id > w.last_id:
            raise InvalidArgument(f"room {key}: chunk {chunk.chunk_id} comes after the last chunk {w.last_id}")
        if chunk.last and w.chunks and max(w.chunks) > chunk.chunk_id:
            raise InvalidArgument(f"room {key}: last chunk {chunk.chunk_id} precedes chunk {max(w.chunks)}")
        # Accepted: from here on the daemon owns the slot.
        room.writers[eng.rank] = w
        eng.send_rooms.add(key.id)
        eng.acquired.discard(chunk.slot.offset)
        out = OutChunk(eng.rank, eng, chunk, slot_freed=eng.spec.zero_copy)
        w.chunks[chunk.chunk_id] = out
        if chunk.last:
            w.last_id = chunk.chunk_id
            w.aux = chunk.aux
        if room.first_chunk_at is None:
            room.first_chunk_at = time.monotonic()
        if room.bootstrapped.is_set() and room.advance(RoomState.TRANSFERRING):
            self._emit_send(room)
        self.scheduler.submit(room, out)
        self.refresh_metrics()

    # ------------------------------------------------------------------ prefill: peer requests

    def bootstrap(
        self, sender: DaemonRef, key: RoomKey, group: str, reader: int, decode_tp: int, layout: KVLayout,
        num_tokens: int, deadline_unix_ms: int, zero_copy: ZeroCopyTarget | None = None,
    ) -> SendRoom:
        if not 1 <= decode_tp <= 1024 or not 0 <= reader < decode_tp:
            raise InvalidArgument(f"reader rank {reader} must be in [0, decode_tp={decode_tp})")
        if not 1 <= num_tokens <= MAX_TOKENS:
            raise InvalidArgument(f"num_tokens must be 1..{MAX_TOKENS}")
        room = self.send_rooms.get(key.id)
        if room is None or room.key.generation < key.generation:
            self._require_serving()
        room = self._send_room_for(key, group, create=True)
        assert room is not None
        if room.finished:
            raise FailedPrecondition(f"room {key} is already {room.state.name}: {room.failure_reason}")
        assert room.layout is not None
        why = layouts_compatible(room.layout, layout)
        if why:
            self.fail_send_room(room, FailureCode.MISMATCH, f"layout mismatch: {why}", push=False)
            raise FailedPrecondition(f"room {key}: layout mismatch: {why}")
        try:
            rank_heads(layout.total_kv_heads, decode_tp, reader, layout.mla)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        group_zc = self._group_engines(group, Role.PREFILL)[0].spec.zero_copy
        if group_zc != (zero_copy is not None):
            why = "prefill group is zero-copy but the reader is not" if group_zc else (
                "reader is zero-copy but the prefill group sends slots")
            self.fail_send_room(room, FailureCode.MISMATCH, why, push=False)
            raise FailedPrecondition(f"room {key}: zero-copy mismatch: {why}")
        if zero_copy is not None:
            if room.prefill_tp != decode_tp and not layout.mla:
                raise FailedPrecondition(
                    f"room {key}: zero-copy needs the same TP on both sides (or MLA); "
                    f"prefill {room.prefill_tp}, decode {decode_tp}"
                )
            if layout.page_size != room.layout.page_size:
                raise FailedPrecondition(f"room {key}: zero-copy needs equal page sizes")
            if len(zero_copy.pages) != pages_for(num_tokens, layout.page_size) or zero_copy.num_slots <= 0:
                raise InvalidArgument(f"room {key}: zero-copy target pages do not cover {num_tokens} tokens")
            room.zero_copy = True
            room.zc_targets[reader] = zero_copy
        if room.decode_tp is not None and room.decode_tp != decode_tp:
            raise InvalidArgument(f"room {key}: decode_tp {decode_tp} differs from {room.decode_tp}")
        if room.num_tokens is not None and room.num_tokens != num_tokens:
            raise InvalidArgument(f"room {key}: num_tokens {num_tokens} differs from {room.num_tokens}")
        for w in room.writers.values():
            for c in w.chunks.values():
                if c.spec.token_start + c.spec.num_tokens > num_tokens:
                    self.fail_send_room(room, FailureCode.MISMATCH, "an enqueued chunk exceeds the room's tokens")
                    raise FailedPrecondition(f"room {key}: enqueued chunks exceed {num_tokens} tokens")
        peer = self.peers.handle_for(sender)
        if room.peer is not None and room.peer is not peer:
            raise InvalidArgument(f"room {key} is bootstrapped by another decode daemon")
        room.peer = peer
        room.decode_tp = decode_tp
        room.num_tokens = num_tokens
        room.readers.add(reader)
        if deadline_unix_ms:
            remaining = deadline_unix_ms / 1000 - time.time()
            self._arm_deadline(room, max(0.0, remaining))
        if len(room.readers) == decode_tp and not room.bootstrapped.is_set():
            room.plan = plan(room.prefill_tp, decode_tp, room.layout.total_kv_heads, room.layout.mla)
            room.bootstrapped.set()
            room.advance(RoomState.WAITING_FOR_INPUT)
            if room.writers:
                room.advance(RoomState.TRANSFERRING)
            logger.info("room %s: bootstrapped by %d reader(s) of %s", key, decode_tp, sender.daemon_id)
            self._emit_send(room)
        self.refresh_metrics()
        return room

    def peer_watermark(self, sender: DaemonRef) -> None:
        peer = self.peers.known(sender.daemon_id)
        if peer is not None:
            peer.space_freed()

    def writer_chunk_done(self, room: SendRoom, chunk: OutChunk) -> None:
        """All parts of a chunk are written (or the room failed): give back the source slot."""
        if not chunk.slot_freed and chunk.in_flight == 0:
            chunk.slot_freed = True
            self.free_slot(chunk.engine, chunk.spec.slot.offset)
        if room.finished:
            self._maybe_quiesce(room)
            self.refresh_metrics()
            return
        w = room.writers[chunk.writer]
        w.done.add(chunk.spec.chunk_id)
        self._emit_send(room, writer=chunk.writer)
        if room.all_writers_finished() and not room.complete_sent:
            last_ids = {w.last_id for w in room.writers.values()}
            if len(last_ids) != 1:
                self.fail_send_room(room, FailureCode.MISMATCH, f"writers disagree on the last chunk: {last_ids}")
                return
            room.complete_sent = True
            self.spawn(self._complete(room), f"complete {room.key}")

    async def _complete(self, room: SendRoom) -> None:
        assert room.peer is not None and room.decode_tp is not None
        last = next(iter(room.writers.values())).last_id
        assert last is not None
        aux = room.writers[0].aux if 0 in room.writers else b""
        try:
            await asyncio.gather(
                *(room.peer.complete(room.key, r, last + 1, aux) for r in range(room.decode_tp))
            )
        except Exception as exc:
            self.fail_send_room(room, FailureCode.PEER_LOST, f"completing with the decode daemon failed: {exc}")
            return
        if room.advance(RoomState.SUCCESS):
            self._finish_metrics(room)
            logger.info("room %s: prefill side SUCCESS", room.key)
            self._emit_send(room)
            self._arm_gc(room)
        self.refresh_metrics()

    def fail_send_room(self, room: SendRoom, code: FailureCode, reason: str, push: bool = True) -> None:
        if not room.fail(code, reason):
            return
        logger.warning("room %s: prefill side FAILED (%s): %s", room.key, code.name, reason)
        self.metrics.room_failures.labels(reason=code.name).inc()
        self._finish_metrics(room)
        room.bootstrapped.set()  # wake chunks waiting for bootstrap so they give back their slots
        for w in room.writers.values():
            for c in w.chunks.values():
                if c.in_flight == 0 and not c.slot_freed:
                    c.slot_freed = True
                    self.free_slot(c.engine, c.spec.slot.offset)
        for fut in room.dest.values():
            if not fut.done():
                fut.cancel()
        self.scheduler.room_failed(room)
        if push and room.peer is not None:
            self.spawn(room.peer.abort(room.key, code, reason, quiesced=room.in_flight == 0), f"abort {room.key}")
            if room.in_flight == 0:
                room.quiesce_sent = True
        self._maybe_quiesce(room)
        self._emit_send(room)
        self._arm_gc(room)
        self.refresh_metrics()

    def _maybe_quiesce(self, room: SendRoom) -> None:
        """Tells the decode side once no transfer of a failed room can still land."""
        if room.state is not RoomState.FAILED or room.in_flight or room.quiesce_sent or room.peer is None:
            return
        room.quiesce_sent = True
        self.spawn(
            room.peer.abort(room.key, room.failure_code, room.failure_reason, quiesced=True), f"quiesce {room.key}"
        )

    def _forget_send_room(self, room: SendRoom) -> None:
        if self.send_rooms.get(room.key.id) is room:
            del self.send_rooms[room.key.id]
        for w in room.writers.values():
            w.engine.send_rooms.discard(room.key.id)
        self._cancel_timers(room)

    # ------------------------------------------------------------------ decode side

    def expect_room(
        self, engine_id: str, key: RoomKey, prefill_address: str, prefill_group: str, num_tokens: int,
        deadline_ms: int, pages: tuple[int, ...] = (),
    ) -> RecvRoom:
        self._require_serving()
        eng = self._engine(engine_id, Role.DECODE)
        if eng.spec.zero_copy:
            self._check_pages(eng, pages, num_tokens, "ExpectRoom")
        elif pages:
            raise InvalidArgument("pages are only for zero-copy engines")
        if prefill_address and not _valid_hostport(prefill_address):
            raise InvalidArgument("prefill_address must be HOST:PORT of the prefill daemon's peer service")
        if not prefill_address and not self.registry.enabled:
            raise InvalidArgument("prefill_address is required (HOST:PORT) unless a fleet registry is configured")
        if not prefill_group:
            raise InvalidArgument("prefill_group must name the prefill engines' group")
        if not 1 <= num_tokens <= MAX_TOKENS:
            raise InvalidArgument(f"num_tokens must be 1..{MAX_TOKENS}, got {num_tokens}")
        if deadline_ms and not 10 <= deadline_ms <= 86_400_000:
            raise InvalidArgument(f"deadline_ms must be 10..86400000, got {deadline_ms}")
        p = eng.spec.parallel
        room = self.recv_rooms.get(key.id)
        if room is not None:
            if key.generation < room.key.generation:
                raise FailedPrecondition(f"room {key}: stale generation (current {room.key.generation})")
            if key.generation > room.key.generation:
                self.fail_recv_room(room, FailureCode.SUPERSEDED, f"room id reused with generation {key.generation}")
                self._forget_recv_room(room)
                room = None
        if room is None:
            deadline_s = deadline_ms / 1000 if deadline_ms else self.config.room_deadline_s
            room = RecvRoom(key, deadline_s, prefill_address, prefill_group, num_tokens, p.tp_size, eng.spec.layout)
            self.recv_rooms[key.id] = room
            self._arm_deadline(room, deadline_s)
            logger.info("room %s: decode side created (prefill %s/%s)", key, prefill_address, prefill_group)
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
        self.spawn(self._bootstrap_reader(room, eng.rank), f"bootstrap {key}")
        self.refresh_metrics()
        return room

    async def _bootstrap_reader(self, room: RecvRoom, reader: int) -> None:
        assert room.layout is not None
        deadline_ms = int((time.time() + room.deadline_s - (time.monotonic() - room.created)) * 1000)
        retry_until = time.monotonic() + BOOTSTRAP_RETRY_S
        while True:
            try:
                if room.by_group:
                    room.prefill_address = await self._resolve_prefill(room)
                peer = await self.peers.connect(room.prefill_address)
                room.peer = peer
                rs0 = room.readers.get(reader)
                target = None
                if rs0 is not None and rs0.engine.spec.zero_copy:
                    ring = rs0.engine.ring
                    target = ZeroCopyTarget(ring.base_addr, rs0.engine.pool_slots, ring.mem, ring.device, rs0.pages)
                prefill_tp, layout = await peer.bootstrap(
                    room.key, room.prefill_group, reader, room.decode_tp, room.layout, room.num_tokens or 0,
                    deadline_ms, target,
                )
                break
            except grpc.aio.AioRpcError as exc:
                # The prefill engines may still be starting: a missing group gets a short grace.
                if exc.code() == grpc.StatusCode.NOT_FOUND and time.monotonic() < retry_until and not room.finished:
                    room.resolving = None  # a group addressed by name may have moved: look again
                    await asyncio.sleep(0.1)
                    continue
                # The prefill daemon has us down (it lost our heartbeats, or thinks we restarted)
                # while we still see it up: handshake again instead of failing every room until
                # its next heartbeat notices.
                if (exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "handshake" in (exc.details() or "")
                        and room.peer is not None and time.monotonic() < retry_until and not room.finished):
                    try:
                        await room.peer.handshake(force=True)
                        continue
                    except Exception as hs_exc:
                        logger.info("room %s: re-handshake with %s failed: %s", room.key, room.prefill_address, hs_exc)
                code = FailureCode.PEER_LOST if exc.code() in _PEER_DOWN else FailureCode.MISMATCH
                self.fail_recv_room(
                    room, code, f"bootstrap with {room.prefill_address} failed: {exc.code().name}: {exc.details()}",
                    push=False,
                )
                return
            except KvxferError as exc:  # the registry could not place the group
                self.fail_recv_room(room, FailureCode.PEER_LOST, str(exc), push=False)
                return
            except Exception as exc:
                self.fail_recv_room(room, FailureCode.PEER_LOST, f"bootstrap with {room.prefill_address} failed: {exc}",
                                    push=False)
                return
        if room.finished:
            return
        why = layouts_compatible(layout, room.layout)
        if why:
            self.fail_recv_room(room, FailureCode.MISMATCH, f"layout mismatch: {why}")
            return
        if room.prefill_tp is None:
            room.prefill_tp = prefill_tp
            room.plan = plan(prefill_tp, room.decode_tp, room.layout.total_kv_heads, room.layout.mla)
        rs = room.readers.get(reader)
        if rs is None:
            return
        rs.bootstrapped = True
        if rs.alloc_early and room.peer is not None:
            # An AllocSlot overtook the Bootstrap reply and was told to wait: ask again now.
            self.spawn(room.peer.push_watermark(rs.engine.id, rs.engine.ring.alloc.watermark()), "bootstrap nudge")
        all_ready = len(room.readers) == room.decode_tp and all(r.bootstrapped for r in room.readers.values())
        if all_ready and room.advance(RoomState.WAITING_FOR_INPUT):
            logger.info("room %s: decode side bootstrapped (prefill tp %d)", room.key, prefill_tp)
            self._emit_recv(room)
        self.refresh_metrics()

    async def _resolve_prefill(self, room: RecvRoom) -> str:
        """One registry lookup per room (every reader must reach the same daemon); it waits for
        the group to register until just before the room's deadline, so the failure names it."""
        if room.resolving is None:
            # Ends well before the room's deadline timer, even on a busy loop, so the failure says
            # which group was missing rather than just "deadline passed".
            margin = min(RESOLVE_MARGIN_MAX_S, max(RESOLVE_MARGIN_MIN_S, 0.2 * room.deadline_s))
            until = room.created + room.deadline_s - margin
            room.resolving = asyncio.ensure_future(self._resolved_address(room.prefill_group, until))
        return await asyncio.shield(room.resolving)

    async def _resolved_address(self, group: str, until: float) -> str:
        return (await self.registry.resolve_group(group, "prefill", until)).address

    def _recv_room(self, key: RoomKey) -> RecvRoom:
        room = self.recv_rooms.get(key.id)
        if room is None or room.key.generation != key.generation:
            raise NotFound(f"room {key} is not expected on this daemon")
        return room

    def alloc_slot(
        self, sender: DaemonRef, key: RoomKey, chunk_id: int, reader: int, token_start: int, num_tokens: int,
        last: bool,
    ) -> tuple[int, int, str, int] | None:
        room = self._recv_room(key)
        if room.finished:
            raise FailedPrecondition(f"room {key} is {room.state.name}: {room.failure_reason}")
        if room.peer is None or room.peer.daemon_id != sender.daemon_id:
            raise PermissionDenied(f"room {key} is not bootstrapped with daemon {sender.daemon_id!r}")
        rs = room.readers.get(reader)
        if rs is None:
            raise FailedPrecondition(f"room {key}: reader {reader} is not bootstrapped")
        if not rs.bootstrapped or room.plan is None or room.layout is None:
            # Our Bootstrap went out and the prefill side answered it, but its AllocSlot can
            # overtake that answer: not an error, a slot it may ask for again (we nudge it once
            # the answer is in, see _bootstrap_reader).
            rs.alloc_early = True
            return None
        assert room.num_tokens is not None
        if not 0 <= chunk_id < MAX_CHUNK_ID:
            raise InvalidArgument(f"chunk_id {chunk_id} out of range")
        if num_tokens < 1 or token_start + num_tokens > room.num_tokens:
            raise InvalidArgument(
                f"room {key}: tokens [{token_start}, {token_start + num_tokens}) exceed {room.num_tokens}"
            )
        existing = rs.slots.get(chunk_id)
        ring = rs.engine.ring
        if existing is not None:
            if (existing.token_start, existing.num_tokens) != (token_start, num_tokens):
                raise InvalidArgument(f"room {key}: chunk {chunk_id} was allocated for another token range")
            return ring.base_addr + existing.offset, existing.length, ring.mem, ring.device
        if rs.num_chunks is not None and chunk_id >= rs.num_chunks:
            raise InvalidArgument(f"room {key}: chunk {chunk_id} is after the last chunk")
        nbytes = part_bytes(room.layout, room.decode_tp, reader, num_tokens)
        if not ring.alloc.fits_ever(nbytes):
            self.fail_recv_room(room, FailureCode.MISMATCH, f"chunk of {nbytes} B can never fit the decode ring")
            raise FailedPrecondition(f"room {key}: a {nbytes} B chunk does not fit the reader's {ring.size} B ring")
        off = ring.alloc.alloc(nbytes)
        if off is None:
            return None
        expected = frozenset(s.writer for s in room.plan if s.reader == reader)
        rs.slots[chunk_id] = InSlot(off, nbytes, token_start, num_tokens, last, nbytes, expected)
        self._ring_metrics(ring)
        self.refresh_metrics()
        return ring.base_addr + off, nbytes, ring.mem, ring.device

    def on_notifs(self, notifs: Iterable[tuple[str, bytes]]) -> None:
        for agent, msg in notifs:
            parsed = decode_notif(msg)
            if parsed is None:
                logger.warning("dropping malformed notification from %s: %r", agent, msg[:64])
                continue
            self.chunk_part_landed(parsed)

    def chunk_part_landed(self, n: Notif) -> None:
        key, chunk_id, writer, reader = n.room, n.chunk_id, n.writer, n.reader
        room = self.recv_rooms.get(key.id)
        if room is None or room.key.generation != key.generation:
            logger.debug("room %s: late notification for an old or unknown room dropped", key)
            return
        rs = room.readers.get(reader)
        slot = rs.slots.get(chunk_id) if rs else None
        if (slot is None and rs is not None and rs.engine.spec.zero_copy and room.plan is not None
                and room.num_tokens is not None and n.num_tokens > 0
                and n.token_start + n.num_tokens <= room.num_tokens and 0 <= chunk_id < MAX_CHUNK_ID):
            # Zero-copy: no slot was allocated; the chunk lands in the reader's own pages.
            expected = frozenset(s.writer for s in room.plan if s.reader == reader)
            slot = rs.slots[chunk_id] = InSlot(-1, 0, n.token_start, n.num_tokens, n.last, 0, expected)
        if rs is None or slot is None or writer not in slot.expected_writers:
            logger.warning("room %s: unexpected notification chunk=%d writer=%d reader=%d", key, chunk_id, writer, reader)
            return
        if room.finished:
            return
        slot.landed_writers.add(writer)
        if slot.landed or slot.landed_writers != set(slot.expected_writers):
            return
        slot.landed = True
        room.advance(RoomState.TRANSFERRING)
        self._emit_landed(room, rs, chunk_id, slot)
        self._check_recv_done(room)

    def complete(self, sender: DaemonRef, key: RoomKey, reader: int, num_chunks: int, aux: bytes) -> None:
        room = self._recv_room(key)
        if room.peer is None or room.peer.daemon_id != sender.daemon_id:
            raise PermissionDenied(f"room {key} is not bootstrapped with daemon {sender.daemon_id!r}")
        if room.finished:
            raise FailedPrecondition(f"room {key} is {room.state.name}")
        rs = room.readers.get(reader)
        if rs is None:
            raise NotFound(f"room {key}: no reader {reader}")
        if not 1 <= num_chunks <= MAX_CHUNK_ID:
            raise InvalidArgument(f"num_chunks {num_chunks} out of range")
        if any(c >= num_chunks for c in rs.slots):
            self.fail_recv_room(room, FailureCode.MISMATCH, "more chunks arrived than the prefill side reports")
            raise FailedPrecondition(f"room {key}: chunk count mismatch")
        rs.num_chunks = num_chunks
        room.aux = aux
        self._check_recv_done(room)

    def _check_recv_done(self, room: RecvRoom) -> None:
        if room.finished or len(room.readers) != room.decode_tp:
            return
        if all(r.complete for r in room.readers.values()):
            room.advance(RoomState.SUCCESS)
            self._finish_metrics(room)
            logger.info("room %s: decode side SUCCESS", room.key)
            self._emit_recv(room, aux=room.aux)
            self.refresh_metrics()

    def watermark(self, engine_id: str, key: RoomKey, chunk_ids: Iterable[int]) -> Watermark:
        eng = self._engine(engine_id, Role.DECODE)
        room = self._recv_room(key)
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
            slot = rs.slots[cid]
            slot.consumed = True
            self._free_in_slot(rs, slot)
        if room.peer is not None:
            self.spawn(room.peer.push_watermark(eng.id, eng.ring.alloc.watermark()), "watermark push")
        self.refresh_metrics()
        return eng.ring.alloc.watermark()

    def _free_in_slot(self, rs: ReaderState, slot: InSlot) -> None:
        if slot.offset < 0:
            slot.freed = True
        elif not slot.freed:
            slot.freed = True
            self.free_slot(rs.engine, slot.offset)

    def fail_recv_room(self, room: RecvRoom, code: FailureCode, reason: str, push: bool = True) -> None:
        if not room.fail(code, reason):
            return
        logger.warning("room %s: decode side FAILED (%s): %s", room.key, code.name, reason)
        self.metrics.room_failures.labels(reason=code.name).inc()
        self._finish_metrics(room)
        if push and room.peer is not None:
            self.spawn(room.peer.abort(room.key, code, reason, quiesced=False), f"abort {room.key}")
        if room.peer is None or code is FailureCode.PEER_LOST:
            room.quiesced = True
        self._release_recv_slots(room)
        self._emit_recv(room)
        self._arm_gc(room)
        self.refresh_metrics()

    def _release_recv_slots(self, room: RecvRoom) -> None:
        """Landed slots go back now; unlanded ones only once no write can land there."""
        for rs in room.readers.values():
            for slot in rs.slots.values():
                if slot.landed or room.quiesced:
                    self._free_in_slot(rs, slot)
        if not room.quiesced:
            self._loop.call_later(QUARANTINE_S, self._quarantine_over, room)

    def _quarantine_over(self, room: RecvRoom) -> None:
        if not room.quiesced:
            logger.warning("room %s: no quiesce from the prefill side in %.0f s; reusing its slots", room.key, QUARANTINE_S)
            room.quiesced = True
            self._release_recv_slots(room)

    def peer_abort(self, sender: DaemonRef, key: RoomKey, code: FailureCode, reason: str, quiesced: bool) -> None:
        rroom = self.recv_rooms.get(key.id)
        if rroom is not None and rroom.key == key and rroom.peer is not None and rroom.peer.daemon_id == sender.daemon_id:
            if quiesced:
                rroom.quiesced = True
            if rroom.state is RoomState.SUCCESS:
                # Every byte landed and the engine may still be reading unconsumed chunks: a late
                # failure on the prefill side (e.g. a Complete ack lost) must not free them.
                pass
            elif rroom.finished:
                if quiesced:
                    self._release_recv_slots(rroom)
            else:
                self.fail_recv_room(rroom, code, f"prefill side: {reason}", push=False)
        sroom = self.send_rooms.get(key.id)
        if sroom is not None and sroom.key == key and sroom.peer is not None and sroom.peer.daemon_id == sender.daemon_id:
            self.fail_send_room(sroom, code, f"decode side: {reason}", push=False)
            # The decode side still needs to hear when our writes have stopped.
            self._maybe_quiesce(sroom)
        elif (sroom is None or sroom.key.generation < key.generation) and (rroom is None or rroom.key != key):
            # The decode side gave up on a room before any prefill rank sent a chunk (its deadline,
            # an abort): remember it, or the first chunk would open a room nobody bootstraps,
            # holding the engine's slots until our own deadline.
            now = time.monotonic()
            if len(self._tombstones) >= MAX_TOMBSTONES:
                for rid in [r for r, t in self._tombstones.items() if t[3] < now] or list(self._tombstones)[:1024]:
                    del self._tombstones[rid]
            self._tombstones[key.id] = (key, code, reason, now + FINISHED_ROOM_TTL_S)

    def peer_lost(self, peer: PeerHandle, reason: str) -> None:
        for sroom in list(self.send_rooms.values()):
            if sroom.peer is peer and not sroom.finished:
                self.fail_send_room(sroom, FailureCode.PEER_LOST, reason, push=False)
                sroom.quiesce_sent = True
        for rroom in list(self.recv_rooms.values()):
            if rroom.peer is peer:
                rroom.quiesced = True
                if rroom.finished:
                    self._release_recv_slots(rroom)
                else:
                    self.fail_recv_room(rroom, FailureCode.PEER_LOST, reason, push=False)

    def _free_released_reader(self, room: RecvRoom, rs: ReaderState) -> None:
        """A reader done with a room (released, or the room forgotten) gives back the slots it
        never watermarked; unlanded ones stay quarantined until no write can land there."""
        for slot in rs.slots.values():
            if slot.landed or room.quiesced:
                self._free_in_slot(rs, slot)

    def _forget_recv_room(self, room: RecvRoom) -> None:
        if self.recv_rooms.get(room.key.id) is room:
            del self.recv_rooms[room.key.id]
        for rs in room.readers.values():
            rs.engine.recv_rooms.discard(room.key.id)
            # Without this a SUCCESS room released (or collected) before every chunk was
            # watermarked would hold its slots for ever.
            self._free_released_reader(room, rs)
        self._cancel_timers(room)

    # ------------------------------------------------------------------ both sides

    def _own_room(self, eng: Engine, key: RoomKey) -> RoomBase:
        if eng.role is Role.PREFILL:
            room = self.send_rooms.get(key.id)
            if room is None or room.key.generation != key.generation or eng.rank not in room.writers:
                raise NotFound(f"room {key} has no chunks from this engine")
            return room
        rroom = self.recv_rooms.get(key.id)
        if rroom is None or rroom.key.generation != key.generation or eng.rank not in rroom.readers:
            raise NotFound(f"room {key} is not expected by this engine")
        return rroom

    def poll_room(self, engine_id: str, key: RoomKey) -> RoomView:
        eng = self._engine(engine_id)
        room = self._own_room(eng, key)
        if isinstance(room, SendRoom):
            return RoomView(room.key, room.state, room.failure_code, room.failure_reason,
                            chunks_done=len(room.writers[eng.rank].done))
        assert isinstance(room, RecvRoom)
        rs = room.readers[eng.rank]
        landed = tuple(
            self._landed(cid, s) for cid, s in sorted(rs.slots.items()) if s.landed and not s.consumed and not s.freed
        )
        return RoomView(room.key, room.state, room.failure_code, room.failure_reason, landed,
                        room.aux if room.state is RoomState.SUCCESS else b"")

    def abort_room(self, engine_id: str, key: RoomKey, reason: str) -> None:
        eng = self._engine(engine_id)
        room = self._own_room(eng, key)
        why = f"aborted by engine {eng.spec.name or eng.id}" + (f": {reason[:200]}" if reason else "")
        if isinstance(room, SendRoom):
            self.fail_send_room(room, FailureCode.ABORTED, why)
        elif isinstance(room, RecvRoom):
            self.fail_recv_room(room, FailureCode.ABORTED, why)

    def release_room(self, engine_id: str, key: RoomKey) -> None:
        eng = self._engine(engine_id)
        room = self._own_room(eng, key)
        if not room.finished:
            self.abort_room(engine_id, key, "released before it finished")
        if isinstance(room, SendRoom):
            eng.send_rooms.discard(key.id)
            if not any(key.id in w.engine.send_rooms for w in room.writers.values()):
                self._forget_send_room(room)
        elif isinstance(room, RecvRoom):
            rs = room.readers[eng.rank]
            rs.released = True
            eng.recv_rooms.discard(key.id)
            self._free_released_reader(room, rs)
            if all(r.released for r in room.readers.values()):
                self._forget_recv_room(room)
        self.refresh_metrics()

    def _arm_deadline(self, room: RoomBase, seconds: float) -> None:
        if room.deadline_handle is not None:
            room.deadline_handle.cancel()
        room.deadline_handle = self._loop.call_later(seconds, self._deadline, room)

    def _deadline(self, room: RoomBase) -> None:
        if room.finished:
            return
        reason = f"deadline passed after {time.monotonic() - room.created:.1f} s in state {room.state.name}"
        if isinstance(room, SendRoom):
            self.fail_send_room(room, FailureCode.DEADLINE, reason)
        elif isinstance(room, RecvRoom):
            self.fail_recv_room(room, FailureCode.DEADLINE, reason)

    def _arm_gc(self, room: RoomBase) -> None:
        if room.deadline_handle is not None:
            room.deadline_handle.cancel()
            room.deadline_handle = None
        if room.gc_handle is None:
            room.gc_handle = self._loop.call_later(FINISHED_ROOM_TTL_S, self._gc, room)

    def _gc(self, room: RoomBase) -> None:
        if isinstance(room, SendRoom):
            if room.in_flight:
                room.gc_handle = self._loop.call_later(FINISHED_ROOM_TTL_S, self._gc, room)
                return
            self._forget_send_room(room)
        elif isinstance(room, RecvRoom):
            self._forget_recv_room(room)
        self.refresh_metrics()

    def _cancel_timers(self, room: RoomBase) -> None:
        for h in (room.deadline_handle, room.gc_handle):
            if h is not None:
                h.cancel()
        room.deadline_handle = room.gc_handle = None

    def _finish_metrics(self, room: RoomBase) -> None:
        self.metrics.rooms_finished.labels(role=room.role, state=room.state.name).inc()
        if room.state is RoomState.SUCCESS:
            self.metrics.room_duration.labels(role=room.role).observe(time.monotonic() - room.created)

    # ------------------------------------------------------------------ events

    @staticmethod
    def _landed(cid: int, s: InSlot) -> LandedChunk:
        return LandedChunk(cid, SlotRef(max(0, s.offset), s.length), s.token_start, s.num_tokens, s.last, s.chunk_bytes)

    def _publish(self, eng: Engine, ev: RoomEvent) -> None:
        for q in eng.watchers:
            q.put_nowait(ev)

    def _emit_send(self, room: SendRoom, writer: int | None = None) -> None:
        ev = RoomEvent(room.key, room.state, room.failure_code, room.failure_reason)
        for rank, w in room.writers.items():
            if writer is None or rank == writer:
                self._publish(w.engine, ev)

    def _emit_recv(self, room: RecvRoom, aux: bytes = b"") -> None:
        ev = RoomEvent(room.key, room.state, room.failure_code, room.failure_reason, aux=aux)
        for rs in room.readers.values():
            self._publish(rs.engine, ev)

    def _emit_landed(self, room: RecvRoom, rs: ReaderState, cid: int, slot: InSlot) -> None:
        self._publish(rs.engine, RoomEvent(room.key, room.state, landed=self._landed(cid, slot)))

    def watch(self, engine_id: str) -> asyncio.Queue[RoomEvent | None]:
        eng = self._engine(engine_id)
        q: asyncio.Queue[RoomEvent | None] = asyncio.Queue()
        eng.watchers.add(q)
        return q

    def unwatch(self, engine_id: str, q: asyncio.Queue[RoomEvent | None]) -> None:
        eng = self.engines.get(engine_id)
        if eng is not None:
            eng.watchers.discard(q)

    # ------------------------------------------------------------------ status and shutdown

    def active_rooms(self) -> int:
        return sum(1 for r in self.send_rooms.values() if not r.finished) + sum(
            1 for r in self.recv_rooms.values() if not r.finished
        )

    def unread_rooms(self) -> int:
        """Finished rooms that a live engine has not released yet (it may not know the outcome)."""
        n = sum(
            1 for r in self.send_rooms.values()
            if r.finished and any(not w.engine.closing and r.key.id in w.engine.send_rooms for w in r.writers.values())
        )
        return n + sum(
            1 for rr in self.recv_rooms.values()
            if rr.finished and any(not rs.released and not rs.engine.closing for rs in rr.readers.values())
        )

    def fail_all(self, code: FailureCode, reason: str) -> None:
        for sroom in list(self.send_rooms.values()):
            self.fail_send_room(sroom, code, reason)
        for rroom in list(self.recv_rooms.values()):
            self.fail_recv_room(rroom, code, reason)

    def status(self) -> dict[str, object]:
        counts: dict[str, int] = {}
        for r in [*self.send_rooms.values(), *self.recv_rooms.values()]:
            counts[r.state.name] = counts.get(r.state.name, 0) + 1
        return {
            "daemon_id": self.daemon_id,
            "version": __version__,
            "serving": self.serving,
            "engines": list(self.engines.values()),
            "peers": self.peers.all(),
            "rooms_by_state": counts,
            "slots_held": self.slots_held(),
            "pool_bytes": self.pool.size,
            "uptime_s": time.monotonic() - self.started,
            "peer_address": self.address,
        }
