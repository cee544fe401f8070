"""Peer-side caps: what one peer (or a crowd of would-be peers) may make this daemon hold.

Each cap is refused with CapExceeded (gRPC RESOURCE_EXHAUSTED) naming it, before the request
touches any state, so a caller that hits one changes nothing for anyone else. Every cap's use and
limit is in GetStatus (`peer_caps`) and in the kvxferd_cap_used / kvxferd_cap_limit gauges. For
per-request caps (metadata, batch size) "used" is the largest request accepted so far.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvxferd.config import Config
from kvxferd.core.caps import CapUsage
from kvxferd.errors import CapExceeded
from kvxferd.ops.metrics import Metrics

PEERS = "peers"
PEER_ADDRESSES = "peer_addresses"
PENDING_HANDSHAKES = "pending_handshakes"
PEER_METADATA_BYTES = "peer_metadata_bytes"
PEER_BATCH_MSGS = "peer_batch_msgs"


@dataclass(frozen=True)
class PeerStatus:
    """The peer side as `kvxferd status` shows it."""

    auth_mode: str
    caps: tuple[CapUsage, ...]


class PeerLimits:
    def __init__(self, config: Config, metrics: Metrics, peers: Callable[[], int], addresses: Callable[[], int],
                 static_addresses: int) -> None:
        self._limits = {
            PEERS: config.max_peers,
            # A daemon may be known under a few addresses (dialed, advertised), static peers on top.
            PEER_ADDRESSES: 2 * config.max_peers + static_addresses,
            PENDING_HANDSHAKES: config.max_pending_handshakes,
            PEER_METADATA_BYTES: config.max_peer_metadata_bytes,
            PEER_BATCH_MSGS: config.max_peer_batch_msgs,
        }
        self._used: dict[str, Callable[[], int]] = {
            PEERS: peers, PEER_ADDRESSES: addresses, PENDING_HANDSHAKES: lambda: self._pending,
            PEER_METADATA_BYTES: lambda: self._high[PEER_METADATA_BYTES],
            PEER_BATCH_MSGS: lambda: self._high[PEER_BATCH_MSGS],
        }
        self._pending = 0
        self._high = {PEER_METADATA_BYTES: 0, PEER_BATCH_MSGS: 0}
        for name, limit in self._limits.items():
            metrics.cap_limit.labels(cap=name).set(limit)
            metrics.cap_used.labels(cap=name).set_function(self._used[name])

    def usage(self) -> tuple[CapUsage, ...]:
        return tuple(CapUsage(name, self._used[name](), limit) for name, limit in self._limits.items())

    def _refuse(self, name: str, want: int) -> CapExceeded:
        return CapExceeded(f"cap {name} reached: {want} > limit {self._limits[name]}")

    @contextlib.contextmanager
    def handshake(self) -> Iterator[None]:
        """One incoming handshake in progress (loading NIXL metadata is the costly part)."""
        if self._pending >= self._limits[PENDING_HANDSHAKES]:
            raise self._refuse(PENDING_HANDSHAKES, self._pending + 1)
        self._pending += 1
        try:
            yield
        finally:
            self._pending -= 1

    def new_peer(self, adds_peer: bool, adds_address: bool) -> None:
        """Before a handshake adds a daemon id or an address to the peer table."""
        if adds_peer and self._used[PEERS]() >= self._limits[PEERS]:
            raise self._refuse(PEERS, self._used[PEERS]() + 1)
        if adds_address and self._used[PEER_ADDRESSES]() >= self._limits[PEER_ADDRESSES]:
            raise self._refuse(PEER_ADDRESSES, self._used[PEER_ADDRESSES]() + 1)

    def metadata(self, nbytes: int) -> None:
        self._sized(PEER_METADATA_BYTES, nbytes)

    def batch(self, msgs: int) -> None:
        self._sized(PEER_BATCH_MSGS, msgs)

    def _sized(self, name: str, n: int) -> None:
        if n > self._limits[name]:
            raise self._refuse(name, n)
        if n > self._high[name]:
            self._high[name] = n
