"""Cache write: the step's K/V into their paged-cache slots, quantised when the cache is fp8.

Cache layout (one layer): [2, num_blocks, block_size, num_kv_heads, head_dim]; token t goes
to slot slot_mapping[t] = block * block_size + offset. Negative slots are padding and are
skipped. Twin: `reference.write_kv_cache_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels._device import cast_to, round_to_fp8_grid
from pagoda_kernels._utils import fp8_params, is_fp8, next_pow2, scale_tensor


@triton.jit
def _cache_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_MANT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if IS_FP8:
        k = round_to_fp8_grid(tl.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)), FP8_MAX, FP8_MIN_NORMAL, FP8_MANT)
        v = round_to_fp8_grid(tl.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), FP8_MAX, FP8_MIN_NORMAL, FP8_MANT)
    tl.store(k_cache_ptr + dst, cast_to(k, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, cast_to(v, v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float | torch.Tensor | None = None,
                   v_scale: float | torch.Tensor | None = None) -> None:
    """k, v [T, KVH, D] (any strides with a contiguous last dim) into kv_cache at slot_mapping."""
    num_tokens, num_heads, head_dim = k.shape
    assert kv_cache.shape[0] == 2 and kv_cache.shape[3:] == (num_heads, head_dim), kv_cache.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    fp8 = is_fp8(kv_cache.dtype)
    fmax, fmin, mant = fp8_params(kv_cache.dtype) if fp8 else (0.0, 0.0, 0)
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_heads), max(1, 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _cache_write_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        *((scale_tensor(k_scale, k.device), scale_tensor(v_scale, k.device)) if fp8 else (slot_mapping,) * 2),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        PAGE_SIZE=kv_cache.shape[2], IS_FP8=fp8,
        FP8_MAX=fmax, FP8_MIN_NORMAL=fmin, FP8_MANT=mant,
        num_warps=4,
    )
