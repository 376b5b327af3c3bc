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

from pagoda_kernels.decode_attention import paged_decode_attention, plan_decode  # isort: skip
from pagoda_kernels.prefill_attention import paged_prefill_attention, varlen_attention  # isort: skip
from pagoda_kernels.reference import paged_attention_ref, varlen_attention_ref  # isort: skip

FP8 = torch.float8_e4m3fn
F16, F32 = torch.float16, torch.float32
# How the decode plan cuts contexts: (work per SM, minimum tiles per chunk). "whole": every
# sequence is one chunk (outputs written directly); "fine": chunks of one tile (combined).
CHUNKING = {"whole": (1, 1 << 20), "fine": (1 << 12, 1), "default": None}

# (head_dim, heads, kv_heads, page, dtype, cache dtype, sliding window, chunking, block_n)
DECODE_CASES = [
    (64, 4, 4, 16, F16, None, None, "whole", 16),  # MHA
    (80, 8, 2, 16, F32, None, None, "fine", 16),  # GQA 4, non-power-of-2 head, split-KV
    (96, 6, 1, 8, F16, None, 20, "fine", 32),  # MQA, tile spans pages, window (chunks outside it are empty)
    (128, 4, 2, 16, F16, FP8, None, "default", 16),  # fp8 cache
    (256, 2, 1, 8, F32, None, 9, "whole", 8),  # head 256, window, tile smaller than a page
    (128, 16, 2, 16, F16, FP8, 33, "fine", 16),  # GQA 8 with fp8 and window
    (64, 24, 8, 16, F16, None, None, "fine", 16),  # 24 heads (not a power of two), GQA 3, split-KV
]


def _plan(b: PagedBatch, kv_heads: int, block_n: int, chunking: str):
    if CHUNKING[chunking] is None:
        return None
    work_per_sm, min_tiles = CHUNKING[chunking]
    return plan_decode(b.seq_lens, kv_heads, block_n, work_per_sm=work_per_sm, min_chunk_tiles=min_tiles)


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "page", "dtype", "cache_dtype", "window", "chunking",
                          "block_n"), DECODE_CASES)
def test_decode_matches_twin(gen, head_dim, heads, kv_heads, page, dtype, cache_dtype, window, chunking, block_n):
    # contexts of 1 token, exactly one page, one past a page, and random
    ctx = [0, page - 1, page, *randint(gen, 1, 5 * page, 2)]
    b = PagedBatch(gen, [1] * len(ctx), ctx, heads, kv_heads, head_dim, page, dtype, cache_dtype)
    scales = (0.7, 0.3) if cache_dtype == FP8 else (None, None)
    scale = head_dim**-0.5
    out = poisoned(b.q.shape, dtype)
    paged_decode_attention(b.q, b.kv_cache, b.block_tables, b.seq_lens, scale, window, *scales,
                           plan=_plan(b, kv_heads, block_n, chunking), out=out, block_n=block_n)
    ref = paged_attention_ref(b.q, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, scale, window, *scales)
    assert_close(out, ref, TOL[dtype])


def test_decode_strided_query_and_default_plan(gen):
    """q as the model hands it over (a view into the qkv projection), the default plan."""
    b = PagedBatch(gen, [1] * 3, randint(gen, 65, 200, 3), 4, 2, 64, 16, F16)
    qkv = randn(gen, 3, 8, 64, dtype=F16)
    q = qkv[:, :4]
    out = paged_decode_attention(q, b.kv_cache, b.block_tables, b.seq_lens, 0.125, block_n=16)
    ref = paged_attention_ref(q, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, 0.125)
    assert_close(out, ref, TOL[F16])


def test_decode_plan_serves_every_layer_of_a_step(gen):
    """One plan, its partial-result buffers and its arrival counts, for all layers (as the
    backend shares them)."""
    b = PagedBatch(gen, [1] * 4, randint(gen, 40, 120, 4), 4, 2, 64, 16, F16)
    plan = plan_decode(b.seq_lens, 2, 16, work_per_sm=1 << 12, min_chunk_tiles=1)  # one-tile chunks
    assert plan.num_chunks.min() > 1
    ref = paged_attention_ref(b.q, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, 0.125)
    for _layer in range(2):
        out = poisoned(b.q.shape, F16)
        paged_decode_attention(b.q, b.kv_cache, b.block_tables, b.seq_lens, 0.125, plan=plan, out=out, block_n=16)
        assert_close(out, ref, TOL[F16])
        assert not plan.arrivals.any()  # each (sequence, KV head)'s last chunk left its count at 0
    assert len(plan.scratch) == 1


@pytest.mark.parametrize("num_seqs", [1, 7, 64, 300])
def test_decode_plan_covers_every_tile_in_balanced_chunks(gen, num_seqs):
    """Each sequence's chunks cover its tiles exactly; chunks are small against one SM's
    share of the work; the work list always fits the grid sized from num_seqs alone."""
    for _ in range(3):
        lens = torch.tensor(randint(gen, 1, 3000, num_seqs), dtype=torch.int32)
        if num_seqs > 1:
            lens[0] = 4000  # one long sequence among short ones
        plan = plan_decode(lens, 8, 64)
        n, per_chunk = plan.num_chunks.tolist(), plan.chunk_tiles.tolist()
        tiles = (-(-lens // 64)).tolist()
        programs = 16 * 8  # WORK_PER_SM x the nominal 8 SMs of a CPU device
        total = sum(tiles) * 8
        largest = max(2, -(-total // programs))  # at most 1/16 of an SM's share, unless held up by the minimum
        if total >= 32 * 4 * 8:  # work enough for four 32-tile programs per SM: chunks of 32 tiles at least
            largest = max(largest, 32)
        for t, c, size in zip(tiles, n, per_chunk):
            assert c == -(-t // largest)  # as few chunks as the largest size allows
            assert (c - 1) * size < t <= c * size and size <= largest  # even sizes, covering every tile
        ends = torch.tensor(n).cumsum(0).tolist()
        assert plan.chunk_ends.tolist() == ends
        assert ends[-1] <= plan.max_work
        items = plan.work_items[: ends[-1]].tolist()  # in order: sequence, then chunk
        want = [(s << 16) | (c << 1) | int(n[s] == 1) for s in range(num_seqs) for c in range(n[s])]
        assert items == want


# (head_dim, heads, kv_heads, page, dtype, cache dtype, sliding window, block_m, block_n)
PREFILL_CASES = [
    (64, 4, 2, 16, F16, None, None, 16, 16),
    (80, 4, 1, 8, F32, None, None, 16, 32),  # MQA, non-power-of-2 head, tile spans pages
    (96, 6, 3, 16, F16, None, 12, 32, 16),  # window shorter than a query tile
    (128, 4, 4, 16, F16, FP8, None, 16, 16),  # fp8 cache
    (256, 2, 1, 8, F32, None, 40, 16, 8),  # head 256, window, tile smaller than a page
    (64, 6, 2, 16, F16, None, 9, 16, 16),  # 3 query heads a KV head: a tile of 5 tokens and a padding row
    (64, 32, 1, 16, F32, None, None, 16, 16),  # 32 query heads a KV head: the tile grows to one token's heads
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
                         [(64, 4, 2, F16, None), (80, 2, 1, F32, 7), (128, 4, 4, F16, None), (64, 10, 2, F16, 5)])
def test_varlen_on_fresh_kv_matches_twin(gen, head_dim, heads, kv_heads, dtype, window):
    q_lens = [1, *randint(gen, 2, 45, 2)]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    t = int(qsl[-1])
    q = randn(gen, t, heads, head_dim, dtype=dtype)
    k, v = randn(gen, t, kv_heads, head_dim, dtype=dtype), randn(gen, t, kv_heads, head_dim, dtype=dtype)
    out = poisoned(q.shape, dtype)
    varlen_attention(q, k, v, qsl, 0.1, window, out=out, block_m=16, block_n=16)
    assert_close(out, varlen_attention_ref(q, k, v, qsl, 0.1, window), TOL[dtype])


@pytest.mark.parametrize(("head_dim", "heads", "dtype", "block_n"), [(64, 4, F16, 16), (80, 2, F32, 16), (32, 12, F16, 32)])
def test_bidirectional_varlen_matches_twin(gen, head_dim, heads, dtype, block_n):
    """An encoder's attention: every query sees its whole sequence; lengths on and off the tile
    boundary, one shorter than a tile, and one of a single token."""
    q_lens = [1, block_n, 3 * block_n + 5, *randint(gen, 2, 45, 2)]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    t = int(qsl[-1])
    q = randn(gen, t, heads, head_dim, dtype=dtype)
    k, v = randn(gen, t, heads, head_dim, dtype=dtype), randn(gen, t, heads, head_dim, dtype=dtype)
    out = poisoned(q.shape, dtype)
    varlen_attention(q, k, v, qsl, head_dim**-0.5, out=out, block_m=16, block_n=block_n, causal=False)
    want = varlen_attention_ref(q, k, v, qsl, head_dim**-0.5, causal=False)
    assert_close(out, want, TOL[dtype])
    causal = varlen_attention_ref(q, k, v, qsl, head_dim**-0.5)
    assert (want - causal).abs().max() > 0.1  # the test can tell the two apart
