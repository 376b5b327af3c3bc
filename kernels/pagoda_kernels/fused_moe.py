"""Fused mixture of experts: routing, moe_align block padding, grouped expert GEMMs.

1. `route_topk`: per token, softmax over the router logits in float32, top-k (ties go to
   the lower expert id), optional renormalisation of the k weights (Qwen3's norm_topk_prob).
2. `moe_align`: the (token, slot) rows sorted by expert, each expert's run padded to a
   multiple of BLOCK_M with a sentinel, so every BLOCK_M tile of rows has one expert. Plain
   torch ops without a host sync (sizes come from a static bound), CUDA-graph safe.
3. `grouped_gemm`: C[r] = A[r // top_k] @ B[expert(r)].T (times the routing weight of r),
   one program per (row tile, column tile); tiles past the padded total return at once.
4. `fused_moe`: gate/up GEMM over w13 [E, 2I, H], SiLU-and-mul, down GEMM over w2 [E, H, I]
   weighted by the routing weights, then the k rows of each token summed.

Layouts follow `pagoda_daemon.models.qwen3_moe` (w13 holds gate rows then up rows).
Twins: `reference.route_topk_ref`, `reference.grouped_gemm_ref`, `reference.moe_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels._device import cast_to, dot
from pagoda_kernels._utils import cdiv, next_pow2
from pagoda_kernels.activation import silu_and_mul
from pagoda_kernels.reference import local_expert_ids

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


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, skip_negative: bool = False):
    """Sort (token, slot) rows by expert and pad each expert's run to a multiple of block_m.
    With skip_negative, rows whose id is -1 (an expert another expert-parallel rank holds) are
    left out: no tile computes them.

    Returns sorted_ids [max_rows] int32 (row r = token * k + slot, padding = T * k),
    expert_ids [max_rows // block_m] int32 (the expert of each tile; tiles past the end hold
    an arbitrary valid id) and num_rows_padded [1] int32 (the padded total, on the device).
    max_rows is a static bound, (ceil(T*k / block_m) + min(E, T*k)) * block_m, so nothing
    here waits for the device.
    """
    flat = topk_ids.flatten().long()
    n = flat.numel()
    device = flat.device
    # Skipped rows go to a bucket of their own past the last expert, and their places to one
    # slot past the end that is cut off.
    buckets = num_experts + 1 if skip_negative else num_experts
    if skip_negative:
        flat = torch.where(flat < 0, num_experts, flat)
    counts = torch.zeros(buckets, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    max_tiles = cdiv(n, block_m) + min(num_experts, n)
    if skip_negative:
        padded.narrow(0, num_experts, 1).zero_()  # on the device: a host scalar cannot enter a CUDA graph
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices
    sorted_experts = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    rank = torch.arange(n, device=device) - first_of_expert[sorted_experts]
    places = starts[sorted_experts] + rank
    if skip_negative:
        places = torch.where(sorted_experts == num_experts, max_tiles * block_m, places)
        ends = ends[:num_experts]
    sorted_ids = torch.full((max_tiles * block_m + int(skip_negative),), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, places, order.to(torch.int32))
    sorted_ids = sorted_ids[: max_tiles * block_m]
    tile_starts = torch.arange(max_tiles, device=device) * block_m
    expert_ids = torch.searchsorted(ends, tile_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


# ---- grouped GEMM -------------------------------------------------------------------------


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_rows_padded_ptr,
    N, K, num_rows, num_tiles_m,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    TOP_K: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
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
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_cols + (k0 + offs_k)[:, None] * stride_bk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = acc + dot(a, b, IEEE)
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + rows, mask=row_mask, other=0.0)[:, None]
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             cast_to(acc, c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _gemm_config(num_rows: int, n: int, k: int) -> dict:
    if num_rows <= 64:  # decode-sized: few rows per expert
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


def grouped_gemm(a, b, out, sorted_ids, expert_ids, num_rows_padded, top_k: int, block_m: int,
                 topk_weights: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """out [R, N] (R = rows of topk ids) from a [R // top_k, K] and b [E, N, K] (see module doc).

    `block_m` must be the one moe_align padded to.
    """
    num_rows = out.shape[0]
    n, k = b.shape[1], b.shape[2]
    assert a.shape[1] == k and a.stride(-1) == 1 and out.stride(-1) == 1
    cfg = dict(config or _gemm_config(num_rows, n, k))
    cfg["BLOCK_M"] = block_m
    num_tiles_m = expert_ids.shape[0]
    grid = (num_tiles_m * triton.cdiv(n, cfg["BLOCK_N"]),)
    _grouped_gemm_kernel[grid](
        a, b, out, topk_weights if topk_weights is not None else out, sorted_ids, expert_ids, num_rows_padded,
        n, k, num_rows, num_tiles_m,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        TOP_K=top_k, MUL_WEIGHTS=topk_weights is not None, IEEE=a.dtype == torch.float32, **cfg,
    )
    return out


# ---- the whole MoE ------------------------------------------------------------------------


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: dict | None = None, skip_negative: bool = False) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk weights/ids [T, k] -> [T, H] in x's dtype.
    With skip_negative, an id of -1 (an expert another rank holds) adds nothing."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    rows = num_tokens * top_k
    if num_tokens == 0:
        return torch.empty_like(x)
    cfg = config or _gemm_config(rows, two_inter, hidden)
    block_m = cfg["BLOCK_M"]
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, block_m, skip_negative)
    gate_up = torch.empty((rows, two_inter), dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, gate_up, sorted_ids, expert_ids, num_padded, top_k, block_m, config=cfg)
    h = silu_and_mul(gate_up)
    # skipped rows are never written: they must read as zero in the sum over the k slots
    down = (torch.zeros if skip_negative else torch.empty)((rows, hidden), dtype=x.dtype, device=x.device)
    grouped_gemm(h, w2, down, sorted_ids, expert_ids, num_padded, 1, block_m,
                 topk_weights=topk_weights.flatten().float(), config=cfg)
    return down.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
        renormalize: bool, first_expert: int = 0, config: dict | None = None) -> torch.Tensor:
    """Route and run: the drop-in for `SparseMoE.forward` after the gate matmul. Under expert
    parallelism w13/w2 hold experts first_expert.. only; the tokens routed elsewhere add nothing."""
    weights, ids = route_topk(router_logits, top_k, renormalize)
    if w13.shape[0] == router_logits.shape[1]:
        return fused_moe(x, w13, w2, weights, ids, config)
    return fused_moe(x, w13, w2, weights, local_expert_ids(ids, first_expert, w13.shape[0]), config,
                     skip_negative=True)
