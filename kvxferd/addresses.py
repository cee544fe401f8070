"""HOST:PORT strings as config and peers give them, and the source a gRPC call came from."""

from __future__ import annotations

import ipaddress

# A caller with an IPv6 address usually has its whole /64: per-source bounds count that, not one address.
_V6_SOURCE_PREFIX = 64


def split_hostport(address: str) -> tuple[str, int]:
    """HOST:PORT as (host, port) for a socket call: an IPv6 host loses its brackets."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def valid_hostport(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        return False
    # An IPv6 host must be bracketed; "1.2.3.4:5:6" would otherwise go to a resolver as a name.
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return False
    return 0 <= int(port) <= 65535


def call_source(peer: str) -> str:
    """Who a gRPC call came from, for per-source bounds: the IP of grpc's context.peer()
    ("ipv4:10.0.0.1:5000", "ipv6:[::1]:5000"; an IPv4-mapped IPv6 address is its IPv4 one, other
    IPv6 addresses count by /64), or the transport alone ("unix", a Unix socket's callers)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return kind
    host = rest.rpartition(":")[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, _V6_SOURCE_PREFIX), strict=False))
    return str(ip)
