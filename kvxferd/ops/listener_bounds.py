"""Bounds on what strangers can make a listener hold (issue #36): file descriptors, connections,
memory before a frame is trusted, and log lines.

Every listener of the daemon is bounded here or by a number sized here:
- fds: RLIMIT_NOFILE is raised to its hard limit at start, and the connection caps below are
  sized from it so that what strangers can open stays well below it (engines, peers, NIXL and
  the pool need their own).
- the gRPC peer port and the engine API's TCP port: gRPC core's per-listener connection cap
  (`grpc.max_allowed_incoming_connections`: a connection over it is closed at accept), a
  handshake timeout (a TCP connection that never speaks HTTP/2 goes after CONTROL_S) and an idle
  timeout (a connection with no call open goes after IDLE_MS; a real client reconnects alone).
- a request that does not decode: INVALID_ARGUMENT, on every service of both gRPC servers, with a
  rate-limited log line instead of a traceback each (grpc would answer UNKNOWN and log one).
The framed peer port and the engine lane bound their own connections with the numbers from
`ListenerCaps` (kvxferd.peer.servicer.WireServer, kvxferd.engine_api.lane.LaneServer).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import resource
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvxferd.config import Config

logger = logging.getLogger(__name__)

# A peer or an engine that opened a TCP connection speaks HTTP/2 at once; 5 s is the peer
# handshake's own budget (kvxferd.peer.link.CONTROL_TIMEOUT_S).
CONTROL_S = 5.0
# A connection with no call open this long is closed (GOAWAY): gRPC clients reconnect on their
# next call, so this costs a real client one reconnect and bounds how long a stranger holds a slot.
IDLE_MS = 120_000
# The most a process may ask for: more fds than this is never needed and some kernels cap at it.
_NOFILE_CEILING = 1 << 20
# Summary lines of refused connections and requests: at most one per this many seconds per kind.
SUMMARY_S = 10.0


@dataclass(frozen=True)
class ListenerCaps:
    """How many connections each listener keeps open at once (see the module docstring)."""

    nofile: int  # RLIMIT_NOFILE's soft limit after start raised it
    peer_connections: int  # gRPC peer port
    engine_connections: int  # the engine API's TCP port (the Unix socket is the engines' own)
    framed_streams: int  # framed peer port, streams past their Hello (two per peer we may know)
    unauthenticated_streams: int  # framed peer port, streams before their Hello
    lane_connections: int  # engine lane (Unix socket)


def raise_nofile() -> int:
    """Raises RLIMIT_NOFILE's soft limit to its hard limit where allowed; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _NOFILE_CEILING if hard == resource.RLIM_INFINITY else min(hard, _NOFILE_CEILING)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            logger.warning("cannot raise RLIMIT_NOFILE from %d to %d; connection caps are sized from %d",
                           soft, want, soft)
    return _NOFILE_CEILING if soft == resource.RLIM_INFINITY else int(soft)


def listener_caps(config: Config, nofile: int) -> ListenerCaps:
    """Caps sized for the fleet the config allows (max_peers, max_engines), each held to a share of
    `nofile` so that all of them together stay well below it: strangers filling every listener to
    its cap still leave about a third of the fds to engines, peers we dial, NIXL and the pool."""
    share = max(16, nofile // 6)
    peer = config.max_peer_connections or min(2 * config.max_peers + 64, share)
    unauth = min(config.max_unauthenticated_streams, share)
    if share < config.max_peers + 16:  # (each peer holds one connection to the peer port)
        logger.warning("RLIMIT_NOFILE is %d: the peer listeners are held to %d connections, fewer than "
                       "max_peers = %d needs; raise the limit (LimitNOFILE=, ulimit -n) for a fleet that "
                       "large", nofile, share, config.max_peers)
    return ListenerCaps(
        nofile=nofile,
        peer_connections=peer,
        engine_connections=min(4 * config.max_engines + 64, share),
        framed_streams=min(2 * config.max_peers + 16, share),
        unauthenticated_streams=unauth,
        lane_connections=min(4 * config.max_engines + 64, share),
    )


def server_options(max_connections: int) -> list[tuple[str, int]]:
    """gRPC core arguments bounding one server's listeners (see the module docstring)."""
    return [
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", int(CONTROL_S * 1000)),
        ("grpc.max_connection_idle_ms", IDLE_MS),
    ]


class RefusalLog:
    """Counts refusals of one kind and logs them as a summary line at most every SUMMARY_S (the
    first at once): a flood of refused connections costs a few log lines, not one each."""

    def __init__(self, what: str, every_s: float = SUMMARY_S) -> None:
        self._what = what
        self._every = every_s
        self._counts: Counter[str] = Counter()
        self._last = -every_s
        self._timer: asyncio.TimerHandle | None = None

    def __call__(self, reason: str) -> None:
        self._counts[reason[:200]] += 1
        if self._timer is not None:
            return
        wait = self._last + self._every - time.monotonic()
        if wait <= 0:
            self._flush()
            return
        try:
            self._timer = asyncio.get_running_loop().call_later(wait, self._flush)
        except RuntimeError:  # no loop (a test, a thread): log now
            self._flush()

    def _flush(self) -> None:
        self._timer = None
        self._last = time.monotonic()
        if not self._counts:
            return
        total = sum(self._counts.values())
        top = "; ".join(f"{n} x {why}" for why, n in self._counts.most_common(5))
        self._counts.clear()
        logger.warning("%s: %d refused in the last %g s (%s)", self._what, total, self._every, top)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._flush()


class _Undecodable:
    """What a request that does not parse deserializes to: the handler wrapper answers it."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


class HandlerGuard:
    """Stands in for a grpc.aio.Server (or another guard) while the generated add_*_to_server
    functions register their handlers: each handler is replaced by `_guard(method, handler)` once.
    Guards stack: the one registered through last runs first."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h, self._guard) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self._server.add_registered_method_handlers(
            service, {name: self._guard(f"/{service}/{name}", h) for name, h in handlers.items()})

    def _guard(self, method: str, handler: Any) -> Any:
        return handler


class DecodeGuard(HandlerGuard):
    """Every handler's request deserializer is made unable to raise, and a request that does not
    decode is answered INVALID_ARGUMENT (gRPC would answer UNKNOWN, with a traceback in the log
    each time)."""

    def __init__(self, server: Any, log: RefusalLog) -> None:
        super().__init__(server)
        self._log = log

    def _guard(self, method: str, handler: Any) -> Any:
        deserialize = handler.request_deserializer if handler is not None else None
        if deserialize is None:
            return handler
        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        behavior = getattr(handler, kind)
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # a sync handler: grpc runs it in a thread; none of ours is one

        def safe(raw: bytes) -> Any:
            try:
                return deserialize(raw)
            except Exception as exc:
                return _Undecodable(f"{type(exc).__name__}: {str(exc)[:200]}")

        wrapped = (_stream_request if handler.request_streaming else _unary_request)(behavior, method, self._log)
        return handler._replace(request_deserializer=safe, **{kind: wrapped})


async def _refuse(context: Any, method: str, bad: _Undecodable, log: RefusalLog) -> None:
    log(f"{method}: undecodable request")
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request does not parse ({bad.why})")


def _unary_request(behavior: Callable[..., Any], method: str, log: RefusalLog) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        async def gen(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await _refuse(context, method, request, log)
            async for msg in behavior(request, context):
                yield msg
        return gen

    async def unary(request: Any, context: Any) -> Any:
        if isinstance(request, _Undecodable):
            await _refuse(context, method, request, log)
        return await behavior(request, context)
    return unary


def _stream_request(behavior: Callable[..., Any], method: str, log: RefusalLog) -> Callable[..., Any]:
    async def checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Undecodable):
                await _refuse(context, method, request, log)
            yield request

    if inspect.isasyncgenfunction(behavior):
        async def gen(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async for msg in behavior(checked(requests, context), context):
                yield msg
        return gen

    async def call(requests: AsyncIterator[Any], context: Any) -> Any:
        return await behavior(checked(requests, context), context)
    return call


class _GuardedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: Any, guard: Callable[[str, Any], Any]) -> None:
        self._inner = inner
        self._wrap = guard
        self._done: dict[tuple[str, int], Any] = {}  # (method, id(inner handler)): wrapped once

    def service(self, handler_call_details: Any) -> Any:
        method = handler_call_details.method
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        key = (method, id(handler))
        if key not in self._done:
            if len(self._done) > 1024:  # a generic handler that makes a new one per call
                self._done.clear()
            self._done[key] = self._wrap(method, handler)
        return self._done[key]
