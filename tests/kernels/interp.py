"""Imported first by every kernel test module: skip cleanly where the interpreter tests
cannot run (no Triton, or a CUDA machine; see conftest.py), and shared test helpers."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter kernel tests run on CPU machines (GPU: tests/gpu/test_kernels_gpu.py)",
                allow_module_level=True)

POISON = float("nan")


def randn(gen: torch.Generator, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Standard normal draws (never all zeros), cast to dtype."""
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def randint(gen: torch.Generator, low: int, high: int, n: int) -> list[int]:
    return torch.randint(low, high, (n,), generator=gen).tolist()


def poisoned(shape, dtype) -> torch.Tensor:
    """An output buffer whose every element fails a comparison unless the kernel writes it."""
    if dtype.itemsize == 1:  # fp8: 0x7f is NaN in e4m3fn (and a large finite in fnuz: still wrong)
        return torch.full(shape, 0x7F, dtype=torch.uint8).view(dtype)
    return torch.full(shape, POISON, dtype=dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert not torch.isnan(out).any(), "output holds NaN (an unwritten or poisoned element)"
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    atol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


class PagedBatch:
    """A random paged batch: sequences with ragged cached prefixes and new-token counts.

    Blocks are handed out shuffled (sequences never own contiguous blocks) and block tables
    are padded with 0, as the engine pads them.
    """

    def __init__(self, gen, q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, page, dtype,
                 cache_dtype=None, extra_blocks=3):
        self.q_lens, self.ctx_lens = q_lens, ctx_lens
        self.seq_lens_list = [a + b for a, b in zip(q_lens, ctx_lens)]
        blocks_per_seq = [-(-n // page) for n in self.seq_lens_list]
        num_blocks = sum(blocks_per_seq) + extra_blocks
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_tables = torch.zeros((len(q_lens), max(blocks_per_seq)), dtype=torch.int32)
        self.block_lists = []
        for i, nb in enumerate(blocks_per_seq):
            ids = perm[:nb]
            perm = perm[nb:]
            self.block_lists.append(ids)
            self.block_tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32)
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int32)
        self.num_tokens = starts[-1]
        slots = []
        for i, (ql, ctx) in enumerate(zip(q_lens, ctx_lens)):
            for p in range(ctx, ctx + ql):
                slots.append(self.block_lists[i][p // page] * page + p % page)
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        cache_dtype = cache_dtype or dtype
        scale = 4.0 if cache_dtype.itemsize == 1 else 1.0
        self.kv_cache = randn(gen, 2, num_blocks, page, num_kv_heads, head_dim, scale=scale).to(cache_dtype)
        self.q = randn(gen, self.num_tokens, num_heads, head_dim, dtype=dtype)
        self.max_query_len = max(q_lens)
        self.max_seq_len = max(self.seq_lens_list)
