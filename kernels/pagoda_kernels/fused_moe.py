"""Fused mixture of experts: routing, moe_align block padding, grouped expert GEMMs.

1. `route_topk`: per token, softmax over the router logits in float32, top-k (ties go to
   the lower expert id), optional renormalisation of the k weights (Qwen3's norm_topk_prob).
2. `moe_align`: the (token, slot) rows sorted by expert, each expert's run padded to a
   multiple of BLOCK_M with a sentinel, so every BLOCK_M tile of rows has one expert. Small
   kernels without a host sync (sizes come from a static bound), CUDA-graph safe.
3. `grouped_gemm`: C[r] = A[r // top_k] @ B[expert(r)].T (times the routing weight of r),
   one program per (row tile, column tile); tiles past the padded total return at once.
4. `fused_moe`: gate/up GEMM over w13 [E, 2I, H], SiLU-and-mul, down GEMM over w2 [E, H, I]
   weighted by the routing weights, then the k rows of each token summed (`moe_sum`).

Layouts follow `pagoda_daemon.models.qwen3_moe` (w13 holds gate rows then up rows).
Twins: `reference.route_topk_ref`, `reference.grouped_gemm_ref`, `reference.moe_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels._device import cast_to, dot_acc
from pagoda_kernels._utils import cdiv, next_pow2
from pagoda_kernels.activation import silu_and_mul

# ---- routing ------------------------------------------------------------------------------


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, stride_l, stride_w, stride_i, E,
                       TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       RENORMALIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    x = tl.load(logits_ptr + t * stride_l + offs_e, mask=e_mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(e_mask, p, -1.0)  # never picked
    offs_k = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, offs_e, BLOCK_E), 0)
        w = tl.where(offs_k == i, best, w)
        ids = tl.where(offs_k == i, idx, ids)
        p = tl.where(offs_e == idx, -1.0, p)
    if RENORMALIZE:
        w = w / tl.sum(w, 0)
    k_mask = offs_k < TOP_K
    tl.store(weights_ptr + t * stride_w + offs_k, w, mask=k_mask)
    tl.store(ids_ptr + t * stride_i + offs_k, ids, mask=k_mask)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """router_logits [T, E] -> (weights [T, k] float32, ids [T, k] int32)."""
    num_tokens, num_experts = router_logits.shape
    assert router_logits.stride(-1) == 1 and 0 < top_k <= num_experts
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _route_topk_kernel[(num_tokens,)](
            router_logits, weights, ids, router_logits.stride(0), weights.stride(0), ids.stride(0), num_experts,
            TOP_K=top_k, BLOCK_E=next_pow2(num_experts), BLOCK_K=next_pow2(top_k), RENORMALIZE=renormalize,
            num_warps=4 if num_experts > 256 else 1,
        )
    return weights, ids


# ---- alignment ----------------------------------------------------------------------------


@triton.jit
def _local_expert(ids_ptr, offs, n, first_expert, num_experts):
    """The local expert of each row; num_experts for a row another rank computes (or past n)."""
    e = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32) - first_expert
    return tl.where((e >= 0) & (e < num_experts) & (offs < n), e, num_experts)


@triton.jit
def _run_of(ends, positions):
    """The expert run each place of the layout is in: how many runs end at or before it (the
    number of experts when past the last run)."""
    return tl.sum((ends[None, :] <= positions[:, None]).to(tl.int32), axis=1)


# The row counts change with every step's batch: not specialised on (one compiled variant, not
# one per divisibility class of the count).
@triton.jit(do_not_specialize=["n"])
def _moe_count_kernel(ids_ptr, counts_ptr, n, first_expert, num_experts, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    counts = tl.histogram(_local_expert(ids_ptr, offs, n, first_expert, num_experts), BLOCK_E)
    offs_e = tl.arange(0, BLOCK_E)
    tl.atomic_add(counts_ptr + offs_e, counts, mask=(offs_e < num_experts) & (counts > 0))


@triton.jit(do_not_specialize=["n", "max_rows", "max_tiles"])
def _moe_layout_kernel(counts_ptr, cursor_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, n, num_experts,
                       max_rows, max_tiles, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr):
    # every program pads the counts (a few hundred values) and lays out its slice of the tiles;
    # the first also leaves each expert's first place for the placing kernel
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    if tl.program_id(0) == 0:
        tl.store(cursor_ptr + offs_e, ends - padded)
        tl.store(num_padded_ptr, tl.sum(padded, 0))
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(sorted_ids_ptr + rows, tl.full([BLOCK], n, tl.int32), mask=rows < max_rows)  # padding: one past the last row
    tiles = tl.program_id(0) * (BLOCK // BLOCK_M) + tl.arange(0, BLOCK // BLOCK_M)
    tl.store(expert_ids_ptr + tiles, tl.minimum(_run_of(ends, tiles * BLOCK_M), num_experts - 1), mask=tiles < max_tiles)


@triton.jit(do_not_specialize=["n"])
def _moe_place_kernel(ids_ptr, cursor_ptr, sorted_ids_ptr, n, first_expert, num_experts, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = _local_expert(ids_ptr, offs, n, first_expert, num_experts)
    mine = e < num_experts
    place = tl.atomic_add(cursor_ptr + e, 1, mask=mine)
    tl.store(sorted_ids_ptr + place, offs.to(tl.int32), mask=mine)


@triton.jit(do_not_specialize=["n", "max_rows", "max_tiles"])
def _moe_align_small_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, n, first_expert, num_experts,
                            max_rows, max_tiles, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr,
                            ROWS: tl.constexpr, SLOTS: tl.constexpr):
    # Every program counts all n rows (BLOCK >= n) and those before its own ROWS rows, so it
    # knows where each of its rows goes without atomics or another launch: after the rows of its
    # expert in earlier programs, in row order within its own. It also fills its SLOTS places of
    # the layout that are padding and names the expert of its tiles; padding and rows never share
    # a place, so nothing needs ordering between programs.
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    every = _local_expert(ids_ptr, offs, n, first_expert, num_experts)
    offs_e = tl.arange(0, BLOCK_E)
    local = offs_e < num_experts
    counts = tl.where(local, tl.histogram(every, BLOCK_E), 0)
    earlier = tl.where(local, tl.histogram(tl.where(offs < pid * ROWS, every, num_experts), BLOCK_E), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    if pid == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))
    rows = pid * ROWS + tl.arange(0, ROWS)
    e = _local_expert(ids_ptr, rows, n, first_expert, num_experts)
    one_hot = (e[:, None] == offs_e[None, :]).to(tl.int32)  # [ROWS, BLOCK_E]
    rank = tl.sum(tl.cumsum(one_hot, 0) * one_hot, 1) - 1  # among this program's rows of its expert
    place = tl.sum(one_hot * (starts + earlier)[None, :], 1) + rank
    tl.store(sorted_ids_ptr + place, rows.to(tl.int32), mask=e < num_experts)
    slots = pid * SLOTS + tl.arange(0, SLOTS)
    run = _run_of(ends, slots)
    filled_to = tl.sum(tl.where(offs_e[None, :] == run[:, None], (starts + counts)[None, :], 0), 1)
    padding = (run >= num_experts) | (slots >= filled_to)
    tl.store(sorted_ids_ptr + slots, tl.full([SLOTS], n, tl.int32), mask=padding & (slots < max_rows))
    tiles = pid * (SLOTS // BLOCK_M) + tl.arange(0, SLOTS // BLOCK_M)
    tl.store(expert_ids_ptr + tiles, tl.minimum(_run_of(ends, tiles * BLOCK_M), num_experts - 1), mask=tiles < max_tiles)


# Up to this many rows moe_align is one launch (a decode step of 256 sequences at top-8 is 2,048
# rows); past it every program's count of all rows costs more than the three kernels' launches.
SMALL_MAX_ROWS = 4096


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int = 0):
    """Group the (token, slot) rows by expert and pad each expert's run to a multiple of
    block_m. Under expert parallelism this rank holds experts first_expert .. first_expert +
    num_experts - 1: rows routed to any other expert (or with an id of -1) are left out, no
    tile computes them.

    Returns sorted_ids [max_rows] int32 (row r = token * k + slot, padding = T * k),
    expert_ids [max_rows // block_m] int32 (the local expert of each tile; tiles past the end
    hold an arbitrary valid id) and num_rows_padded [1] int32 (the padded total, on the device).
    max_rows is a static bound, (ceil(T*k / block_m) + min(E, T*k)) * block_m, so nothing here
    waits for the device.

    Up to SMALL_MAX_ROWS rows (decode steps) one launch places every row by counting, in each
    program, the rows before it (rows in row order within a run). More rows take three kernels
    (count, lay out, place) and a zeroing of the counts; there rows take their place in a run by
    an atomic counter, so their order within it varies from run to run. No result depends on
    the order (each row of a grouped GEMM is computed on its own). Replacing the torch version (a
    stable sort, scatters, a search: 15 launches per MoE layer), with moe_sum, took a decode step of the
    Qwen3-30B-A3B shape at EP = 2 from 25.0 to 21.4 ms (2 x H100, 2026-11-26).
    """
    flat = topk_ids.flatten()
    n = flat.numel()
    device = flat.device
    max_tiles = cdiv(n, block_m) + min(num_experts, n)
    max_rows = max_tiles * block_m
    block_e = next_pow2(num_experts + 1)  # one bin more: the rows of other ranks' experts
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_tiles, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    if n <= SMALL_MAX_ROWS:
        rows, slots = 32, max(block_m, 64)
        _moe_align_small_kernel[(max(1, cdiv(n, rows), cdiv(max_rows, slots)),)](
            flat, sorted_ids, expert_ids, num_padded, n, first_expert, num_experts, max_rows, max_tiles,
            BLOCK_M=block_m, BLOCK_E=block_e, BLOCK=next_pow2(max(n, 16)), ROWS=rows, SLOTS=slots, num_warps=4)
        return sorted_ids, expert_ids, num_padded
    counts = torch.zeros(block_e, dtype=torch.int32, device=device)
    cursor = torch.empty(block_e, dtype=torch.int32, device=device)
    block, layout_block = 1024, max(block_m, 2048)
    _moe_count_kernel[(max(1, cdiv(n, block)),)](flat, counts, n, first_expert, num_experts, BLOCK_E=block_e, BLOCK=block)
    _moe_layout_kernel[(max(1, cdiv(max_rows, layout_block)),)](
        counts, cursor, sorted_ids, expert_ids, num_padded, n, num_experts, max_rows, max_tiles,
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK=layout_block)
    _moe_place_kernel[(max(1, cdiv(n, block)),)](flat, cursor, sorted_ids, n, first_expert, num_experts, BLOCK=block)
    return sorted_ids, expert_ids, num_padded


# ---- grouped GEMM -------------------------------------------------------------------------


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_rows_padded_ptr,
    N, K, num_rows, num_tiles_m,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    TOP_K: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    IEEE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    # grouped ordering of the tiles so neighbouring programs share B columns in L2
    pid = tl.program_id(0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_rows_padded_ptr):
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m)
    row_mask = rows < num_rows
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (rows // TOP_K).to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:  # no K tail: A masked by row only, B (with no N tail either) not at all
            a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=row_mask[:, None], other=0.0)
            if EVEN_N:
                b = tl.load(b_cols + (k0 + offs_k)[:, None] * stride_bk)
            else:
                b = tl.load(b_cols + (k0 + offs_k)[:, None] * stride_bk, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = (k0 + offs_k) < K
            a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_cols + (k0 + offs_k)[:, None] * stride_bk, mask=k_mask[:, None] & n_mask[None, :],
                        other=0.0)
        acc = dot_acc(a, b, acc, IEEE)
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + rows, mask=row_mask, other=0.0)[:, None]
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             cast_to(acc, c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


# From this many rows per expert (a step's rows over the experts they are routed to) 16-bit GEMMs
# take 128 x 256 tiles: at the Qwen3-30B-A3B shape on an H200 (2026-11-30, one call), the fused
# MoE of a 4,096-token step took 0.89 ms with them against 1.01 with 64 x 128, an 8,192-token
# step 1.54 against 1.91 (vLLM's fused_experts 0.88 and 1.82); at 1,024 tokens (64 rows an
# expert, each expert's run padded to a whole 128-row tile) they gain nothing.
# docs/benchmarks/2026-11-30-moe-prefill-h200.md
LARGE_TILE_ROWS_PER_EXPERT = 256


def _gemm_config(num_rows: int, n: int, k: int, experts: int, dtype: torch.dtype) -> dict:
    """Tiles of the grouped GEMMs for `num_rows` (token, slot) rows spread over `experts`."""
    if num_rows <= 64:  # decode-sized: few rows per expert
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3}
    if dtype != torch.float32 and num_rows >= LARGE_TILE_ROWS_PER_EXPERT * experts:
        return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


def grouped_gemm(a, b, out, sorted_ids, expert_ids, num_rows_padded, top_k: int, block_m: int,
                 topk_weights: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """out [R, N] (R = rows of topk ids) from a [R // top_k, K] and b [E, N, K] (see module doc).

    `block_m` must be the one moe_align padded to.
    """
    num_rows = out.shape[0]
    n, k = b.shape[1], b.shape[2]
    assert a.shape[1] == k and a.stride(-1) == 1 and out.stride(-1) == 1
    cfg = dict(config or _gemm_config(num_rows, n, k, b.shape[0], a.dtype))
    cfg["BLOCK_M"] = block_m
    num_tiles_m = expert_ids.shape[0]
    grid = (num_tiles_m * triton.cdiv(n, cfg["BLOCK_N"]),)
    _grouped_gemm_kernel[grid](
        a, b, out, topk_weights if topk_weights is not None else out, sorted_ids, expert_ids, num_rows_padded,
        n, k, num_rows, num_tiles_m,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        TOP_K=top_k, MUL_WEIGHTS=topk_weights is not None, IEEE=a.dtype == torch.float32,
        EVEN_K=k % cfg["BLOCK_K"] == 0, EVEN_N=n % cfg["BLOCK_N"] == 0, **cfg,
    )
    return out


# ---- the whole MoE ------------------------------------------------------------------------


@triton.jit
def _moe_sum_kernel(down_ptr, ids_ptr, out_ptr, H, stride_it, stride_ik, first_expert, num_experts,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    # out[t] = the sum of token t's k rows in float32, leaving out the rows of other ranks'
    # experts (never written: they may hold anything)
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * stride_it + k * stride_ik + offs_h * 0) - first_expert  # one id, every lane
        mine = h_mask & (e >= 0) & (e < num_experts)
        acc += tl.load(down_ptr + (t * TOP_K + k) * H + offs_h, mask=mine, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs_h, cast_to(acc, out_ptr.dtype.element_ty), mask=h_mask)


def moe_sum(down: torch.Tensor, topk_ids: torch.Tensor, first_expert: int, num_experts: int,
            dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """down [T * k, H] -> [T, H] in dtype (into ``out`` when given, contiguous): each token's k
    rows summed (float32), the rows routed to experts outside first_expert .. first_expert +
    num_experts - 1 left out."""
    num_tokens, top_k = topk_ids.shape
    hidden = down.shape[1]
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=dtype, device=down.device)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype and out.is_contiguous()
    block_h = min(1024, next_pow2(hidden))
    _moe_sum_kernel[(num_tokens, cdiv(hidden, block_h))](
        down, topk_ids, out, hidden, topk_ids.stride(0), topk_ids.stride(1), first_expert, num_experts,
        TOP_K=top_k, BLOCK_H=block_h, num_warps=4)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: dict | None = None, first_expert: int = 0,
              out: torch.Tensor | None = None, global_experts: int | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk weights/ids [T, k] -> [T, H] in x's dtype
    (written into ``out`` when given: the all-reduce's buffer, sparing a copy).
    Under expert parallelism w13/w2 hold experts first_expert .. first_expert + E - 1 and the
    ids are global: a row routed to another expert (or with an id of -1) adds nothing.
    `global_experts` (all ranks' experts; w13's count when not given) sizes the tiles: a step's
    rows spread over all of them."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    rows = num_tokens * top_k
    if num_tokens == 0:
        return torch.empty_like(x) if out is None else out
    cfg = config or _gemm_config(rows, two_inter, hidden, global_experts or num_experts, x.dtype)
    block_m = cfg["BLOCK_M"]
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, block_m, first_expert)
    gate_up = torch.empty((rows, two_inter), dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, gate_up, sorted_ids, expert_ids, num_padded, top_k, block_m, config=cfg)
    # only the rows of this rank's experts: the others' are never read (half or more under EP)
    h = silu_and_mul(gate_up, expert_ids=topk_ids.reshape(-1), first_expert=first_expert, num_experts=num_experts)
    down = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)  # rows left out: never read
    grouped_gemm(h, w2, down, sorted_ids, expert_ids, num_padded, 1, block_m,
                 topk_weights=topk_weights.flatten().float(), config=cfg)
    return moe_sum(down, topk_ids, first_expert, num_experts, x.dtype, out)


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
        renormalize: bool, first_expert: int = 0, config: dict | None = None) -> torch.Tensor:
    """Route and run: the drop-in for `SparseMoE.forward` after the gate matmul. Under expert
    parallelism w13/w2 hold experts first_expert.. only; the tokens routed elsewhere add nothing."""
    weights, ids = route_topk(router_logits, top_k, renormalize)
    return fused_moe(x, w13, w2, weights, ids, config, first_expert, global_experts=router_logits.shape[-1])
