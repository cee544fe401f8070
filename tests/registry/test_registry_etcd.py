"""The etcd registry on a real etcd server, driven in-process: records, leases, the watch-fed
cache, lookups by group, and etcd going away and coming back (whole, or for one client through a
`Gate`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import grpc
import pytest
from aetcd import rpc

from kvxferd.config import load_config
from kvxferd.errors import Unavailable
from kvxferd.fleet.etcd import BACKOFF_MIN_S, HEALTHY_SESSION_S, EtcdRegistry, RegistryUnavailable, read_fleet
from kvxferd.fleet.registry import DaemonRecord, GroupRecord
from kvxferd.ops.metrics import Metrics
from tests.registry.conftest import Etcd, Gate, free_port


def cfg(endpoint: str, ttl: int = 1, **kw: Any) -> Any:
    return load_config(None, env={}, overrides={
        "registry_backend": "etcd", "registry_endpoints": endpoint, "registry_lease_ttl_s": ttl,
        "registry_timeout_s": 0.5, "socket": "/tmp/kvx-reg-test/x.sock", **kw,
    })


class Daemon:
    """A registry client plus the record it publishes; `gone` collects what it was told."""

    def __init__(self, endpoint: str, daemon_id: str, ttl: int = 1, **kw: Any) -> None:
        self.record = DaemonRecord(daemon_id, f"{daemon_id}-i1", f"127.0.0.1:{free_port()}", "node-a", "0.1.0",
                                   time.time())
        self.gone: list[tuple[str, str, str]] = []
        self.states: list[bool] = []
        self.metrics = Metrics()
        self.reg = EtcdRegistry(cfg(endpoint, ttl, **kw), lambda: self.record,
                                lambda d, i, why: self.gone.append((d, i, why)), self.metrics, self.states.append)

    def set_groups(self, *groups: GroupRecord) -> None:
        self.record = replace(self.record, groups=groups)
        self.reg.groups_changed()

    def gauge(self, name: str, **labels: str) -> float:
        return float(self.metrics.registry.get_sample_value(name, labels) or 0.0)


def group(name: str, role: str = "prefill", tp: int = 1, ranks: tuple[int, ...] = (0,)) -> GroupRecord:
    return GroupRecord(name, role, tp, ranks, "abc")


async def until(cond: Any, timeout: float = 10.0, what: str = "") -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def test_register_watch_resolve_and_lease_expiry(etcd: Etcd) -> None:
    # A 3 s call timeout (the default), not 0.5 s: on a loaded box a keep-alive answered late would
    # end a's session, and a delete seen while recovering from that is held, not reported at once.
    a, b = Daemon(etcd.endpoint, "a", registry_timeout_s=3.0), Daemon(etcd.endpoint, "b", registry_timeout_s=3.0)
    await a.reg.start()
    await b.reg.start()
    try:
        await until(lambda: a.reg.up and b.reg.up, what="both registered")
        assert a.gauge("kvxferd_registry_up", backend="etcd") == 1
        # Each sees the other through the watch.
        await until(lambda: a.reg.cache.get("b") is not None, what="a sees b")
        assert a.reg.cache.get("b") == b.record
        # A group published later is found by a lookup that was already waiting for it.
        look = asyncio.ensure_future(a.reg.resolve_group("llama-pre", "prefill", time.monotonic() + 5))
        await asyncio.sleep(0.2)
        assert not look.done()
        b.set_groups(group("llama-pre", tp=2, ranks=(0,)))
        await asyncio.sleep(0.3)
        assert not look.done(), "a group with one of its two ranks must not resolve"
        b.set_groups(group("llama-pre", tp=2, ranks=(0, 1)))
        loc = await asyncio.wait_for(look, 5)
        assert (loc.daemon_id, loc.instance_id, loc.address) == ("b", "b-i1", b.record.address)
        # From the cache: no wait.
        t0 = time.perf_counter()
        loc2 = await a.reg.resolve_group("llama-pre", "prefill", time.monotonic() + 1)
        assert loc2 == loc and time.perf_counter() - t0 < 0.05
        # The decode role of the same name is another group.
        with pytest.raises(Unavailable, match="decode group 'llama-pre' is not registered"):
            await a.reg.resolve_group("llama-pre", "decode", time.monotonic() + 0.2)
        # b dies without revoking: its keep-alives stop, etcd expires the record within the TTL.
        assert b.reg._task is not None
        b.reg._task.cancel()
        t_dead = time.monotonic()
        await until(lambda: a.reg.cache.get("b") is None, timeout=5, what="b's record expires")
        took = time.monotonic() - t_dead
        assert took < 1 + 1.5, f"record outlived its 1 s lease by {took:.1f} s"
        assert a.gone == [("b", "b-i1", "its registry record was deleted (lease expired or revoked)")], a.reg.status()
    finally:
        await a.reg.stop()
        await b.reg.stop()


async def test_restart_and_move(etcd: Etcd) -> None:
    # c's lease is long, so that its record going at once can only be the revocation.
    a, b, c = Daemon(etcd.endpoint, "a"), Daemon(etcd.endpoint, "b"), Daemon(etcd.endpoint, "c", ttl=10)
    b.set_groups(group("g"))
    for d in (a, b, c):
        await d.reg.start()
    try:
        await until(lambda: a.reg.cache.get("b") is not None and a.reg.cache.get("c") is not None)
        assert (await a.reg.resolve_group("g", "prefill", time.monotonic() + 1)).daemon_id == "b"
        # b restarts: same daemon id, new instance id: the old instance is reported gone.
        await b.reg.stop()
        b.record = replace(b.record, instance_id="b-i2", started_unix=time.time())
        b.reg = EtcdRegistry(b.reg._cfg, lambda: b.record, lambda *x: None, Metrics())
        await b.reg.start()
        await until(lambda: (a.reg.cache.get("b") or b.record).instance_id == "b-i2"
                    and a.reg.cache.get("b") is not None, what="a sees b's new instance")
        assert ("b", "b-i1") in [(d, i) for d, i, _ in a.gone]
        assert (await a.reg.resolve_group("g", "prefill", time.monotonic() + 1)).instance_id == "b-i2"
        # The group moves to c (newer start): lookups follow it while b's record still lists it.
        c.record = replace(c.record, started_unix=time.time())
        c.set_groups(group("g"))
        await until(lambda: any(g.group == "g" for g in (a.reg.cache.get("c") or c.record).groups)
                    and a.reg.cache.get("c") is not None and bool(a.reg.cache.get("c").groups))  # type: ignore[union-attr]
        assert (await a.reg.resolve_group("g", "prefill", time.monotonic() + 1)).daemon_id == "c"
        # A graceful stop revokes the lease: the record goes at once, not a TTL later.
        await c.reg.stop()
        took = await until(lambda: a.reg.cache.get("c") is None, timeout=3)
        assert took < 3.0, f"{took:.1f} s: the record expired instead of being revoked"
        assert (await a.reg.resolve_group("g", "prefill", time.monotonic() + 1)).daemon_id == "b"
        fleet = await read_fleet(a.reg._cfg)
        assert [r.daemon_id for r, _ in fleet] == ["a", "b"]
        assert all(0 <= ttl <= 2 for _, ttl in fleet), fleet  # whole seconds left of 1 s leases
    finally:
        for d in (a, b, c):
            await d.reg.stop()


async def test_etcd_down_then_back(etcd: Etcd) -> None:
    a, b = Daemon(etcd.endpoint, "a", ttl=2), Daemon(etcd.endpoint, "b", ttl=2)
    b.set_groups(group("known"))
    await a.reg.start()
    await b.reg.start()
    try:
        await until(lambda: a.reg.up and a.reg.cache.get("b") is not None and bool(a.reg.cache.get("b").groups))  # type: ignore[union-attr]
        etcd.kill()
        await until(lambda: not a.reg.up, timeout=5, what="a notices etcd is gone")
        assert a.states[-1] is False and a.gauge("kvxferd_registry_up", backend="etcd") == 0
        assert "degraded" in str(a.reg.status()["state"])
        # The cache still serves what it knew; an unknown group waits, then fails naming the cause.
        assert (await a.reg.resolve_group("known", "prefill", time.monotonic() + 0.1)).daemon_id == "b"
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match=r"prefill group 'new' is not registered.*registry degraded"):
            await a.reg.resolve_group("new", "prefill", time.monotonic() + 0.5)
        assert 0.45 < time.monotonic() - t0 < 1.5
        assert a.gone == [], "etcd going away is no daemon's loss"
        # etcd returns (same data dir): both re-register by themselves, with fresh leases.
        await asyncio.to_thread(etcd.start)
        await until(lambda: a.reg.up and b.reg.up, timeout=15, what="re-registered")
        assert a.states[-1] is True and a.gauge("kvxferd_registry_reconnects_total") >= 1
        b.set_groups(group("known"), group("new"))
        loc = await a.reg.resolve_group("new", "prefill", time.monotonic() + 5)
        assert loc.daemon_id == "b"
        fleet = await read_fleet(a.reg._cfg)
        assert {r.daemon_id for r, _ in fleet} == {"a", "b"}
    finally:
        await a.reg.stop()
        await b.reg.stop()


async def test_required_registry_refuses_to_start_without_etcd() -> None:
    d = Daemon(f"127.0.0.1:{free_port()}", "a", registry_required=True)
    with pytest.raises(RegistryUnavailable, match=r"registry is required but etcd at 127\.0\.0\.1:"):
        await d.reg.start()
    # Not required: start returns at once with the registry in back-off.
    e = Daemon(f"127.0.0.1:{free_port()}", "b")
    t0 = time.monotonic()
    await e.reg.start()
    assert time.monotonic() - t0 < 0.1 and not e.reg.up
    await asyncio.sleep(0.3)
    assert "UNAVAILABLE" in e.reg.reason
    await e.reg.stop()


async def test_blips_keep_leases_resume_the_watch_and_reset_the_backoff(etcd: Etcd) -> None:
    # Leases longer than the back-off can grow over a blip (up to 1.5 x 5 s), as by default (10 s).
    a, b = Daemon(etcd.endpoint, "a", ttl=10, registry_timeout_s=3.0), Daemon(etcd.endpoint, "b", ttl=10, registry_timeout_s=3.0)
    await a.reg.start()
    await b.reg.start()
    try:
        await until(lambda: a.reg.up and b.reg.up and a.reg.cache.get("b") is not None, what="registered")
        await asyncio.sleep(HEALTHY_SESSION_S)
        for blip in range(2):
            n = len(a.reg.backoffs)
            etcd.kill()
            await until(lambda: not a.reg.up and not b.reg.up, timeout=5, what="both notice etcd is gone")
            if blip == 0:
                b.set_groups(group("during"))  # changed while etcd was away: put once it is back
            await until(lambda n=n: len(a.reg.backoffs) > n, what="a's first reconnect attempt")
            # The session before was healthy: the back-off starts over (it used to keep growing).
            assert a.reg.backoffs[n] <= BACKOFF_MIN_S * 1.5, a.reg.backoffs
            await asyncio.sleep(1.0)
            await asyncio.to_thread(etcd.start)
            await until(lambda: a.reg.up and b.reg.up, timeout=15, what="both back")
            await asyncio.sleep(HEALTHY_SESSION_S)
        # etcd kept both leases (it extends them when it comes back): no new lease, no re-put of
        # an unchanged record, no whole-fleet read, the watch resumed where it was.
        for d in (a, b):
            assert {k: d.reg.counts[k] for k in ("lease_grants", "leases_kept", "full_reads", "resumes")} == {
                "lease_grants": 1, "leases_kept": 2, "full_reads": 1, "resumes": 2}, d.reg.status()
        assert (a.reg.counts["puts"], b.reg.counts["puts"]) == (1, 2)
        await until(lambda: [g.group for g in (a.reg.cache.get("b") or b.record).groups] == ["during"],
                    what="a sees b's change made while etcd was away")
        assert a.gone == [] and b.gone == []
    finally:
        await a.reg.stop()
        await b.reg.stop()


async def test_a_partitioned_client_replays_what_it_missed_or_rereads_after_compaction(etcd: Etcd) -> None:
    gate = Gate(etcd)
    await gate.start()
    # Exact session counts below: a 3 s call timeout, so a loaded box does not end sessions by itself.
    a, b = Daemon(gate.endpoint, "a", ttl=3, registry_timeout_s=3.0), Daemon(etcd.endpoint, "b", ttl=3, registry_timeout_s=3.0)
    c = Daemon(etcd.endpoint, "c", ttl=3)
    await a.reg.start()
    await b.reg.start()
    try:
        await until(lambda: a.reg.up and b.reg.up and a.reg.cache.get("b") is not None, what="registered")
        gate.cut()
        await until(lambda: not a.reg.up, timeout=5, what="a cut off")
        b.set_groups(group("x"))
        await c.reg.start()
        await until(lambda: c.reg.up and b.reg.cache.get("c") is not None, what="c registered")
        await c.reg.stop()
        await until(lambda: b.reg.cache.get("c") is None, what="c gone")
        gate.heal()
        await until(lambda: a.reg.up and bool((a.reg.cache.get("b") or b.record).groups), timeout=15,
                    what="a back, with b's change")
        # Replayed from the revision a had seen: c came and went, b changed, no whole-fleet read.
        assert a.reg.cache.get("c") is None and a.reg.counts["full_reads"] == 1 and a.reg.counts["resumes"] == 1
        assert a.reg.counts["lease_grants"] == 1
        # Cut again, and etcd compacts away the revision a would resume from: a reads the fleet whole.
        gate.cut()
        await until(lambda: not a.reg.up, timeout=5, what="a cut off again")
        b.set_groups(group("y"))
        await until(lambda: b.reg.counts["puts"] == 3, what="b's change put")
        async with grpc.aio.insecure_channel(etcd.endpoint) as ch:
            # A write after b's, so that the compaction passes the revision of b's change too.
            now = (await rpc.KVStub(ch).Put(rpc.PutRequest(key=b"elsewhere", value=b"1"))).header.revision
            await rpc.KVStub(ch).Compact(rpc.CompactionRequest(revision=now, physical=True))
        gate.heal()
        await until(lambda: a.reg.up and [g.group for g in (a.reg.cache.get("b") or b.record).groups] == ["y"],
                    timeout=15, what="a back after compaction, with b's change")
        assert a.reg.counts["full_reads"] == 2 and a.reg.counts["lease_grants"] == 1
        assert a.gone == [], "b only changed; c left while a was away and was not known to a"
    finally:
        for d in (a, b, c):
            await d.reg.stop()
        await gate.close()


async def test_a_lapsed_lease_racing_its_reregistration_is_not_gone_but_a_restart_is(etcd: Etcd) -> None:
    """etcd blips; b is back at once, a (behind a gate) only after its lease lapsed: b sees a's
    record deleted, then put again by the same instance. That is no loss. A new instance is
    reported at once, and a record deleted for good is reported once the recovery window ends."""
    gate = Gate(etcd)
    await gate.start()
    a, b = Daemon(gate.endpoint, "a", ttl=1, registry_timeout_s=3.0), Daemon(etcd.endpoint, "b", ttl=1, registry_timeout_s=3.0)
    await a.reg.start()
    await b.reg.start()
    a2: Daemon | None = None
    try:
        await until(lambda: a.reg.up and b.reg.up and b.reg.cache.get("a") is not None, what="registered")
        etcd.kill()
        gate.cut()
        await until(lambda: not a.reg.up and not b.reg.up, timeout=5, what="both notice etcd is gone")
        await asyncio.to_thread(etcd.start)
        await until(lambda: b.reg.up, timeout=15, what="b back")
        await until(lambda: b.reg.cache.get("a") is None, timeout=10, what="a's lease lapses (a is cut off)")
        gate.heal()
        await until(lambda: a.reg.up and b.reg.cache.get("a") is not None, timeout=15, what="a re-registers")
        await asyncio.sleep(0.5)
        # A new lease, and one session: the replayed delete of its own old record does not end it.
        assert a.reg.counts["lease_grants"] == 2 and a.reg.sessions == 2 and a.reg.up, a.reg.status()
        assert b.reg.status()["gone_withdrawn"] == 1 and b.gone == [], b.gone
        # A restart (new instance id) in the same window is reported at once.
        assert a.reg._task is not None
        a.reg._task.cancel()
        a2 = Daemon(etcd.endpoint, "a", ttl=1)
        a2.record = replace(a2.record, instance_id="a-i2")
        await a2.reg.start()
        await until(lambda: bool(b.gone), timeout=5, what="b told of a's restart")
        assert b.gone == [("a", "a-i1", "restarted (new instance in the registry)")]
        # a2 dies without revoking: its record goes a TTL later and is reported by the window's end.
        assert a2.reg._task is not None
        a2.reg._task.cancel()
        # b's window: TTL 1 s + 1.5 x 5 s + 2 x 3 s from its reconnect.
        await until(lambda: len(b.gone) == 2, timeout=25, what="a2 reported gone")
        assert b.gone[1] == ("a", "a-i2", "its registry record was deleted (lease expired or revoked)")
    finally:
        for d in (a, b, *([a2] if a2 else [])):
            await d.reg.stop()
        await gate.close()
