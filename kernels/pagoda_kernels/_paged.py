"""Device-side helpers shared by the paged attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_paged_tile(cache_ptr, block_table_ptr, pos, valid, head_off, offs_d, d_mask, scale,
                    stride_cb, stride_cs, PAGE_SIZE: tl.constexpr, IS_FP8: tl.constexpr, OUT_DTYPE,
                    MASKED: tl.constexpr = True):
    """Rows `pos` [BLOCK_N] of one KV head of one sequence, [BLOCK_N, BLOCK_D] in OUT_DTYPE.

    `block_table_ptr` points at the sequence's row of the block table; a tile may span pages
    (each row finds its own page). Invalid rows and padded head dims read as zero. MASKED
    False: the caller knows every row valid and the head dim a power of two (plain loads).
    """
    if MASKED:
        block = tl.load(block_table_ptr + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_cb + (pos % PAGE_SIZE) * stride_cs + head_off
        x = tl.load(cache_ptr + row[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
    else:
        block = tl.load(block_table_ptr + pos // PAGE_SIZE).to(tl.int64)
        row = block * stride_cb + (pos % PAGE_SIZE) * stride_cs + head_off
        x = tl.load(cache_ptr + row[:, None] + offs_d[None, :])
    if IS_FP8:
        x = x.to(tl.float32) * scale
    # A dot operand: the hardware conversion (round to nearest even) is exact here, and a
    # no-op when the cache already holds OUT_DTYPE (cast_to's integer rounding is for values
    # converted back to float32, which Triton may fold; it would cost ALU in the inner loop).
    return x.to(OUT_DTYPE)
