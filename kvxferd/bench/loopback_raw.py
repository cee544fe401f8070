"""The raw pairs of ``kvxferd bench loopback``: an initiator and a target process with one
transport each (a NIXL agent, or a Mooncake Transfer Engine over TCP), moving the same chunks
as kvxferd does: one descriptor per chunk, or the per-token descriptors an in-engine mixed-TP
fallback posts. Slot pairs are reused FIFO; the target checks stamps (and every byte in full
mode) against the pattern.
"""

from __future__ import annotations

import math
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvxferd.bench.loopback_procs import child_loop, redirect_output
from kvxferd.bench.loopback_spec import pattern_at, pattern_words


@dataclass(frozen=True)
class RawSpec:
    """One raw run: rooms of `chunks_per_room` chunks, N rooms in flight, slot pairs reused FIFO."""

    tag: str
    src_slot: int  # bytes between source slots
    dst_slot: int  # bytes between destination slots
    slots: int
    rooms: int
    chunks_per_room: int
    in_flight: int
    full: bool
    timeout_s: float
    # "chunk": one descriptor of `chunk_bytes`, stamps at every head block's start and end.
    # "per_token": writer 0 of a (ptp → dtp) pair, one descriptor per (layer, K/V, token, slice).
    desc: str = "chunk"
    chunk_bytes: int = 0
    head_block: int = 0  # bytes per head block (chunk mode)
    layers: int = 0
    planes: int = 2
    tokens: int = 0
    head_bytes: int = 0
    writer_heads: int = 0
    slices: tuple[tuple[int, int, int, int], ...] = ()  # (reader, src_head, dst_head, heads)
    reader_heads: tuple[tuple[int, int, int], ...] = ()  # (reader, heads, byte offset in the dst slot)


@dataclass
class RawPlan:
    descs: np.ndarray | None  # (n, 3) int64 (src offset, dst offset, length) within the slots
    stamp_src: np.ndarray  # uint64 word index within a source slot
    stamp_dst: np.ndarray  # uint64 word index within a destination slot
    moved: int  # bytes one chunk moves


def raw_plan(spec: RawSpec) -> RawPlan:
    if spec.desc == "chunk":
        offs = np.arange(0, spec.chunk_bytes, spec.head_block, dtype=np.int64)
        words = np.concatenate([offs, offs + spec.head_block - 8]) // 8
        return RawPlan(None, words.astype(np.int64), words.astype(np.int64), spec.chunk_bytes)
    lp = spec.layers * spec.planes
    rows = np.arange(lp * spec.tokens, dtype=np.int64)  # (layer, plane, token) flattened
    hb = spec.head_bytes
    parts = []
    for reader, src_head, dst_head, n in spec.slices:
        rh, roff = next((h, o) for r, h, o in spec.reader_heads if r == reader)
        src = (rows * spec.writer_heads + src_head) * hb
        dst = roff + (rows * rh + dst_head) * hb
        parts.append(np.stack([src, dst, np.full_like(rows, n * hb)], axis=1))
    descs = np.concatenate(parts)
    return RawPlan(descs, descs[:, 0] // 8, descs[:, 1] // 8, int(descs[:, 2].sum()))


_RAW_SEED = 0x5EED


class NixlSide:
    def __init__(self, name: str, nbytes: int, fill: bool) -> None:
        from kvxferd.bench.raw_nixl import _make_agent

        self.agent = _make_agent(name, progress_thread=False)
        self.buf = _touched_buffer(nbytes, fill)
        self.addr = int(self.buf.ctypes.data)
        self.agent.register_memory([(self.addr, nbytes, 0, "")], "DRAM")
        self.remote = ""
        self.raddr = 0

    def info(self) -> dict[str, Any]:
        return {"metadata": self.agent.get_agent_metadata(), "addr": self.addr}

    def connect(self, info: dict[str, Any]) -> None:
        name = self.agent.add_remote_agent(info["metadata"])
        self.remote = name.decode() if isinstance(name, bytes) else str(name)
        self.raddr = int(info["addr"])

    def post(self, src: int, dst: int, length: int, descs: np.ndarray | None, notif: bytes) -> Any:
        if descs is None:
            ld = self.agent.get_xfer_descs([(self.addr + src, length, 0)], "DRAM")
            rd = self.agent.get_xfer_descs([(self.raddr + dst, length, 0)], "DRAM")
        else:
            zeros = np.zeros(len(descs), dtype=np.int64)
            ld = self.agent.get_xfer_descs(np.stack([descs[:, 0] + (self.addr + src), descs[:, 2], zeros], axis=1), "DRAM")
            rd = self.agent.get_xfer_descs(np.stack([descs[:, 1] + (self.raddr + dst), descs[:, 2], zeros], axis=1), "DRAM")
        h = self.agent.initialize_xfer("WRITE", ld, rd, self.remote, notif)
        if self.agent.transfer(h) == "ERR":
            raise RuntimeError("NIXL transfer() returned ERR")
        return h

    def check(self, h: Any) -> int:
        s = self.agent.check_xfer_state(h)
        return 1 if s == "DONE" else 0 if s == "PROC" else -1

    def release(self, h: Any) -> None:
        self.agent.release_xfer_handle(h)

    def notifs(self) -> int:
        return sum(len(v) for v in self.agent.get_new_notifs().values())


class _MooncakeSide:
    def __init__(self, name: str, nbytes: int, fill: bool) -> None:
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        rc = self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize(127.0.0.1, P2PHANDSHAKE, tcp) returned {rc}")
        self.buf = _touched_buffer(nbytes, fill)
        self.addr = int(self.buf.ctypes.data)
        rc = self.te.register_memory(self.addr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory returned {rc}")
        self.session = ""
        self.raddr = 0

    def info(self) -> dict[str, Any]:
        return {"session": f"127.0.0.1:{self.te.get_rpc_port()}", "addr": self.addr}

    def connect(self, info: dict[str, Any]) -> None:
        self.session = str(info["session"])
        self.raddr = int(info["addr"])

    def post(self, src: int, dst: int, length: int, descs: np.ndarray | None, notif: bytes) -> Any:
        if descs is not None:
            raise ValueError("the Mooncake pair only posts one descriptor per chunk")
        bid = self.te.transfer_submit_write(self.session, self.addr + src, self.raddr + dst, length)
        if bid < 0:
            raise RuntimeError(f"Mooncake transfer_submit_write returned {bid}")
        return bid

    def check(self, h: Any) -> int:
        s = self.te.transfer_check_status(h)
        return 1 if s == 1 else 0 if s == 0 else -1

    def release(self, h: Any) -> None:
        pass

    def notifs(self) -> int:
        return 0


def _touched_buffer(nbytes: int, fill: bool) -> np.ndarray:
    """A buffer whose pages exist (first-touch faults stay out of the timings)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    if not fill:
        buf.fill(0)
        return buf
    fill_pattern(buf)
    return buf


def fill_pattern(buf: np.ndarray) -> None:
    """The initiator's source: the pattern every target check expects."""
    words = buf[: len(buf) // 8 * 8].view(np.uint64)
    step = 1 << 23
    for i in range(0, len(words), step):
        n = min(step, len(words) - i)
        words[i:i + n] = pattern_words(_RAW_SEED, i, n)


_Side = NixlSide | _MooncakeSide


def _make_side(backend: str, name: str, nbytes: int, fill: bool) -> _Side:
    if backend == "mooncake":
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        return _MooncakeSide(name, nbytes, fill)
    from kvxferd.transports.nixl import apply_ucx_env_defaults

    apply_ucx_env_defaults()  # the UCX environment the daemons run with
    return NixlSide(name, nbytes, fill)


class ClosedLoop:
    """The closed loop of a RawSpec, shared by the posting threads (one for the one-thread pair): rooms
    admitted N at a time, each room's chunks into free slot pairs (FIFO), a finished room admits the next."""

    def __init__(self, spec: RawSpec, buf: np.ndarray, rp: RawPlan) -> None:
        self.spec = spec
        self.rp = rp
        self.words = buf[: len(buf) // 8 * 8].view(np.uint64)
        self.lock = threading.Lock()
        self.free = deque(range(spec.slots))
        self.queue: deque[int] = deque()
        self.last_seq = [0] * spec.slots
        self.admit = [0.0] * spec.rooms
        self.done = [0.0] * spec.rooms
        self.left = [spec.chunks_per_room] * spec.rooms
        self.next_room = self.open_rooms = self.finished = self.seq = 0
        self.error = ""

    def take(self, most: int) -> list[tuple[int, int, int]]:
        """Up to `most` (room, slot, seq) to post now, their stamps written into the source slots."""
        s = self.spec
        out: list[tuple[int, int, int]] = []
        with self.lock:
            while self.next_room < s.rooms and self.open_rooms < s.in_flight:
                self.admit[self.next_room] = time.monotonic()
                self.queue.extend([self.next_room] * s.chunks_per_room)
                self.next_room += 1
                self.open_rooms += 1
            while len(out) < most and self.queue and self.free:
                room, slot = self.queue.popleft(), self.free.popleft()
                self.seq += 1
                self.words[slot * (s.src_slot // 8) + self.rp.stamp_src] = self.seq
                self.last_seq[slot] = self.seq
                out.append((room, slot, self.seq))
        return out

    def finish(self, room: int, slot: int) -> None:
        with self.lock:
            self.free.append(slot)
            self.left[room] -= 1
            if self.left[room] == 0:
                self.done[room] = time.monotonic()
                self.finished += 1
                self.open_rooms -= 1

    @property
    def over(self) -> bool:
        return bool(self.error) or self.finished >= self.spec.rooms

    def result(self) -> dict[str, Any]:
        """The run's times (raises what a posting thread met); the source's pattern put back."""
        if self.error:
            raise RuntimeError(self.error)
        restore_pattern(self.words, self.spec, self.rp, self.last_seq)
        return {"admit": self.admit, "done": self.done, "last_seq": self.last_seq, "chunks": self.seq,
                "moved_per_chunk": self.rp.moved}


def post_loop(side: Any, loop: ClosedLoop, most: int, deadline: float) -> None:
    """One posting thread: keeps up to `most` WRITEs in flight, polls them, backs off when idle;
    an error stops every thread of the loop and is raised by ClosedLoop.result."""
    spec, rp = loop.spec, loop.rp
    active: list[tuple[Any, int, int]] = []
    backoff = 2e-5
    try:
        while not loop.over:
            for room, slot, seq in loop.take(most - len(active)):
                h = side.post(slot * spec.src_slot, slot * spec.dst_slot, rp.moved, rp.descs, b"raw %d" % seq)
                active.append((h, room, slot))
            progressed = False
            still = []
            for h, room, slot in active:
                st = side.check(h)
                if st == 0:
                    still.append((h, room, slot))
                    continue
                if st < 0:
                    raise RuntimeError(f"transfer of room {room} (slot {slot}) ended in error")
                side.release(h)
                loop.finish(room, slot)
                progressed = True
            active = still
            if progressed:
                backoff = 2e-5
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"{spec.tag}: {spec.rooms - loop.finished} rooms unfinished")
            time.sleep(backoff)
            backoff = min(backoff * 2, 5e-4)
    except Exception:
        loop.error = loop.error or traceback.format_exc()


def _raw_run(side: _Side, spec: RawSpec) -> dict[str, Any]:
    """The one-thread initiator: admit rooms, post chunks into free slot pairs, poll completions."""
    loop = ClosedLoop(spec, side.buf, raw_plan(spec))
    post_loop(side, loop, spec.slots, time.monotonic() + spec.timeout_s)
    return loop.result()


def restore_pattern(words: np.ndarray, spec: RawSpec, rp: RawPlan, last_seq: Sequence[int]) -> None:
    """Puts the pattern back under a run's stamps: the next run's full check expects a pristine source."""
    used = np.asarray([i for i, q in enumerate(last_seq) if q], dtype=np.int64)
    if len(used):
        idx = (used[:, None] * (spec.src_slot // 8) + rp.stamp_src[None, :]).ravel()
        words[idx] = pattern_at(_RAW_SEED, idx)


def raw_check(buf: np.ndarray, spec: RawSpec, last_seq: Sequence[int]) -> dict[str, Any]:
    """Target side: every slot holds the stamps of the last chunk written into it (and, in
    full mode, every byte the descriptors cover equals the source's)."""
    rp = raw_plan(spec)
    words = buf[: len(buf) // 8 * 8].view(np.uint64)
    errors: list[str] = []
    stamps = 0
    checked = 0
    dst_words = spec.dst_slot // 8
    src_words = spec.src_slot // 8
    for slot, seq in enumerate(last_seq):
        if not seq:
            continue
        got = words[slot * dst_words + rp.stamp_dst]
        stamps += len(got)
        if not np.all(got == np.uint64(seq)):
            errors.append(f"slot {slot}: {int(np.sum(got != np.uint64(seq)))} stamps differ from chunk {seq}")
            continue
        if not spec.full:
            continue
        src = pattern_words(_RAW_SEED, slot * src_words, src_words)
        src[rp.stamp_src] = seq
        src_b = src.view(np.uint8)
        dst_b = buf[slot * spec.dst_slot:(slot + 1) * spec.dst_slot]
        if spec.desc == "chunk":
            ok = np.array_equal(dst_b[: spec.chunk_bytes], src_b[: spec.chunk_bytes])
            checked += spec.chunk_bytes
        else:
            lpt = spec.layers * spec.planes * spec.tokens
            sv = src_b[: lpt * spec.writer_heads * spec.head_bytes].reshape(lpt, spec.writer_heads, spec.head_bytes)
            ok = True
            for reader, src_head, dst_head, n in spec.slices:
                rh, roff = next((h, o) for r, h, o in spec.reader_heads if r == reader)
                dv = dst_b[roff:roff + lpt * rh * spec.head_bytes].reshape(lpt, rh, spec.head_bytes)
                same = dv[:, dst_head:dst_head + n] == sv[:, src_head:src_head + n]
                if not same.all():
                    ok = False
                    where = tuple(int(i) for i in np.unravel_index(int(np.argmin(same)), same.shape))
                    errors.append(f"slot {slot} reader {reader}: {int((~same).sum())} bytes differ, first at "
                                  f"(row, head, byte) {where}")
                checked += lpt * n * spec.head_bytes
        if not ok:
            errors.append(f"slot {slot}: bytes differ from chunk {seq}")
    return {"errors": errors[:20], "stamps_checked": stamps, "bytes_checked": checked}


def raw_entry(conn: Connection, backend: str, role: str, nbytes: int, log_path: str) -> None:
    serve_side(conn, log_path, lambda: _make_side(backend, f"bench-raw-{role}-{os.getpid()}", nbytes,
                                                  fill=role == "initiator"),
               {"run": lambda side, msg: _raw_run(side, msg[1])})


def serve_side(conn: Connection, log_path: str, make: Callable[[], Any],
               commands: dict[str, Callable[[Any, tuple[Any, ...]], Any]]) -> None:
    """A raw pair's process: makes its side, then serves connect, begin, check and `commands`
    until told to stop (the side's close(), if it has one, runs then)."""
    redirect_output(log_path)
    try:
        side = make()
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", {"pid": os.getpid(), **side.info()}))

    def handle(msg: tuple[Any, ...]) -> Any:
        kind = msg[0]
        if kind == "connect":
            side.connect(msg[1])
            return None
        if kind == "begin":
            return count_notifs(side, conn)
        if kind == "check":
            return raw_check(side.buf, msg[1], msg[2])
        if kind in commands:
            return commands[kind](side, msg)
        raise ValueError(f"unknown command {kind!r}")

    child_loop(conn, handle, getattr(side, "close", lambda: None))


def count_notifs(side: _Side, conn: Connection) -> dict[str, Any]:
    """Target during a run: progress the NIXL agent (notifications) until told how many to expect."""
    count = 0
    expected = -1
    deadline = math.inf
    idle = 2e-5
    while True:
        n = side.notifs()
        count += n
        if expected < 0 and conn.poll():
            msg = conn.recv()
            expected = int(msg[1])
            deadline = time.monotonic() + 30
        if expected >= 0 and (count >= expected or time.monotonic() > deadline):
            return {"notifs": count, "expected": expected}
        if n:
            idle = 2e-5
        else:
            time.sleep(idle)
            idle = min(idle * 2, 1e-3)
