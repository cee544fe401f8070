"""The page fence of zero-copy decode rooms.

A zero-copy reader's chunks land in its engine's own KV pages, which the engine hands to another
request once the room is over. A room that fails on the decode side (its deadline, an abort, a
lost peer) may still have prefill WRITEs in flight toward those pages, and a page reused at once
could take a late WRITE's bytes. Slot rooms have the credit fence (kvxferd.datapath.credits); pages have
this one. Such a room is FAILED at once (the engine learns it without delay), but its pages stay
fenced, and its events and PollRoom say so, until nothing can land there any more:
- the prefill daemon says it has no WRITE in flight for the room (an Abort with `quiesced`). It
  says so when its own failure waited for WRITEs, and answers the decode side's Abort; a session
  lost and regained with the same instance is asked again;
- that prefill daemon instance is gone: a new one handshook, or its port refuses connections;
- `quarantine_s` passed (as for revoked credits): lifted with a warning and a metric, the last
  resort against a peer that is neither alive nor provably dead.
One more FAILED event, with the fence off, tells the engine; ReleaseRoom waits for it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from kvxferd.core.peer_port import Link
from kvxferd.core.room_events import EventHub
from kvxferd.core.rooms import RecvRoom
from kvxferd.core.types import RoomKey
from kvxferd.ops.metrics import Metrics

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Fence:
    room: RecvRoom
    peer: Link  # the room's prefill daemon, whose WRITEs may still land
    instance: str  # its instance when the room failed
    timer: asyncio.TimerHandle
    waiters: list[asyncio.Future[None]] = field(default_factory=list)


class PageFence:
    def __init__(self, hub: EventHub, quarantine_s: float, metrics: Metrics) -> None:
        self._hub = hub
        self._quarantine_s = quarantine_s
        self._events = metrics.page_fences
        self._fences: dict[RoomKey, _Fence] = {}

    def close(self, room: RecvRoom) -> None:
        """The room failed with WRITEs from its prefill daemon possibly on their way to its pages."""
        peer = room.peer
        assert peer is not None
        if room.key in self._fences:
            return
        room.pages_fenced = True
        timer = asyncio.get_running_loop().call_later(self._quarantine_s, self._expire, room.key)
        self._fences[room.key] = _Fence(room, peer, peer.instance_id, timer)
        self._events.labels(event="raised").inc()

    def quiesced(self, peer: Link, key: RoomKey) -> None:
        f = self._fences.get(key)
        if f is not None and f.peer is peer and f.instance == peer.instance_id:
            self._lift(key, "the prefill side has no WRITE in flight")

    def peer_back(self, peer: Link, old_instance: str) -> None:
        """A lost session is up again: the same instance is asked anew, a new one cannot write."""
        for key, f in list(self._fences.items()):
            if f.peer is not peer:
                continue
            if f.instance != peer.instance_id:
                self._lift(key, f"prefill daemon instance {f.instance} was replaced")
            elif old_instance == peer.instance_id and peer.up:
                r = f.room
                peer.send_abort(key, r.failure_code, r.failure_reason, quiesced=False)

    def peer_gone(self, peer: Link, instance: str) -> None:
        for key, f in list(self._fences.items()):
            if f.peer is peer and f.instance == instance:
                self._lift(key, f"prefill daemon instance {instance} is gone")

    async def wait(self, key: RoomKey) -> None:
        f = self._fences.get(key)
        if f is None:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        f.waiters.append(fut)
        await fut

    def _expire(self, key: RoomKey) -> None:
        f = self._fences.get(key)
        if f is None:
            return
        logger.warning("room %s: prefill daemon %s never said its WRITEs are over; its pages are unfenced "
                       "after %.0f s", key, f.peer.daemon_id, self._quarantine_s)
        self._events.labels(event="expired").inc()
        self._lift(key, "quarantine over")

    def _lift(self, key: RoomKey, why: str) -> None:
        f = self._fences.pop(key)
        f.timer.cancel()
        f.room.pages_fenced = False
        logger.debug("room %s: pages unfenced (%s)", key, why)
        self._events.labels(event="lifted").inc()
        for fut in f.waiters:
            if not fut.done():
                fut.set_result(None)
        self._hub.recv_state(f.room)
