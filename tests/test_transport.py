"""Transport tests: real NIXL (one agent in another process), peer restart, faults, LocalTransport."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from kvxferd.transports.interface import (
    FaultInjector,
    LocalTransport,
    Transport,
    TransportError,
    XferHandle,
    XferState,
    coalesce,
)
from kvxferd.transports.nixl import NixlTransport, agent_name_from_metadata
from tests.conftest import ROOT

MiB = 1 << 20


def _pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# -- a NIXL peer in its own process ------------------------------------------------------------

def _peer_main(conn: Connection, name: str, nbytes: int) -> None:
    """Child: a receiving NixlTransport. Sends (metadata, buffer address), then serves
    ("wait", notif, timeout) -> notifications seen so far, ("read", off, n) -> bytes, ("exit",)."""
    parent = os.getppid()  # the fork server, which exits with the test process
    deadline = time.monotonic() + 300  # pytest's own timeout; never outlive a broken run by much
    t = NixlTransport(name)
    buf = np.zeros(nbytes, dtype=np.uint8)
    t.register_region(buf.ctypes.data, nbytes)
    conn.send((t.metadata(), buf.ctypes.data))
    seen: list[tuple[str, bytes]] = []
    waiting: tuple[bytes, float] | None = None
    while time.monotonic() < deadline and os.getppid() == parent:
        # Polling notifications also drives this agent's UCX progress (no progress thread here).
        seen.extend(t.get_notifs())
        if waiting is not None and (any(m == waiting[0] for _, m in seen) or time.monotonic() > waiting[1]):
            conn.send(list(seen))
            waiting = None
        if conn.poll(0.001):
            cmd = conn.recv()
            if cmd[0] == "wait":
                waiting = (cmd[1], time.monotonic() + cmd[2])
            elif cmd[0] == "read":
                conn.send(bytes(buf[cmd[1]:cmd[1] + cmd[2]]))
            elif cmd[0] == "exit":
                break
    t.close()


def _context() -> Any:
    # A fresh interpreter pays `import nixl` (which imports torch on a CPU-only box: ~4 s of CPU)
    # once in the fork server; each peer is then a cheap fork of a process that has no NIXL
    # agent or UCX state yet.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["nixl._api", "numpy"])
    return ctx


class Peer:
    def __init__(self, name: str, nbytes: int = 4 * MiB) -> None:
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, name, nbytes), daemon=True)
        self.proc.start()
        child.close()
        self._md: tuple[bytes, int] | None = None

    def _recv(self, timeout: float = 30.0) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"peer process did not answer in {timeout} s (exit code {self.proc.exitcode})")
        return self.conn.recv()

    @property
    def metadata(self) -> bytes:
        if self._md is None:
            self._md = self._recv()
        return self._md[0]

    @property
    def addr(self) -> int:
        self.metadata  # noqa: B018 - waits for the child to report
        assert self._md is not None
        return self._md[1]

    def wait_notif(self, msg: bytes, timeout: float = 10.0) -> list[tuple[str, bytes]]:
        self.conn.send(("wait", msg, timeout))
        got: list[tuple[str, bytes]] = self._recv(timeout + 10)
        return got

    def read(self, off: int, n: int) -> bytes:
        self.conn.send(("read", off, n))
        data: bytes = self._recv()
        return data

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
            except OSError:
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.kill()


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, Peer]]:
    """Started together at module scope, from one fork server that paid for `import nixl` once.

    Both use one agent name: "restarted" plays "rx" after a restart (the restart test kills "rx",
    so it runs after every other test that needs "rx").
    """
    started = {"rx": Peer("kvx-test-rx"), "restarted": Peer("kvx-test-rx")}
    try:
        yield started
    finally:
        for p in started.values():
            p.stop()


@pytest.fixture(scope="module")
def tx() -> Iterator[NixlTransport]:
    t = NixlTransport("kvx-test-tx")
    yield t
    t.close()


@pytest.fixture(scope="module")
def src(tx: NixlTransport) -> Iterator[np.ndarray]:
    buf = _pattern(7, 4 * MiB)
    tx.register_region(buf.ctypes.data, buf.nbytes)
    yield buf
    tx.deregister_region(buf.ctypes.data)


def _wait(t: Transport, h: object, timeout: float = 10.0, pump: Transport | None = None) -> XferState:
    deadline = time.monotonic() + timeout
    while True:
        state = t.check(h)
        if state is not XferState.PENDING or time.monotonic() > deadline:
            return state
        if pump is not None:
            pump.get_notifs()  # an in-process receiver must make progress too
        time.sleep(0.0005)


# -- NIXL between two processes ------------------------------------------------------------

def test_write_to_another_process_lands_before_its_notification(
    peers: dict[str, Peer], tx: NixlTransport, src: np.ndarray
) -> None:
    rx = peers["rx"]
    assert tx.add_remote(rx.metadata) == "kvx-test-rx"
    base = src.ctypes.data
    # Three pairs; the first two are contiguous on both sides and go out as one descriptor.
    pairs = [(base, rx.addr, MiB), (base + MiB, rx.addr + MiB, MiB), (base + 3 * MiB, rx.addr + 2 * MiB, 512 << 10)]
    h = tx.post_write("kvx-test-rx", pairs, b"room 1 chunk 0")
    assert isinstance(h, XferHandle) and h.nbytes == 2 * MiB + (512 << 10)
    assert _wait(tx, h) is XferState.DONE
    tx.release(h)
    tx.release(h)  # twice is harmless
    notifs = rx.wait_notif(b"room 1 chunk 0")
    assert ("kvx-test-tx", b"room 1 chunk 0") in notifs
    # The child read nothing until the notification arrived; the bytes are all there.
    assert rx.read(0, 2 * MiB) == src[: 2 * MiB].tobytes()
    assert rx.read(2 * MiB, 512 << 10) == src[3 * MiB: 3 * MiB + (512 << 10)].tobytes()
    assert rx.read(2 * MiB + (512 << 10), 16) == bytes(16)  # nothing beyond


def test_post_errors_are_transport_errors(peers: dict[str, Peer], tx: NixlTransport, src: np.ndarray) -> None:
    rx = peers["rx"]
    tx.add_remote(rx.metadata)
    with pytest.raises(TransportError, match="nobody"):
        tx.post_write("nobody", [(src.ctypes.data, rx.addr, 4096)], b"x")
    with pytest.raises(TransportError):  # remote range outside what the peer registered
        tx.post_write("kvx-test-rx", [(src.ctypes.data, rx.addr + 64 * MiB, 4096)], b"x")
    with pytest.raises(TransportError, match="bad transfer pair"):
        tx.post_write("kvx-test-rx", [(src.ctypes.data, rx.addr, 0)], b"x")
    with pytest.raises(TransportError, match="at least one"):
        tx.post_write("kvx-test-rx", [], b"x")


def test_restarted_peer_is_replaced_and_removal_is_idempotent(
    peers: dict[str, Peer], tx: NixlTransport, src: np.ndarray
) -> None:
    old, new = peers["rx"], peers["restarted"]
    name = tx.add_remote(old.metadata)
    assert name == "kvx-test-rx"
    assert tx.add_remote(old.metadata) == name  # the same metadata again: nothing changes
    h = tx.post_write(name, [(src.ctypes.data, old.addr, MiB)], b"before")
    assert _wait(tx, h) is XferState.DONE
    tx.release(h)
    assert ("kvx-test-tx", b"before") in old.wait_notif(b"before")

    old.kill()
    # The writer learns of the death: a post raises, or its WRITE ends in ERROR (UCX sees the
    # connection drop within tens of ms on loopback).
    deadline = time.monotonic() + 10
    failed = ""
    while not failed and time.monotonic() < deadline:
        try:
            h = tx.post_write(name, [(src.ctypes.data, old.addr, MiB)], b"to the dead")
        except TransportError as exc:
            failed = str(exc)
            break
        if _wait(tx, h, 5) is XferState.ERROR:
            failed = h.error
        tx.release(h)
        time.sleep(0.02)
    assert failed, "a WRITE to a killed peer never failed"

    # Same agent name, new process: re-adding replaces the old entry (NIXL refuses to load it
    # over the old one; the transport removes the old one first) and WRITEs land in the new one.
    assert tx.add_remote(new.metadata) == name
    h = tx.post_write(name, [(src.ctypes.data + MiB, new.addr, MiB)], b"after")
    assert _wait(tx, h) is XferState.DONE, h.error
    tx.release(h)
    assert ("kvx-test-tx", b"after") in new.wait_notif(b"after")
    assert new.read(0, MiB) == src[MiB: 2 * MiB].tobytes()

    tx.remove_remote(name)
    tx.remove_remote(name)
    tx.remove_remote("never-added")
    with pytest.raises(TransportError):
        tx.post_write(name, [(src.ctypes.data, new.addr, 4096)], b"gone")
    # And back again after an explicit removal.
    assert tx.add_remote(new.metadata) == name
    h = tx.post_write(name, [(src.ctypes.data, new.addr, 4096)], b"again")
    assert _wait(tx, h) is XferState.DONE
    tx.release(h)


# -- NIXL in one process ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_pair() -> Iterator[tuple[NixlTransport, NixlTransport, np.ndarray, np.ndarray]]:
    injector = FaultInjector()
    # Four UCX workers on the posting side, as a daemon with four transfer threads has.
    a = NixlTransport("kvx-test-a", fault_injector=injector, num_workers=4)
    b = NixlTransport("kvx-test-b")
    sbuf, dbuf = _pattern(3, 8 * MiB), np.zeros(8 * MiB, dtype=np.uint8)
    a.register_region(sbuf.ctypes.data, sbuf.nbytes)
    b.register_region(dbuf.ctypes.data, dbuf.nbytes)
    assert a.add_remote(b.metadata()) == "kvx-test-b"
    yield a, b, sbuf, dbuf
    a.close()
    b.close()


def test_fault_injector_makes_check_return_error(
    local_pair: tuple[NixlTransport, NixlTransport, np.ndarray, np.ndarray]
) -> None:
    a, b, sbuf, dbuf = local_pair
    injector = a._faults
    assert injector is not None
    dbuf[:] = 0
    b.get_notifs()
    s, d = sbuf.ctypes.data, dbuf.ctypes.data
    injector.fail_next(2)
    bad = [a.post_write("kvx-test-b", [(s, d, 4096)], b"f%d" % i) for i in range(2)]
    assert [a.check(h) for h in bad] == [XferState.ERROR, XferState.ERROR]
    assert all(h.error == "injected fault" for h in bad if isinstance(h, XferHandle))
    for h in bad:
        a.release(h)
    injector.fail_matching(lambda remote, pairs, notif: notif.startswith(b"drop"))
    dropped = a.post_write("kvx-test-b", [(s, d + 8192, 4096)], b"drop me")
    good = a.post_write("kvx-test-b", [(s, d, 4096)], b"keep")
    assert a.check(dropped) is XferState.ERROR
    assert _wait(a, good, pump=b) is XferState.DONE
    a.release(good)
    a.release(dropped)
    injector.clear()
    assert not injector.armed
    # Failed posts moved nothing and sent nothing.
    deadline = time.monotonic() + 5
    notifs: list[tuple[str, bytes]] = []
    while not notifs and time.monotonic() < deadline:
        notifs += b.get_notifs()
    time.sleep(0.05)
    notifs += b.get_notifs()
    assert notifs == [("kvx-test-a", b"keep")]
    assert dbuf[:4096].tobytes() == sbuf[:4096].tobytes()
    assert not dbuf[4096:].any()


def test_threads_post_and_poll_at_once(
    local_pair: tuple[NixlTransport, NixlTransport, np.ndarray, np.ndarray]
) -> None:
    """Several threads posting on one agent with one UCX worker each, plus control-path calls: the
    default NIXL sync mode segfaults here."""
    a, b, sbuf, dbuf = local_pair
    assert a._agent.get_backend_params("UCX")["num_workers"] == "4"
    dbuf[:] = 0
    b.get_notifs()
    threads, posts, size = 4, 30, 64 << 10  # 7.5 MiB of the 8 MiB buffers
    errors: list[str] = []
    stop = threading.Event()
    got: list[tuple[str, bytes]] = []

    def worker(i: int) -> None:
        try:
            for k in range(posts):
                off = (i * posts + k) * size
                h = a.post_write("kvx-test-b", [(sbuf.ctypes.data + off, dbuf.ctypes.data + off, size)], b"w%d-%d" % (i, k))
                state = _wait(a, h)
                a.release(h)
                if state is not XferState.DONE:
                    errors.append(f"{i}/{k}: {state}")
        except Exception as exc:
            errors.append(repr(exc))

    def receiver() -> None:
        while not stop.is_set():
            got.extend(b.get_notifs())
            time.sleep(0.0002)

    def control() -> None:
        scratch = np.zeros(4096, dtype=np.uint8)
        while not stop.is_set():
            a.register_region(scratch.ctypes.data, scratch.nbytes)
            a.metadata()
            a.deregister_region(scratch.ctypes.data)

    pumps = [threading.Thread(target=receiver), threading.Thread(target=control)]
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pumps + workers:
        t.start()
    for t in workers:
        t.join(60)
    deadline = time.monotonic() + 5
    while len(got) < threads * posts and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for t in pumps:
        t.join(10)
    assert not errors
    assert sorted(m for _, m in got) == sorted(b"w%d-%d" % (i, k) for i in range(threads) for k in range(posts))
    n = threads * posts * size
    assert dbuf[:n].tobytes() == sbuf[:n].tobytes()


def test_close_deregisters_everything_and_refuses_posts(
    local_pair: tuple[NixlTransport, NixlTransport, np.ndarray, np.ndarray]
) -> None:
    _, b, _, dbuf = local_pair
    t = NixlTransport("kvx-test-closing")
    one, two = np.zeros(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    t.register_region(one.ctypes.data, one.nbytes)
    t.register_region(two.ctypes.data, two.nbytes)
    with pytest.raises(TransportError, match="already registered"):
        t.register_region(one.ctypes.data, one.nbytes)
    assert t.add_remote(b.metadata()) == "kvx-test-b"
    t.close()
    assert not t._regions and not t._remotes
    with pytest.raises(TransportError, match="closed"):
        t.post_write("kvx-test-b", [(one.ctypes.data, dbuf.ctypes.data, 8)], b"late")
    with pytest.raises(TransportError, match="closed"):
        t.metadata()
    assert t.get_notifs() == []
    t.remove_remote("kvx-test-b")
    t.deregister_region(one.ctypes.data)
    t.close()  # twice is harmless


# -- pieces without NIXL ---------------------------------------------------------------------

def test_local_transport_moves_bytes_and_delivers_notifs_in_order() -> None:
    injector = FaultInjector()
    a, b = LocalTransport("local-a", fault_injector=injector), LocalTransport("local-b")
    assert isinstance(a, Transport)
    src, dst = _pattern(1, 1 << 16), np.zeros(1 << 16, dtype=np.uint8)
    a.register_region(src.ctypes.data, src.nbytes)
    b.register_region(dst.ctypes.data, dst.nbytes)
    try:
        with pytest.raises(TransportError, match="unknown"):
            a.post_write("local-b", [(src.ctypes.data, dst.ctypes.data, 16)], b"x")
        assert a.add_remote(b.metadata()) == "local-b"
        s, d = src.ctypes.data, dst.ctypes.data
        h1 = a.post_write("local-b", [(s, d, 100), (s + 100, d + 100, 100)], b"one")
        h2 = a.post_write("local-b", [(s + 1000, d + 2000, 50)], b"two")
        assert a.check(h1) is XferState.DONE and a.check(h2) is XferState.DONE
        a.release(h1)
        assert dst[:200].tobytes() == src[:200].tobytes()
        assert dst[2000:2050].tobytes() == src[1000:1050].tobytes()
        assert b.get_notifs() == [("local-a", b"one"), ("local-a", b"two")]
        assert b.get_notifs() == []
        with pytest.raises(TransportError, match="not registered"):
            a.post_write("local-b", [(s, d + (1 << 16) - 8, 16)], b"x")
        with pytest.raises(TransportError, match="not registered"):
            a.post_write("local-b", [(ctypes.addressof(ctypes.c_char()), d, 1)], b"x")
        injector.fail_next(1)
        h = a.post_write("local-b", [(s, d + 4096, 16)], b"lost")
        assert a.check(h) is XferState.ERROR and not dst[4096:4112].any()
        assert b.get_notifs() == []
        a.remove_remote("local-b")
        a.remove_remote("local-b")
        with pytest.raises(TransportError):
            a.post_write("local-b", [(s, d, 16)], b"x")
    finally:
        a.close()
        b.close()
    with pytest.raises(TransportError, match="no LocalTransport"):
        LocalTransport("local-c").add_remote(b.metadata())


def test_fault_injector_counts_exactly_across_threads() -> None:
    inj = FaultInjector()
    inj.fail_next(100)
    inj.fail_matching(lambda r, p, n: n == b"special", times=3)
    hits: list[int] = []
    lock = threading.Lock()

    def post_many() -> None:
        n = sum(inj.should_fail("peer", [(1, 2, 3)], b"plain") for _ in range(200))
        with lock:
            hits.append(n)

    ts = [threading.Thread(target=post_many) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sum(hits) == 100
    assert [inj.should_fail("p", [], b"special") for _ in range(4)] == [True, True, True, False]
    assert not inj.armed
    with pytest.raises(ValueError):
        inj.fail_next(-1)


def test_coalesce_and_metadata_name() -> None:
    assert coalesce([(100, 1000, 10), (110, 1010, 5), (200, 1015, 5)]) == [(100, 1000, 15), (200, 1015, 5)]
    assert coalesce([(100, 1000, 10), (110, 2000, 10)]) == [(100, 1000, 10), (110, 2000, 10)]
    name = b"kvxferd-abc"
    md = b"nixlSerDes|Agent" + len(name).to_bytes(8, "little") + name + b"|Conns..."
    assert agent_name_from_metadata(md) == "kvxferd-abc"
    assert agent_name_from_metadata(b"something else") is None
    assert agent_name_from_metadata(b"nixlSerDes|Agent" + (999).to_bytes(8, "little") + b"short") is None


def test_raw_nixl_pattern_and_arguments() -> None:
    from kvxferd.bench.raw_nixl import pattern_blocks, run_raw_nixl

    total = (16 << 20) + 13  # crosses a block boundary, not a multiple of 8
    blocks = list(pattern_blocks(5, total))
    assert sum(len(b) for _, b in blocks) == total and [o for o, _ in blocks] == [0, 16 << 20]
    again = np.concatenate([b for _, b in pattern_blocks(5, total)])
    assert np.array_equal(np.concatenate([b for _, b in blocks]), again)
    assert not np.array_equal(again[:4096], np.concatenate([b for _, b in pattern_blocks(6, 4096)]))
    for bad in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        with pytest.raises(ValueError):
            run_raw_nixl(*bad)


def test_changed_metadata_of_a_live_peer_replaces_its_entry() -> None:
    """A region registered after the first load is unknown until the peer's metadata is loaded
    again; a region released since must be unknown afterwards (NIXL's in-place load would keep it,
    and a GPU ring imported at its address later would be shadowed by the stale entry)."""
    import numpy as np

    a, b = NixlTransport("upd-a"), NixlTransport("upd-b")
    src = np.full(1 << 16, 7, dtype=np.uint8)
    first = np.zeros(1 << 16, dtype=np.uint8)
    late = np.zeros(1 << 16, dtype=np.uint8)

    def write(dst: np.ndarray, notif: bytes) -> XferState:
        h = a.post_write(name, [(src.ctypes.data, dst.ctypes.data, 4096)], notif)
        deadline = time.monotonic() + 20
        state = a.check(h)
        while state is XferState.PENDING and time.monotonic() < deadline:
            b.get_notifs()  # the receiver must progress for the first connection
            time.sleep(0.001)
            state = a.check(h)
        a.release(h)
        return state

    try:
        a.register_region(src.ctypes.data, src.nbytes)
        b.register_region(first.ctypes.data, first.nbytes)
        name = a.add_remote(b.metadata())
        assert write(first, b"w") is XferState.DONE
        b.register_region(late.ctypes.data, late.nbytes)
        with pytest.raises(TransportError):
            a.post_write(name, [(src.ctypes.data, late.ctypes.data, 4096)], b"x")
        assert a.add_remote(b.metadata()) == name
        assert write(late, b"y") is XferState.DONE
        assert (late[:4096] == 7).all() and (late[4096:] == 0).all()
        b.deregister_region(first.ctypes.data)
        assert a.add_remote(b.metadata()) == name
        with pytest.raises(TransportError):
            a.post_write(name, [(src.ctypes.data, first.ctypes.data, 4096)], b"z")
        assert write(late, b"again") is XferState.DONE
    finally:
        a.close()
        b.close()


def test_daemon_transport_does_not_import_torch() -> None:
    """The nixl meta package imports torch to choose a CUDA build when torch is a CPU build (~2.5 s
    of every daemon start on the CI machine); the daemon never needs torch for a host-memory agent."""
    code = (
        "import sys\n"
        "from kvxferd.transports.nixl import NixlTransport\n"
        "t = NixlTransport('no-torch-probe')\n"
        "t.close()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
