"""Paged decode and prefill/extend attention, and varlen attention, against their twins.

Shapes are small and random (ragged lengths, positions on and off block boundaries); the
cases cover every supported head size, MHA/GQA/MQA, sliding windows, split-KV and fp8
caches. Dots run in float16/float32: Triton 3.9's interpreter computes bfloat16 `tl.dot`
wrongly (the GPU suite covers bfloat16).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interp import TOL, PagedBatch, assert_close, poisoned, randint, randn

from pagoda_kernels.decode_attention import default_num_splits, paged_decode_attention  # isort: skip
from pagoda_kernels.prefill_attention import paged_prefill_attention, varlen_attention  # isort: skip
from pagoda_kernels.reference import paged_attention_ref, varlen_attention_ref  # isort: skip

FP8 = torch.float8_e4m3fn
F16, F32 = torch.float16, torch.float32

# (head_dim, heads, kv_heads, page, dtype, cache dtype, sliding window, splits, block_n)
DECODE_CASES = [
    (64, 4, 4, 16, F16, None, None, 1, 16),  # MHA, one split writes the output directly
    (80, 8, 2, 16, F32, None, None, 3, 16),  # GQA 4, non-power-of-2 head, split-KV
    (96, 6, 1, 8, F16, None, 20, 2, 32),  # MQA, tile spans pages, window
    (128, 4, 2, 16, F16, FP8, None, 4, 16),  # fp8 cache, more splits than some contexts have tiles
    (256, 2, 1, 8, F32, None, 9, 1, 8),  # head 256, window, tile smaller than a page
    (128, 16, 2, 16, F16, FP8, 33, 2, 16),  # GQA 8 with fp8 and window
]


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "page", "dtype", "cache_dtype", "window", "splits",
                          "block_n"), DECODE_CASES)
def test_decode_matches_twin(gen, head_dim, heads, kv_heads, page, dtype, cache_dtype, window, splits, block_n):
    # contexts of 1 token, exactly one page, one past a page, and random
    ctx = [0, page - 1, page, *randint(gen, 1, 5 * page, 2)]
    b = PagedBatch(gen, [1] * len(ctx), ctx, heads, kv_heads, head_dim, page, dtype, cache_dtype)
    scales = (0.7, 0.3) if cache_dtype == FP8 else (None, None)
    scale = head_dim**-0.5
    out = poisoned(b.q.shape, dtype)
    paged_decode_attention(b.q, b.kv_cache, b.block_tables, b.seq_lens, scale, window, *scales,
                           num_splits=splits, out=out, block_n=block_n)
    ref = paged_attention_ref(b.q, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, scale, window, *scales)
    assert_close(out, ref, TOL[dtype])


def test_decode_strided_query_and_default_splits(gen):
    """q as the model hands it over (a view into the qkv projection), splits by heuristic."""
    b = PagedBatch(gen, [1] * 3, randint(gen, 65, 200, 3), 4, 2, 64, 16, F16)
    qkv = randn(gen, 3, 8, 64, dtype=F16)
    q = qkv[:, :4]
    splits = default_num_splits(3, 2, b.max_seq_len, q.device, block_n=16)
    assert splits > 1  # 3 x 2 programs cannot fill a device: the heuristic splits
    out = paged_decode_attention(q, b.kv_cache, b.block_tables, b.seq_lens, 0.125, max_seq_len=b.max_seq_len,
                                 block_n=16)
    ref = paged_attention_ref(q, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, 0.125)
    assert_close(out, ref, TOL[F16])


# (head_dim, heads, kv_heads, page, dtype, cache dtype, sliding window, block_m, block_n)
PREFILL_CASES = [
    (64, 4, 2, 16, F16, None, None, 16, 16),
    (80, 4, 1, 8, F32, None, None, 16, 32),  # MQA, non-power-of-2 head, tile spans pages
    (96, 6, 3, 16, F16, None, 12, 32, 16),  # window shorter than a query tile
    (128, 4, 4, 16, F16, FP8, None, 16, 16),  # fp8 cache
    (256, 2, 1, 8, F32, None, 40, 16, 8),  # head 256, window, tile smaller than a page
]


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "page", "dtype", "cache_dtype", "window", "block_m",
                          "block_n"), PREFILL_CASES)
def test_prefill_with_cached_prefix_matches_twin(gen, head_dim, heads, kv_heads, page, dtype, cache_dtype, window,
                                                 block_m, block_n):
    # a fresh prefill, a chunk after a page-aligned prefix, a decode row, a ragged extend
    q_lens = [randint(gen, 2, 40, 1)[0], page, 1, randint(gen, 2, 30, 1)[0]]
    ctx = [0, 2 * page, randint(gen, 1, 50, 1)[0], randint(gen, 1, 40, 1)[0]]
    b = PagedBatch(gen, q_lens, ctx, heads, kv_heads, head_dim, page, dtype, cache_dtype)
    scales = (0.5, 0.25) if cache_dtype == FP8 else (None, None)
    scale = head_dim**-0.5
    out = poisoned(b.q.shape, dtype)
    paged_prefill_attention(b.q, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, scale, window,
                            *scales, max_query_len=b.max_query_len, out=out, block_m=block_m, block_n=block_n)
    ref = paged_attention_ref(b.q, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, scale, window,
                              *scales)
    assert_close(out, ref, TOL[dtype])


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "dtype", "window"),
                         [(64, 4, 2, F16, None), (80, 2, 1, F32, 7), (128, 4, 4, F16, None)])
def test_varlen_on_fresh_kv_matches_twin(gen, head_dim, heads, kv_heads, dtype, window):
    q_lens = [1, *randint(gen, 2, 45, 2)]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    t = int(qsl[-1])
    q = randn(gen, t, heads, head_dim, dtype=dtype)
    k, v = randn(gen, t, kv_heads, head_dim, dtype=dtype), randn(gen, t, kv_heads, head_dim, dtype=dtype)
    out = poisoned(q.shape, dtype)
    varlen_attention(q, k, v, qsl, 0.1, window, out=out, block_m=16, block_n=16)
    assert_close(out, varlen_attention_ref(q, k, v, qsl, 0.1, window), TOL[dtype])
