"""Shared machinery of the fault tests: daemons (optionally inside a network namespace), engine
processes that use only kvxfer_client and stream what they see back to the test, status checks and
the time-to-FAILED recorder.

Engine processes report every verified chunk and every finished room with the wall-clock time at
which they saw it (they poll every 2 ms), so the test can measure how long after a fault each
side's rooms turned FAILED. Chunk bytes follow tests/engine_procs.py (a pure function of room,
chunk and head), so a decode engine checks every byte it receives.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import queue
import random
import re
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvxfer_client import DecodeReceiver, KvxferError, Layout, PrefillSender, RoomState
from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2, engine_pb2_grpc
from kvxferd.ops.owned_files import ephemeral_port_range
from tests.conftest import ROOT, DaemonProc, daemon_env, wait_ready
from tests.engine_procs import RoomPlan, part_bytes_for

# 2 layers x 2 KV heads x K/V x 64 dims x 2 B = 1 KiB per token for a TP-1 rank.
LAYOUT = Layout(num_layers=2, total_kv_heads=2, head_dim=64, dtype_bytes=2, page_size=16, dtype="bfloat16")
TOKEN_BYTES = 1024
HEARTBEAT_S = 1.0  # the production default; 0.5 s gave false peer losses on a loaded 2-core machine
POLL_S = 0.005  # engines poll their rooms this often (the resolution of the measured times)


# --------------------------------------------------------------------------- daemons


def launch(
    workdir: Path, name: str, *extra: str, prefix: Sequence[str] = (), peer_listen: str = "127.0.0.1:0",
    pool: str = "64MiB", env: dict[str, str] | None = None, wait: bool = True,
) -> DaemonProc:
    """Like tests.conftest.spawn_daemon, plus a command prefix (e.g. `ip netns exec NS`)."""
    sock = str(workdir / f"{name}.sock")
    ready = workdir / f"{name}.ready"
    log = workdir / f"{name}.log"
    ready.unlink(missing_ok=True)
    args = [
        *prefix, sys.executable, "-m", "kvxferd", "serve", "--socket", sock, "--peer-listen", peer_listen,
        "--metrics-port", "0", "--host-pool-bytes", pool, "--daemon-id", name, "--ready-file", str(ready),
        "--log-format", "text", "--set", f"heartbeat_interval_s={HEARTBEAT_S}", *extra,
    ]
    d = DaemonProc(name, _popen(args, log, env), sock, log, ready, args)
    if wait:
        wait_ready(d)
    return d


def _popen(args: list[str], log: Path, env: dict[str, str] | None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as fh:
        return subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=daemon_env(env), cwd=ROOT)


def launch_pair(workdir: Path, started: list[DaemonProc], *extra: str, **kw: Any) -> tuple[DaemonProc, DaemonProc]:
    """A prefill and a decode daemon, started in parallel (NIXL start-up is ~3 s each)."""
    pre = launch(workdir, "prefill", *extra, wait=False, **kw)
    dec = launch(workdir, "decode", *extra, wait=False, **kw)
    started += [pre, dec]
    wait_ready(pre)
    wait_ready(dec)
    return pre, dec


def pinned_listen(host: str = "127.0.0.1") -> str:
    """A free peer address to restart on, with its port below the kernel's ephemeral range.

    A port the kernel handed out (`:0`) lies inside that range: once its daemon dies, any
    outgoing connection on the host -- the peer's own reconnects to it included -- can take it
    as a source port, and the restart fails with "address in use" (seen once in CI).
    """
    span = ephemeral_port_range()
    assert span is not None, "no net.ipv4.ip_local_port_range here"
    low = span[0]
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 8000), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return f"{host}:{port}"
    raise AssertionError(f"no free port below {low} on {host}")


def restart(d: DaemonProc, env: dict[str, str] | None = None) -> None:
    """Starts the same command line again: same socket, daemon id and --peer-listen (see pinned_listen)."""
    assert d.proc.poll() is not None, "restart a daemon only after it died"
    d.ready_file.unlink(missing_ok=True)
    d.proc = _popen(d.args, d.log, env)
    wait_ready(d)


def status(socket: str, timeout: float = 5.0) -> engine_pb2.DaemonStatus:
    with grpc.insecure_channel(f"unix:{socket}") as ch:
        return engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=timeout)


def wait_until(pred: Callable[[], bool], timeout: float, what: str, every: float = 0.02) -> float:
    """Polls pred until true; returns the seconds it took. Fails the test with `what` on timeout."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def wait_no_slots(*ds: DaemonProc, timeout: float = 10.0) -> None:
    """Zero slots held (every ring, both roles) and the daemon still answers."""
    for d in ds:
        last: list[int] = [-1]

        def free(d: DaemonProc = d, last: list[int] = last) -> bool:
            last[0] = status(d.socket).slots_held
            return last[0] == 0

        try:
            wait_until(free, timeout, f"{d.name} to hold no slots")
        except AssertionError:
            raise AssertionError(f"{d.name} still holds {last[0]} slots:\n{d.log_text()[-3000:]}") from None


def peer_state(d: DaemonProc, peer: str) -> str:
    return next((p.state for p in status(d.socket).peers if p.daemon_id == peer), "")


def log_lines(d: DaemonProc, needle: str) -> list[str]:
    return [ln for ln in d.log_text().splitlines() if needle in ln]


def assert_alive(*ds: DaemonProc) -> None:
    for d in ds:
        assert d.proc.poll() is None, f"daemon {d.name} died ({d.proc.returncode}):\n{d.log_text()[-3000:]}"
        assert status(d.socket).serving, f"daemon {d.name} stopped serving"


def inject_transfer_errors(d: DaemonProc, n: int) -> None:
    """Test-only hook (daemon started with fault_injection=true): the next n NIXL posts end in ERROR."""
    fault_command(d, str(n))


def fault_command(d: DaemonProc, command: str) -> None:
    """Test-only hook (fault_injection=true), one command of kvxferd.ops.faults.fault_control: `N` fails the
    next N NIXL posts; `break S` breaks the pair's NIXL connection (rebuilds fail for S s); `delay S` holds the next WRITE; `stall S` blocks the daemon's event loop (its peers lose it,
    its workers go on posting); `register BYTES` / `release` change the daemon's NIXL metadata as importing
    or releasing a GPU ring does."""
    ctl = Path(d.socket + ".faults")
    wait_until(lambda: not ctl.exists(), 5, "the previous fault command to be taken")
    tmp = ctl.with_suffix(".tmp")
    tmp.write_text(command + "\n")
    os.replace(tmp, ctl)
    wait_until(lambda: not ctl.exists(), 5, f"the fault command {command!r} to be taken")


def metric(d: DaemonProc, name: str, label: str = "") -> float:
    """Sum of a Prometheus sample over its label sets (those holding `label`, e.g. 'method="X"',
    when given), scraped from the daemon's /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line.rsplit(" ", 1)[0]:
            total += float(line.rsplit(" ", 1)[1])
    return total


# --------------------------------------------------------------------------- netns


@dataclass
class NetPair:
    """Two network namespaces joined by a veth pair; `cut()` drops every packet both ways."""

    ns: tuple[str, str]
    ips: tuple[str, str]
    devs: tuple[str, str]

    def run(self, i: int, *cmd: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.ns[i], *cmd], check=True, capture_output=True, timeout=10)

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[i]]

    def cut(self) -> None:
        # Blackhole routes drop silently (no RST, no ICMP): a partition, not a crash, so only
        # heartbeat timeouts can tell; established TCP connections survive it.
        self.run(0, "ip", "route", "add", "blackhole", f"{self.ips[1]}/32")
        self.run(1, "ip", "route", "add", "blackhole", f"{self.ips[0]}/32")

    def restore(self) -> None:
        self.run(0, "ip", "route", "del", "blackhole", f"{self.ips[1]}/32")
        self.run(1, "ip", "route", "del", "blackhole", f"{self.ips[0]}/32")

    def close(self) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def netns_unavailable() -> str:
    """Empty if this process may create network namespaces, else why not (the skip reason)."""
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN); CI runs it as root"
    try:
        out = subprocess.run(["ip", "-V"], capture_output=True, timeout=5)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return "iproute2 (`ip`) is not installed"
    if out.returncode != 0:
        return "iproute2 (`ip`) does not run"
    probe = f"kvxprobe{os.getpid()}"
    got = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if got.returncode != 0:
        return f"cannot create a network namespace here: {got.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return ""


def make_netpair(tag: str) -> NetPair:
    # Names stay short (IFNAMSIZ 15) and unique per test process; 10.231.x/24 is private and lives
    # only inside the two namespaces created here.
    n = os.getpid() % 200 + 20
    pair = NetPair((f"kvx{tag}{n}a", f"kvx{tag}{n}b"), (f"10.231.{n}.1", f"10.231.{n}.2"),
                   (f"kvx{n}{tag}a", f"kvx{n}{tag}b"))
    pair.close()
    cmds = [
        ["ip", "netns", "add", pair.ns[0]],
        ["ip", "netns", "add", pair.ns[1]],
        ["ip", "link", "add", pair.devs[0], "type", "veth", "peer", "name", pair.devs[1]],
        ["ip", "link", "set", pair.devs[0], "netns", pair.ns[0]],
        ["ip", "link", "set", pair.devs[1], "netns", pair.ns[1]],
    ]
    for i in (0, 1):
        cmds += [
            ["ip", "-n", pair.ns[i], "addr", "add", f"{pair.ips[i]}/24", "dev", pair.devs[i]],
            ["ip", "-n", pair.ns[i], "link", "set", pair.devs[i], "up"],
            ["ip", "-n", pair.ns[i], "link", "set", "lo", "up"],
        ]
    try:
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True, timeout=10)
    except Exception:
        pair.close()
        raise
    return pair


# --------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class Job:
    """What one engine process does. Rooms are sent/expected in order."""

    role: str  # "prefill" | "decode"
    socket: str
    group: str
    rooms: tuple[RoomPlan, ...]
    rank: int = 0
    tp: int = 1
    ring_bytes: int = 4 << 20
    prefill_address: str = ""  # decode
    prefill_group: str = ""  # decode
    in_flight: int = 4  # rooms open at once
    chunk_delay_s: float = 0.0  # prefill: pause between rounds of chunks (keeps rooms mid-transfer)
    consume_delay_s: float = 0.0  # decode: a landed chunk is watermarked this long after it landed
    stall: frozenset[int] = frozenset()  # decode: rooms whose chunks are never watermarked
    abort_after: tuple[tuple[int, int], ...] = ()  # decode: (room, chunks) abort once that many landed
    deadline_ms: int = 0  # decode: ExpectRoom deadline
    lease_ms: int = 0
    timeout_s: float = 90.0
    wait_go: bool = False  # prefill: register, then send nothing until Fleet.go()

    @property
    def who(self) -> str:
        return f"{self.role}:{self.group}:{self.rank}"


def _finished_report(job: Job, room: int, st: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "kind": "room", "who": job.who, "room": room, "state": st.state.name, "code": st.failure_code,
        "reason": st.failure_reason, "t": time.time(), **(extra or {}),
    }


def _daemon_gone(exc: BaseException) -> bool:
    return isinstance(exc, KvxferError) and exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def run_prefill(job: Job, q: Any, stop: Any, go: Any) -> None:
    """Sends rooms round-robin (one chunk of each open room per round); a poller thread reports
    every room's end the moment it sees it. After `stop` no new room is started."""
    try:
        tx = PrefillSender(socket=job.socket, group=job.group, layout=LAYOUT, tp_size=job.tp, tp_rank=job.rank,
                           ring_bytes=job.ring_bytes, name=job.who, lease_ms=job.lease_ms)
    except Exception:
        q.put({"kind": "exit", "who": job.who, "error": traceback.format_exc()})
        return
    q.put({"kind": "ready", "who": job.who, "pid": os.getpid(), "engine_id": tx.engine_id})
    pending: dict[int, bool] = {}  # room -> this engine stopped sending it (last chunk in, or refused)
    ended: set[int] = set()  # rooms whose end was reported
    lock = threading.Lock()
    done = threading.Event()
    gone = threading.Event()

    def poller() -> None:
        while not done.is_set():
            with lock:
                rooms = list(pending.items())
            for r, sent in rooms:
                if r not in ended:
                    try:
                        st = tx.poll(r)
                    except KvxferError as exc:
                        if _daemon_gone(exc):
                            gone.set()
                            for rr, _ in rooms:
                                q.put({"kind": "room", "who": job.who, "room": rr, "state": "DAEMON_GONE",
                                       "code": "", "reason": exc.message, "t": time.time()})
                            with lock:
                                pending.clear()
                            return
                        continue
                    if not st.finished:
                        continue
                    q.put(_finished_report(job, r, st))
                    ended.add(r)
                # Released only once the sender is done with it: a chunk enqueued after the
                # release would open a new room under the same key.
                if sent:
                    try:
                        tx.release(r)
                    except KvxferError:
                        pass
                    with lock:
                        pending.pop(r, None)
            time.sleep(POLL_S)

    th = threading.Thread(target=poller, daemon=True)
    th.start()
    try:
        if job.wait_go and not go.wait(job.timeout_s):
            raise TimeoutError(f"{job.who}: never told to go")
        todo = list(job.rooms)
        active: list[list[Any]] = []  # [plan, next chunk, next token]
        deadline = time.monotonic() + job.timeout_s
        while (todo or active) and not gone.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job.who}: still sending after {job.timeout_s} s")
            if stop.is_set():
                todo.clear()
            with lock:
                open_rooms = len(pending) + sum(1 for a in active if a[0].room not in pending)
            while todo and open_rooms < job.in_flight:
                active.append([todo.pop(0), 0, 0])
                open_rooms += 1
            if not active:
                time.sleep(POLL_S)
                continue
            for a in list(active):
                plan, cid, start = a
                if plan.room in ended:
                    active.remove(a)  # it failed under us: stop sending it
                    with lock:
                        pending[plan.room] = True
                    continue
                ntok = plan.chunks[cid]
                last = cid == len(plan.chunks) - 1
                data = part_bytes_for(LAYOUT, job.tp, job.rank, plan.room, cid, ntok)
                try:
                    tx.send_chunk(plan.room, cid, start, ntok, data.data, last=last,
                                  aux=b"aux-%d" % plan.room if last else b"", timeout=job.timeout_s)
                except KvxferError as exc:
                    active.remove(a)
                    draining = exc.code == grpc.StatusCode.UNAVAILABLE and "draining" in exc.message
                    if _daemon_gone(exc) and not draining:
                        gone.set()
                        break
                    if cid == 0:
                        # Refused before it started: this engine never handed the room over.
                        q.put({"kind": "room", "who": job.who, "room": plan.room, "state": "REFUSED",
                               "code": exc.code.name, "reason": exc.message, "t": time.time()})
                        if draining:
                            todo.clear()
                    else:
                        # The room ended under us (a fault); the poller reports how.
                        q.put({"kind": "enqueue_refused", "who": job.who, "room": plan.room, "chunk": cid,
                               "code": exc.code.name, "reason": exc.message, "t": time.time()})
                        with lock:
                            pending[plan.room] = True
                    continue
                if cid == 0:
                    with lock:
                        pending[plan.room] = False
                q.put({"kind": "sent", "who": job.who, "room": plan.room, "chunk": cid, "t": time.time()})
                a[1], a[2] = cid + 1, start + ntok
                if last:
                    active.remove(a)
                    with lock:
                        pending[plan.room] = True
            if job.chunk_delay_s:
                time.sleep(job.chunk_delay_s)
        while not gone.is_set():
            with lock:
                if not pending:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job.who}: rooms unfinished after {job.timeout_s} s: {list(pending)[:5]}")
            time.sleep(POLL_S)
        done.set()
        th.join(5)
        q.put({"kind": "exit", "who": job.who, "error": None, "daemon_gone": gone.is_set()})
    except Exception:
        done.set()
        q.put({"kind": "exit", "who": job.who, "error": traceback.format_exc()})
    finally:
        try:
            tx.close(unregister=not gone.is_set())
        except Exception:
            pass


def run_decode(job: Job, q: Any, stop: Any, go: Any) -> None:
    """Expects rooms (up to in_flight open), checks every landed byte, watermarks (after
    consume_delay_s; never for stalled rooms), aborts where told, releases finished rooms."""
    try:
        rx = DecodeReceiver(socket=job.socket, group=job.group, layout=LAYOUT, tp_size=job.tp, tp_rank=job.rank,
                            ring_bytes=job.ring_bytes, name=job.who, lease_ms=job.lease_ms)
    except Exception:
        q.put({"kind": "exit", "who": job.who, "error": traceback.format_exc()})
        return
    q.put({"kind": "ready", "who": job.who, "pid": os.getpid(), "engine_id": rx.engine_id})
    by_id = {p.room: p for p in job.rooms}
    abort_after = dict(job.abort_after)
    gone = False
    try:
        todo = list(job.rooms)
        active: dict[int, set[int]] = {}
        checked: dict[int, int] = {}
        due: list[tuple[float, int, int]] = []  # (when, room, chunk) watermarks not yet given
        deadline = time.monotonic() + job.timeout_s
        while todo or active:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job.who}: rooms unfinished after {job.timeout_s} s: {list(active)[:5]}")
            if stop.is_set():
                todo.clear()
            while todo and len(active) < job.in_flight:
                p = todo.pop(0)
                try:
                    rx.expect(p.room, job.prefill_address, job.prefill_group, p.num_tokens, deadline_ms=job.deadline_ms)
                except KvxferError as exc:
                    if _daemon_gone(exc) and "draining" not in exc.message:
                        raise
                    q.put({"kind": "room", "who": job.who, "room": p.room, "state": "REFUSED",
                           "code": exc.code.name, "reason": exc.message, "t": time.time()})
                    todo.clear()
                    break
                active[p.room] = set()
                checked[p.room] = 0
                q.put({"kind": "expected", "who": job.who, "room": p.room, "t": time.time()})
            now = time.monotonic()
            for item in [d for d in due if d[0] <= now]:
                due.remove(item)
                _, r, c = item
                if r in active:
                    try:
                        rx.watermark(r, [c])
                    except KvxferError as exc:
                        if _daemon_gone(exc):
                            raise
                        # The room failed in between: its slots went back with it.
            for r in list(active):
                st = rx.poll(r)
                plan = by_id[r]
                starts = np.cumsum((0, *plan.chunks))
                for c in st.landed:
                    if c.chunk_id in active[r]:
                        continue
                    want = part_bytes_for(LAYOUT, job.tp, job.rank, r, c.chunk_id, plan.chunks[c.chunk_id])
                    got = np.frombuffer(rx.read(c), dtype=np.uint8)
                    if c.token_start != starts[c.chunk_id] or c.num_tokens != plan.chunks[c.chunk_id]:
                        raise AssertionError(f"room {r} chunk {c.chunk_id}: wrong token range {c}")
                    if got.shape != want.shape or not np.array_equal(got, want):
                        raise AssertionError(f"room {r} chunk {c.chunk_id} rank {job.rank}: bytes differ")
                    checked[r] += want.nbytes
                    active[r].add(c.chunk_id)
                    q.put({"kind": "landed", "who": job.who, "room": r, "chunk": c.chunk_id, "t": time.time()})
                    if r not in job.stall:
                        due.append((time.monotonic() + job.consume_delay_s, r, c.chunk_id))
                    if r in abort_after and len(active[r]) >= abort_after[r]:
                        del abort_after[r]
                        t_abort = time.time()
                        rx.abort(r, "test: decode engine aborts mid-room")
                        q.put({"kind": "aborted", "who": job.who, "room": r, "t": t_abort})
                if st.finished:
                    if st.state is RoomState.SUCCESS:
                        if any(d[1] == r for d in due):
                            continue  # report after its last watermark
                        if len(active[r]) != len(plan.chunks):
                            raise AssertionError(f"room {r}: SUCCESS with {len(active[r])}/{len(plan.chunks)} chunks")
                        if st.aux != b"aux-%d" % r:
                            raise AssertionError(f"room {r}: aux {st.aux!r}")
                    q.put(_finished_report(job, r, st, {"bytes": checked[r], "chunks": len(active[r])}))
                    rx.release(r)
                    del active[r]
                    due[:] = [d for d in due if d[1] != r]
            time.sleep(POLL_S)
        q.put({"kind": "exit", "who": job.who, "error": None, "daemon_gone": False})
    except KvxferError as exc:
        gone = _daemon_gone(exc)
        q.put({"kind": "exit", "who": job.who, "error": None if gone else traceback.format_exc(), "daemon_gone": gone})
    except Exception:
        q.put({"kind": "exit", "who": job.who, "error": traceback.format_exc()})
    finally:
        try:
            rx.close(unregister=not gone)
        except Exception:
            pass


@dataclass
class Fleet:
    """Engine processes of one test and everything they reported."""

    ctx: Any = field(default_factory=lambda: mp.get_context("spawn"))
    procs: dict[str, Any] = field(default_factory=dict)
    jobs: dict[str, Job] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    exits: dict[str, dict[str, Any]] = field(default_factory=dict)
    ready: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # One queue per engine process: a queue's writers share a lock, and an engine killed with
        # SIGKILL while its feeder thread holds it would stop every other engine's events (and,
        # as their feeders join at exit, their exits) for good.
        self.queues: dict[str, Any] = {}
        self.stops: dict[str, Any] = {}
        self.gos: dict[str, Any] = {}

    def start(self, *jobs: Job, wait: bool = True) -> None:
        for job in jobs:
            target = run_prefill if job.role == "prefill" else run_decode
            self.stops[job.who] = self.ctx.Event()
            self.gos[job.who] = self.ctx.Event()
            self.queues[job.who] = self.ctx.Queue()
            p = self.ctx.Process(target=target, args=(job, self.queues[job.who], self.stops[job.who], self.gos[job.who]),
                                 name=job.who, daemon=True)
            p.start()
            self.procs[job.who] = p
            self.jobs[job.who] = job
        if wait:
            names = [j.who for j in jobs]
            self.wait_for(lambda: all(n in self.ready for n in names), 60, f"engines {names} to register")

    def pump(self, timeout: float = 0.05) -> None:
        end = time.monotonic() + timeout
        while True:
            got = 0
            for q in list(self.queues.values()):
                while True:
                    try:
                        ev = q.get_nowait()
                    except queue.Empty:
                        break
                    got += 1
                    self._record(ev)
            if time.monotonic() >= end:
                return
            if not got:
                time.sleep(0.002)

    def _record(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)
        if ev["kind"] == "ready":
            self.ready[ev["who"]] = ev
        elif ev["kind"] == "exit":
            self.exits[ev["who"]] = ev
            if ev.get("error"):
                raise AssertionError(f"engine {ev['who']} failed:\n{ev['error']}")

    def wait_for(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}; last events: {self.events[-8:]}")
            for who, p in self.procs.items():
                if not p.is_alive() and who not in self.exits and p.exitcode not in (None, 0, -9):
                    raise AssertionError(f"engine {who} died with {p.exitcode}")
            self.pump(0.02)

    def rooms(self, who: str) -> dict[int, dict[str, Any]]:
        return {e["room"]: e for e in self.events if e["kind"] == "room" and e["who"] == who}

    def of_kind(self, kind: str, who: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind and (who is None or e["who"] == who)]

    def landed_rooms(self, who: str) -> set[int]:
        return {e["room"] for e in self.of_kind("landed", who)}

    def kill(self, who: str) -> float:
        t = time.time()
        os.kill(self.procs[who].pid, 9)
        self.procs[who].join(10)
        return t

    def finish(self, *whos: str, timeout: float = 90.0) -> None:
        names = list(whos or self.procs)
        self.wait_for(lambda: all(n in self.exits or not self.procs[n].is_alive() for n in names), timeout,
                      f"engines {names} to finish")
        self.pump(0.1)
        for n in names:
            self.procs[n].join(10)

    def go(self, *jobs: Job) -> None:
        """Engines started with wait_go begin sending."""
        for job in jobs:
            self.gos[job.who].set()

    def stop(self, *jobs: Job) -> None:
        """These engines start no new room (open rooms go on)."""
        for job in jobs:
            self.stops[job.who].set()

    def close(self) -> None:
        for ev in self.stops.values():
            ev.set()
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)


def plans(first: int, n: int, chunks: Iterable[int]) -> tuple[RoomPlan, ...]:
    c = tuple(chunks)
    return tuple(RoomPlan(first + i, c) for i in range(n))


# --------------------------------------------------------------------------- timings


def record_timing(fault: str, what: str, seconds: Sequence[float], note: str = "") -> None:
    """Prints time-to-FAILED numbers; KVX_FAULT_TIMINGS=FILE also appends them as JSON lines
    (docs/faults.md is written from that file)."""
    vals = sorted(seconds)
    row = {"fault": fault, "what": what, "n": len(vals), "min_s": round(vals[0], 4) if vals else None,
           "max_s": round(vals[-1], 4) if vals else None, "median_s": round(vals[len(vals) // 2], 4) if vals else None,
           "note": note}
    print("time-to-FAILED", json.dumps(row))
    out = os.environ.get("KVX_FAULT_TIMINGS")
    if out:
        with open(out, "a") as fh:
            fh.write(json.dumps(row) + "\n")


_FAILED_RE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ kvxferd(?:\.\w+)+ \[[^\]]*\] room (\d+)\.(\d+): "
    r"(prefill|decode) side FAILED \((\w+)\): (.*)$"
)


def failures_in_log(d: DaemonProc, side: str) -> dict[int, tuple[float, str, str]]:
    """room -> (wall time, failure code, reason) of the rooms the daemon logged as FAILED on one side.
    For rooms whose engine is dead (nobody left to poll them) the log is the only witness."""
    out: dict[int, tuple[float, str, str]] = {}
    for ln in d.log_text().splitlines():
        m = _FAILED_RE.match(ln)
        if m and m.group(4) == side:
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.setdefault(int(m.group(2)), (t, m.group(5), m.group(6)))
    return out


def jobs(pre: DaemonProc, dec: DaemonProc, group: str, rooms: tuple[RoomPlan, ...], **kw: object) -> tuple[Job, Job]:
    """A prefill and a decode engine job for one group; `p_x`/`d_x` set x on one side only."""
    both = {k: v for k, v in kw.items() if not k.startswith(("p_", "d_"))}
    pkw = {**both, **{k[2:]: v for k, v in kw.items() if k.startswith("p_")}}
    dkw = {**both, **{k[2:]: v for k, v in kw.items() if k.startswith("d_")}}
    p = Job("prefill", pre.socket, f"{group}-pre", rooms, **pkw)  # type: ignore[arg-type]
    d = Job("decode", dec.socket, f"{group}-dec", rooms, prefill_address=pre.peer_address,
            prefill_group=f"{group}-pre", **dkw)  # type: ignore[arg-type]
    return p, d
