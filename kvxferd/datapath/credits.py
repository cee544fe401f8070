"""Slot credits: destination space granted ahead of time, so a chunk costs no round trip.

The decode daemon (`CreditLedger`) carves windows out of a reader's ring and grants them to a
prefill daemon; the prefill daemon (`CreditWindow`, one per peer) cuts each chunk's destination
range out of a window it holds and writes with no request in between. Ranges come back when
the decode side says it holds them no longer (the reader consumed the chunk, or the room ended);
windows come back when idle or when the decode side reclaims or revokes them.

Credit ids are capabilities: 63 random bits (never 0, unique among the live grants), handed only
to the holder over its authenticated control stream, so no other peer can name one in a forged
notification (a counter was: one id of your own told you your neighbours').

The fence. A credit id is not reused by the granting daemon instance (a random id meets an old one
with odds of 2^-63), and a revoked credit's space is reused only once nothing can still write into it:
- the prefill side marks it revoked (its workers check that flag right before posting, and a
  WRITE dispatched earlier counts as in flight until it is reported) and returns it only when
  no WRITE into it is in flight: after that, no byte can land there;
- if the prefill daemon is gone (a new instance of it handshook) its old process cannot write;
- a peer that never comes back is waited for `quarantine_s`, then the space is reused with a
  warning and a metric, as the last resort against a peer that is neither alive nor provably
  dead.
Notifications naming a revoked or unknown credit never count as landed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvxferd.buffers.host_pool import RingAllocator
from kvxferd.core.engines import Engine
from kvxferd.core.peer_port import CreditSpec, Link
from kvxferd.core.types import RoomKey
from kvxferd.ops.metrics import Metrics
from kvxferd.transports.local_ipc import ring_for, views

logger = logging.getLogger(__name__)

# An empty window the prefill side has not used for this long goes back to the decode ring.
IDLE_RETURN_S = 2.0


# --------------------------------------------------------------------------- decode side


@dataclass(eq=False)
class Grant:
    """A credit as the granting (decode) daemon tracks it."""

    id: int
    peer: Link
    instance: str  # the peer instance it was granted to
    engine: Engine
    offset: int  # in the reader's ring
    length: int
    revoked: bool = False
    # Why the space may be reused despite the revocation (set once): "returned", "peer restarted", ...
    cleared: str = ""
    # Offsets (relative) of landed ranges a reader has not released yet.
    live: set[int] = field(default_factory=set)
    quarantine: asyncio.TimerHandle | None = None

    @property
    def address(self) -> int:
        return self.engine.ring.base_addr + self.offset


class CreditLedger:
    def __init__(self, split: int, quarantine_s: float, metrics: Metrics,
                 free_space: Callable[[Engine, int], None]) -> None:
        self._split = max(1, split)
        self.quarantine_s = quarantine_s
        self._metrics = metrics
        # Gives ring space back (EngineTable.free_slot: also closes a released engine's ring).
        self._free_space = free_space
        self.grants: dict[int, Grant] = {}
        self._waiting: dict[str, deque[tuple[Link, int]]] = {}

    # -- granting

    def ensure(self, peer: Link, eng: Engine, room_bytes: int) -> None:
        """Before a bootstrap: a peer holding no usable credit on the reader's ring gets one, sized
        for the whole room if the ring allows, so its first chunks need no request."""
        if any(g.peer is peer and g.engine is eng and not g.revoked for g in self.grants.values()):
            return
        self._grant(peer, eng, 0, room_bytes)

    def request(self, peer: Link, eng: Engine, nbytes: int) -> None:
        if not eng.ring.alloc.fits_ever(nbytes):
            return  # never grantable: RecvSide.credit_request fails the rooms it may be for instead
        if self._grant(peer, eng, nbytes):
            return
        q = self._waiting.setdefault(eng.id, deque())
        if all(p is not peer for p, _ in q):
            q.append((peer, nbytes))
        # Holders (the asking peer too: its windows may each be too small for this chunk) give
        # back the windows of this ring that hold nothing, so the space can be granted anew.
        for holder in {g.peer for g in self.grants.values() if g.engine is eng and not g.revoked and g.peer.up}:
            holder.send_reclaim(eng.id)

    def _grant(self, peer: Link, eng: Engine, nbytes: int, hint: int = 0) -> bool:
        alloc = eng.ring.alloc
        # A window is at least ring/split (few messages) and at least the chunk (or, ahead of a
        # bootstrap, the room) it is for, so a chunk never waits for space that exists only in
        # pieces; never more than what is free, so peers sharing a ring each get some.
        want = max(nbytes, hint, eng.ring.size // self._split, 1)
        size = min(want, alloc.watermark().largest_free)
        if size < max(nbytes, 1) or eng.closing:
            return False
        off = alloc.alloc(size)
        if off is None:
            return False
        length = alloc.slot_length(off) or size
        g = Grant(self._new_id(), peer, peer.instance_id, eng, off, length)
        self.grants[g.id] = g
        local = ring_for(peer.daemon_id, peer.instance_id, eng.ring.mem, eng.ring.base_addr, eng.ring.size)
        peer.send_grant([CreditSpec(g.id, eng.id, g.address, length, eng.ring.mem, eng.ring.device, local)])
        logger.debug("credit %d: %d B of ring %s granted to %s", g.id, length, eng.id, peer.daemon_id)
        self._metrics.credits.labels(event="granted").inc()
        return True

    def _new_id(self) -> int:
        """Random, not counted: a peer may still hold (revoked, WRITEs in flight) credits of our
        previous process, and a guessable id would let one peer name another's credit."""
        while True:
            cid = secrets.randbits(63)  # the wire's uint64, and positive in a notification
            if cid and cid not in self.grants:
                return cid

    def _serve_waiting(self, eng: Engine) -> None:
        q = self._waiting.get(eng.id)
        while q:
            peer, nbytes = q[0]
            if not peer.up or eng.closing:
                q.popleft()
                continue
            if not self._grant(peer, eng, nbytes):
                return
            q.popleft()
        self._waiting.pop(eng.id, None)

    # -- lookups for landed notifications

    def valid(self, credit_id: int, peer: Link, eng: Engine, offset: int, nbytes: int) -> Grant | None:
        g = self.grants.get(credit_id)
        if (g is None or g.revoked or g.peer is not peer or g.instance != peer.instance_id or g.engine is not eng
                or offset < 0 or offset + nbytes > g.length):
            return None
        return g

    def hold(self, g: Grant, offset: int) -> None:
        g.live.add(offset)

    def unhold(self, credit_id: int, offset: int) -> None:
        g = self.grants.get(credit_id)
        if g is not None:
            g.live.discard(offset)
            self._maybe_free(g)

    # -- windows coming back

    def returned(self, peer: Link, ids: list[int]) -> None:
        for cid in ids:
            g = self.grants.get(cid)
            if g is None or g.peer is not peer or g.instance != peer.instance_id:
                continue
            g.revoked = True
            g.cleared = g.cleared or "returned"
            self._maybe_free(g)

    def revoke_ring(self, eng: Engine, reason: str) -> None:
        """The reader's ring is going away: every holder stops writing into it and gives it back."""
        by_peer: dict[Link, list[int]] = {}
        for g in list(self.grants.values()):
            if g.engine is eng and not g.revoked:
                self._revoke(g)
                by_peer.setdefault(g.peer, []).append(g.id)
        for peer, ids in by_peer.items():
            if peer.up:
                peer.send_revoke(ids, reason)
        self._waiting.pop(eng.id, None)

    def peer_lost(self, peer: Link) -> None:
        """Its windows are revoked; the space waits until it returns them or is known dead."""
        for g in list(self.grants.values()):
            if g.peer is peer and not g.revoked:
                self._revoke(g)

    def peer_back(self, peer: Link, old_instance: str) -> None:
        """A session with `peer` is up again. Windows revoked while it was away: a new instance
        cannot write into the old one's (that process is gone); the same instance is asked to
        give them back once its WRITEs into them are done."""
        again = []
        for g in list(self.grants.values()):
            if g.peer is not peer or not g.revoked or g.cleared:
                continue
            if g.instance != peer.instance_id:
                g.cleared = "peer restarted"
                self._maybe_free(g)
            else:
                again.append(g.id)
        if again and old_instance == peer.instance_id:
            peer.send_revoke(again, "revoked while the session was down")

    def peer_gone(self, peer: Link, instance: str) -> None:
        """That instance of the peer is provably gone (its port refuses connections)."""
        for g in list(self.grants.values()):
            if g.peer is peer and g.instance == instance and g.revoked and not g.cleared:
                g.cleared = "peer gone"
                self._maybe_free(g)

    def _revoke(self, g: Grant) -> None:
        g.revoked = True
        self._metrics.credits.labels(event="revoked").inc()
        loop = asyncio.get_running_loop()
        g.quarantine = loop.call_later(self.quarantine_s, self._quarantine_over, g)

    def _quarantine_over(self, g: Grant) -> None:
        g.quarantine = None
        if g.cleared or g.id not in self.grants:
            return
        logger.warning("credit %d of %s: not returned in %.0f s; reusing its space", g.id, g.peer.daemon_id,
                       self.quarantine_s)
        self._metrics.credits.labels(event="quarantine_expired").inc()
        g.cleared = "quarantine over"
        self._maybe_free(g)

    def _maybe_free(self, g: Grant) -> None:
        if not g.revoked or not g.cleared or g.live or g.id not in self.grants:
            return
        del self.grants[g.id]
        logger.debug("credit %d of %s freed (%s)", g.id, g.peer.daemon_id, g.cleared)
        if g.quarantine is not None:
            g.quarantine.cancel()
        self._metrics.credits.labels(event="freed").inc()
        self._free_space(g.engine, g.offset)
        self._serve_waiting(g.engine)

    def slots_held(self) -> int:
        """Landed chunks a reader still holds, plus windows revoked but not yet safe to reuse."""
        return sum(len(g.live) + (1 if g.revoked and not g.cleared else 0) for g in self.grants.values())



# --------------------------------------------------------------------------- prefill side


@dataclass(eq=False)
class HeldRange:
    """One (chunk, reader) destination inside a held window, shared by every writer of the chunk."""

    held: Held
    offset: int
    length: int
    room: RoomKey
    released: bool = False  # the decode side holds it no longer
    in_flight: int = 0  # WRITEs dispatched into it and not yet reported

    @property
    def address(self) -> int:
        return self.held.spec.address + self.offset


@dataclass(eq=False)
class Held:
    """A window this (prefill) daemon holds. `revoked` is read by worker threads before a post."""

    spec: CreditSpec
    alloc: RingAllocator
    ranges: dict[int, HeldRange] = field(default_factory=dict)
    revoked: bool = False
    returning: bool = False  # reclaimed: goes back as soon as it is empty
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)


Waiter = Callable[[HeldRange | None], None]


class CreditWindow:
    """The windows one peer granted us, and the chunks waiting for space in them."""

    def __init__(self, peer: Link, metrics: Metrics) -> None:
        self._peer = peer
        self._metrics = metrics
        self.held: dict[int, Held] = {}
        self._waiters: dict[str, deque[tuple[int, RoomKey, Waiter]]] = {}
        self._asked: set[str] = set()
        self._rooms: dict[RoomKey, list[HeldRange]] = {}

    def add(self, specs: list[CreditSpec]) -> None:
        for spec in specs:
            if spec.id in self.held or spec.length <= 0:
                continue
            self.held[spec.id] = Held(spec, RingAllocator(spec.length))
            self._asked.discard(spec.ring)
            self._serve(spec.ring)

    def _carve(self, ring: str, nbytes: int, room: RoomKey) -> HeldRange | None:
        for h in self.held.values():
            if h.spec.ring != ring or h.revoked or h.returning:
                continue
            off = h.alloc.alloc(nbytes)
            if off is None:
                continue
            r = HeldRange(h, off, h.alloc.slot_length(off) or nbytes, room)
            h.ranges[off] = r
            h.last_used = time.monotonic()
            self._rooms.setdefault(room, []).append(r)
            return r
        return None

    def take(self, ring: str, nbytes: int, room: RoomKey, waiter: Waiter) -> HeldRange | None:
        """A range now, or None and `waiter` is called with one (or None if it never comes)."""
        q = self._waiters.get(ring)
        if not q:  # FIFO: never overtake a chunk already waiting on this ring
            r = self._carve(ring, nbytes, room)
            if r is not None:
                return r
        self._waiters.setdefault(ring, deque()).append((nbytes, room, waiter))
        if ring not in self._asked:
            self._asked.add(ring)
            self._peer.send_credit_request(ring, nbytes)
            self._metrics.credits.labels(event="requested").inc()
        return None

    def _serve(self, ring: str) -> None:
        q = self._waiters.get(ring)
        while q:
            nbytes, room, waiter = q[0]
            r = self._carve(ring, nbytes, room)
            if r is None:
                if ring not in self._asked:
                    self._asked.add(ring)
                    self._peer.send_credit_request(ring, nbytes)
                return
            q.popleft()
            waiter(r)
        self._waiters.pop(ring, None)

    def cancel_room(self, room: RoomKey) -> None:
        """A failed room's chunks stop waiting for space (callbacks run after the queues are
        settled: they may fail the room, which cancels again)."""
        dropped = []
        for ring, q in list(self._waiters.items()):
            if any(w[1] == room for w in q):
                if q[0][1] == room:
                    # The request out for this ring was for the chunk at the head, which may never
                    # be granted (a part larger than the ring fails its room): the next head asks anew.
                    self._asked.discard(ring)
                dropped += [w for w in q if w[1] == room]
                self._waiters[ring] = deque(w for w in q if w[1] != room)
        for _, _, waiter in dropped:
            waiter(None)
        for ring in list(self._waiters):
            self._serve(ring)

    # -- WRITEs in and out of a range

    def write_started(self, r: HeldRange) -> None:
        r.in_flight += 1
        r.held.in_flight += 1

    def write_done(self, r: HeldRange) -> None:
        r.in_flight -= 1
        r.held.in_flight -= 1
        self._maybe_free(r)
        self._maybe_give_back(r.held)

    # -- the decode side lets go

    def release(self, ranges: list[tuple[int, int]], rooms: list[RoomKey]) -> None:
        for cid, off in ranges:
            h = self.held.get(cid)
            r = h.ranges.get(off) if h is not None else None
            if r is not None:
                r.released = True
                self._maybe_free(r)
        for key in rooms:
            for r in list(self._rooms.get(key, ())):
                r.released = True
                self._maybe_free(r)

    def _maybe_free(self, r: HeldRange) -> None:
        h = r.held
        if not r.released or r.in_flight or h.ranges.get(r.offset) is not r:
            return
        del h.ranges[r.offset]
        h.alloc.free(r.offset)
        rs = self._rooms.get(r.room)
        if rs is not None:
            rs.remove(r)
            if not rs:
                del self._rooms[r.room]
        self._maybe_give_back(h)
        if not h.revoked and not h.returning:
            self._serve(h.spec.ring)

    def revoke(self, ids: list[int]) -> None:
        for cid in ids:
            h = self.held.get(cid)
            if h is None:
                # Unknown here (already returned, or we restarted): nothing can be in flight.
                self._peer.send_credit_return([cid])
                continue
            h.revoked = True
            self._maybe_give_back(h)

    def reclaim(self, ring: str) -> None:
        for h in list(self.held.values()):
            if h.spec.ring == ring and not h.revoked:
                h.returning = True
                self._maybe_give_back(h)

    def _maybe_give_back(self, h: Held) -> None:
        if h.spec.id not in self.held or h.in_flight:
            return
        if h.revoked or (h.returning and not h.ranges):
            del self.held[h.spec.id]
            views.forget(h.spec)  # no copy into it in flight: its ring's IPC mapping may close
            for r in list(h.ranges.values()):
                rs = self._rooms.get(r.room)
                if rs is not None and r in rs:
                    rs.remove(r)
                    if not rs:
                        del self._rooms[r.room]
            if self._peer.up:
                self._peer.send_credit_return([h.spec.id])
            self._metrics.credits.labels(event="returned").inc()

    def sweep(self, now: float) -> None:
        """Idle empty windows go back, so one prefill daemon does not keep a ring it no longer uses."""
        for h in list(self.held.values()):
            if (not h.ranges and not h.in_flight and not h.revoked and not self._waiters.get(h.spec.ring)
                    and now - h.last_used > IDLE_RETURN_S):
                h.returning = True
                self._maybe_give_back(h)

    def lost(self) -> None:
        """The session is gone: nothing more is written into these windows. Those with WRITEs
        still in flight stay (revoked) until the WRITEs are reported; the decode side asks for
        them back when the session is up again, or knows we are gone."""
        for h in list(self.held.values()):
            h.revoked = True
            if not h.in_flight:
                del self.held[h.spec.id]
                views.forget(h.spec)
        self._rooms.clear()
        self._asked.clear()
        waiters = [w for q in self._waiters.values() for w in q]
        self._waiters.clear()
        for _, _, waiter in waiters:
            waiter(None)
