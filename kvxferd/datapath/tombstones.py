"""Tombstones of the send side: rooms a decode side failed before this daemon had them.

Without one, the first chunk of such a room would open a room nobody bootstraps, holding the
engine's slots until our own deadline; with one, the chunk (or a late bootstrap) is refused with
the decode side's reason. Bounded: the oldest are evicted first, since refusing to remember makes
no sense and an evicted tombstone costs at most a room that waits for its deadline.
"""

from __future__ import annotations

import time

from kvxferd.core.types import FailureCode, RoomKey

MAX_REASON = 1024
TOMBSTONE_TTL_S = 60.0


class Tombstones:
    def __init__(self) -> None:
        # room id -> (key, code, reason, expiry); the dict's order is the age order.
        self._dead: dict[int, tuple[RoomKey, FailureCode, str, float]] = {}

    def __len__(self) -> int:
        return len(self._dead)

    def remember(self, key: RoomKey, code: FailureCode, reason: str, cap: int) -> None:
        now = time.monotonic()
        if len(self._dead) >= cap:
            expired = [r for r, t in self._dead.items() if t[3] < now]
            for rid in expired or list(self._dead)[: max(1, cap // 64)]:
                del self._dead[rid]
        self._dead.pop(key.id, None)  # re-inserted last: the newest
        self._dead[key.id] = (key, code, reason[:MAX_REASON], now + TOMBSTONE_TTL_S)

    def get(self, key: RoomKey) -> tuple[FailureCode, str] | None:
        """The decode side's failure of this room, while remembered."""
        dead = self._dead.get(key.id)
        if dead is None or dead[0] != key or dead[3] <= time.monotonic():
            return None
        return dead[1], dead[2]
