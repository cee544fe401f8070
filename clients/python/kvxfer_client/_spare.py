"""The spare slots that accepted chunks bring back (EnqueueChunkRequest.next_tokens), for a
client that gets its slots from the daemon (claim_slots off, or a daemon without claimed slots)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from kvxfer_client.errors import NotSent
from kvxfer_client.types import Slot
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2


class SpareSlot:
    """Slots that the daemon handed out early, with accepted chunks
    (EnqueueChunkRequest.next_tokens): an engine that sends chunk after chunk then makes one call
    per chunk instead of two, and AcquireSlot is left for waiting on a full ring.

    depth: how many it holds and asks for at once. One is enough while each enqueue waits for its
    reply; an engine that does not wait (PrefillSender.enqueue(wait=False)) holds two, so the
    next chunk's slot is already here while the last chunk's reply is still on its way."""

    def __init__(self, enabled: bool, depth: int = 1) -> None:
        self.enabled = enabled
        self.depth = depth
        self._lock = threading.Lock()
        self._held: list[tuple[int, Slot]] = []
        self._asked = 0  # asks whose replies are still to come
        self._surplus: list[Slot] = []  # spares to give back at the next call (give_back)

    def take(self, num_tokens: int) -> tuple[Slot | None, Slot | None]:
        """(a held slot sized for num_tokens, else None; a held slot of another size to give back,
        so that a change of chunk size does not leave the spares stuck)."""
        with self._lock:
            for i, (tokens, slot) in enumerate(self._held):
                if tokens == num_tokens:
                    del self._held[i]
                    return slot, None
            stale = self._held.pop(0)[1] if self._held else None
        return None, stale

    def ask(self, req: engine_pb2.EnqueueChunkRequest, depth: int | None = None) -> bool:
        """Asks for a spare in `req` when fewer than `depth` (at most the constructor's) are held
        or asked for; says whether it did (the reply, or its failure, must then reach keep() or
        settle())."""
        # Only slot-based chunks: a zero-copy engine has no slots.
        if self.enabled and req.HasField("slot"):
            with self._lock:
                if len(self._held) + self._asked < min(self.depth, depth or self.depth):
                    self._asked += 1
                    req.next_tokens = req.num_tokens
                    return True
        return False

    @contextlib.contextmanager
    def asking(self, req: engine_pb2.EnqueueChunkRequest, depth: int | None = None) -> Iterator[bool]:
        """ask() around the call that carries `req`: a call that fails settles the ask."""
        asked = self.ask(req, depth)
        try:
            yield asked
        except BaseException:
            if asked:
                self.settle()
            raise

    def keep(self, reply: engine_pb2.EnqueueChunkReply, num_tokens: int, asked: bool = True) -> Slot | None:
        """Holds the reply's slot; returns one that must be given back (other threads' replies
        filled the place)."""
        with self._lock:
            if asked:
                self._asked = max(0, self._asked - 1)
            if not reply.HasField("next_slot"):
                return None
            slot = Slot(reply.next_slot.offset, reply.next_slot.length, reply.next_chunk_bytes)
            if len(self._held) < self.depth:
                self._held.append((num_tokens, slot))
                return None
        return slot

    def settle(self) -> None:
        """An ask whose call failed: no slot will come from it."""
        with self._lock:
            self._asked = max(0, self._asked - 1)

    def give_back(self, slot: Slot) -> None:
        """A spare that found no place, kept for the owner's next call to release (a reply read
        inside another call must not start one)."""
        with self._lock:
            self._surplus.append(slot)

    def surplus(self) -> list[Slot]:
        with self._lock:
            out, self._surplus = self._surplus, []
        return out

    def unreleased(self, slots: Sequence[Slot], failed: int, exc: BaseException) -> None:
        """ReleaseSlot of ``slots[failed]`` raised `exc`: the slots after it go back to the
        surplus, for the owner's next call to release, and so does that one when its call never
        left (NotSent). One the daemon refused, or whose reply was lost, is not released again:
        the daemon names a slot by its offset, so a second release could free the slot's next
        holder (a refused one would also fail every later call); the engine's lease frees it."""
        with self._lock:
            if isinstance(exc, NotSent):
                self._surplus.append(slots[failed])
            self._surplus.extend(slots[failed + 1:])

    def late(self, reply: engine_pb2.EnqueueChunkReply) -> None:
        """The reply to a chunk whose verdict was given up on (its ask settled then) came after
        all: a slot it brings is the engine's, and goes back with the next call."""
        if reply.HasField("next_slot"):
            self.give_back(Slot(reply.next_slot.offset, reply.next_slot.length, reply.next_chunk_bytes))

    def drop(self) -> list[Slot]:
        """Every held slot (the client is closing), for giving back."""
        with self._lock:
            held, self._held = self._held, []
            out, self._surplus = self._surplus, []
        return out + [slot for _, slot in held]
