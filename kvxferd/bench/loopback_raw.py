"""The raw pairs of ``kvxferd bench loopback``: an initiator and a target process with one
transport each (a NIXL agent, or a Mooncake Transfer Engine over TCP), moving the same chunks
as kvxferd does: one descriptor per chunk, or the per-token descriptors an in-engine mixed-TP
fallback posts. Slot pairs are reused FIFO; the target checks stamps (and every byte in full
mode) against the pattern.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from collections import deque
from collections.abc import Sequence
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
    from kvxferd.transport_nixl import apply_ucx_env_defaults

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


def raw_entry(conn: Connection, backend: str, role: str, nbytes: int, log_path: str) -> None:
    redirect_output(log_path)
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

    child_loop(conn, handle, lambda: None)


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
