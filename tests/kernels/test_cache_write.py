"""Cache write (slot mapping, fp8 quantisation) against its twin, byte for byte."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interp import PagedBatch, poisoned, randn

from pagoda_kernels.cache_write import write_kv_cache  # isort: skip
from pagoda_kernels.reference import quantize_fp8_ref, write_kv_cache_ref  # isort: skip

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize(
    ("cache_dtype", "kv_dtype", "head_dim", "num_kv_heads", "page"),
    [
        (torch.float16, torch.float16, 64, 2, 16),
        (torch.bfloat16, torch.bfloat16, 80, 1, 8),
        (torch.float32, torch.float32, 96, 3, 4),
        (torch.bfloat16, torch.float32, 128, 2, 16),  # a cast on the way in
        (FP8, torch.bfloat16, 80, 2, 16),
        (FP8, torch.float16, 256, 1, 8),
    ],
)
def test_cache_write_matches_twin(gen, cache_dtype, kv_dtype, head_dim, num_kv_heads, page):
    # ragged sequences whose new tokens start and end on and off block boundaries
    q_lens = [page, 1, 2 * page + 3, 5]
    ctx_lens = [0, page - 1, page, 3 * page + 1]
    b = PagedBatch(gen, q_lens, ctx_lens, 4, num_kv_heads, head_dim, page, kv_dtype)
    # k and v as the model hands them over: strided views into one qkv projection
    qkv = randn(gen, b.num_tokens, 2 * num_kv_heads + 3, head_dim, dtype=kv_dtype, scale=3.0)
    k, v = qkv[:, 1:1 + num_kv_heads], qkv[:, 1 + num_kv_heads:1 + 2 * num_kv_heads]
    slots = b.slot_mapping.clone()
    slots[2] = -1  # padding: skipped
    k_scale, v_scale = (0.043, 0.11) if cache_dtype == FP8 else (None, None)
    cache = poisoned(b.kv_cache.shape, cache_dtype)
    expected = cache.clone()
    write_kv_cache(k, v, cache, slots, k_scale, v_scale)
    write_kv_cache_ref(k, v, expected, slots, k_scale, v_scale)
    # byte for byte, so the slots nobody wrote must still hold the poison
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_fp8_quantisation_edges():
    """Round to nearest even at every binade edge, subnormals, saturation, signed zeros."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties
    values = torch.cat([grid, mids, mids.nextafter(torch.tensor(float("inf"))),
                        mids.nextafter(torch.tensor(-float("inf"))),
                        torch.tensor([500.0, -1e6, 449.0, -470.0, 2.0**-10, -(2.0**-12), 0.0, -0.0])])
    n = values.numel() // 4 * 4
    values = values[:n]
    k = values.view(-1, 1, 4)
    cache = poisoned((2, 1, k.shape[0], 1, 4), FP8)
    slots = torch.arange(k.shape[0])
    write_kv_cache(k, k, cache, slots, 1.0, 0.5)
    assert torch.equal(cache[0, 0].view(torch.uint8), quantize_fp8_ref(k, 1.0, FP8).view(torch.uint8))
    assert torch.equal(cache[1, 0].view(torch.uint8), quantize_fp8_ref(k, 0.5, FP8).view(torch.uint8))
