"""The sum of the same span of every rank's buffer, in rank order, after a barrier across the
ranks: the tensor-parallel all-reduce through the peers' memory, in one kernel
(daemon/.../distributed/peer_all_reduce.py).

The buffers are other GPUs' memory mapped into this one's address space (torch symmetric
memory); ``table`` holds their addresses, rank 0 first, so that every rank adds the same
numbers in the same order and all of them get bit-identical sums. Accumulates in float32 and
rounds once, as NCCL's bf16 and fp16 sums do. Many small programs rather than torch's one-shot
kernel's few large ones: reads of another GPU's memory take long to come back, so the more of
them in flight the better (2 MiB at two ranks: see the docstring of peer_all_reduce.py).

The barrier is per program: program p of each rank raises a flag in every other rank's signal
pad (``pads``: each rank's pad address, in rank order; one int32 per program and rank, all
zero between launches) and waits for theirs in its own, then sums. That is enough: a rank's
program p starts only once the kernels before it on its stream have finished, so a flag from
any program of rank r says that rank r's part is in place and that its previous launch has
stopped reading. The flags go up by compare-and-swap 0 -> 1 and come down 1 -> 0, so a flag
not yet taken down holds the next raiser back. (A separate barrier kernel before each sum cost
66 launches of 3.1 µs in each Llama-3-8B decode step at TP = 2, and 96 of 3.1 µs at the
Qwen3-30B-A3B shape with EP = 2: 0.20 and 0.30 ms a step on 2 × H200, 2026-11-27/28.)

``peer_sum_add_norm`` is the same sum followed by the next RMSNorm's residual add and norm, one
program per row: each row of the sum is read, added, normed and written once, in the launch that
sums it, rather than written by the sum and read back by the norm's own launch (a decode step of
the Qwen3-30B-A3B shape at EP = 2 ran 97 norm launches, 0.25 ms on 2 × H200, 2026-11-28).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_kernels._device import cast_to
from pagoda_kernels._utils import next_pow2
from pagoda_kernels.rmsnorm import add_residual, norm_row

# At most this many programs (each needs one flag per rank in every pad: torch's default signal
# pad of 9,216 bytes holds 2,304): the rest of a large tensor is summed by the same programs in
# turn. Swept on 2 × H200 (2026-11-28, bf16, in CUDA graphs, µs per all-reduce with the copy into
# the slot): 256 programs of 2,048 elements, 4 warps: 1 MiB 8.97, 2 MiB 12.55, 4 MiB 19.34, 8 MiB
# 33.89; 512 programs: 8.93, 13.67, 20.17, 34.67 (each program's barrier costs NVLink round trips);
# 128: 9.39, 12.79, 19.78, 34.54; 4,096-element blocks of 8 warps or 8,192 of 16: no better.
MAX_PROGRAMS = 256


@triton.jit
def _barrier(pads_ptr, pid, rank, RANKS: tl.constexpr):
    """Program ``pid``'s flag raised in every other rank's pad, then theirs awaited in this one's."""
    flags = pid * RANKS
    for r in tl.static_range(RANKS):  # raise this program's flag in every other rank's pad
        if r != rank:
            theirs = tl.load(pads_ptr + r).to(tl.pointer_type(tl.int32))
            while tl.atomic_cas(theirs + flags + rank, 0, 1, sem="release", scope="sys") != 0:
                pass
    mine = tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(RANKS):  # and wait for each of theirs in this rank's, taking it down
        if r != rank:
            while tl.atomic_cas(mine + flags + r, 1, 0, sem="acquire", scope="sys") != 1:
                pass


@triton.jit
def _rank_sum(table_ptr, offs, mask, dtype, RANKS: tl.constexpr):
    """The ranks' elements at ``offs``, added in rank order in float32."""
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for r in tl.static_range(RANKS):
        src = tl.load(table_ptr + r).to(tl.pointer_type(dtype))
        acc += tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _peer_sum_kernel(table_ptr, pads_ptr, out_ptr, n, rank, RANKS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    _barrier(pads_ptr, pid, rank, RANKS)
    dtype = out_ptr.dtype.element_ty
    for start in range(pid.to(tl.int64) * BLOCK, n, tl.num_programs(0).to(tl.int64) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, cast_to(_rank_sum(table_ptr, offs, mask, dtype, RANKS), dtype), mask=mask)


@triton.jit
def _peer_sum_add_norm_kernel(table_ptr, pads_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, rows, N, rank,
                              RANKS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    _barrier(pads_ptr, pid, rank, RANKS)
    dtype = res_out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    for row in range(pid.to(tl.int64), rows, tl.num_programs(0)):
        offs = row * N + cols
        x = cast_to(_rank_sum(table_ptr, offs, mask, dtype, RANKS), dtype)  # the sum, rounded as peer_sum's
        # then rmsnorm's fused add and norm, by its own helpers
        x = add_residual(x, tl.load(res_ptr + offs, mask=mask, other=0.0), dtype)
        tl.store(res_out_ptr + offs, x, mask=mask)
        # the weight loaded per row (norm_row): held across the rows it spilled at 8 ranks and rows of 8,192
        out = norm_row(x, w_ptr, cols, mask, eps, N, dtype)
        tl.store(out_ptr + offs, cast_to(out, out_ptr.dtype.element_ty), mask=mask)


def max_programs_for(ranks: int, pad_bytes: int) -> int:
    """The most programs whose flags fit a signal pad of ``pad_bytes`` at ``ranks`` ranks."""
    return min(MAX_PROGRAMS, pad_bytes // 4 // ranks)


def peer_sum(table: torch.Tensor, pads: torch.Tensor, rank: int, out: torch.Tensor,
             max_programs: int = MAX_PROGRAMS, block: int = 2048) -> torch.Tensor:
    """``out`` (contiguous) = the sum over ranks of the first ``out.numel()`` elements at each
    address in ``table`` (int64, one per rank, in rank order), each of ``out``'s dtype, once every
    rank has launched it. ``pads``: int64, each rank's signal pad, of at least ``max_programs *
    ranks`` int32 flags. An empty ``out``: the barrier alone (one program)."""
    assert out.is_contiguous() and table.dtype == torch.int64 and pads.dtype == torch.int64
    assert table.numel() == pads.numel() and 0 <= rank < table.numel() and max_programs >= 1
    n = out.numel()
    programs = max(1, min(triton.cdiv(n, block), max_programs))
    _peer_sum_kernel[(programs,)](table, pads, out, n, rank, RANKS=table.numel(), BLOCK=block, num_warps=4)
    return out


def peer_sum_add_norm(table: torch.Tensor, pads: torch.Tensor, rank: int, residual: torch.Tensor,
                      weight: torch.Tensor, eps: float, out: torch.Tensor, residual_out: torch.Tensor,
                      max_programs: int = MAX_PROGRAMS) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-parallel sum followed by the fused residual add and RMSNorm, in one kernel:
    ``residual_out`` = the sum over ranks (as :func:`peer_sum`, rows of ``residual``'s shape at
    each address in ``table``) + ``residual``; ``out`` = the norm of that, times ``weight``, with
    ``pagoda_kernels.rmsnorm``'s casts, bit for bit what the two launches give. One program per
    row (rows beyond the programs taken in turn): a decode step's rows at the Qwen3-30B-A3B
    shape are 2,048 elements, peer_sum's block. ``residual_out`` may be ``residual``."""
    n = residual.shape[-1]
    rows = residual.numel() // max(n, 1)
    assert residual.is_contiguous() and out.is_contiguous() and residual_out.is_contiguous() and weight.is_contiguous()
    assert out.shape == residual.shape == residual_out.shape and weight.shape == (n,)
    assert table.dtype == torch.int64 and pads.dtype == torch.int64 and table.numel() == pads.numel()
    block = next_pow2(n)
    programs = max(1, min(rows, max_programs))
    _peer_sum_add_norm_kernel[(programs,)](table, pads, residual, weight, out, residual_out, eps, rows, n, rank,
                                           RANKS=table.numel(), BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out, residual_out
