"""Device-side helpers shared by the kernels: casts, fp8 rounding, dots."""

from __future__ import annotations

import triton
import triton.language as tl

# Narrowing casts are done as "snap onto the target grid in float32 with integer ops, then
# cast": the snapped value is exactly representable, so the final cast does no rounding.
# Why: Triton 3.6 on an H100 folds `x.to(bf16).to(f32)` round trips away (a probe kernel
# disagreed with torch's step-by-step rounding on 31% of elements), and Triton 3.9's
# interpreter narrows float32 to bfloat16 by truncation. Integer ops are folded by neither.
FP16_MAX = tl.constexpr(65504.0)
FP16_MIN_NORMAL = tl.constexpr(6.103515625e-05)


@triton.jit
def cast_to(x, DTYPE: tl.constexpr):
    """x.to(DTYPE) with round-to-nearest-even that survives compilation, on every backend.

    float16 values beyond its range saturate at ±65504 instead of becoming ±inf. Costs a few
    integer operations per element: for dot operands, where nothing converts back, use the
    plain `.to()` instead.
    """
    if x.dtype == DTYPE:
        return x
    elif tl.bfloat16 == DTYPE:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(DTYPE)
    elif tl.float16 == DTYPE:
        return round_to_fp8_grid(x.to(tl.float32), FP16_MAX, FP16_MIN_NORMAL, 10).to(DTYPE)
    else:
        return x.to(DTYPE)


@triton.jit
def round_to_fp8_grid(x, FP8_MAX: tl.constexpr, MIN_NORMAL: tl.constexpr, MANT_BITS: tl.constexpr):
    """Round float32 `x` to the nearest value of an fp8 grid (ties to even, saturating).

    The result is exactly representable in the fp8 format, so the final `.to(fp8)` does no
    rounding of its own. Doing the rounding here keeps every backend identical: Triton's
    interpreter (3.9) loses the carry when a value rounds up to the next power of two, and
    NVIDIA, AMD OCP and AMD fnuz conversions differ in their saturation rules.
    """
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    SHIFT: tl.constexpr = 23 - MANT_BITS
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> SHIFT) & 1
    rounded = (bits + ((1 << (SHIFT - 1)) - 1) + lsb) & (-(1 << SHIFT))
    normal = rounded.to(tl.float32, bitcast=True)
    # Subnormals sit on a fixed grid of STEP = MIN_NORMAL / 2**MANT_BITS. Count steps with
    # exact operations only (scaling by powers of two, truncation, subtracting the integer
    # part), so no compiler rewrite of float arithmetic can move a tie.
    STEP: tl.constexpr = MIN_NORMAL / (1 << MANT_BITS)
    steps = tl.abs(x) * (1.0 / STEP)  # < 2**MANT_BITS where it is used
    whole = tl.minimum(steps, 1 << MANT_BITS).to(tl.int32)
    frac = steps - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    sub = (whole + up.to(tl.int32)).to(tl.float32) * STEP
    # the sign by its bit: `-sub` may compile to `0 - sub`, which turns -0.0 into +0.0
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < MIN_NORMAL, sub, normal)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b with float32 accumulation; IEEE float32 products when the operands are float32
    (no TF32), so float32 results stay within 1e-6 of a float64 reference."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def dot_acc(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b, accumulated by the matrix unit (no separate add over the accumulator)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
