"""Write docs/config.md, the full configuration reference, from kvxferd/config.py.

Run: python scripts/gen_config_doc.py [--out FILE]
Every key is a field of `kvxferd.config.Config`: its default and type come from the dataclass, its
description from the comment block directly above the field, then from NOTES below (what the
README's table said, for users) where there is one. tests/test_config_doc.py fails when the file
is stale or a field has neither.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG_PY = ROOT / "kvxferd" / "config.py"
DEFAULT_OUT = ROOT / "docs" / "config.md"

# TOML tables whose keys are `<table>_<key>` fields (kvxferd.config._SECTIONS).
SECTIONS = ("registry",)

# `kvxferd serve` flags that set a key (kvxferd/cli.py; tests/test_config_doc.py checks they exist).
FLAGS = {
    "socket": "--socket", "listen": "--listen", "metrics_port": "--metrics-port", "peer_listen": "--peer-listen",
    "host_pool_bytes": "--host-pool-bytes", "daemon_id": "--daemon-id", "log_format": "--log-format",
    "log_level": "--log-level",
}

# Defaults that depend on the machine the doc is generated on: said in words.
DEFAULT_WORDS = {
    "socket": "`$XDG_RUNTIME_DIR/kvxferd/kvxferd.sock`, else `/tmp/kvxferd-$UID/kvxferd.sock`",
}

# For users, beyond the code's comment (moved here from the README's configuration table).
NOTES = {
    "socket": "An engine started by the same user finds the default path with no setting; a second daemon "
              "on one host needs its own.",
    "socket_mode": "Who may connect to the engine socket (and map the host pool, which gets the same mode). "
                   "Octal, e.g. `0o660` with `socket_group`.",
    "socket_group": "Group given the socket and the host pool, with `socket_mode = 0o660`.",
    "listen": "Engine API on TCP `HOST:PORT`, TLS if `tls_*` are set.",
    "peer_listen": "Set a routable address on real fleets (peers then must authenticate: mTLS or "
                   "`peer_secret_file`).",
    "peer_stream_port": "A message on it costs a few µs of CPU where the gRPC `Session` stream cost ~85 µs. "
                        "Set a fixed port (e.g. 7472) where firewalls need it. A peer that serves none, or "
                        "whose port is out of reach, is spoken to over the gRPC `Session` stream "
                        "(`kvxferd_peer_streams_total{kind}` counts both).",
    "daemon_id": "Stable name among peers; default `hostname:peer_port`. Hosts cloned with one host name "
                 "need one each (else the second is refused: \"another daemon uses our daemon_id\").",
    "metrics_host": "Address of the Prometheus `/metrics` listener.",
    "metrics_port": "Prometheus `/metrics` port.",
    "host_pool_bytes": "Shared-memory host pool (rings of host-path engines are carved from it). Checked at "
                       "start, before anything is allocated, against MemAvailable and the tightest cgroup v2 "
                       "`memory.max` above the daemon (less what it holds and 128 MiB for the daemon; on "
                       "hugetlbfs against the free huge pages): a pool that does not fit stops the daemon "
                       "with one line naming the limit and exit 2, not an OOM kill with an empty log.",
    "shm_dir": "Where the pool lives when `pool_backing` is `shm_dir` (or `auto` finds no private huge-page "
               "tmpfs); a hugetlbfs mount (e.g. `/dev/hugepages` with `vm.nr_hugepages` reserved, or a "
               "Kubernetes `emptyDir: {medium: HugePages}`) backs the pool with huge pages.",
    "pool_backing": "`auto`: the pool is an unnamed file on a private tmpfs mounted `huge=always` (made by a "
                    "short-lived helper in a mount namespace of its own; a user namespace when not "
                    "privileged), handed to engines as a file descriptor over `<socket>.pool`; on 2 MiB pages "
                    "it halves the CPU of every NIXL WRITE into it on one host, and nothing is left behind "
                    "however the daemon dies.",
    "prefault_pool": "The first WRITE into a page otherwise pays for zeroing it inside the copy.",
    "engine_lane": "About 25 µs of CPU a side per call against 280-430 µs for gRPC.",
    "workers": "A WRITE goes to the least busy thread, so the copies of one peer (and of one room) run in "
               "parallel.",
    "merge_writes": "Up to 8 WRITEs and `merge_max_bytes`; nothing is held back to be merged. Measured on 16 "
                    "cores: TP 4→2 +40 % at 5 MiB chunks and +11 % at 20 MiB, same TP and 1→4 unchanged.",
    "merge_max_bytes": "1 MiB to 1 GiB. A smaller value hands a merged WRITE's first slot back sooner.",
    "nixl_progress_thread": "NIXL/UCX progress thread (polling measured faster on 2 cores; the thread doubled "
                            "the daemons' CPU).",
    "heartbeat_interval_s": "Peer liveness: rooms fail after `heartbeat_misses x heartbeat_interval_s` of "
                            "silence (a newly dialed stream: 5 s, or that if longer, until the peer's first "
                            "word; a handshake that no stream follows within that time is a loss too; a peer "
                            "that states a longer interval in its handshake gets `misses x` its own).",
    "heartbeat_misses": "See `heartbeat_interval_s`.",
    "slow_peer_limit_s": "Set it above the longest stall to ride out; a refused or unanswered connect "
                         "(process gone, path cut) is lost at the heartbeat limit as before.",
    "engine_lease_s": "An engine that stops renewing is dead: its rooms fail, its ring is released.",
    "room_deadline_s": "Default room deadline (ExpectRoom can set its own).",
    "drain_grace_s": "SIGTERM: time given to in-flight rooms before they fail with SHUTDOWN.",
    "max_message_bytes": "gRPC request size limit (at most gRPC's int32 limit).",
    "max_engines": "Engine ranks registered at once (a restarted rank re-registering its group and rank is "
                   "always let in).",
    "max_rooms_per_engine": "Rooms one engine rank takes part in until it releases them (or they are "
                            "collected 60 s after finishing).",
    "max_rooms_per_peer": "Rooms whose other side is one peer daemon, both roles (decode: by the "
                          "`prefill_address` named; prefill: by the bootstrapping daemon's address).",
    "max_open_streams": "Server streams open on the engine API (WatchRooms, EnqueueStream), counted from the "
                        "moment they open.",
    "max_watchers_per_engine": "WatchRooms streams of one engine.",
    "max_streams_per_engine": "EnqueueStream streams that named one engine.",
    "max_watch_backlog": "Events queued for one WatchRooms reader that does not read: past it that stream "
                         "ends (`RESOURCE_EXHAUSTED`), nothing else does.",
    "log_level": "Structured logs on stderr.",
    "log_format": "`json` or `text`.",
    "peers": "Static peer list (`HOST:PORT`), heartbeated from start.",
    "tls_cert": "TLS for the TCP listeners (peer service, engine `listen`) and the daemon's own peer "
                "channels.",
    "tls_key": "The private key of `tls_cert`.",
    "tls_ca": "CA that signs peers' (and, with `tls_client_auth`, clients') certificates.",
    "tls_client_auth": "Mutual TLS: a peer's certificate must name its `daemon_id` (URI SAN "
                       "`kvxferd://daemon/<id>`, else the subject CN).",
    "peer_secret_file": "At least 16 bytes; the file must not be group/world accessible. The secret is never "
                        "logged.",
    "peer_secret_overlap_s": "How long the previous secret is still accepted after `peer_secret_file` "
                             "changes.",
    "insecure_peers": "Warned at every start.",
    "max_peers": "Peer daemons known at once (see docs/registry.md for the memory per peer).",
    "max_pending_handshakes": "Handshakes being processed at once (`RESOURCE_EXHAUSTED` beyond).",
    "max_peer_metadata_bytes": "NIXL metadata a peer may send in a handshake.",
    "max_peer_batch_msgs": "Messages in one peer batch (bytes per batch: `max_message_bytes`).",
    "max_unauthenticated_streams": "See `max_peer_connections`.",
    "registry_backend": "With `etcd`, a decode engine may name only the prefill group: "
                        "`rx.expect(42, \"\", \"llama70b-prefill\", num_tokens)`.",
    "registry_endpoints": "etcd endpoints to use (`HOST:PORT`).",
    "registry_prefix": "etcd key prefix.",
    "registry_timeout_s": "Per-call timeout to etcd.",
    "registry_tls_ca": "TLS to etcd: CA.",
    "registry_tls_cert": "TLS to etcd: client certificate.",
    "registry_tls_key": "TLS to etcd: client key.",
    "registry_node_name": "Node shown in the fleet (`kvxferd status --fleet`); default the host name.",
    "data_path": "Followed by clients given `kv_device=` (`GetStatus.gpu_data_path`). `auto` is `vram` only "
                 "with GPUDirect RDMA: an RDMA device, `nvidia_peermem` and UCX's CUDA transport.",
}


def field_comments(source: str) -> dict[str, str]:
    """The comment block directly above each field of `class Config`, joined into one paragraph."""
    lines = source.splitlines()
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    out: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        block: list[str] = []
        i = node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            block.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        out[node.target.id] = " ".join(block)
    return out


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _default(name: str, value: Any) -> str:
    if name in DEFAULT_WORDS:
        return DEFAULT_WORDS[name]
    if name == "socket_mode":
        return f"`0o{value:o}`"
    if name.endswith("_bytes") and isinstance(value, int):
        return f"`{_size(value)}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return "`[]`" if not value else f"`{list(value)}`"
    if value == "":
        return "unset"
    return f"`{value}`"


def _where(name: str) -> str:
    table = next((s for s in SECTIONS if name.startswith(s + "_")), None)
    toml = f"`[{table}] {name[len(table) + 1:]}`" if table else f"`{name}`"
    parts = [f"TOML {toml}", f"env `KVXFERD_{name.upper()}`"]
    if name in FLAGS:
        parts.append(f"flag `{FLAGS[name]}`")
    parts.append(f"`--set {name}=…`")
    return " · ".join(parts)


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from kvxferd.config import Config

    comments = field_comments(CONFIG_PY.read_text())
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen_config_doc.py from kvxferd/config.py; do not edit by hand "
        "(tests/test_config_doc.py fails when this file is stale). -->",
        "",
        "One TOML file (`--config` / `KVXFERD_CONFIG`), `KVXFERD_<KEY>` environment variables and flags "
        "(`--set KEY=VALUE` for any key), in increasing precedence; validated once at start: an unknown key "
        "or a bad value stops the daemon with one clear line and exit code 2. Sizes (`*_bytes`) take "
        "`268435456` or `\"256MiB\"`. Keys of a TOML table (`[registry] backend`) are `<table>_<key>` in the "
        "environment and `--set` (`KVXFERD_REGISTRY_BACKEND`, `--set registry_backend=etcd`).",
        "",
        "| key | default |",
        "| --- | --- |",
    ]
    for f in fields(Config):
        value = f.default if f.default is not MISSING else None
        out.append(f"| [`{f.name}`](#{f.name}) | {_default(f.name, value)} |")
    out.append("")
    for f in fields(Config):
        value = f.default if f.default is not MISSING else None
        typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        text = " ".join(t for t in (comments.get(f.name, ""), NOTES.get(f.name, "")) if t)
        out += [f"## {f.name}", "", f"`{typ}`, default {_default(f.name, value)}. {_where(f.name)}", "",
                text or "(undocumented)", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    args.out.write_text(render())
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
