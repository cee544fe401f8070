"""Prometheus metrics. Each daemon owns a fresh registry so tests stay independent."""

from __future__ import annotations

import asyncio
import bisect
import functools
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from kvxferd import __version__

_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_C = TypeVar("_C")
# The `peer` label of peers past the cap (config max_peer_series). Parenthesised: not a HOST:PORT.
OTHER_PEERS = "(other)"


class PeerSeries:
    """Series labelled with a peer's daemon id, a name the peer chose: only peers in the peer
    table (`admit`ted at handshake) and at most `cap` of them have their own at a time, the rest
    share peer="(other)" (counted, not lost), and a forgotten peer's series go with it
    (PeerManager), so ids that come and go cannot grow /metrics for ever; nor can a late event of
    a peer already forgotten bring its series back."""

    def __init__(self, cap: int = 256) -> None:
        self.cap = cap
        # (metric, peer, other label values) -> child: one dict lookup per chunk.
        self._children: dict[tuple[Any, str, tuple[str, ...]], Any] = {}
        self._peers: set[str] = set()  # those with series
        self._known: set[str] = set()

    def admit(self, peer: str) -> None:
        self._known.add(peer)

    def labels(self, metric: Any, peer: str, *more: str) -> Any:
        """`metric`'s child for `peer` and the rest of its label values, in the metric's order."""
        key = (metric, peer, more)
        got = self._children.get(key)
        if got is not None:
            return got
        if peer != OTHER_PEERS and peer not in self._peers and (len(self._peers) >= self.cap
                                                                or peer not in self._known):
            return self.labels(metric, OTHER_PEERS, *more)
        child = self._children[key] = metric.labels(peer, *more)
        if peer != OTHER_PEERS:
            self._peers.add(peer)
        return child

    def forget(self, peer: str) -> None:
        self._known.discard(peer)
        if peer == OTHER_PEERS or peer not in self._peers:
            return
        self._peers.discard(peer)
        for key in [k for k in self._children if k[1] == peer]:
            del self._children[key]
            key[0].remove(peer, *key[2])


class Tally:
    """A label child of a PlainCounter: a plain integer. Prometheus's own inc() takes a lock and
    builds a sample; per layer part that was ~16 % of the prefill loop (issue #37)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def inc(self, amount: int = 1) -> None:
        self.n += amount


class _Plain(Generic[_C]):
    """Label children made by `make`, looked up like prometheus_client's (labels, remove), exported
    by the subclass's collect when scraped. Written on the event loop; a scrape from another thread
    may see a count a moment old, never a lost one."""

    def __init__(self, name: str, doc: str, labelnames: list[str], registry: CollectorRegistry,
                 make: Callable[[], _C]) -> None:
        self._name, self._doc, self._labelnames, self._make = name, doc, labelnames, make
        self._children: dict[tuple[str, ...], _C] = {}
        registry.register(self)

    def labels(self, *values: str, **named: str) -> _C:
        key = values or tuple(named[n] for n in self._labelnames)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = self._make()
        return got

    def remove(self, *values: str) -> None:
        self._children.pop(values, None)

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError


class PlainCounter(_Plain[Tally]):
    """A counter with the same name, labels and samples as a prometheus_client Counter, counted
    in plain integers and read only when scraped."""

    def __init__(self, name: str, doc: str, labelnames: list[str], registry: CollectorRegistry) -> None:
        super().__init__(name, doc, labelnames, registry, Tally)

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self._name, self._doc, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(self._name, self._doc, labels=self._labelnames)
        for key, child in list(self._children.items()):
            fam.add_metric(list(key), child.n)
        yield fam


class Buckets:
    """A label child of a PlainHistogram: counts per bucket and a sum, no lock."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: a value on a bound counts in it
        self.sum += value


class PlainHistogram(_Plain[Buckets]):
    """A histogram exported like a prometheus_client Histogram (buckets, _count, _sum), observed
    without a lock (see PlainCounter)."""

    def __init__(self, name: str, doc: str, labelnames: list[str], buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self._bounds = tuple(float(b) for b in buckets)
        super().__init__(name, doc, labelnames, registry, functools.partial(Buckets, self._bounds))

    def observe(self, value: float) -> None:
        """For a histogram without labels."""
        self.labels().observe(value)

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for key, child in list(self._children.items()):
            counts, total = list(child.counts), child.sum
            cumulative, running = [], 0
            for bound, n in zip((*(repr(b) for b in self._bounds), "+Inf"), counts, strict=True):
                running += n
                cumulative.append((bound, running))
            fam.add_metric(list(key), cumulative, total)
        yield fam


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.build_info = Info("kvxferd_build", "kvxferd build information", registry=r)
        self.build_info.info({"version": __version__})
        self.rpc_duration = Histogram(
            "kvxferd_rpc_duration_seconds", "gRPC handler latency", ["service", "method", "code"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.rooms = Gauge("kvxferd_rooms", "Rooms by role and state", ["role", "state"], registry=r)
        self.rooms_finished = Counter(
            "kvxferd_rooms_finished", "Rooms that reached SUCCESS or FAILED", ["role", "state"], registry=r
        )
        self.room_duration = Histogram(
            "kvxferd_room_duration_seconds", "Room start to SUCCESS", ["role"], buckets=_TRANSFER_BUCKETS,
            registry=r,
        )
        # Observed per WRITE (per layer part when parts do not merge): read at scrape time.
        self.chunk_transfer = PlainHistogram(
            "kvxferd_chunk_transfer_seconds", "One WRITE (a chunk's parts for one daemon) from post to DONE", ["path"],
            buckets=_TRANSFER_BUCKETS, registry=r,
        )
        self.queue_depth = Gauge("kvxferd_queue_depth", "Work waiting per queue", ["queue"], registry=r)
        self.ring_capacity = Gauge("kvxferd_ring_capacity_bytes", "Ring size", ["ring"], registry=r)
        self.ring_used = Gauge("kvxferd_ring_used_bytes", "Ring bytes held by slots", ["ring"], registry=r)
        self.slots_held = Gauge("kvxferd_slots_held", "Slots reserved in all rings", registry=r)
        self.transfer_bytes = PlainCounter(
            "kvxferd_transfer_bytes", "Bytes written to peers, by path: nixl, or on this daemon local (host), "
            "local-gpu (one GPU), local-p2p (GPU to GPU, peer access), local-staged (GPU to GPU through host), "
            "local-host-gpu", ["peer", "path"], registry=r
        )
        self.peer_series = PeerSeries()
        self.nixl_errors = Counter("kvxferd_nixl_errors", "NIXL transfer errors", ["peer"], registry=r)
        self.peers = Gauge("kvxferd_peers", "Known peer daemons by state", ["state"], registry=r)
        self.engines = Gauge("kvxferd_engines", "Registered engine ranks", ["role"], registry=r)
        self.room_failures = Counter(
            "kvxferd_room_failures", "Rooms failed, by reason code", ["reason"], registry=r
        )
        self.heartbeat_misses = Counter(
            "kvxferd_heartbeat_misses", "Heartbeats to a peer that got no answer", ["peer"], registry=r
        )
        self.peer_reconnects = Counter(
            "kvxferd_peer_reconnects", "Pairs whose NIXL connection was rebuilt after a transport error", ["peer"],
            registry=r,
        )
        self.peer_metadata_reloads = Counter(
            "kvxferd_peer_metadata_reloads", "Live peers' NIXL metadata replaced after they registered or released memory",
            ["peer"], registry=r,
        )
        self.credits = Counter(
            "kvxferd_credits", "Slot credits by event (granted, requested, returned, revoked, freed, "
            "quarantine_expired)", ["event"], registry=r,
        )
        self.notifs_dropped = Counter(
            "kvxferd_notifs_dropped", "NIXL notifications that counted for nothing, by reason (malformed; sender: "
            "not the room's writer; token: without the room's token; stale: room unknown or ended; range, "
            "credit, held, writer: outside what the writer was granted)", ["reason"], registry=r,
        )
        self.page_fences = Counter(
            "kvxferd_page_fences", "Zero-copy decode rooms whose pages were fenced after a failure, by event "
            "(raised, lifted, expired: lifted after the quarantine, not by the prefill side)", ["event"], registry=r,
        )
        self.peer_batches = Counter(
            "kvxferd_peer_batches", "Batches on peer control streams", ["direction"], registry=r
        )
        self.peer_streams = Counter(
            "kvxferd_peer_streams", "Peer control streams opened, by kind (framed: the daemons' own "
            "framed stream; grpc: the Session RPC, where a peer names no framed stream or it is out of "
            "reach; local: rooms between engines of this daemon)", ["kind"], registry=r,
        )
        self.peer_messages = Counter(
            "kvxferd_peer_messages", "Messages on peer control streams", ["direction"], registry=r
        )
        # Layer parts (docs/design/layerwise.md): role prefill (event enqueued, refused, written,
        # sealed) and decode (landed, duplicate); parts_per_write shows how much merging saves.
        # Counted per part: plain integers read at scrape time (PlainCounter).
        self.layer_parts = PlainCounter(
            "kvxferd_layer_parts", "Layer parts of chunks by role and event (prefill: enqueued, refused, "
            "written, sealed; decode: landed, duplicate)", ["role", "event"], registry=r,
        )
        self.parts_per_write = PlainHistogram(
            "kvxferd_parts_per_write", "Layer parts one NIXL WRITE carries (merged adjacent parts of a room)",
            [], buckets=(1, 2, 4, 8, 16, 32, 64), registry=r,
        )
        # Caps on what callers can make the daemon hold (kvxferd.core.caps); per-caller caps report the
        # caller closest to its limit.
        self.cap_used = Gauge("kvxferd_cap_used", "Use of each cap", ["cap"], registry=r)
        self.cap_limit = Gauge("kvxferd_cap_limit", "Limit of each cap", ["cap"], registry=r)
        self.peer_auth_mode = Gauge("kvxferd_peer_auth_mode", "How peers authenticate: 1 on the mode in use "
                                    "(mtls, secret, host-secret, insecure)", ["mode"], registry=r)
        self.peer_refusals = Counter("kvxferd_peer_refusals", "Peer requests refused before touching any state",
                                     ["reason"], registry=r)
        self.peer_calls_refused = Counter(
            "kvxferd_peer_calls_refused", "gRPC peer port calls refused or cut before they authenticated "
            "(source: max_peer_calls_per_source; total: max_unauthenticated_streams; cut: an older one cut for a "
            "newcomer)", ["reason"], registry=r)
        self.peer_connections_cut = Counter(
            "kvxferd_peer_connections_cut", "gRPC peer port connections shut down that carried no authenticated call "
            "(source: max_peer_connections_per_source; total: over half the port's connection cap)", ["reason"],
            registry=r)
        # Fleet registry (etcd): 1 while this daemon's record is published and the watch runs;
        # 0 means lookups of groups not seen yet cannot succeed (transfers are unaffected).
        # Labelled so that a daemon without a registry exports no series (and raises no alert).
        self.registry_up = Gauge(
            "kvxferd_registry_up", "Registry connected and this daemon registered", ["backend"], registry=r
        )
        self.registry_daemons = Gauge("kvxferd_registry_daemons", "Daemons in the local registry cache", registry=r)
        self.registry_lookup = Histogram(
            "kvxferd_registry_lookup_seconds", "Prefill group to daemon resolution", ["result"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.registry_reconnects = Counter(
            "kvxferd_registry_reconnects", "Registry sessions re-established after a failure", registry=r
        )
        for role in ("prefill", "decode"):
            self.engines.labels(role=role).set(0)
            for state in ("BOOTSTRAPPING", "WAITING_FOR_INPUT", "TRANSFERRING", "SUCCESS", "FAILED"):
                self.rooms.labels(role=role, state=state).set(0)
        for state in ("up", "down"):
            self.peers.labels(state=state).set(0)
        for queue in ("admit", "waiting_slot", "workers"):
            self.queue_depth.labels(queue=queue).set(0)


# Scrapers use a connection or two at a time: more at once are cut on arrival, so a flood of
# idle connections (each also cut after 5 s) holds no more fds than this (issue #36).
MAX_SCRAPE_CONNECTIONS = 64


async def start_metrics_server(
    host: str, port: int, registry: CollectorRegistry
) -> tuple[asyncio.AbstractServer, int]:
    """A minimal asyncio HTTP endpoint for /metrics (no extra thread, no extra dependency)."""
    open_now: set[asyncio.StreamWriter] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(open_now) >= MAX_SCRAPE_CONNECTIONS:
            writer.transport.abort()
            return
        open_now.add(writer)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            parts = head.split(b"\r\n", 1)[0].split()
            path = parts[1].split(b"?")[0] if len(parts) >= 2 else b""
            if len(parts) < 2 or parts[0] not in (b"GET", b"HEAD"):
                status, ctype, body = b"405 Method Not Allowed", b"text/plain", b"method not allowed\n"
            elif path in (b"/metrics", b"/"):
                status, ctype, body = b"200 OK", CONTENT_TYPE_LATEST.encode(), generate_latest(registry)
            elif path == b"/healthz":
                status, ctype, body = b"200 OK", b"text/plain", b"ok\n"
            else:
                status, ctype, body = b"404 Not Found", b"text/plain", b"not found\n"
            writer.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                + (body if parts and parts[0] != b"HEAD" else b"")
            )
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            open_now.discard(writer)
            writer.close()

    server = await asyncio.start_server(handle, host, port)
    bound = server.sockets[0].getsockname()[1]
    return server, bound
