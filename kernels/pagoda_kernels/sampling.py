"""Temperature sampling and greedy decoding in one read of the logits.

The engine's torch sampler makes several passes over the [B, V] logits each step: a cast
to float32, a divide by the temperature, a softmax, an exponential draw, a divide and an
argmax, each a separate launch (at batch 256 and a 152k vocabulary 0.7 ms of H200 time
against 83 µs for this kernel; docs/kernels.md). Sampling from softmax(logits / T) needs
none of the normalisation: the exponential race (Gumbel-max) picks

    token = argmax_v (logits[v] / T - log E_v),    E_v ~ Exp(1) independent,

which is a draw from softmax(logits / T). So one kernel reads each logit once, draws E_v
from Philox on the fly and keeps a running (best score, lowest index). Rows with T <= 0
are greedy: exactly argmax(logits), no noise, ties to the lowest index (as torch.argmax).

Two stages so that one row still spreads over the GPU: grid (row, chunk of the vocabulary)
writes each chunk's winner to small [B, num_chunks] buffers; `_sample_reduce_kernel` picks
each row's winner (lowest index among equal scores); a row of one chunk writes its token
directly. No host sync.

The exponentials: E = -log(1 - w) with w uniform on (0, 1) from one 32-bit Philox word
(resolution 2**-32 at both ends), by its series where w < 2**-6, so that small E, the ones
that win, keep full float32 precision (-log(u) of a float32 uniform u near 1 would quantise
them in steps of 6e-8, and tokens 1e-7 times less likely than the top one could never be
drawn). E is never 0 or inf, so no score is NaN unless a logit is. Each Philox call
(10 rounds, key = the 64-bit seed) yields four words, used for four elements; its counter
is (element, row, offset low, offset high), so every (seed, offset, row, element) draws
an independent number whatever the batch size.

Twin: `reference.sample_tokens_ref` (the same distribution through torch's exponential
race; the Philox stream itself is not reproduced, so sampled rows are tested statistically
and greedy rows exactly).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.random import philox_impl

from pagoda_kernels._utils import aligned_buffers, cdiv, is_hip, next_pow2, num_sms

# BLOCK logits per loop iteration: four sub-blocks of BLOCK // 4, one Philox call per
# element of a sub-block (its four output words serve the four sub-blocks). With 4 warps
# that is 4 contiguous elements per thread per load (8-byte loads in bf16). Sampled rows
# are compute-bound (Philox about a quarter, the two logs and the rest the bulk; greedy rows
# only read), so bigger loads buy little: on an H200 at batch 256, BLOCK 1024-4096 with 4 or
# 8 warps and chunks of 4-8 blocks all ran within 10% of each other (2026-11-21).
BLOCK = 2048
NUM_WARPS = 4
# A chunk (one program) covers between MIN_CHUNK and MAX_CHUNK logits of a row, a power-of-
# two number of blocks: small enough that a batch of one still makes 75 programs at
# V = 151936, large enough that at batch 256 a program amortises its setup over 4 blocks
# and the second stage reads 19 partial results per row. Between those bounds the chunk aims
# at PROGRAMS_PER_SM programs per SM.
MIN_CHUNK = BLOCK
MAX_CHUNK = 4 * BLOCK
PROGRAMS_PER_SM = 4
TWO_POW_M32 = tl.constexpr(2.3283064365386963e-10)  # 2**-32
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# Arguments that change between steps are not specialised: each value class (1, a multiple of
# 16, other) would be a variant compiled while serving (see pagoda_kernels.jit_watch).
@triton.jit(do_not_specialize=["num_chunks", "seed_lo", "seed_hi", "offset_lo", "offset_hi"])
def _sample_partial_kernel(
    logits_ptr, temp_ptr, val_ptr, idx_ptr, out_ptr,
    stride_row, V, chunk, num_chunks,
    seed_lo, seed_hi, offset_lo, offset_hi,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, FAST_LOG2: tl.constexpr,
):
    row = tl.program_id(0)
    pid_c = tl.program_id(1)
    Q: tl.constexpr = BLOCK // 4
    lane = tl.arange(0, Q)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lo = pid_c * chunk
    hi = tl.minimum(lo + chunk, V)
    t = tl.load(temp_ptr + row)
    best_val = tl.full([Q], float("-inf"), tl.float32)
    best_idx = lo + lane  # an all -inf chunk reports its first index, as torch.argmax would
    if t > 0.0:
        scale = LOG2E / t  # scores in log2 units: log2(e) * (x / T - ln E)
        # Philox key and the counter words shared by the row: scalars (uniform registers)
        k0 = seed_lo.to(tl.uint32, bitcast=True)
        k1 = seed_hi.to(tl.uint32, bitcast=True)
        c1 = row.to(tl.uint32, bitcast=True)
        c2 = offset_lo.to(tl.uint32, bitcast=True)
        c3 = offset_hi.to(tl.uint32, bitcast=True)
        for start in range(lo, hi, BLOCK):
            c0 = (start + lane).to(tl.uint32, bitcast=True)
            r0, r1, r2, r3 = philox_impl(c0, c1, c2, c3, k0, k1)
            for k in tl.static_range(4):  # written out, not helpers: the interpreter is slow at calls
                if k == 0:
                    r = r0
                elif k == 1:
                    r = r1
                elif k == 2:
                    r = r2
                else:
                    r = r3
                cols = start + k * Q + lane
                mask = cols < hi
                x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
                # E = -ln(1 - w) ~ Exp(1), w = (r + 1/2) * 2**-32 in (0, 1). Whichever of w and
                # 1 - w is below 1/2 comes exactly from the integer (as r or ~r); small E (those
                # that win) from the series of -ln(1 - w), since 1 - w in float32 would round
                # them away. E lies in [1.2e-10, 22.9]: never 0 or inf, no NaN.
                upper = r.to(tl.int32, bitcast=True) < 0  # w >= 1/2
                f = (tl.where(upper, ~r, r).to(tl.float32) + 0.5) * TWO_POW_M32  # upper: 1 - w; else w
                u = tl.where(upper, f, 1.0 - f)
                if FAST_LOG2:  # the MUFU instruction (rel. error ~2**-22); tl.log2 is a polynomial
                    lg_u = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32,
                                                     is_pure=True, pack=1)
                else:
                    lg_u = tl.log2(u)
                series = f * (1.0 + f * (0.5 + f * (0.3333333432674408 + f * 0.25)))
                e = tl.where(upper | (f >= 0.015625), lg_u * -LN2, series)
                if FAST_LOG2:
                    lg_e = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [e], dtype=tl.float32,
                                                     is_pure=True, pack=1)
                else:
                    lg_e = tl.log2(e)
                score = tl.where(mask, x * scale - lg_e, float("-inf"))
                # strict >: an equal score later in the row loses; NaN never wins
                take = score > best_val
                best_val = tl.where(take, score, best_val)
                best_idx = tl.where(take, cols, best_idx)
    else:
        for start in range(lo, hi, BLOCK):
            for k in tl.static_range(4):
                cols = start + k * Q + lane
                x = tl.load(row_ptr + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
                take = x > best_val
                best_val = tl.where(take, x, best_val)
                best_idx = tl.where(take, cols, best_idx)
    # lanes saw increasing indices, so each lane holds its earliest best: take the lowest
    # index among the lanes that reach the chunk's best
    m = tl.max(best_val, 0)
    i = tl.min(tl.where(best_val == m, best_idx, 2147483647), 0)
    if SINGLE:  # the whole row in one chunk: this is the token
        tl.store(out_ptr + row, i.to(tl.int64))
    else:
        tl.store(val_ptr + row * num_chunks + pid_c, m)
        tl.store(idx_ptr + row * num_chunks + pid_c, i)


@triton.jit(do_not_specialize=["num_chunks"])
def _sample_reduce_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    v = tl.load(val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_chunks + c, mask=mask, other=2147483647)
    m = tl.max(v, 0)
    best = tl.min(tl.where(v == m, i, 2147483647), 0)
    tl.store(out_ptr + row, best.to(tl.int64))


@functools.lru_cache(maxsize=64)
def chunk_size(batch: int, vocab: int, sms: int) -> int:
    """Logits per program: a power-of-two number of BLOCKs in [MIN_CHUNK, MAX_CHUNK]."""
    want = cdiv(batch * vocab, PROGRAMS_PER_SM * sms)
    return max(MIN_CHUNK, min(MAX_CHUNK, next_pow2(want), next_pow2(vocab)))


def _int32_halves(value: int) -> tuple[int, int]:
    """A 64-bit integer as two signed 32-bit ints (so the kernel's argument types never change)."""
    value &= (1 << 64) - 1
    lo, hi = value & 0xFFFFFFFF, value >> 32
    return lo - (1 << 32) if lo >= 1 << 31 else lo, hi - (1 << 32) if hi >= 1 << 31 else hi


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seed: int, offset: int = 0) -> torch.Tensor:
    """One token per row of logits [B, V] (bf16/fp16/fp32; rows may be strided, the last dim
    contiguous): a draw from softmax(logits / T) where temperature[row] > 0, argmax(logits)
    where it is 0 (or below). temperature: [B] float32 on the logits' device.

    seed (any int; 64 bits used) and offset (same) select the random numbers: the same
    (seed, offset) gives the same tokens for the same logits; change either for the next
    step. Returns [B] int64.
    """
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits [B, V] with a contiguous last dim"
    assert logits.dtype in (torch.float32, torch.float16, torch.bfloat16), logits.dtype
    bsz, vocab = logits.shape
    assert temperature.shape == (bsz,) and temperature.dtype == torch.float32
    assert 0 < vocab < 2**31
    temperature = temperature.contiguous()
    out = torch.empty(bsz, dtype=torch.int64, device=logits.device)
    if bsz == 0:
        return out
    chunk = chunk_size(bsz, vocab, num_sms(logits.device))
    num_chunks = cdiv(vocab, chunk)
    if num_chunks > 1:  # each chunk's best score and its index, in one allocation
        vals, idxs = aligned_buffers([bsz * num_chunks] * 2, torch.float32, logits.device)
        idxs = idxs.view(torch.int32)
    else:
        vals, idxs = out, out  # unused
    seed_lo, seed_hi = _int32_halves(seed)
    offset_lo, offset_hi = _int32_halves(offset)
    _sample_partial_kernel[(bsz, num_chunks)](
        logits, temperature, vals, idxs, out,
        logits.stride(0), vocab, chunk, num_chunks,
        seed_lo, seed_hi, offset_lo, offset_hi,
        BLOCK=BLOCK, SINGLE=num_chunks == 1, FAST_LOG2=_fast_log2(logits.device), num_warps=NUM_WARPS,
    )
    if num_chunks > 1:
        # BLOCK_C from the vocabulary alone: one compiled variant whatever the batch size (the
        # engine's warm-up compiles it; a batch size first seen while serving compiles nothing)
        _sample_reduce_kernel[(bsz,)](vals, idxs, out, num_chunks, BLOCK_C=next_pow2(cdiv(vocab, MIN_CHUNK)),
                                      num_warps=1)
    return out


def _fast_log2(device: torch.device) -> bool:
    """Whether the kernel may use PTX's lg2.approx: compiled for an NVIDIA GPU."""
    return device.type == "cuda" and not is_hip() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
