"""Neox-style rotary embedding from a precomputed cos/sin table.

The table is the engine's (`pagoda_daemon.models.layers.RotaryEmbedding`): float32
[max_positions, head_dim], both halves of each row filled (so llama3 and other scalings
live in the table, not here). Casts as the engine does them: the table row to the input
dtype, then x * cos + rotate_half(x) * sin, each product and the sum rounded to that dtype.
Two programs per token, one for its query heads and one for its key heads (at batch 1 a
single program for both was the slowest small kernel of a Llama-8B decode step).
Optionally each head is RMS-normalised first (Qwen3's q/k norm), fused into the same pass.
Twin: `reference.rope_neox_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels._device import cast_to
from pagoda_kernels._utils import next_pow2


@triton.jit
def _rotate(x_ptr, o_ptr, w_ptr, eps, t, stride_xt, stride_xh, stride_ot, stride_oh, c1, s1, c2, s2,
            offs_j, j_mask, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
            NORM: tl.constexpr):
    dtype = x_ptr.dtype.element_ty
    if NORM:
        w1 = tl.load(w_ptr + offs_j, mask=j_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_j, mask=j_mask, other=0.0).to(tl.float32)[None, :]
    for h0 in tl.static_range(0, NUM_HEADS, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < NUM_HEADS)[:, None] & j_mask[None, :]
        src = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_j[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        if NORM:  # the engine's RMSNorm per head: float32 norm, rounded, times the weight, rounded
            var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
            inv = tl.div_rn(1.0, tl.sqrt_rn(var + eps))[:, None]
            x1 = cast_to(w1 * cast_to(x1 * inv, dtype).to(tl.float32), dtype).to(tl.float32)
            x2 = cast_to(w2 * cast_to(x2 * inv, dtype).to(tl.float32), dtype).to(tl.float32)
        # out1 = x1*cos1 + (-x2)*sin1; out2 = x2*cos2 + x1*sin2; every step rounded to dtype
        o1 = cast_to(x1 * c1, dtype).to(tl.float32) + cast_to(-x2 * s1, dtype).to(tl.float32)
        o2 = cast_to(x2 * c2, dtype).to(tl.float32) + cast_to(x1 * s2, dtype).to(tl.float32)
        dst = o_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_j[None, :]
        tl.store(dst, cast_to(o1, o_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, cast_to(o2, o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, q_w_ptr, k_w_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_oqt, stride_oqh, stride_okt, stride_okh, stride_cos,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_H: tl.constexpr, NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    is_key = tl.program_id(1) == 1
    offs_j = tl.arange(0, BLOCK_J)
    j_mask = offs_j < HALF
    dtype = q_ptr.dtype.element_ty
    row = pos * stride_cos + offs_j
    c1 = cast_to(tl.load(cos_ptr + row, mask=j_mask, other=0.0), dtype).to(tl.float32)[None, :]
    s1 = cast_to(tl.load(sin_ptr + row, mask=j_mask, other=0.0), dtype).to(tl.float32)[None, :]
    c2 = cast_to(tl.load(cos_ptr + row + HALF, mask=j_mask, other=0.0), dtype).to(tl.float32)[None, :]
    s2 = cast_to(tl.load(sin_ptr + row + HALF, mask=j_mask, other=0.0), dtype).to(tl.float32)[None, :]
    if is_key:
        _rotate(k_ptr, k_out_ptr, k_w_ptr, eps, t, stride_kt, stride_kh, stride_okt, stride_okh, c1, s1, c2, s2,
                offs_j, j_mask, NUM_K_HEADS, BLOCK_H, HALF, NORM)
    else:
        _rotate(q_ptr, q_out_ptr, q_w_ptr, eps, t, stride_qt, stride_qh, stride_oqt, stride_oqh, c1, s1, c2, s2,
                offs_j, j_mask, NUM_Q_HEADS, BLOCK_H, HALF, NORM)


def rope_neox(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
              q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
              eps: float = 1e-6):
    """positions [T] (int), q [T, H, D], k [T, KVH, D], cos/sin [P, D] -> (q', k').

    Pass q_out=q, k_out=k to rotate in place (each element is read before it is written).
    With q_norm_weight and k_norm_weight [D] (Qwen3's q/k norm), every head is first
    RMS-normalised as the engine's RMSNorm does it: one launch instead of a norm per tensor
    (and the copies a norm of a strided view costs) and then the rotation.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert head_dim % 2 == 0 and cos.shape[-1] == head_dim and sin.stride() == cos.stride()
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1
    norm = q_norm_weight is not None
    assert norm == (k_norm_weight is not None), "q and k are normalised together or not at all"
    if norm:
        assert q_norm_weight.shape == k_norm_weight.shape == (head_dim,)
        assert q_norm_weight.dtype == k_norm_weight.dtype == q.dtype == k.dtype, "the norm's output is q's dtype"
        assert q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()
    q_out = torch.empty_like(q) if q_out is None else q_out
    k_out = torch.empty_like(k) if k_out is None else k_out
    if num_tokens:
        half = head_dim // 2
        block_j = next_pow2(half)
        block_h = min(next_pow2(max(num_q_heads, num_k_heads)), max(1, 2048 // block_j))
        _rope_kernel[(num_tokens, 2)](  # per token: one program for the query heads, one for the keys
            positions, q, k, cos, sin, q_out, k_out,
            q_norm_weight if norm else cos, k_norm_weight if norm else cos, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=half, BLOCK_J=block_j, BLOCK_H=block_h,
            NORM=norm, num_warps=4,
        )
    return q_out, k_out
