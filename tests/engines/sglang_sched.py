"""sglang's own PD scheduler code around the kvxferd backend, for tests/engines/test_sglang_sched.py.

Each rank is a process of its own with a minimal scheduler host (:class:`_Host` and, per role,
:func:`_host`) built on sglang's ``SchedulerDisaggregationPrefillMixin`` /
``SchedulerDisaggregationDecodeMixin``; the queues are sglang's own (``PrefillBootstrapQueue``,
``DecodePreallocQueue``, ``DecodeTransferQueue``), as are the KV pool (``MHATokenToKVPool`` on
CPU), the req-to-token pool, the paged allocator, the tree cache (``RadixCache``, disabled as with
``--disable-radix-cache``), the metadata buffers, ``Req``, the published ``ServerArgs`` and the
TP ranks' poll all-reduce (a real gloo group per side). The backend comes through sglang's plugin
loader (``load_plugins``) and its ``get_kv_class`` hook. What stands in, and why, is in the test
module's docstring.
"""

from __future__ import annotations

import os
import time
import traceback
import types
from array import array
from dataclasses import dataclass
from typing import Any

import torch

from tests.engines.sglang_ranks import (
    DTYPE,
    HEAD_DIM,
    LAYERS,
    PAGE,
    TOTAL_HEADS,
    free_port,
    local_heads,
    run_ranks,
    value,
)

POOL_TOKENS, ROWS = 512, 16
META_SLOTS = 8


@dataclass(frozen=True)
class Plan:
    room: int
    tokens: int
    chunk_tokens: int  # prefill forward chunk (sglang's --chunked-prefill-size); >= tokens: one chunk
    abort_after: int = -1  # the prefill scheduler aborts the request after this many chunks
    repeat_chunk: int = -1  # this chunk goes out with the previous chunk's id (an engine bug)
    orphan: bool = False  # decode only: no prefill instance answers at the request's bootstrap address

    @property
    def fails(self) -> bool:
        return self.abort_after >= 0 or self.repeat_chunk >= 0 or self.orphan


def first_token(room: int) -> int:
    return 1000 + room % 50_000


class _Recorder:
    """Stands in for the scheduler's output streamer (the detokenizer IPC): records what sglang
    would stream back to the client."""

    def __init__(self) -> None:
        self.streamed: list[Any] = []

    def stream_output(self, reqs: list[Any], *_: Any, **__: Any) -> None:
        self.streamed.extend(reqs)


class _Group:
    """sglang's GroupCoordinator as the disaggregation code reads it (cpu_group, world_size)."""

    def __init__(self, tp: int) -> None:
        import torch.distributed as dist

        self.cpu_group = dist.group.WORLD
        self.world_size = tp


class _Host:
    """What sglang's Scheduler holds that the disaggregation mixins and queues read."""

    def __init__(self, tp: int, rank: int) -> None:
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.runtime_context import get_server_args

        self.server_args = get_server_args()
        self.heads = local_heads(tp, rank)
        self.transfer_backend = TransferBackend(self.server_args.disaggregation_transfer_backend)
        self.kv_pool = MHATokenToKVPool(size=POOL_TOKENS, page_size=PAGE, dtype=DTYPE, head_num=len(self.heads),
                                        head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                                        enable_alt_stream=False)
        self.req_to_token_pool = ReqToTokenPool(size=ROWS, max_context_len=POOL_TOKENS, device="cpu",
                                                enable_memory_saver=False)
        self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(POOL_TOKENS, PAGE, DTYPE, "cpu", self.kv_pool,
                                                                      need_sort=False)
        self.tree_cache = RadixCache(CacheInitParams(disable=True, req_to_token_pool=self.req_to_token_pool,
                                                     token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                                                     page_size=PAGE))
        self.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(META_SLOTS)
        self.disagg_metadata_buffers = MetadataBuffers(META_SLOTS, hidden_size=16, hidden_states_dtype=DTYPE,
                                                       max_sampling_mask_tokens=16)
        group = _Group(tp)
        self.attn_tp_cpu_group = self.attn_cp_cpu_group = group.cpu_group
        self.output_streamer = _Recorder()
        self.metrics_reporter = types.SimpleNamespace(enable_metrics=False)
        self.model_config = types.SimpleNamespace(num_hidden_layers=LAYERS, hf_text_config=types.SimpleNamespace(),
                                                  get_total_num_kv_heads=lambda: TOTAL_HEADS)
        self.tp_worker = types.SimpleNamespace(
            is_hybrid_swa=False,
            model_runner=types.SimpleNamespace(kv_cache_dtype_str="auto", effective_logical_max_total_num_tokens=POOL_TOKENS))
        self.kv_shard_widening = 1
        self.rust_server = None
        self.scheduler_stage_metrics = None
        self.kv_checksum_computer = None
        self.waiting_queue: list[Any] = []
        self.enable_overlap = self.enable_staging = self.enable_hisparse = self.enable_decode_hicache = False
        self.enable_priority_scheduling = self.enable_lora = False
        self.processed_tokens_counter = 0
        self.random_seed = 0
        self.last_batch = None
        # The batch result processor's reasoning-token count (no reasoning parser: nothing to count).
        self.batch_result_processor = types.SimpleNamespace(_maybe_update_reasoning_tokens=lambda req, token: None)
        self.spec_algorithm = types.SimpleNamespace(is_eagle=lambda: False, is_none=lambda: True)

    def _release_aborted_request(self, req: Any) -> None:
        # Scheduler._release_aborted_request, less its multimodal and session parts.
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

        self.tree_cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)


def _req(plan: Plan, port: int, mode: Any) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid=f"req-{plan.room}", origin_input_text="", origin_input_ids=array("q", range(plan.tokens)),
               sampling_params=SamplingParams(max_new_tokens=4), bootstrap_host="127.0.0.1", bootstrap_port=port,
               bootstrap_room=plan.room, disagg_mode=mode)


def _publish(role: str, tp: int, rank: int, port: int, dist_port: int) -> None:
    import torch.distributed as dist
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", world_size=tp, rank=rank)
    sa = ServerArgs(model_path="dummy", device="cpu", disaggregation_mode=role, disaggregation_transfer_backend="kvxferd",
                    tp_size=tp, page_size=PAGE, host="127.0.0.1", port=20000 + port % 20000,
                    disaggregation_bootstrap_port=port)
    rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=rank))
    rc.get_parallel().override_permanently(attn_tp_group=_Group(tp))


def _values(room: int, tokens: range, heads: list[int], layer: int, plane: int) -> torch.Tensor:
    """[tokens, heads, HEAD_DIM] of value() for one layer and plane."""
    return torch.stack([torch.stack([value(room, layer, plane, t, h) for h in heads]) for t in tokens])


def _forward(host: _Host, req: Any, plan: Plan, start: int, end: int) -> None:
    """Stands in for the model forward of one prefill chunk [start, end): allocates the chunk's
    KV slots as sglang's extend does (req row, whole pages) and writes the KV that a forward would."""
    pool = host.req_to_token_pool
    if not req.kv.holds_kv:
        pool.alloc([req])
    n = -(-(end - start) // PAGE) * PAGE
    locs = host.token_to_kv_pool_allocator.alloc(n)
    assert locs is not None, f"room {plan.room}: KV pool full"
    pool.write((req.kv.req_pool_idx, slice(start, end)), locs[: end - start].to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = end
    req.extend_end = end
    idx = locs[: end - start].long()
    for layer in range(LAYERS):
        host.kv_pool.k_buffer[layer][idx] = _values(plan.room, range(start, end), host.heads, layer, 0)
        host.kv_pool.v_buffer[layer][idx] = _values(plan.room, range(start, end), host.heads, layer, 1)


def _host(role: str, tp: int, rank: int) -> Any:
    """A scheduler host of sglang's prefill or decode mixin. The mixins are imported here, not at
    module import: sglang's scheduler modules take a minute to import on a loaded 2-core box and
    only the helper process (and the ranks forked from it) loads them."""
    from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    mixin = SchedulerDisaggregationPrefillMixin if role == "prefill" else SchedulerDisaggregationDecodeMixin
    return type(f"{role.title()}Host", (_Host, mixin), {})(tp, rank)


def _outcome(req: Any) -> str:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if isinstance(req.finished_reason, FINISH_ABORT):
        return f"Failed: {req.finished_reason.message}"
    return "Success"


def prefill_rank(tp: int, rank: int, port: int, dist_port: int, plans: list[Plan]) -> dict[str, Any]:
    """One prefill TP rank: requests go through sglang's bootstrap queue, chunked 'forwards',
    send_kv_chunk and the inflight queue until every request is done."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import DisaggregationMode, prepare_abort

    _publish("prefill", tp, rank, port, dist_port)
    host = h = _host("prefill", tp, rank)
    h.disagg_prefill_inflight_queue = []
    h.disagg_prefill_pending_chunk_rids = set()
    h.chunked_req = None
    h.disagg_prefill_bootstrap_queue = PrefillBootstrapQueue(
        host.kv_pool, None, host.req_to_metadata_buffer_idx_allocator, host.disagg_metadata_buffers, 0, port,
        POOL_TOKENS, host, None, host.transfer_backend)
    plans = [p for p in plans if not p.orphan]
    by_room = {p.room: p for p in plans}
    reqs = [_req(p, port, DisaggregationMode.PREFILL) for p in plans]
    for req in reqs:
        h.disagg_prefill_bootstrap_queue.add(req, len(host.heads))
    running: list[Any] = []
    sent: dict[int, int] = {}  # chunks forwarded per room
    results: dict[int, str] = {}
    deadline = time.monotonic() + 120
    while len(results) < len(plans):
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefill rank {rank}: rooms left {set(by_room) - set(results)}")
        running += h.disagg_prefill_bootstrap_queue.pop_bootstrapped()
        for req in list(running):
            plan = by_room[req.bootstrap_room]
            n = sent.get(plan.room, 0)
            if n == plan.abort_after:  # the client aborts the request between two chunks
                prepare_abort(req, "aborted by the client")
                h._retire_aborted_prefill_result(req)
                running.remove(req)
                results[plan.room] = "Failed: aborted"
                continue
            start = n * plan.chunk_tokens
            end = min(plan.tokens, start + plan.chunk_tokens)
            _forward(host, req, plan, start, end)
            sent[plan.room] = n + 1
            if n == plan.repeat_chunk:
                req.disagg_kv_sender.chunk_id -= 1  # an engine bug: the daemon refuses the chunk
            if end < plan.tokens:
                h.send_kv_chunk(req)  # as process_prefill_chunk sends a finished middle chunk
                continue
            # As process_batch_result_disagg_prefill does for a request whose prefill is done.
            req.output_ids.append(first_token(plan.room))
            h.checkpoint_disagg_prefill(req)
            h.disagg_prefill_inflight_queue.append(req)
            h.send_kv_chunk(req, last_chunk=True)
            running.remove(req)
        for req in h.process_disagg_prefill_inflight_queue():
            results[req.bootstrap_room] = _outcome(req)
        for req in host.output_streamer.streamed:  # bootstrap failures
            results.setdefault(req.bootstrap_room, _outcome(req))
        time.sleep(0.01)  # one scheduler step; a loaded 2-core box is shared
    mgr = h.disagg_prefill_bootstrap_queue.kv_manager
    mgr.close()
    return {"rooms": results, "free_meta": host.req_to_metadata_buffer_idx_allocator.available_size()}


def decode_rank(tp: int, rank: int, port: int, dist_port: int, plans: list[Plan]) -> dict[str, Any]:
    """One decode TP rank: requests go through sglang's prealloc and transfer queues
    (process_decode_queue, the scheduler's own step) until each is transferred or failed; every
    landed KV byte and the first output token are checked."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
    from sglang.srt.disaggregation.utils import DisaggregationMode

    _publish("decode", tp, rank, port + 1, dist_port)
    host = h = _host("decode", tp, rank)
    h.running_batch = types.SimpleNamespace(reqs=[])
    h.disagg_decode_transfer_queue = DecodeTransferQueue(host.req_to_metadata_buffer_idx_allocator,
                                                         host.disagg_metadata_buffers, host, host.tree_cache)
    h.disagg_decode_prealloc_queue = DecodePreallocQueue(
        host.req_to_token_pool, host.token_to_kv_pool_allocator, None, host.req_to_metadata_buffer_idx_allocator,
        host.disagg_metadata_buffers, host, h.disagg_decode_transfer_queue, host.tree_cache, 0, port, POOL_TOKENS,
        2 * PAGE, host.transfer_backend)
    by_room = {p.room: p for p in plans}
    dead = free_port()  # nothing listens there
    for p in plans:
        h.disagg_decode_prealloc_queue.add(_req(p, dead if p.orphan else port, DisaggregationMode.DECODE))
    results: dict[int, str] = {}
    checked = 0
    deadline = time.monotonic() + 120
    while len(results) < len(plans):
        if time.monotonic() > deadline:
            raise TimeoutError(f"decode rank {rank}: rooms left {set(by_room) - set(results)}")
        h.process_decode_queue()
        for req in host.waiting_queue:
            checked += _check(host, req, by_room[req.bootstrap_room])
            results[req.bootstrap_room] = _outcome(req)
        host.waiting_queue.clear()
        for req in host.output_streamer.streamed:
            results.setdefault(req.bootstrap_room, _outcome(req))
        time.sleep(0.01)  # one scheduler step; a loaded 2-core box is shared
    h.disagg_decode_prealloc_queue.kv_manager.close()
    return {"rooms": results, "checked_bytes": checked,
            "free_meta": host.req_to_metadata_buffer_idx_allocator.available_size()}


def _check(host: _Host, req: Any, plan: Plan) -> int:
    """The request's KV, read through its req-to-token row as decode's attention would, and the
    first output token the prefill handed over."""
    if list(req.output_ids[:1]) != [first_token(plan.room)]:
        raise AssertionError(f"room {plan.room}: first output token {req.output_ids[:1]}")
    locs = host.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : plan.tokens].long()
    for layer in range(LAYERS):
        for plane, buf in ((0, host.kv_pool.k_buffer), (1, host.kv_pool.v_buffer)):
            want = _values(plan.room, range(plan.tokens), host.heads, layer, plane)
            if not torch.equal(buf[layer][locs], want):
                bad = (buf[layer][locs] != want).any(-1).nonzero().tolist()[:4]
                raise AssertionError(f"room {plan.room} layer {layer} plane {plane}: (token, head) {bad} differ")
    return plan.tokens * LAYERS * 2 * len(host.heads) * HEAD_DIM * DTYPE.itemsize


def _rank(fn: Any, socket: str, args: tuple[Any, ...], role: str, rank: int, out: Any) -> None:
    try:
        os.environ["KVXFERD_SOCKET"] = socket
        os.environ["KVXFER_SGLANG_RING_BYTES"] = str(4 << 20)
        out.put((role, rank, fn(*args), None))
    except BaseException:
        out.put((role, rank, {}, traceback.format_exc()))


def run_pair(prefill_socket: str, decode_socket: str, prefill_tp: int, decode_tp: int, plans: list[Plan],
             timeout: float = 180.0) -> list[tuple[str, int, Any, str | None]]:
    """Every prefill and decode rank of one TP pair over `plans`, in processes forked from this
    one (which must have loaded sglang: sglang_cpu.load_sglang), with the backend's bootstrap
    server, which sglang's get_kv_class hands out, in this process (as sglang's prefill launcher
    runs it). Returns each rank's (role, rank, result, error)."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    port, pdist, ddist = free_port(), free_port(), free_port()
    boot = get_kv_class(TransferBackend("kvxferd"), KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
    try:
        return run_ranks([(_rank, (prefill_rank, prefill_socket, (prefill_tp, r, port, pdist, plans), "prefill", r))
                          for r in range(prefill_tp)]
                         + [(_rank, (decode_rank, decode_socket, (decode_tp, r, port, ddist, plans), "decode", r))
                            for r in range(decode_tp)], timeout)
    finally:
        boot.close()


def plugin_facts() -> dict[str, Any]:
    """What sglang's own plugin loading made of the backend, read the way sglang reads it."""
    import argparse

    from sglang.srt.disaggregation import decode, prefill
    from sglang.srt.disaggregation import utils as u
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    cli = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "dummy", "--disaggregation-transfer-backend",
                                                      "kvxferd"]))
    backend = u.TransferBackend("kvxferd")
    return {
        "cli_backend": cli.disaggregation_transfer_backend,
        "member": backend.name,
        "classes": {t.value: getattr(u.get_kv_class(backend, t), "__qualname__", None) for t in u.KVClassType},
        "nixl_manager": u.get_kv_class(u.TransferBackend.NIXL, u.KVClassType.MANAGER).__qualname__,
        "scheduler_modules_bound": all(m.get_kv_class is u.get_kv_class and m.TransferBackend is u.TransferBackend
                                       for m in (decode, prefill)),
    }


def main() -> None:
    """One process: sglang's plugins and scheduler modules loaded (the torchvision stand-in is
    installed here, never in pytest's process), the plugin facts, then every TP pair asked for;
    prints one JSON object."""
    import argparse
    import json
    import logging

    from tests.engines.sglang_cpu import load_sglang

    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill-socket", required=True)
    ap.add_argument("--decode-socket", required=True)
    ap.add_argument("--pairs", default="2:1,1:2")
    ap.add_argument("--plans", required=True, help="JSON list of Plan fields per pair")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    t0 = time.monotonic()
    load_sglang()
    report: dict[str, Any] = {"load_s": round(time.monotonic() - t0, 1), "plugin": plugin_facts(), "pairs": []}
    for pair, plans in zip(args.pairs.split(","), json.loads(args.plans), strict=True):
        ptp, dtp = (int(x) for x in pair.split(":"))
        t = time.monotonic()
        got = run_pair(args.prefill_socket, args.decode_socket, ptp, dtp, [Plan(**p) for p in plans])
        report["pairs"].append({"tp": [ptp, dtp], "seconds": round(time.monotonic() - t, 1),
                                "ranks": [{"role": g[0], "rank": g[1], "result": g[2], "error": g[3]} for g in got]})
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
