"""The skinny decode matmul (`pagoda_kernels.gemv`) against its twin: ragged N and K (tiles
that hang over both edges), 1 to 4 rows, bias, and the fused SiLU-and-mul input."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interp import assert_close, poisoned, randint, randn

from pagoda_kernels.gemv import MAX_ROWS, gemv  # isort: skip
from pagoda_kernels.reference import gemv_ref  # isort: skip

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_matches_twin(gen, dtype, silu_mul):
    rows = randint(gen, 1, MAX_ROWS + 1, 1)[0]
    n, k = randint(gen, 5, 70, 1)[0], randint(gen, 65, 700, 1)[0]  # never a whole number of tiles
    weight = randn(gen, n, k, dtype=dtype, scale=k**-0.5)
    x = randn(gen, rows, 2 * k if silu_mul else k, dtype=dtype, scale=2.0)
    bias = randn(gen, n, dtype=dtype) if not silu_mul else None
    out = poisoned((rows, n), dtype)
    gemv(x, weight, bias, out=out, silu_mul=silu_mul, block_n=8, block_k=64)
    assert_close(out, gemv_ref(x, weight, bias, silu_mul), TOL[dtype])


def test_gemv_default_tiles_and_strided_rows(gen):
    """The engine's call: default tiles, rows of a wider buffer (x.stride(0) > K)."""
    base = randn(gen, 3, 300, dtype=torch.float16)
    x = base[:, :256]
    weight = randn(gen, 100, 256, dtype=torch.float16, scale=1 / 16)
    assert_close(gemv(x, weight), gemv_ref(x, weight), TOL[torch.float16])


def test_gemv_rejects_what_it_cannot_do():
    w = torch.zeros(8, 16, dtype=torch.float16)
    with pytest.raises(AssertionError, match="at most"):
        gemv(torch.ones(MAX_ROWS + 1, 16, dtype=torch.float16), w)
    with pytest.raises(AssertionError):
        gemv(torch.ones(1, 16, dtype=torch.float16), w, silu_mul=True)  # silu_mul wants [M, 2K]
