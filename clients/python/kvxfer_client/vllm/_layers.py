"""Layer-wise sends and loads of the vLLM connector (issue #37, docs/design/layerwise.md §3.1).

Prefill: a layer-wise chunk's slot is acquired when the step's plan is bound
(``bind_connector_metadata``, before the forward; vLLM 0.32 calls ``start_load_kv`` after it), so
the forward never waits for ring space. ``save_kv_layer`` at a group's last layer gathers that group
of every open chunk of the step into its slot (group-major ``[groups, heads, g, 2, tokens,
head_dim]``) and enqueues the groups of all rooms as one call without waiting for the verdicts
(``enqueue_layers(wait=False)``): the daemon writes a group while the next ones compute.
``wait_for_save`` sends what a hook did not (none, when every layer's hook ran), seals the rooms
whose prompt ended this step and reads every verdict in one round trip (``_send.SendPath``).

Decode: each group is scattered as it lands (``watch(layer_progress)``, ``_worker.py``); vLLM runs
an asynchronously loaded request only after its whole load finished, so ``wait_for_layer_load``
has nothing left to wait for.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvxfer_client._parts import layer_part, seal_part
from kvxfer_client._sync_prefill import PrefillSender
from kvxfer_client.types import Chunk, Landed, Slot
from kvxfer_client.vllm._config import SendChunk
from kvxfer_client.vllm._paged import CacheShape

logger = logging.getLogger(__name__)

# Auto group size (layer_group 0). Streaming a chunk in G parts hides all but the last part of
# the work that follows its gather (the daemons' write, the decode side's scatter), T; each part
# past the first costs a fixed C (a gather and an enqueue call on the forward thread, a part in
# each daemon, an event and a scatter call on the decode side). What stays exposed, T/G + (G-1)C,
# is least at G = sqrt(T/C). Measured on the 2-core VM (vLLM CPU, 2 KV heads, fp32): C ~0.6 ms
# (CPU summed over the processes); T ~1.25 ms a MiB on CPU KV (decode scatter ~1 GB/s under load
# plus the write), ~0.3 ms a MiB through the pinned host path of an H100
# (layerwise-gpu-h100-2026-11-28.json: 1 GiB in ~340 ms). At most MAX_GROUPS parts a chunk
# keeps parts/s within one daemon event loop (design §4).
PART_COST_S = 6e-4
HIDE_S_PER_BYTE = {"cpu": 1.25e-3 / (1 << 20), "cuda": 0.33e-3 / (1 << 20)}
MAX_GROUPS = 16


def group_size(setting: int, num_layers: int, layer_bytes: int, device: str = "cpu") -> int:
    """Layers a group of a chunk whose one layer is ``layer_bytes`` (KV on ``device``);
    ``num_layers``: whole."""
    if setting:
        return min(setting, num_layers)
    hide_s = num_layers * layer_bytes * HIDE_S_PER_BYTE.get(device, HIDE_S_PER_BYTE["cpu"])
    groups = max(1, min(num_layers, MAX_GROUPS, round(math.sqrt(hide_s / PART_COST_S))))
    return -(-num_layers // groups)


@dataclass
class _Open:
    """A layer-wise chunk of this step: its slot and the layers enqueued so far."""

    c: SendChunk
    slot: Slot
    group: int
    sent: int = 0  # layers [0, sent) gathered and enqueued


class LayerSends:
    """One TP rank's layer-wise chunks of the current step. Only the model's step thread calls it."""

    def __init__(self, shape: CacheShape, acquire_timeout_s: float,
                 fail: Callable[[str, int, str, PrefillSender | None], None]) -> None:
        self.shape = shape
        self._acquire_timeout = acquire_timeout_s
        self._fail = fail
        self._index = {name: i for i, name in enumerate(shape.layers)}
        self._open: list[_Open] = []
        self._tx: PrefillSender | None = None
        self.rooms: set[int] = set()  # rooms with a part out: their slots are never released here

    def group_of(self, c: SendChunk) -> int:
        s = self.shape
        layer_bytes = 2 * s.local_heads * (c.end - c.start) * s.head_size * s.dtype.itemsize
        return group_size(c.layer_group, len(s.layers), layer_bytes, s.pages.device.type)

    def open(self, tx: PrefillSender, c: SendChunk) -> bool:
        """Acquires the chunk's slot (before the forward); False: it goes whole (one group)."""
        g = self.group_of(c)
        if g >= len(self.shape.layers):
            return False
        slot = tx.acquire(c.end - c.start, timeout=self._acquire_timeout)
        self._tx = tx
        self._open.append(_Open(c, slot, g))
        self.rooms.add(c.room)
        return True

    def is_open(self, c: SendChunk) -> bool:
        return any(o.c is c for o in self._open)

    def on_layer(self, name: str) -> None:
        """A layer's KV is written: at a group's last layer, that group of every open chunk goes."""
        if not self._open:
            return
        i = self._index.get(name)
        if i is None:
            return
        done = i + 1
        ready = [o for o in self._open
                 if o.sent < done and (done % o.group == 0 or done == len(self.shape.layers))]
        if ready:
            self._send(*self._gather_all(ready, done))

    def finish(self) -> None:
        """End of the step: the layers no hook sent (e.g. a forward that skipped the hooks),
        then the seals of rooms whose prompt ended this step; verdicts come with flush()."""
        opened, self._open = self._open, []
        tx = self._tx
        if not opened or tx is None:
            return
        n = len(self.shape.layers)
        full = [o for o in opened if o.sent >= n]
        parts, owners = self._gather_all([o for o in opened if o.sent < n], n)
        owners += full
        parts += [seal_part(tx.layout, o.c.room, o.c.chunk_id, o.c.start, o.c.end - o.c.start, o.group)
                  for o in owners if o.c.last]
        if parts:
            self._send(parts, owners)

    def drop(self, room: int) -> None:
        self.rooms.discard(room)

    def _gather_all(self, opens: list[_Open], upto: int) -> tuple[list[Chunk], list[_Open]]:
        """Each chunk's layers up to ``upto`` as a part; a chunk whose copy fails fails its room."""
        parts, owners = [], []
        for o in opens:
            try:
                parts.append(self._gather(o, upto))
            except Exception as exc:
                self._open = [x for x in self._open if x is not o]
                if o.sent == 0 and self._tx is not None:
                    try:
                        self._tx.release_slot(o.slot)  # no part of it went: still ours
                    except Exception as rel:
                        logger.debug("room %d: slot release failed: %s", o.c.room, rel)
                self._fail(o.c.req_id, o.c.room, f"prefill layer gather failed: {exc}", self._tx)
                continue
            owners.append(o)
        return parts, owners

    def _gather(self, o: _Open, upto: int) -> Chunk:
        """Layers [o.sent, upto) into the slot, a group at a time; one part for all of them."""
        assert self._tx is not None
        s, c = self.shape, o.c
        n = c.end - c.start
        slot = self._tx.tensor(o.slot.offset, o.slot.chunk_bytes)
        lo = o.sent
        while lo < upto:
            hi = min(upto, (lo // o.group + 1) * o.group)
            kv = s.pages.layers(lo, hi)
            s.copy("gather", s.pages.group_view(slot, lo, hi, n), c.block_ids, c.first_block, c.start, c.end, kv=kv)
            lo = hi
        part = layer_part(c.room, c.chunk_id, c.start, n, o.slot, o.group, o.sent, upto)
        o.sent = upto
        return part

    def _send(self, parts: list[Chunk], owners: list[_Open]) -> None:
        assert self._tx is not None
        try:
            self._tx.enqueue_layers(parts, wait=False)
        except Exception as exc:
            # Nothing of the call went: every room in it fails (the decode side hears it now).
            for o in owners:
                self._fail(o.c.req_id, o.c.room, f"prefill layer parts failed: {exc}", self._tx)
            self._open = [o for o in self._open if o not in owners]


def scatter_chunk(shape: CacheShape, src: torch.Tensor, c: Landed, block_ids: tuple[int, ...], lo: int,
                  layers: tuple[int, int], done: set[int]) -> None:
    """The groups of layers ``layers`` of a group-major chunk (``c.layer_group`` layers a group)
    not in ``done`` (their first layers; added as they are copied) into the request's blocks,
    tokens [lo, end) of it (tokens before ``lo`` the decode engine holds already)."""
    s = shape
    n, g = c.num_tokens, c.layer_group
    slot = src.view(s.dtype)
    start, end = layers[0] - layers[0] % g, min(layers[1], len(s.layers))
    for first in range(start, end, g):
        last = min(len(s.layers), first + g)
        if first in done:
            continue
        done.add(first)
        grp = s.pages.group_view(slot, first, last, n)
        if lo > c.token_start:
            grp = grp.view(s.local_heads, last - first, 2, n, s.head_size)[:, :, :, lo - c.token_start:].contiguous()
        s.copy("scatter", grp, block_ids, 0, lo, c.token_start + n, kv=s.pages.layers(first, last))
