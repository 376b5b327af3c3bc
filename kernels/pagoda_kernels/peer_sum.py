"""The sum of the same span of every rank's buffer, in rank order: the reading half of the
tensor-parallel all-reduce through the peers' memory (daemon/.../distributed/peer_all_reduce.py).

The buffers are other GPUs' memory mapped into this one's address space (torch symmetric
memory); ``table`` holds their addresses, rank 0 first, so that every rank adds the same
numbers in the same order and all of them get bit-identical sums. Accumulates in float32 and
rounds once, as NCCL's bf16 and fp16 sums do. Many small programs rather than torch's one-shot
kernel's few large ones: reads of another GPU's memory take long to come back, so the more of
them in flight the better (2 MiB at two ranks: see the docstring of peer_all_reduce.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels._device import cast_to


@triton.jit
def _peer_sum_kernel(table_ptr, out_ptr, n, RANKS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(RANKS):
        src = tl.load(table_ptr + r).to(tl.pointer_type(dtype))
        acc += tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, cast_to(acc, dtype), mask=mask)


def peer_sum(table: torch.Tensor, out: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """``out`` (contiguous) = the sum over ranks of the first ``out.numel()`` elements at each
    address in ``table`` (int64, one per rank, in rank order), each of ``out``'s dtype."""
    assert out.is_contiguous() and table.dtype == torch.int64
    n = out.numel()
    if n:
        _peer_sum_kernel[(triton.cdiv(n, block),)](table, out, n, RANKS=table.numel(), BLOCK=block, num_warps=4)
    return out
