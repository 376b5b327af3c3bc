"""Paged decode attention: one query token per sequence over a paged KV cache.

Flash-decoding with a work plan. Each sequence's context is cut into even chunks of
BLOCK_N-token tiles (a tile may span pages), no longer than a bound the whole step's work
sets (see WORK_PER_SM and LONG_CHUNK_TILES), and every (chunk, KV head) is one program, so
a few long sequences among many short ones (what a serving batch looks like) still spread
evenly over the SMs. A program takes every query head of its KV head (GQA/MQA
heads packed into the rows of a tensor-core tile) and keeps an online softmax over its
chunk. A sequence with one chunk writes its output directly; otherwise each chunk writes
a partial output and log-sum-exp, counts itself in the (sequence, KV head)'s arrivals, and
the last to arrive combines the partials (no second kernel: a combine launch over every
(sequence, head) was 0.65 ms of a 15.2 ms EP = 2 decode step at the Qwen3-30B-A3B shape on
2 x H200, 2026-11-28).

`plan_decode` computes the plan on the device from seq_lens (one small kernel, no host
sync), so a CUDA graph captures it with the attention kernels and replays it with the
lengths of the step; the launch grid depends on the number of sequences only.

Head sizes need not be powers of two (64, 80, 96, 128, 256 ...): the head dim is padded to
the next power of two and masked. Sliding window: only the last `sliding_window` positions
are visible (the plan ignores the window; chunks wholly outside it return empty). fp8
caches (e4m3, per-tensor k_scale/v_scale) are dequantised on load.
Twin: `reference.paged_attention_ref` with one query per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from pagoda_kernels._device import cast_to, dot
from pagoda_kernels._paged import load_paged_tile
from pagoda_kernels._utils import aligned_buffers, cdiv, is_fp8, next_pow2, num_sms, scale_tensor

LOG2E = 1.4426950408889634
# A chunk holds at most 1/WORK_PER_SM of one SM's share of the step's tiles (so the tail
# after the last wave is short) and at least MIN_CHUNK_TILES tiles (so a chunk's fixed
# costs, loading q and combining partial results, stay small against its reads).
WORK_PER_SM = 16
MIN_CHUNK_TILES = 2
# Short chunks cost: each program pays a prologue (lookups, the first loads) and a partial
# result to combine. When the step has work enough for LONG_CHUNK_PROGRAMS_PER_SM programs
# of LONG_CHUNK_TILES tiles on every SM, chunks are at least that long (an H200 at batch 64
# x 4,096 tokens: 0.97 of the copy rate in one chunk a sequence, 0.86 in 16-tile chunks).
LONG_CHUNK_TILES = 32
LONG_CHUNK_PROGRAMS_PER_SM = 4
# The plan kernel reads every sequence length in one block of at least this many lanes: one
# compiled variant for any batch up to it (engines run at most 256 sequences by default).
PLAN_MIN_BLOCK = 256


@dataclass
class DecodePlan:
    """Where each sequence's chunks sit in the flat work list, on the device.

    num_chunks[s]: chunks of sequence s; chunk_ends[s]: inclusive prefix sum of num_chunks
    (sequence s owns work items chunk_ends[s] - num_chunks[s] .. chunk_ends[s] - 1);
    chunk_tiles[s]: tiles per chunk of sequence s (its tiles spread evenly over its chunks);
    work_items[w]: sequence << 16 | chunk << 1 | (1 if the sequence has one chunk), valid
    below chunk_ends[-1] (one load tells a program what to do). max_work bounds the work
    items for any lengths (the grid width). arrivals[s * KVH + h]: the chunks of (s, h) done in
    the layer running now; the plan kernel zeroes them, the combining chunk resets them.
    """

    num_chunks: torch.Tensor  # [S] int32
    chunk_ends: torch.Tensor  # [S] int32
    chunk_tiles: torch.Tensor  # [S] int32
    work_items: torch.Tensor  # [max_work] int32
    arrivals: torch.Tensor  # [S * KVH] int32
    num_seqs: int
    max_work: int
    block_n: int
    num_kv_heads: int
    # partial outputs [max_work, H, BLOCK_D] and log2-sum-exps [max_work, H] (float32), made by
    # the step's first layer and reused by the others (two allocations a step, not a layer)
    scratch: dict = field(default_factory=dict, repr=False)

    def partials(self, num_heads: int, block_d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (num_heads, block_d)
        if key not in self.scratch:
            self.scratch[key] = (
                torch.empty((self.max_work, num_heads, block_d), dtype=torch.float32, device=device),
                torch.empty((self.max_work, num_heads), dtype=torch.float32, device=device),
            )
        return self.scratch[key]


# Integer arguments that change from step to step are not specialised (1 / multiple of 16 /
# other would be three compiled variants, the later ones compiled while serving).
@triton.jit(do_not_specialize=["num_seqs", "programs", "long_work"])
def _decode_plan_kernel(seq_lens_ptr, num_chunks_ptr, chunk_ends_ptr, chunk_tiles_ptr, work_items_ptr,
                        arrivals_ptr, num_seqs, programs, long_work,
                        NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
                        LONG_TILES: tl.constexpr, BLOCK_S: tl.constexpr):
    offs = tl.arange(0, BLOCK_S)
    mask = offs < num_seqs
    lens = tl.load(seq_lens_ptr + offs, mask=mask, other=0)
    tiles = (lens + BLOCK_N - 1) // BLOCK_N
    total = tl.sum(tiles, 0) * NUM_KV_HEADS
    chunk = tl.maximum((total + programs - 1) // programs, MIN_TILES)  # the largest chunk allowed
    if total >= long_work:
        chunk = tl.maximum(chunk, LONG_TILES)
    n = (tiles + chunk - 1) // chunk
    ends = tl.cumsum(n, 0)
    tl.store(num_chunks_ptr + offs, n, mask=mask)
    tl.store(chunk_ends_ptr + offs, ends, mask=mask)
    tl.store(chunk_tiles_ptr + offs, (tiles + n - 1) // tl.maximum(n, 1), mask=mask)
    item = (offs << 16) | (n == 1).to(tl.int32)
    for c in range(0, tl.max(n, 0)):
        tl.store(work_items_ptr + ends - n + c, item | (c << 1), mask=mask & (c < n))
    for h in tl.static_range(NUM_KV_HEADS):
        tl.store(arrivals_ptr + offs * NUM_KV_HEADS + h, tl.zeros([BLOCK_S], tl.int32), mask=mask)


def plan_decode(seq_lens: torch.Tensor, num_kv_heads: int, block_n: int,
                work_per_sm: int = WORK_PER_SM, min_chunk_tiles: int = MIN_CHUNK_TILES) -> DecodePlan:
    """The work plan of one decode step (shared by every layer of the step)."""
    num_seqs = seq_lens.shape[0]
    sms = num_sms(seq_lens.device)
    # sum(cdiv(tiles_s, chunk)) <= S + total / chunk, and chunk >= total * KVH / programs;
    # max_work is a grid dimension of the chunk kernel (at most 65,535)
    programs = min(work_per_sm * sms, (65535 - num_seqs) * num_kv_heads)
    max_work = num_seqs + cdiv(programs, num_kv_heads)
    assert num_seqs < 1 << 15, "work items hold the sequence index in 15 bits"
    assert programs > 0
    bufs = aligned_buffers([num_seqs] * 3 + [max_work, num_seqs * num_kv_heads], torch.int32, seq_lens.device)
    plan = DecodePlan(*bufs, num_seqs, max_work, block_n, num_kv_heads)
    if num_seqs:
        _decode_plan_kernel[(1,)](seq_lens, plan.num_chunks, plan.chunk_ends, plan.chunk_tiles, plan.work_items,
                                  plan.arrivals, num_seqs, programs, LONG_CHUNK_TILES * LONG_CHUNK_PROGRAMS_PER_SM * sms,
                                  NUM_KV_HEADS=num_kv_heads, BLOCK_N=block_n, MIN_TILES=min_chunk_tiles,
                                  LONG_TILES=LONG_CHUNK_TILES,
                                  BLOCK_S=max(PLAN_MIN_BLOCK, next_pow2(num_seqs)))
    return plan


@triton.jit
def _load_partial(mid_o_ptr, mid_lse_ptr, work, end, heads, offs_d, mask, g_mask, stride_mw, stride_mh, stride_lw):
    """One chunk's log2-sum-exps and partial output (-inf and 0 past the sequence's last chunk),
    read past L1 (.cg): its lines may hold an earlier layer's partials."""
    ok = g_mask & (heads * 0 + work < end)
    lse = tl.load(mid_lse_ptr + work * stride_lw + heads, mask=ok, other=float("-inf"), cache_modifier=".cg")
    part = tl.load(mid_o_ptr + work * stride_mw + heads[:, None] * stride_mh + offs_d[None, :], mask=mask & ok[:, None],
                   other=0.0, cache_modifier=".cg")
    return lse, part


@triton.jit(do_not_specialize=["num_seqs"])  # the block-table stride is fixed per engine: specialised
def _decode_chunk_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
    num_chunks_ptr, chunk_ends_ptr, chunk_tiles_ptr, work_items_ptr, arrivals_ptr,
    out_ptr, mid_o_ptr, mid_lse_ptr,
    num_seqs, scale_log2,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_ot, stride_oh,
    stride_mw, stride_mh, stride_lw,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
    IS_FP8: tl.constexpr, IEEE: tl.constexpr,
):
    # KV heads on the fastest grid axis: the step's work items start first and the padding
    # programs past them (the grid is sized for the worst case) queue behind, not between.
    kv_head = tl.program_id(0)
    work = tl.program_id(1)
    num_work = tl.load(chunk_ends_ptr + num_seqs - 1)
    item = tl.load(work_items_ptr + work)
    if work >= num_work:
        return  # past the step's work: the grid is sized for the worst case
    seq = item >> 16
    chunk = (item >> 1) & 0x7FFF
    chunk_tiles = tl.load(chunk_tiles_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    tile_lo = chunk * chunk_tiles
    tile_hi = tl.minimum(tile_lo + chunk_tiles, tl.cdiv(seq_len, BLOCK_N))
    start = 0
    if SLIDING_WINDOW > 0:
        start = tl.maximum(seq_len - SLIDING_WINDOW, 0)
        tile_lo = tl.maximum(tile_lo, start // BLOCK_N)  # may leave the chunk empty

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
    if (item & 1) == 1:  # the sequence's only chunk
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 cast_to(out, out_ptr.dtype.element_ty), mask=mask)
    else:
        # partial output and log2-sum-exp of this chunk; an empty chunk stores -inf
        tl.store(mid_o_ptr + work * stride_mw + heads[:, None] * stride_mh + offs_d[None, :], out, mask=mask)
        tl.store(mid_lse_ptr + work * stride_lw + heads, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=g_mask)
        tl.debug_barrier()  # every thread's part stored before the program counts as arrived
        n_chunks = tl.load(num_chunks_ptr + seq)
        counter = arrivals_ptr + seq * NUM_KV_HEADS + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_chunks - 1:
            # the last chunk of (sequence, KV head) to finish: every partial is in place
            tl.store(counter, 0)  # for the next layer, which shares the plan
            first = tl.load(chunk_ends_ptr + seq) - n_chunks
            m = tl.full([BLOCK_G], float("-inf"), tl.float32)
            total = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            end = first + n_chunks
            for c in range(first, end, 4):  # four chunks' loads in flight at once
                lse0, part0 = _load_partial(mid_o_ptr, mid_lse_ptr, c, end, heads, offs_d, mask, g_mask,
                                            stride_mw, stride_mh, stride_lw)
                lse1, part1 = _load_partial(mid_o_ptr, mid_lse_ptr, c + 1, end, heads, offs_d, mask, g_mask,
                                            stride_mw, stride_mh, stride_lw)
                lse2, part2 = _load_partial(mid_o_ptr, mid_lse_ptr, c + 2, end, heads, offs_d, mask, g_mask,
                                            stride_mw, stride_mh, stride_lw)
                lse3, part3 = _load_partial(mid_o_ptr, mid_lse_ptr, c + 3, end, heads, offs_d, mask, g_mask,
                                            stride_mw, stride_mh, stride_lw)
                m_new = tl.maximum(tl.maximum(m, tl.maximum(lse0, lse1)), tl.maximum(lse2, lse3))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # only empty chunks so far
                alpha = tl.exp2(m - m_safe)
                w0, w1, w2, w3 = tl.exp2(lse0 - m_safe), tl.exp2(lse1 - m_safe), tl.exp2(lse2 - m_safe), tl.exp2(lse3 - m_safe)
                acc = (acc * alpha[:, None] + w0[:, None] * part0 + w1[:, None] * part1 + w2[:, None] * part2
                       + w3[:, None] * part3)  # empty chunks (and those past the end) weigh 0
                total = total * alpha + w0 + w1 + w2 + w3
                m = m_new
            tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                     cast_to(acc / tl.where(total == 0.0, 1.0, total)[:, None], out_ptr.dtype.element_ty), mask=mask)


def decode_block_n(head_dim: int, dtype: torch.dtype) -> int:
    """KV tile length that compiles without register spills on sm_90 (checked with cuobjdump)."""
    if dtype == torch.float32:  # IEEE float32 dots run on FMAs and hold more registers
        return 16
    return 64 if head_dim <= 128 else 32


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    plan: DecodePlan | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """q [num_seqs, H, D] (token i is sequence i's one new token) over kv_cache
    [2, blocks, page, KVH, D] -> out [num_seqs, H, D] in q's dtype.

    Pass the step's `plan` (from `plan_decode` with the same block_n) to share it between
    layers; without it one is made here.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, _, page, num_kv_heads, cache_dim = kv_cache.shape
    assert cache_dim == head_dim and num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    block_n = block_n or decode_block_n(head_dim, q.dtype)
    if plan is None:
        plan = plan_decode(seq_lens, num_kv_heads, block_n)
    assert plan.block_n == block_n and plan.num_seqs == num_seqs and plan.num_kv_heads == num_kv_heads
    group = num_heads // num_kv_heads
    block_d = next_pow2(head_dim)
    fp8 = is_fp8(kv_cache.dtype)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # scales are read through pointers only for fp8 caches
    ks, vs = (scale_tensor(k_scale, q.device), scale_tensor(v_scale, q.device)) if fp8 else (seq_lens, seq_lens)
    mid_o, mid_lse = plan.partials(num_heads, block_d, q.device)
    mstrides = (mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0))
    _decode_chunk_kernel[(num_kv_heads, plan.max_work)](
        q, k_cache, v_cache, block_tables, seq_lens, ks, vs,
        plan.num_chunks, plan.chunk_ends, plan.chunk_tiles, plan.work_items, plan.arrivals,
        out, mid_o, mid_lse,
        num_seqs, scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *mstrides,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_G=max(16, next_pow2(group)),  # tensor-core tiles need 16 rows
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=page, BLOCK_N=block_n, SLIDING_WINDOW=sliding_window or 0,
        IS_FP8=fp8, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
