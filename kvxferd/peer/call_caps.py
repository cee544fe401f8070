"""Per-source bounds on the gRPC peer port (issue #36): strangers cannot crowd peers out.

gRPC core caps a listener's connections and times out those that never speak HTTP/2 or stay idle
(kvxferd.ops.listener_bounds), but it counts nothing per caller and keeps no room for anyone. What a caller
can hold on the port once connected is calls: a Session stream waiting for its Hello (up to
CONTROL_TIMEOUT_S), a Health.Watch, a reflection stream; gRPC has no per-source cap for them. So
every call of the peer port passes here before its handler (a stand-in for the server while the
servicers register, as listeners.DecodeGuard):

- A call is a stranger's until it authenticates: a Session stream once PeerManager.accept took its
  Hello (`authenticated()`); it then counts against nothing here (peers are bounded by max_peers)
  and can no longer be cut. Unary calls (Challenge, Handshake, Heartbeat, Health.Check) are
  answered at once and are never cut.
- One source (an IP; an IPv6 /64) holds at most `per_source` stranger calls: a newcomer over it
  cuts that source's oldest stranger stream, or, with none to cut, is refused. Both answer
  RESOURCE_EXHAUSTED naming the cap. Cutting the oldest rather than refusing the newest is what
  keeps a peer that shares its address with strangers (a shared host's loopback) from being kept
  out: its calls are the newest and take milliseconds to authenticate.
- All sources together hold at most `total`: a newcomer past it cuts the oldest stranger stream of
  the source holding the most; with none to cut it is refused, unless its source is reserved for
  peers (a literal IP in `peers`, a source a peer completed a handshake from, or a caller with a
  verified client certificate), which may use as many again: strangers cannot take the room peers
  need to handshake.

Refusals and cuts are counted in kvxferd_peer_calls_refused{reason} and logged as summary lines.
Per call: a dict insert and delete, no lock, nothing on the chunk path (chunks never touch this port).

Connections that carry no call are bounded per source by kvxferd.ops.conn_reaper (`reap`): the guard
tells it which connections (the caller's ip:port) carried an authenticated call and which carry a
call now, and those it never cuts.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc

from kvxferd.addresses import call_source, split_hostport
from kvxferd.ops.conn_reaper import ConnKey, ConnReaper, conn_key
from kvxferd.ops.listener_bounds import HandlerGuard, ListenerCaps, RefusalLog
from kvxferd.ops.metrics import Metrics

SOURCE, TOTAL, CUT = "source", "total", "cut"
REASONS = (SOURCE, TOTAL, CUT)
# Sources peers completed a handshake from, most recent kept: the headroom past `total` is theirs.
MAX_VOUCHED = 4096


class _Call:
    __slots__ = ("conn", "cut", "done", "source", "stream", "task")

    def __init__(self, source: str, conn: ConnKey | None, task: asyncio.Task[Any] | None, stream: bool) -> None:
        self.source = source
        self.conn = conn  # the connection it came on (None: a Unix socket's)
        self.task = task
        self.stream = stream
        self.cut = ""  # why it was cut, once it was
        self.done = False  # authenticated or ended: no longer a stranger's


_current: contextvars.ContextVar[tuple[PeerCallGuard, _Call] | None] = contextvars.ContextVar(
    "kvxferd_peer_call", default=None)


def authenticated() -> None:
    """The running peer-port call has authenticated: it leaves the strangers' count and can no
    longer be cut (a no-op outside a guarded call)."""
    cur = _current.get()
    if cur is not None:
        cur[0].trust(cur[1].conn)
        cur[0].leave(cur[1])


def vouch() -> None:
    """A peer completed a handshake in the running call: its source is reserved from now on."""
    cur = _current.get()
    if cur is not None:
        cur[0].vouch(cur[1].source)
        cur[0].trust(cur[1].conn)


class PeerCallGuard(HandlerGuard):
    """`peers`: the configured peers' HOST:PORT (literal IPs among them are reserved sources)."""

    def __init__(self, server: Any, per_source: int, total: int, peers: Iterable[str], counter: Any,
                 log: RefusalLog) -> None:
        super().__init__(server)
        self._per_source = per_source
        self._total = total
        hosts = (split_hostport(a)[0] for a in peers)
        self._reserved = frozenset(call_source(f"ipv6:[{h}]:0" if ":" in h else f"ipv4:{h}:0") for h in hosts)
        self._vouched: dict[str, None] = {}  # oldest first
        self._by_source: dict[str, dict[_Call, None]] = {}  # stranger calls per source, oldest first
        self._count = 0
        self._trusted: set[ConnKey] = set()  # connections that carried an authenticated call (open ones)
        self._busy: dict[ConnKey, int] = {}  # calls in flight per connection, before they authenticated
        self._counted = {r: counter.labels(reason=r) for r in REASONS}
        self._log = log

    @property
    def strangers(self) -> int:
        return self._count

    def _guard(self, method: str, handler: Any) -> Any:
        if handler is None:
            return None
        stream = bool(handler.request_streaming or handler.response_streaming)
        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        behavior = getattr(handler, kind)
        if inspect.isasyncgenfunction(behavior):
            async def gen(request: Any, context: Any) -> Any:
                async with self._held(context, stream):
                    async for msg in behavior(request, context):
                        yield msg
            return handler._replace(**{kind: gen})
        if not inspect.iscoroutinefunction(behavior):
            return handler  # a sync handler: grpc runs it in a thread; none of ours is one

        async def run(request: Any, context: Any) -> Any:
            async with self._held(context, stream):
                return await behavior(request, context)
        return handler._replace(**{kind: run})

    @contextlib.asynccontextmanager
    async def _held(self, context: Any, stream: bool) -> AsyncIterator[None]:
        """The call admitted (else aborted) and counted while it runs, as a stranger's until it
        authenticates; a cut one ends RESOURCE_EXHAUSTED saying why."""
        call = await self._admit(context, stream)
        token = _current.set((self, call))
        try:
            yield
        except asyncio.CancelledError:
            if call.cut:
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"peer port: cut before it authenticated: {call.cut}")
            raise
        finally:
            _current.reset(token)
            self.leave(call)

    # -- admission

    async def _admit(self, context: Any, stream: bool) -> _Call:
        call = self.enter(context, stream)
        if isinstance(call, str):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, call)
        assert isinstance(call, _Call)
        return call

    def enter(self, context: Any, stream: bool) -> _Call | str:
        """A new stranger call from `context.peer()` (`stream`: one that may be held, and cut), or
        why it is refused (it then holds nothing)."""
        source = call_source(context.peer())
        calls = self._by_source.get(source)
        if calls is not None and len(calls) >= self._per_source and not self._cut_oldest(
                calls, f"{source} opened more than max_peer_calls_per_source = {self._per_source}"):
            return self._refuse(SOURCE, f"peer port: {source} holds {self._per_source} calls that have not "
                                        f"authenticated (max_peer_calls_per_source)")
        if self._count >= self._total:
            biggest = max(self._by_source.values(), key=len)
            if not self._cut_oldest(biggest, f"more than max_unauthenticated_streams = {self._total} open") \
                    and not (self._count < 2 * self._total and self._reserved_for_peers(source, context)):
                return self._refuse(TOTAL, f"peer port: {self._total} calls that have not authenticated are open "
                                           f"(max_unauthenticated_streams)")
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no loop running: nothing to cut
            task = None
        call = _Call(source, conn_key(context.peer()), task, stream)
        self._by_source.setdefault(source, {})[call] = None
        self._count += 1
        if call.conn is not None:
            self._busy[call.conn] = self._busy.get(call.conn, 0) + 1
        return call

    def _reserved_for_peers(self, source: str, context: Any) -> bool:
        if self.reserved(source):
            return True
        try:  # with TLS client authentication, gRPC verified this certificate against the fleet CA
            return bool(context.auth_context().get("x509_pem_cert"))
        except Exception:
            return False

    def _cut_oldest(self, calls: dict[_Call, None], why: str) -> bool:
        victim = next((c for c in calls if c.stream and c.task is not None), None)
        if victim is None or victim.task is None:
            return False
        self.leave(victim)
        victim.cut = why
        victim.task.cancel()
        self._counted[CUT].inc()
        self._log(f"stream cut before it authenticated ({why})")
        return True

    def _refuse(self, reason: str, why: str) -> str:
        self._counted[reason].inc()
        self._log(why)
        return why

    def leave(self, call: _Call) -> None:
        """The call authenticated or ended: no longer a stranger's."""
        if call.done:
            return
        call.done = True
        if call.conn is not None:
            left = self._busy.pop(call.conn, 1) - 1
            if left:
                self._busy[call.conn] = left
        calls = self._by_source.get(call.source)
        if calls is not None and call in calls:
            del calls[call]
            self._count -= 1
            if not calls:
                del self._by_source[call.source]

    def vouch(self, source: str) -> None:
        self._vouched.pop(source, None)
        self._vouched[source] = None
        if len(self._vouched) > MAX_VOUCHED:
            del self._vouched[next(iter(self._vouched))]

    def trust(self, conn: ConnKey | None) -> None:
        """The connection carried an authenticated call: the reaper never counts or cuts it."""
        if conn is not None:
            self._trusted.add(conn)

    def _forget(self, live: set[ConnKey]) -> None:
        self._trusted &= live

    def reserved(self, source: str) -> bool:
        return source in self._reserved or source in self._vouched

    def reaper(self, port: int, per_source: int, caps: ListenerCaps, metrics: Metrics) -> ConnReaper:
        """The connection bound of the peer port `port` (kvxferd.ops.conn_reaper), told by this guard:
        strangers keep at most half the port's connection cap after a sweep, the rest is the peers'."""
        return ConnReaper(port, per_source, caps.peer_connections // 2, self._trusted.__contains__,
                          self._busy.__contains__, self.reserved, self._forget, metrics.peer_connections_cut)
