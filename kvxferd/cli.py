"""`kvxferd` command line: serve, status, bench, --version."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from kvxferd import __version__

_BENCHES = ("loopback", "rpc", "kernels", "soak")


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
    return run(config, ready_file=args.ready_file)


def _status(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from kvxfer_client._pb.kvxfer.v1 import engine_pb2, engine_pb2_grpc
    from kvxferd.config import _default_socket

    path = args.socket or os.environ.get("KVXFERD_SOCKET") or _default_socket()
    target = path if ":" in path and not path.startswith("/") else f"unix:{path}"
    try:
        with grpc.insecure_channel(target) as ch:
            st = engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"kvxferd: error: cannot reach the daemon at {path}: {exc.code().name}: {exc.details()}",
              file=sys.stderr)
        return 1
    data = MessageToDict(st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
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
    head.add_row("host pool", f"{st.pool_bytes / 2**20:.0f} MiB")
    head.add_row("slots held", str(st.slots_held))
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
    peers = Table(title="peers")
    for col in ("daemon", "address", "state", "active rooms"):
        peers.add_column(col)
    for p in st.peers:
        peers.add_row(p.daemon_id, p.address, p.state, str(p.rooms))
    con.print(peers)
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
    st.add_argument("--socket", help="daemon socket path (or KVXFERD_SOCKET)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--timeout", type=float, default=5.0)
    b = sub.add_parser("bench", help="benchmarks; `kvxferd bench NAME --help`")
    b.add_argument("which", choices=_BENCHES)
    args, rest = parser.parse_known_args(argv)
    if args.cmd != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "serve":
        return _serve(args)
    if args.cmd == "status":
        return _status(args)
    return _bench(args, rest)


if __name__ == "__main__":
    sys.exit(main())
