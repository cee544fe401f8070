"""The engine processes of ``kvxferd bench loopback``: a prefill or decode rank of one TP pair
that talks to its daemon only through :mod:`kvxfer_client`, as a real engine does.

A prefill rank admits rooms (closed loop), fills slots with stamps or the full pattern and
enqueues; a decode rank expects the rooms, checks every landed chunk and watermarks it.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvxfer_protocol.slot_layout import bytes_per_head, rank_heads
from kvxferd.bench.loopback_procs import child_loop, redirect_output
from kvxferd.bench.loopback_spec import (
    STAMP_BYTES,
    ModelShape,
    RoomPlan,
    RunSpec,
    head_seed,
    head_stamp,
    pattern_bytes,
    tail_stamp,
)

# Engines register with a long lease: on a loaded (shared) machine a starved keep-alive thread
# must not end a run.
ENGINE_LEASE_MS = 120_000


def _client_args(socket: str, group: str, shape: ModelShape, tp: int, rank: int, ring_bytes: int,
                 role: str) -> dict[str, Any]:
    """How a rank of either role registers: the same layout, timeouts and lease on both sides."""
    from kvxfer_client import Layout

    layout = Layout(shape.layers, shape.kv_heads, shape.head_dim, shape.dtype_bytes, shape.page_size)
    return {"socket": socket, "group": group, "layout": layout, "tp_size": tp, "tp_rank": rank,
            "ring_bytes": ring_bytes, "name": f"bench-{group}-{role}{rank}", "call_timeout": 30.0,
            "lease_ms": ENGINE_LEASE_MS}


class _PrefillEngine:
    """A prefill rank: admits rooms (closed loop), fills slots, enqueues; SUCCESS comes by watch."""

    def __init__(self, socket: str, group: str, shape: ModelShape, tp: int, rank: int, ring_bytes: int) -> None:
        from kvxfer_client import PrefillSender

        self.tx = PrefillSender(**_client_args(socket, group, shape, tp, rank, ring_bytes, "p"))
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

    def _follow(self, stream: Any) -> None:
        """Blocking mode: per-chunk progress events wake _wait_chunk (stream opened for that run only,
        so the other runs pay no event per chunk)."""
        try:
            for _ in stream:
                self.progress.set()
        except Exception:  # cancelled at the end of the run, or the daemon went
            pass

    def produce(self, spec: RunSpec) -> dict[str, Any]:
        progress = None
        if spec.mode == "blocking":
            progress = self.tx.watch(chunk_progress=True)
            threading.Thread(target=self._follow, args=(progress,), name="bench-progress", daemon=True).start()
            time.sleep(0.2)  # subscribed before the first room is admitted
        try:
            return self._produce(spec)
        finally:
            if progress is not None:
                progress.cancel()

    def _start_run(self, spec: RunSpec) -> float:
        """Resets the closed loop for `spec` and admits its first rooms; returns the run's deadline."""
        with self.cond:
            self.active.clear()
            self.finished.clear()
            self.in_flight = 0
            self.limit = spec.in_flight
            self.pending = deque(spec.plans)
            self.ready = deque()
            self.admitted = {}
            self._admit_locked()
        return time.monotonic() + spec.timeout_s

    def _take_ready(self, deadline: float, most: int = 1) -> list[RoomPlan]:
        """Up to `most` admitted rooms to produce, waiting for one; [] once every room finished."""
        with self.cond:
            while not self.ready and (self.pending or self.in_flight):
                if self.watch_error:
                    raise RuntimeError(self.watch_error)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rooms unfinished: {sorted(self.active)[:5]}")
                self.cond.wait(0.5)
            return [self.ready.popleft() for _ in range(min(most, len(self.ready)))]

    def _produce(self, spec: RunSpec) -> dict[str, Any]:
        deadline = self._start_run(spec)
        acquire_wait = 0.0
        while True:
            taken = self._take_ready(deadline)
            if not taken:
                break
            p = taken[0]
            start = 0
            for cid, ntok in enumerate(p.chunks):
                t0 = time.monotonic()
                slot = self.tx.acquire(ntok, timeout=max(1.0, deadline - t0))
                acquire_wait += time.monotonic() - t0
                self._fill(self.tx.slot_view(slot), p.room, cid, ntok, spec.mode == "full")
                last = cid == len(p.chunks) - 1
                self.tx.enqueue(p.room, cid, start, ntok, slot, last=last, aux=b"aux-%d" % p.room if last else b"",
                                wait=spec.enqueue_wait)
                start += ntok
                if spec.mode == "blocking":
                    self._wait_chunk(p.room, cid + 1, deadline)
        refused = self.tx.flush()
        if refused:
            raise RuntimeError(f"chunks refused: {refused[:3]}")
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

    def __init__(self, socket: str, group: str, shape: ModelShape, tp: int, rank: int, ring_bytes: int,
                 layer_parts: bool = False) -> None:
        from kvxfer_client import DecodeReceiver

        # layer_parts: rooms may come as layer parts, and the watch hears each landed layer range.
        self.layer_parts = layer_parts
        self.rx = DecodeReceiver(**_client_args(socket, group, shape, tp, rank, ring_bytes, "d"), layer_parts=layer_parts)
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

    def _watermark(self, read: dict[int, list[int]]) -> None:
        """Gives back what was read: every room's chunks in one call (one write each way)."""
        if not read:
            return
        marks = list(read.items())
        read.clear()
        for (room, _), err in zip(marks, self.rx.watermark_many(marks), strict=True):
            if err is not None:
                self._error(f"room {room}: watermark failed: {err}")

    def _watch(self) -> None:
        try:
            for batch in self.rx.watch(layer_progress=self.layer_parts).batches():
                # Chunks read from the ring, watermarked once per batch of events (as an engine
                # that consumes what one wake-up brought), before any of their rooms is released.
                read: dict[int, list[int]] = {}
                for ev in batch:
                    self._event(ev, read)
                self._watermark(read)
        except Exception as exc:
            with self.cond:
                self.watch_error = f"watch stream ended: {exc!r}"
                self.cond.notify_all()

    def _event(self, ev: Any, read: dict[int, list[int]]) -> None:
        from kvxfer_client import KvxferError, RoomState

        p = self.plans.get(ev.room)
        if p is None:
            return
        if ev.landed is not None:
            c = ev.landed
            starts = np.cumsum((0, *p.chunks))
            if c.chunk_id >= len(p.chunks) or c.num_tokens != p.chunks[c.chunk_id] \
                    or c.token_start != int(starts[c.chunk_id]):
                self._error(f"room {ev.room}: unexpected landed chunk {c}")
            else:
                self._check(ev.room, p, c.chunk_id, self.rx.read(c), c.num_tokens)
            read.setdefault(ev.room, []).append(c.chunk_id)
            self.landed.setdefault(ev.room, set()).add(c.chunk_id)
        if ev.state is RoomState.WAITING_FOR_INPUT:
            with self.cond:
                self.boot.add(ev.room)
                self.cond.notify_all()
        elif ev.state in (RoomState.SUCCESS, RoomState.FAILED):
            now = time.monotonic()
            if ev.room in self.done:
                return
            if ev.state is RoomState.SUCCESS:
                state = "SUCCESS"
                if len(self.landed.get(ev.room, ())) != len(p.chunks):
                    self._error(f"room {ev.room}: SUCCESS with {len(self.landed.get(ev.room, ()))}"
                                f"/{len(p.chunks)} chunks seen")
                if ev.aux != b"aux-%d" % ev.room:
                    self._error(f"room {ev.room}: aux {ev.aux!r}")
            else:
                state = f"FAILED {ev.failure_code}: {ev.failure_reason}"
            self._watermark(read)  # what was read goes back before the room is released
            try:
                self.rx.release(ev.room)
            except KvxferError:
                pass
            with self.cond:
                self.done[ev.room] = (now, state)
                self.boot.add(ev.room)
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


def engine_entry(conn: Connection, role: str, socket: str, group: str, shape: ModelShape, tp: int, rank: int,
                  ring_bytes: int, log_path: str) -> None:
    redirect_output(log_path)
    try:
        cls = _PrefillEngine if role == "prefill" else _DecodeEngine
        eng: _PrefillEngine | _DecodeEngine = cls(socket, group, shape, tp, rank, ring_bytes)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", {"pid": os.getpid()}))
    child_loop(conn, eng.handle, eng.close)
