"""PeerLink's outgoing batches: range releases wait briefly for company, everything else leaves at once."""

from __future__ import annotations

import asyncio
from typing import Any

from kvxferd.config import Config
from kvxferd.core.types import FailureCode, RoomKey
from kvxferd.ops.metrics import Metrics
from kvxferd.peer.link import LAZY_FLUSH_S, MAX_RANGES_PER_MSG, PeerLink, Session


async def _link() -> tuple[PeerLink, list[Any]]:
    link = PeerLink("127.0.0.1:1", Config(heartbeat_interval_s=30.0), Metrics())
    batches: list[Any] = []

    async def write(batch: Any) -> None:
        batches.append(batch)

    link.attach(Session(write, lambda: None))
    await asyncio.sleep(0.05)  # the attach's first (empty) batch, if any, is out
    batches.clear()
    return link, batches


async def test_range_releases_share_one_batch() -> None:
    link, batches = await _link()
    try:
        for i in range(10):
            link.send_release(ranges=[(1, i * 4096)])
        await asyncio.sleep(0)
        assert batches == [], "a range release left before its flush delay"
        await asyncio.sleep(LAZY_FLUSH_S * 5)
        # One batch, and in it one message naming the ten ranges in order.
        assert len(batches) == 1 and len(batches[0].msgs) == 1
        assert [r.offset for r in batches[0].msgs[0].release.ranges] == [i * 4096 for i in range(10)]
        # A release after that batch left starts a new message; the one sent is not touched.
        link.send_release(ranges=[(2, 0)])
        await asyncio.sleep(LAZY_FLUSH_S * 5)
        assert len(batches) == 2 and [r.credit_id for r in batches[1].msgs[0].release.ranges] == [2]
        assert len(batches[0].msgs[0].release.ranges) == 10
        # A message holds at most MAX_RANGES_PER_MSG ranges.
        for i in range(MAX_RANGES_PER_MSG + 5):
            link.send_release(ranges=[(3, i)])
        await asyncio.sleep(LAZY_FLUSH_S * 5)
        assert [len(m.release.ranges) for m in batches[2].msgs] == [MAX_RANGES_PER_MSG, 5]
    finally:
        await link.close()


async def test_other_messages_leave_at_once_and_take_waiting_releases_along() -> None:
    link, batches = await _link()
    try:
        link.send_release(ranges=[(1, 0)])
        link.send_abort(RoomKey(7), FailureCode.ABORTED, "test", quiesced=True)
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(batches) == 1
        assert [m.WhichOneof("body") for m in batches[0].msgs] == ["release", "abort"]
        # A room's release (the room is over on the decode side) is not held either.
        link.send_release(rooms=[RoomKey(7)])
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(batches) == 2 and batches[1].msgs[0].release.rooms[0].id == 7
    finally:
        await link.close()
