"""``kvxferd bench loopback``: kvxferd against raw NIXL, per-token descriptors, blocking
per-chunk transfers and Mooncake, on one machine, over the same bytes and chunking.

What runs (all on 127.0.0.1, every process on this machine):

* two daemons (``python -m kvxferd serve``), prefill and decode, each with its own NIXL agent,
* engine processes that use only :mod:`kvxfer_client`: one per prefill rank and one per decode
  rank, for TP 1→1 (same TP) and the mixed pairs 4→2 and 1→4,
* a raw NIXL initiator/target pair (two processes, one NIXL agent each): one descriptor per chunk
  (the transport's ceiling here), and the per-token descriptor path (one descriptor per
  (layer, K/V, token, head slice), as an in-engine mixed-TP fallback posts them),
* a Mooncake Transfer Engine pair over TCP loopback (P2PHANDSHAKE metadata), if installed.

A *room* is one request's KV (``room_tokens`` tokens of the model layout), cut into chunks of
``chunk_tokens``. "N rooms in flight" is a closed loop: N rooms are admitted, each admitted
room's chunks are produced in order (waiting for ring space), and a finished room admits the
next. Room latency runs from admission to the moment the decode side sees the room complete
(raw paths: the last chunk's WRITE completes). Throughput counts KV bytes of the rooms that
finish after the first ``min(N, rooms/4)`` rooms (the pipeline is full by then), over the time
from that point to the last room.

Bytes are checked twice: every timed chunk carries stamps (room, chunk, global head, at the
start and end of every head block; raw paths: a sequence number per descriptor), which the
receiver checks; and a verification pass per path (ragged chunk sizes for kvxferd) compares
every byte with a deterministic pattern. ``ratios.bytes_verified`` is true only if both held
everywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import multiprocessing as mp
import os
import struct
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from kvxferd.bench._common import (
    CpuMeter,
    Daemon,
    fmt_bytes,
    iter_chunks,
    latency_summary,
    machine_info,
    ratio,
    remove_tree,
    rounded,
    short_tmpdir,
    start_daemon,
    target_check,
    write_json,
)
from kvxferd.config import parse_size
from kvxferd.layout import KVLayout, bytes_per_head, plan, rank_heads

# --------------------------------------------------------------------------- shapes and settings


@dataclass(frozen=True)
class ModelShape:
    layers: int = 80
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    page_size: int = 16

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.dtype_bytes

    def kv_layout(self) -> KVLayout:
        return KVLayout(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes, self.page_size)

    def describe(self) -> str:
        return (f"{self.layers} layers x {self.kv_heads} KV heads x head dim {self.head_dim} x "
                f"{self.dtype_bytes} B, page {self.page_size} ({fmt_bytes(self.bytes_per_token)}/token)")


@dataclass(frozen=True)
class Settings:
    shape: ModelShape = ModelShape()
    room_tokens: int = 256
    chunk_tokens: tuple[int, ...] = (16, 64, 256)
    headline_chunk: int = 64
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    headline_concurrency: int = 16
    tail_concurrency: int = 64
    mixed_tp: tuple[tuple[int, int], ...] = ((4, 2), (1, 4))
    ring_bytes: int = 768 << 20  # per TP pair and side, split over the ranks; also the raw window
    point_bytes: int = 2 << 30  # at least this many KV bytes per timed point
    mooncake_point_bytes: int = 1 << 30
    per_token_bytes: int = 192 << 20
    rooms_per_in_flight: int = 2  # rooms per point >= (this + 1) x in flight (latency samples)
    headline_repeats: int = 3  # the headline point runs this often (interleaved); ratios use medians
    timeout_s: float = 240.0
    quick: bool = False

    @property
    def room_bytes(self) -> int:
        return self.room_tokens * self.shape.bytes_per_token

    def chunk_bytes(self, chunk_tokens: int) -> int:
        return chunk_tokens * self.shape.bytes_per_token


DEFAULT = Settings()
# --quick: a small layout and few rooms; every path still runs and every byte check still happens.
QUICK = Settings(
    shape=ModelShape(layers=4, kv_heads=8, head_dim=128, dtype_bytes=2, page_size=16),
    room_tokens=64, chunk_tokens=(32,), headline_chunk=32, concurrency=(1, 16, 64),
    ring_bytes=64 << 20, point_bytes=48 << 20, mooncake_point_bytes=24 << 20, per_token_bytes=2 << 20,
    rooms_per_in_flight=2, headline_repeats=1, timeout_s=90.0, quick=True,
)

TARGETS: dict[str, tuple[str, float]] = {
    "kvxferd_over_raw_nixl": (">=", 0.90),
    "p99_over_p50_at_64": ("<=", 1.3),
    "kvxferd_over_mooncake": (">=", 4.0),
    "per_token_slowdown": (">=", 10.0),
    "mixed_tp_over_same_tp": (">=", 0.90),
}

PATH_LABELS = {
    "kvxferd_same_tp_ref": "kvxferd TP 1→1 (mixed-TP ref)",
    "raw_nixl": "raw NIXL (1 desc/chunk)",
    "kvxferd": "kvxferd TP 1→1",
    "mooncake_tcp": "Mooncake TCP",
    "blocking": "blocking per chunk",
    "per_token": "per-token descriptors",
}


def tp_path(ptp: int, dtp: int) -> str:
    return "kvxferd" if (ptp, dtp) == (1, 1) else f"kvxferd_tp{ptp}to{dtp}"


def path_label(path: str) -> str:
    if path in PATH_LABELS:
        return PATH_LABELS[path]
    if path.startswith("kvxferd_tp"):
        p, d = path.removeprefix("kvxferd_tp").split("to")
        return f"kvxferd TP {p}→{d}"
    if path.startswith("per_token_tp"):
        p, d = path.removeprefix("per_token_tp").split("to")
        return f"per-token TP {p}→{d}"
    return path


# --------------------------------------------------------------------------- rooms and data patterns


@dataclass(frozen=True)
class RoomPlan:
    room: int
    chunks: tuple[int, ...]  # tokens per chunk

    @property
    def num_tokens(self) -> int:
        return sum(self.chunks)


@dataclass(frozen=True)
class RunSpec:
    """One kvxferd run, sent to every engine rank of a TP pair."""

    tag: str
    plans: tuple[RoomPlan, ...]
    in_flight: int
    mode: str  # "stamp" | "full" | "blocking"
    timeout_s: float


_MUL = np.uint64(0x9E3779B97F4A7C15)
_HEAD_MAGIC = 0x4B565848
_TAIL_MAGIC = 0x4B565854
STAMP_BYTES = 16
# Engines register with a long lease: on a loaded (shared) machine a starved keep-alive thread
# must not end a run.
ENGINE_LEASE_MS = 120_000


def pattern_words(seed: int, start: int, count: int) -> np.ndarray:
    """A deterministic pseudo-random uint64 sequence: word i is a function of (seed, start + i)."""
    return pattern_at(seed, np.arange(start, start + count, dtype=np.uint64))


def pattern_at(seed: int, index: np.ndarray) -> np.ndarray:
    """The pattern's words at the given word indices."""
    x = index.astype(np.uint64, copy=True)
    x += np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
    x *= _MUL
    x ^= x >> np.uint64(29)
    return x


def pattern_bytes(seed: int, nbytes: int) -> np.ndarray:
    return pattern_words(seed, 0, (nbytes + 7) // 8).view(np.uint8)[:nbytes]


def head_seed(room: int, chunk: int, head: int) -> int:
    h = hashlib.blake2b(b"%d/%d/%d" % (room, chunk, head), digest_size=8).digest()
    return int.from_bytes(h, "little")


def head_stamp(room: int, chunk: int, head: int) -> bytes:
    return struct.pack("<4I", _HEAD_MAGIC, head, room & 0xFFFFFFFF, chunk)


def tail_stamp(room: int, chunk: int, head: int) -> bytes:
    return struct.pack("<4I", _TAIL_MAGIC, head, room & 0xFFFFFFFF, chunk)


def _redirect_output(log_path: str) -> None:
    """Native libraries (UCX, NIXL, glog) print to fd 1/2: send it to the process's log file."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _child_loop(conn: Connection, handler: Callable[[tuple[Any, ...]], Any], close: Callable[[], None]) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            close()
            return
        if msg[0] == "stop":
            try:
                close()
            finally:
                conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handler(msg)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


# --------------------------------------------------------------------------- engine processes


class _PrefillEngine:
    """A prefill rank: admits rooms (closed loop), fills slots, enqueues; SUCCESS comes by watch."""

    def __init__(self, socket: str, group: str, shape: ModelShape, tp: int, rank: int, ring_bytes: int) -> None:
        from kvxfer_client import Layout, PrefillSender

        layout = Layout(shape.layers, shape.kv_heads, shape.head_dim, shape.dtype_bytes, shape.page_size)
        self.tx = PrefillSender(socket=socket, group=group, layout=layout, tp_size=tp, tp_rank=rank,
                                ring_bytes=ring_bytes, name=f"bench-{group}-p{rank}", call_timeout=30.0,
                                lease_ms=ENGINE_LEASE_MS)
        self.kl = shape.kv_layout()
        self.heads = rank_heads(shape.kv_heads, tp, rank)
        self.cond = threading.Condition()
        self.active: set[int] = set()
        self.finished: dict[int, tuple[float, str]] = {}
        self.in_flight = 0
        self.limit = 1
        self.pending: deque[RoomPlan] = deque()  # not admitted yet
        self.ready: deque[RoomPlan] = deque()  # admitted, chunks not produced yet
        self.admitted: dict[int, float] = {}
        self.progress = threading.Event()
        self.watch_error = ""
        threading.Thread(target=self._watch, name="bench-watch", daemon=True).start()
        time.sleep(0.3)  # the WatchRooms stream is subscribed before any room starts

    def _watch(self) -> None:
        from kvxfer_client import KvxferError, RoomState

        try:
            for ev in self.tx.watch():
                self.progress.set()
                if ev.state not in (RoomState.SUCCESS, RoomState.FAILED):
                    continue
                now = time.monotonic()
                with self.cond:
                    if ev.room not in self.active:
                        continue
                    self.active.discard(ev.room)
                state = "SUCCESS" if ev.state is RoomState.SUCCESS else f"FAILED {ev.failure_code}: {ev.failure_reason}"
                try:
                    self.tx.release(ev.room)
                except KvxferError:
                    pass
                with self.cond:
                    self.finished[ev.room] = (now, state)
                    self.in_flight -= 1
                    self._admit_locked()
        except Exception as exc:
            with self.cond:
                self.watch_error = f"watch stream ended: {exc!r}"
                self.cond.notify_all()

    def _fill(self, view: memoryview, room: int, chunk: int, ntok: int, full: bool) -> None:
        bph = bytes_per_head(self.kl, ntok)
        if full:
            arr = np.frombuffer(view, dtype=np.uint8)
            for h in range(self.heads.count):
                g = self.heads.start + h
                arr[h * bph:(h + 1) * bph] = pattern_bytes(head_seed(room, chunk, g), bph)
            return
        for h in range(self.heads.count):
            g = self.heads.start + h
            view[h * bph:h * bph + STAMP_BYTES] = head_stamp(room, chunk, g)
            view[(h + 1) * bph - STAMP_BYTES:(h + 1) * bph] = tail_stamp(room, chunk, g)

    def _wait_chunk(self, room: int, n: int, deadline: float) -> None:
        """Blocking mode: returns once `n` chunks of the room are written (or the room ended)."""
        from kvxfer_client import KvxferError

        while True:
            with self.cond:
                if room in self.finished:
                    return
            self.progress.clear()
            try:
                st = self.tx.poll(room)
            except KvxferError:
                return  # released meanwhile: finished
            if st.chunks_done >= n or st.finished:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"room {room}: chunk {n - 1} not written in time")
            self.progress.wait(0.05)

    def _admit_locked(self) -> None:
        """Admits rooms while fewer than N are unfinished (called with the lock held).

        Admission is when the request "arrives" (its latency starts); its chunks are produced
        later, in admission order, as ring space allows. Admitting only when production can
        start would hide the time a room waits behind others and keep fewer than N rooms open.
        """
        now = time.monotonic()
        while self.pending and self.in_flight < self.limit:
            p = self.pending.popleft()
            self.in_flight += 1
            self.active.add(p.room)
            self.admitted[p.room] = now
            self.ready.append(p)
        self.cond.notify_all()

    def produce(self, spec: RunSpec) -> dict[str, Any]:
        deadline = time.monotonic() + spec.timeout_s
        acquire_wait = 0.0
        with self.cond:
            self.active.clear()
            self.finished.clear()
            self.in_flight = 0
            self.limit = spec.in_flight
            self.pending = deque(spec.plans)
            self.ready = deque()
            self.admitted = {}
            self._admit_locked()
        while True:
            with self.cond:
                while not self.ready and (self.pending or self.in_flight):
                    if self.watch_error:
                        raise RuntimeError(self.watch_error)
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rooms unfinished: {sorted(self.active)[:5]}")
                    self.cond.wait(0.5)
                if not self.ready:
                    break
                p = self.ready.popleft()
            start = 0
            for cid, ntok in enumerate(p.chunks):
                t0 = time.monotonic()
                slot = self.tx.acquire(ntok, timeout=max(1.0, deadline - t0))
                acquire_wait += time.monotonic() - t0
                self._fill(self.tx.slot_view(slot), p.room, cid, ntok, spec.mode == "full")
                last = cid == len(p.chunks) - 1
                self.tx.enqueue(p.room, cid, start, ntok, slot, last=last, aux=b"aux-%d" % p.room if last else b"")
                start += ntok
                if spec.mode == "blocking":
                    self._wait_chunk(p.room, cid + 1, deadline)
        with self.cond:
            finished = dict(self.finished)
            admit = dict(self.admitted)
        return {
            "admit": admit,
            "done": {r: t for r, (t, _) in finished.items()},
            "states": {r: s for r, (_, s) in finished.items()},
            "acquire_wait_s": acquire_wait,
        }

    def handle(self, msg: tuple[Any, ...]) -> Any:
        if msg[0] == "produce":
            return self.produce(msg[1])
        raise ValueError(f"unknown command {msg[0]!r}")

    def close(self) -> None:
        self.tx.close()


class _DecodeEngine:
    """A decode rank: expects rooms, checks every landed chunk, watermarks, records completion."""

    def __init__(self, socket: str, group: str, shape: ModelShape, tp: int, rank: int, ring_bytes: int) -> None:
        from kvxfer_client import DecodeReceiver, Layout

        layout = Layout(shape.layers, shape.kv_heads, shape.head_dim, shape.dtype_bytes, shape.page_size)
        self.rx = DecodeReceiver(socket=socket, group=group, layout=layout, tp_size=tp, tp_rank=rank,
                                 ring_bytes=ring_bytes, name=f"bench-{group}-d{rank}", call_timeout=30.0,
                                 lease_ms=ENGINE_LEASE_MS)
        self.kl = shape.kv_layout()
        self.heads = rank_heads(shape.kv_heads, tp, rank)
        self.cond = threading.Condition()
        self.plans: dict[int, RoomPlan] = {}
        self.mode = "stamp"
        self.boot: set[int] = set()
        self.landed: dict[int, set[int]] = {}
        self.done: dict[int, tuple[float, str]] = {}
        self.errors: list[str] = []
        self.stamps_checked = 0
        self.bytes_checked = 0
        self.watch_error = ""
        threading.Thread(target=self._watch, name="bench-watch", daemon=True).start()
        time.sleep(0.3)

    def _error(self, msg: str) -> None:
        with self.cond:
            if len(self.errors) < 20:
                self.errors.append(msg)

    def _check(self, room: int, p: RoomPlan, cid: int, data: memoryview, ntok: int) -> None:
        bph = bytes_per_head(self.kl, ntok)
        if len(data) < self.heads.count * bph:
            self._error(f"room {room} chunk {cid}: {len(data)} B landed, expected {self.heads.count * bph}")
            return
        if self.mode == "full":
            arr = np.frombuffer(data, dtype=np.uint8)
            for h in range(self.heads.count):
                want = pattern_bytes(head_seed(room, cid, self.heads.start + h), bph)
                got = arr[h * bph:(h + 1) * bph]
                if not np.array_equal(got, want):
                    bad = int(np.argmax(got != want))
                    self._error(f"room {room} chunk {cid} head {self.heads.start + h}: byte {bad} differs")
            self.bytes_checked += self.heads.count * bph
            return
        for h in range(self.heads.count):
            g = self.heads.start + h
            if (bytes(data[h * bph:h * bph + STAMP_BYTES]) != head_stamp(room, cid, g)
                    or bytes(data[(h + 1) * bph - STAMP_BYTES:(h + 1) * bph]) != tail_stamp(room, cid, g)):
                self._error(f"room {room} chunk {cid} head {g}: stamp mismatch")
        self.stamps_checked += 2 * self.heads.count

    def _watch(self) -> None:
        from kvxfer_client import KvxferError, RoomState

        try:
            for ev in self.rx.watch():
                p = self.plans.get(ev.room)
                if p is None:
                    continue
                if ev.landed is not None:
                    c = ev.landed
                    starts = np.cumsum((0, *p.chunks))
                    if c.chunk_id >= len(p.chunks) or c.num_tokens != p.chunks[c.chunk_id] \
                            or c.token_start != int(starts[c.chunk_id]):
                        self._error(f"room {ev.room}: unexpected landed chunk {c}")
                    else:
                        self._check(ev.room, p, c.chunk_id, self.rx.read(c), c.num_tokens)
                    try:
                        self.rx.watermark(ev.room, [c.chunk_id])
                    except KvxferError as exc:
                        self._error(f"room {ev.room}: watermark failed: {exc}")
                    self.landed.setdefault(ev.room, set()).add(c.chunk_id)
                if ev.state is RoomState.WAITING_FOR_INPUT:
                    with self.cond:
                        self.boot.add(ev.room)
                        self.cond.notify_all()
                elif ev.state in (RoomState.SUCCESS, RoomState.FAILED):
                    now = time.monotonic()
                    if ev.room in self.done:
                        continue
                    if ev.state is RoomState.SUCCESS:
                        state = "SUCCESS"
                        if len(self.landed.get(ev.room, ())) != len(p.chunks):
                            self._error(f"room {ev.room}: SUCCESS with {len(self.landed.get(ev.room, ()))}"
                                        f"/{len(p.chunks)} chunks seen")
                        if ev.aux != b"aux-%d" % ev.room:
                            self._error(f"room {ev.room}: aux {ev.aux!r}")
                    else:
                        state = f"FAILED {ev.failure_code}: {ev.failure_reason}"
                    try:
                        self.rx.release(ev.room)
                    except KvxferError:
                        pass
                    with self.cond:
                        self.done[ev.room] = (now, state)
                        self.boot.add(ev.room)
                        self.cond.notify_all()
        except Exception as exc:
            with self.cond:
                self.watch_error = f"watch stream ended: {exc!r}"
                self.cond.notify_all()

    def expect(self, spec: RunSpec, prefill_address: str, prefill_group: str) -> dict[str, Any]:
        from kvxfer_client import RoomState

        with self.cond:
            self.plans = {p.room: p for p in spec.plans}
            self.mode = "full" if spec.mode == "full" else "stamp"
            self.boot = set()
            self.landed = {}
            self.done = {}
            self.errors = []
            self.stamps_checked = 0
            self.bytes_checked = 0
        for p in spec.plans:
            self.rx.expect(p.room, prefill_address, prefill_group, p.num_tokens)
        want = set(self.plans)
        t0 = time.monotonic()
        polled = False
        with self.cond:
            while not want <= self.boot:
                if self.watch_error:
                    raise RuntimeError(self.watch_error)
                waited = time.monotonic() - t0
                if waited > 60:
                    raise TimeoutError(f"rooms not bootstrapped: {sorted(want - self.boot)[:5]}")
                if waited > 3 and not polled:
                    polled = True  # an event missed: ask for the state directly
                    for r in sorted(want - self.boot):
                        if self.rx.poll(r).state >= RoomState.WAITING_FOR_INPUT:
                            self.boot.add(r)
                    continue
                self.cond.wait(0.2)
        return {"bootstrap_s": time.monotonic() - t0}

    def collect(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while len(self.done) < len(self.plans):
                if self.watch_error:
                    raise RuntimeError(self.watch_error)
                if time.monotonic() > deadline:
                    left = sorted(set(self.plans) - set(self.done))
                    raise TimeoutError(f"{len(left)} rooms unfinished, e.g. {left[:5]}")
                self.cond.wait(0.5)
            out = {
                "done": {r: t for r, (t, _) in self.done.items()},
                "states": {r: s for r, (_, s) in self.done.items()},
                "errors": list(self.errors),
                "stamps_checked": self.stamps_checked,
                "bytes_checked": self.bytes_checked,
            }
            self.plans = {}
        return out

    def handle(self, msg: tuple[Any, ...]) -> Any:
        if msg[0] == "expect":
            return self.expect(msg[1], msg[2], msg[3])
        if msg[0] == "collect":
            return self.collect(msg[1])
        raise ValueError(f"unknown command {msg[0]!r}")

    def close(self) -> None:
        self.rx.close()


def _engine_entry(conn: Connection, role: str, socket: str, group: str, shape: ModelShape, tp: int, rank: int,
                  ring_bytes: int, log_path: str) -> None:
    _redirect_output(log_path)
    try:
        cls = _PrefillEngine if role == "prefill" else _DecodeEngine
        eng: _PrefillEngine | _DecodeEngine = cls(socket, group, shape, tp, rank, ring_bytes)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", {"pid": os.getpid()}))
    _child_loop(conn, eng.handle, eng.close)


# --------------------------------------------------------------------------- raw pairs (NIXL, Mooncake)


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


class _NixlSide:
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
    words = buf[: nbytes // 8 * 8].view(np.uint64)
    step = 1 << 23
    for i in range(0, len(words), step):
        n = min(step, len(words) - i)
        words[i:i + n] = pattern_words(_RAW_SEED, i, n)
    return buf


_Side = _NixlSide | _MooncakeSide


def _make_side(backend: str, name: str, nbytes: int, fill: bool) -> _Side:
    if backend == "mooncake":
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        return _MooncakeSide(name, nbytes, fill)
    from kvxferd.transport import apply_ucx_env_defaults

    apply_ucx_env_defaults()  # the UCX environment the daemons run with
    return _NixlSide(name, nbytes, fill)


def _raw_run(side: _Side, spec: RawSpec) -> dict[str, Any]:
    """The initiator's loop: admit rooms, post chunks into free slot pairs, poll completions."""
    rp = raw_plan(spec)
    words = side.buf[: len(side.buf) // 8 * 8].view(np.uint64)
    free = deque(range(spec.slots))
    last_seq = [0] * spec.slots
    admit = [0.0] * spec.rooms
    done = [0.0] * spec.rooms
    left = [spec.chunks_per_room] * spec.rooms
    queue: deque[int] = deque()
    active: list[tuple[Any, int, int]] = []
    next_room = open_rooms = finished = seq = 0
    deadline = time.monotonic() + spec.timeout_s
    backoff = 2e-5
    src_words = spec.src_slot // 8
    while finished < spec.rooms:
        while next_room < spec.rooms and open_rooms < spec.in_flight:
            admit[next_room] = time.monotonic()
            queue.extend([next_room] * spec.chunks_per_room)
            next_room += 1
            open_rooms += 1
        while queue and free:
            room = queue.popleft()
            slot = free.popleft()
            seq += 1
            words[slot * src_words + rp.stamp_src] = seq
            h = side.post(slot * spec.src_slot, slot * spec.dst_slot, rp.moved, rp.descs, b"raw %d" % seq)
            last_seq[slot] = seq
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
            free.append(slot)
            progressed = True
            left[room] -= 1
            if left[room] == 0:
                done[room] = time.monotonic()
                finished += 1
                open_rooms -= 1
        active = still
        if progressed or not active:
            backoff = 2e-5
        else:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{spec.tag}: {spec.rooms - finished} rooms unfinished")
            time.sleep(backoff)
            backoff = min(backoff * 2, 5e-4)
    # Put the pattern back under this run's stamps: the next run's full check expects a pristine source.
    used = np.asarray([i for i, q in enumerate(last_seq) if q], dtype=np.int64)
    if len(used):
        idx = (used[:, None] * src_words + rp.stamp_src[None, :]).ravel()
        words[idx] = pattern_at(_RAW_SEED, idx)
    return {"admit": admit, "done": done, "last_seq": last_seq, "chunks": seq, "moved_per_chunk": rp.moved}


def _raw_check(side: _Side, spec: RawSpec, last_seq: Sequence[int]) -> dict[str, Any]:
    """Target side: every slot holds the stamps of the last chunk written into it (and, in
    full mode, every byte the descriptors cover equals the source's)."""
    rp = raw_plan(spec)
    words = side.buf[: len(side.buf) // 8 * 8].view(np.uint64)
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
        dst_b = side.buf[slot * spec.dst_slot:(slot + 1) * spec.dst_slot]
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


def _raw_entry(conn: Connection, backend: str, role: str, nbytes: int, log_path: str) -> None:
    _redirect_output(log_path)
    try:
        side = _make_side(backend, f"bench-raw-{role}-{os.getpid()}", nbytes, fill=role == "initiator")
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", {"pid": os.getpid(), **side.info()}))

    def handle(msg: tuple[Any, ...]) -> Any:
        kind = msg[0]
        if kind == "connect":
            side.connect(msg[1])
            return None
        if kind == "run":
            return _raw_run(side, msg[1])
        if kind == "begin":
            return _count_notifs(side, conn)
        if kind == "check":
            return _raw_check(side, msg[1], msg[2])
        raise ValueError(f"unknown command {kind!r}")

    _child_loop(conn, handle, lambda: None)


def _count_notifs(side: _Side, conn: Connection) -> dict[str, Any]:
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


# --------------------------------------------------------------------------- coordinator: children


class _Child:
    """A spawned process driven through a pipe: send a command, get ("ok", value) or ("error", text)."""

    def __init__(self, ctx: Any, name: str, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.proc.start()
        child.close()
        self.info: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer in {timeout:.0f} s")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.name}: process died (exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"{self.name} failed:\n{value}")
        return value

    def call(self, *msg: Any, timeout: float = 120.0) -> Any:
        self.send(*msg)
        return self.recv(timeout)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.send("stop")
                self.recv(10)
            except Exception:
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@dataclass
class _Group:
    """Engine processes of one TP pair, registered on the two daemons."""

    ptp: int
    dtp: int
    prefill: list[_Child] = field(default_factory=list)
    decode: list[_Child] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"tp{self.ptp}to{self.dtp}"

    @property
    def path(self) -> str:
        return tp_path(self.ptp, self.dtp)


def summarize(admit: Sequence[float], done: Sequence[float], room_bytes: Sequence[int], in_flight: int) -> dict[str, Any]:
    """Throughput over the full pipeline and room latencies (see the module doc)."""
    n = len(admit)
    order = sorted(range(n), key=lambda i: done[i])
    # Closed loop: once the first min(N, n/4) rooms are done the pipeline is full. With no more
    # rooms than slots in flight everything starts at once: then the whole span counts.
    warm = max(1, min(in_flight, n // 4)) if n > in_flight else 0
    t_a = done[order[warm - 1]] if warm else min(admit)
    t_b = done[order[-1]]
    steady = sum(room_bytes[i] for i in order[warm:])
    total = sum(room_bytes)
    span = max(t_b - min(admit), 1e-9)
    gbps = steady / max(t_b - t_a, 1e-9) / 1e9 if warm and t_b > t_a else total / span / 1e9
    lat = [done[i] - admit[i] for i in range(n)]
    samples = lat[in_flight:] if n > in_flight else lat
    return {
        "rooms": n,
        "bytes": total,
        "seconds": span,
        "throughput_gbps": gbps,
        "span_gbps": total / span / 1e9,
        "latency_ms": latency_summary(samples),
        "latency_samples_ms": [round(x * 1e3, 3) for x in samples],
    }


class LoopbackBench:
    def __init__(self, settings: Settings, keep_logs: bool = False, profile_dir: str | None = None,
                 mooncake: bool = True) -> None:
        self.s = settings
        self.keep_logs = keep_logs
        self.profile_dir = profile_dir
        self.want_mooncake = mooncake
        self.workdir = short_tmpdir("kvxb-")
        self.ctx = mp.get_context("spawn")
        self.daemons: dict[str, Daemon] = {}
        self.groups: dict[tuple[int, int], _Group] = {}
        self.raw: dict[str, tuple[_Child, _Child]] = {}
        self.unavailable: dict[str, str] = {}
        self.points: list[dict[str, Any]] = []
        self.verification: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.profiles: dict[str, Any] = {}
        self._room = 1
        self.started_at = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    def _ranks_ring(self, tp: int) -> int:
        per = self.s.ring_bytes // tp
        return max(per // (1 << 20), 1) << 20

    def start(self, status: Callable[[str], None]) -> None:
        s = self.s
        tps = [(1, 1), *s.mixed_tp]
        pool = sum(self._ranks_ring(p) * p for p, _ in tps) + (64 << 20)
        dpool = sum(self._ranks_ring(d) * d for _, d in tps) + (64 << 20)
        status("starting daemons, raw NIXL and Mooncake pairs")
        self.daemons["prefill"] = start_daemon(self.workdir, "prefill", pool)
        self.daemons["decode"] = start_daemon(self.workdir, "decode", dpool)
        win = s.ring_bytes
        self._start_raw("nixl", win)
        if self.want_mooncake:
            try:
                import importlib.util

                if importlib.util.find_spec("mooncake.engine") is None:
                    raise ImportError("mooncake.engine not found")
                self._start_raw("mooncake", win)
            except ImportError as exc:
                self.unavailable["mooncake_tcp"] = (
                    f"mooncake-transfer-engine-non-cuda is not installed ({exc}); "
                    "install the bench extra: pip install 'kvxferd[bench]'")
        else:
            self.unavailable["mooncake_tcp"] = "skipped (--no-mooncake)"
        for d in self.daemons.values():
            d.wait_ready()
        status("starting engine processes")
        for ptp, dtp in tps:
            g = _Group(ptp, dtp)
            for r in range(dtp):
                g.decode.append(self._engine("decode", g, dtp, r))
            for r in range(ptp):
                g.prefill.append(self._engine("prefill", g, ptp, r))
            self.groups[(ptp, dtp)] = g
        for name, (ini, tgt) in list(self.raw.items()):
            try:
                tgt.info = tgt.recv(120)
                ini.info = ini.recv(120)
                ini.call("connect", tgt.info, timeout=60)
            except Exception as exc:
                if name == "nixl":
                    raise
                self.unavailable["mooncake_tcp"] = f"Mooncake pair did not start: {str(exc).strip()[-600:]}"
                ini.stop()
                tgt.stop()
                del self.raw[name]
        for g in self.groups.values():
            for c in [*g.decode, *g.prefill]:
                c.info = c.recv(120)

    def _start_raw(self, backend: str, nbytes: int) -> None:
        tgt = _Child(self.ctx, f"{backend}-target", _raw_entry,
                     (backend, "target", nbytes, str(self.workdir / f"{backend}-target.log")))
        ini = _Child(self.ctx, f"{backend}-initiator", _raw_entry,
                     (backend, "initiator", nbytes, str(self.workdir / f"{backend}-initiator.log")))
        self.raw[backend] = (ini, tgt)

    def _engine(self, role: str, g: _Group, tp: int, rank: int) -> _Child:
        d = self.daemons[role]
        group = f"{g.name}-{role}"
        return _Child(self.ctx, f"{g.name}-{role}{rank}", _engine_entry, (
            role, d.socket, group, self.s.shape, tp, rank, self._ranks_ring(tp),
            str(self.workdir / f"{g.name}-{role}{rank}.log"),
        ))

    def stop(self) -> None:
        for g in self.groups.values():
            for c in [*g.prefill, *g.decode]:
                c.stop()
        for ini, tgt in self.raw.values():
            ini.stop()
            tgt.stop()
        for d in self.daemons.values():
            d.stop()
        remove_tree(self.workdir, self.keep_logs or bool(self.failures))

    def pids(self) -> dict[str, int]:
        out = {f"daemon_{k}": d.pid for k, d in self.daemons.items()}
        for g in self.groups.values():
            for c in [*g.prefill, *g.decode]:
                out[c.name] = c.pid
        for name, (ini, tgt) in self.raw.items():
            out[f"{name}_initiator"] = ini.pid
            out[f"{name}_target"] = tgt.pid
        return out

    def _meter(self, keys: Sequence[str]) -> CpuMeter:
        pids = self.pids()
        return CpuMeter({k: pids[k] for k in keys if k in pids})

    # ------------------------------------------------------------------ kvxferd points

    def _plans(self, n: int, chunks: Sequence[int]) -> tuple[RoomPlan, ...]:
        out = tuple(RoomPlan(self._room + i, tuple(chunks)) for i in range(n))
        self._room += n
        return out

    def _rooms_for(self, in_flight: int, budget: int, room_bytes: int) -> int:
        return max(math.ceil(budget / room_bytes), self.s.rooms_per_in_flight * in_flight + in_flight, 2)

    def kvx_run(self, g: _Group, plans: tuple[RoomPlan, ...], in_flight: int, mode: str,
                profile: bool = False) -> dict[str, Any]:
        s = self.s
        spec = RunSpec(f"{g.name}/{mode}", plans, in_flight, mode, s.timeout_s)
        pre = self.daemons["prefill"]
        for d in g.decode:
            d.send("expect", spec, pre.peer_address, f"{g.name}-prefill")
        for d in g.decode:
            d.recv(90)
        keys = ["daemon_prefill", "daemon_decode", *(c.name for c in [*g.prefill, *g.decode])]
        meter = self._meter(keys)
        spies = self._start_profile(g, spec) if profile else []
        meter.start()
        for p in g.prefill:
            p.send("produce", spec)
        for d in g.decode:
            d.send("collect", s.timeout_s)
        pres = [p.recv(s.timeout_s + 60) for p in g.prefill]
        dres = [d.recv(s.timeout_s + 60) for d in g.decode]
        cpu = meter.stop()
        self._stop_profile(spies)
        admit = [min(r["admit"][p.room] for r in pres) for p in plans]
        done = [max(r["done"][p.room] for r in dres) for p in plans]
        errors = [e for r in dres for e in r["errors"]]
        for r in [*pres, *dres]:
            errors += [f"room {k}: {v}" for k, v in r["states"].items() if v != "SUCCESS"][:5]
        tokens = [p.num_tokens for p in plans]
        out = summarize(admit, done, [t * s.shape.bytes_per_token for t in tokens], in_flight)
        out.update({
            "cpu_s": _cpu_groups(cpu),
            "acquire_wait_s": max(r["acquire_wait_s"] for r in pres),
            "stamps_checked": sum(r["stamps_checked"] for r in dres),
            "bytes_checked": sum(r["bytes_checked"] for r in dres),
            "errors": errors[:10],
            "ok": not errors,
        })
        return out

    def kvx_point(self, g: _Group, chunk_tokens: int, in_flight: int, mode: str = "stamp",
                  path: str | None = None, profile: bool = False, repeat: int = 0, **extra: Any) -> dict[str, Any]:
        s = self.s
        chunks = tuple(iter_chunks(s.room_tokens, chunk_tokens))
        n = self._rooms_for(in_flight, s.point_bytes, s.room_bytes)
        if mode == "blocking":
            n = max(math.ceil(s.point_bytes / 2 / s.room_bytes), 4)
        out = self.kvx_run(g, self._plans(n, chunks), in_flight, mode, profile)
        return self._record(path or g.path, chunk_tokens, in_flight, out, tp=f"{g.ptp}->{g.dtp}", repeat=repeat,
                            **extra)

    def _record(self, path: str, chunk_tokens: int, in_flight: int, out: dict[str, Any], **extra: Any) -> dict[str, Any]:
        point = {"path": path, "chunk_tokens": chunk_tokens, "chunk_bytes": self.s.chunk_bytes(chunk_tokens),
                 "in_flight": in_flight, **extra, **out}
        if not out.get("ok", False):
            self.failures.append(f"{path} chunk {chunk_tokens} in flight {in_flight}: {out.get('errors')}")
        self.points.append(point)
        return point

    # ------------------------------------------------------------------ raw points

    def raw_spec(self, tag: str, chunk_tokens: int, in_flight: int, rooms: int, full: bool,
                 per_token: tuple[int, int] | None = None) -> RawSpec:
        s = self.s
        cb = s.chunk_bytes(chunk_tokens)
        slot = cb
        slots = max(s.ring_bytes // slot, 1)
        cpr = len(list(iter_chunks(s.room_tokens, chunk_tokens)))
        if s.room_tokens % chunk_tokens:
            raise ValueError("raw paths need room_tokens to be a multiple of every chunk size")
        base = RawSpec(tag=tag, src_slot=slot, dst_slot=slot, slots=slots, rooms=rooms, chunks_per_room=cpr,
                       in_flight=in_flight, full=full, timeout_s=s.timeout_s, chunk_bytes=cb,
                       head_block=bytes_per_head(s.shape.kv_layout(), chunk_tokens))
        if per_token is None:
            return base
        ptp, dtp = per_token
        heads = s.shape.kv_heads
        wh = rank_heads(heads, ptp, 0).count
        slices = tuple((x.reader, x.src_head, x.dst_head, x.num_heads) for x in plan(ptp, dtp, heads) if x.writer == 0)
        bph = bytes_per_head(s.shape.kv_layout(), chunk_tokens)
        readers = sorted({x[0] for x in slices})
        rh_list = []
        off = 0
        for r in readers:
            rh = rank_heads(heads, dtp, r).count
            rh_list.append((r, rh, off))
            off += rh * bph
        return replace(base, desc="per_token", src_slot=wh * bph, dst_slot=off, slots=max(s.ring_bytes // max(off, wh * bph), 1),
                       layers=s.shape.layers, planes=2, tokens=chunk_tokens, head_bytes=s.shape.head_bytes,
                       writer_heads=wh, slices=slices, reader_heads=tuple(rh_list))

    def raw_run(self, backend: str, spec: RawSpec) -> dict[str, Any]:
        ini, tgt = self.raw[backend]
        meter = self._meter([f"{backend}_initiator", f"{backend}_target"])
        tgt.send("begin")
        meter.start()
        res = ini.call("run", spec, timeout=spec.timeout_s + 60)
        cpu = meter.stop()
        tgt.send("end", res["chunks"] if backend == "nixl" else 0)
        notes = tgt.recv(60)
        chk = tgt.call("check", spec, res["last_seq"], timeout=300)
        errors = list(chk["errors"])
        if backend == "nixl" and notes["notifs"] < res["chunks"]:
            errors.append(f"{notes['notifs']}/{res['chunks']} notifications arrived")
        moved = res["moved_per_chunk"] * spec.chunks_per_room
        out = summarize(res["admit"], res["done"], [moved] * spec.rooms, spec.in_flight)
        out.update({"cpu_s": _cpu_groups(cpu), "stamps_checked": chk["stamps_checked"],
                    "bytes_checked": chk["bytes_checked"], "errors": errors[:10], "ok": not errors})
        return out

    def raw_point(self, backend: str, chunk_tokens: int, in_flight: int, path: str,
                  per_token: tuple[int, int] | None = None, budget: int | None = None, repeat: int = 0) -> dict[str, Any]:
        s = self.s
        room_bytes = s.room_bytes
        if per_token is not None:
            spec0 = self.raw_spec(path, chunk_tokens, in_flight, 1, False, per_token)
            room_bytes = raw_plan(spec0).moved * spec0.chunks_per_room
            rooms = max(math.ceil((budget or s.per_token_bytes) / room_bytes), 2)
        else:
            rooms = self._rooms_for(in_flight, budget or s.point_bytes, room_bytes)
            if backend == "mooncake":
                rooms = max(math.ceil((budget or s.mooncake_point_bytes) / room_bytes), 2 * in_flight)
        spec = self.raw_spec(path, chunk_tokens, in_flight, rooms, False, per_token)
        out = self.raw_run(backend, spec)
        extra: dict[str, Any] = {"repeat": repeat}
        if per_token is not None:
            rp = raw_plan(spec)
            extra = {"tp": f"{per_token[0]}->{per_token[1]}", "descriptors_per_chunk": len(rp.stamp_src),
                     "descriptor_bytes": int(rp.descs[0, 2]) if rp.descs is not None else 0, "repeat": repeat}
        return self._record(path, chunk_tokens, in_flight, out, **extra)

    # ------------------------------------------------------------------ verification, profiling

    def verify(self, status: Callable[[str], None]) -> None:
        """Every byte compared with the pattern, per path (ragged chunks for kvxferd)."""
        s = self.s
        ragged = _ragged_chunks(s.room_tokens, s.shape.page_size)
        for (ptp, dtp), g in self.groups.items():
            status(f"verify every byte: kvxferd TP {ptp}→{dtp}")
            out = self.kvx_run(g, self._plans(3, ragged), 2, "full")
            self._verified(g.path, out, chunks=list(ragged))
        status("verify every byte: raw NIXL")
        out = self.raw_run("nixl", self.raw_spec("verify", s.headline_chunk, 2, 3, True))
        self._verified("raw_nixl", out)
        for ptp, dtp in s.mixed_tp:
            status(f"verify every byte: per-token TP {ptp}→{dtp}")
            out = self.raw_run("nixl", self.raw_spec("verify", s.headline_chunk, 2, 2, True, (ptp, dtp)))
            self._verified(f"per_token_tp{ptp}to{dtp}", out)
        if "mooncake" in self.raw:
            status("verify every byte: Mooncake")
            out = self.raw_run("mooncake", self.raw_spec("verify", s.headline_chunk, 2, 3, True))
            self._verified("mooncake_tcp", out)

    def _verified(self, path: str, out: dict[str, Any], **extra: Any) -> None:
        rec = {"path": path, "rooms": out["rooms"], "bytes_checked": out["bytes_checked"],
               "ok": out["ok"] and out["bytes_checked"] > 0, "errors": out["errors"], **extra}
        if not rec["ok"]:
            self.failures.append(f"verification {path}: {out['errors'] or 'no bytes checked'}")
        self.verification.append(rec)

    def warm_up(self, status: Callable[[str], None]) -> None:
        """Touches every ring page through the real path, so page faults stay out of the timings."""
        s = self.s
        if s.quick:
            return  # small rings: first-touch faults are noise next to what --quick can resolve
        for (ptp, dtp), g in self.groups.items():
            status(f"warm-up: kvxferd TP {ptp}→{dtp}")
            n = max(math.ceil(1.5 * s.ring_bytes / s.room_bytes), 4)
            self.kvx_run(g, self._plans(n, tuple(iter_chunks(s.room_tokens, max(s.chunk_tokens)))),
                         s.headline_concurrency, "stamp")
        for backend in self.raw:
            status(f"warm-up: {backend}")
            spec = self.raw_spec("warm-up", s.headline_chunk, s.headline_concurrency,
                                 max(2, math.ceil(s.ring_bytes / s.room_bytes)), False)
            self.raw_run(backend, spec)

    def _start_profile(self, g: _Group, spec: RunSpec) -> list[Any]:
        import shutil
        import subprocess

        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not self.profile_dir or not Path(exe).exists():
            return []
        out = Path(self.profile_dir)
        out.mkdir(parents=True, exist_ok=True)
        spies = []
        for name in ("prefill", "decode"):
            raw = out / f"{name}-daemon.{g.name}.txt"
            cmd = [exe, "record", "--pid", str(self.daemons[name].pid), "--rate", "250", "--format", "raw",
                   "--threads", "--nonblocking", "--output", str(raw), "--duration", str(int(spec.timeout_s)),
                   *os.environ.get("KVX_PYSPY_ARGS", "").split()]
            if "--native" in cmd:
                cmd.remove("--nonblocking")  # py-spy reads native stacks only from a paused process
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            spies.append((name, proc, raw))
        time.sleep(1.0)
        return spies

    def _stop_profile(self, spies: list[Any]) -> None:
        import signal
        import subprocess

        for name, proc, raw in spies:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            self.profiles[name] = {"file": str(raw), "top": _profile_top(raw)}


def _cpu_groups(cpu: dict[str, float]) -> dict[str, float]:
    """Per-process CPU seconds folded into roles (engines summed per side)."""
    out: dict[str, float] = {}
    for k, v in cpu.items():
        if k.startswith("_"):
            out[k] = v
            continue
        key = k
        if "-prefill" in k:
            key = "engines_prefill"
        elif "-decode" in k:
            key = "engines_decode"
        out[key] = round(out.get(key, 0.0) + v, 4)
    return out


def _profile_top(raw: Path, n: int = 15) -> list[dict[str, Any]]:
    """Self time per function from py-spy's collapsed stacks ("frame;frame;... count")."""
    try:
        lines = raw.read_text(errors="replace").splitlines()
    except OSError:
        return []
    self_counts: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        c = int(count)
        total += c
        frames = stack.split(";")
        leaf = frames[-1]
        self_counts[leaf] = self_counts.get(leaf, 0) + c
        for f in set(frames):
            incl[f] = incl.get(f, 0) + c
    top = sorted(self_counts.items(), key=lambda kv: -kv[1])[:n]
    return [{"frame": f, "self_pct": round(100 * c / max(total, 1), 2),
             "incl_pct": round(100 * incl.get(f, 0) / max(total, 1), 2)} for f, c in top]


def _ragged_chunks(room_tokens: int, page: int) -> tuple[int, ...]:
    """Chunk sizes of one room that are not page multiples (and a 1-token chunk)."""
    sizes = [max(1, page + 1), 1, max(1, 2 * page - 3)]
    out: list[int] = []
    left = room_tokens
    i = 0
    while left > 0:
        n = min(sizes[i % len(sizes)], left)
        out.append(n)
        left -= n
        i += 1
    return tuple(out)


# --------------------------------------------------------------------------- the sweep


def run_sweep(bench: LoopbackBench, progress: Callable[[str, bool], None]) -> None:
    """Points in a fixed order; each (chunk, in flight) point runs raw NIXL, kvxferd and Mooncake back to back."""
    s = bench.s
    same = bench.groups[(1, 1)]
    for chunk in s.chunk_tokens:
        for conc in s.concurrency:
            headline = chunk == s.headline_chunk and conc == s.headline_concurrency
            reps = s.headline_repeats if headline else 1
            for rep in range(reps):
                tag = f" (run {rep + 1}/{reps})" if reps > 1 else ""
                progress(f"raw NIXL      chunk {chunk} tok, {conc} in flight{tag}", False)
                bench.raw_point("nixl", chunk, conc, "raw_nixl", repeat=rep)
                progress(f"kvxferd       chunk {chunk} tok, {conc} in flight{tag}", False)
                bench.kvx_point(same, chunk, conc, profile=bool(bench.profile_dir) and headline and rep == 0,
                                repeat=rep)
                if "mooncake" in bench.raw:
                    progress(f"Mooncake TCP  chunk {chunk} tok, {conc} in flight{tag}", False)
                    bench.raw_point("mooncake", chunk, conc, "mooncake_tcp", repeat=rep)
            progress("", True)
    for chunk in s.chunk_tokens:
        progress(f"blocking per chunk, chunk {chunk} tok", False)
        bench.kvx_point(same, chunk, 1, mode="blocking", path="blocking")
        progress("", True)
    # Mixed TP runs right after a same-TP run of the same point, and the per-token path right
    # after its mixed-TP run: each ratio compares runs that saw the same machine (a shared
    # machine's load drifts over minutes).
    hc = s.headline_concurrency
    for chunk in s.chunk_tokens:
        progress(f"kvxferd TP 1→1 (reference) chunk {chunk} tok, {hc} in flight", False)
        ref = bench.kvx_point(same, chunk, hc, path="kvxferd_same_tp_ref")
        for ptp, dtp in s.mixed_tp:
            g = bench.groups[(ptp, dtp)]
            progress(f"kvxferd TP {ptp}→{dtp} chunk {chunk} tok, {hc} in flight", False)
            bench.kvx_point(g, chunk, hc, same_tp_ref_gbps=ref["throughput_gbps"])
            if chunk == s.headline_chunk:
                progress(f"per-token descriptors TP {ptp}→{dtp}", False)
                bench.raw_point("nixl", chunk, hc, f"per_token_tp{ptp}to{dtp}", per_token=(ptp, dtp))
        progress("", True)


def sweep_steps(s: Settings, mooncake: bool) -> int:
    return len(s.chunk_tokens) * len(s.concurrency) + 2 * len(s.chunk_tokens)


# --------------------------------------------------------------------------- results


def _all(points: Sequence[dict[str, Any]], path: str, chunk: int, conc: int) -> list[dict[str, Any]]:
    return [p for p in points if p["path"] == path and p["chunk_tokens"] == chunk and p["in_flight"] == conc]


def _find(points: Sequence[dict[str, Any]], path: str, chunk: int, conc: int) -> dict[str, Any] | None:
    """The point (the first run of a repeated one)."""
    found = _all(points, path, chunk, conc)
    return found[0] if found else None


def _median_gbps(points: Sequence[dict[str, Any]], path: str, chunk: int, conc: int) -> float | None:
    """Median throughput over the runs of a point (one run: its throughput)."""
    vals = sorted(float(p["throughput_gbps"]) for p in _all(points, path, chunk, conc))
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def _gbps(p: dict[str, Any] | None) -> float | None:
    return None if p is None else float(p["throughput_gbps"])


def compute_ratios(s: Settings, points: Sequence[dict[str, Any]], verified: bool,
                   unavailable: dict[str, str]) -> dict[str, Any]:
    ch, hc, tc = s.headline_chunk, s.headline_concurrency, s.tail_concurrency
    kvx = _median_gbps(points, "kvxferd", ch, hc)
    raw = _median_gbps(points, "raw_nixl", ch, hc)
    moon = _median_gbps(points, "mooncake_tcp", ch, hc)
    tail = _find(points, "kvxferd", ch, tc)
    mixed = {}
    per_token = {}
    for ptp, dtp in s.mixed_tp:
        mp = _find(points, tp_path(ptp, dtp), ch, hc)
        m = _gbps(mp)
        # Against the same-TP run made just before it (same machine state), see run_sweep.
        mixed[f"{ptp}->{dtp}"] = ratio(m, mp.get("same_tp_ref_gbps") if mp else None)
        pt = _median_gbps(points, f"per_token_tp{ptp}to{dtp}", ch, hc)
        per_token[f"{ptp}->{dtp}"] = ratio(m, pt)
    mixed_vals = [v for v in mixed.values() if v is not None]
    pt_vals = [v for v in per_token.values() if v is not None]
    out: dict[str, Any] = {
        "at": {"chunk_tokens": ch, "chunk_bytes": s.chunk_bytes(ch), "in_flight": hc, "tail_in_flight": tc},
        "kvxferd_over_raw_nixl": ratio(kvx, raw),
        "p99_over_p50_at_64": tail["latency_ms"].get("p99_over_p50") if tail else None,
        "kvxferd_over_mooncake": ratio(kvx, moon),
        "mixed_tp_over_same_tp": min(mixed_vals) if mixed_vals else None,
        "per_token_slowdown": min(pt_vals) if pt_vals else None,
        "bytes_verified": verified,
        "mixed_tp_over_same_tp_by_pair": mixed,
        "per_token_slowdown_by_pair": per_token,
        "blocking_over_kvxferd": ratio(_median_gbps(points, "blocking", ch, 1), kvx),
        "headline_runs": {
            path: [round(float(p["throughput_gbps"]), 4) for p in _all(points, path, ch, hc)]
            for path in ("raw_nixl", "kvxferd", "mooncake_tcp")
        },
    }
    if out["kvxferd_over_mooncake"] is None:
        out["kvxferd_over_mooncake_reason"] = unavailable.get("mooncake_tcp", "no Mooncake number at this point")
    if tc != 64:
        out["p99_over_p50_at_64_note"] = f"measured at {tc} rooms in flight (--quick or custom sweep)"
    by_chunk: dict[str, Any] = {}
    for c in s.chunk_tokens:
        by_chunk[str(c)] = {
            "kvxferd_over_raw_nixl": ratio(_median_gbps(points, "kvxferd", c, hc), _median_gbps(points, "raw_nixl", c, hc)),
            "kvxferd_over_mooncake": ratio(_median_gbps(points, "kvxferd", c, hc),
                                           _median_gbps(points, "mooncake_tcp", c, hc)),
            "p99_over_p50_at_tail": (_find(points, "kvxferd", c, tc) or {}).get("latency_ms", {}).get("p99_over_p50"),
            "mixed_tp_over_same_tp": {
                f"{p}->{d}": ratio(_gbps(_find(points, tp_path(p, d), c, hc)),
                                   (_find(points, tp_path(p, d), c, hc) or {}).get("same_tp_ref_gbps"))
                for p, d in s.mixed_tp
            },
        }
    out["by_chunk_tokens"] = by_chunk
    return out


def target_table(ratios: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, (op, limit) in TARGETS.items():
        out[key] = {"value": ratios.get(key), "target": f"{op} {limit:g}", "met": target_check(ratios.get(key), op, limit)}
    return out


def _print_results(con: Any, s: Settings, result: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"kvxferd bench loopback — {s.shape.describe()}, rooms of {s.room_tokens} tokens "
                    f"({fmt_bytes(s.room_bytes)})")
    for col in ("path", "chunk", "in flight", "GB/s", "p50 ms", "p90 ms", "p99 ms", "p99/p50", "rooms", "checked"):
        t.add_column(col, justify="left" if col == "path" else "right")
    for p in result["points"]:
        lat = p["latency_ms"]
        t.add_row(
            path_label(p["path"]) + (f" (run {p['repeat'] + 1})" if p.get("repeat") else ""),
            f"{p['chunk_tokens']} tok / {fmt_bytes(p['chunk_bytes'])}", str(p["in_flight"]),
            f"{p['throughput_gbps']:.2f}", f"{lat.get('p50', math.nan):.1f}", f"{lat.get('p90', math.nan):.1f}",
            f"{lat.get('p99', math.nan):.1f}", f"{lat.get('p99_over_p50', math.nan):.2f}", str(p["rooms"]),
            "[green]ok[/]" if p["ok"] else "[red]FAILED[/]",
        )
    con.print(t)
    r = result["ratios"]
    rt = Table(title=f"ratios (chunk {r['at']['chunk_tokens']} tokens = {fmt_bytes(r['at']['chunk_bytes'])}, "
                     f"{r['at']['in_flight']} rooms in flight)")
    for col in ("ratio", "value", "target", "met"):
        rt.add_column(col)
    for key, row in result["targets"].items():
        v = row["value"]
        met = row["met"]
        rt.add_row(key, "n/a" if v is None else f"{v:.2f}", row["target"],
                   "[green]yes[/]" if met else ("[red]no[/]" if met is False else "n/a"))
    rt.add_row("bytes_verified", str(r["bytes_verified"]), "true",
               "[green]yes[/]" if r["bytes_verified"] else "[red]no[/]")
    con.print(rt)
    if r.get("kvxferd_over_mooncake_reason"):
        con.print(f"[yellow]Mooncake:[/] {r['kvxferd_over_mooncake_reason']}")


def plot(result: dict[str, Any], png: str, cdf_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    s = result["settings"]
    chunks = s["chunk_tokens"]
    fig, axes = plt.subplots(1, len(chunks), figsize=(5.2 * len(chunks), 5.0), squeeze=False, sharey=True)
    styles = {"raw_nixl": ("black", "o", "-"), "kvxferd": ("tab:blue", "s", "-"), "mooncake_tcp": ("tab:orange", "^", "-")}
    for ax, chunk in zip(axes[0], chunks, strict=True):
        for path, (color, marker, ls) in styles.items():
            xs = sorted({p["in_flight"] for p in pts if p["path"] == path and p["chunk_tokens"] == chunk})
            ys = [_median_gbps(pts, path, chunk, x) for x in xs]
            if xs:
                ax.plot(xs, ys, color=color, marker=marker, ls=ls, label=path_label(path))
        extra = [p for p in pts if p["chunk_tokens"] == chunk and (p["path"].startswith(("kvxferd_tp", "per_token")) or p["path"] == "blocking")]
        markers = {"blocking": ("tab:red", "X"), "per_token": ("tab:purple", "v")}
        for p in extra:
            kind = "per_token" if p["path"].startswith("per_token") else p["path"]
            color, marker = markers.get(kind, ("tab:green", "D" if "4to2" in p["path"] else "P"))
            ax.scatter([p["in_flight"]], [p["throughput_gbps"]], color=color, marker=marker, s=60, zorder=5,
                       label=path_label(p["path"]))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({p["in_flight"] for p in pts}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("rooms in flight")
        ax.set_title(f"chunk {chunk} tokens ({fmt_bytes(chunk * s['bytes_per_token'])})")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("KV throughput (GB/s)")
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 5), fontsize=8)
    m = result["machine"]
    fig.suptitle(f"kvxferd bench loopback — {m['cores']} cores, {m['cpu_model']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)

    r = result["ratios"]["at"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), squeeze=False)
    for ax, conc in zip(axes[0], (r["in_flight"], r["tail_in_flight"]), strict=True):
        for p in pts:
            if (p["chunk_tokens"] != r["chunk_tokens"] or p["in_flight"] != conc or not p.get("latency_samples_ms")
                    or p.get("repeat", 0)):
                continue
            lat = np.sort(np.asarray(p["latency_samples_ms"]))
            frac = np.arange(1, len(lat) + 1) / len(lat)
            ax.step(lat, frac, where="post", label=f"{path_label(p['path'])} (p99/p50 {p['latency_ms']['p99_over_p50']:.2f})")
        ax.set_xlabel("room latency (ms)")
        ax.set_ylabel("fraction of rooms")
        ax.set_title(f"latency CDF, {conc} rooms in flight, chunk {r['chunk_tokens']} tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(cdf_png, dpi=110)
    plt.close(fig)


def cdf_path(png: str) -> str:
    p = Path(png)
    return str(p.with_name(f"{p.stem}-cdf{p.suffix or '.png'}"))


def _reference_raw_nixl(s: Settings) -> dict[str, Any]:
    """The project's raw two-process NIXL baseline (kvxferd.bench.raw_nixl), as a cross-check."""
    try:
        from kvxferd.bench import raw_nixl  # type: ignore[attr-defined,unused-ignore]
    except ImportError as exc:
        return {"available": False, "reason": f"kvxferd.bench.raw_nixl not importable: {exc}"}
    try:
        cb = s.chunk_bytes(s.headline_chunk)
        total = max(cb * 16, min(s.point_bytes, 2 << 30)) // cb * cb
        out = raw_nixl.run_raw_nixl(total, cb, s.headline_concurrency)
        return {"available": True, "total_bytes": total, "chunk_bytes": cb, "in_flight": s.headline_concurrency,
                "result": out}
    except Exception as exc:
        return {"available": False, "reason": f"run_raw_nixl failed: {exc!r}"[:500]}


# --------------------------------------------------------------------------- CLI


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def build_settings(args: argparse.Namespace) -> Settings:
    s = QUICK if args.quick else DEFAULT
    shape = s.shape
    shape = ModelShape(
        layers=args.layers or shape.layers, kv_heads=args.kv_heads or shape.kv_heads,
        head_dim=args.head_dim or shape.head_dim, dtype_bytes=args.dtype_bytes or shape.dtype_bytes,
        page_size=args.page_size or shape.page_size,
    )
    s = replace(s, shape=shape)
    if args.room_tokens:
        s = replace(s, room_tokens=args.room_tokens)
    if args.chunk_tokens:
        chunks = _ints(args.chunk_tokens)
        s = replace(s, chunk_tokens=chunks, headline_chunk=chunks[len(chunks) // 2] if s.headline_chunk not in chunks else s.headline_chunk)
    if args.concurrency:
        conc = _ints(args.concurrency)
        s = replace(s, concurrency=conc, headline_concurrency=16 if 16 in conc else conc[len(conc) // 2],
                    tail_concurrency=max(conc))
    if args.ring_bytes:
        s = replace(s, ring_bytes=parse_size(args.ring_bytes))
    if args.point_bytes:
        s = replace(s, point_bytes=parse_size(args.point_bytes))
    if (shape.head_dim * shape.dtype_bytes) % 8:
        raise SystemExit("kvxferd bench loopback: head_dim x dtype_bytes must be a multiple of 8")
    for c in s.chunk_tokens:
        if s.room_tokens % c:
            raise SystemExit(f"kvxferd bench loopback: room tokens {s.room_tokens} must be a multiple of chunk {c}")
        if s.chunk_bytes(c) > s.ring_bytes // 4:
            raise SystemExit(f"kvxferd bench loopback: a {c}-token chunk ({fmt_bytes(s.chunk_bytes(c))}) "
                             "needs --ring-bytes of at least 4 chunks")
    for p, d in s.mixed_tp:
        plan(p, d, shape.kv_heads)
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxferd bench loopback", description=__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("--json", help="write every figure, the settings and the machine here")
    ap.add_argument("--plot", help="throughput plot (PNG); the latency CDF goes next to it as NAME-cdf.png")
    ap.add_argument("--quick", action="store_true", help="small layout and few rooms (CI): every path, every check")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--dtype-bytes", type=int)
    ap.add_argument("--page-size", type=int)
    ap.add_argument("--room-tokens", type=int, help="tokens per room (default 256; --quick 64)")
    ap.add_argument("--chunk-tokens", help="chunk sizes to sweep, comma-separated (default 16,64,256)")
    ap.add_argument("--concurrency", help="rooms in flight to sweep (default 1,4,16,64)")
    ap.add_argument("--ring-bytes", help="ring per TP pair and side, also the raw window (default 768MiB)")
    ap.add_argument("--point-bytes", help="KV bytes at least per timed point (default 3GiB)")
    ap.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake pair")
    ap.add_argument("--no-reference", action="store_true", help="skip the kvxferd.bench.raw_nixl cross-check")
    ap.add_argument("--profile", metavar="DIR", help="py-spy both daemons during the headline kvxferd point")
    ap.add_argument("--keep-logs", action="store_true", help="keep daemon and process logs (kept anyway on failure)")
    args = ap.parse_args(argv)
    s = build_settings(args)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    con = Console() if sys.stdout.isatty() else Console(width=150)
    t0 = time.monotonic()
    bench = LoopbackBench(s, keep_logs=args.keep_logs, profile_dir=args.profile, mooncake=not args.no_mooncake)
    con.print(f"[bold]kvxferd bench loopback[/] — {s.shape.describe()}; rooms of {s.room_tokens} tokens; "
              f"chunks {', '.join(map(str, s.chunk_tokens))} tokens; {', '.join(map(str, s.concurrency))} rooms in flight"
              f"{' (quick)' if s.quick else ''}")
    con.print(f"logs: {bench.workdir}")
    result: dict[str, Any] = {}
    phases: dict[str, float] = {}
    rc = 0
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=con, transient=False) as prog:
            setup = prog.add_task("setting up", total=None)
            ts = time.monotonic()
            bench.start(lambda m: prog.update(setup, description=m))
            phases["start_s"] = time.monotonic() - ts
            ts = time.monotonic()
            bench.verify(lambda m: prog.update(setup, description=m))
            phases["verify_s"] = time.monotonic() - ts
            ts = time.monotonic()
            bench.warm_up(lambda m: prog.update(setup, description=m))
            phases["warm_up_s"] = time.monotonic() - ts
            ts = time.monotonic()
            prog.update(setup, description="set up, verified, warmed up", total=1, completed=1)
            task = prog.add_task("sweep", total=sweep_steps(s, "mooncake" in bench.raw))

            def step(desc: str, advance: bool) -> None:
                if desc:
                    prog.update(task, description=desc)
                if advance and not desc:
                    prog.advance(task)

            run_sweep(bench, step)
            phases["sweep_s"] = time.monotonic() - ts
            prog.update(task, description="sweep done")
    except Exception:
        bench.failures.append(traceback.format_exc())
        con.print_exception()
        rc = 1
    finally:
        bench.stop()
    reference: dict[str, Any] = {"available": False, "reason": "skipped (--quick or --no-reference)"}
    if rc == 0 and not s.quick and not args.no_reference:
        reference = _reference_raw_nixl(s)
    verified = (rc == 0 and not bench.failures and all(v["ok"] for v in bench.verification)
                and all(p["ok"] for p in bench.points) and bool(bench.verification))
    ratios = compute_ratios(s, bench.points, verified, bench.unavailable)
    settings = asdict(s)
    settings["bytes_per_token"] = s.shape.bytes_per_token
    settings["room_bytes"] = s.room_bytes
    result = {
        "bench": "loopback",
        "generated_unix": int(time.time()),
        "runtime_s": round(time.monotonic() - t0, 1),
        "phases_s": {k: round(v, 1) for k, v in phases.items()},
        "machine": machine_info(),
        "settings": settings,
        "method": {
            "throughput": "KV bytes of rooms finishing after the first min(N, rooms/4) rooms, over the time from "
                          "then to the last room; GB/s = 1e9 B/s",
            "latency": "room admission to room complete on the decode side (raw paths: last WRITE complete); "
                       "rooms admitted after the first N only",
            "checks": "timed chunks: stamps at every head block's start and end (raw: per descriptor); "
                      "verification pass: every byte against a pattern (kvxferd with ragged chunk sizes)",
            "daemons": "python -m kvxferd serve with the default config except socket, ephemeral 127.0.0.1 ports, "
                       "host_pool_bytes sized for the rings, metrics off",
        },
        "ratios": ratios,
        "targets": target_table(ratios),
        "unavailable": bench.unavailable,
        "verification": bench.verification,
        "points": bench.points,
        "raw_nixl_reference": reference,
        "profiles": bench.profiles,
        "failures": [f[-2000:] for f in bench.failures],
    }
    result = rounded(result, 5)
    if bench.points:
        _print_results(con, s, result)
    con.print(f"runtime {result['runtime_s']:.0f} s; bytes verified: {ratios['bytes_verified']}")
    if args.json:
        write_json(args.json, result)
        con.print(f"wrote {args.json}")
    if args.plot and bench.points:
        plot(result, args.plot, cdf_path(args.plot))
        con.print(f"wrote {args.plot} and {cdf_path(args.plot)}")
    if bench.failures:
        con.print(f"[red]failures:[/] {len(bench.failures)}; logs kept in {bench.workdir}")
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
