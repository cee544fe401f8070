"""The engine processes of ``kvxferd bench loopback --layer-parts N`` (issue #37's control-plane
stress): a prefill rank that sends each room's one chunk as N layer parts (layer group 1) and a
seal, and a decode rank registered with ``layer_parts`` that hears every landed layer range.

A prefill step takes every room ready now (up to the rooms in flight), fills their slots and
sends the k-th part of all of them in one ``enqueue_layers`` call, k = 0..N-1, then their seals:
an engine's step over a batch, layer by layer. Runs in mode ``stamp``/``full`` send whole chunks
through the same engines (the whole-chunk arm: same bytes, no parts).

The stamps and patterns are per layer-sized block of the chunk's bytes whatever the slot layout:
at TP 1->1 the decode slot holds the prefill slot's bytes verbatim in both layouts, so both arms
carry the same checks (a head-major block is not a layer there, which the check does not need).
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvxferd.bench.loopback_engines import _DecodeEngine, _PrefillEngine
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

LAYERS_PREFIX = "layers-"  # RunSpec.mode "layers-stamp" / "layers-full": the chunk goes as layer parts


def is_layered(mode: str) -> bool:
    return mode.startswith(LAYERS_PREFIX)


def base_mode(mode: str) -> str:
    return mode[len(LAYERS_PREFIX):] if is_layered(mode) else mode


def fill_blocks(view: memoryview, room: int, chunk: int, block: int, nblocks: int, full: bool) -> None:
    """Block b of the chunk: the pattern of (room, chunk, b) (full) or stamps at its start and end."""
    if full:
        arr = np.frombuffer(view, dtype=np.uint8)
        for b in range(nblocks):
            arr[b * block:(b + 1) * block] = pattern_bytes(head_seed(room, chunk, b), block)
        return
    for b in range(nblocks):
        view[b * block:b * block + STAMP_BYTES] = head_stamp(room, chunk, b)
        view[(b + 1) * block - STAMP_BYTES:(b + 1) * block] = tail_stamp(room, chunk, b)


def check_blocks(data: memoryview, room: int, chunk: int, block: int, nblocks: int, full: bool) -> list[str]:
    """What differs from fill_blocks' bytes (at most a few lines)."""
    if len(data) < block * nblocks:
        return [f"room {room} chunk {chunk}: {len(data)} B landed, expected {block * nblocks}"]
    errors: list[str] = []
    arr = np.frombuffer(data, dtype=np.uint8)
    for b in range(nblocks):
        if full:
            want = pattern_bytes(head_seed(room, chunk, b), block)
            got = arr[b * block:(b + 1) * block]
            if not np.array_equal(got, want):
                errors.append(f"room {room} chunk {chunk} block {b}: byte {int(np.argmax(got != want))} differs")
        elif (bytes(data[b * block:b * block + STAMP_BYTES]) != head_stamp(room, chunk, b)
              or bytes(data[(b + 1) * block - STAMP_BYTES:(b + 1) * block]) != tail_stamp(room, chunk, b)):
            errors.append(f"room {room} chunk {chunk} block {b}: stamp mismatch")
        if len(errors) >= 3:
            break
    return errors


class LayerPrefill(_PrefillEngine):
    """A prefill rank of TP 1->1 whose rooms are one chunk each: as N layer parts, or whole."""

    def __init__(self, socket: str, group: str, shape: ModelShape, ring_bytes: int) -> None:
        super().__init__(socket, group, shape, 1, 0, ring_bytes)
        self.shape = shape

    def _fill(self, view: memoryview, room: int, chunk: int, ntok: int, full: bool) -> None:
        n = self.shape.layers
        fill_blocks(view, room, chunk, ntok * self.shape.bytes_per_token // n, n, full)

    def _produce(self, spec: RunSpec) -> dict[str, Any]:
        if not is_layered(spec.mode):
            return super()._produce(spec)
        from kvxfer_client._parts import layer_part, seal_part

        full = base_mode(spec.mode) == "full"
        n = self.shape.layers
        deadline = self._start_run(spec)
        acquire_wait = 0.0
        calls = 0
        while True:
            # Every room ready now: one step's batch.
            batch = self._take_ready(deadline, spec.in_flight)
            if not batch:
                break
            slots = []
            for p in batch:
                t0 = time.monotonic()
                slot = self.tx.acquire(p.chunks[0], timeout=max(1.0, deadline - t0))
                acquire_wait += time.monotonic() - t0
                self._fill(self.tx.slot_view(slot), p.room, 0, p.chunks[0], full)
                slots.append(slot)
            # Layer k of every room of the step in one call, as an engine's forward pass produces them.
            for k in range(n):
                self._sent(self.tx.enqueue_layers(
                    [layer_part(p.room, 0, 0, p.chunks[0], slot, 1, k, k + 1) for p, slot in zip(batch, slots, strict=True)],
                    wait=spec.enqueue_wait))
            self._sent(self.tx.enqueue_layers(
                [seal_part(self.tx.layout, p.room, 0, 0, p.chunks[0], 1, b"aux-%d" % p.room) for p in batch],
                wait=spec.enqueue_wait))
            calls += n + 1
        refused = self.tx.flush()
        if refused:
            raise RuntimeError(f"parts refused: {refused[:3]}")
        with self.cond:
            finished = dict(self.finished)
            admit = dict(self.admitted)
        return {"admit": admit, "done": {r: t for r, (t, _) in finished.items()},
                "states": {r: s for r, (_, s) in finished.items()}, "acquire_wait_s": acquire_wait,
                "enqueue_calls": calls}

    @staticmethod
    def _sent(errors: list[Any]) -> None:
        bad = [e for e in errors if e is not None]
        if bad:
            raise RuntimeError(f"parts refused: {bad[:3]}")


class LayerDecode(_DecodeEngine):
    """A decode rank (layer_parts) that hears each landed layer range and checks every complete chunk."""

    def __init__(self, socket: str, group: str, shape: ModelShape, ring_bytes: int) -> None:
        self.shape = shape
        self.layer_events = 0
        self.layers_landed = 0
        super().__init__(socket, group, shape, 1, 0, ring_bytes, layer_parts=True)

    def _check(self, room: int, p: RoomPlan, cid: int, data: memoryview, ntok: int) -> None:
        n = self.shape.layers
        full = self.mode == "full"
        for e in check_blocks(data, room, cid, ntok * self.shape.bytes_per_token // n, n, full):
            self._error(e)
        if full:
            self.bytes_checked += ntok * self.shape.bytes_per_token
        else:
            self.stamps_checked += 2 * n

    def _event(self, ev: Any, read: dict[int, list[int]]) -> None:
        c = ev.landed
        if c is not None and c.layer_end:
            # A layer event (layer_progress): what landed must be a range of the chunk's layers.
            self.layer_events += 1
            self.layers_landed += c.layer_end - c.layer_start
            if not 0 <= c.layer_start < c.layer_end <= self.shape.layers:
                self._error(f"room {ev.room}: layer range [{c.layer_start}, {c.layer_end}) off [0, {self.shape.layers})")
            if not c.chunk_complete:
                ev = replace(ev, landed=None)  # the chunk is read and watermarked once, when complete
        super()._event(ev, read)

    def expect(self, spec: RunSpec, prefill_address: str, prefill_group: str) -> dict[str, Any]:
        self.layer_events = self.layers_landed = 0
        return super().expect(replace(spec, mode=base_mode(spec.mode)), prefill_address, prefill_group)

    def collect(self, timeout_s: float) -> dict[str, Any]:
        out = super().collect(timeout_s)
        out.update({"layer_events": self.layer_events, "layers_landed": self.layers_landed})
        return out


def layer_engine_entry(conn: Connection, role: str, socket: str, group: str, shape: ModelShape, ring_bytes: int,
                       log_path: str) -> None:
    redirect_output(log_path)
    try:
        eng: LayerPrefill | LayerDecode = (LayerPrefill if role == "prefill" else LayerDecode)(
            socket, group, shape, ring_bytes)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", {"pid": os.getpid()}))
    child_loop(conn, eng.handle, eng.close)
