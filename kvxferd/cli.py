"""`kvxferd` command line: serve, status, bench, --version."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from kvxferd import __version__

_BENCHES = ("loopback", "rpc", "kernels", "soak", "engines")


def _serve(args: argparse.Namespace) -> int:
    from kvxferd.app import run
    from kvxferd.config import ConfigError, load_config

    overrides: dict[str, Any] = {
        "socket": args.socket, "listen": args.listen, "metrics_port": args.metrics_port,
        "peer_listen": args.peer_listen, "host_pool_bytes": args.host_pool_bytes, "daemon_id": args.daemon_id,
        "log_format": args.log_format, "log_level": args.log_level,
    }
    for item in args.set or ():
        key, sep, value = item.partition("=")
        if not sep:
            print(f"kvxferd: error: --set expects KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        overrides[key.strip()] = value
    try:
        config = load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"kvxferd: error: bad configuration: {exc}", file=sys.stderr)
        return 2
    clash = _port_in_use(config)
    if clash:
        print(f"kvxferd: error: {clash}", file=sys.stderr)
        return 2
    return run(config, ready_file=args.ready_file)


def _port_in_use(config: Any) -> str | None:
    """A fixed port of ours that another process already listens on, said once and before anything
    starts: found later, gRPC's own log line would print beside ours, after NIXL and the pool."""
    import errno
    import socket

    from kvxferd.ops.owned_files import ephemeral_port_note

    peer_host = config.peer_listen.rpartition(":")[0]
    wanted = [("peer service (peer_listen)", config.peer_listen),
              ("peer control stream (peer_stream_port)", f"{peer_host}:{config.peer_stream_port}"),
              ("metrics (metrics_port)", f"{config.metrics_host}:{config.metrics_port}"),
              ("engine TCP listener (listen)", config.listen)]
    for what, address in wanted:
        host, _, port = address.rpartition(":")
        if not port.isdigit() or int(port) == 0:
            continue  # off (-1, unset) or ephemeral: nothing to clash with
        try:
            infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM)
        except OSError:
            continue  # the daemon's own start-up names an unresolvable host
        family, kind, proto, _, addr = infos[0]
        with socket.socket(family, kind, proto) as probe:
            # SO_REUSEADDR: a port left in TIME_WAIT is free to listen on; only a live listener clashes.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    continue
                # A port in the ephemeral range may be held by any outgoing connection: say so too.
                hint = ephemeral_port_note(address)
                return (f"{address} for the {what} is already in use by another process (another kvxferd? "
                        "a second daemon on one host needs its own --socket, --peer-listen and --metrics-port, "
                        "and its own peer_stream_port where that is fixed)" + (f"; {hint}" if hint else ""))
    return None


def _registry_state(ch: Any, timeout: float) -> str:
    """The daemon's view of the fleet registry, from its health service (off when not configured)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvxferd.fleet.registry import REGISTRY_HEALTH

    try:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=REGISTRY_HEALTH),
                                                     timeout=timeout)
    except grpc.RpcError as exc:
        return "off" if exc.code() == grpc.StatusCode.NOT_FOUND else f"unknown ({exc.code().name})"
    return "up" if reply.status == health_pb2.HealthCheckResponse.SERVING else "DEGRADED (etcd unreachable)"


def _is_peer_port(path: str, tls: Any, timeout: float) -> bool:
    """Whether the server at `path` serves the peer service: its health service knows it."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvxfer_client._channel import sync_channel

    try:
        with sync_channel(path, tls) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kvxfer.v1.Peer"),
                                                 timeout=timeout)
    except (grpc.RpcError, ValueError, OSError):
        return False
    return True


def _fleet(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from kvxferd.config import ConfigError, load_config
    from kvxferd.fleet.etcd import RegistryUnavailable, read_fleet

    overrides: dict[str, Any] = {"registry_backend": "etcd"}
    if args.endpoints:
        overrides["registry_endpoints"] = args.endpoints
    try:
        config = load_config(args.config, overrides=overrides)
        fleet = asyncio.run(read_fleet(config))
    except (ConfigError, RegistryUnavailable) as exc:
        print(f"kvxferd: error: {exc}", file=sys.stderr)
        return 1
    now = time.time()
    if args.json:
        out = [{**rec.__dict__, "groups": [g.__dict__ for g in rec.groups], "age_s": round(now - rec.started_unix, 1),
                "lease_ttl_s": ttl} for rec, ttl in fleet]
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fleet: {len(fleet)} daemon(s) in {config.registry_prefix} on {','.join(config.registry_endpoints)}")
    for col in ("daemon", "instance", "address", "node", "version", "age", "lease", "groups (role tp ranks)"):
        table.add_column(col)
    for rec, ttl in fleet:
        groups = "\n".join(f"{g.group} {g.role} tp{g.tp_size} {','.join(map(str, g.ranks))}" for g in rec.groups)
        table.add_row(rec.daemon_id, rec.instance_id, rec.address, rec.node, rec.version,
                      f"{now - rec.started_unix:.0f} s", f"{ttl} s", groups or "-")
    Console().print(table)
    return 0


def _status(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from kvxfer_client._channel import Tls, sync_channel
    from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2, engine_pb2_grpc
    from kvxferd.config import _default_socket

    path = args.socket or os.environ.get("KVXFERD_SOCKET") or _default_socket()
    if args.fleet:
        return _fleet(args)
    try:
        tls = Tls(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, server_name=args.tls_server_name) \
            if (args.tls_ca or args.tls_cert or args.tls_key) else None
        channel = sync_channel(path, tls)
    except (ValueError, OSError) as exc:
        print(f"kvxferd: error: {exc}", file=sys.stderr)
        return 2
    try:
        with channel as ch:
            st = engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=args.timeout)
            registry = _registry_state(ch, args.timeout)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED and _is_peer_port(path, tls, args.timeout):
            print(f"kvxferd: error: {path} is a kvxferd peer port (daemon to daemon), not the engine API; "
                  "the engine API is the daemon's Unix socket on its own host (run `kvxferd status` there, "
                  "or --socket PATH), or its `listen` HOST:PORT where that is set", file=sys.stderr)
            return 2
        print(f"kvxferd: error: cannot reach the daemon at {path}: {exc.code().name}: {exc.details()}",
              file=sys.stderr)
        return 1
    data = MessageToDict(st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    data["registry"] = registry
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    head = Table(title=f"kvxferd {st.version} — {st.daemon_id}", show_header=False)
    head.add_row("serving", "yes" if st.serving else "NO (draining)")
    head.add_row("peer address", st.peer_address)
    head.add_row("uptime", f"{st.uptime_s:.0f} s")
    head.add_row("host pool", f"{st.pool_bytes / 2**20:.0f} MiB, {st.pool_backing or '?'}"
                 f" ({st.pool_huge_bytes / 2**20:.0f} MiB on huge pages so far)")
    head.add_row("slots held", str(st.slots_held))
    head.add_row("fleet registry", registry)
    head.add_row("peer auth", st.peer_auth)
    con.print(head)
    rooms = Table(title="rooms by state")
    rooms.add_column("state")
    rooms.add_column("rooms", justify="right")
    for state, n in sorted(st.rooms_by_state.items()):
        rooms.add_row(state, str(n))
    con.print(rooms)
    eng = Table(title="engines and rings")
    for col in ("engine", "name", "role", "group", "tp", "ring", "used / size", "slots"):
        eng.add_column(col)
    for e in st.engines:
        eng.add_row(
            e.engine_id[:12], e.name, engine_pb2.Role.Name(e.role).removeprefix("ROLE_").lower(), e.group,
            f"{e.parallel.tp_rank}/{e.parallel.tp_size}", e.ring_kind,
            f"{e.ring_used_bytes / 2**20:.1f} / {e.ring_bytes / 2**20:.1f} MiB", str(e.slots_held),
        )
    con.print(eng)
    caps = Table(title="caps (per-caller caps: the caller closest to its limit)")
    for col in ("cap", "used", "limit"):
        caps.add_column(col, justify="left" if col == "cap" else "right")
    for c in st.caps:
        caps.add_row(c.name, str(c.used), str(c.limit), style="bold red" if c.used >= c.limit else None)
    con.print(caps)
    peers = Table(title="peers")
    for col in ("daemon", "address", "state", "active rooms", "path"):
        peers.add_column(col)
    for p in st.peers:
        peers.add_row(p.daemon_id, p.address, p.state, str(p.rooms), p.path)
    con.print(peers)
    for line in st.gpu_links:
        con.print(f"same-node GPU copies: {line}")
    caps = Table(title="peer caps")
    for col in ("cap", "used", "limit"):
        caps.add_column(col, justify="left" if col == "cap" else "right")
    for c in st.peer_caps:
        caps.add_row(c.name, str(c.used), str(c.limit))
    con.print(caps)
    return 0


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    mod = importlib.import_module(f"kvxferd.bench.{args.which}")
    return int(mod.main(rest))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvxferd", description="KV-cache transfer daemon for PD-disaggregated LLM serving")
    parser.add_argument("--version", action="version", version=f"kvxferd {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", help="TOML file (or KVXFERD_CONFIG)")
    s.add_argument("--socket", help="engine API Unix socket path (KVXFERD_SOCKET)")
    s.add_argument("--listen", help="engine API TCP HOST:PORT, off by default (KVXFERD_LISTEN)")
    s.add_argument("--metrics-port", type=int, help="Prometheus port; 0 = ephemeral, -1 = off (KVXFERD_METRICS_PORT)")
    s.add_argument("--peer-listen", help="peer service HOST:PORT (KVXFERD_PEER_LISTEN)")
    s.add_argument("--host-pool-bytes", help="host pool size, e.g. 1GiB (KVXFERD_HOST_POOL_BYTES)")
    s.add_argument("--daemon-id", help="stable name of this daemon among its peers")
    s.add_argument("--log-format", choices=("json", "text"))
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="any config key (repeatable)")
    s.add_argument("--ready-file", help="write {socket, peer_address, metrics_port, ...} as JSON once serving")
    st = sub.add_parser("status", help="print the daemon's view: engines, rings, peers, rooms")
    st.add_argument("--socket", help="daemon socket path, or HOST:PORT of its TCP engine listener (or KVXFERD_SOCKET)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--timeout", type=float, default=5.0)
    st.add_argument("--tls-ca", help="with --socket HOST:PORT (a TCP engine listener): CA file that signed the daemon's certificate")
    st.add_argument("--tls-cert", help="client certificate file, for a daemon with tls_client_auth (mutual TLS)")
    st.add_argument("--tls-key", help="the client certificate's private key file")
    st.add_argument("--tls-server-name", default="", help="name to check in the daemon's certificate (default: the host)")
    st.add_argument("--fleet", action="store_true",
                    help="daemons, groups, instance ids and ages from the fleet registry (etcd)")
    st.add_argument("--config", help="with --fleet: TOML file with the [registry] table (or KVXFERD_CONFIG)")
    st.add_argument("--endpoints", help="with --fleet: etcd HOST:PORT[,HOST:PORT] (or KVXFERD_REGISTRY_ENDPOINTS)")
    # No help of its own: `kvxferd bench NAME --help` must reach NAME's parser (its options), so
    # -h is taken here only to pass it on, or to print this usage when no NAME is given.
    b = sub.add_parser("bench", help="benchmarks; `kvxferd bench NAME --help`", add_help=False,
                       usage=f"kvxferd bench {{{','.join(_BENCHES)}}} [--help] [OPTIONS]")
    b.add_argument("which", nargs="?", choices=_BENCHES, help="the benchmark; `kvxferd bench NAME --help` lists its options")
    b.add_argument("-h", "--help", action="store_true", dest="bench_help")
    args, rest = parser.parse_known_args(argv)
    if args.cmd != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "serve":
        return _serve(args)
    if args.cmd == "status":
        return _status(args)
    if args.which is None:
        b.print_help()
        return 0 if args.bench_help else 2
    return _bench(args, [*rest, "--help"] if args.bench_help else rest)


if __name__ == "__main__":
    sys.exit(main())
