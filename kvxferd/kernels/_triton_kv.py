"""Triton gather/scatter kernels between paged engine KV and a staging slot.

Imported lazily by :mod:`kvxferd.kernels.kv_copy`: ``triton.jit`` decides at
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
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _kv_rows(  # type: ignore[no-untyped-def]  # triton reads annotations as types
    page_ids,
    pid_t,
    pid_h,
    num_tokens,
    num_heads,
    head_start,
    stride_s_v,
    stride_h_v,
    out_head_stride_v,
    PAGE_SIZE: tl.constexpr,
    ROW: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_TOK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    r = tl.arange(0, BLOCK_TOK * BLOCK_H)
    tok = pid_t.to(tl.int64) * BLOCK_TOK + (r // BLOCK_H)
    h = pid_h.to(tl.int64) * BLOCK_H + (r % BLOCK_H)
    row_ok = (tok < num_tokens) & (h < num_heads)
    page = tl.load(page_ids + tok // PAGE_SIZE, mask=row_ok, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + tok % PAGE_SIZE
    # Multiplying vector-unit offsets by the constexpr VEC is what tells the
    # compiler every row start is VEC-aligned.
    kv_row = (slot * stride_s_v + (head_start + h) * stride_h_v) * VEC
    slot_row = h * out_head_stride_v * VEC + tok * ROW
    return kv_row, slot_row, row_ok


@triton.jit
def gather_kernel(  # type: ignore[no-untyped-def]  # triton reads annotations as types
    kv_base,
    lp_offs_v,
    page_ids,
    out,
    num_tokens,
    num_heads,
    head_start,
    lp_begin,
    num_lp,
    stride_s_v,
    stride_h_v,
    out_head_stride_v,
    out_lp_stride_v,
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
    kv_row, slot_row, row_ok = _kv_rows(
        page_ids,
        pid_t,
        pid_h,
        num_tokens,
        num_heads,
        head_start,
        stride_s_v,
        stride_h_v,
        out_head_stride_v,
        PAGE_SIZE,
        ROW,
        VEC,
        BLOCK_TOK,
        BLOCK_H,
    )
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d < ROW)[None, :]
    for i in tl.static_range(LP_PER_PROG):
        lp = pid_lp.to(tl.int64) * LP_PER_PROG + i
        if lp < num_lp:
            base = tl.load(lp_offs_v + lp_begin + lp) * VEC
            vals = tl.load(kv_base + base + kv_row[:, None] + d[None, :], mask=mask)
            tl.store(out + lp * out_lp_stride_v * VEC + slot_row[:, None] + d[None, :], vals, mask=mask)


@triton.jit
def scatter_kernel(  # type: ignore[no-untyped-def]  # triton reads annotations as types
    kv_base,
    lp_offs_v,
    page_ids,
    src,
    num_tokens,
    num_heads,
    head_start,
    lp_begin,
    num_lp,
    stride_s_v,
    stride_h_v,
    src_head_stride_v,
    src_lp_stride_v,
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
    kv_row, slot_row, row_ok = _kv_rows(
        page_ids,
        pid_t,
        pid_h,
        num_tokens,
        num_heads,
        head_start,
        stride_s_v,
        stride_h_v,
        src_head_stride_v,
        PAGE_SIZE,
        ROW,
        VEC,
        BLOCK_TOK,
        BLOCK_H,
    )
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d < ROW)[None, :]
    for i in tl.static_range(LP_PER_PROG):
        lp = pid_lp.to(tl.int64) * LP_PER_PROG + i
        if lp < num_lp:
            base = tl.load(lp_offs_v + lp_begin + lp) * VEC
            vals = tl.load(src + lp * src_lp_stride_v * VEC + slot_row[:, None] + d[None, :], mask=mask)
            tl.store(kv_base + base + kv_row[:, None] + d[None, :], vals, mask=mask)


def launch(
    kernel_name: str,
    grid: tuple[int, int, int],
    args: tuple[object, ...],
    constexprs: dict[str, int],
    num_warps: int,
) -> None:
    kernel = gather_kernel if kernel_name == "gather" else scatter_kernel
    kernel[grid](*args, **constexprs, num_warps=num_warps)
