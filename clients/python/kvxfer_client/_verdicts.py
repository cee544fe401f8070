"""What the verdicts on chunks sent with enqueue(wait=False) leave behind, for either client: the
refusals the engine has not been told of yet, and the spare slots accepted chunks brought."""

from __future__ import annotations

import threading
from typing import Any

from kvxfer_client._claims import ClaimRing
from kvxfer_client._spare import SpareSlot
from kvxfer_client.errors import ChunkRefused, KvxferError
from kvxfer_client.types import Chunk


class Verdicts:
    def __init__(self, spare: SpareSlot) -> None:
        self._spare = spare
        self._lock = threading.Lock()  # the blocking client reads verdicts on any of its threads
        # Oldest first, per thread that sent the chunks: a refusal is raised by (or returned to)
        # the thread whose enqueue(wait=False) it answers, never to another thread's call.
        self._refused: dict[int, list[ChunkRefused]] = {}
        self.claims: ClaimRing | None = None  # set once the engine is registered with claimed slots

    def on_reply(self, c: Chunk, asked: bool, got: Any, owner: int | None = None) -> None:
        """The daemon's reply to chunk `c` (or the KvxferError that stands for it); `asked`: its
        request asked for a spare slot; `owner`: the thread that sent it (by default, this one)."""
        claims = self.claims
        if claims is not None and c.slot is not None and c.slot.claim:
            if isinstance(got, KvxferError):
                claims.failed(c.slot.claim, got)
            else:
                claims.verdict(c.slot.claim, True, got.freed_claims)
        if isinstance(got, KvxferError):
            if asked:
                self._spare.settle()
            key = threading.get_ident() if owner is None else owner
            with self._lock:
                self._refused.setdefault(key, []).append(ChunkRefused(c.room, c.chunk_id, c.slot, got))
            return
        extra = self._spare.keep(got, c.num_tokens, asked)
        if extra is not None:
            # Released by the engine's next call: whoever read the reply must not start one.
            self._spare.give_back(extra)

    def on_late(self, got: Any) -> None:
        """A reply that came after its chunk was refused as lost (DEADLINE_EXCEEDED): the
        refusal stands (the room's events say whether the chunk went in), but a slot the daemon
        handed out with it is the engine's, so it goes back with the next call."""
        if not isinstance(got, KvxferError):
            if self.claims is not None:
                self.claims.freed(got.freed_claims)
            self._spare.late(got)

    def take(self) -> list[ChunkRefused]:
        """Every refusal of this thread's chunks not handed over yet, oldest first."""
        with self._lock:
            return self._refused.pop(threading.get_ident(), [])

    def raise_oldest(self) -> None:
        """Raises the oldest refusal of this thread's chunks not handed over yet, if any."""
        key = threading.get_ident()
        with self._lock:
            mine = self._refused.get(key)
            refused = mine.pop(0) if mine else None
            if mine == []:
                del self._refused[key]
        if refused is not None:
            raise refused
