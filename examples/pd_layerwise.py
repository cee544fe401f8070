"""Layer-wise streaming for examples/pd_transformers.py (issue #37, docs/design/layerwise.md §3.3).

Prefill: forward hooks on the decoder layers copy each layer's new K/V out of the model's cache into
the rank's paged pool as soon as the layer ran; at a group's last layer the group is gathered into
its bytes of the chunk's group-major slot and sent as a layer part, so the transfer of early layers
overlaps the compute of later ones. On CPU the hook enqueues itself (over the lane without waiting:
the forward never waits for the daemon); with a GPU the hook only launches the copies and records a
CUDA event, and a sender thread enqueues each part once its event has passed (the forward thread
never blocks on the GPU or the daemon). The room's last chunk is closed by a seal carrying the first
token, which exists only after the LM head.

Decode: each landed layer range is scattered into the pool as its event comes, a group at a time.

Kept apart from the example's main module so that it stays readable; it takes what it needs from
there as arguments (the example also runs as ``__main__``, where a second import of it would be a
second set of classes).
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# Parts of at most 16 groups a chunk (design decision 6): G = ceil(L / 16).
MAX_GROUPS = 16
MODES = ("whole", "layerwise", "compute")


def auto_group(layers: int) -> int:
    return max(1, -(-layers // MAX_GROUPS))


def group_ranges(layers: int, group: int) -> list[tuple[int, int]]:
    """The layer groups of a slot cut ``group`` layers a group (0 or >= layers: one group)."""
    g = group if 0 < group < layers else layers
    return [(lo, min(lo + g, layers)) for lo in range(0, layers, g)]


@dataclass
class _Chunk:
    """The chunk a forward is computing, as the hooks see it."""

    room: int
    chunk_id: int
    start: int
    end: int
    pages: torch.Tensor  # the room's pages
    chunk_pages: torch.Tensor
    offset: int
    slot: Any
    dst: torch.Tensor


class LayerStream:
    """One prefill engine's (rank, dtype) layer-wise sender: hooks on ``layers`` (the model's
    decoder layers), parts of ``group`` layers through ``tx`` (a PrefillSender)."""

    def __init__(self, layers: Sequence[torch.nn.Module], cache_kv: Callable[[Any, int], tuple[torch.Tensor, torch.Tensor]],
                 pool: Any, tx: Any, heads: slice, group: int, device: str, backend: str, timeout: float) -> None:
        self._layers = layers
        self.num_layers = len(layers)
        self.groups = group_ranges(self.num_layers, group)
        self.group = self.groups[0][1]
        self._last_of = {hi - 1: (lo, hi) for lo, hi in self.groups}
        self._cache_kv = cache_kv
        self.pool = pool
        self.tx = tx
        self.heads = heads
        self.backend = backend
        self.timeout = timeout
        self.cuda = device.startswith("cuda")
        self.cache: Any = None
        self.chunk: _Chunk | None = None
        self.errors: list[str] = []
        self.groups_sent = 0  # layer groups gathered and sent
        self.parts_sent = 0  # parts they went as (adjacent groups ready together merge)
        self._handles: list[Any] = []
        self._queue: queue.Queue[Any] = queue.Queue()
        self._sender: threading.Thread | None = None
        if self.cuda:
            self._sender = threading.Thread(target=self._send_loop, name="layer-sender", daemon=True)
            self._sender.start()

    # -- the forward thread ----------------------------------------------------------------

    def begin(self, cache: Any, room: int, chunk_id: int, start: int, end: int, pages: torch.Tensor,
              slot_tensor: Callable[[Any, int, int], torch.Tensor]) -> int:
        """Arms the hooks for one chunk's forward (the slot is taken now, before the compute);
        returns the slot's bytes."""
        n = end - start
        slot = self.tx.acquire(n, timeout=self.timeout)
        chunk_pages, offset = self.pool.chunk_pages(pages, start, n)
        self.cache = cache
        self.chunk = _Chunk(room, chunk_id, start, end, pages, chunk_pages, offset, slot,
                            slot_tensor(self.tx, slot.offset, slot.chunk_bytes))
        # Hooked only during a layer-wise forward: the whole-chunk and compute-only baselines run without.
        self._handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(self._layers)]
        return int(slot.chunk_bytes)

    def end(self, last: bool, aux: bytes) -> None:
        """After the chunk's forward: the seal of a room's last chunk goes after its parts."""
        ch = self.chunk
        assert ch is not None
        self.chunk = None
        self.cache = None
        for h in self._handles:
            h.remove()
        self._handles = []
        if last:
            if self.cuda:
                self._queue.put(("seal", ch.room, ch.chunk_id, ch.start, ch.end - ch.start, aux))
            else:
                self.tx.seal(ch.room, ch.chunk_id, ch.start, ch.end - ch.start, self.group, aux=aux, wait=False)
        del ch.dst  # no view of the ring may outlive the client's mapping

    def _hook(self, layer: int) -> Callable[..., None]:
        def hook(_module: Any, _args: Any, _out: Any) -> None:
            ch = self.chunk
            if ch is None:
                return
            # The attention of this layer has just appended the chunk's K/V to the cache.
            k, v = self._cache_kv(self.cache, layer)
            self.pool.store_layer(ch.pages, ch.start, layer, k[0, self.heads, ch.start:ch.end],
                                  v[0, self.heads, ch.start:ch.end])
            rng = self._last_of.get(layer)
            if rng is None:
                return
            lo, hi = rng
            n = ch.end - ch.start
            self.pool.kv.layers(lo, hi).gather(ch.chunk_pages, n, self.pool.page_size,
                                               self.pool.kv.group_view(ch.dst, lo, hi, n),
                                               token_offset=ch.offset, backend=self.backend)
            part = (ch.room, ch.chunk_id, ch.start, n, ch.slot, lo, hi)
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record()
                self._queue.put(("part", ev, part))
            else:
                self._send([part])
        return hook

    # -- the parts -------------------------------------------------------------------------

    def _send(self, parts: list[tuple[Any, ...]], wait: bool = False) -> None:
        from kvxfer_client._parts import layer_part

        # Adjacent groups of one chunk ready together go as one part (one WRITE, one entry).
        merged: list[list[Any]] = []
        for room, cid, start, n, slot, lo, hi in parts:
            if merged and merged[-1][:2] == [room, cid] and merged[-1][6] == lo:
                merged[-1][6] = hi
            else:
                merged.append([room, cid, start, n, slot, lo, hi])
        self.groups_sent += len(parts)
        self.parts_sent += len(merged)
        errs = self.tx.enqueue_layers([layer_part(r, c, s, n, sl, self.group, lo, hi) for r, c, s, n, sl, lo, hi in merged],
                                      wait=wait)
        self.errors += [f"room {m[0]} chunk {m[1]} layers [{m[5]}, {m[6]}): {e}" for m, e in zip(merged, errs, strict=True) if e]

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                batch = [item]
                # Everything whose copies are done by now goes in this call.
                while True:
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    batch.append(nxt)
                    if nxt is None or nxt[0] != "part":
                        break
                parts = []
                for it in batch:
                    if it is None or it[0] != "part":
                        continue
                    it[1].synchronize()
                    parts.append(it[2])
                # This thread waits for its verdicts (a deferred one would come back to flush() on
                # this thread only); the forward thread never waits for them.
                if parts:
                    self._send(parts, wait=True)
                for it in batch:
                    if it is not None and it[0] == "seal":
                        _, room, cid, start, n, aux = it
                        self.tx.seal(room, cid, start, n, self.group, aux=aux)
                if batch[-1] is None:
                    return
            except Exception as exc:  # a refused call: the run reports it, the rank does not hang
                self.errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                for _ in batch:
                    self._queue.task_done()

    def drain(self) -> list[str]:
        """Waits for every queued part to be sent and every verdict; the refusals, as text."""
        if self._sender is not None:
            self._queue.join()
        else:
            self.errors += [str(r) for r in self.tx.flush(timeout=self.timeout)]
        return self.errors

    def close(self) -> None:
        if self._sender is not None:
            self._queue.put(None)
            self._sender.join(10)


# ---------------------------------------------------------------------------------------------
# decode side


@dataclass
class Held:
    """Which layer groups of which chunks of a room this decode rank has scattered."""

    layers: int
    num_tokens: int
    groups: dict[int, set[int]] = field(default_factory=dict)  # chunk id -> scattered groups' first layers
    layer_tokens: int = 0
    t_held: float = 0.0
    scattered: int = 0  # group copies made

    @property
    def complete(self) -> bool:
        return self.layer_tokens == self.layers * self.num_tokens

    def scatter(self, landed: Any, lo: int, hi: int, copy: Callable[[Any, int, int], None]) -> int:
        """Scatters the groups of ``landed`` (a kvxfer_client.Landed) in layers [lo, hi) not
        scattered yet; returns their bytes."""
        done = self.groups.setdefault(landed.chunk_id, set())
        moved = 0
        for glo, ghi in group_ranges(self.layers, landed.layer_group):
            if glo < lo or ghi > hi or glo in done:
                continue
            copy(landed, glo, ghi)
            done.add(glo)
            self.scattered += 1
            self.layer_tokens += (ghi - glo) * landed.num_tokens
            moved += landed.chunk_bytes * (ghi - glo) // self.layers
        if moved and self.complete:
            self.t_held = time.monotonic()
        return moved


# ---------------------------------------------------------------------------------------------
# timing


def compare_summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per prompt length: medians over reps of compute-only, whole and layer-wise TTFT (ms), the
    exposed transfer (TTFT - compute-only) and its cut; the issue's targets, reported, not asserted."""
    by: dict[tuple[str, int], dict[str, list[float]]] = {}
    lwc: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        t = r.get("timing")
        if not t or r.get("warmup"):
            continue
        d = by.setdefault((r["dtype"], r["prompt_tokens"]), {m: [] for m in MODES})
        d[r["mode"]].append(t["ttft_ms"] if r["mode"] != "compute" else t["compute_ms"])
        if r["mode"] == "layerwise":
            lwc.setdefault((r["dtype"], r["prompt_tokens"]), []).append(t["compute_ms"])
    out = []
    for (dtype, n), d in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if not all(d[m] for m in MODES):
            continue
        whole, lw, comp = (statistics.median(d[m]) for m in MODES)
        ex_w, ex_l = whole - comp, lw - comp
        out.append({
            "dtype": dtype, "prompt_tokens": n, "reps": min(len(d[m]) for m in MODES),
            "compute_ms": round(comp, 2),
            # The forward with the hooks' copies and sends (the GIL and GPU they take from the compute).
            "compute_in_layerwise_ms": round(statistics.median(lwc[(dtype, n)]), 2),
            "ttft_whole_ms": round(whole, 2), "ttft_layerwise_ms": round(lw, 2),
            "exposed_whole_ms": round(ex_w, 2), "exposed_layerwise_ms": round(ex_l, 2),
            "layerwise_over_compute": round(lw / comp, 4) if comp > 0 else None,
            "exposed_cut": round(1 - ex_l / ex_w, 4) if ex_w > 0 else None,
            "target_ttft_le_compute_plus_15pct": lw <= 1.15 * comp,
            "target_exposed_cut_ge_70pct": ex_w > 0 and 1 - ex_l / ex_w >= 0.70,
            "samples_ms": {m: [round(x, 2) for x in d[m]] for m in MODES},
        })
    return out
