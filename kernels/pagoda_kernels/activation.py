"""SiLU-and-mul: x [..., 2I] (gate then up) -> silu(gate) * up [..., I].

Casts as torch does them in the input dtype: silu computed in float32 and rounded, then
the product rounded. Twin: `reference.silu_and_mul_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels._device import cast_to


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, ids_ptr, stride_x, stride_o, N, first_expert, num_experts,
                         ONLY_LOCAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if ONLY_LOCAL:  # a MoE row routed to another rank's expert: never computed, never read
        e = tl.load(ids_ptr + row) - first_expert
        if (e < 0) | (e >= num_experts):
            return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = cast_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, cast_to(silu * up, dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, block: int = 1024,
                 expert_ids: torch.Tensor | None = None, first_expert: int = 0,
                 num_experts: int = 0) -> torch.Tensor:
    """With ``expert_ids`` (one per row of ``x``, contiguous: a MoE layer's routed rows) only the
    rows of experts ``first_expert .. first_expert + num_experts - 1`` are computed; the others'
    output rows are left as they were. Under expert parallelism half or more of the rows belong
    to other ranks (Qwen3-30B-A3B at EP = 2: SiLU-and-mul over every row took 0.19 ms of a 15.4 ms
    decode step on 2 x H200, 2026-11-28)."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    assert x2.stride(-1) == 1
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    o2 = out.view(-1, n)
    if expert_ids is not None:
        assert expert_ids.is_contiguous() and expert_ids.numel() == x2.shape[0]
    if x2.shape[0] and n:
        block = min(block, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, o2, x2 if expert_ids is None else expert_ids, x2.stride(0), o2.stride(0), n, first_expert, num_experts,
            ONLY_LOCAL=expert_ids is not None, BLOCK=block, num_warps=4)
    return out
