"""The fleet cache's (group, role) index and the held "gone" reports, without etcd."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace

from kvxferd.fleet.registry import DaemonRecord, FleetCache, GroupLocation, GroupRecord, PendingGone


def rec(i: int, groups: tuple[tuple[str, str], ...], started: float | None = None) -> DaemonRecord:
    return DaemonRecord(f"d{i}", f"d{i}-i1", f"10.0.0.{i % 250}:7471", "n", "0.1.0",
                        float(i) if started is None else started,
                        tuple(GroupRecord(g, role, 1, (0,), "abc") for g, role in groups))


def scan(cache: FleetCache, group: str, role: str) -> list[GroupLocation]:
    """What the lookup must answer: every record's matching groups, the newest start first."""
    out = [GroupLocation(r.daemon_id, r.instance_id, r.address, g)
           for r in cache.records() for g in r.groups if g.group == group and g.role == role]
    return sorted(out, key=lambda loc: (-(cache.get(loc.daemon_id) or rec(0, ())).started_unix, loc.daemon_id))


class NoScan(dict[str, DaemonRecord]):
    """The records of a cache whose lookups must not walk the fleet."""

    def values(self) -> object:  # type: ignore[override]
        raise AssertionError("find() walked every record")

    def items(self) -> object:  # type: ignore[override]
        raise AssertionError("find() walked every record")

    def __iter__(self) -> object:  # type: ignore[override]
        raise AssertionError("find() walked every record")


def test_the_group_index_follows_puts_deletes_and_reloads() -> None:
    rng = random.Random(7)
    names = [f"g{k}" for k in range(12)]
    cache = FleetCache()
    for step in range(3000):
        i = rng.randrange(60)
        op = rng.random()
        if op < 0.6:
            groups = tuple((rng.choice(names), rng.choice(("prefill", "decode"))) for _ in range(rng.randrange(4)))
            cache.put(rec(i, groups, started=rng.choice((1.0, 2.0, float(step)))))
        elif op < 0.95:
            cache.delete(f"d{i}")
        else:
            cache.replace_all([r for r in cache.records() if rng.random() < 0.8])
        g, role = rng.choice(names), rng.choice(("prefill", "decode"))
        assert cache.find(g, role) == scan(cache, g, role), (step, g, role)
    assert len(cache) == len(cache.records())


def test_a_lookup_reads_only_its_group() -> None:
    cache = FleetCache()
    cache.replace_all(rec(i, tuple((f"g{i}-{k}", "prefill") for k in range(8))) for i in range(1000))
    cache.put(replace(rec(1000, (("g7-3", "prefill"),)), started_unix=5000.0))
    cache._records = NoScan(cache._records)
    found = cache.find("g7-3", "prefill")
    assert [loc.daemon_id for loc in found] == ["d1000", "d7"]  # the newest start first
    assert cache.find("nobody", "prefill") == [] and cache.find("g7-3", "decode") == []


async def test_held_gone_reports_are_withdrawn_reported_on_restart_or_at_their_deadline() -> None:
    told: list[tuple[str, str, str]] = []
    held = PendingGone(lambda d, i, why: told.append((d, i, why)))
    a, b, c = rec(1, ()), rec(2, ()), rec(3, ())
    for r in (a, b, c):
        held.hold(r, "deleted", time.monotonic() + 0.3)
    held.came_back(a)  # the same instance: it was alive
    held.came_back(replace(b, instance_id="d2-i2"))  # a restart: the held instance is gone, now
    assert told == [("d2", "d2-i1", "restarted (new instance in the registry)")]
    assert held.withdrawn == 1 and len(held) == 1
    await asyncio.sleep(0.5)
    assert told[1:] == [("d3", "d3-i1", "deleted")] and len(held) == 0
    held.hold(c, "deleted", time.monotonic() + 0.1)
    held.clear()
    await asyncio.sleep(0.2)
    assert len(told) == 2, "a cleared hold reports nothing"
