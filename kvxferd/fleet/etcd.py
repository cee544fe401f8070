"""etcd backend of the fleet registry.

One key per daemon, `<prefix>/daemons/<daemon_id>`, holding its `DaemonRecord` as JSON and
attached to a lease of `registry_lease_ttl_s`: a daemon that dies stops renewing and etcd deletes
its record a TTL later. A session is: keep our lease if etcd still has it (else grant one and put
our record), watch the prefix from the last revision we saw (read it whole only the first time or
when that revision was compacted), renew the lease every third of the TTL, and put the record again
whenever our engine groups change. Anything going wrong ends the session; the next one starts after
a jittered back-off, which starts over after a healthy session. After an etcd blip a fleet thus
costs etcd one lease check and one watch per daemon, not a re-registration and a whole-fleet read
each (the storm that did not settle in 295 s at 300 daemons). The cache survives sessions: while
etcd is away, lookups are served from what was last seen.

We use aetcd's etcd v3 stubs (`aetcd.rpc`) on our own `grpc.aio` channel rather than its
`Client`: the client dials one endpoint without TLS, and its watcher hides stream errors we need
to see to end a session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import time
from collections.abc import Callable
from typing import Any

import grpc
from aetcd import rpc

from kvxferd import __version__
from kvxferd.config import Config
from kvxferd.core.engines import EngineTable
from kvxferd.core.peer_port import Identity
from kvxferd.fleet.etcd_wire import RegistryUnavailable as RegistryUnavailable
from kvxferd.fleet.etcd_wire import daemons_prefix, open_channel, prefix_end
from kvxferd.fleet.etcd_wire import read_fleet as read_fleet
from kvxferd.fleet.registry import (
    DaemonRecord,
    FleetCache,
    GroupLocation,
    GroupRecord,
    PendingGone,
    all_ranks,
    layout_digest,
    wait_for_group,
)
from kvxferd.ops.metrics import Metrics

logger = logging.getLogger(__name__)

_PUT, _DELETE = 0, 1  # mvccpb.Event.EventType
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.2, 5.0
# A session up this long was healthy: the next reconnect starts from BACKOFF_MIN_S again. Shorter
# ones (etcd flapping) keep doubling, so a flapping etcd is not hammered every 0.2 s.
HEALTHY_SESSION_S = 2.0
# Engine registrations come in bursts (every TP rank of a group at once): one put per burst.
PUBLISH_COALESCE_S = 0.05


class _SessionEnded(Exception):
    """The lease or the watch is gone; a new session re-registers."""


class _Compacted(Exception):
    """The revision a watch was to resume from is compacted away: read the prefix whole."""


def gone_grace_s(config: Config) -> float:
    """How long after a lease lapses its live owner may take to put its record again: its longest
    back-off, then a lease check (or grant) and a put, each up to timeout_s."""
    return 1.5 * BACKOFF_MAX_S + 2 * config.registry_timeout_s


def local_record(engines: EngineTable, ident: Identity, config: Config, started_unix: float) -> DaemonRecord:
    """This daemon's record: one GroupRecord per (group, role) of the engines registered here."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for eng in engines.engines.values():
        if eng.closing:
            continue
        groups.setdefault((eng.spec.group, eng.role.name.lower()), []).append(eng)
    out = []
    for (group, role), engs in sorted(groups.items()):
        spec = engs[0].spec
        lay = spec.layout
        out.append(GroupRecord(
            group, role, spec.parallel.tp_size, tuple(sorted(e.rank for e in engs)),
            layout_digest((lay.num_layers, lay.total_kv_heads, lay.head_dim, lay.dtype_bytes, lay.page_size, lay.mla)),
        ))
    return DaemonRecord(
        ident.daemon_id, ident.instance_id, ident.address, config.registry_node_name or socket.gethostname(),
        __version__, started_unix, tuple(out),
    )


class EtcdRegistry:
    enabled = True

    def __init__(
        self, config: Config, local: Callable[[], DaemonRecord], on_daemon_gone: Callable[[str, str, str], None],
        metrics: Metrics, on_state: Callable[[bool], None] | None = None, watch: bool = True,
    ) -> None:
        """`watch=False`: publish only, keep no fleet cache (a daemon that never resolves a group;
        bench/fleet_registry.py's record-only clients)."""
        self._cfg = config
        self._watching = watch
        self._local = local
        self._gone = on_daemon_gone
        self._m = metrics
        self._on_state = on_state
        self.cache = FleetCache()
        self._prefix = daemons_prefix(config)
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._up = asyncio.Event()
        self.reason = "not connected yet"
        self.since = time.monotonic()
        self.sessions = 0
        self._endpoint = 0
        self._lease = 0
        # The record as last put under self._lease: a session that keeps the lease puts only a change.
        self._published: bytes | None = None
        # The newest revision whose events the cache holds: the next watch resumes after it (0: read whole).
        self._rev = 0
        self._channel: grpc.aio.Channel | None = None
        self._stopping = False
        self.backoffs: list[float] = []  # the sleeps before each reconnect (status, tests)
        self.counts = {"lease_grants": 0, "leases_kept": 0, "puts": 0, "full_reads": 0, "resumes": 0,
                       "gone_reported": 0}
        self._pending_gone = PendingGone(self._report_gone)
        # Until then, a record deleted is reported gone only if its owner has not re-registered by then.
        self._recovering_until = 0.0
        self._me: DaemonRecord | None = None
        self._put_rev = 0  # etcd's revision of our last put

    # ------------------------------------------------------------------ what the core calls

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())
        if not self._cfg.registry_required:
            return
        try:
            await asyncio.wait_for(self._up.wait(), self._cfg.registry_timeout_s * 2)
        except asyncio.TimeoutError:
            await self.stop()
            raise RegistryUnavailable(
                f"registry is required but etcd at {','.join(self._cfg.registry_endpoints)} cannot be reached: "
                f"{self.reason}"
            ) from None

    async def stop(self) -> None:
        """Revokes the lease first (peers see us leave at once, not a TTL later), then stops."""
        self._stopping = True
        self._pending_gone.clear()
        if self._channel is not None and self._lease and self._up.is_set():
            try:
                await rpc.LeaseStub(self._channel).LeaseRevoke(rpc.LeaseRevokeRequest(ID=self._lease), timeout=1.0)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError):
                pass
            except asyncio.CancelledError:
                # The keep-alive loop can see the revoked lease before this call returns: the session
                # then ends and closes the channel under the call. Only our own cancellation goes on.
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._up.clear()
        self._m.registry_up.labels(backend="etcd").set(0)
        self.reason = "stopped"

    def groups_changed(self) -> None:
        self._dirty.set()

    async def resolve_group(self, group: str, role: str, deadline: float) -> GroupLocation:
        t0 = time.monotonic()
        try:
            loc = await wait_for_group(self.cache, group, role, deadline, all_ranks, self._why)
        except Exception:
            self._m.registry_lookup.labels(result="missing").observe(time.monotonic() - t0)
            raise
        self._m.registry_lookup.labels(result="cache" if time.monotonic() - t0 < 0.001 else "waited").observe(
            time.monotonic() - t0)
        return loc

    def status(self) -> dict[str, object]:
        return {
            "backend": "etcd", "state": "up" if self._up.is_set() else "degraded", "reason": self.reason,
            "since_s": round(time.monotonic() - self.since, 3), "daemons": len(self.cache),
            "sessions": self.sessions, "endpoint": self._cfg.registry_endpoints[self._endpoint],
            "revision": self._rev, **self.counts, "gone_withdrawn": self._pending_gone.withdrawn,
        }

    @property
    def up(self) -> bool:
        return self._up.is_set()

    # ------------------------------------------------------------------ sessions

    def _why(self) -> str:
        return "" if self._up.is_set() else f" (registry degraded: {self.reason})"

    def _set_up(self) -> None:
        if not self._up.is_set():
            self._up.set()
            self.since = time.monotonic()
            self.reason = ""
            self._m.registry_up.labels(backend="etcd").set(1)
            if self.sessions > 1:
                self._m.registry_reconnects.inc()
                # Every daemon reconnects after an etcd blip, some only after their back-off (up to
                # 1.5 x BACKOFF_MAX_S) and a lease check: a record deleted meanwhile may be a lease
                # that lapsed while its live owner was away, so it gets until then to come back.
                self._recovering_until = time.monotonic() + self._cfg.registry_lease_ttl_s + gone_grace_s(self._cfg)
            logger.info("registry: registered in etcd %s as %s (lease %x)",
                        self._cfg.registry_endpoints[self._endpoint], self._local().daemon_id, self._lease)
            if self._on_state is not None:
                self._on_state(True)

    def _set_down(self, reason: str) -> None:
        self.reason = reason
        if self._up.is_set():
            self._up.clear()
            self.since = time.monotonic()
            self._m.registry_up.labels(backend="etcd").set(0)
            logger.warning("registry degraded: %s (transfers between known peers go on)", reason)
            if self._on_state is not None:
                self._on_state(False)

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        self._m.registry_up.labels(backend="etcd").set(0)
        while True:
            endpoint = self._cfg.registry_endpoints[self._endpoint]
            try:
                await self._session(endpoint)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                self._end_session(f"etcd {endpoint}: {exc.code().name}: {(exc.details() or '')[:200]}")
            except Exception as exc:
                self._end_session(f"etcd {endpoint}: {exc}")
            if self._healthy:
                backoff = BACKOFF_MIN_S
            self._endpoint = (self._endpoint + 1) % len(self._cfg.registry_endpoints)
            # Jittered: after an etcd outage a whole fleet must not reconnect in one burst.
            sleep = backoff * random.uniform(0.5, 1.5)
            self.backoffs.append(round(sleep, 3))
            del self.backoffs[:-32]
            await asyncio.sleep(sleep)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _end_session(self, reason: str) -> None:
        # Read before _set_down clears _up: was the session that just ended a healthy one?
        self._healthy = self._up.is_set() and time.monotonic() - self.since >= HEALTHY_SESSION_S
        self._set_down(reason)

    _healthy = False

    async def _session(self, endpoint: str) -> None:
        self._healthy = False
        self._channel = channel = open_channel(self._cfg, endpoint)
        try:
            kv, lease = rpc.KVStub(channel), rpc.LeaseStub(channel)
            await self._lease_for_session(lease)
            self.sessions += 1
            if self._published != self._local().to_json():
                await self._publish(kv)
            loops = [asyncio.ensure_future(self._keepalive(lease)), asyncio.ensure_future(self._publisher(kv))]
            if self._watching:
                loops.append(asyncio.ensure_future(self._watch(kv, rpc.WatchStub(channel))))
            else:
                self._set_up()
            try:
                done, _ = await asyncio.wait(loops, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
                raise _SessionEnded("a registry loop ended")
            finally:
                for task in loops:
                    task.cancel()
                await asyncio.gather(*loops, return_exceptions=True)
        finally:
            self._channel = None
            await channel.close()

    async def _lease_for_session(self, lease: rpc.LeaseStub) -> None:
        """Keeps the lease of the last session if etcd still has it (etcd extends every lease by its
        TTL when it comes back, so after a blip it usually does): our record is then still there and
        peers see nothing. Else a fresh lease, and the record is put again."""
        t = self._cfg.registry_timeout_s
        if self._lease:
            left = await lease.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=self._lease), timeout=t)
            if left.TTL > 0:
                self.counts["leases_kept"] += 1
                return
        grant = await lease.LeaseGrant(rpc.LeaseGrantRequest(TTL=self._cfg.registry_lease_ttl_s), timeout=t)
        if grant.error:
            raise _SessionEnded(f"lease not granted: {grant.error}")
        self._lease, self._published = grant.ID, None
        self.counts["lease_grants"] += 1

    async def _publish(self, kv: rpc.KVStub) -> None:
        rec = self._local()
        raw = rec.to_json()
        key = self._prefix + rec.daemon_id.encode()
        put = await kv.Put(rpc.PutRequest(key=key, value=raw, lease=self._lease), timeout=self._cfg.registry_timeout_s)
        self._published, self._put_rev = raw, put.header.revision
        self.counts["puts"] += 1

    async def _publisher(self, kv: rpc.KVStub) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(PUBLISH_COALESCE_S)
            self._dirty.clear()
            if self._published != self._local().to_json():
                await self._publish(kv)

    async def _keepalive(self, lease: rpc.LeaseStub) -> None:
        t = self._cfg.registry_timeout_s
        call = lease.LeaseKeepAlive()
        try:
            while True:
                await call.write(rpc.LeaseKeepAliveRequest(ID=self._lease))
                reply = await asyncio.wait_for(call.read(), t)
                if reply is grpc.aio.EOF:
                    raise _SessionEnded("lease keep-alive stream closed by etcd")
                if reply.TTL <= 0:
                    raise _SessionEnded("our lease was revoked (stopping)" if self._stopping else
                                        "our lease expired (etcd was unreachable for longer than the TTL)")
                await asyncio.sleep(self._cfg.registry_lease_ttl_s / 3)
        except asyncio.TimeoutError:
            raise _SessionEnded(f"no lease keep-alive answer within {t} s") from None
        finally:
            call.cancel()

    async def _watch(self, kv: rpc.KVStub, stub: rpc.WatchStub) -> None:
        """Follows the prefix from the last revision seen; reads it whole only when there is none
        (first session) or etcd compacted it away."""
        while True:
            if self._rev:
                self.counts["resumes"] += 1
            else:
                got = await kv.Range(rpc.RangeRequest(key=self._prefix, range_end=prefix_end(self._prefix)),
                                     timeout=self._cfg.registry_timeout_s)
                self.counts["full_reads"] += 1
                self._load(got.kvs)
                self._rev = got.header.revision
            try:
                await self._follow(stub, self._rev + 1)
            except _Compacted as exc:
                logger.warning("registry: %s; reading the fleet whole", exc)
                self._rev = 0

    async def _follow(self, stub: rpc.WatchStub, start_revision: int) -> None:
        call = stub.Watch()
        try:
            await call.write(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                key=self._prefix, range_end=prefix_end(self._prefix), start_revision=start_revision, prev_kv=True,
            )))
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise _SessionEnded("watch stream closed by etcd")
                if resp.compact_revision:
                    raise _Compacted(f"revision {start_revision} is compacted (etcd keeps {resp.compact_revision}+)")
                if resp.canceled:
                    raise _SessionEnded(f"watch cancelled: {resp.cancel_reason}")
                if resp.created:
                    self._set_up()
                for ev in resp.events:
                    self._event(ev)
                    # Event revisions, not the header's: a catching-up watch sends a long history in
                    # batches whose header already names the newest revision.
                    self._rev = max(self._rev, ev.kv.mod_revision)
                if resp.events:
                    self._m.registry_daemons.set(len(self.cache))
        finally:
            call.cancel()

    # ------------------------------------------------------------------ cache

    def _decode(self, key: bytes, value: bytes) -> DaemonRecord | None:
        try:
            rec = DaemonRecord.from_json(value)
        except ValueError as exc:
            logger.warning("registry: ignoring %s: %s", key[:200], exc)
            return None
        if key != self._prefix + rec.daemon_id.encode():
            logger.warning("registry: ignoring %s: it names daemon %r", key[:200], rec.daemon_id)
            return None
        return rec

    def _load(self, kvs: Any) -> None:
        """A fresh read after (re)connecting. Records missing from it are dropped from the cache
        but not taken as lost: after an etcd outage their owners may simply not have re-registered
        yet, and heartbeats still watch the peers we talk to. A changed instance id is a restart."""
        recs = [r for r in (self._decode(bytes(kv.key), bytes(kv.value)) for kv in kvs) if r is not None]
        for rec in recs:
            old = self.cache.get(rec.daemon_id)
            if old is not None and old.instance_id != rec.instance_id:
                self._report_gone(old.daemon_id, old.instance_id, "restarted (new instance in the registry)")
            self._pending_gone.came_back(rec)
        self.cache.replace_all(recs)
        self._m.registry_daemons.set(len(self.cache))

    def _event(self, ev: Any) -> None:
        key = bytes(ev.kv.key)
        me = self._me = self._me or self._local()  # its ids never change; the groups are not read here
        if ev.type == _PUT:
            rec = self._decode(key, bytes(ev.kv.value))
            if rec is None:
                return
            if rec.daemon_id == me.daemon_id and rec.instance_id != me.instance_id:
                logger.error("registry: another daemon (instance %s at %s) registered our daemon_id %r",
                             rec.instance_id, rec.address, rec.daemon_id)
            old = self.cache.put(rec)
            if old is not None and old.instance_id != rec.instance_id:
                self._report_gone(old.daemon_id, old.instance_id, "restarted (new instance in the registry)")
            self._pending_gone.came_back(rec)
        elif ev.type == _DELETE:
            daemon_id = key[len(self._prefix):].decode(errors="replace")
            if daemon_id == me.daemon_id and not self._stopping:
                if ev.kv.mod_revision < self._put_rev:
                    return  # replayed: our lease lapsed while we were away, and we have put it again since
                self._published = None
                raise _SessionEnded("our record was deleted")
            old = self.cache.delete(daemon_id)
            if old is None:
                return
            why = "its registry record was deleted (lease expired or revoked)"
            if time.monotonic() < self._recovering_until:
                self._pending_gone.hold(old, why, self._recovering_until)
            else:
                self._report_gone(old.daemon_id, old.instance_id, why)

    def _report_gone(self, daemon_id: str, instance_id: str, why: str) -> None:
        self.counts["gone_reported"] += 1
        self._gone(daemon_id, instance_id, why)


def make_registry(
    config: Config, engines: EngineTable, ident: Identity, on_daemon_gone: Callable[[str, str, str], None],
    metrics: Metrics, on_state: Callable[[bool], None] | None = None,
) -> EtcdRegistry | None:
    """The configured registry, or None in static mode."""
    if config.registry_backend != "etcd":
        return None
    started = time.time()
    return EtcdRegistry(config, lambda: local_record(engines, ident, config, started), on_daemon_gone, metrics,
                        on_state)
