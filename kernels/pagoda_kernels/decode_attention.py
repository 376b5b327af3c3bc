"""Paged decode attention: one query token per sequence over a paged KV cache.

Flash-decoding: the grid is (sequence, KV head, split). Each program takes every query head
of one KV head (GQA/MQA heads packed into the rows of a tensor-core tile), walks its share
of the context in tiles of BLOCK_N tokens (a tile may span pages), and keeps an online
softmax. With one split the program writes the output directly; with several, each writes
its partial output and log-sum-exp and a second kernel combines them.

Head sizes need not be powers of two (64, 80, 96, 128, 256 ...): the head dim is padded to
the next power of two and masked. Sliding window: only the last `sliding_window` positions
are visible. fp8 caches (e4m3, per-tensor k_scale/v_scale) are dequantised on load.
Twin: `reference.paged_attention_ref` with one query per sequence.

CUDA graphs: the launch depends on num_seqs and num_splits only; pass a fixed `num_splits`
when capturing (the kernel accepts any context length with any split count).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels._device import cast_to, dot
from pagoda_kernels._paged import load_paged_tile
from pagoda_kernels._utils import cdiv, is_fp8, next_pow2, num_sms, scale_tensor

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, mid_o_ptr, mid_lse_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_ot, stride_oh,
    stride_ms, stride_mh, stride_mp, stride_ls, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
    IS_FP8: tl.constexpr, IEEE: tl.constexpr, DIRECT_OUT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = 0
    if SLIDING_WINDOW > 0:
        start = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    # Tiles are aligned to absolute positions; split s takes a contiguous run of them.
    first_tile = start // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = first_tile + split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, first_tile + num_tiles)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    k_scale = 1.0
    v_scale = 1.0
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + offs_n
        valid = (pos < seq_len) & (pos >= start)
        k = load_paged_tile(k_cache_ptr, table, pos, valid, head_off, offs_d, d_mask, k_scale,
                            stride_cb, stride_cs, PAGE_SIZE, IS_FP8, q.dtype)
        s = dot(q, tl.trans(k), IEEE) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds a valid position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_paged_tile(v_cache_ptr, table, pos, valid, head_off, offs_d, d_mask, v_scale,
                            stride_cb, stride_cs, PAGE_SIZE, IS_FP8, q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)  # a dot operand: native conversion
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT_OUT:
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 cast_to(out, out_ptr.dtype.element_ty), mask=mask)
    else:
        # partial output and log2-sum-exp of this split; an empty split stores -inf
        mid = seq * stride_ms + heads * stride_mh + split * stride_mp
        tl.store(mid_o_ptr + mid[:, None] + offs_d[None, :], out, mask=mask)
        tl.store(mid_lse_ptr + seq * stride_ls + heads * stride_lh + split,
                 m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    stride_ms, stride_mh, stride_mp, stride_ls, stride_lh,
    stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + seq * stride_ls + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)  # empty splits weigh 0
    o = tl.load(mid_o_ptr + seq * stride_ms + head * stride_mh + offs_s[:, None] * stride_mp + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, cast_to(out, out_ptr.dtype.element_ty),
             mask=d_mask)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                       block_n: int = 64) -> int:
    """Enough programs to fill the device about twice, never fewer than 4 tiles a split.

    (Tried on an H100: ~16 programs per SM helps batch 32 with mixed lengths but costs 2-4
    points at batch 64-256, uniform or mixed; docs/benchmarks/2026-11-21-e2e-h100.md.)
    """
    programs = num_seqs * num_kv_heads
    want = cdiv(2 * num_sms(device), max(1, programs))
    by_len = max(1, cdiv(max_seq_len, 4 * block_n))
    return max(1, min(want, by_len, 32))


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """q [num_seqs, H, D] (token i is sequence i's one new token) over kv_cache
    [2, blocks, page, KVH, D] -> out [num_seqs, H, D] in q's dtype.

    `max_seq_len` (a host int) only feeds the split heuristic when `num_splits` is None.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, _, page, num_kv_heads, cache_dim = kv_cache.shape
    assert cache_dim == head_dim and num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = next_pow2(head_dim)
    block_g = max(16, next_pow2(group))  # tensor-core tiles need 16 rows
    if block_n is None:  # tiles that compile without register spills on sm_90 (checked with cuobjdump)
        if q.dtype == torch.float32:  # IEEE float32 dots run on FMAs and hold more registers
            block_n = 16
        else:
            block_n = 64 if head_dim <= 128 else 32
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_seq_len or 4096, q.device, block_n)
    fp8 = is_fp8(kv_cache.dtype)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # scales are read through pointers only for fp8 caches
    ks, vs = (scale_tensor(k_scale, q.device), scale_tensor(v_scale, q.device)) if fp8 else (seq_lens, seq_lens)
    direct = num_splits == 1
    if direct:
        mid_o = mid_lse = out  # unused
        mstrides = (0, 0, 0, 0, 0)
    else:
        # partial outputs [S, H, splits, BLOCK_D] and their log2-sum-exps [S, H, splits], float32
        mid_o = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        mstrides = (*mid_o.stride()[:3], *mid_lse.stride()[:2])
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, ks, vs,
        out, mid_o, mid_lse,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *mstrides,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE_SIZE=page, BLOCK_N=block_n, SLIDING_WINDOW=sliding_window or 0,
        IS_FP8=fp8, IEEE=q.dtype == torch.float32, DIRECT_OUT=direct,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            mid_o, mid_lse, out,
            *mstrides,
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), HEAD_DIM=head_dim, BLOCK_D=block_d,
            num_warps=4,
        )
    return out

