"""Triton copy kernel between paged engine KV and a staging slot, both directions.

Imported lazily by :mod:`kvxfer_client.kernels.kv_copy`: ``triton.jit`` decides at
decoration time whether to build an interpreted function (``TRITON_INTERPRET=1``),
so importing this module early would freeze that choice before tests can set it.

Everything here works on raw integer "units" (1, 2, 4 or 8 bytes) and on
offsets expressed in ``VEC``-unit vectors, so that

* any KV dtype is copied byte for byte (fp8 never goes through a float path);
* the compiler can prove every row start is a multiple of ``VEC`` units and emit
  16-byte loads/stores, which is what gets PCIe and HBM close to copy-engine speed.

Tile: rows are (token, head) pairs of one layer-plane, columns are the
``ROW`` units of one head's vector. One program copies ``BLOCK_TOK`` tokens x
``BLOCK_H`` heads for ``LP_PER_PROG`` layer-planes; the token axis walks the
chunk (not pages), so a tiny page size still gives each program a useful tile.
Layer-planes ``[lp_begin, lp_begin + num_lp)`` of the table are copied; the slot
holds only those, so a staged copy can move a head's layers in pieces.

Token ``i`` of the chunk is token ``token_offset + i`` of the page list: a chunk
may start (and end) in the middle of a page.

Gather and scatter are one body: the address arithmetic is identical and only
which side is loaded and which is stored differs (the ``GATHER`` constexpr), so
the two directions cannot drift apart and a tuning change applies to both.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_copy_kernel(  # type: ignore[no-untyped-def]  # triton reads annotations as types
    kv_base,
    lp_offs_v,
    page_ids,
    slot,
    num_tokens,
    token_offset,
    num_heads,
    head_start,
    lp_begin,
    num_lp,
    stride_s_v,
    stride_h_v,
    slot_head_stride_v,
    slot_lp_stride_v,
    GATHER: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_TOK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LP_PER_PROG: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_lp = tl.program_id(1)
    pid_h = tl.program_id(2)
    r = tl.arange(0, BLOCK_TOK * BLOCK_H)
    tok = pid_t.to(tl.int64) * BLOCK_TOK + (r // BLOCK_H)
    h = pid_h.to(tl.int64) * BLOCK_H + (r % BLOCK_H)
    row_ok = (tok < num_tokens) & (h < num_heads)
    pos = tok + token_offset
    page = tl.load(page_ids + pos // PAGE_SIZE, mask=row_ok, other=0).to(tl.int64)
    kv_slot = page * PAGE_SIZE + pos % PAGE_SIZE
    # Multiplying vector-unit offsets by the constexpr VEC is what tells the
    # compiler every row start is VEC-aligned.
    kv_row = (kv_slot * stride_s_v + (head_start + h) * stride_h_v) * VEC
    slot_row = h * slot_head_stride_v * VEC + tok * ROW
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d < ROW)[None, :]
    for i in tl.static_range(LP_PER_PROG):
        lp = pid_lp.to(tl.int64) * LP_PER_PROG + i
        if lp < num_lp:
            kv_ptr = kv_base + tl.load(lp_offs_v + lp_begin + lp) * VEC + kv_row[:, None] + d[None, :]
            slot_ptr = slot + lp * slot_lp_stride_v * VEC + slot_row[:, None] + d[None, :]
            if GATHER:
                tl.store(slot_ptr, tl.load(kv_ptr, mask=mask), mask=mask)
            else:
                tl.store(kv_ptr, tl.load(slot_ptr, mask=mask), mask=mask)


def launch(
    gather: bool,
    grid: tuple[int, int, int],
    args: tuple[object, ...],
    constexprs: dict[str, int],
    num_warps: int,
) -> None:
    kv_copy_kernel[grid](*args, GATHER=gather, **constexprs, num_warps=num_warps)
