"""Device-side helpers shared by the paged attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl

from pagoda_kernels._device import cast_to


@triton.jit
def load_paged_tile(cache_ptr, block_table_ptr, pos, valid, head_off, offs_d, d_mask, scale,
                    stride_cb, stride_cs, PAGE_SIZE: tl.constexpr, IS_FP8: tl.constexpr, OUT_DTYPE):
    """Rows `pos` [BLOCK_N] of one KV head of one sequence, [BLOCK_N, BLOCK_D] in OUT_DTYPE.

    `block_table_ptr` points at the sequence's row of the block table; a tile may span pages
    (each row finds its own page). Invalid rows and padded head dims read as zero.
    """
    block = tl.load(block_table_ptr + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    row = block * stride_cb + (pos % PAGE_SIZE) * stride_cs + head_off
    x = tl.load(cache_ptr + row[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
    if IS_FP8:
        x = x.to(tl.float32) * scale
    return cast_to(x, OUT_DTYPE)
