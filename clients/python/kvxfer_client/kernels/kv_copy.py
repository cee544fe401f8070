"""Gather paged engine KV into a staging slot, and scatter it back.

Engine side: per layer a K and a V tensor ``[num_slots, local_heads, head_dim]``
(MLA: one latent tensor per layer, ``[num_slots, 1, width]`` or
``[num_slots, width]``). Page ``p`` is slots ``[p * page_size, (p + 1) * page_size)``; with ``j = token_offset + i``,
token ``i`` of a chunk lives in slot ``page_ids[j // page_size] * page_size + j % page_size``:
a chunk may start in the middle of its first page (chunked prefill cut by a token budget) and
end in the middle of its last one; only its own tokens are read or written.
Or block-major planes ``[num_pages, local_heads, page_size, head_dim]`` of any strides (vLLM's
caches as ``kvxfer_client.vllm._paged.kv_planes`` sees them): token ``i`` is then row
``j % page_size`` of page ``page_ids[j // page_size]``. Token-major pages are slots as above
(Triton copies them); others, such as CPU_ATTN's transposed K, go through the torch reference.

Slot side (see docs/contracts.md): ``[heads, layers, planes, tokens, head_dim]``
contiguous, planes = (K, V) or just the latent. With a head sub-range the slot
holds only heads ``[head_start, head_start + num_heads)`` of the engine's local heads.
A layer-wise chunk's slot is group-major, ``[groups, heads, layers_in_group, planes, tokens,
head_dim]`` (docs/design/layerwise.md §1): each group is the layout above over its layers, so
``KVPages.layers(lo, hi)`` copies it into ``KVPages.group_view(slot, lo, hi, ...)``.

Copies are byte-exact for every dtype: tensors are reinterpreted as integers
of the widest width that every address and stride allows.

Hot paths should build one :class:`KVPages` per engine and call its
``gather``/``scatter`` per chunk: validation and the per-layer address table
are done once. :func:`gather_kv`/:func:`scatter_kv` are one-shot wrappers.

How bytes move, by where the slot lives:

* slot on the KV's GPU (staging ring): one Triton launch, all layers.
* slot in host memory, GPU KV: by default *staged*: the kernel gathers a few
  MiB at a time into a small GPU buffer and the copy engine moves it over PCIe
  on a side stream, double-buffered. SM-driven PCIe traffic (the kernel
  writing host memory directly) tops out a few percent under the copy engine
  and occupies SMs for the whole transfer; staging costs 64 MiB of GPU memory
  and reaches copy-engine speed. ``staging_bytes=0`` selects the direct path.
* CPU KV: Triton under ``TRITON_INTERPRET=1`` (tests), else the torch reference.

All GPU work is ordered on the caller's current stream: after a call returns,
work (or an event) enqueued on that stream runs after the copy finished.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import torch

from kvxfer_client.kernels._staged import CopyCall, Kind, Stager
from kvxfer_client.kernels._support import (
    INT_BY_WIDTH,
    VEC_BYTES,
    TileConfig,
    as_3d,
    as_int,
    check_positive,
    default_tile,
    flat_pages,
    next_pow2,
    to_device,
)

logger = logging.getLogger(__name__)

Backend = Literal["auto", "triton", "torch"]

DEFAULT_STAGING_BYTES = 64 << 20

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "Backend",
    "KVPages",
    "TileConfig",
    "default_tile",
    "slot_nbytes",
    "slot_shape",
    "triton_available",
]


def slot_shape(num_heads: int, num_layers: int, planes: int, num_tokens: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one rank's part of a chunk in a slot, in elements of the KV dtype."""
    return (num_heads, num_layers, planes, num_tokens, head_dim)


def slot_nbytes(
    num_heads: int, num_layers: int, planes: int, num_tokens: int, head_dim: int, dtype: torch.dtype
) -> int:
    return math.prod(slot_shape(num_heads, num_layers, planes, num_tokens, head_dim)) * dtype.itemsize


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class KVPages:
    """An engine's paged KV cache (all layers), validated once, copied many times.

    Args:
        k_layers: per-layer K ``[num_slots, local_heads, head_dim]`` (or the MLA latent,
            2-D or with one head). All layers share shape, strides, dtype and device;
            ``head_dim`` must be contiguous; layers may be separate allocations or views
            of one buffer. Or block-major ``[num_pages, local_heads, page_size, head_dim]``
            planes of one shape and any strides (each call's ``page_size`` must match).
        v_layers: per-layer V, same shape as K; ``None`` for MLA (one plane).
        staging_bytes: GPU buffer for the staged host path (see module doc); 0 disables it.
    """

    def __init__(
        self,
        k_layers: Sequence[torch.Tensor],
        v_layers: Sequence[torch.Tensor] | None = None,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        if len(k_layers) == 0:
            raise ValueError("need at least one layer")
        if v_layers is not None and len(v_layers) != len(k_layers):
            raise ValueError(f"got {len(k_layers)} K layers but {len(v_layers)} V layers")
        if staging_bytes < 0:
            raise ValueError(f"staging_bytes must be >= 0, got {staging_bytes}")
        planes = 1 if v_layers is None else 2
        given = [t for i, k in enumerate(k_layers) for t in (k, *(() if v_layers is None else (v_layers[i],)))]
        # Block-major planes name their page size; slot-major ones leave it to each call.
        self.page_size: int | None = int(given[0].shape[2]) if given[0].dim() == 4 else None
        paged = self.page_size is not None
        tensors = [flat_pages(t) if paged and t.dim() == 4 else as_3d(t, f"{'kv'[i % planes]}_layers[{i // planes}]")
                   for i, t in enumerate(given)]
        ref = tensors[0]
        for g, t in zip(given[1:], tensors[1:], strict=True):
            # Block-major planes may differ in strides (CPU_ATTN stores K transposed, V not): the
            # torch reference indexes each plane by itself.
            if g.shape != given[0].shape or (not paged and t.stride() != ref.stride()) or t.dtype != ref.dtype \
                    or t.device != ref.device:
                raise ValueError(
                    "all KV layers must share shape, strides, dtype and device; "
                    f"got {tuple(t.shape)}/{t.stride()}/{t.dtype}/{t.device} vs "
                    f"{tuple(ref.shape)}/{ref.stride()}/{ref.dtype}/{ref.device}"
                )
        if not paged and ref.stride(2) != 1:
            raise ValueError("KV head_dim must be contiguous (stride 1)")
        self._adopt(tuple(tensors), planes, Stager(ref.device, staging_bytes))

    def _adopt(self, tensors: tuple[torch.Tensor, ...], planes: int, stager: Stager) -> None:
        """Everything derived from validated planes; shared by the constructor and :meth:`layers`."""
        ref = tensors[0]
        # Triton addresses every plane as the first one's [slot, head, D] strides from its own base.
        self._triton_ok = ref.dim() == 3 and ref.stride(2) == 1 and all(t.stride() == ref.stride() for t in tensors)
        self.planes_t: tuple[torch.Tensor, ...] = tensors  # layer-major: k0, v0, k1, v1, ...
        self.num_layers = len(tensors) // planes
        self.planes = planes
        self.local_heads, self.head_dim = int(ref.shape[1]), int(ref.shape[-1])
        self.num_slots = int(ref.shape[0]) * (int(ref.shape[2]) if ref.dim() == 4 else 1)
        self.dtype = ref.dtype
        self.itemsize = ref.element_size()
        self.device = ref.device
        self.row_bytes = self.head_dim * self.itemsize
        self.stride_s, self.stride_h = ref.stride(0), ref.stride(1)
        addrs = [t.data_ptr() for t in tensors]
        self._addrs = addrs
        # Alignment every launch shares; a call folds in its slot's address.
        g = 0
        for q in (self.row_bytes, self.stride_s * self.itemsize, self.stride_h * self.itemsize, addrs[0]):
            g = math.gcd(g, q)
        for a in addrs:
            g = math.gcd(g, a - addrs[0])
        self._align = g
        self._tables: dict[int, torch.Tensor] = {}
        self._staging_bytes = stager.staging_bytes
        self._stager = stager
        self._subsets: dict[tuple[int, int], KVPages] = {}

    @property
    def num_lp(self) -> int:
        return self.num_layers * self.planes

    def slot_nbytes(self, num_tokens: int, num_heads: int | None = None) -> int:
        heads = self.local_heads if num_heads is None else num_heads
        return slot_nbytes(heads, self.num_layers, self.planes, num_tokens, self.head_dim, self.dtype)

    def layers(self, lo: int, hi: int) -> KVPages:
        """The KV of layers ``[lo, hi)`` alone: a layer group of a group-major slot
        ``[groups, heads, layers_in_group, planes, tokens, head_dim]`` (docs/design/layerwise.md §1).
        Its ``gather`` fills, and its ``scatter`` reads, ``[heads, hi - lo, planes, tokens, head_dim]``:
        the group's bytes of the slot, :meth:`group_view`. Cached per range, so a per-layer hook pays
        no validation; shares this cache's staging buffer (one copy at a time, as for this cache)."""
        self._check_layers(lo, hi)
        if (lo, hi) == (0, self.num_layers):
            return self
        sub = self._subsets.get((lo, hi))
        if sub is None:
            sub = object.__new__(KVPages)
            sub._adopt(self.planes_t[lo * self.planes : hi * self.planes], self.planes, self._stager)
            sub.page_size = self.page_size
            # Setting one key is atomic under the GIL; two threads building one range both get a valid view.
            self._subsets[(lo, hi)] = sub
        return sub

    def _check_layers(self, lo: int, hi: int) -> None:
        ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (lo, hi)) and 0 <= lo < hi <= self.num_layers
        if not ok:
            raise ValueError(f"layer range [{lo}, {hi}) is not a non-empty range of the {self.num_layers} layers")

    def group_view(
        self, slot: torch.Tensor, lo: int, hi: int, num_tokens: int, num_heads: int | None = None
    ) -> torch.Tensor:
        """The bytes of layers ``[lo, hi)`` in a group-major slot of ``num_tokens`` tokens and
        ``num_heads`` heads (default all local ones), flat, for ``layers(lo, hi)`` to copy.

        A group of ``g`` layers starts at ``lo * heads * b`` (``b`` = one layer-head's planes x
        tokens x row bytes) whatever ``g`` the slot was cut with, because every earlier group holds
        all heads of its layers. Copy one group at a time: the view of several groups is one byte
        range (a part's bytes), but laid out ``[groups, heads, g, ...]``, not ``layers(lo, hi)``'s
        ``[heads, hi - lo, ...]`` (the two agree only for one head).
        """
        self._check_layers(lo, hi)
        heads = self.local_heads if num_heads is None else num_heads
        want = self.slot_nbytes(num_tokens, heads)
        if not slot.is_contiguous() or slot.numel() * slot.element_size() != want:
            raise ValueError(
                f"slot must be contiguous and hold the {want} bytes of {heads} heads x {self.num_layers} layers x "
                f"{num_tokens} tokens, got {slot.numel() * slot.element_size()} bytes"
                f"{'' if slot.is_contiguous() else ' (not contiguous)'}"
            )
        per_layer = want // self.num_layers
        flat = slot.reshape(-1).view(torch.uint8)[lo * per_layer : hi * per_layer]
        return flat.view(slot.dtype) if per_layer % slot.element_size() == 0 else flat

    # -- public copies -------------------------------------------------------

    def gather(
        self,
        page_ids: torch.Tensor,
        num_tokens: int,
        page_size: int,
        out: torch.Tensor,
        head_start: int = 0,
        num_heads: int | None = None,
        *,
        token_offset: int = 0,
        backend: Backend = "auto",
        tile: TileConfig | None = None,
    ) -> torch.Tensor:
        """Copy a chunk's KV from pages into ``out``; see :func:`gather_kv`. Returns ``out``."""
        call = self._validate(page_ids, num_tokens, token_offset, page_size, out, head_start, num_heads)
        self._copy("gather", call, backend, tile)
        return out

    def scatter(
        self,
        page_ids: torch.Tensor,
        num_tokens: int,
        page_size: int,
        src: torch.Tensor,
        head_start: int = 0,
        num_heads: int | None = None,
        *,
        token_offset: int = 0,
        backend: Backend = "auto",
        tile: TileConfig | None = None,
    ) -> None:
        """Write a slot's tokens into pages; see :func:`scatter_kv`."""
        call = self._validate(page_ids, num_tokens, token_offset, page_size, src, head_start, num_heads)
        self._copy("scatter", call, backend, tile)

    def settle(self) -> None:
        """Returns once the copies enqueued on the caller's stream have run, so the slot may go to
        the daemon (gather) or back to it (scatter) at once. A no-op for CPU KV."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # -- internals -----------------------------------------------------------

    def _copy(self, kind: Kind, call: CopyCall, backend: Backend, tile: TileConfig | None) -> None:
        path = self._choose_path(call, backend)
        if path != "torch":
            # Upload host-side ids once, not once per staged chunk.
            call = replace(call, page_ids=to_device(call.page_ids, self.device))
        if path == "torch":
            self._copy_torch(kind, call)
        elif path == "staged":
            self._stager.run(kind, call, self.row_bytes, functools.partial(self._launch_staged, tile))
        else:
            self._launch(kind, call, tile)

    def _validate(
        self,
        page_ids: torch.Tensor,
        num_tokens: int,
        token_offset: int,
        page_size: int,
        slot: torch.Tensor,
        head_start: int,
        num_heads: int | None,
    ) -> CopyCall:
        check_positive("num_tokens", num_tokens)
        check_positive("page_size", page_size)
        if self.page_size is not None and page_size != self.page_size:
            raise ValueError(f"page_size {page_size} is not the {self.page_size} tokens of the KV planes' pages")
        if not isinstance(token_offset, int) or isinstance(token_offset, bool) or not 0 <= token_offset < page_size:
            raise ValueError(f"token_offset must be an int in [0, {page_size}), got {token_offset!r}")
        if num_heads is None:
            num_heads = self.local_heads - head_start
        if not (head_start >= 0 and num_heads > 0 and head_start + num_heads <= self.local_heads):
            raise ValueError(
                f"head range [{head_start}, {head_start + num_heads}) outside the {self.local_heads} local heads"
            )
        if page_ids.dim() != 1 or page_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"page_ids must be a 1-D int32/int64 tensor, got {page_ids.dtype} {tuple(page_ids.shape)}")
        needed_pages = -(-(token_offset + num_tokens) // page_size)
        if page_ids.numel() < needed_pages:
            raise ValueError(
                f"{num_tokens} tokens from offset {token_offset} need {needed_pages} pages of {page_size}, "
                f"got {page_ids.numel()} page ids"
            )
        page_ids = page_ids[:needed_pages]
        num_pages_total = self.num_slots // page_size
        # Bounds are checked only for host-side ids: checking device ids would stall the
        # caller's stream on every chunk.
        if page_ids.device.type == "cpu" and (int(page_ids.min()) < 0 or int(page_ids.max()) >= num_pages_total):
            raise ValueError(
                f"page ids must be in [0, {num_pages_total}) for {self.num_slots} slots of page size {page_size}"
            )
        if not slot.is_contiguous():
            raise ValueError("slot tensor must be contiguous")
        expect = self.slot_nbytes(num_tokens, num_heads)
        got = slot.numel() * slot.element_size()
        if got != expect:
            raise ValueError(
                f"slot holds {got} bytes but [{num_heads}, {self.num_layers}, {self.planes}, {num_tokens}, "
                f"{self.head_dim}] x {self.itemsize} B needs {expect}"
            )
        return CopyCall(
            page_ids=page_ids,
            num_tokens=num_tokens,
            token_offset=token_offset,
            page_size=page_size,
            head_start=head_start,
            num_heads=num_heads,
            lp_begin=0,
            num_lp=self.num_lp,
            slot=slot.reshape(-1),
        )

    def _choose_path(self, call: CopyCall, backend: Backend) -> Literal["triton", "staged", "torch"]:
        slot_dev = call.slot.device
        if backend == "torch":
            return "torch"
        path: Literal["triton", "staged"] | None = None
        if not triton_available() or not self._triton_ok:
            path = None
        elif self.device.type == "cuda" and not _interpreting():
            if slot_dev == self.device:
                path = "triton"
            elif slot_dev.type == "cpu":
                if self._staging_bytes and self._plane_bytes(call) <= self._staging_bytes // 2:
                    path = "staged"
                elif call.slot.is_pinned():
                    # A GPU kernel reaches host memory only if it is pinned (mapped into the UVA space).
                    path = "triton"
        elif self.device.type == "cpu" and slot_dev.type == "cpu" and _interpreting():
            path = "triton"
        if path is not None:
            return path
        if backend == "triton":
            raise ValueError(
                f"triton backend cannot copy between KV on {self.device} and a slot on {slot_dev}"
                f"{' (pageable host memory, no staging)' if slot_dev.type == 'cpu' else ''}"
                f"{'' if triton_available() else '; triton is not installed'}"
                f"{'' if self._triton_ok else '; its KV planes are not [slot, head, D] rows of one stride'}"
            )
        logger.debug("kv copy falls back to torch (kv on %s, slot on %s)", self.device, slot_dev)
        return "torch"

    def _plane_bytes(self, call: CopyCall) -> int:
        return call.num_tokens * self.row_bytes

    def _launch_staged(self, tile: TileConfig | None, kind: Kind, call: CopyCall) -> None:
        self._launch(kind, call, tile or default_tile(kind, False))

    # torch reference ----------------------------------------------------------

    def _slot_view(self, call: CopyCall) -> torch.Tensor:
        shape = (call.num_heads, call.num_lp, call.num_tokens, self.head_dim)
        return as_int(call.slot.view(torch.uint8).view(self.dtype)).view(shape)

    def _copy_torch(self, kind: Kind, call: CopyCall) -> None:
        pos = torch.arange(call.num_tokens, device=self.device) + call.token_offset
        pages = call.page_ids.to(device=self.device, dtype=torch.int64)[pos // call.page_size]
        offsets = pos % call.page_size
        slots = pages * call.page_size + offsets
        view = self._slot_view(call)
        src = view if kind == "gather" else view.to(self.device)
        hs = slice(call.head_start, call.head_start + call.num_heads)
        whole = call.head_start == 0 and call.num_heads == self.local_heads
        for i in range(call.num_lp):
            plane = as_int(self.planes_t[call.lp_begin + i])
            # Either index gives [tokens, heads, D] (advanced indices around a slice go first).
            index = (slots, hs) if plane.dim() == 3 else (pages, hs, offsets)
            if kind == "gather":
                view[:, i].copy_(plane[index].transpose(0, 1))  # [tokens, heads, D] -> [heads, ...]
            elif whole and plane.dim() == 3:
                plane.index_copy_(0, slots, src[:, i].transpose(0, 1).contiguous())
            else:
                # index_put on a head-sliced view keeps untouched heads intact.
                plane[index] = src[:, i].transpose(0, 1)

    # triton -------------------------------------------------------------------

    def _table(self, step: int) -> torch.Tensor:
        """Per layer-plane offsets from the first plane, in ``step``-byte vectors, on the KV device.

        Built once per vector width: a blocking upload per chunk would stall the
        caller until its stream drained.
        """
        table = self._tables.get(step)
        if table is None:
            offs = torch.tensor([(a - self._addrs[0]) // step for a in self._addrs], dtype=torch.int64)
            table = to_device(offs, self.device)
            self._tables[step] = table
        return table

    def _launch(self, kind: Kind, call: CopyCall, tile: TileConfig | None) -> None:
        from kvxfer_client.kernels import _triton_kv

        if tile is None:
            tile = default_tile(kind, call.slot.device.type == "cpu")
        g = math.gcd(self._align, call.slot.data_ptr())
        align = g & -g  # largest power of two dividing every address and stride
        width = min(8, align)
        vec = max(1, min(VEC_BYTES, align) // width)
        step = width * vec
        idt = INT_BY_WIDTH[width]
        row = self.row_bytes // width
        block_d = next_pow2(row)
        row_bytes_padded = block_d * width
        block_h = min(next_pow2(call.num_heads), max(1, tile.target_tile_bytes // row_bytes_padded))
        block_tok = max(1, tile.target_tile_bytes // (row_bytes_padded * block_h))
        block_tok = min(next_pow2(block_tok), next_pow2(call.num_tokens))
        lp_per_prog = max(1, min(tile.lp_per_prog, call.num_lp))
        grid = (
            -(-call.num_tokens // block_tok),
            -(-call.num_lp // lp_per_prog),
            -(-call.num_heads // block_h),
        )
        slot_lp_stride = call.num_tokens * row
        args = (
            self.planes_t[0].view(torch.uint8).view(idt),
            self._table(step),
            to_device(call.page_ids, self.device),
            call.slot.view(torch.uint8).view(idt),
            call.num_tokens,
            call.token_offset,
            call.num_heads,
            call.head_start,
            call.lp_begin,
            call.num_lp,
            self.stride_s * self.itemsize // step,
            self.stride_h * self.itemsize // step,
            call.num_lp * slot_lp_stride // vec,
            slot_lp_stride // vec,
        )
        constexprs = {
            "PAGE_SIZE": call.page_size,
            "ROW": row,
            "BLOCK_D": block_d,
            "VEC": vec,
            "BLOCK_TOK": block_tok,
            "BLOCK_H": block_h,
            "LP_PER_PROG": lp_per_prog,
        }
        _triton_kv.launch(kind == "gather", grid, args, constexprs, tile.num_warps)
