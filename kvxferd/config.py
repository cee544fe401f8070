"""Daemon configuration: one TOML file, KVXFERD_* environment variables, flags.

Precedence: flags > environment > file > defaults. Everything is validated once,
at start, and a bad value stops the daemon with one clear line.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomllib

from kvxferd.addresses import split_hostport as split_hostport
from kvxferd.addresses import valid_hostport as _valid_hostport
from kvxferd.ops.owned_files import check_dir


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def _default_socket() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return str(Path(runtime) / "kvxferd" / "kvxferd.sock")
    return f"/tmp/kvxferd-{os.getuid()}/kvxferd.sock"


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.I)
_SIZE_MULT = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as "256MiB" / "1G"."""
    if isinstance(value, bool):
        raise ConfigError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ConfigError(f"expected a size like 268435456 or '256MiB', got {value!r}")
    unit = (m.group(2) or "").upper()[:1]
    return int(m.group(1)) * _SIZE_MULT[unit]


# Messages per PeerBatch: a sender splits its backlog at this many, a receiver refuses more than its
# `max_peer_batch_msgs` (never below this, or it would refuse well-behaved peers).
PEER_BATCH_MSGS = 4096
# Shortest shared peer secret accepted (bytes, surrounding whitespace removed).
MIN_SECRET_BYTES = 16
PEER_AUTH_MODES = ("mtls", "secret", "host-secret", "insecure")
POOL_BACKINGS = ("auto", "private", "shm_dir", "huge_dir")


def loopback_listen(hostport: str) -> bool:
    """True if HOST:PORT binds a loopback address only (nothing off this host can connect)."""
    host = hostport.rpartition(":")[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_secret_file(path: str) -> bytes:
    """The shared peer secret; refused if anyone but the owner may access the file."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"peer_secret_file {path!r} is not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(f"peer_secret_file {path!r} is accessible by group or others "
                              f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
        with open(path, "rb") as fh:
            secret = fh.read(64 << 10).strip()
    except OSError as exc:
        raise ConfigError(f"peer_secret_file {path!r} cannot be read: {exc.strerror}") from exc
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"peer_secret_file {path!r} holds fewer than {MIN_SECRET_BYTES} bytes")
    return secret


@dataclass(frozen=True)
class Config:
    # Engine API on a Unix socket; mode and group let engine users in.
    socket: str = field(default_factory=_default_socket)
    socket_mode: int = 0o600
    socket_group: str = ""
    # Optional engine API on TCP ("host:port"); off by default.
    listen: str = ""
    # Daemon-to-daemon peer service.
    peer_listen: str = "127.0.0.1:7471"
    # Address peers use to reach us; defaults to the bound peer address.
    advertise_address: str = ""
    # The framed control stream between daemons (kvxferd.peer.wire), on peer_listen's host:
    # -1 off (the gRPC Session stream only), 0 a free port, else that port.
    peer_stream_port: int = 0
    daemon_id: str = ""
    metrics_host: str = "127.0.0.1"
    # 0 = ephemeral port, -1 = no metrics listener.
    metrics_port: int = 9479
    host_pool_bytes: int = 256 << 20
    shm_dir: str = "/dev/shm"
    # "auto": a private huge-page tmpfs handed to engines by fd, else a file in shm_dir (warned);
    # "private": that or no start; "shm_dir": always a named file in shm_dir (kvxferd.buffers.host_pool);
    # "huge_dir": a file in huge_dir or no start. "auto" tries huge_dir first when it is set.
    pool_backing: str = "auto"
    # A hugetlbfs (or huge= tmpfs) the platform mounted for the daemon (/dev/hugepages/kvxferd,
    # a Kubernetes HugePages emptyDir): huge pages without unshare or any capability; the pool
    # file is handed to engines by fd, so they need no part of the mount (kvxferd.buffers.host_pool).
    huge_dir: str = ""
    # Serve the engine API's unary calls on <socket>.lane too (kvxferd.engine_api.lane): same calls, a
    # fraction of gRPC's CPU per call; engines use it when the registration reply names it.
    engine_lane: bool = True
    # Make the whole pool resident at start (kvxferd.buffers.host_pool.HostPool.prefault).
    prefault_pool: bool = True
    # Transfer threads, each with its own UCX worker (kvxferd.datapath.workers); over CMA each copies at about one
    # core's speed (16 cores, loopback: 4/6/8/12 gave 13/22/23/32 GB/s). 0: half the CPUs this process
    # may use, 2 to 8: the rest stays with engines and the daemon's loop; idle workers cost nothing.
    workers: int = 0
    # WRITEs of one room queued behind a busy transfer thread go as one (kvxferd.datapath.workers): one
    # post and one notification for several small parts. Off: each chunk is its own WRITE.
    merge_writes: bool = True
    # ... up to this many bytes in one WRITE: its fixed cost (post, completion, notification on both
    # daemons) is shared by its parts, while a bigger one holds its first part's slot until the copies
    # behind it are done. 64 MiB lets three 20 MiB chunks go as one; against 16 MiB, interleaved on
    # the 2-core VM: CPU per GB 1.44-1.49x raw NIXL vs 1.54-1.64x, throughput 1.10-1.18x vs
    # 1.02-1.14x; neutral on 16 cores (bench/results/merge-bytes-ab-*.json).
    merge_max_bytes: int = 64 << 20
    # A reader ring is granted to a prefill daemon in windows of ring_size / credit_split bytes
    # (more windows on demand): 1 gives one peer the whole ring at once, larger values share a
    # decode engine's ring more evenly among many prefill daemons.
    credit_split: int = 4
    nixl_progress_thread: bool = False
    heartbeat_interval_s: float = 1.0
    heartbeat_misses: int = 2
    # A silent peer whose port still accepts connections (a stopped or stalled daemon, not a dead
    # one) is lost only after this much silence, never less than twice the heartbeat limit (0 asks
    # for that floor): rooms with a stalled peer wait and fail at their own deadlines meanwhile, so
    # a 20 s stop of either daemon (issue #40) costs no room that could wait. A wedged daemon that
    # holds its port but never speaks costs this long before its peers give it up.
    slow_peer_limit_s: float = 30.0
    engine_lease_s: float = 10.0
    room_deadline_s: float = 120.0
    drain_grace_s: float = 20.0
    max_message_bytes: int = 4 << 20
    # Caps on what callers can make the daemon hold (kvxferd.core.caps): a caller at a cap is refused
    # with RESOURCE_EXHAUSTED naming it; nothing is evicted for it.
    max_engines: int = 256
    max_rooms_per_engine: int = 8192
    max_rooms_per_peer: int = 32768
    max_open_streams: int = 1024
    max_watchers_per_engine: int = 16
    max_streams_per_engine: int = 16
    max_watch_backlog: int = 65536
    # Aborts of rooms we did not have yet; oldest evicted first (refusing a peer's abort makes no sense).
    max_tombstones: int = 65536
    log_level: str = "info"
    log_format: str = "json"
    peers: tuple[str, ...] = ()
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_client_auth: bool = False
    # Peer authentication without mTLS: a file (mode 0600) holding a secret shared by the fleet.
    # Re-read when it changes; the previous secret is still accepted for peer_secret_overlap_s.
    peer_secret_file: str = ""
    peer_secret_overlap_s: float = 120.0
    # The default peer proof, this uid's host secret (kvxferd/peer/host_secret.py); "" = ~/.kvxferd/host-secret.
    host_secret_file: str = ""
    # Allow unauthenticated peers (no mTLS, no secret), on loopback too: an explicit opt-in.
    insecure_peers: bool = False
    # Peer-side caps: refused with RESOURCE_EXHAUSTED, shown in status and kvxferd_cap_* metrics.
    # 2,048: every daemon of a 1,000-node prefill/decode mesh, twice (ids that left linger until
    # peer_forget_s); an idle peer costs ~55 KiB (docs/registry.md), so ~110 MiB at the cap.
    max_peers: int = 2048
    # A peer down this long, not in `peers`, is forgotten (its entries go and it is no longer
    # dialed): daemons come and go (a pod's new name is a new daemon id), and the table must not
    # fill up with those that left. A new peer at max_peers evicts one down that long already.
    peer_forget_s: float = 600.0
    # Peers with their own series in peer-labelled metrics (a daemon id is the peer's own word):
    # later ones share peer="(other)" until one is forgotten, so /metrics stays bounded.
    max_peer_series: int = 256
    max_pending_handshakes: int = 16
    max_peer_metadata_bytes: int = 1 << 20
    max_peer_batch_msgs: int = PEER_BATCH_MSGS
    # Listener bounds (kvxferd.ops.listener_bounds): gRPC peer port connections (0: from max_peers and
    # RLIMIT_NOFILE); framed streams before their Hello, and gRPC peer port calls before they
    # authenticate, each (over it the oldest stranger stream of the biggest source is cut).
    max_peer_connections: int = 0
    max_unauthenticated_streams: int = 64
    # gRPC peer port calls one source (an IP; an IPv6 /64) holds before they authenticate: a newcomer
    # over it cuts that source's oldest such stream, or is refused (kvxferd.peer.call_caps).
    max_peer_calls_per_source: int = 32
    # gRPC peer port connections one source holds past their first 5 s with no authenticated call: the newest over
    # it that carry no call are shut down within a second (kvxferd.ops.conn_reaper).
    max_peer_connections_per_source: int = 32
    # Fleet registry ([registry] table in the file; KVXFERD_REGISTRY_* in the environment).
    # "none": rooms name their prefill daemon's address; "etcd": daemons publish themselves
    # under a lease and rooms may name a prefill group only.
    registry_backend: str = "none"
    registry_endpoints: tuple[str, ...] = ()
    registry_prefix: str = "/kvxferd"
    # Seconds a dead daemon's record outlives it; keep-alives go out every third of it.
    registry_lease_ttl_s: int = 10
    # true: the daemon does not start while etcd is unreachable; false: it starts with the
    # registry in back-off (degraded) and registers once etcd answers.
    registry_required: bool = False
    registry_timeout_s: float = 3.0
    registry_tls_ca: str = ""
    registry_tls_cert: str = ""
    registry_tls_key: str = ""
    # Published with the record; the DaemonSet sets it from the pod's node name.
    registry_node_name: str = ""
    # Test-only: lets tests inject NIXL errors through the transport's hook.
    fault_injection: bool = False
    # "nixl" (default) or "local" (in-process copies; unit tests only).
    transport: str = "nixl"
    # The NIXL backend plugin the agent moves bytes with (kvxferd.transports.nixl); only "UCX" is tested
    # (docs/transports.md). One the installed NIXL does not offer stops the start, naming those it does.
    nixl_backend: str = "UCX"
    # How GPU engines should stage chunks here: "vram" (CUDA IPC rings, VRAM over NIXL), "host"
    # (pinned host-pool rings, DRAM over NIXL) or "auto" (probe once what UCX can do with VRAM).
    data_path: str = "auto"

    def validate(self) -> Config:
        if self.socket_mode < 0 or self.socket_mode > 0o777:
            raise ConfigError(f"socket_mode must be an octal permission like 0o600, got {self.socket_mode}")
        for key in ("listen", "peer_listen", "advertise_address"):
            value = getattr(self, key)
            if value and not _valid_hostport(value):
                raise ConfigError(f"{key} must be HOST:PORT, got {value!r}")
        if not self.peer_listen:
            raise ConfigError("peer_listen must be set (HOST:PORT; port 0 picks a free port)")
        for addr in self.peers:
            if not _valid_hostport(addr):
                raise ConfigError(f"peers entries must be HOST:PORT, got {addr!r}")
        if not -1 <= self.peer_stream_port <= 65535:
            raise ConfigError(f"peer_stream_port must be -1 (off), 0 (ephemeral) or a port, got {self.peer_stream_port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be -1 (off), 0 (ephemeral) or a port, got {self.metrics_port}")
        if self.host_pool_bytes < (1 << 20):
            raise ConfigError(f"host_pool_bytes must be at least 1 MiB, got {self.host_pool_bytes}")
        if not 0 <= self.workers <= 256:
            raise ConfigError(f"workers must be 0 (auto) or 1..256, got {self.workers}")
        if not (1 << 20) <= self.merge_max_bytes <= (1 << 30):
            raise ConfigError(f"merge_max_bytes must be 1 MiB..1 GiB, got {self.merge_max_bytes}")
        if not 1 <= self.credit_split <= 1024:
            raise ConfigError(f"credit_split must be 1..1024, got {self.credit_split}")
        # Upper bounds too: the same ranges callers get (deadline_ms, lease_ms), and no timer that
        # would keep a dead peer or a stuck room for days.
        for key, hi in (("heartbeat_interval_s", 60), ("engine_lease_s", 3600), ("room_deadline_s", 86400)):
            if not 0 < getattr(self, key) <= hi:
                raise ConfigError(f"{key} must be > 0 and <= {hi}, got {getattr(self, key)}")
        if not 0 <= self.drain_grace_s <= 3600:
            raise ConfigError(f"drain_grace_s must be 0..3600, got {self.drain_grace_s}")
        if not 0 <= self.slow_peer_limit_s <= 3600:
            raise ConfigError(f"slow_peer_limit_s must be 0..3600, got {self.slow_peer_limit_s}")
        if not 1 <= self.heartbeat_misses <= 100:
            raise ConfigError(f"heartbeat_misses must be 1..100, got {self.heartbeat_misses}")
        # gRPC keeps message limits in a signed 32-bit int: a larger value failed deep in grpc with a traceback.
        if not 64 << 10 <= self.max_message_bytes <= (1 << 31) - 1:
            raise ConfigError(f"max_message_bytes must be 65536..2147483647, got {self.max_message_bytes}")
        for key, lo, hi in _CAP_RANGES:
            if not lo <= getattr(self, key) <= hi:
                raise ConfigError(f"{key} must be {lo}..{hi}, got {getattr(self, key)}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug|info|warning|error, got {self.log_level!r}")
        if self.log_format not in ("json", "text"):
            raise ConfigError(f"log_format must be json|text, got {self.log_format!r}")
        if self.data_path not in ("auto", "host", "vram"):
            raise ConfigError(f"data_path must be auto|host|vram, got {self.data_path!r}")
        if self.transport not in ("nixl", "local"):
            raise ConfigError(f"transport must be nixl|local, got {self.transport!r}")
        if not re.fullmatch(r"[A-Za-z0-9_]{1,64}", self.nixl_backend):
            raise ConfigError(f"nixl_backend must be a NIXL plugin name like UCX, got {self.nixl_backend!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key must be given together")
        if self.tls_client_auth and not (self.tls_ca and self.tls_cert):
            raise ConfigError("tls_client_auth needs tls_ca, tls_cert and tls_key")
        for key in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, key)
            if path and not Path(path).is_file():
                raise ConfigError(f"{key}: no such file {path!r}")
        self._validate_peer_auth()
        self._validate_registry()
        if not Path(self.shm_dir).is_dir():
            raise ConfigError(f"shm_dir {self.shm_dir!r} is not a directory")
        if self.pool_backing not in POOL_BACKINGS:
            raise ConfigError(f"pool_backing must be one of {', '.join(POOL_BACKINGS)}, got {self.pool_backing!r}")
        _check_socket_path(self.socket)
        return self

    def _validate_peer_auth(self) -> None:
        if self.tls_client_auth and self.peer_secret_file:
            raise ConfigError("peer_secret_file and tls_client_auth are two ways to authenticate peers: choose one")
        if self.peer_secret_file:
            read_secret_file(self.peer_secret_file)
        if self.peer_auth_mode == "insecure" and not self.insecure_peers:
            raise ConfigError(f"peer_listen {self.peer_listen} is not loopback and peers are not authenticated: set "
                              "tls_client_auth (mTLS with tls_ca), peer_secret_file, or insecure_peers = true")
        if not 0 <= self.peer_secret_overlap_s <= 86400:
            raise ConfigError(f"peer_secret_overlap_s must be 0..86400, got {self.peer_secret_overlap_s}")
        if not 1 <= self.max_peers <= 65536:
            raise ConfigError(f"max_peers must be 1..65536, got {self.max_peers}")
        limit = self.heartbeat_misses * self.heartbeat_interval_s
        if not limit <= self.peer_forget_s <= 7 * 86400:
            raise ConfigError(f"peer_forget_s must be heartbeat_misses x heartbeat_interval_s ({limit:g})"
                              f"..604800, got {self.peer_forget_s}")
        if not 1 <= self.max_peer_series <= 65536:
            raise ConfigError(f"max_peer_series must be 1..65536, got {self.max_peer_series}")
        if not 1 <= self.max_pending_handshakes <= 4096:
            raise ConfigError(f"max_pending_handshakes must be 1..4096, got {self.max_pending_handshakes}")
        # A handshake is a gRPC request too: max_message_bytes bounds it whatever this says.
        if not 4096 <= self.max_peer_metadata_bytes <= 1 << 30:
            raise ConfigError(f"max_peer_metadata_bytes must be 4096..1GiB, got {self.max_peer_metadata_bytes}")
        if not PEER_BATCH_MSGS <= self.max_peer_batch_msgs <= 1 << 20:
            raise ConfigError(f"max_peer_batch_msgs must be {PEER_BATCH_MSGS}..1048576, got {self.max_peer_batch_msgs}")

    @functools.cached_property
    def transfer_workers(self) -> int:
        """`workers`, with 0 resolved for this machine, once: the NIXL agent's UCX workers and
        the transfer threads must be the same number."""
        if self.workers:
            return self.workers
        return min(8, max(2, usable_cpus() // 2))

    @property
    def peer_auth_mode(self) -> str:
        """How peers prove who they are: one of PEER_AUTH_MODES."""
        if self.tls_client_auth:
            return "mtls"
        if self.peer_secret_file:
            return "secret"
        return "host-secret" if loopback_listen(self.peer_listen) and not self.insecure_peers else "insecure"

    def _validate_registry(self) -> None:
        if self.registry_backend not in ("none", "etcd"):
            raise ConfigError(f"registry.backend must be none|etcd, got {self.registry_backend!r}")
        if self.registry_backend == "etcd" and not self.registry_endpoints:
            raise ConfigError("registry.endpoints must list etcd's HOST:PORT when registry.backend = \"etcd\"")
        for ep in self.registry_endpoints:
            if not _valid_hostport(ep):
                raise ConfigError(f"registry.endpoints entries must be HOST:PORT, got {ep!r}")
        if not re.fullmatch(r"/[A-Za-z0-9._/-]{0,200}", self.registry_prefix) or self.registry_prefix.endswith("/"):
            raise ConfigError(f"registry.prefix must look like /kvxferd (no trailing /), got {self.registry_prefix!r}")
        if not 1 <= self.registry_lease_ttl_s <= 3600:
            raise ConfigError(f"registry.lease_ttl_s must be 1..3600 (whole seconds), got {self.registry_lease_ttl_s}")
        if not 0 < self.registry_timeout_s <= 60:
            raise ConfigError(f"registry.timeout_s must be in (0, 60], got {self.registry_timeout_s}")
        if bool(self.registry_tls_cert) != bool(self.registry_tls_key):
            raise ConfigError("registry.tls_cert and registry.tls_key must be given together")
        for key in ("registry_tls_ca", "registry_tls_cert", "registry_tls_key"):
            path = getattr(self, key)
            if path and not Path(path).is_file():
                raise ConfigError(f"{key.replace('_', '.', 1)}: no such file {path!r}")

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert)

    def tls_material(self) -> tuple[bytes, bytes, bytes | None]:
        """(private key, certificate chain, CA bundle or None) as PEM bytes."""
        ca = Path(self.tls_ca).read_bytes() if self.tls_ca else None
        return Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes(), ca


_CAP_RANGES = (
    ("max_engines", 1, 65536),
    ("max_rooms_per_engine", 1, 1 << 20),
    ("max_rooms_per_peer", 1, 1 << 22),
    ("max_open_streams", 1, 1 << 20),
    ("max_watchers_per_engine", 1, 4096),
    ("max_streams_per_engine", 1, 4096),
    ("max_watch_backlog", 16, 1 << 24),
    ("max_tombstones", 16, 1 << 22),
    ("max_peer_connections", 0, 1 << 20),
    ("max_unauthenticated_streams", 1, 1 << 16),
    ("max_peer_calls_per_source", 1, 1 << 16),
    ("max_peer_connections_per_source", 1, 1 << 16),
)


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup v2 CPU quota (a container's
    CPU limit) when one is set, since affinity alone shows every CPU of the node."""
    cpus = len(os.sched_getaffinity(0))
    try:
        with open(os.path.join(cgroup_root, "cpu.max")) as fh:
            quota, period = fh.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def _check_socket_path(path: str) -> None:
    if not path:
        raise ConfigError("socket must be a path")
    if len(path.encode()) > 107:
        raise ConfigError(f"socket path is too long for a Unix socket ({len(path)} > 107): {path!r}")
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise ConfigError(f"socket directory {str(parent)!r} cannot be created: {exc.strerror}") from exc
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"socket directory {str(parent)!r} is not writable")
    try:
        # e.g. /tmp/kvxferd-$UID created beforehand by another user: whoever owns it could swap the
        # socket engines connect to.
        check_dir(str(parent), "socket directory")
    except OSError as exc:
        raise ConfigError(exc.strerror or str(exc)) from exc


_FIELDS = {f.name: f for f in fields(Config)}


def _coerce(key: str, value: Any) -> Any:
    f = _FIELDS[key]
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if key.endswith("_bytes"):  # every *_bytes setting is a size: "256MiB" as well as 268435456
            return parse_size(value)
        if key == "socket_mode":
            if isinstance(value, str):
                return int(value, 8)
            return int(value)
        if typ == "bool":
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(value)
        if typ == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if typ == "float":
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if typ.startswith("tuple"):
            if isinstance(value, str):
                return tuple(v.strip() for v in value.split(",") if v.strip())
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                return tuple(value)
            raise ValueError(value)
        if not isinstance(value, str):
            raise ValueError(value)
        return value
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}: invalid value {value!r} (expected {typ})") from exc


# TOML tables whose keys map to `<table>_<key>` fields (`[registry] backend` -> registry_backend).
_SECTIONS = ("registry",)


def _flatten_sections(data: Mapping[str, Any], path: str | os.PathLike[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in _SECTIONS and isinstance(value, dict):
            for sub, subvalue in value.items():
                if f"{key}_{sub}" not in _FIELDS:
                    raise ConfigError(f"config file {path}: unknown key {sub!r} in [{key}]")
                out[f"{key}_{sub}"] = subvalue
        elif key not in _FIELDS:
            raise ConfigError(f"config file {path}: unknown key {key!r}")
        else:
            out[key] = value
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Builds and validates the config from file, environment and overrides."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = path or env.get("KVXFERD_CONFIG") or None
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {path}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
        for key, value in _flatten_sections(data, path).items():
            values[key] = _coerce(key, value)
    for name, value in env.items():
        if not name.startswith("KVXFERD_") or name == "KVXFERD_CONFIG":
            continue
        key = name[len("KVXFERD_"):].lower()
        if key not in _FIELDS:
            raise ConfigError(f"environment variable {name}: unknown setting {key!r}")
        values[key] = _coerce(key, value)
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {key!r}")
        values[key] = _coerce(key, value)
    return Config(**values).validate()
