"""The staged host path: GPU KV <-> host slot through a small double-buffered GPU staging buffer.

The kernel gathers a few MiB at a time into one half of the buffer while the copy engine moves
the other half over PCIe on a side stream (scatter: the other way round). Also home of the
validated copy description both this path and :mod:`kvxfer_client.kernels.kv_copy` work from.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Literal

import torch

Kind = Literal["gather", "scatter"]


@dataclass(frozen=True)
class CopyCall:
    """One validated copy: which heads, which layer-planes, which tokens, which slot bytes."""

    page_ids: torch.Tensor
    num_tokens: int
    token_offset: int  # position of the chunk's first token in its first page
    page_size: int
    head_start: int
    num_heads: int
    lp_begin: int
    num_lp: int
    slot: torch.Tensor  # flat, contiguous, any dtype


@dataclass(frozen=True)
class StagedPiece:
    head_start: int
    num_heads: int
    lp_begin: int
    num_lp: int
    offset: int  # bytes into the slot
    nbytes: int


def staged_pieces(call: CopyCall, plane: int, half: int) -> Iterator[StagedPiece]:
    """Split the slot into contiguous byte ranges of at most ``half`` bytes.

    ``plane`` is the bytes of one (head, layer-plane): tokens x row bytes. A (head, layer-plane
    range) is contiguous in the slot layout; when a whole head fits, several heads are taken at once.
    """
    head_bytes = call.num_lp * plane
    if head_bytes <= half:
        per = max(1, half // head_bytes)
        for h in range(0, call.num_heads, per):
            n = min(per, call.num_heads - h)
            yield StagedPiece(call.head_start + h, n, 0, call.num_lp, h * head_bytes, n * head_bytes)
        return
    per_lp = half // plane
    for h in range(call.num_heads):
        for lp in range(0, call.num_lp, per_lp):
            n = min(per_lp, call.num_lp - lp)
            yield StagedPiece(call.head_start + h, 1, lp, n, h * head_bytes + lp * plane, n * plane)


class Stager:
    """Staging buffer, copy stream and per-half completion events of one KV cache; one copy at a time."""

    def __init__(self, device: torch.device, staging_bytes: int) -> None:
        self.device = device
        self.staging_bytes = staging_bytes
        self._staging: torch.Tensor | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        self._free: list[torch.cuda.Event | None] = [None, None]
        self._lock = threading.Lock()

    def _halves(self) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Stream]:
        if self._staging is None or self._copy_stream is None:
            half = (self.staging_bytes // 2) & ~255  # keep both halves 256-byte aligned
            self._staging = torch.empty((2, half), dtype=torch.uint8, device=self.device)
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._staging[0], self._staging[1], self._copy_stream

    def run(self, kind: Kind, call: CopyCall, row_bytes: int, launch: Callable[[Kind, CopyCall], None]) -> None:
        """``launch(kind, sub_call)`` runs the kernel on a device sub-slot, on the current stream."""
        with self._lock:
            self._run(kind, call, row_bytes, launch)

    def _run(self, kind: Kind, call: CopyCall, row_bytes: int, launch: Callable[[Kind, CopyCall], None]) -> None:
        first, second, copy = self._halves()
        bufs = (first, second)
        compute = torch.cuda.current_stream(self.device)
        # The side stream starts where the caller's stream is, so the copy sees
        # everything the caller enqueued before this call (as a direct launch would).
        start = torch.cuda.Event()
        start.record(compute)
        copy.wait_event(start)
        slot_u8 = call.slot.view(torch.uint8)
        for i, piece in enumerate(staged_pieces(call, call.num_tokens * row_bytes, first.numel())):
            b = i % 2
            buf = bufs[b][: piece.nbytes]
            region = slot_u8[piece.offset : piece.offset + piece.nbytes]
            sub = replace(
                call,
                head_start=piece.head_start,
                num_heads=piece.num_heads,
                lp_begin=piece.lp_begin,
                num_lp=piece.num_lp,
                slot=buf,
            )
            # Gather: kernel (compute stream) fills the half, then the copy engine drains it to
            # the host. Scatter: the copy engine fills it, then the kernel drains it. Either way
            # the half is reused only after the second step of its previous use finished.
            kernel = (compute, functools.partial(launch, kind, sub))
            dst, src = (region, buf) if kind == "gather" else (buf, region)
            move = (copy, functools.partial(dst.copy_, src, non_blocking=True))
            (s1, step1), (s2, step2) = (kernel, move) if kind == "gather" else (move, kernel)
            prev = self._free[b]
            if prev is not None:
                s1.wait_event(prev)
            ready = torch.cuda.Event()
            done = torch.cuda.Event()
            with torch.cuda.stream(s1):
                step1()
            ready.record(s1)
            s2.wait_event(ready)
            with torch.cuda.stream(s2):
                step2()
            done.record(s2)
            self._free[b] = done
        # Completion is reported through the caller's stream, as for the direct paths.
        for ev in self._free:
            if ev is not None:
                compute.wait_event(ev)
