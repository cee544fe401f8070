"""GPU end-to-end harness: engine processes whose KV pools are torch tensors and whose staging
rings are GPU tensors the daemon imports by CUDA IPC (``ring_tensor=``).

Every byte is a pure function of (room, global head), generated with a seeded torch generator on
the engine's device, so a decode rank can recompute exactly what each of its KV pages must hold
whatever the prefill/decode TP pair (GQA replicas and MLA included) and compare byte for byte.

Prefill rank: fills its pool pages for every room (before the clock starts), then per chunk:
AcquireSlot -> gather the chunk's pages into the ring slot with the Triton kernel -> wait for the
gather (CUDA event) -> EnqueueChunk. Decode rank: ExpectRoom for every room, then per landed
chunk: scatter the ring slot into its own pages -> wait for the scatter -> Watermark. After the
clock stops it compares every page of every room with the recomputed bytes, and checks that no
page outside the rooms was written.

The functions run in spawned processes and use only kvxfer_client, the kernels and torch. They
also run with ``device="cpu"`` (host rings in the daemon's pool, torch copies): that is how the
harness itself is exercised on machines without a GPU; the tests in this package use CUDA only.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from kvxfer_client import DecodeReceiver, Layout, PrefillSender, RoomState
from kvxfer_client.kernels import KVPages
from kvxfer_protocol.slot_layout import KVLayout, RankHeads, rank_heads

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "bfloat16": (torch.bfloat16, 2),
    "float8_e4m3fn": (torch.float8_e4m3fn, 1),
}


@dataclass(frozen=True)
class Case:
    """One end-to-end run: a TP pair, a KV layout and a workload."""

    name: str
    ptp: int
    dtp: int
    dtype: str = "bfloat16"
    total_kv_heads: int = 2
    mla: bool = False
    num_layers: int = 16
    head_dim: int = 128
    page_size: int = 16
    rooms: int = 16
    tokens_per_room: int = 2003  # not a page multiple: the last page of a room is partial
    chunk_tokens: int = 512  # any size: chunks may start and end mid-page
    ring_bytes: int = 64 << 20
    first_room: int = 1
    same_node: bool = False
    in_flight: int = 8
    # The pinned host path: rings are windows of the daemon's host pool that each GPU engine
    # page-locks (pin_host); kernels move GPU pages <-> pinned slot, the daemons DRAM <-> DRAM.
    host_path: bool = False

    @property
    def layout(self) -> Layout:
        return Layout(
            num_layers=self.num_layers, total_kv_heads=self.total_kv_heads, head_dim=self.head_dim,
            dtype_bytes=DTYPES[self.dtype][1], page_size=self.page_size, mla=self.mla, dtype=self.dtype,
        )

    @property
    def klayout(self) -> KVLayout:
        lay = self.layout
        return KVLayout(lay.num_layers, lay.total_kv_heads, lay.head_dim, lay.dtype_bytes, lay.page_size, lay.mla)

    @property
    def planes(self) -> int:
        return 1 if self.mla else 2

    @property
    def row_bytes(self) -> int:
        return self.head_dim * DTYPES[self.dtype][1]

    @property
    def room_ids(self) -> list[int]:
        return list(range(self.first_room, self.first_room + self.rooms))

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """(token_start, num_tokens) of each chunk of a room."""
        out = []
        start = 0
        while start < self.tokens_per_room:
            n = min(self.chunk_tokens, self.tokens_per_room - start)
            out.append((start, n))
            start += n
        return out

    @property
    def pages_per_room(self) -> int:
        return -(-self.tokens_per_room // self.page_size)

    def heads(self, tp: int, rank: int) -> RankHeads:
        return rank_heads(self.total_kv_heads, tp, rank, self.mla)

    def decode_bytes(self) -> int:
        """Bytes that land in the decode rings (every reader's part of every chunk)."""
        per_token_head = self.num_layers * self.planes * self.row_bytes
        heads = sum(self.heads(self.dtp, r).count for r in range(self.dtp))
        return heads * per_token_head * self.tokens_per_room * self.rooms

    def groups(self) -> tuple[str, str]:
        return f"{self.name}-pre", f"{self.name}-dec"


@dataclass
class RankResult:
    role: str
    rank: int
    engine_id: str = ""
    states: dict[int, str] = field(default_factory=dict)
    t_start: float = 0.0
    t_end: float = 0.0
    bytes_moved: int = 0
    checked_bytes: int = 0
    mismatches: list[str] = field(default_factory=list)
    stray_bytes: int = 0
    error: str | None = None


def _seed(room: int, head: int) -> int:
    digest = hashlib.blake2b(b"kvx-gpu/%d/%d" % (room, head), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def head_bytes(case: Case, room: int, head: int, device: torch.device) -> torch.Tensor:
    """The bytes of global head `head` of room `room`: uint8 [layers, planes, tokens, row_bytes]."""
    g = torch.Generator(device=device)
    g.manual_seed(_seed(room, head))
    shape = (case.num_layers, case.planes, case.tokens_per_room, case.row_bytes)
    return torch.randint(0, 256, shape, generator=g, device=device, dtype=torch.uint8)


class Pool:
    """An engine's paged KV: per layer K and V ``[num_slots, local_heads, head_dim]`` (MLA: one plane)."""

    def __init__(self, case: Case, heads: RankHeads, device: torch.device, seed: int) -> None:
        self.case = case
        self.heads = heads
        self.device = device
        dtype = DTYPES[case.dtype][0]
        # Two spare pages that belong to no room: nothing may ever write them.
        self.num_pages = case.rooms * case.pages_per_room + 2
        num_slots = self.num_pages * case.page_size
        shape = (num_slots, heads.count, case.head_dim * DTYPES[case.dtype][1])

        def plane() -> torch.Tensor:  # zeroed as bytes: fill kernels need not exist for fp8
            return torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)

        self.k = [plane() for _ in range(case.num_layers)]
        self.v = None if case.mla else [plane() for _ in range(case.num_layers)]
        # Layer-major, as the slot layout: k0, v0, k1, v1, ... (MLA: one latent plane per layer).
        self.planes_t = list(self.k) if self.v is None else [t for kv in zip(self.k, self.v, strict=True) for t in kv]
        self.kv = KVPages(self.k, self.v)
        # Scattered, non-contiguous pages: each engine lays out rooms its own way.
        g = torch.Generator()
        g.manual_seed(seed)
        perm = torch.randperm(self.num_pages, generator=g)
        self.pages: dict[int, torch.Tensor] = {}
        used = torch.zeros(self.num_pages, dtype=torch.bool)
        for i, room in enumerate(case.room_ids):
            ids = perm[i * case.pages_per_room : (i + 1) * case.pages_per_room]
            used[ids] = True
            self.pages[room] = ids.to(device=device, dtype=torch.int32)
        self.unused_pages = (~used).nonzero().flatten()

    def token_slots(self, room: int) -> torch.Tensor:
        ps = self.case.page_size
        tok = torch.arange(self.case.tokens_per_room, device=self.device)
        return self.pages[room].long()[tok // ps] * ps + tok % ps

    def plane_u8(self, i: int) -> torch.Tensor:
        t = self.planes_t[i]
        return t.view(torch.uint8).view(t.shape[0], t.shape[1], self.case.row_bytes)

    def fill(self, room: int) -> None:
        slots = self.token_slots(room)
        for h in range(self.heads.count):
            want = head_bytes(self.case, room, self.heads.start + h, self.device)
            for lp in range(len(self.planes_t)):
                layer, plane = divmod(lp, self.case.planes)
                self.plane_u8(lp)[slots, h] = want[layer, plane]

    def copy(self, kind: str, room: int, token_start: int, num_tokens: int, slot: torch.Tensor) -> None:
        """Gather the chunk's tokens into ``slot`` or scatter them from it; a chunk may start mid-page."""
        ps = self.case.page_size
        pages = self.pages[room][token_start // ps : -(-(token_start + num_tokens) // ps)]
        fn = self.kv.gather if kind == "gather" else self.kv.scatter
        fn(pages, num_tokens, ps, slot, token_offset=token_start % ps)

    def verify(self, room: int) -> tuple[int, list[str]]:
        """Compares every KV byte of the room with the recomputed pattern; returns (bytes, problems)."""
        slots = self.token_slots(room)
        checked, bad = 0, []
        for h in range(self.heads.count):
            want = head_bytes(self.case, room, self.heads.start + h, self.device)
            for lp in range(len(self.planes_t)):
                layer, plane = divmod(lp, self.case.planes)
                got = self.plane_u8(lp)[slots, h]
                if not torch.equal(got, want[layer, plane]):
                    diff = (got != want[layer, plane]).nonzero()
                    bad.append(f"room {room} head {self.heads.start + h} layer {layer} plane {plane}: "
                               f"{diff.shape[0]} bytes differ, first at token/byte {diff[0].tolist()}")
                checked += got.numel()
        return checked, bad

    def stray_bytes(self) -> int:
        """Non-zero bytes in pages that belong to no room (a scatter that wrote out of bounds)."""
        ps = self.case.page_size
        slots = (self.unused_pages.to(self.device)[:, None] * ps + torch.arange(ps, device=self.device)).flatten()
        return sum(int(self.plane_u8(lp)[slots].count_nonzero()) for lp in range(len(self.planes_t)))


def _device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def _sync(dev: torch.device) -> None:
    """Waits for the copies enqueued on the current stream (a no-op on CPU)."""
    if dev.type == "cuda":
        ev = torch.cuda.Event()
        ev.record()
        ev.synchronize()


def _ring(case: Case, dev: torch.device, ring_bytes: int) -> torch.Tensor | None:
    # A plain cudaMalloc'd block (not expandable_segments): exportable by cudaIpcGetMemHandle.
    if dev.type != "cuda" or case.host_path:
        return None
    return torch.empty(ring_bytes, dtype=torch.uint8, device=dev)


def prefill_main(
    socket: str, case: Case, rank: int, device: str, ready: Any, start: Any, result: Any,
    exit_mode: str = "close", ring_bytes: int = 0, lease_ms: int = 0, timeout: float = 180.0,
) -> None:
    """exit_mode: "close" (UnregisterEngine), or "crash" (exit without unregistering: the lease lapses)."""
    res = RankResult("prefill", rank)
    tx: PrefillSender | None = None
    try:
        dev = _device(device)
        pool = Pool(case, case.heads(case.ptp, rank), dev, seed=1000 + rank)
        for room in case.room_ids:
            pool.fill(room)
        ring = _ring(case, dev, ring_bytes or case.ring_bytes)
        group = case.groups()[0]
        tx = PrefillSender(
            socket=socket, group=group, layout=case.layout, tp_size=case.ptp, tp_rank=rank,
            ring_bytes=ring_bytes or case.ring_bytes, ring_tensor=ring, name=f"{group}-p{rank}", lease_ms=lease_ms,
            pin_host=case.host_path and dev.type == "cuda",
        )
        res.engine_id = tx.engine_id
        # Off the clock: compile/load the kernel for each chunk shape.
        first = case.room_ids[0]
        for tok0, ntok in {(0, n) for _, n in case.chunks} | {case.chunks[-1]}:
            scratch = torch.empty(pool.kv.slot_nbytes(ntok), dtype=torch.uint8, device=dev)
            pool.copy("gather", first, tok0, ntok, scratch)
        _sync(dev)
        ready.put(("prefill", rank))
        if not start.wait(timeout):
            raise TimeoutError("start signal never came")
        res.t_start = time.time()
        deadline = time.monotonic() + timeout
        pending: list[int] = []

        def settle(limit: int) -> None:
            while len(pending) > limit:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"prefill rank {rank}: rooms unfinished: {pending[:5]}")
                for r in list(pending):
                    st = tx.poll(r)
                    if st.finished:
                        res.states[r] = "SUCCESS" if st.state is RoomState.SUCCESS else (
                            f"FAILED {st.failure_code}: {st.failure_reason}")
                        tx.release(r)
                        pending.remove(r)
                time.sleep(0.001)

        chunks = case.chunks
        for room in case.room_ids:
            for cid, (tok0, ntok) in enumerate(chunks):
                slot = tx.acquire(ntok, timeout=timeout)
                out = tx.tensor(slot.offset, slot.chunk_bytes)
                pool.copy("gather", room, tok0, ntok, out)
                _sync(dev)  # the daemon reads the slot as soon as the chunk is enqueued
                last = cid == len(chunks) - 1
                tx.enqueue(room, cid, tok0, ntok, slot, last=last, aux=b"aux-%d" % room if last else b"")
                res.bytes_moved += slot.chunk_bytes
            pending.append(room)
            settle(case.in_flight)
        settle(0)
        res.t_end = time.time()
    except Exception:
        res.error = traceback.format_exc()
    result.put(res)
    if exit_mode == "crash" and res.error is None:
        result.close()
        result.join_thread()  # flush the result before dying
        os._exit(0)  # no UnregisterEngine, no KeepAlive any more: the daemon must notice by itself
    if tx is not None:
        tx.close()


def _watch(rx: DecodeReceiver, wake: queue.Queue[int]) -> None:
    with contextlib.suppress(Exception):  # the stream ends when the client closes
        for ev in rx.watch():
            wake.put(ev.room)


def decode_main(
    socket: str, case: Case, rank: int, device: str, prefill_address: str, ready: Any, start: Any, result: Any,
    ring_bytes: int = 0, timeout: float = 180.0,
) -> None:
    res = RankResult("decode", rank)
    rx: DecodeReceiver | None = None
    try:
        dev = _device(device)
        pool = Pool(case, case.heads(case.dtp, rank), dev, seed=2000 + rank)
        ring = _ring(case, dev, ring_bytes or case.ring_bytes)
        pre_group, group = case.groups()
        rx = DecodeReceiver(
            socket=socket, group=group, layout=case.layout, tp_size=case.dtp, tp_rank=rank,
            ring_bytes=ring_bytes or case.ring_bytes, ring_tensor=ring, name=f"{group}-d{rank}",
            pin_host=case.host_path and dev.type == "cuda",
        )
        res.engine_id = rx.engine_id
        # Off the clock: compile/load the kernel for each chunk shape (zeros onto zero pages).
        first = case.room_ids[0]
        for tok0, ntok in {(0, n) for _, n in case.chunks} | {case.chunks[-1]}:
            scratch = torch.zeros(pool.kv.slot_nbytes(ntok), dtype=torch.uint8, device=dev)
            pool.copy("scatter", first, tok0, ntok, scratch)
        _sync(dev)
        ready.put(("decode", rank))
        if not start.wait(timeout):
            raise TimeoutError("start signal never came")
        res.t_start = time.time()
        deadline = time.monotonic() + timeout
        # Room events say which rooms to poll: polling every active room each sweep cost one
        # PollRoom round trip per room per sweep, and that, not the copy, set the pace.
        wake: queue.Queue[int] = queue.Queue()
        threading.Thread(target=_watch, args=(rx, wake), daemon=True).start()
        done: dict[int, set[int]] = {}
        for room in case.room_ids:
            rx.expect(room, prefill_address, pre_group, case.tokens_per_room)
            done[room] = set()
        active = set(case.room_ids)
        nchunks = len(case.chunks)
        again: set[int] = set()  # finished with chunks just taken: poll once more, now
        while active:
            if time.monotonic() > deadline:
                raise TimeoutError(f"decode rank {rank}: rooms unfinished: {sorted(active)[:5]}")
            dirty, again = again, set()
            try:
                if not dirty:
                    dirty.add(wake.get(timeout=0.05))
                while True:
                    dirty.add(wake.get_nowait())
            except queue.Empty:
                pass
            # Quiet for a while (or the stream was not up yet): poll every room once.
            for room in sorted(dirty & active if dirty else active):
                st = rx.poll(room)
                fresh = [c for c in st.landed if c.chunk_id not in done[room]]
                for c in fresh:
                    src = rx.tensor(c.offset, c.chunk_bytes)
                    pool.copy("scatter", room, c.token_start, c.num_tokens, src)
                    res.bytes_moved += c.chunk_bytes
                if fresh:
                    _sync(dev)  # the slot is reused once watermarked: finish reading it first
                    rx.watermark(room, [c.chunk_id for c in fresh])
                    done[room].update(c.chunk_id for c in fresh)
                    if st.finished:
                        again.add(room)
                if st.finished and not fresh:
                    if st.state is RoomState.SUCCESS:
                        if len(done[room]) != nchunks:
                            raise AssertionError(f"room {room}: SUCCESS with {len(done[room])}/{nchunks} chunks")
                        if st.aux != b"aux-%d" % room:
                            raise AssertionError(f"room {room}: aux {st.aux!r}")
                        res.states[room] = "SUCCESS"
                    else:
                        res.states[room] = f"FAILED {st.failure_code}: {st.failure_reason}"
                    rx.release(room)
                    active.discard(room)
        _sync(dev)
        res.t_end = time.time()
        # Off the clock: every page of every room, byte for byte, and nothing outside them.
        for room in case.room_ids:
            if res.states.get(room) != "SUCCESS":
                continue
            checked, bad = pool.verify(room)
            res.checked_bytes += checked
            res.mismatches.extend(bad[:4])
        res.stray_bytes = pool.stray_bytes()
    except Exception:
        res.error = traceback.format_exc()
    result.put(res)
    if rx is not None:
        rx.close()


@dataclass
class CaseResult:
    case: Case
    ranks: list[RankResult]
    seconds: float

    def by_role(self, role: str) -> list[RankResult]:
        return sorted((r for r in self.ranks if r.role == role), key=lambda r: r.rank)

    @property
    def errors(self) -> list[str]:
        return [f"{r.role} rank {r.rank}:\n{r.error}" for r in self.ranks if r.error]

    @property
    def problems(self) -> list[str]:
        """One line per rank error and per distinct room failure (for the results file)."""
        out = [f"{r.role} {r.rank}: {r.error.strip().splitlines()[-1]}" for r in self.ranks if r.error]
        failed = {v for r in self.ranks for v in r.states.values() if v != "SUCCESS"}
        return out + sorted(failed)[:3]

    @property
    def landed_bytes(self) -> int:
        return sum(r.bytes_moved for r in self.by_role("decode"))

    @property
    def gbps(self) -> float:
        return self.landed_bytes / self.seconds / 1e9 if self.seconds > 0 else math.nan


def run_case(
    case: Case, prefill_socket: str, decode_socket: str, prefill_address: str, device: str,
    prefill_kw: dict[str, Any] | None = None, decode_kw: dict[str, Any] | None = None, timeout: float = 180.0,
    decode_device: str = "",
) -> CaseResult:
    """Starts every rank (spawned processes), releases them together, collects their results.
    Prefill ranks run on `device`, decode ranks on `decode_device` (default: the same).

    Throughput counts the bytes that landed in the decode rings over the wall time from the
    common start until the last rank finished (gathers, NIXL, scatters and watermarks included).
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    start = ctx.Event()
    procs = [
        ctx.Process(target=decode_main,
                    args=(decode_socket, case, r, decode_device or device, prefill_address, ready, start, results),
                    kwargs={**(decode_kw or {}), "timeout": timeout})
        for r in range(case.dtp)
    ] + [
        ctx.Process(target=prefill_main, args=(prefill_socket, case, r, device, ready, start, results),
                    kwargs={**(prefill_kw or {}), "timeout": timeout})
        for r in range(case.ptp)
    ]
    for p in procs:
        p.start()
    ranks: list[RankResult] = []
    t0 = 0.0
    try:
        waiting, deadline = len(procs), time.monotonic() + timeout
        while waiting:
            try:
                ready.get(timeout=0.5)
                waiting -= 1
                continue
            except queue.Empty:
                pass
            # A rank that fails before it is ready reports why instead; fail fast.
            if not results.empty() or time.monotonic() > deadline or any(not p.is_alive() for p in procs):
                time.sleep(0.5)
                while not results.empty():
                    ranks.append(results.get())
                raise AssertionError(
                    f"{waiting} of {len(procs)} ranks never got ready:\n" + "\n".join(r.error or "" for r in ranks)
                )
        t0 = time.time()
        start.set()
        for _ in procs:
            ranks.append(results.get(timeout=timeout + 60))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    t_end = max((r.t_end for r in ranks if r.t_end), default=t0)  # a rank that raised has none
    return CaseResult(case, ranks, t_end - t0)
