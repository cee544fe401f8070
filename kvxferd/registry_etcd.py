"""etcd backend of the fleet registry.

One key per daemon, `<prefix>/daemons/<daemon_id>`, holding its `DaemonRecord` as JSON and
attached to a lease of `registry_lease_ttl_s`: a daemon that dies stops renewing and etcd deletes
its record a TTL later. A session is: grant a lease, put our record, read the prefix, watch it from
the revision read, renew the lease every third of the TTL, and put the record again whenever our
engine groups change. Anything going wrong ends the session; the next one starts after a back-off,
with a fresh lease, so a daemon re-registers by itself when etcd returns. The cache survives
sessions: while etcd is away, lookups are served from what was last seen.

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
from pathlib import Path
from typing import Any

import grpc
from aetcd import rpc

from kvxferd import __version__
from kvxferd.config import Config
from kvxferd.engines import EngineTable
from kvxferd.metrics import Metrics
from kvxferd.ports import Identity
from kvxferd.registry import (
    DaemonRecord,
    FleetCache,
    GroupLocation,
    GroupRecord,
    all_ranks,
    layout_digest,
    wait_for_group,
)

logger = logging.getLogger(__name__)

_PUT, _DELETE = 0, 1  # mvccpb.Event.EventType
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.2, 5.0
# Engine registrations come in bursts (every TP rank of a group at once): one put per burst.
PUBLISH_COALESCE_S = 0.05


class RegistryUnavailable(RuntimeError):
    """etcd could not be reached and the config says the registry is required."""


class _SessionEnded(Exception):
    """The lease or the watch is gone; a new session re-registers."""


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range end for "every key starting with prefix"."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\0"
    b[-1] += 1
    return bytes(b)


def open_channel(config: Config, endpoint: str) -> grpc.aio.Channel:
    # Keep-alive pings let a half-open TCP connection to a partitioned etcd fail within seconds.
    opts = [("grpc.keepalive_time_ms", 2000), ("grpc.keepalive_timeout_ms", 2000),
            ("grpc.keepalive_permit_without_calls", 1)]
    if config.registry_tls_ca or config.registry_tls_cert:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(config.registry_tls_ca).read_bytes() if config.registry_tls_ca else None,
            private_key=Path(config.registry_tls_key).read_bytes() if config.registry_tls_key else None,
            certificate_chain=Path(config.registry_tls_cert).read_bytes() if config.registry_tls_cert else None,
        )
        return grpc.aio.secure_channel(endpoint, creds, options=opts)
    return grpc.aio.insecure_channel(endpoint, options=opts)


def daemons_prefix(config: Config) -> bytes:
    return f"{config.registry_prefix}/daemons/".encode()


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
        metrics: Metrics, on_state: Callable[[bool], None] | None = None,
    ) -> None:
        self._cfg = config
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
        self._channel: grpc.aio.Channel | None = None
        self._stopping = False

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
            "since_s": round(time.monotonic() - self.since, 3), "daemons": len(self.cache.records()),
            "sessions": self.sessions, "endpoint": self._cfg.registry_endpoints[self._endpoint],
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
                self._set_down(f"etcd {endpoint}: {exc.code().name}: {(exc.details() or '')[:200]}")
            except Exception as exc:
                self._set_down(f"etcd {endpoint}: {exc}")
            if self.sessions and self._up.is_set():
                backoff = BACKOFF_MIN_S
            self._endpoint = (self._endpoint + 1) % len(self._cfg.registry_endpoints)
            # Jittered: after an etcd outage a whole fleet must not re-register in one burst.
            await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _session(self, endpoint: str) -> None:
        t = self._cfg.registry_timeout_s
        self._channel = channel = open_channel(self._cfg, endpoint)
        try:
            kv, lease = rpc.KVStub(channel), rpc.LeaseStub(channel)
            grant = await lease.LeaseGrant(rpc.LeaseGrantRequest(TTL=self._cfg.registry_lease_ttl_s), timeout=t)
            if grant.error:
                raise _SessionEnded(f"lease not granted: {grant.error}")
            self._lease = grant.ID
            self.sessions += 1
            await self._publish(kv)
            got = await kv.Range(rpc.RangeRequest(key=self._prefix, range_end=prefix_end(self._prefix)), timeout=t)
            self._load(got.kvs)
            watch_from = got.header.revision + 1
            self._set_up()
            loops = [
                asyncio.ensure_future(self._keepalive(lease)),
                asyncio.ensure_future(self._watch(rpc.WatchStub(channel), watch_from)),
                asyncio.ensure_future(self._publisher(kv)),
            ]
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

    async def _publish(self, kv: rpc.KVStub) -> None:
        rec = self._local()
        key = self._prefix + rec.daemon_id.encode()
        await kv.Put(rpc.PutRequest(key=key, value=rec.to_json(), lease=self._lease),
                     timeout=self._cfg.registry_timeout_s)

    async def _publisher(self, kv: rpc.KVStub) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(PUBLISH_COALESCE_S)
            self._dirty.clear()
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

    async def _watch(self, stub: rpc.WatchStub, start_revision: int) -> None:
        call = stub.Watch()
        try:
            await call.write(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                key=self._prefix, range_end=prefix_end(self._prefix), start_revision=start_revision, prev_kv=True,
            )))
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise _SessionEnded("watch stream closed by etcd")
                if resp.canceled or resp.compact_revision:
                    raise _SessionEnded(f"watch cancelled: {resp.cancel_reason or 'compacted'}")
                for ev in resp.events:
                    self._event(ev)
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
                self._gone(old.daemon_id, old.instance_id, "restarted (new instance in the registry)")
        self.cache.replace_all(recs)
        self._m.registry_daemons.set(len(recs))

    def _event(self, ev: Any) -> None:
        key = bytes(ev.kv.key)
        me = self._local()
        if ev.type == _PUT:
            rec = self._decode(key, bytes(ev.kv.value))
            if rec is None:
                return
            if rec.daemon_id == me.daemon_id and rec.instance_id != me.instance_id:
                logger.error("registry: another daemon (instance %s at %s) registered our daemon_id %r",
                             rec.instance_id, rec.address, rec.daemon_id)
            old = self.cache.put(rec)
            if old is not None and old.instance_id != rec.instance_id:
                self._gone(old.daemon_id, old.instance_id, "restarted (new instance in the registry)")
        elif ev.type == _DELETE:
            daemon_id = key[len(self._prefix):].decode(errors="replace")
            if daemon_id == me.daemon_id and not self._stopping:
                raise _SessionEnded("our record was deleted")
            old = self.cache.delete(daemon_id)
            if old is not None:
                self._gone(old.daemon_id, old.instance_id, "its registry record was deleted (lease expired or revoked)")
        self._m.registry_daemons.set(len(self.cache.records()))


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


async def read_fleet(config: Config) -> list[tuple[DaemonRecord, int]]:
    """Every daemon record (with its lease's remaining TTL) for `kvxferd status --fleet`."""
    errors = []
    for endpoint in config.registry_endpoints:
        channel = open_channel(config, endpoint)
        try:
            prefix = daemons_prefix(config)
            t = config.registry_timeout_s
            got = await rpc.KVStub(channel).Range(rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix)), timeout=t)
            out = []
            for kv in got.kvs:
                try:
                    rec = DaemonRecord.from_json(bytes(kv.value))
                except ValueError:
                    continue
                ttl = await rpc.LeaseStub(channel).LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=kv.lease), timeout=t)
                out.append((rec, int(ttl.TTL)))
            return sorted(out, key=lambda x: x[0].daemon_id)
        except grpc.aio.AioRpcError as exc:
            errors.append(f"{endpoint}: {exc.code().name}")
        finally:
            await channel.close()
    raise RegistryUnavailable(f"etcd unreachable ({'; '.join(errors)})")
