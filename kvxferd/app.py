"""Daemon lifecycle: build every part from the config, serve, drain, close.

`serve(config, shutdown_trigger=None)` is the one entry point; tests stop it by
setting the trigger instead of sending signals. SIGTERM/SIGINT: health goes
NOT_SERVING, new work is refused with UNAVAILABLE, in-flight rooms get
`drain_grace_s` to finish, the rest fail with SHUTDOWN on both sides, then
everything is closed. A second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import grp
import json
import logging
import os
import signal
import socket
import stat
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from kvxfer_protocol.lane_frames import LANE_SUFFIX
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc
from kvxferd import __version__
from kvxferd.buffers.host_pool import POOL_SUFFIX, HostPool
from kvxferd.buffers.memlimit import PoolDoesNotFit
from kvxferd.config import Config, ConfigError, loopback_listen
from kvxferd.core.node import Node
from kvxferd.core.peer_port import Identity
from kvxferd.core.types import FailureCode
from kvxferd.datapath.notif import join_notifs
from kvxferd.datapath.workers import WorkerPool
from kvxferd.engine_api.lane import LaneServer
from kvxferd.engine_api.pool_socket import PoolSocket
from kvxferd.engine_api.servicer import EngineServicer, wrap_servicer
from kvxferd.fleet.etcd import RegistryUnavailable, make_registry
from kvxferd.fleet.registry import REGISTRY_HEALTH
from kvxferd.ops.faults import FAULT_CONTROL_SUFFIX, PostDelay, fault_control
from kvxferd.ops.listener_bounds import DecodeGuard, RefusalLog, listener_caps, raise_nofile, server_options
from kvxferd.ops.logs import setup_logging
from kvxferd.ops.metrics import Metrics, start_metrics_server
from kvxferd.ops.owned_files import Busy, OwnerLock, check_dir, listen_failure_hint
from kvxferd.peer.call_caps import PeerCallGuard
from kvxferd.peer.heal import PAUSE_S
from kvxferd.peer.link import grpc_options
from kvxferd.peer.manager import PeerManager
from kvxferd.peer.servicer import PEER_UNARY, PeerServicer, WireServer
from kvxferd.transports.interface import FaultInjector, LocalTransport, Transport
from kvxferd.transports.nixl import NixlTransport

logger = logging.getLogger(__name__)
GC_YOUNG_THRESHOLD = 10_000  # net allocations between young collections (CPython: 700)

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name
# After the last room finished, how long a drain waits for engines to read the outcomes.
DRAIN_LINGER_S = 2.0
SWEEP_S = 0.25  # how often engine leases are checked


class StartupError(RuntimeError):
    """The daemon cannot start; the message is the one line the operator sees."""


@dataclass(frozen=True)
class Ready:
    """What a started daemon tells its launcher (tests, `--ready-file`)."""

    daemon_id: str
    socket: str
    peer_address: str
    metrics_port: int
    engine_tcp: str
    pid: int
    stream_address: str = ""

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


def make_transport(config: Config, name: str, injector: FaultInjector | None = None) -> Transport:
    if config.transport == "local":
        return LocalTransport(name)
    if injector is None and config.fault_injection:
        injector = FaultInjector()
    with _ucx_devices(config):
        return NixlTransport(name, progress_thread=config.nixl_progress_thread, fault_injector=injector,
                             num_workers=config.transfer_workers, backend=config.nixl_backend)


@contextlib.contextmanager
def _ucx_devices(config: Config) -> Iterator[None]:
    """UCX's TCP transport listens on every network device it finds, whatever peer_listen says:
    a daemon kept on loopback would still expose its data path on the node's NICs. Unless the
    operator picked devices (UCX_NET_DEVICES), a loopback-only daemon keeps UCX on `lo` too.
    UCX reads the variable when the agent is created; it is restored afterwards so in-process
    daemons (tests) do not leak it into each other or into processes they start."""
    if "UCX_NET_DEVICES" in os.environ or not loopback_listen(config.peer_listen):
        yield
        return
    os.environ["UCX_NET_DEVICES"] = "lo"
    try:
        yield
    finally:
        os.environ.pop("UCX_NET_DEVICES", None)


LOCK_SUFFIX = ".lock"
# Files next to the engine socket that its lock owns: a dead daemon's are removed at start,
# ours at close.
SOCKET_SIDECARS = (FAULT_CONTROL_SUFFIX, POOL_SUFFIX, LANE_SUFFIX)


def _claim_socket(path: str) -> OwnerLock:
    """The daemon serving `path` holds `<path>.lock` for its life (a lock, not a PID: see
    kvxferd.ops.owned_files). Once we hold it, a socket and a fault file left there are a dead daemon's and
    are removed; a daemon that holds it is alive, in whatever PID namespace, and we do not start."""
    try:
        warning = check_dir(os.path.dirname(path) or ".", "socket directory")
        if warning:
            logger.warning("%s", warning)
        lock = OwnerLock(path + LOCK_SUFFIX)
    except Busy as exc:
        raise StartupError(f"another daemon is already serving on {path} (it holds {path}{LOCK_SUFFIX})") from exc
    except OSError as exc:
        raise StartupError(f"cannot claim the socket {path}: {exc.strerror or exc}") from exc
    try:
        _remove_stale_socket(path)
        for suffix in SOCKET_SIDECARS:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path + suffix)
    except BaseException:
        lock.release()
        raise
    return lock


def _remove_stale_socket(path: str) -> None:
    """Removes a socket file left by a dead daemon; refuses anything that is not a socket (a
    symlink is not followed) and a socket that still answers (a daemon older than the lock)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"socket path {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise StartupError(f"another daemon is already serving on {path}")


def _server_credentials(config: Config) -> grpc.ServerCredentials | None:
    if not config.tls_enabled:
        return None
    key, cert, ca = config.tls_material()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=config.tls_client_auth
    )


def _bind(server: grpc.aio.Server, address: str, creds: grpc.ServerCredentials | None, what: str) -> int:
    try:
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise StartupError(f"cannot listen on {address} for the {what} ({listen_failure_hint(address)})") from exc
    if port == 0 and not address.startswith("unix:"):
        raise StartupError(f"cannot listen on {address} for the {what} ({listen_failure_hint(address)})")
    return port


def _cuda_importer(transport: Transport) -> Callable[..., Any]:
    from kvxferd.buffers.gpu_rings import make_cuda_importer

    return make_cuda_importer(transport)


@dataclass
class _Daemon:
    """Everything a running daemon holds, built by _start and taken apart by _close."""

    config: Config
    metrics: Metrics
    pool: HostPool
    socket_lock: OwnerLock
    transport: Transport | None = None
    workers: WorkerPool | None = None
    node: Node | None = None
    peers: PeerManager | None = None
    health: health.aio.HealthServicer | None = None
    servers: list[grpc.aio.Server] = field(default_factory=list)
    pool_socket: PoolSocket | None = None
    lane: LaneServer | None = None
    wire: WireServer | None = None
    metrics_server: asyncio.AbstractServer | None = None
    background: list[asyncio.Future[Any]] = field(default_factory=list)


async def _start(d: _Daemon, ready: Callable[[Ready], None] | None) -> None:
    """Builds every part, binds every listener, and reports SERVING."""
    config, metrics, pool = d.config, d.metrics, d.pool
    loop = asyncio.get_running_loop()
    instance = pool.tag
    injector: FaultInjector | None = None
    delays = PostDelay()
    try:
        if config.fault_injection and config.transport == "nixl":
            injector = FaultInjector()
        d.transport = transport = make_transport(config, f"kvxferd-{instance}", injector)
        transport.register_region(pool.base_addr, pool.size, "DRAM", 0)
    except Exception as exc:
        raise StartupError(f"cannot start the NIXL agent: {exc}") from exc
    ident = Identity(config.daemon_id, instance + uuid.uuid4().hex[:8])
    d.node = node = Node(config, pool, metrics, ident)
    d.workers = workers = WorkerPool(transport, loop, config.transfer_workers,
                                     join_notifs=join_notifs if config.merge_writes else None,
                                     merge_max_bytes=config.merge_max_bytes,
                                     post_delay=delays.take if config.fault_injection else None)
    d.peers = peers = PeerManager(ident, config, transport, workers, metrics, node, node.spawn)
    node.attach(workers, peers.window, peers.connect, peers.all, peers.health.transport_failed)

    d.health = health_servicer = health.aio.HealthServicer()
    opts, caps = [*grpc_options(config), ("grpc.so_reuseport", 0)], listener_caps(config, raise_nofile())
    engine_server = grpc.aio.server(options=[*opts, *server_options(caps.engine_connections)])
    peer_server = grpc.aio.server(options=[*opts, *server_options(caps.peer_connections)])
    d.servers = [engine_server, peer_server]
    # Peer port calls and connections capped per source, room kept for peers (peer.call_caps, ops.conn_reaper).
    calls = PeerCallGuard(peer_server, config.max_peer_calls_per_source, caps.unauthenticated_streams, config.peers,
                          metrics.peer_calls_refused, RefusalLog("peer port calls"))
    engine, peer = DecodeGuard(engine_server, RefusalLog("engine API")), DecodeGuard(calls, RefusalLog("peer port"))
    engine_servicer = EngineServicer(node, metrics, _cuda_importer(transport), peers.status)
    engine_pb2_grpc.add_EngineServicer_to_server(engine_servicer, engine)
    peer_servicer = PeerServicer(ident, peers, transport)
    wrap_servicer(peer_servicer, "Peer", metrics, PEER_UNARY)
    peer_pb2_grpc.add_PeerServicer_to_server(peer_servicer, peer)
    for srv, service in ((engine, ENGINE_SERVICE), (peer, PEER_SERVICE)):
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, srv)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer((service, health.SERVICE_NAME, reflection.SERVICE_NAME)), srv)

    # Created private (umask) so no other user can connect in the moment before the chmod below
    # sets the configured mode.
    old_umask = os.umask(0o177)
    try:
        _bind(engine_server, f"unix:{config.socket}", None, "engine API socket")
    finally:
        os.umask(old_umask)
    engine_tcp = ""
    creds = _server_credentials(config)
    if config.listen:
        port = _bind(engine_server, config.listen, creds, "engine API")
        engine_tcp = f"{config.listen.rpartition(':')[0]}:{port}"
    peer_port = _bind(peer_server, config.peer_listen, creds, "peer service")
    peer_host = config.peer_listen.rpartition(":")[0]
    ident.address = config.advertise_address or f"{peer_host}:{peer_port}"
    ident.daemon_id = config.daemon_id or f"{socket.gethostname()}:{peer_port}"
    if config.peer_stream_port >= 0:
        d.wire = WireServer(peers, config, caps)
        try:
            stream_port = await d.wire.start(peer_host, config.peer_stream_port)
        except OSError as exc:
            raise StartupError(f"cannot listen on {peer_host}:{config.peer_stream_port} for the peer control "
                               f"stream ({exc.strerror or exc}; peer_stream_port = -1 turns it off)") from exc
        ident.stream_address = f"{ident.address.rpartition(':')[0]}:{stream_port}"

    for srv in d.servers:
        await srv.start()
    os.chmod(config.socket, config.socket_mode)
    gid = -1
    if config.socket_group:
        try:
            gid = grp.getgrnam(config.socket_group).gr_gid
            os.chown(config.socket, -1, gid)
            if pool.path:
                # Engines of that group must also map the host pool their rings live in.
                os.chown(pool.path, -1, gid)
        except (KeyError, PermissionError) as exc:
            raise StartupError(f"cannot give the socket to group {config.socket_group!r}: {exc}") from exc
    if config.engine_lane:
        unary, streams, waiting = engine_servicer.lane_methods()
        d.lane = LaneServer(config.socket + LANE_SUFFIX, unary, streams, config.max_message_bytes, waiting,
                            caps.lane_connections)
        try:
            await d.lane.start(config.socket_mode, gid)
        except OSError as exc:
            raise StartupError(f"cannot serve the engine lane on {d.lane.path}: {exc.strerror or exc}") from exc
    if not pool.path:
        d.pool_socket = PoolSocket(config.socket + POOL_SUFFIX, pool.fd, instance, pool.size)
        try:
            d.pool_socket.start(loop, config.socket_mode, gid)
        except OSError as exc:
            raise StartupError(f"cannot serve the host pool on {d.pool_socket.path}: {exc.strerror or exc}") from exc
    metrics_port = -1
    if config.metrics_port >= 0:
        try:
            d.metrics_server, metrics_port = await start_metrics_server(
                config.metrics_host, config.metrics_port, metrics.registry
            )
        except OSError as exc:
            raise StartupError(
                f"cannot serve metrics on {config.metrics_host}:{config.metrics_port}: {exc.strerror}"
            ) from exc
    workers.start()
    workers.start_notif_poller(node.on_notifs)
    peers.start()
    for svc in ("", ENGINE_SERVICE, PEER_SERVICE):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    registry = make_registry(config, node.engines, ident, peers.instance_gone, metrics, lambda up: node.spawn(
        health_servicer.set(REGISTRY_HEALTH, health_pb2.HealthCheckResponse.SERVING if up
                            else health_pb2.HealthCheckResponse.NOT_SERVING), "registry health"))
    if registry is not None:
        await health_servicer.set(REGISTRY_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
        node.set_registry(registry)
        try:
            await registry.start()
        except RegistryUnavailable as exc:
            raise StartupError(str(exc)) from exc
    reap = calls.reaper(peer_port, config.max_peer_connections_per_source, caps, metrics).run()
    d.background += [asyncio.ensure_future(_sweep(node)), asyncio.ensure_future(reap)]
    if injector is not None:
        d.background.append(asyncio.ensure_future(fault_control(
            config.socket + FAULT_CONTROL_SUFFIX, injector, delays, transport, ident, workers.run_blocking,
            d.wire.close if d.wire is not None else None,
            lambda seconds: setattr(peers, "accept_delay_s", seconds))))
    if peers.auth.mode == "insecure":
        logger.warning("insecure_peers: the peer service on %s accepts unauthenticated peers; any host that "
                       "reaches it can claim any daemon id (set peer_secret_file or mTLS)", ident.address)
    logger.info(
        "kvxferd %s serving: daemon %s, socket %s, peer %s, metrics %s:%d, pool %d MiB, peer auth %s",
        __version__, ident.daemon_id, config.socket, ident.address, config.metrics_host, metrics_port,
        pool.size >> 20, peers.auth.mode,
    )
    if ready is not None:
        ready(Ready(ident.daemon_id, config.socket, ident.address, metrics_port, engine_tcp, os.getpid(),
                    ident.stream_address))


async def _wait(shutdown_trigger: asyncio.Event | Awaitable[Any] | None, install_signal_handlers: bool) -> None:
    """Until the trigger fires or SIGTERM/SIGINT arrives (a second SIGINT exits at once)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    if install_signal_handlers:
        def _on_signal(sig: int) -> None:
            if stop.is_set():
                logger.warning("second signal %d: exiting without drain", sig)
                os._exit(130)
            logger.info("signal %d: draining", sig)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _on_signal, sig)
    waiters = [asyncio.ensure_future(stop.wait())]
    if shutdown_trigger is not None:
        trig = shutdown_trigger.wait() if isinstance(shutdown_trigger, asyncio.Event) else shutdown_trigger
        waiters.append(asyncio.ensure_future(trig))
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()


async def _drain(d: _Daemon) -> None:
    """NOT_SERVING, refuse new work, give rooms in flight `drain_grace_s`, fail the rest."""
    node, workers, config = d.node, d.workers, d.config
    assert node is not None and workers is not None and d.health is not None
    node.serving = False
    # Leave the fleet first: peers stop routing new rooms here, while the rooms in flight finish.
    await node.recv.registry.stop()
    await d.health.enter_graceful_shutdown()
    t0 = time.monotonic()
    while (node.active_rooms() or workers.in_flight) and time.monotonic() - t0 < config.drain_grace_s:
        await asyncio.sleep(0.02)
    # Engines learn outcomes by event or poll: a short linger (inside the grace) lets them read
    # SUCCESS/FAILED of the last rooms instead of finding the socket closed.
    linger_until = min(t0 + config.drain_grace_s, time.monotonic() + DRAIN_LINGER_S)
    while node.unread_rooms() and time.monotonic() < linger_until:
        await asyncio.sleep(0.02)
    left = node.active_rooms()
    if left:
        logger.warning("drain grace over: failing %d unfinished room(s)", left)
        node.fail_all(FailureCode.SHUTDOWN, "daemon shut down before the room finished")
        await asyncio.sleep(0.1)
    logger.info("drained in %.2f s", time.monotonic() - t0)


async def _close(d: _Daemon) -> None:
    """Stops every part, in reverse order of _start; safe on a half-started daemon."""
    for task in d.background:
        task.cancel()
    if d.peers is not None:
        await d.peers.stop()
    if d.wire is not None:
        d.wire.close()
    for srv in d.servers:
        await srv.stop(0.5)
    if d.metrics_server is not None:
        d.metrics_server.close()
    if d.pool_socket is not None:
        d.pool_socket.close()
    if d.lane is not None:
        await d.lane.close()
    if d.workers is not None:
        d.workers.stop()
    if d.transport is not None:
        try:
            d.transport.close()
        except Exception as exc:
            logger.warning("closing the transport failed: %s", exc)
    d.pool.close()
    # Nothing is left behind: the socket, the fault file, and last the lock that owned them.
    for leftover in (d.config.socket, *(d.config.socket + suffix for suffix in SOCKET_SIDECARS)):
        with contextlib.suppress(OSError):
            os.unlink(leftover)
    d.socket_lock.release()


async def serve(
    config: Config,
    shutdown_trigger: asyncio.Event | Awaitable[Any] | None = None,
    ready: Callable[[Ready], None] | None = None,
    install_signal_handlers: bool = False,
) -> int:
    """Runs the daemon until the trigger fires (or a signal); returns the exit code."""
    instance = uuid.uuid4().hex[:12]
    lock = _claim_socket(config.socket)
    try:
        # HostPool checks the pool against the memory of the backing it picks (kvxferd.buffers.memlimit).
        pool = HostPool(config.shm_dir, config.host_pool_bytes, instance, mode=config.socket_mode | 0o600,
                        backing=config.pool_backing, huge_dir=config.huge_dir)
    except PoolDoesNotFit as exc:
        lock.release()
        raise StartupError(str(exc)) from None
    except OSError as exc:
        lock.release()
        where = {"private": "on a private huge-page tmpfs", "huge_dir": f"in {config.huge_dir}"}.get(
            config.pool_backing, f"in {config.shm_dir}")
        raise StartupError(f"cannot create the host pool {where}: {exc.strerror or exc}") from exc
    t0 = time.monotonic()
    try:
        if config.prefault_pool:
            pool.prefault()
    except OSError as exc:
        pool.close()
        lock.release()
        raise StartupError(f"cannot make the {pool.size >> 20} MiB host pool resident ({pool.backing}): "
                           f"{exc.strerror or exc}; lower host_pool_bytes or free memory") from exc
    logger.info("host pool: %d MiB, %s%s, %s", pool.size >> 20, pool.backing,
                f" at {pool.path}" if pool.path else f" ({pool.file + ', ' if pool.file else ''}handed to engines by fd)",
                f"resident after {time.monotonic() - t0:.2f} s" if config.prefault_pool else "pages placed on first use")
    d = _Daemon(config, Metrics(), pool, lock)
    try:
        await _start(d, ready)
        await _wait(shutdown_trigger, install_signal_handlers)
        await _drain(d)
        return 0
    finally:
        await _close(d)


async def _sweep(node: Node) -> None:
    """Lease expiry: a crashed engine stops renewing; its rooms fail and its ring is released. A
    sweep PAUSE_S later than due means this daemon did not run (SIGSTOP, a stalled loop): the time
    away is not counted against engine leases (EngineTable.fresh_leases)."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(SWEEP_S)
        now = time.monotonic()
        away, last = now - last, now
        try:
            if away > SWEEP_S + PAUSE_S:
                node.engines.fresh_leases(away)
            node.expire_leases()
        except Exception:
            logger.exception("lease sweep failed")


def run(config: Config, ready_file: str | None = None) -> int:
    """Blocking entry point for the CLI: uvloop, signals, one-line errors."""
    setup_logging(config)

    def _ready(r: Ready) -> None:
        # Process-wide, so not in serve() (tests embed it): start-up objects, frozen, are never walked
        # again (a collection took 6 % of the decode loop); young collections come less often.
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        if ready_file:
            tmp = ready_file + ".tmp"
            # Not through a symlink planted at the temporary name.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w") as fh:
                fh.write(r.to_json())
            os.replace(tmp, ready_file)

    try:
        import uvloop

        runner: Callable[..., int] = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(serve(config, ready=_ready, install_signal_handlers=True))
    except (StartupError, ConfigError) as exc:  # (ConfigError: a host secret refused at start)
        print(f"kvxferd: error: {exc}", file=sys.stderr)
        return 2
