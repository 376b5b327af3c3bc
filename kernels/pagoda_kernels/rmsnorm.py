"""RMSNorm with an optional fused residual add, with the engine's semantics exactly.

Engine (`pagoda_daemon.models.layers.RMSNorm`): x = x + residual in the input dtype (that
sum is also the new residual), the norm in float32, then weight * normed.to(dtype), whose
dtype is the promotion of weight and input. One program per row; the row stays in
registers. Twin: `reference.rmsnorm_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels._device import cast_to
from pagoda_kernels._utils import next_pow2


@triton.jit
def add_residual(x, r, dtype):
    """x + r in the input dtype, as the engine adds them: the new residual stream."""
    return cast_to(x.to(tl.float32) + r.to(tl.float32), dtype)


@triton.jit
def norm_row(x, w_ptr, cols, mask, eps, N, dtype):
    """One row's RMSNorm in float32, rounded to ``dtype`` (x's), times the weight: the engine's
    casts, in float32. Shared with peer_sum's fused sum and norm, so both give the same bits. The
    weight is loaded after the row's reduction: held across it, peer_sum's at 8 ranks and rows of
    8,192 spilled (sm_90)."""
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / N
    h = h * tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return w.to(tl.float32) * cast_to(h, dtype).to(tl.float32)


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps,
    stride_x, stride_r, stride_o, stride_ro, N,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = add_residual(x, r, dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    out = norm_row(x, w_ptr, cols, mask, eps, N, dtype)
    tl.store(out_ptr + row * stride_o + cols, cast_to(out, out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None):
    """x [..., N]. Without residual: norm(x). With: (norm(x + residual), x + residual).

    `residual_out` may be `residual` itself (in place, as the fused-add norms of other
    engines do); `out` may be x.
    """
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    assert x2.stride(-1) == 1 and weight.is_contiguous()
    if out is None:
        out = torch.empty(shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    o2 = out.view(-1, n)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if residual_out is None:
            residual_out = torch.empty_like(x)
        ro2 = residual_out.view(-1, n)
    else:
        r2 = ro2 = x2
    rows = x2.shape[0]
    if rows:
        block = next_pow2(n)
        _rmsnorm_kernel[(rows,)](
            x2, r2, weight, o2, ro2, eps,
            x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0), n,
            BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, residual_out)
