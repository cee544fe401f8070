"""What the verdicts on chunks sent with enqueue(wait=False) leave behind, for either client: the
refusals the engine has not been told of yet, and the spare slots accepted chunks brought."""

from __future__ import annotations

import threading
from typing import Any

from kvxfer_client._claims import ClaimRing
from kvxfer_client._common import Chunk, ChunkRefused, KvxferError
from kvxfer_client._spare import SpareSlot


class Verdicts:
    def __init__(self, spare: SpareSlot) -> None:
        self._spare = spare
        self._lock = threading.Lock()  # the blocking client reads verdicts on any of its threads
        self._refused: list[ChunkRefused] = []  # oldest first
        self.claims: ClaimRing | None = None  # set once the engine is registered with claimed slots

    def on_reply(self, c: Chunk, asked: bool, got: Any) -> None:
        """The daemon's reply to chunk `c` (or the KvxferError that stands for it); `asked`: its
        request asked for a spare slot."""
        claims = self.claims
        if claims is not None and c.slot is not None and c.slot.claim:
            if isinstance(got, KvxferError):
                claims.failed(c.slot.claim, got)
            else:
                claims.verdict(c.slot.claim, True, got.freed_claims)
        if isinstance(got, KvxferError):
            if asked:
                self._spare.settle()
            with self._lock:
                self._refused.append(ChunkRefused(c.room, c.chunk_id, c.slot, got))
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
        """Every refusal not handed over yet, oldest first."""
        with self._lock:
            refused, self._refused = self._refused, []
        return refused

    def raise_oldest(self) -> None:
        """Raises the oldest refusal not handed over yet, if any."""
        with self._lock:
            refused = self._refused.pop(0) if self._refused else None
        if refused is not None:
            raise refused
