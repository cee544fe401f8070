"""etcd plumbing of the fleet registry shared by the daemon's session (`registry_etcd`) and
`kvxferd status --fleet`: the channel, the key layout, and a one-shot read of the fleet."""

from __future__ import annotations

from pathlib import Path

import grpc
from aetcd import rpc

from kvxferd.config import Config
from kvxferd.fleet.registry import DaemonRecord

# etcd refuses pings more often than --grpc-keepalive-min-time (5 s by default) with a
# too_many_pings GOAWAY, which ends the session; twice that leaves room for timer slop. A dead
# etcd is found sooner by the lease keep-alive (answer within timeout_s, every TTL / 3).
ETCD_MIN_PING_S = 5.0
KEEPALIVE_PING_MS = int(2 * ETCD_MIN_PING_S * 1000)


class RegistryUnavailable(RuntimeError):
    """etcd could not be reached and the config says the registry is required."""


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
    # Keep-alive pings let a half-open TCP connection to a partitioned etcd fail, within the server's minimum.
    opts = [("grpc.keepalive_time_ms", KEEPALIVE_PING_MS), ("grpc.keepalive_timeout_ms", 5000),
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
