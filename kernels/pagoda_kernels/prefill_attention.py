"""Paged prefill/extend attention: variable-length queries over a paged KV cache.

Sequence i brings q_len new tokens (query_start_loc) that are the last q_len of its
seq_lens[i] positions, so a chunked prefill or a prefix-cache hit attends to the cached
prefix and causally to itself. Decode rows (q_len 1) mixed into the batch are fine too.

The grid is (sequence, KV head, query tile), the last query tiles (most causal work)
launched first; programs past a sequence's q_len return at once. A query tile is BLOCK_M
rows: BLOCK_M // GROUP tokens times the GROUP query heads that share the KV head (GQA heads
packed into the rows of the tensor-core tile, as decode does), so each K/V tile is loaded
once for all of them. Each program walks KV tiles of BLOCK_N: first the tiles every row of
its query tile sees in full (no mask), then the diagonal tiles under the causal mask (with
a sliding window every tile is masked). Head dims are padded to a power of two and masked.

`varlen_attention` is the same kernel over the step's fresh K/V laid end to end (no
cache): what a prefill-only step or the memory-profiling pass needs. Not ``causal``, every
query sees its whole sequence (an encoder's attention): every KV tile but a sequence's last,
partial one runs unmasked.
Twins: `reference.paged_attention_ref`, `reference.varlen_attention_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels._device import cast_to, dot, dot_acc
from pagoda_kernels._paged import load_paged_tile
from pagoda_kernels._utils import is_fp8, next_pow2, scale_tensor

LOG2E = 1.4426950408889634


@triton.jit
def _load_kv(k_ptr, v_ptr, table, pos, valid, head_off, offs_d, d_mask, k_scale, v_scale, q_start,
             stride_kt, stride_vt, stride_cb, stride_cs,
             PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, IS_FP8: tl.constexpr, DTYPE, MASKED: tl.constexpr):
    """MASKED False: every row valid and the head dim a power of two, so plain loads."""
    if PAGED:
        k = load_paged_tile(k_ptr, table, pos, valid, head_off, offs_d, d_mask, k_scale,
                            stride_cb, stride_cs, PAGE_SIZE, IS_FP8, DTYPE, MASKED)
        v = load_paged_tile(v_ptr, table, pos, valid, head_off, offs_d, d_mask, v_scale,
                            stride_cb, stride_cs, PAGE_SIZE, IS_FP8, DTYPE, MASKED)
    else:
        rows = (q_start + pos).to(tl.int64)
        if MASKED:
            mask = valid[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + rows[:, None] * stride_kt + head_off + offs_d[None, :], mask=mask, other=0.0)
            v = tl.load(v_ptr + rows[:, None] * stride_vt + head_off + offs_d[None, :], mask=mask, other=0.0)
        else:
            k = tl.load(k_ptr + rows[:, None] * stride_kt + head_off + offs_d[None, :])
            v = tl.load(v_ptr + rows[:, None] * stride_vt + head_off + offs_d[None, :])
    return k.to(DTYPE), v.to(DTYPE)  # dot operands: see load_paged_tile


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, q_pos, lo, hi, seq_len,
                  k_ptr, v_ptr, table, head_off, offs_n, offs_d, d_mask, k_scale, v_scale, q_start,
                  scale_log2, stride_kt, stride_vt, stride_cb, stride_cs,
                  MASKED: tl.constexpr, SLIDING_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
                  PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, IS_FP8: tl.constexpr, IEEE: tl.constexpr,
                  PLAIN_LOADS: tl.constexpr, CAUSAL: tl.constexpr):
    """MASKED False: tiles every row sees in full (each score finite); PLAIN_LOADS: and the
    head dim a power of two, so K/V load without masks. CAUSAL False: MASKED masks only the
    positions past the sequence."""
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < seq_len
        k, v = _load_kv(k_ptr, v_ptr, table, pos, valid, head_off, offs_d, d_mask, k_scale, v_scale, q_start,
                        stride_kt, stride_vt, stride_cb, stride_cs, PAGED, PAGE_SIZE, IS_FP8, q.dtype,
                        not PLAIN_LOADS)
        s = dot(q, tl.trans(k), IEEE)  # unscaled: the scale folds into the exponent's FMA
        if MASKED:
            if CAUSAL:
                keep = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            else:
                keep = valid[None, :] & (q_pos[:, None] >= 0)  # every row, the tile's columns in the sequence
            if SLIDING_WINDOW > 0:
                keep = keep & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        m_safe = m_new
        if MASKED:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s * scale_log2 - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], IEEE)  # a dot operand: native conversion
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_cb, stride_cs, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, PAGED: tl.constexpr, IS_FP8: tl.constexpr, IEEE: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Blocks start in launch order, the last grid axis slowest: the query tiles with the most
    # causal work go first, so the short ones fill in the end of the kernel (with few heads
    # the other order leaves the SMs idle behind a last wave of long tiles).
    m_tile = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * TILE_TOKENS >= q_len:
        return
    if PAGED:
        seq_len = tl.load(seq_lens_ptr + seq)
    else:
        seq_len = q_len
    ctx = seq_len - q_len

    # row r: token r // GROUP of the tile, query head r % GROUP of the KV head (rows past
    # TILE_TOKENS * GROUP, when GROUP is not a power of two, are padding)
    rows = tl.arange(0, BLOCK_M)
    offs_m = m_tile * TILE_TOKENS + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = (offs_m < q_len) & (rows < TILE_TOKENS * GROUP)
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx + offs_m
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    k_scale = 1.0
    v_scale = 1.0
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_kh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first_q = ctx + m_tile * TILE_TOKENS
    hi = tl.minimum(seq_len, first_q + TILE_TOKENS)  # past the tile's last query: invisible
    if CAUSAL and SLIDING_WINDOW > 0:
        lo = tl.maximum(first_q - SLIDING_WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, lo, hi, seq_len, k_ptr, v_ptr, table, head_off, offs_n, offs_d, d_mask,
            k_scale, v_scale, q_start, scale_log2, stride_kt, stride_vt, stride_cb, stride_cs,
            True, SLIDING_WINDOW, BLOCK_N, PAGED, PAGE_SIZE, IS_FP8, IEEE, False, True)
    else:
        # unmasked tiles first, then the masked rest: for a causal tile the tiles below every
        # row's diagonal, then up to it; for a bidirectional one the whole sequence, the last
        # partial tile masked by validity (no cached context there)
        if CAUSAL:
            full = first_q // BLOCK_N * BLOCK_N
            end = hi
        else:
            full = seq_len // BLOCK_N * BLOCK_N
            end = seq_len
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, 0, full, seq_len, k_ptr, v_ptr, table, head_off, offs_n, offs_d, d_mask,
            k_scale, v_scale, q_start, scale_log2, stride_kt, stride_vt, stride_cb, stride_cs,
            False, 0, BLOCK_N, PAGED, PAGE_SIZE, IS_FP8, IEEE, HEAD_DIM == BLOCK_D, CAUSAL)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, full, end, seq_len, k_ptr, v_ptr, table, head_off, offs_n, offs_d, d_mask,
            k_scale, v_scale, q_start, scale_log2, stride_kt, stride_vt, stride_cb, stride_cs,
            True, 0, BLOCK_N, PAGED, PAGE_SIZE, IS_FP8, IEEE, False, CAUSAL)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             cast_to(out, out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _blocks(head_dim: int, group: int, dtype: torch.dtype, block_m: int | None, block_n: int | None,
            num_warps: int | None, num_stages: int | None, paged: bool) -> tuple[int, int, int, int]:
    """Tile rows (tokens x the `group` query heads of a KV head; at least one token's), tile
    columns, warps and pipeline stages that compile without register spills on sm_90.

    16-bit paged: 128 x 64 tiles, 4 warps, 3 stages (an H100 sweep, 4,096 tokens, 16 and 32 query
    heads over 8 KV heads: 354 and 367 TFLOP/s against 320 and 330 for 64 x 64 with 4 warps, 334
    and 349 for 256 x 64 with 8; docs/benchmarks/2026-11-27-prefill-heavy-profile-h100.md).
    16-bit contiguous: 64 x 64, 4 warps, 3 stages (H100 sweeps of the 16-head case in two calls:
    384 and 361 TFLOP/s against 356 and 340 for 128 x 64 with 8 warps; 249 with 4).
    """
    stages, warps = 2, None
    if dtype == torch.float32:  # IEEE float32 dots run on FMAs; some spilling remains (a correctness path)
        m, n = (32, 16) if head_dim <= 128 else (64, 32)
    elif head_dim > 128:
        m, n = 64, 32
    elif paged:
        m, n, stages, warps = 128, 64, 3, 4
    else:
        m, n, stages = 64, 64, 3
    block_m = max(block_m or m, next_pow2(group))
    if num_warps is None:  # a [BLOCK_M, head dim] float32 accumulator needs 8 warps from 128 x 128 on
        num_warps = warps or (8 if block_m * next_pow2(head_dim) >= 128 * 128 else 4)
    return block_m, block_n or n, num_warps, num_stages or stages


def _launch(q, k, v, block_tables, query_start_loc, seq_lens, scale, sliding_window, k_scale, v_scale,
            max_query_len, out, block_m, block_n, num_warps, num_stages, paged, page, fp8,
            stride_k, stride_v, causal=True):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = _blocks(head_dim, group, q.dtype, block_m, block_n, num_warps,
                                                      num_stages, paged)
    tile_tokens = block_m // group
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, tile_tokens))
    _prefill_kernel[grid](
        q, k, v, block_tables, query_start_loc, seq_lens,
        *((scale_tensor(k_scale, q.device), scale_tensor(v_scale, q.device)) if fp8 else (query_start_loc,) * 2),
        out, scale * LOG2E,
        q.stride(0), q.stride(1), stride_k[0], stride_k[1], stride_v[0],
        stride_k[2], stride_k[3],
        # one value per engine (its block-table width; 0 without a cache) so that every step
        # runs the variant the warm-up compiled (Triton specialises integers: 1, % 16, other)
        block_tables.stride(0) if paged else 0,
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        BLOCK_M=block_m, TILE_TOKENS=tile_tokens, BLOCK_N=block_n, PAGE_SIZE=page,
        SLIDING_WINDOW=sliding_window or 0, PAGED=paged, IS_FP8=fp8, IEEE=q.dtype == torch.float32,
        CAUSAL=causal, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] over kv_cache [2, blocks, page, KVH, D] (already holding this step's K/V).

    `max_query_len` (a host int) sizes the grid; without it the wrapper syncs to find it.
    """
    if out is None:
        out = torch.empty_like(q)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert kv_cache.shape[-1] == q.shape[-1] and kv_cache.stride(-1) == 1
    return _launch(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
                   k_scale, v_scale, max_query_len, out, block_m, block_n, num_warps, num_stages,
                   True, kv_cache.shape[2], is_fp8(kv_cache.dtype),
                   (0, k_cache.stride(2), k_cache.stride(0), k_cache.stride(1)), (0,))


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Causal (or, not ``causal``, bidirectional) attention within each sequence of fresh tokens:
    q [T, H, D], k/v [T, KVH, D]."""
    assert causal or not sliding_window, "a sliding window is causal"
    if out is None:
        out = torch.empty_like(q)
    dummy = query_start_loc  # no block table, no seq_lens: never read when not paged
    return _launch(q, k, v, dummy.view(1, -1), query_start_loc, dummy, scale, sliding_window,
                   None, None, max_query_len, out, block_m, block_n, num_warps, num_stages,
                   False, 1, False, (k.stride(0), k.stride(1), 0, 0), (v.stride(0),), causal)
