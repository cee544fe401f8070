"""Prefill and decode rank processes for the sglang backend tests: real sglang base classes and
KVArgs over CPU tensors laid out as sglang's MHA token-to-KV pool lays them out (per layer K and V
``[size + page_size, local_heads, head_dim]``, K buffers then V buffers, one item = one page)."""

from __future__ import annotations

import os
import time
import traceback
import types
from dataclasses import dataclass
from typing import Any

import torch

from tests.readiness import Budget, wait_for

LAYERS, TOTAL_HEADS, HEAD_DIM, PAGE, POOL_PAGES, AUX_BYTES = 2, 2, 8, 4, 64, 16
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class RoomPlan:
    room: int
    tokens: int
    chunk_pages: tuple[int, ...]  # pages per send() call
    abort_after: int = -1  # prefill aborts after this many chunks (-1: never)
    repeat_chunk: int = -1  # prefill sends this chunk with the previous chunk's id (the daemon refuses it)


def value(room: int, layer: int, plane: int, token: int, head: int) -> torch.Tensor:
    """The KV of one (token, head): small integers, exact in bf16, different per coordinate."""
    base = room * 7 + layer * 5 + plane * 3 + token * 11 + head * 13
    return ((torch.arange(HEAD_DIM) + base) % 200).to(DTYPE)


def local_heads(tp: int, rank: int) -> list[int]:
    if tp <= TOTAL_HEADS:
        n = TOTAL_HEADS // tp
        return list(range(rank * n, (rank + 1) * n))
    return [rank * TOTAL_HEADS // tp]


class Pool:
    def __init__(self, tp: int, rank: int) -> None:
        self.heads = local_heads(tp, rank)
        size = POOL_PAGES * PAGE
        self.k = [torch.zeros(size + PAGE, len(self.heads), HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS)]
        self.v = [torch.zeros(size + PAGE, len(self.heads), HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS)]
        self.aux = torch.zeros(32, AUX_BYTES, dtype=torch.uint8)

    def kv_args(self, rank: int) -> Any:
        from sglang.srt.disaggregation.base.conn import KVArgs

        a = KVArgs()
        bufs = self.k + self.v
        a.engine_rank = rank
        a.kv_data_ptrs = [b.data_ptr() for b in bufs]
        a.kv_data_lens = [b.nbytes for b in bufs]
        a.kv_item_lens = [b[0].nbytes * PAGE for b in bufs]
        a.kv_layer_ids = list(range(LAYERS)) * 2
        a.kv_cache_dtype_str = "bfloat16"
        a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [self.aux.data_ptr()], [self.aux.nbytes], [AUX_BYTES]
        a.kv_head_num, a.total_kv_head_num, a.page_size = len(self.heads), TOTAL_HEADS, PAGE
        return a

    def fill(self, plan: RoomPlan, pages: list[int]) -> None:
        for t in range(plan.tokens):
            slot = pages[t // PAGE] * PAGE + t % PAGE
            for layer in range(LAYERS):
                for i, h in enumerate(self.heads):
                    self.k[layer][slot, i] = value(plan.room, layer, 0, t, h)
                    self.v[layer][slot, i] = value(plan.room, layer, 1, t, h)

    def check(self, plan: RoomPlan, pages: list[int]) -> int:
        for t in range(plan.tokens):
            slot = pages[t // PAGE] * PAGE + t % PAGE
            for layer in range(LAYERS):
                for i, h in enumerate(self.heads):
                    for plane, buf in ((0, self.k), (1, self.v)):
                        if not torch.equal(buf[layer][slot, i], value(plan.room, layer, plane, t, h)):
                            raise AssertionError(f"room {plan.room} token {t} layer {layer} plane {plane} head {h} differs")
        return plan.tokens * LAYERS * 2 * len(self.heads) * HEAD_DIM * 2


def aux_for(room: int) -> bytes:
    return (b"aux-%d-" % room).ljust(AUX_BYTES, b"x")[:AUX_BYTES]


def server_args(port: int, tp: int) -> Any:
    # The fields the backend reads from sglang's ServerArgs.
    return types.SimpleNamespace(host="127.0.0.1", port=30000 + port % 1000, disaggregation_bootstrap_port=port,
                                 tp_size=tp, device="cpu")


class PollCounter:
    """Counts the backend's poll() calls (sglang's scheduler makes one per sender or receiver per
    step) and the PollRoom calls they cost the daemon."""

    def __init__(self, client: Any) -> None:
        self.started = time.monotonic()
        self.polls = 0
        self.daemon_polls = 0
        inner = client.poll

        def counted(*a: Any, **k: Any) -> Any:
            self.daemon_polls += 1
            return inner(*a, **k)

        client.poll = counted

    def report(self) -> dict[str, Any]:
        return {"polls": self.polls, "daemon_polls": self.daemon_polls, "seconds": time.monotonic() - self.started}


COUNTER: PollCounter | None = None


def _wait(obj: Any, want: set[int], timeout: float = 60.0) -> int:
    from sglang.srt.disaggregation.base.conn import KVPoll

    deadline = time.monotonic() + timeout
    while True:
        if COUNTER is not None:
            COUNTER.polls += 1
        st = obj.poll()
        if st in want or st == KVPoll.Failed:
            return int(st)
        if time.monotonic() > deadline:
            raise TimeoutError(f"still {st}")
        time.sleep(0.001)  # sglang polls once per scheduler step


def _ensure_route(mgr: Any, addr: str, base_s: float = 60.0) -> None:
    """As sglang's decode prealloc queue does before it inits a receiver: asks until the prefill
    instance has registered its route (it may start after this rank)."""
    wait_for(f"kvxferd route from the prefill bootstrap server {addr}", lambda: bool(mgr.try_ensure_parallel_info(addr)),
             base_s, every=0.05)


def prefill_rank(socket: str, port: int, tp: int, rank: int, plans: list[RoomPlan], out: Any) -> None:
    try:
        os.environ["KVXFERD_SOCKET"] = socket
        os.environ["KVXFER_SGLANG_RING_BYTES"] = str(4 << 20)
        from sglang.srt.disaggregation.base.conn import KVPoll

        from kvxfer_client.sglang._conn import KvxferdKVManager, KvxferdKVSender

        pool = Pool(tp, rank)
        mgr = KvxferdKVManager(pool.kv_args(rank), "prefill", server_args(port, tp), False)
        global COUNTER
        COUNTER = PollCounter(mgr.tx)
        results: dict[int, str] = {}
        for i, plan in enumerate(plans):
            sender = KvxferdKVSender(mgr, f"127.0.0.1:{port}", plan.room)
            got = _wait(sender, {KVPoll.WaitingForInput})
            fails = plan.abort_after >= 0 or plan.repeat_chunk >= 0
            if got == KVPoll.Failed and fails and "aborted by engine" in sender._error:
                # Another rank got here first and failed the room (the plan says it does: an abort,
                # or a repeated chunk the daemon refuses): a rank that comes later sees it failed,
                # as sglang's scheduler would, and sends nothing.
                results[plan.room] = "Failed"
                sender.clear()
                continue
            assert got == KVPoll.WaitingForInput, f"room {plan.room}: poll {got}, {sender._error or 'no error'}"
            num_pages = -(-plan.tokens // PAGE)
            slot = i % len(pool.aux)  # aux items are reused once their room is over
            sender.init(num_pages, aux_index=slot)
            pool.aux[slot] = torch.frombuffer(bytearray(aux_for(plan.room)), dtype=torch.uint8)
            pages = [POOL_PAGES - 1 - p for p in range(num_pages)]  # not the decode's pages
            pool.fill(plan, pages)
            at = 0
            for n, count in enumerate(plan.chunk_pages):
                if n == plan.abort_after:
                    sender.abort()
                    break
                if n == plan.repeat_chunk:
                    sender.chunk_id -= 1  # an engine bug: the daemon refuses the chunk, the room fails
                sender.send(torch.tensor(pages[at : at + count], dtype=torch.int32))
                at += count
            end = _wait(sender, {KVPoll.Success})
            results[plan.room] = "Success" if end == KVPoll.Success else "Failed"
            sender.clear()
        out.put(("prefill", rank, {"rooms": results, **COUNTER.report()}, None))
        mgr.close()
    except Exception:
        out.put(("prefill", rank, {}, traceback.format_exc()))


def decode_rank(socket: str, port: int, tp: int, rank: int, plans: list[RoomPlan], out: Any) -> None:
    try:
        os.environ["KVXFERD_SOCKET"] = socket
        os.environ["KVXFER_SGLANG_RING_BYTES"] = str(4 << 20)
        from sglang.srt.disaggregation.base.conn import KVPoll

        from kvxfer_client.sglang._conn import KvxferdKVManager, KvxferdTransferError
        from kvxfer_client.sglang._receiver import KvxferdKVReceiver

        pool = Pool(tp, rank)
        mgr = KvxferdKVManager(pool.kv_args(rank), "decode", server_args(port + 1, tp), False)
        global COUNTER
        COUNTER = PollCounter(mgr.rx)
        results: dict[int, Any] = {}
        checked = 0
        for i, plan in enumerate(plans):
            recv = KvxferdKVReceiver(mgr, f"127.0.0.1:{port}", plan.room)
            _ensure_route(mgr, f"127.0.0.1:{port}")
            recv.init(0)
            assert _wait(recv, {KVPoll.WaitingForInput}) == KVPoll.WaitingForInput
            pages = [3 * p + 1 for p in range(-(-plan.tokens // PAGE))]
            slot = i % len(pool.aux)
            recv.send_metadata(torch.tensor(pages, dtype=torch.int32), aux_index=slot)
            end = _wait(recv, {KVPoll.Success})
            if end == KVPoll.Success:
                checked += pool.check(plan, pages)
                if bytes(pool.aux[slot].numpy()) != aux_for(plan.room):
                    raise AssertionError(f"room {plan.room}: aux {bytes(pool.aux[slot].numpy())!r}")
                results[plan.room] = "Success"
            else:
                try:
                    recv.failure_exception()
                except KvxferdTransferError as exc:
                    results[plan.room] = f"Failed: {exc.failure_reason}"
            recv.clear()
        out.put(("decode", rank, {"rooms": results, "checked_bytes": checked, **COUNTER.report()}, None))
        mgr.close()
    except Exception:
        out.put(("decode", rank, {}, traceback.format_exc()))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_pair(prefill_socket: str, decode_socket: str, prefill_tp: int, decode_tp: int, plans: list[RoomPlan],
             timeout: float = 120.0) -> list[tuple[str, int, Any, str | None]]:
    """Runs every prefill and decode rank of one TP pair (processes of their own, the backend's
    bootstrap server in this one) over `plans`; returns each rank's (role, rank, result, error).
    Raises TimeoutError, with what came back, when a rank stays silent for `timeout`."""
    from kvxfer_client.sglang._bootstrap import KvxferdKVBootstrapServer

    port = free_port()
    boot = KvxferdKVBootstrapServer("127.0.0.1", port)
    try:
        return run_ranks([(prefill_rank, (prefill_socket, port, prefill_tp, r, plans)) for r in range(prefill_tp)]
                         + [(decode_rank, (decode_socket, port, decode_tp, r, plans)) for r in range(decode_tp)],
                         timeout)
    finally:
        boot.close()


def run_ranks(targets: list[tuple[Any, tuple[Any, ...]]], timeout: float) -> list[tuple[str, int, Any, str | None]]:
    """Each target(*args, out) in a process forked from this one; each puts one (role, rank,
    result, error) on `out`. Raises TimeoutError, with what came back, when one stays silent for
    `timeout`; kills what is left at the end."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("fork")
    out: Any = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, out)) for fn, args in targets]
    got: list[tuple[str, int, Any, str | None]] = []
    try:
        for proc in procs:
            proc.start()
        while len(got) < len(procs):
            # Each result may take `timeout` on a quiet box (the first includes engine start-up).
            b = Budget(f"a result from {len(procs) - len(got)} of {len(procs)} ranks", timeout)
            try:
                got.append(out.get(timeout=b.limit()))
            except queue.Empty:
                raise TimeoutError(b.failure(f"got {got}")) from None
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return got
