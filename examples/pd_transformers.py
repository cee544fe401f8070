#!/usr/bin/env python3
"""Real-model check: prefill in one engine, decode in another, tokens identical.

A transformers causal LM (Llama, Qwen2 or Mistral family) is built from a config with random
weights from a fixed seed. Several prompts of different lengths ("rooms") are then served the
prefill/decode-disaggregated way, through two kvxferd daemons:

* ``--prefill-tp`` prefill rank processes. Each runs the model's forward on every chunk of
  ``--chunk-tokens`` prompt tokens (chunked prefill). A real TP engine would compute only its own
  heads; here every rank computes the whole (tiny) model and keeps only the KV heads its TP rank
  owns (:func:`kvxfer_protocol.slot_layout.rank_heads`). The chunk's KV (the model's ``past_key_values`` for
  those tokens) is stored in the rank's paged KV pool, laid out as an engine keeps it (per layer K
  and V ``[num_slots, local_heads, head_dim]``, pages handed out in random order), then gathered by
  the kernel straight into a slot of the rank's ring and enqueued with ``kvxfer_client``. The first
  generated token (greedy on the prefill's last logits) travels as the room's aux bytes, as PD
  engines do.
* ``--decode-tp`` decode rank processes. Each receives its heads, scatters every landed chunk from
  the ring slot into its own paged pool and watermarks it. Once the room is complete it gathers the
  room's pages back out of its pool and hands them to the decode driver (this process), which
  stitches every rank's heads into the full ``[layers, kv_heads, tokens, head_dim]`` cache (a TP
  decode engine would run attention per rank instead; the stock transformers model needs the whole
  cache), builds a ``DynamicCache`` from it and generates ``--new-tokens`` greedily, continuing
  after the prompt's last token.
* The reference: the same model, the same prompts and the same chunking in this one process, no
  transfer. Chunking is kept the same so that any difference can only come from the transfer.

The check passes (exit status 0) only when every room's tokens match the reference and every
decode rank's KV (GQA replicas included) is bit-identical to the reference's. Exit status 1: the
check failed; 2: the run itself failed (a rank, a daemon, a timeout).

Daemons: two are started here (``python -m kvxferd serve``, temp sockets, peer port 0, a ready
file) unless ``--prefill-socket``, ``--decode-socket`` and ``--prefill-address`` name running ones.

Rank processes are forked on CPU: they inherit the imported torch/transformers/triton, which on a
small machine costs more than all the work. With ``--device cuda`` they are spawned (CUDA does not
survive a fork) and the KV pools and the model live on the GPU; ``--staging`` picks the rings:
CUDA IPC rings on the GPU (``vram``), or host-pool rings each engine pins (``host``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from kvxfer_client.kernels.kv_copy import Backend

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("llama", "qwen2", "mistral")
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FAULTS = ("none", "swap-heads")
# Room ids of one run: base + dtype index * stride + room index. The base comes from the pid so
# runs that share long-lived daemons never reuse an id.
ROOM_STRIDE = 1000


# ---------------------------------------------------------------------------------------------
# what a run is


@dataclass(frozen=True)
class Room:
    index: int
    prompt: tuple[int, ...]
    # --layerwise-compare: "whole", "layerwise" or "compute" (prefill alone); "": the run's mode.
    mode: str = ""
    # A warm-up room (kernels compiled, caches allocated): run and checked, left out of the timing summary.
    warmup: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt)


@dataclass(frozen=True)
class Spec:
    """Everything a rank process needs; plain data so that it pickles for spawned ranks."""

    arch: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    seed: int
    dtypes: tuple[str, ...]
    device: str
    page_size: int
    chunk_tokens: int
    new_tokens: int
    prefill_tp: int
    decode_tp: int
    rooms: tuple[Room, ...]
    run_id: str
    room_base: int
    fault: str
    backend: Backend
    timeout: float
    prefill_socket: str = ""
    decode_socket: str = ""
    prefill_address: str = ""
    staging: str = "vram"  # GPU engines: "vram" (CUDA IPC ring), "host" (pinned host ring), "auto" (the daemon's)
    layerwise: bool = False  # chunks go as layer parts from forward hooks (examples/pd_layerwise.py)
    layer_group: int = 0  # layers a part; 0: ceil(layers / 16)
    sequential: bool = False  # one room at a time, the next once the decode holds it (timed runs)
    intermediate: int = 0  # MLP width; 0: 2 x hidden
    timing: bool = False  # per room t_start / t_compute / t_held in the report

    def mode(self, room: Room) -> str:
        return room.mode or ("layerwise" if self.layerwise else "whole")

    @property
    def takes_parts(self) -> bool:
        return self.layerwise or any(r.mode == "layerwise" for r in self.rooms)

    def room_id(self, dtype: str, room: Room) -> int:
        return self.room_base + self.dtypes.index(dtype) * ROOM_STRIDE + room.index

    def group(self, dtype: str, role: str) -> str:
        return f"{self.run_id}-{dtype}-{role}"

    def chunks(self, room: Room) -> list[tuple[int, int]]:
        """Token ranges [start, end) of the room's prefill chunks."""
        n = room.num_tokens
        return [(s, min(s + self.chunk_tokens, n)) for s in range(0, n, self.chunk_tokens)]


def kv_layout(spec: Spec, dtype: str) -> Any:
    from kvxfer_client import Layout

    return Layout(
        num_layers=spec.layers, total_kv_heads=spec.kv_heads, head_dim=spec.head_dim,
        dtype_bytes=DTYPES[dtype].itemsize, page_size=spec.page_size, dtype=dtype,
    )


def swap_rank(spec: Spec) -> int:
    """The decode rank that the swap-heads fault corrupts: the last one holding two heads or more."""
    from kvxfer_protocol.slot_layout import rank_heads

    for rank in reversed(range(spec.decode_tp)):
        if rank_heads(spec.kv_heads, spec.decode_tp, rank).count >= 2:
            return rank
    raise ValueError("--fault swap-heads needs a decode rank that holds at least two KV heads")


# ---------------------------------------------------------------------------------------------
# the model


def setup_torch(spec: Spec) -> None:
    # One thread everywhere: the reference and every rank then run the same kernels with the same
    # reduction order, so their KV agrees bit for bit (and 2 cores are shared by many processes).
    torch.set_num_threads(1)
    if spec.device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def build_model(spec: Spec, dtype: str) -> Any:
    """The causal LM from a config, random weights from ``spec.seed``; the same in every process."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[spec.arch]
    longest = max(r.num_tokens for r in spec.rooms) + spec.new_tokens
    config = config_cls(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate or 2 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=max(256, 2 * longest), tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    if spec.device.startswith("cuda"):
        # Initialised on the GPU in the run's dtype: an 8B-shape model would take minutes and 32 GB
        # of host memory a process in fp32 on the CPU. Same seed, same device, same kernels: every
        # process still gets the same weights.
        with torch.device(spec.device):
            return AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).eval()
    # Initialised in fp32 from the seed, then cast: every dtype sees the same weights, rounded.
    model = AutoModelForCausalLM.from_config(config)
    return model.to(device=spec.device, dtype=DTYPES[dtype]).eval()


def new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56 builds its layers lazily
        return DynamicCache()


def cache_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s K and V, each ``[1, kv_heads, tokens, head_dim]``."""
    if hasattr(cache, "layers"):
        lay = cache.layers[layer]
        return lay.keys, lay.values
    return cache.key_cache[layer], cache.value_cache[layer]


def greedy_continue(model: Any, cache: Any, first: int, new_tokens: int) -> list[int]:
    """``new_tokens`` greedy tokens: ``first`` (sampled by prefill), then one forward per token."""
    tokens = [first]
    device = next(model.parameters()).device
    while len(tokens) < new_tokens:
        ids = torch.tensor([[tokens[-1]]], device=device)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def prefill_chunk(model: Any, cache: Any, prompt: Sequence[int], start: int, end: int) -> int:
    """One chunked-prefill forward over prompt[start:end]; returns the greedy next token."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt[start:end])], device=device)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return int(out.logits[0, -1].argmax())


def stacked_kv(cache: Any, layers: int, start: int, end: int) -> torch.Tensor:
    """The cache's tokens [start, end) as ``[kv_heads, layers, 2, tokens, head_dim]`` (slot order)."""
    per_layer = []
    for layer in range(layers):
        k, v = cache_kv(cache, layer)
        per_layer.append(torch.stack((k[0, :, start:end], v[0, :, start:end]), dim=1))  # [H, 2, T, D]
    return torch.stack(per_layer, dim=1)


# ---------------------------------------------------------------------------------------------
# an engine rank's paged KV pool


class PagedPool:
    """Per layer K and V ``[num_slots, local_heads, head_dim]``; pages handed out in random order."""

    def __init__(
        self, spec: Spec, dtype: str, local_heads: int, num_pages: int, seed: int, garbage: bool
    ) -> None:
        from kvxfer_client.kernels import KVPages

        gen = torch.Generator().manual_seed(seed)
        slots = num_pages * spec.page_size
        shape = (slots, local_heads, spec.head_dim)

        def plane() -> torch.Tensor:
            # The decode pool starts as loud garbage so a token the scatter missed cannot pass for KV.
            t = torch.randn(shape, generator=gen) * 1000 if garbage else torch.zeros(shape)
            return t.to(device=spec.device, dtype=DTYPES[dtype])

        self.k = [plane() for _ in range(spec.layers)]
        self.v = [plane() for _ in range(spec.layers)]
        self.kv = KVPages(self.k, self.v)
        self.page_size = spec.page_size
        self.layout = kv_layout(spec, dtype)
        self.free = torch.randperm(num_pages, generator=gen).tolist()

    def alloc(self, num_tokens: int) -> torch.Tensor:
        n = -(-num_tokens // self.page_size)
        if n > len(self.free):
            raise RuntimeError(f"KV pool out of pages: {n} needed, {len(self.free)} free")
        pages, self.free = self.free[:n], self.free[n:]
        return torch.tensor(pages, dtype=torch.int64)

    def store(self, pages: torch.Tensor, start: int, kv: torch.Tensor) -> None:
        """What an engine's attention does: write tokens [start, start+T) of ``kv``
        (``[local_heads, layers, 2, T, head_dim]``) into their page slots."""
        tok = torch.arange(start, start + kv.shape[3])
        slots = (pages[tok // self.page_size] * self.page_size + tok % self.page_size).to(kv.device)
        for layer in range(len(self.k)):
            self.k[layer][slots] = kv[:, layer, 0].transpose(0, 1)
            self.v[layer][slots] = kv[:, layer, 1].transpose(0, 1)

    def store_layer(self, pages: torch.Tensor, start: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One layer's K and V (each ``[local_heads, T, head_dim]``) of tokens [start, start+T): what
        a layer's attention writes, called from the layer-wise forward hooks."""
        tok = torch.arange(start, start + k.shape[1])
        slots = (pages[tok // self.page_size] * self.page_size + tok % self.page_size).to(k.device)
        self.k[layer][slots] = k.transpose(0, 1)
        self.v[layer][slots] = v.transpose(0, 1)

    def free_pages(self, pages: torch.Tensor) -> None:
        self.free += pages.tolist()

    def chunk_pages(self, pages: torch.Tensor, start: int, num_tokens: int) -> tuple[torch.Tensor, int]:
        """The pages holding tokens [start, start + num_tokens) and where ``start`` sits in the first.

        Chunks are cut by a token budget, not by page: a chunk may start and end mid-page. The
        kernels copy exactly the chunk's tokens from that offset, so a partial page is filled by
        the two chunks that share it, each writing only its own tokens.
        """
        ids, offset = self.layout.chunk_pages(pages.tolist(), start, num_tokens)
        return torch.tensor(ids, dtype=torch.int64), offset


def slot_tensor(client: Any, offset: int, length: int) -> torch.Tensor:
    """A uint8 tensor over ``length`` bytes of the client's ring at ``offset``, no copy."""
    if hasattr(client, "tensor"):
        return cast(torch.Tensor, client.tensor(offset, length))
    return torch.frombuffer(client.view(offset, length), dtype=torch.uint8)


def ring_kwargs(spec: Spec, nbytes: int) -> dict[str, Any]:
    """How a rank's staging ring is set up. On CPU: a window of the daemon's host pool. With
    --device cuda: --staging vram gives each engine a ring on its GPU that the daemon imports by
    CUDA IPC (VRAM over NIXL); --staging host a window of the host pool that the engine pins, so
    the kernels move GPU pages <-> pinned slot (DRAM over NIXL); --staging auto follows the
    daemon's data_path."""
    if not spec.device.startswith("cuda"):
        return {}
    if spec.staging == "host":
        return {"pin_host": True}
    if spec.staging == "auto":
        return {"kv_device": spec.device}
    return {"ring_tensor": torch.empty(nbytes, dtype=torch.uint8, device=spec.device)}


def device_sync(device: str) -> None:
    # The kernels are asynchronous on a GPU: the slot must hold the bytes before the daemon is told.
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def pages_for(spec: Spec) -> int:
    """Enough pages for every room at once (one at a time with --sequential, whose rooms give their
    pages back), plus spare ones so the random placement has room."""
    need = [-(-r.num_tokens // spec.page_size) for r in spec.rooms]
    return (2 * max(need) if spec.sequential else sum(need)) * 3 // 2 + 2


def ring_bytes_for(spec: Spec, dtype: str, local_heads: int) -> int:
    """A ring that holds every chunk of every room (so a slow reader slows, never stalls, a run)."""
    per_token = local_heads * spec.layers * 2 * spec.head_dim * DTYPES[dtype].itemsize
    total = sum(len(spec.chunks(r)) * spec.chunk_tokens * per_token for r in spec.rooms)
    # At least the largest chunk and slack (one-chunk prompts of an 8B shape are 1 GiB slots).
    biggest = max(e - s for r in spec.rooms for s, e in spec.chunks(r)) * per_token
    return int(max(min(64 << 20, max(1 << 20, 2 * total)), biggest * 5 // 4 + (1 << 20) if biggest > 48 << 20 else 0))


# ---------------------------------------------------------------------------------------------
# prefill rank


def prefill_rank(spec: Spec, rank: int, results: Any, go: Any = None) -> None:
    try:
        results.put(("done", "prefill", rank, _prefill_rank(spec, rank, go, results), None))
    except BaseException:
        results.put(("done", "prefill", rank, {}, traceback.format_exc()))


def _lw() -> Any:
    """examples/pd_layerwise.py, whether this runs as a module of ``examples`` or as a script."""
    try:
        from examples import pd_layerwise
    except ImportError:
        import pd_layerwise  # type: ignore[no-redef]  # run as a script: examples/ is sys.path[0]
    return pd_layerwise


def prefill_order(spec: Spec) -> list[tuple[Room, int]]:
    """(room, chunk index) in compute order. Chunk c of every room before chunk c+1 of any: the
    rooms' chunks interleave in both daemons as they would under a batching scheduler. With
    --sequential one room after another (each waits for the decode to hold the one before)."""
    if spec.sequential:
        return [(room, c) for room in spec.rooms for c in range(len(spec.chunks(room)))]
    steps = max(len(spec.chunks(r)) for r in spec.rooms)
    return [(room, c) for c in range(steps) for room in spec.rooms if c < len(spec.chunks(room))]


def _prefill_rank(spec: Spec, rank: int, go: Any, results: Any) -> dict[str, Any]:
    from kvxfer_client import PrefillSender
    from kvxfer_protocol.slot_layout import rank_heads

    setup_torch(spec)
    heads = rank_heads(spec.kv_heads, spec.prefill_tp, rank)
    hs = slice(heads.start, heads.start + heads.count)
    gathered = 0
    timing: dict[str, dict[str, float]] = {}
    with contextlib.ExitStack() as stack:
        engines: dict[str, tuple[Any, Any, PagedPool, Any]] = {}
        for i, dt in enumerate(spec.dtypes):
            ring_bytes = ring_bytes_for(spec, dt, heads.count)
            tx = stack.enter_context(PrefillSender(
                socket=spec.prefill_socket, group=spec.group(dt, "prefill"), layout=kv_layout(spec, dt),
                tp_size=spec.prefill_tp, tp_rank=rank, ring_bytes=ring_bytes,
                name=f"{spec.group(dt, 'prefill')}-r{rank}", **ring_kwargs(spec, ring_bytes),
            ))
            pool = PagedPool(spec, dt, heads.count, pages_for(spec), seed=spec.seed * 7919 + 100 * i + rank,
                             garbage=False)
            model = build_model(spec, dt)
            stream = None
            if spec.takes_parts:
                stream = _lw().LayerStream(model.model.layers, cache_kv, pool, tx, hs, spec.layer_group, spec.device,
                                           spec.backend, spec.timeout)
                stack.callback(stream.close)
            engines[dt] = (model, tx, pool, stream)
        caches: dict[tuple[str, int], Any] = {}
        pages: dict[tuple[str, int], torch.Tensor] = {}
        states: dict[str, str] = {}
        with torch.inference_mode():
            for room, c in prefill_order(spec):
                mode = spec.mode(room)
                start, end = spec.chunks(room)[c]
                last = end == room.num_tokens
                for dt in spec.dtypes:
                    model, tx, pool, stream = engines[dt]
                    key = (dt, room.index)
                    if c == 0:
                        caches[key] = new_cache(model)
                        if mode != "compute":
                            pages[key] = pool.alloc(room.num_tokens)
                        device_sync(spec.device)
                        timing[f"{dt}:{room.index}"] = {"t_start": time.monotonic()}
                    cache = caches[key]
                    if mode == "layerwise":
                        gathered += stream.begin(cache, spec.room_id(dt, room), c, start, end, pages[key], slot_tensor)
                    nxt = prefill_chunk(model, cache, room.prompt, start, end)  # its argmax syncs a GPU
                    if last:
                        timing[f"{dt}:{room.index}"]["t_compute"] = time.monotonic()
                        # Sent at once: a rank that fails later still leaves its rooms' timing.
                        results.put(("t", "prefill", rank, f"{dt}:{room.index}", timing[f"{dt}:{room.index}"]))
                    aux = nxt.to_bytes(4, "little") if last else b""
                    if mode == "layerwise":
                        stream.end(last, aux)
                    elif mode == "whole":
                        # The stock model attends from its DynamicCache; the pool is the engine's
                        # copy of this rank's heads, the one the transfer reads, as in a real engine.
                        pool.store(pages[key], start, stacked_kv(cache, spec.layers, start, end)[hs])
                        n = end - start
                        slot = tx.acquire(n, timeout=spec.timeout)
                        dst = slot_tensor(tx, slot.offset, slot.chunk_bytes)
                        chunk_pages, offset = pool.chunk_pages(pages[key], start, n)
                        pool.kv.gather(chunk_pages, n, spec.page_size, dst, token_offset=offset,
                                       backend=spec.backend)
                        device_sync(spec.device)
                        del dst  # no view of the ring may outlive the client's mapping
                        tx.enqueue(spec.room_id(dt, room), c, start, n, slot, last=last, aux=aux)
                        gathered += slot.chunk_bytes
                    if last:
                        del caches[key]  # this room's prefill is over
                if last and spec.sequential and mode != "compute":
                    # The next room starts once the decode holds this one and the driver checked
                    # it: no transfer or check overlaps the next room's compute.
                    got = go.get(timeout=spec.timeout)
                    if got != room.index:
                        raise RuntimeError(f"prefill rank {rank}: room {room.index} done, the driver said {got}")
                    for dt in spec.dtypes:
                        engines[dt][2].free_pages(pages.pop((dt, room.index)))
                        # Settled now: a daemon forgets a finished room after a while, so a wait
                        # at the end of a long run could find it gone.
                        rid = spec.room_id(dt, room)
                        states[str(rid)] = engines[dt][1].wait(rid, timeout=spec.timeout, poll_s=0.01).state.name
                        engines[dt][1].release(rid)
        refusals: list[str] = []
        for dt in spec.dtypes:
            _, tx, _, stream = engines[dt]
            if stream is not None:
                refusals += stream.drain()
            for room in spec.rooms:
                rid = spec.room_id(dt, room)
                if spec.mode(room) == "compute" or str(rid) in states:
                    continue
                states[str(rid)] = tx.wait(rid, timeout=spec.timeout, poll_s=0.01).state.name
                tx.release(rid)
        if refusals:
            raise RuntimeError(f"prefill rank {rank}: parts refused: {refusals[:4]}")
    streams = [e[3] for e in engines.values() if e[3] is not None]
    return {"bytes_gathered": gathered, "states": states, "timing": timing,
            "layer_groups_sent": sum(st.groups_sent for st in streams), "layer_parts_sent": sum(st.parts_sent for st in streams)}


# ---------------------------------------------------------------------------------------------
# decode rank


@dataclass
class _Recv:
    dtype: str
    room: Room
    held: Any  # pd_layerwise.Held: the layer groups of each chunk scattered so far
    pages: torch.Tensor | None = None  # taken at the room's first landed bytes
    done: set[int] = field(default_factory=set)


def decode_rank(spec: Spec, rank: int, results: Any) -> None:
    try:
        results.put(("done", "decode", rank, _decode_rank(spec, rank, results), None))
    except BaseException:
        results.put(("done", "decode", rank, {}, traceback.format_exc()))


def _watch(rx: Any, wake: queue.Queue[tuple[int, Any]], layer_progress: bool) -> None:
    # Events say which room to poll and, with layer_progress, which layers of a chunk landed (to
    # scatter at once). PollRoom stays the source of truth for complete chunks, so an event lost
    # while the stream was being set up costs a fallback poll, never a room.
    with contextlib.suppress(Exception):
        for ev in rx.watch(layer_progress=layer_progress):
            wake.put((ev.room, ev.landed))


def _decode_rank(spec: Spec, rank: int, results: Any) -> dict[str, Any]:
    from kvxfer_client import DecodeReceiver, RoomFailed, RoomState
    from kvxfer_protocol.slot_layout import rank_heads

    setup_torch(spec)
    lw = _lw()
    heads = rank_heads(spec.kv_heads, spec.decode_tp, rank)
    swap = spec.fault == "swap-heads" and rank == swap_rank(spec)
    received = 0
    scattered = 0
    early = 0  # layer groups scattered from a layer event, before their chunk was complete
    wake: queue.Queue[tuple[int, Any]] = queue.Queue()
    with contextlib.ExitStack() as stack:
        engines: dict[str, tuple[Any, PagedPool]] = {}
        for i, dt in enumerate(spec.dtypes):
            ring_bytes = ring_bytes_for(spec, dt, heads.count)
            rx = stack.enter_context(DecodeReceiver(
                socket=spec.decode_socket, group=spec.group(dt, "decode"), layout=kv_layout(spec, dt),
                tp_size=spec.decode_tp, tp_rank=rank, ring_bytes=ring_bytes,
                name=f"{spec.group(dt, 'decode')}-r{rank}", layer_parts=spec.takes_parts,
                **ring_kwargs(spec, ring_bytes),
            ))
            pool = PagedPool(spec, dt, heads.count, pages_for(spec), seed=spec.seed * 7919 + 100 * i + 50 + rank,
                             garbage=True)
            engines[dt] = (rx, pool)
            threading.Thread(target=_watch, args=(rx, wake, spec.takes_parts), daemon=True).start()

        def copy(rec: _Recv, c: Any, lo: int, hi: int) -> None:
            """Scatters layers [lo, hi) (one group) of landed chunk ``c`` into the pool."""
            rx, pool = engines[rec.dtype]
            if rec.pages is None:
                rec.pages = pool.alloc(rec.room.num_tokens)
            src = slot_tensor(rx, c.offset, c.chunk_bytes)
            view = pool.kv.group_view(src, lo, hi, c.num_tokens)
            sub = pool.kv.layers(lo, hi)
            chunk_pages, offset = pool.chunk_pages(rec.pages, c.token_start, c.num_tokens)
            if swap:
                # Test-only fault: local head h lands where head count-1-h belongs.
                per_head = view.numel() // heads.count
                for h in range(heads.count):
                    sub.scatter(chunk_pages, c.num_tokens, spec.page_size, view[h * per_head : (h + 1) * per_head],
                                head_start=heads.count - 1 - h, num_heads=1, token_offset=offset,
                                backend=spec.backend)
            else:
                sub.scatter(chunk_pages, c.num_tokens, spec.page_size, view, token_offset=offset,
                            backend=spec.backend)
            device_sync(spec.device)
            del src, view

        active: dict[int, _Recv] = {}
        for dt in spec.dtypes:
            rx, pool = engines[dt]
            for room in spec.rooms:
                if spec.mode(room) == "compute":
                    continue
                rid = spec.room_id(dt, room)
                active[rid] = _Recv(dt, room, lw.Held(spec.layers, room.num_tokens))
                rx.expect(rid, spec.prefill_address, spec.group(dt, "prefill"), room.num_tokens,
                          deadline_ms=int(spec.timeout * 1000))
        deadline = time.monotonic() + spec.timeout
        while active:
            if time.monotonic() > deadline:
                raise TimeoutError(f"decode rank {rank}: rooms unfinished after {spec.timeout} s: {sorted(active)}")
            events: list[tuple[int, Any]] = []
            try:
                events.append(wake.get(timeout=0.05))
                while True:
                    events.append(wake.get_nowait())
            except queue.Empty:
                pass
            dirty: set[int] = set()
            for rid, landed in events:
                rec = active.get(rid)
                if rec is None:
                    continue
                if landed is not None and landed.layer_end and landed.chunk_id not in rec.done:
                    # A layer range landed: scatter it now, while later layers are still on the way.
                    before = rec.held.scattered
                    received += rec.held.scatter(landed, landed.layer_start, landed.layer_end,
                                                 lambda c, lo, hi, rec=rec: copy(rec, c, lo, hi))
                    early += 0 if landed.chunk_complete else rec.held.scattered - before
                if landed is None or landed.chunk_complete:
                    dirty.add(rid)
            if not events:
                dirty = set(active)  # quiet for a while: poll everything once
            for rid in sorted(dirty & set(active)):
                rec = active[rid]
                rx, pool = engines[rec.dtype]
                st = rx.poll(rid)
                for c in st.landed:
                    if c.chunk_id in rec.done:
                        continue
                    # What no layer event brought (or all of it, for a whole chunk).
                    received += rec.held.scatter(c, 0, spec.layers, lambda c, lo, hi, rec=rec: copy(rec, c, lo, hi))
                    rx.watermark(rid, [c.chunk_id])
                    rec.done.add(c.chunk_id)
                if st.state is RoomState.FAILED:
                    raise RoomFailed(rid, st.failure_code, st.failure_reason)
                if st.state is RoomState.SUCCESS and rec.held.complete and rec.pages is not None:
                    # The decode engine's view of the room: its heads, gathered back out of its pool.
                    n = rec.room.num_tokens
                    out = torch.empty(pool.kv.slot_nbytes(n), dtype=torch.uint8, device=spec.device)
                    pool.kv.gather(rec.pages, n, spec.page_size, out, backend=spec.backend)
                    results.put(("kv", rec.dtype, rec.room.index, rank, out.cpu().numpy().tobytes(), st.aux,
                                 rec.held.t_held))
                    del out
                    scattered += rec.held.scattered
                    rx.release(rid)
                    if spec.sequential:
                        pool.free_pages(rec.pages)
                    del active[rid]
    return {"bytes_received": received, "layer_groups_early": early, "groups_scattered": scattered}



# ---------------------------------------------------------------------------------------------
# reference and decode driver (this process)


@dataclass
class Reference:
    tokens: list[int]
    kv: torch.Tensor  # [kv_heads, layers, 2, tokens, head_dim], CPU


def reference(spec: Spec, model: Any) -> dict[int, Reference]:
    """Every room in one process, no transfer: the same chunked prefill, then greedy decode."""
    out: dict[int, Reference] = {}
    seen: dict[tuple[int, ...], Reference] = {}
    with torch.inference_mode():
        for room in spec.rooms:
            if spec.mode(room) == "compute":
                continue
            if room.prompt in seen:  # --layerwise-compare repeats prompts
                out[room.index] = seen[room.prompt]
                continue
            cache = new_cache(model)
            nxt = 0
            for start, end in spec.chunks(room):
                nxt = prefill_chunk(model, cache, room.prompt, start, end)
            kv = stacked_kv(cache, spec.layers, 0, room.num_tokens).cpu().clone()
            out[room.index] = seen[room.prompt] = Reference(greedy_continue(model, cache, nxt, spec.new_tokens), kv)
            del cache
    return out


def check_room(
    spec: Spec, dtype: str, model: Any, room: Room, ref: Reference, parts: dict[int, tuple[bytes, bytes]]
) -> dict[str, Any]:
    """Stitch the decode ranks' heads into one cache, generate from it, compare with the reference."""
    from kvxfer_protocol.slot_layout import rank_heads

    dt = DTYPES[dtype]
    n = room.num_tokens
    full = torch.empty((spec.kv_heads, spec.layers, 2, n, spec.head_dim), dtype=dt)
    filled = [False] * spec.kv_heads
    max_diff = 0.0
    identical = True
    for rank in sorted(parts):
        rh = rank_heads(spec.kv_heads, spec.decode_tp, rank)
        part = torch.frombuffer(bytearray(parts[rank][0]), dtype=torch.uint8).view(dt)
        part = part.view(rh.count, spec.layers, 2, n, spec.head_dim)
        want = ref.kv[rh.start : rh.start + rh.count]
        # Every rank is compared, GQA replicas included: a replica nobody decodes from here is
        # still a rank a TP engine would attend with.
        same = torch.equal(part.view(torch.uint8), want.contiguous().view(torch.uint8))
        identical = identical and same
        if not same:  # (in float64 an 8k-token 8B-shape room would take 8 GiB to say 0)
            max_diff = max(max_diff, float((part.double() - want.double()).abs().max()))
        for h in range(rh.count):
            if not filled[rh.start + h]:
                full[rh.start + h] = part[h]
                filled[rh.start + h] = True
    aux = parts[0][1]
    device = next(model.parameters()).device
    with torch.inference_mode():
        cache = new_cache(model)
        for layer in range(spec.layers):
            k = full[:, layer, 0].unsqueeze(0).contiguous().to(device)
            v = full[:, layer, 1].unsqueeze(0).contiguous().to(device)
            cache.update(k, v, layer)
        tokens = greedy_continue(model, cache, int.from_bytes(aux, "little"), spec.new_tokens) if len(aux) == 4 else []
    common = min(len(tokens), len(ref.tokens))
    mismatch = next((i for i in range(common) if tokens[i] != ref.tokens[i]), None)
    if mismatch is None and len(tokens) != len(ref.tokens):
        mismatch = common
    return {
        "dtype": dtype, "room": spec.room_id(dtype, room), "index": room.index, "prompt_tokens": n,
        "chunks": len(spec.chunks(room)), "mode": spec.mode(room), "warmup": room.warmup,
        "tokens_match": mismatch is None, "first_mismatch": mismatch,
        "max_abs_kv_diff": max_diff, "kv_bit_identical": identical, "tokens": tokens,
        "reference_tokens": ref.tokens,
    }


# ---------------------------------------------------------------------------------------------
# daemons of our own


class OwnDaemons:
    """Two daemons as subprocesses (temp sockets, peer port 0); started at once, awaited later."""

    def __init__(self, timeout: float = 60.0, pools: tuple[str, str] = ("128MiB", "128MiB")) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvx-pd-"))  # short: socket paths are capped at 108 B
        self.timeout = timeout
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.info: dict[str, dict[str, Any]] = {}
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name, pool in zip(("prefill", "decode"), pools, strict=True):
            args = [
                sys.executable, "-m", "kvxferd", "serve", "--socket", str(self.dir / f"{name}.sock"),
                "--peer-listen", "127.0.0.1:0", "--metrics-port", "-1", "--host-pool-bytes", pool,
                "--daemon-id", f"pd-{name}-{os.getpid()}", "--ready-file", str(self.dir / f"{name}.ready"),
                "--log-format", "text", "--set", "drain_grace_s=2",
            ]
            with open(self.dir / f"{name}.log", "ab") as log:
                self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        for name, proc in self.procs.items():
            ready = self.dir / f"{name}.ready"
            while not ready.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} daemon exited with {proc.returncode}:\n{self.log(name)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} daemon not ready after {self.timeout} s:\n{self.log(name)}")
                time.sleep(0.02)
            self.info[name] = json.loads(ready.read_text())

    def log(self, name: str) -> str:
        try:
            return (self.dir / f"{name}.log").read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if not os.environ.get("KVX_KEEP_LOGS"):
            shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# the run


def run(spec: Spec, daemons: OwnDaemons | None = None) -> dict[str, Any]:
    """Reference, then the PD run through the daemons; the report as a dict."""
    setup_torch(spec)
    models = {dt: build_model(spec, dt) for dt in spec.dtypes}
    refs = {dt: reference(spec, models[dt]) for dt in spec.dtypes}
    if daemons is not None:
        # Our own daemons booted while the models were built and the reference ran.
        daemons.wait_ready()
        spec = replace(
            spec, prefill_socket=daemons.info["prefill"]["socket"], decode_socket=daemons.info["decode"]["socket"],
            prefill_address=daemons.info["prefill"]["peer_address"],
        )
    fork = not spec.device.startswith("cuda")
    if fork:
        # Forked ranks inherit these imports instead of paying for them once each.
        import kvxfer_client
        import kvxfer_client.kernels

        if kvxfer_client.kernels.triton_available() and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            import kvxfer_client.kernels._triton_kv
    ctx: Any = mp.get_context("fork" if fork else "spawn")
    results: Any = ctx.Queue()
    procs: dict[tuple[str, int], Any] = {}
    # --sequential: the driver tells each prefill rank when the decode holds a room and it was checked.
    gos = [ctx.Queue() if spec.sequential else None for _ in range(spec.prefill_tp)]
    for rank in range(spec.decode_tp):
        procs[("decode", rank)] = ctx.Process(target=decode_rank, args=(spec, rank, results), daemon=True)
    for rank in range(spec.prefill_tp):
        procs[("prefill", rank)] = ctx.Process(target=prefill_rank, args=(spec, rank, results, gos[rank]),
                                               daemon=True)
    t0 = time.perf_counter()
    for p in procs.values():
        p.start()
    parts: dict[tuple[str, int], dict[int, tuple[bytes, bytes]]] = {}
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    stats: dict[tuple[str, int], dict[str, Any]] = {}
    held: dict[tuple[str, int], float] = {}
    early_timing: dict[int, dict[str, dict[str, float]]] = {}  # prefill rank -> room key -> times
    errors: list[str] = []
    gone_since: dict[tuple[str, int], float] = {}
    deadline = time.monotonic() + spec.timeout + 30
    by_index = {r.index: r for r in spec.rooms}
    try:
        while len(stats) < len(procs) and not errors:
            try:
                msg = results.get(timeout=0.5)
            except queue.Empty:
                now = time.monotonic()
                for key, p in procs.items():
                    # A rank that died without a word (a crash, the OOM killer) would hang the run.
                    if key not in stats and p.exitcode is not None and now - gone_since.setdefault(key, now) > 3:
                        errors.append(f"{key[0]} rank {key[1]} exited with {p.exitcode} and no report")
                if now > deadline:
                    errors.append(f"run not finished after {spec.timeout + 30:.0f} s")
                continue
            if msg[0] == "t":
                _, role, rank, key, t = msg
                early_timing.setdefault(rank, {})[key] = t
                continue
            if msg[0] == "kv":
                _, dtype, index, rank, data, aux, t_held = msg
                got = parts.setdefault((dtype, index), {})
                got[rank] = (data, aux)
                held[(dtype, index)] = max(held.get((dtype, index), 0.0), t_held)
                if len(got) == spec.decode_tp:
                    room = by_index[index]
                    rows[(dtype, index)] = check_room(spec, dtype, models[dtype], room, refs[dtype][index], got)
                    del parts[(dtype, index)]
                    if spec.sequential and all(k in rows for k in ((dt, index) for dt in spec.dtypes)):
                        for go in gos:
                            go.put(index)
            else:
                _, role, rank, payload, err = msg
                stats[(role, rank)] = payload
                if err:
                    errors.append(f"{role} rank {rank} failed:\n{err}")
    finally:
        wall = time.perf_counter() - t0
        for p in procs.values():
            if errors:
                p.terminate()
            p.join(10)
            if p.is_alive():
                p.kill()
    ordered = [rows[(dt, r.index)] for dt in spec.dtypes for r in spec.rooms if (dt, r.index) in rows]
    sent = [r for r in spec.rooms if spec.mode(r) != "compute"]
    complete = len(ordered) == len(spec.dtypes) * len(sent)
    for (role, rank), st in stats.items():
        if role == "prefill" and not st.get("timing"):  # a rank that failed after its rooms
            st["timing"] = early_timing.get(rank, {})
    timed = room_timing(spec, rows, held, stats) if spec.timing else []
    first = next((r for r in ordered if not r["tokens_match"]), None)
    tokens_match = complete and first is None
    max_diff = max((r["max_abs_kv_diff"] for r in ordered), default=math.inf)
    identical = complete and all(r["kv_bit_identical"] for r in ordered)
    bytes_moved = sum(s.get("bytes_received", 0) for (role, _), s in stats.items() if role == "decode")
    bytes_gathered = sum(s.get("bytes_gathered", 0) for (role, _), s in stats.items() if role == "prefill")

    def total(role: str, key: str) -> int:
        return sum(s.get(key, 0) for (r, _), s in stats.items() if r == role)

    return {
        "ok": not errors and tokens_match and identical and max_diff == 0,
        "tokens_match": tokens_match,
        "first_mismatch": None if first is None else {
            "dtype": first["dtype"], "room": first["room"], "position": first["first_mismatch"]},
        "max_abs_kv_diff": max_diff if math.isfinite(max_diff) else None,
        "kv_bit_identical": identical,
        "bytes_moved": bytes_moved,
        "bytes_gathered": bytes_gathered,
        # Layer-wise: groups gathered and the parts they went as (prefill ranks), group copies into
        # the decode pools and how many of them a layer event brought before the chunk was complete.
        "layer_groups_sent": total("prefill", "layer_groups_sent"),
        "layer_parts_sent": total("prefill", "layer_parts_sent"),
        "groups_scattered": total("decode", "groups_scattered"),
        "layer_groups_early": total("decode", "layer_groups_early"),
        "wall_s": round(wall, 3),
        "rooms": len(ordered),
        "staging_ring": ("cuda-ipc" if spec.staging == "vram" else f"host-pinned ({spec.staging})")
        if spec.device.startswith("cuda") else "host",
        "errors": errors,
        "config": {k: v for k, v in asdict(spec).items() if k not in ("rooms",)},
        "per_room": ordered,
        **({"timing": timed, "compare": _lw().compare_summary(timed)} if spec.timing else {}),
    }


def room_timing(spec: Spec, rows: dict[tuple[str, int], dict[str, Any]], held: dict[tuple[str, int], float],
                stats: dict[tuple[str, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """Per room (every mode): t_start (the first prefill rank's forward begins), t_compute (the
    last one's ends), t_held (the last decode rank's last scatter synced), all CLOCK_MONOTONIC, which
    a host's processes share; TTFT = t_held - t_start."""
    out = []
    for dt in spec.dtypes:
        for room in spec.rooms:
            per_rank = [s.get("timing", {}).get(f"{dt}:{room.index}") for (role, _), s in stats.items() if role == "prefill"]
            if not per_rank or not all(t and "t_compute" in t for t in per_rank):
                continue
            t0 = min(t["t_start"] for t in per_rank)
            t1 = max(t["t_compute"] for t in per_rank)
            mode = spec.mode(room)
            row: dict[str, Any] = {"dtype": dt, "index": room.index, "room": spec.room_id(dt, room), "mode": mode,
                                   "prompt_tokens": room.num_tokens, "warmup": room.warmup,
                                   "ok": True if mode == "compute" else bool(rows.get((dt, room.index), {}).get("kv_bit_identical"))}
            t = {"t_start": t0, "t_compute": t1, "compute_ms": round((t1 - t0) * 1000, 3)}
            if (dt, room.index) in held:
                t |= {"t_held": held[(dt, room.index)], "ttft_ms": round((held[(dt, room.index)] - t0) * 1000, 3)}
            elif mode != "compute":
                continue
            out.append(row | {"timing": t})
    return out


# ---------------------------------------------------------------------------------------------
# output


def print_report(spec: Spec, rep: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    title = (
        f"{spec.arch}: {spec.layers} layers, {spec.heads} heads / {spec.kv_heads} KV heads x {spec.head_dim}, "
        f"prefill TP {spec.prefill_tp} -> decode TP {spec.decode_tp}, chunks of {spec.chunk_tokens}, "
        f"pages of {spec.page_size}" + (f", fault {spec.fault}" if spec.fault != "none" else "")
    )
    table = Table(title=title, title_justify="left")
    for col, just in (("dtype", "left"), ("room", "right"), ("prompt", "right"), ("chunks", "right"),
                      ("decode tokens", "left"), ("= reference", "left"), ("max |dKV|", "right"),
                      ("KV bit-exact", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in rep["per_room"]:
        match = "yes" if r["tokens_match"] else f"[red]no, from {r['first_mismatch']}[/red]"
        exact = "yes" if r["kv_bit_identical"] else "[red]no[/red]"
        table.add_row(r["dtype"], str(r["room"]), str(r["prompt_tokens"]), str(r["chunks"]),
                      " ".join(map(str, r["tokens"])), match, f"{r['max_abs_kv_diff']:g}", exact)
    console.print(table)
    for err in rep["errors"]:
        console.print(f"[red]error:[/red] {err}", markup=True, highlight=False)
    verdict = "[green]PASS[/green]" if rep["ok"] else "[red]FAIL[/red]"
    console.print(
        f"tokens_match={rep['tokens_match']} first_mismatch={json.dumps(rep['first_mismatch'])} "
        f"max_abs_kv_diff={rep['max_abs_kv_diff']} kv_bit_identical={rep['kv_bit_identical']}", highlight=False,
    )
    console.print(f"rooms={rep['rooms']} bytes_moved={rep['bytes_moved']} wall_s={rep['wall_s']}  {verdict}",
                  highlight=False)
    for c in rep.get("compare", []):
        console.print(
            f"{c['dtype']} {c['prompt_tokens']} tokens (median of {c['reps']}): compute {c['compute_ms']} ms, TTFT whole "
            f"{c['ttft_whole_ms']} / layer-wise {c['ttft_layerwise_ms']} ms = compute x {c['layerwise_over_compute']}, "
            f"exposed {c['exposed_whole_ms']} -> {c['exposed_layerwise_ms']} ms (cut {c['exposed_cut']})", highlight=False)


# ---------------------------------------------------------------------------------------------
# command line


_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Spec]:
    from kvxfer_protocol.slot_layout import rank_heads

    p = argparse.ArgumentParser(
        description="Prefill a transformers model in one engine, decode in another through two kvxferd daemons, "
        "and check the tokens and the KV against a one-process reference.",
    )
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4, help="attention (query) heads")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--rooms", type=int, default=8, help="prompts, of different lengths, served at once")
    p.add_argument("--prompt-tokens", type=int, default=48, help="longest prompt; the others are shorter")
    p.add_argument("--chunk-tokens", type=int, default=16, help="chunked prefill size (any: chunks may start and end mid-page)")
    p.add_argument("--page-size", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per room, the prefill's first included")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16,float32", help="comma list: bfloat16, float16, float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (KV pools and the model)")
    p.add_argument("--staging", choices=("vram", "host", "auto"), default="vram",
                   help="with --device cuda: CUDA IPC rings (vram), pinned host-pool rings (host), or the daemon's "
                   "data_path (auto)")
    p.add_argument("--kernel-backend", choices=("auto", "triton", "torch"), default="auto")
    p.add_argument("--fault", choices=FAULTS, default="none",
                   help="test only: swap-heads makes one decode rank scatter its heads in reverse order")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole PD run")
    p.add_argument("--prefill-socket", default="", help="running prefill daemon (else one is started)")
    p.add_argument("--decode-socket", default="", help="running decode daemon")
    p.add_argument("--prefill-address", default="", help="the prefill daemon's peer address")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--intermediate", type=int, default=0, help="MLP width (default 2 x --hidden); the 8B shape: "
                   "--layers 32 --heads 32 --kv-heads 8 --head-dim 128 --hidden 4096 --intermediate 14336 --vocab 128256")
    p.add_argument("--layerwise", action="store_true",
                   help="send chunks as layer parts from forward hooks as each layer group is computed (issue #37)")
    p.add_argument("--layer-group", type=int, default=0, help="layers a part (default ceil(layers / 16))")
    p.add_argument("--timing", action="store_true", help="per room t_start / t_compute / t_held and TTFT")
    p.add_argument("--sequential", action="store_true",
                   help="one room at a time: the next prefill starts once the decode holds the last one")
    p.add_argument("--layerwise-compare", action="store_true",
                   help="per prompt, interleave whole chunks, layer-wise and compute-only, --reps times (implies "
                   "--timing --sequential); one warm-up round at the shortest prompt is left out of the summary")
    p.add_argument("--prompt-lengths", default="", help="comma list of prompt lengths (instead of --rooms/--prompt-tokens)")
    p.add_argument("--reps", type=int, default=3, help="--layerwise-compare rounds")
    args = p.parse_args(argv)

    given = [bool(args.prefill_socket), bool(args.decode_socket), bool(args.prefill_address)]
    if any(given) and not all(given):
        p.error("--prefill-socket, --decode-socket and --prefill-address go together")
    for name in ("layers", "heads", "kv_heads", "head_dim", "hidden", "vocab", "rooms", "prompt_tokens",
                 "chunk_tokens", "page_size", "new_tokens", "prefill_tp", "decode_tp", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.rooms >= ROOM_STRIDE:
        p.error(f"--rooms must be below {ROOM_STRIDE}")
    if args.layer_group < 0 or args.intermediate < 0:
        p.error("--layer-group and --intermediate must be at least 0")
    try:
        given_lengths = [int(x) for x in args.prompt_lengths.split(",") if x.strip()]
    except ValueError:
        p.error("--prompt-lengths: a comma list of token counts")
    if any(n < 1 for n in given_lengths):
        p.error("--prompt-lengths: every length must be at least 1")
    compare_rooms = 3 * (1 + args.reps * len(given_lengths or [args.prompt_tokens]))
    if args.layerwise_compare and compare_rooms >= ROOM_STRIDE:
        p.error(f"--layerwise-compare: {compare_rooms} rooms, at most {ROOM_STRIDE - 1}")
    if args.fault != "none" and args.layerwise_compare:
        p.error("--fault and --layerwise-compare do not go together")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    dtypes = tuple(_DTYPE_ALIASES.get(d.strip(), d.strip()) for d in args.dtype.split(",") if d.strip())
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes or len(set(dtypes)) != len(dtypes):
        p.error(f"--dtype: give distinct names among {', '.join(DTYPES)}")
    try:
        for tp in (args.prefill_tp, args.decode_tp):
            rank_heads(args.kv_heads, tp, 0)
    except ValueError as exc:
        p.error(str(exc))

    gen = torch.Generator().manual_seed(args.seed + 1)
    lo = max(1, args.prompt_tokens // 4)
    # The longest prompt, then distinct shorter lengths while there are enough of them.
    pool = torch.randperm(args.prompt_tokens - lo, generator=gen).add(lo).tolist() if args.prompt_tokens > lo else []
    lengths = [args.prompt_tokens]
    for i in range(1, args.rooms):
        lengths.append(pool[i - 1] if i - 1 < len(pool) else int(torch.randint(lo, args.prompt_tokens + 1, (1,),
                                                                                generator=gen)))
    if given_lengths:
        lengths = given_lengths
    rooms = tuple(
        Room(i, tuple(torch.randint(0, args.vocab, (n,), generator=gen).tolist())) for i, n in enumerate(lengths)
    )
    if args.layerwise_compare:
        rooms = compare_rooms_of(rooms, args.reps)
    pid = os.getpid()
    spec = Spec(
        arch=args.arch, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        hidden=args.hidden, vocab=args.vocab, seed=args.seed, dtypes=dtypes, device=args.device,
        page_size=args.page_size, chunk_tokens=args.chunk_tokens, new_tokens=args.new_tokens,
        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, rooms=rooms,
        run_id=f"pd{pid}-{int(time.time() * 1000) % 1_000_000}", room_base=(pid % 4_000_000) * 10 * ROOM_STRIDE,
        fault=args.fault, backend=cast("Backend", args.kernel_backend), timeout=args.timeout,
        prefill_socket=args.prefill_socket, decode_socket=args.decode_socket,
        prefill_address=args.prefill_address, staging=args.staging,
        layerwise=args.layerwise, layer_group=args.layer_group, intermediate=args.intermediate,
        timing=args.timing or args.layerwise_compare, sequential=args.sequential or args.layerwise_compare,
    )
    if spec.fault == "swap-heads":
        try:
            swap_rank(spec)
        except ValueError as exc:
            p.error(str(exc))
    return args, spec


def compare_rooms_of(prompts: Sequence[Room], reps: int) -> tuple[Room, ...]:
    """A warm-up of each mode at the shortest prompt, then per rep and prompt the three modes, their
    order rotated per rep so that none always runs first (right after another room's transfer)."""
    modes = ("whole", "layerwise", "compute")
    shortest = min(prompts, key=lambda r: r.num_tokens)
    plan = [(shortest.prompt, m, True) for m in modes]
    for rep in range(reps):
        for r in prompts:
            plan += [(r.prompt, modes[(rep + j) % 3], False) for j in range(3)]
    return tuple(Room(i, prompt, mode, warm) for i, (prompt, mode, warm) in enumerate(plan))


def pool_size(spec: Spec, role: str) -> str:
    """The daemons' host pool: with GPU engines staging in host rings, every ring of the side."""
    from kvxfer_protocol.slot_layout import rank_heads

    if not spec.device.startswith("cuda") or spec.staging == "vram":
        return "128MiB"
    tp = spec.prefill_tp if role == "prefill" else spec.decode_tp
    rings = sum(ring_bytes_for(spec, dt, rank_heads(spec.kv_heads, tp, r).count) for dt in spec.dtypes for r in range(tp))
    return f"{max(512, (rings * 5 // 4 >> 20) + 64)}MiB"


def main(argv: Sequence[str] | None = None) -> int:
    args, spec = parse_args(argv)
    # Host-pool rings of every rank of both dtypes come out of the pool when GPU engines stage there.
    daemons = None if spec.prefill_socket else OwnDaemons(pools=(pool_size(spec, "prefill"), pool_size(spec, "decode")))
    try:
        rep = run(spec, daemons)
    except Exception as exc:  # a run that could not happen still leaves a report
        rep = {"ok": False, "tokens_match": False, "first_mismatch": None, "max_abs_kv_diff": None,
               "kv_bit_identical": False, "bytes_moved": 0, "bytes_gathered": 0, "wall_s": 0.0, "rooms": 0,
               "errors": [f"{type(exc).__name__}: {exc}"], "config": {}, "per_room": []}
    finally:
        if daemons is not None:
            daemons.close()
    print_report(spec, rep)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2) + "\n")
    if rep["errors"]:
        return 2
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
