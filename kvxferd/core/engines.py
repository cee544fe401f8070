"""Engines and their rings: registration, leases, source slots, and when a ring may go back.

Owns the engine table. Rooms are not its business: when an engine goes (unregistered, lease
lapsed, replaced by a restarted rank) it tells the room sides through `on_engine_gone`, and it
releases the engine's ring only once no slot or credit in it is held any more.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvxfer_protocol.slot_layout import part_bytes, rank_heads
from kvxferd.buffers.host_pool import HostPool, RingAllocator
from kvxferd.config import Config
from kvxferd.core.caps import ENGINES, MAX_ENGINE_NAME, MAX_GROUP, MAX_ID, Limits, check_len
from kvxferd.core.peer_port import Identity
from kvxferd.core.types import EngineSpec, FailureCode, Role, RoomEvent, SlotRef
from kvxferd.errors import FailedPrecondition, InvalidArgument, KvxferError, NotFound, ResourceExhausted, Unavailable
from kvxferd.ops.metrics import Metrics

logger = logging.getLogger(__name__)

MAX_TOKENS = 1 << 24
# Engine ids: a random part, then the daemon instance (the host pool's tag) that registered it.
_ENGINE_ID = re.compile(r"[0-9a-f]{32}@[0-9a-f]{6,32}")


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
    # Set whenever a slot of this engine's ring is freed: AcquireSlot calls waiting for space.
    space: asyncio.Event = field(default_factory=asyncio.Event)
    # WatchRooms queues: events, None when the engine goes, an error when the reader fell behind.
    watchers: set[asyncio.Queue[RoomEvent | KvxferError | None]] = field(default_factory=set)
    # Those of them that asked for an event per chunk written (WatchRoomsRequest.chunk_progress).
    progress_watchers: set[asyncio.Queue[RoomEvent | KvxferError | None]] = field(default_factory=set)
    # Those that asked for an event per landed layer range (WatchRoomsRequest.layer_progress).
    layer_watchers: set[asyncio.Queue[RoomEvent | KvxferError | None]] = field(default_factory=set)
    send_rooms: set[int] = field(default_factory=set)
    recv_rooms: set[int] = field(default_factory=set)
    closing: bool = False
    # Zero-copy engines: token slots per (layer, plane) in the pool held by the ring.
    pool_slots: int = 0
    # Claimed slots (RegisterEngineRequest.claim_slots): the engine's tag of each slot it cut out
    # of its ring that the daemon holds, by offset, and the tags let go of not yet told.
    claims: dict[int, int] = field(default_factory=dict)
    freed_claims: list[int] = field(default_factory=list)

    @property
    def role(self) -> Role:
        return self.spec.role

    @property
    def rank(self) -> int:
        return self.spec.parallel.tp_rank

    @functools.cached_property
    def claims_slots(self) -> bool:
        """Cuts its own slots: asked for, and a sender with a slot ring (zero-copy has no slots)."""
        return self.spec.claim_slots and self.role is Role.PREFILL and not self.spec.zero_copy

    @functools.cached_property
    def token_bytes(self) -> int:
        """Bytes one token of this engine's part takes in a slot (a part is linear in tokens):
        computed once, not per chunk and per slot."""
        p = self.spec.parallel
        return part_bytes(self.spec.layout, p.tp_size, p.tp_rank, 1)


def _ring_size(spec: EngineSpec) -> int:
    return spec.cuda_ring.size if spec.cuda_ring is not None else spec.ring_bytes


def zero_copy_slot_bytes(spec: EngineSpec) -> int:
    """Bytes of one token slot across a zero-copy pool's [layers, K/V] planes, for this rank's heads."""
    lay, p = spec.layout, spec.parallel
    heads = rank_heads(lay.total_kv_heads, p.tp_size, p.tp_rank, lay.mla).count
    return lay.num_layers * lay.planes * heads * lay.head_dim * lay.dtype_bytes


def _drain_freed(eng: Engine) -> list[int]:
    out, eng.freed_claims = eng.freed_claims, []
    return out


async def _run_inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class EngineTable:
    def __init__(self, config: Config, pool: HostPool, metrics: Metrics, ident: Identity,
                 spawn: Callable[[Coroutine[Any, Any, Any], str], None]) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.ident = ident
        self.serving = True
        self.engines: dict[str, Engine] = {}
        self.limits = Limits(config)
        self._spawn = spawn
        # Engines gone whose rings still have slots or credits a transfer may touch.
        self._closing: list[Engine] = []
        # Set by the node: fails the rooms of an engine that is gone, revokes credits on its ring.
        self.on_engine_gone: Callable[[Engine, FailureCode, str], None] = lambda e, c, r: None
        # Answers "does an unfinished room still wait for chunks from this engine?" (drain).
        self.owes_chunks: Callable[[Engine], bool] = lambda e: False
        # Told whenever the set of engines changes (the fleet registry republishes our groups).
        self.on_change: Callable[[], None] = lambda: None
        # Runs a slow blocking call (CUDA IPC import, VRAM registration) off the event loop.
        self.run_blocking: Callable[..., Awaitable[Any]] = _run_inline

    # ------------------------------------------------------------------ lookups

    def get(self, engine_id: str, role: Role | None = None) -> Engine:
        check_len("engine_id", engine_id, MAX_ID)
        eng = self.engines.get(engine_id)
        if eng is None and _ENGINE_ID.fullmatch(engine_id) and not engine_id.endswith(f"@{self.pool.tag}"):
            # Ids carry the daemon instance: an engine that outlived a daemon restart (its mapping is
            # of the old, removed pool) is told so instead of being treated as never registered.
            raise NotFound(f"engine {engine_id!r} was registered with an earlier instance of this daemon "
                           "(it restarted): register again and map the new pool")
        if eng is None or eng.closing:
            raise NotFound(f"unknown engine {engine_id!r} (not registered, unregistered, or its lease lapsed)")
        if role is not None and eng.role is not role:
            raise FailedPrecondition(f"engine {engine_id!r} is a {eng.role.name.lower()} engine")
        return eng

    def _members(self, group: str, role: Role) -> Iterator[Engine]:
        return (e for e in self.engines.values() if e.spec.group == group and e.role is role and not e.closing)

    def group(self, group: str, role: Role) -> list[Engine]:
        return list(self._members(group, role))

    def group_spec(self, group: str, role: Role) -> EngineSpec | None:
        """The spec of an engine of the group (its ranks share layout and TP size), without
        building the group's list: asked once per new room."""
        first = next(self._members(group, role), None)
        return None if first is None else first.spec

    def require_serving(self) -> None:
        if not self.serving:
            raise Unavailable("daemon is draining and accepts no new work")

    def source_slots_held(self) -> int:
        """Slots of prefill rings that chunks hold (a decode ring's space is handed out as credits:
        credits.py). A slot an engine acquired and has not enqueued is the engine's, not held for a
        transfer: a sending engine keeps one spare (EnqueueChunkRequest.next_tokens)."""
        return sum(e.ring.alloc.slots_held - len(e.acquired)
                   for e in [*self.engines.values(), *self._closing] if e.role is Role.PREFILL)

    def ring_metrics(self, ring: Ring) -> None:
        """Read at scrape time, not set per slot: two label lookups and gauge writes per chunk
        were on the hot path for a figure nobody reads between scrapes."""
        alloc = ring.alloc
        self.metrics.ring_used.labels(ring=ring.name).set_function(lambda: alloc.used_bytes)

    def lease_s(self, eng: Engine) -> float:
        return eng.spec.lease_ms / 1000 if eng.spec.lease_ms else self.config.engine_lease_s

    # ------------------------------------------------------------------ registration

    def check_spec(self, spec: EngineSpec) -> None:
        """Every check of RegisterEngine that needs no ring; raises InvalidArgument/FailedPrecondition."""
        self.require_serving()
        p = spec.parallel
        if spec.role not in (Role.PREFILL, Role.DECODE):
            raise InvalidArgument("role must be PREFILL or DECODE")
        check_len("group", spec.group, MAX_GROUP, required=True)
        check_len("name", spec.name, MAX_ENGINE_NAME)
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
        if not any(self._same_rank(other, spec) for other in self.engines.values()):
            self.limits.check(ENGINES, len(self.engines))
        if spec.zero_copy:
            lay = spec.layout
            per_slot, want = zero_copy_slot_bytes(spec), _ring_size(spec)
            if want <= 0 or want % (per_slot * lay.page_size):
                raise InvalidArgument(
                    f"zero-copy pool of {want} B is not a whole number of pages of "
                    f"{per_slot * lay.page_size} B ([layers, K/V, slots, local_heads, head_dim])"
                )

    async def register_async(self, spec: EngineSpec, cuda_importer: Callable[[EngineSpec], Ring] | None) -> Engine:
        """register(), with a GPU ring imported off the event loop: a daemon's first CUDA IPC import
        creates its CUDA context and registers VRAM with NIXL, which took seconds on the GPU box
        with several engines starting at once; on the loop that starved the peer streams."""
        if spec.cuda_ring is None or cuda_importer is None:
            return self.register(spec, cuda_importer)
        self.check_spec(spec)  # bad input fails before anything touches the GPU
        ring: Ring = await self.run_blocking(cuda_importer, spec)
        try:
            return self.register(spec, lambda _: ring)
        except BaseException:
            if ring.close is not None:
                await self.run_blocking(ring.close)
            raise

    def register(self, spec: EngineSpec, cuda_importer: Callable[[EngineSpec], Ring] | None) -> Engine:
        # Checked again after register_async's import: the daemon may have started draining, or
        # another rank registered the group with another layout, while the import ran.
        self.check_spec(spec)
        p = spec.parallel
        if spec.cuda_ring is not None:
            if cuda_importer is None:
                raise FailedPrecondition("this daemon cannot import CUDA IPC rings (no CUDA available)")
            ring = cuda_importer(spec)
            self.ident.md_epoch += 1
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
        pool_slots = _ring_size(spec) // zero_copy_slot_bytes(spec) if spec.zero_copy else 0
        # A restarted engine process re-registers the same rank: the old registration is dead
        # (its rooms fail, its mappings go).
        for other in list(self.engines.values()):
            if self._same_rank(other, spec):
                logger.warning("engine %s replaced by a new registration of the same rank", other.id)
                self.drop(other, FailureCode.ENGINE_LOST, "engine re-registered (restarted)")
        engine_id = f"{uuid.uuid4().hex}@{self.pool.tag}"
        ring.name = engine_id
        eng = Engine(engine_id, spec, ring, 0.0, pool_slots=pool_slots)
        eng.lease_deadline = time.monotonic() + self.lease_s(eng)
        self.engines[engine_id] = eng
        self.metrics.ring_capacity.labels(ring=engine_id).set(ring.size)
        self.ring_metrics(ring)
        logger.info(
            "engine %s registered: %s group=%s tp=%d/%d ring=%s %d B", engine_id, spec.role.name.lower(),
            spec.group, p.tp_rank, p.tp_size, ring.kind, ring.size,
        )
        self.on_change()
        return eng

    @staticmethod
    def _same_rank(other: Engine, spec: EngineSpec) -> bool:
        p = spec.parallel
        return (other.spec.group == spec.group and other.role is spec.role and other.rank == p.tp_rank
                and other.spec.parallel.pp_rank == p.pp_rank)

    def keep_alive(self, engine_id: str) -> float:
        eng = self.get(engine_id)
        eng.lease_deadline = time.monotonic() + self.lease_s(eng)
        return self.lease_s(eng)

    def unregister(self, engine_id: str) -> None:
        self.drop(self.get(engine_id), FailureCode.ENGINE_LOST, "engine unregistered")

    def fresh_leases(self, away_s: float) -> None:
        """This daemon did not run for `away_s` (SIGSTOP, a stalled loop): its engines could not be
        heard meanwhile, so that time is not counted against their leases (each runs on by `away_s`,
        to at most a whole lease from now). Not a whole fresh lease each: a loaded daemon's loop
        stalls 1.4 s at times, and an engine that died just before would get its rooms failed a
        whole lease late."""
        now = time.monotonic()
        for eng in self.engines.values():
            eng.lease_deadline = max(eng.lease_deadline, min(eng.lease_deadline + away_s, now + self.lease_s(eng)))
        if self.engines:
            logger.warning("this daemon did not run for %.1f s (paused, or its event loop stalled): its %d engine(s) "
                           "keep their leases", away_s, len(self.engines))

    def expire_leases(self) -> None:
        now = time.monotonic()
        for eng in list(self.engines.values()):
            if eng.lease_deadline < now:
                self.drop(eng, FailureCode.ENGINE_LOST, "engine lease lapsed")

    def drop(self, eng: Engine, code: FailureCode, reason: str) -> None:
        if eng.closing:
            return
        eng.closing = True
        logger.info("engine %s gone: %s", eng.id, reason)
        self.on_engine_gone(eng, code, reason)
        for off in list(eng.acquired):
            eng.ring.alloc.free(off)
        eng.acquired.clear()
        for q in list(eng.watchers):
            q.put_nowait(None)
        eng.space.set()
        self.engines.pop(eng.id, None)
        self._closing.append(eng)
        self.maybe_close_ring(eng)
        self.on_change()

    def maybe_close_ring(self, eng: Engine) -> None:
        """A ring goes back only when no transfer can touch it any more."""
        if not eng.closing or eng.ring.alloc.slots_held or eng not in self._closing:
            return
        self._closing.remove(eng)
        ring = eng.ring
        if ring.kind == "host":
            self.pool.free_region(ring.pool_offset)
        if ring.kind == "cuda":
            # Peers still hold the released ring in their copy of our NIXL metadata; the next
            # handshake replaces it, before a ring imported at the same address can be written.
            self.ident.md_epoch += 1
        if ring.close is not None:
            # Deregistering VRAM and closing the IPC mapping can take long: not on the loop.
            self._spawn(self._close_ring(eng.id, ring.close), f"close ring {eng.id}")
        else:
            logger.info("ring of engine %s released", eng.id)
        self.metrics.ring_capacity.remove(ring.name)
        self.metrics.ring_used.remove(ring.name)

    async def _close_ring(self, engine_id: str, close: Callable[[], None]) -> None:
        try:
            await self.run_blocking(close)
        except Exception as exc:
            logger.warning("closing ring of engine %s failed: %s", engine_id, exc)
        else:
            logger.info("ring of engine %s released", engine_id)

    # ------------------------------------------------------------------ slots

    def free_slot(self, eng: Engine, offset: int) -> None:
        eng.ring.alloc.free(offset)
        if eng.claims:
            tag = eng.claims.pop(offset, None)
            if tag is not None:
                eng.freed_claims.append(tag)
        eng.space.set()
        if eng.closing:
            self.maybe_close_ring(eng)

    def acquire_slot(self, engine_id: str, num_tokens: int) -> tuple[SlotRef, int]:
        eng = self.get(engine_id, Role.PREFILL)
        # Draining refuses new rooms (EnqueueChunk), but rooms already under way get their grace
        # period only if their remaining chunks can still get slots.
        if not self.serving and not self.owes_chunks(eng):
            raise Unavailable("daemon is draining and accepts no new work")
        if eng.spec.zero_copy:
            raise FailedPrecondition("zero-copy engines address chunks by pages; they have no slots")
        if not 1 <= num_tokens <= MAX_TOKENS:
            raise InvalidArgument(f"num_tokens must be 1..{MAX_TOKENS}, got {num_tokens}")
        nbytes = eng.token_bytes * num_tokens
        if not eng.ring.alloc.fits_ever(nbytes):
            raise InvalidArgument(f"a chunk of {num_tokens} tokens needs {nbytes} B; the ring has {eng.ring.size} B")
        off = eng.ring.alloc.alloc(nbytes)
        if off is None:
            raise ResourceExhausted(
                f"ring full: {eng.ring.alloc.used_bytes}/{eng.ring.size} B held by {eng.ring.alloc.slots_held} slots"
            )
        eng.acquired.add(off)
        return SlotRef(off, eng.ring.alloc.slot_length(off) or nbytes), nbytes

    async def acquire_slot_wait(self, engine_id: str, num_tokens: int, wait_s: float) -> tuple[SlotRef, int]:
        """acquire_slot, waiting up to wait_s for space while the ring is full."""
        deadline = time.monotonic() + wait_s
        while True:
            eng = self.get(engine_id, Role.PREFILL)
            eng.space.clear()
            try:
                return self.acquire_slot(engine_id, num_tokens)
            except ResourceExhausted:
                left = deadline - time.monotonic()
                if left <= 0 or eng.closing:
                    raise
            try:
                await asyncio.wait_for(eng.space.wait(), left)
            except asyncio.TimeoutError:
                pass

    def check_claim(self, eng: Engine, slot: SlotRef, need: int) -> None:
        """A claimed slot may be taken: inside the ring, aligned, big enough, and free. Nothing
        changes here (take_claim does, once the chunk is accepted)."""
        if not eng.claims_slots:
            raise FailedPrecondition("this engine did not register with claim_slots: its slots come from AcquireSlot")
        ring, align = eng.ring, eng.ring.alloc.align
        if slot.offset % align or slot.length <= 0 or slot.offset + slot.length > ring.size:
            raise InvalidArgument(f"claimed slot [{slot.offset}, +{slot.length}) is not an aligned range of the "
                                  f"{ring.size} B ring (alignment {align} B)")
        if need > slot.length:
            raise InvalidArgument(f"the chunk needs {need} B but the claimed slot has {slot.length} B")
        if not ring.alloc.is_free(slot.offset, slot.length):
            raise FailedPrecondition(f"claimed slot [{slot.offset}, +{slot.length}) overlaps a slot the daemon holds")

    def take_claim(self, eng: Engine, slot: SlotRef, tag: int) -> None:
        if not eng.ring.alloc.claim(slot.offset, slot.length):
            raise FailedPrecondition(f"claimed slot [{slot.offset}, +{slot.length}) is not free")
        eng.claims[slot.offset] = tag

    def take_freed(self, engine_id: str) -> list[int]:
        """The claims let go of since the engine was last told (each is told once)."""
        eng = self.engines.get(engine_id)
        return _drain_freed(eng) if eng is not None else []

    async def wait_freed(self, engine_id: str, believed: list[int], wait_s: float) -> list[int]:
        """The claims the engine may cut again (freed, or believed held but not), waiting up to
        wait_s for one while there is none."""
        deadline = time.monotonic() + wait_s
        while True:
            eng = self.get(engine_id, Role.PREFILL)
            if not eng.claims_slots:
                raise FailedPrecondition("this engine did not register with claim_slots")
            eng.space.clear()
            held = set(eng.claims.values())
            out = _drain_freed(eng) + [t for t in believed if t not in held]
            if out:
                return out
            left = deadline - time.monotonic()
            if left <= 0:
                raise ResourceExhausted(f"ring full: {eng.ring.alloc.used_bytes}/{eng.ring.size} B held by "
                                        f"{eng.ring.alloc.slots_held} slots")
            try:
                await asyncio.wait_for(eng.space.wait(), left)
            except asyncio.TimeoutError:
                pass

    def release_slot(self, engine_id: str, slot: SlotRef) -> None:
        eng = self.get(engine_id, Role.PREFILL)
        if slot.offset not in eng.acquired:
            raise InvalidArgument(f"offset {slot.offset} is not a slot this engine acquired and still holds")
        eng.acquired.discard(slot.offset)
        self.free_slot(eng, slot.offset)

    def check_pages(self, eng: Engine, pages: tuple[int, ...], num_tokens: int, what: str) -> None:
        """Page ids must cover exactly the tokens and lie inside the engine's registered pool."""
        ps = eng.spec.layout.page_size
        need = -(-num_tokens // ps)
        if len(pages) != need:
            raise InvalidArgument(f"{what}: {num_tokens} tokens need {need} pages, got {len(pages)}")
        limit = eng.pool_slots // ps
        bad = [pg for pg in pages if pg >= limit]
        if bad:
            raise InvalidArgument(f"{what}: page {bad[0]} is outside the engine's pool of {limit} pages")
        if len(set(pages)) != len(pages):
            raise InvalidArgument(f"{what}: a page appears twice")
