"""Caps on what callers can make the daemon hold, and length limits on what they name.

Every table a caller can grow has a cap from the config. A caller that reaches one is refused
with `CapExceeded` (RESOURCE_EXHAUSTED), whose message names the cap and its config key; nothing
is evicted to make room, so one caller at its cap changes nothing for anyone else. The only
exception is the tombstone table (aborts peers send for rooms we do not have): refusing an abort
makes no sense, so it evicts oldest-first (sender.py).

Per-caller caps (rooms per engine, streams per engine, ...) report as `used` the figure of the
caller closest to its cap, so `used == limit` in status means "someone is being refused now".
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxferd.config import Config
from kvxferd.errors import CapExceeded, InvalidArgument

# Lengths of what callers name (characters), checked with INVALID_ARGUMENT.
MAX_GROUP = 128  # engine groups, prefill_group, reader ring names
MAX_ENGINE_NAME = 256  # RegisterEngine.name (logs and status only)
MAX_ID = 64  # engine ids, registration ids (ours are 32-45 characters)
MAX_ADDRESS = 261  # HOST:PORT: a 253-character DNS name or a bracketed IPv6 address, and a port
MAX_DEVICE_UUID = 96  # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" is 40


def check_len(what: str, value: str, limit: int, required: bool = False) -> None:
    """Refuses an empty (when required) or overlong name; the message never echoes the value."""
    if required and not value:
        raise InvalidArgument(f"{what} is required")
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long; at most {limit}")


@dataclass(frozen=True)
class Cap:
    name: str
    key: str  # the config key that sets it
    what: str


ENGINES = Cap("engines", "max_engines", "engine ranks registered on this daemon")
ROOMS_PER_ENGINE = Cap("rooms_per_engine", "max_rooms_per_engine",
                       "rooms one engine rank takes part in (until released or collected)")
ROOMS_PER_PEER = Cap("rooms_per_peer", "max_rooms_per_peer",
                     "rooms whose other side is one peer daemon, both roles")
OPEN_STREAMS = Cap("open_streams", "max_open_streams", "server streams open on the engine API (WatchRooms, "
                   "EnqueueStream), counted from the moment they open")
WATCHERS_PER_ENGINE = Cap("watchers_per_engine", "max_watchers_per_engine", "WatchRooms streams of one engine")
STREAMS_PER_ENGINE = Cap("streams_per_engine", "max_streams_per_engine",
                         "EnqueueStream streams that named one engine")
WATCH_BACKLOG = Cap("watch_backlog", "max_watch_backlog",
                    "events queued for one WatchRooms stream that its reader has not taken")
TOMBSTONES = Cap("tombstones", "max_tombstones", "rooms aborted by a peer before we had them (oldest evicted)")

CAPS = (ENGINES, ROOMS_PER_ENGINE, ROOMS_PER_PEER, OPEN_STREAMS, WATCHERS_PER_ENGINE, STREAMS_PER_ENGINE,
        WATCH_BACKLOG, TOMBSTONES)


@dataclass(frozen=True)
class CapUsage:
    name: str
    used: int
    limit: int


class Limits:
    """The configured caps and the counters no other table keeps (streams, rooms per peer)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.open_streams = 0
        self.engine_streams: dict[str, int] = {}
        self.peer_rooms: dict[str, int] = {}

    def limit(self, cap: Cap) -> int:
        return int(getattr(self.config, cap.key))

    def check(self, cap: Cap, used: int, whose: str = "") -> None:
        """Raises CapExceeded if one more would go past the cap."""
        limit = self.limit(cap)
        if used >= limit:
            raise CapExceeded(
                f"{cap.name} cap reached{whose}: {used} of {limit} {cap.what} (config {cap.key})"
            )

    # ------------------------------------------------------------------ rooms per peer

    def peer_room_added(self, peer: str) -> None:
        self.check(ROOMS_PER_PEER, self.peer_rooms.get(peer, 0), f" for peer {peer}")
        self.peer_rooms[peer] = self.peer_rooms.get(peer, 0) + 1

    def peer_room_gone(self, peer: str) -> None:
        n = self.peer_rooms.get(peer, 0) - 1
        if n > 0:
            self.peer_rooms[peer] = n
        else:
            self.peer_rooms.pop(peer, None)

    # ------------------------------------------------------------------ streams

    def open_stream(self) -> StreamTicket:
        return StreamTicket(self)


class StreamTicket:
    """One open server stream: counted daemon-wide from its opening, and against every engine it
    names (EnqueueStream requests carry an engine id each). `close` gives everything back."""

    def __init__(self, limits: Limits) -> None:
        limits.check(OPEN_STREAMS, limits.open_streams)
        limits.open_streams += 1
        self._limits = limits
        self._engines: set[str] = set()
        self._closed = False

    def join(self, engine_id: str) -> None:
        """Counts the stream against `engine_id` (an engine the caller has checked exists)."""
        if engine_id in self._engines:
            return
        counts = self._limits.engine_streams
        self._limits.check(STREAMS_PER_ENGINE, counts.get(engine_id, 0), f" for engine {engine_id}")
        counts[engine_id] = counts.get(engine_id, 0) + 1
        self._engines.add(engine_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._limits.open_streams -= 1
        counts = self._limits.engine_streams
        for eid in self._engines:
            n = counts.get(eid, 0) - 1
            if n > 0:
                counts[eid] = n
            else:
                counts.pop(eid, None)
        self._engines.clear()
