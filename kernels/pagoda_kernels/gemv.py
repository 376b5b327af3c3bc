"""Skinny matmul for decode at small batch: y [M, N] = x [M, K] @ W[N, K]^T (+ bias), M <= 4.

At batch 1 a decode step is a stream over the weights, and every weight byte is read once:
the kernel's job is to keep enough loads in flight to run at the copy rate. cuBLAS picks
split-K kernels with a separate reduction launch for the square and the down projections
(0.88 of the copy rate over a Llama-8B step on an H100); here each program owns BLOCK_N
output rows, walks the whole of K with no reduction pass, and keeps a float32 accumulator
of the tile's shape so the cross-lane sum happens once at the end.

With `silu_mul=True` x is the gate/up projection's output [M, 2K] and the kernel computes
silu(gate) * up on the fly, rounded as `activation.silu_and_mul` rounds it: the down
projection without the activation's launch.

Float32 accumulation, one rounding to the output dtype (what cuBLAS does, in another order
of summation). Twin: `reference.gemv_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels._device import cast_to
from pagoda_kernels._utils import next_pow2

MAX_ROWS = 4  # beyond this cuBLAS's tensor-core kernels are as fast (and the tile would not fit)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
    M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    dtype = y_ptr.dtype.element_ty
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xm = m_mask[:, None] & k_mask[None, :]
        if SILU_MUL:  # x holds gate then up; the activation as silu_and_mul rounds it
            gate = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0).to(tl.float32)
            up = tl.load(x_rows + K + offs_k[None, :], mask=xm, other=0.0).to(tl.float32)
            silu = cast_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
            x = cast_to(silu * up, dtype).to(tl.float32)
        else:
            x = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0).to(tl.float32)
        acc += w.to(tl.float32)[None, :, :] * x[:, None, :]
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dst = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(dst, cast_to(y, dtype), mask=m_mask[:, None] & n_mask[None, :])


def default_tiles(rows: int) -> dict:
    """BLOCK_N / BLOCK_K / warps / stages: 8 output rows a program fills every SM several times
    over at Llama-8B's widths, and the float32 accumulator stays at 32 registers a thread. Within
    0.01 of the best of 36 tilings for each of Llama-8B's projections (H200 sweep, 2026-11-22)."""
    return dict(block_n=8, block_k=max(64, 512 // next_pow2(rows)), num_warps=4, num_stages=3)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         silu_mul: bool = False, block_n: int | None = None, block_k: int | None = None,
         num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [M, K] (or [M, 2K] with silu_mul), weight [N, K] contiguous rows -> [M, N] in x's dtype.

    The tile arguments override `default_tiles` (the benchmark's sweep)."""
    rows = x.shape[0]
    n, k = weight.shape
    assert 1 <= rows <= MAX_ROWS, f"gemv is for at most {MAX_ROWS} rows, got {rows}"
    assert x.shape[1] == (2 * k if silu_mul else k), (x.shape, weight.shape, silu_mul)
    assert x.stride(-1) == 1 and weight.stride(-1) == 1, "rows must be contiguous"
    assert x.dtype == weight.dtype, (x.dtype, weight.dtype)
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    tiles = default_tiles(rows)
    block_n = block_n or tiles["block_n"]
    block_k = block_k or tiles["block_k"]
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
        M=rows, BLOCK_M=next_pow2(rows), BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NUM_STAGES=num_stages or tiles["num_stages"],
        num_warps=num_warps or tiles["num_warps"],
    )
    return out
