"""Kernel tests under Triton's interpreter, on CPU tensors.

TRITON_INTERPRET=1 must be set before any `triton.jit` runs (Triton reads it when a kernel
is decorated, i.e. when a `pagoda_kernels` kernel module is imported), so it is set here,
when pytest loads this conftest, before the test modules import anything. On a machine
with CUDA these tests are skipped (tests/gpu/test_kernels_gpu.py covers the same kernels
compiled), so that one pytest run never mixes interpreted and compiled kernels. Set
PAGODA_KERNELS_INTERPRET=1 to force them anyway.

Inputs are fresh random draws every run; the seed is printed (shown on failure) and can
be pinned with PAGODA_TEST_SEED.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

FORCE = os.environ.get("PAGODA_KERNELS_INTERPRET", "") not in ("", "0")
if FORCE or not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def gen(request) -> torch.Generator:
    seed = int(os.environ.get("PAGODA_TEST_SEED") or random.randrange(2**31))
    print(f"{request.node.nodeid}: PAGODA_TEST_SEED={seed}")
    g = torch.Generator()
    g.manual_seed(seed)
    return g
