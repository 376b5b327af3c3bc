"""Device-side helpers shared by the kernels: casts, fp8 rounding, dots."""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's interpreter (3.9) narrows float32 to bfloat16 by truncation; on GPUs the cast
# rounds to nearest even. Under the interpreter, `cast_to` rounds first, so CPU tests see
# the GPU's numbers. Read once, when this module is imported (as triton.jit itself does).
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def cast_to(x, DTYPE: tl.constexpr):
    """x.to(DTYPE) with round-to-nearest-even on every backend."""
    if INTERPRET and DTYPE == tl.bfloat16:  # noqa: SIM300
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(DTYPE)
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
    # Subnormals sit on a fixed grid of MIN_NORMAL / 2**MANT_BITS: add and remove a magic
    # number whose float32 ulp is that step, on |x|, then put the sign back (keeps -0.0).
    MAGIC: tl.constexpr = MIN_NORMAL * (1 << (23 - MANT_BITS))
    sub = (tl.abs(x) + MAGIC) - MAGIC
    sub = tl.where(bits < 0, -sub, sub)
    return tl.where(tl.abs(x) < MIN_NORMAL, sub, normal)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b with float32 accumulation; IEEE float32 products when the operands are float32
    (no TF32), so float32 results stay within 1e-6 of a float64 reference."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
