"""Pagoda's Triton kernels compiled on a GPU, over the full grid of shapes, against their
pure-torch twins computed in float64.

Relative error ||out - ref|| / ||ref||: float32 far under 1e-3 (asserted < 1e-4),
bfloat16/float16 operands < 1e-2, never NaN. Outputs are poisoned (NaN) before each run.
Skipped without CUDA (CPU CI runs the same kernels under the interpreter:
tests/kernels/). Run on the GPU machine: `pytest tests/gpu/test_kernels_gpu.py -q`.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA (or ROCm) device", allow_module_level=True)
pytest.importorskip("triton")

from pagoda_kernels.activation import silu_and_mul
from pagoda_kernels.cache_write import write_kv_cache
from pagoda_kernels.decode_attention import decode_block_n, paged_decode_attention, plan_decode
from pagoda_kernels.fused_moe import fused_moe, route_topk
from pagoda_kernels.gemv import gemv
from pagoda_kernels.kv_copy import load_blocks
from pagoda_kernels.prefill_attention import paged_prefill_attention, varlen_attention
from pagoda_kernels.reference import (
    gemv_ref,
    load_blocks_ref,
    moe_ref,
    paged_attention_ref,
    quantize_fp8_ref,
    rmsnorm_ref,
    rope_cos_sin_ref,
    rope_neox_ref,
    route_topk_ref,
    silu_and_mul_ref,
    varlen_attention_ref,
    write_kv_cache_ref,
)
from pagoda_kernels.rmsnorm import rmsnorm
from pagoda_kernels.rope import rope_neox

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HEAD_DIMS = [64, 80, 96, 128, 256]
GQA = [(32, 8), (16, 16), (8, 1)]  # GQA 4, MHA, MQA
DTYPES = [F32, BF16, F16]
LIMIT = {F32: 1e-4, BF16: 1e-2, F16: 1e-2}


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "NaN in the output"
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert err < LIMIT[dtype], f"relative error {err:.3g} (limit {LIMIT[dtype]})"


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


class Batch:
    def __init__(self, q_lens, ctx_lens, heads, kv_heads, head_dim, page, dtype, cache_dtype=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.seq_lens_list = [a + b for a, b in zip(q_lens, ctx_lens)]
        per_seq = [-(-n // page) for n in self.seq_lens_list]
        num_blocks = sum(per_seq) + 2
        perm = torch.randperm(num_blocks, generator=g).tolist()
        tables = torch.zeros((len(q_lens), max(per_seq)), dtype=torch.int32)
        for i, nb in enumerate(per_seq):
            tables[i, :nb] = torch.tensor(perm[:nb])
            perm = perm[nb:]
        self.block_tables = tables.to(DEV)
        self.query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                                            device=DEV)
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int32, device=DEV)
        cache = torch.randn((2, num_blocks, page, kv_heads, head_dim), generator=g)
        self.kv_cache = (cache * 4).to(cache_dtype).to(DEV) if cache_dtype else cache.to(dtype).to(DEV)
        self.q = torch.randn((sum(q_lens), heads, head_dim), generator=g).to(dtype).to(DEV)
        self.max_query_len, self.max_seq_len = max(q_lens), max(self.seq_lens_list)


def _ragged(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (n,), generator=g).tolist()


# ---- decode -----------------------------------------------------------------------------

DECODE_GRID = [(d, h, kvh, dt) for d in HEAD_DIMS for h, kvh in GQA for dt in DTYPES]


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "dtype"), DECODE_GRID)
def test_decode_grid(head_dim, heads, kv_heads, dtype):
    ctx = [0, 15, 16, 17, *_ragged(5, 1, 2500, head_dim + heads)]
    b = Batch([1] * len(ctx), ctx, heads, kv_heads, head_dim, 16, dtype, seed=head_dim * heads)
    out = nan_like(b.q)
    paged_decode_attention(b.q, b.kv_cache, b.block_tables, b.seq_lens, head_dim**-0.5, out=out)
    ref = paged_attention_ref(b.q.double(), b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens,
                              head_dim**-0.5)
    check(out, ref, dtype)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize(("page", "chunking", "window", "fp8"),
                         [(16, "whole", None, False), (32, "fine", None, False), (64, "default", 300, False),
                          (128, "fine", 1000, False), (16, "default", None, True), (16, "fine", 200, True)])
def test_decode_variants(head_dim, page, chunking, window, fp8):
    dtype = BF16
    ctx = _ragged(8, 1, 3000, page + head_dim)
    b = Batch([1] * 8, ctx, 32, 8, head_dim, page, dtype, FP8 if fp8 else None, seed=page)
    scales = (0.6, 0.3) if fp8 else (None, None)
    out = nan_like(b.q)
    plan = None
    if chunking != "default":  # every sequence one chunk, or chunks of one tile
        work_per_sm, min_tiles = (1, 1 << 20) if chunking == "whole" else (1 << 12, 1)
        plan = plan_decode(b.seq_lens, 8, decode_block_n(head_dim, dtype), work_per_sm, min_tiles)
    paged_decode_attention(b.q, b.kv_cache, b.block_tables, b.seq_lens, head_dim**-0.5, window, *scales,
                           plan=plan, out=out)
    ref = paged_attention_ref(b.q.double(), b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens,
                              head_dim**-0.5, window, *scales)
    check(out, ref, dtype)


def test_decode_plan_shared_by_layers_in_a_cuda_graph():
    """256 sequences in one-tile chunks (tens of thousands of programs arriving at once), eight
    layers on one plan in a CUDA graph replayed on new queries: every layer equals the twin, so
    each (sequence, KV head)'s last chunk to arrive saw every partial and left its count at 0
    for the next layer (the plan kernel, outside the graph, zeroes them only once)."""
    seed = int(torch.randint(2**31, ()))
    head_dim, dtype, layers = 128, BF16, 8
    b = Batch([1] * 256, _ragged(256, 1, 2000, seed), 16, 2, head_dim, 16, dtype, seed=seed)
    plan = plan_decode(b.seq_lens, 2, decode_block_n(head_dim, dtype), 1 << 12, 1)
    assert int(plan.num_chunks.min()) > 1 or int(b.seq_lens.min()) <= decode_block_n(head_dim, dtype)
    queries = [torch.randn_like(b.q) for _ in range(layers)]
    outs = [nan_like(b.q) for _ in range(layers)]

    def run():
        for q, out in zip(queries, outs):
            paged_decode_attention(q, b.kv_cache, b.block_tables, b.seq_lens, head_dim**-0.5, plan=plan, out=out)

    run()  # compile and allocate the partials outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _replay in range(3):
        for q, out in zip(queries, outs):
            q.copy_(torch.randn_like(q))
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for q, out in zip(queries, outs):
            check(out, paged_attention_ref(q.double(), b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens,
                                           head_dim**-0.5), dtype)
        assert not plan.arrivals.any()


# ---- prefill / extend ---------------------------------------------------------------------


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "dtype"), DECODE_GRID)
def test_prefill_grid(head_dim, heads, kv_heads, dtype):
    q_lens = [1, 16, 300, *_ragged(3, 2, 700, head_dim)]
    ctx = [900, 32, 0, *_ragged(3, 0, 600, heads)]
    b = Batch(q_lens, ctx, heads, kv_heads, head_dim, 16, dtype, seed=head_dim + heads)
    out = nan_like(b.q)
    paged_prefill_attention(b.q, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, head_dim**-0.5,
                            max_query_len=b.max_query_len, out=out)
    ref = paged_attention_ref(b.q.double(), b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens,
                              head_dim**-0.5)
    check(out, ref, dtype)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize(("page", "window", "fp8"), [(32, 256, False), (16, None, True), (128, 100, True)])
def test_prefill_variants(head_dim, page, window, fp8):
    dtype = BF16
    q_lens, ctx = [5, 400, 129, 1], [700, 0, 1, 64]
    b = Batch(q_lens, ctx, 16, 4, head_dim, page, dtype, FP8 if fp8 else None, seed=head_dim)
    scales = (0.5, 0.2) if fp8 else (None, None)
    out = nan_like(b.q)
    paged_prefill_attention(b.q, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, head_dim**-0.5, window,
                            *scales, max_query_len=b.max_query_len, out=out)
    ref = paged_attention_ref(b.q.double(), b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens,
                              head_dim**-0.5, window, *scales)
    check(out, ref, dtype)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_long_causal(head_dim, dtype):
    g = torch.Generator().manual_seed(1)
    q_lens = [4096, 1, 777]
    qsl = torch.tensor([0, 4096, 4097, 4874], dtype=torch.int32, device=DEV)
    t = sum(q_lens)
    q = torch.randn((t, 8, head_dim), generator=g).to(dtype).to(DEV)
    k = torch.randn((t, 2, head_dim), generator=g).to(dtype).to(DEV)
    v = torch.randn((t, 2, head_dim), generator=g).to(dtype).to(DEV)
    out = nan_like(q)
    varlen_attention(q, k, v, qsl, head_dim**-0.5, max_query_len=4096, out=out)
    check(out, varlen_attention_ref(q.double(), k.double(), v.double(), qsl, head_dim**-0.5), dtype)


# ---- cache write ----------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", [F32, BF16, F16, FP8])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_cache_write(cache_dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    num_blocks, page, kvh = 64, 16, 8
    t = 700
    qkv = (torch.randn((t, 3 * kvh, head_dim), generator=g) * 3).to(BF16).to(DEV)
    k, v = qkv[:, kvh:2 * kvh], qkv[:, 2 * kvh:]
    slots = torch.randperm(num_blocks * page, generator=g)[:t].to(DEV)
    slots[::97] = -1
    cache = torch.full((2, num_blocks, page, kvh, head_dim), 0x7F, dtype=torch.uint8, device=DEV)
    cache = cache.view(cache_dtype) if cache_dtype == FP8 else cache.to(torch.float32).fill_(float("nan")).to(cache_dtype)
    expected = cache.cpu().clone()
    scales = (0.05, 0.1) if cache_dtype == FP8 else (None, None)
    write_kv_cache(k, v, cache, slots, *scales)
    write_kv_cache_ref(k.cpu(), v.cpu(), expected, slots.cpu(), *scales)
    assert torch.equal(cache.cpu().view(torch.uint8), expected.view(torch.uint8))


def test_fp8_rounding_matches_torch_everywhere():
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, torch.randn(10_000) * 100, torch.randn(10_000) * 1e-3])
    x = x[: x.numel() // 64 * 64].view(-1, 1, 64).to(DEV)
    cache = torch.empty((2, 1, x.shape[0], 1, 64), dtype=FP8, device=DEV)
    write_kv_cache(x, x, cache, torch.arange(x.shape[0], device=DEV), 1.0, 1.0)
    assert torch.equal(cache[0, 0].view(torch.uint8), quantize_fp8_ref(x, 1.0, FP8).view(torch.uint8))


@pytest.mark.parametrize("dtype", [BF16, FP8])
@pytest.mark.parametrize("max_programs", [0, 32])
def test_load_blocks_from_pinned_host(dtype, max_programs):
    """The host tier's loads: pinned slots read by the kernel over PCIe, every layer of 200
    scattered blocks into scattered cache blocks, byte for byte (past 2**31 bytes of cache)."""
    g = torch.Generator().manual_seed(max_programs)
    shape = (28, 2, 16, 8, 256)  # 256 bytes a row: head_dim 128 in bf16, 256 in fp8
    host = torch.randint(0, 256, (300, *shape), dtype=torch.uint8, generator=g).pin_memory().view(dtype)
    cache = torch.full((*shape[:2], 1200, *shape[2:]), 0x7F, dtype=torch.uint8, device=DEV).view(dtype)
    slots = torch.randperm(300, generator=g)[:200]
    blocks = torch.randperm(1200, generator=g)[:200]
    expected = cache.clone()
    load_blocks(host, slots.to(DEV), cache, blocks.to(DEV), max_programs=max_programs)
    load_blocks_ref(host, slots, expected, blocks)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


# ---- norms, rope, activation -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1024, 2048, 4096, 5120, 8192])
def test_rmsnorm(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn((257, hidden), generator=g).to(dtype).to(DEV)
    r = torch.randn((257, hidden), generator=g).to(dtype).to(DEV)
    w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype).to(DEV)
    out, res = rmsnorm(x, w, 1e-6, residual=r)
    _, ref_res = rmsnorm_ref(x.cpu(), w.cpu(), 1e-6, residual=r.cpu())
    assert torch.equal(res.cpu(), ref_res)
    check(out.cpu(), rmsnorm_ref(ref_res.double(), w.cpu().double(), 1e-6), dtype)
    check(rmsnorm(x, w, 1e-6), rmsnorm_ref(x.double(), w.double(), 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(d, h, kvh) for d in HEAD_DIMS for h, kvh in GQA])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm-rope"])
def test_rope(dtype, head_dim, heads, kv_heads, qk_norm):
    g = torch.Generator().manual_seed(head_dim)
    cos, sin = rope_cos_sin_ref(head_dim, 8192)
    cos, sin = cos.to(DEV), sin.to(DEV)
    pos = torch.randint(0, 8192, (333,), generator=g).to(DEV)
    q = (3 * torch.randn((333, heads, head_dim), generator=g)).to(dtype).to(DEV)
    k = (3 * torch.randn((333, kv_heads, head_dim), generator=g)).to(dtype).to(DEV)
    ws = [(1 + 0.2 * torch.randn(head_dim, generator=g)).to(dtype).to(DEV) for _ in range(2)] if qk_norm else []
    a, b = rope_neox(pos, q, k, cos, sin, None, None, *ws)
    a2, b2 = rope_neox_ref(pos, q.double(), k.double(), cos.double(), sin.double(), *[w.double() for w in ws])
    check(a, a2, dtype)
    check(b, b2, dtype)
    if dtype != F32:  # same rounding steps as the engine's torch code: nearly always identical
        a3, _ = rope_neox_ref(pos, q, k, cos, sin, *ws)
        assert (a != a3).float().mean() < (2e-2 if qk_norm else 1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn((300, 2 * 6144), generator=g) * 3).to(dtype).to(DEV)
    check(silu_and_mul(x), silu_and_mul_ref(x.double()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("n, k, silu_mul", [(6144, 4096, False), (4096, 14336, True), (32000, 4096, False),
                                            (1000, 1000, False)])
def test_gemv(dtype, rows, n, k, silu_mul):
    """Llama-8B's qkv, down (activation fused) and a vocabulary; 1000 x 1000 hangs over every tile."""
    g = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    w = (torch.randn((n, k), generator=g) * k**-0.5).to(dtype).to(DEV)
    x = (torch.randn((rows, 2 * k if silu_mul else k), generator=g) * 2).to(dtype).to(DEV)
    out = torch.full((rows, n), float("nan"), dtype=dtype, device=DEV)
    gemv(x, w, out=out, silu_mul=silu_mul)
    ref = gemv_ref(x.double(), w.double(), silu_mul=silu_mul)
    check(out, ref, dtype)


# ---- fused MoE -------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 16, 300, 2048, 4100])  # 4,100: prompt-sized tiles (128 x 256), a ragged tail
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_fused_moe_qwen3_30b_shapes(tokens, dtype):
    g = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    x = torch.randn((tokens, hidden), generator=g).to(dtype).to(DEV)
    w13 = (torch.randn((experts, 2 * inter, hidden), generator=g) * hidden**-0.5).to(dtype).to(DEV)
    w2 = (torch.randn((experts, hidden, inter), generator=g) * inter**-0.5).to(dtype).to(DEV)
    logits = torch.randn((tokens, experts), generator=g).to(DEV)
    w, ids = route_topk(logits, top_k, True)
    rw, rids = route_topk_ref(logits, top_k, True)
    assert torch.equal(ids.long(), rids)
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)
    out = fused_moe(x, w13, w2, w, ids)
    check(out, moe_ref(x.double(), w13.double(), w2.double(), rw.double(), rids), dtype)


@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_fused_moe_expert_parallel_shards_qwen3_30b_shapes(tokens, dtype):
    """Two expert-parallel ranks' outputs (64 experts each; tokens routed to the other rank
    add nothing) sum to the whole MoE."""
    from pagoda_kernels.fused_moe import moe

    g = torch.Generator().manual_seed(tokens + 7)
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    x = torch.randn((tokens, hidden), generator=g).to(dtype).to(DEV)
    w13 = (torch.randn((experts, 2 * inter, hidden), generator=g) * hidden**-0.5).to(dtype).to(DEV)
    w2 = (torch.randn((experts, hidden, inter), generator=g) * inter**-0.5).to(dtype).to(DEV)
    logits = torch.randn((tokens, experts), generator=g).to(DEV)
    rw, rids = route_topk_ref(logits, top_k, True)
    half = experts // 2
    out = sum(moe(x, logits, w13[r * half:(r + 1) * half].contiguous(), w2[r * half:(r + 1) * half].contiguous(),
                  top_k, True, first_expert=r * half).float() for r in range(2))
    check(out.to(dtype), moe_ref(x.double(), w13.double(), w2.double(), rw.double(), rids), dtype)


def test_fused_moe_expert_parallel_shard_in_a_cuda_graph():
    """An expert-parallel rank's MoE (other ranks' experts skipped) captured in a CUDA graph, as
    decode steps are, and replayed on new inputs: its alignment once copied a host scalar, which
    capture refuses (2 × H100, 2026-11-25)."""
    from pagoda_kernels.fused_moe import moe

    g = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    experts, top_k, hidden, inter, tokens, dtype = 16, 4, 256, 128, 8, BF16
    half = experts // 2
    w13 = (torch.randn((half, 2 * inter, hidden), generator=g) * hidden**-0.5).to(dtype).to(DEV)
    w2 = (torch.randn((half, hidden, inter), generator=g) * inter**-0.5).to(dtype).to(DEV)
    x = torch.randn((tokens, hidden), generator=g).to(dtype).to(DEV)
    logits = torch.randn((tokens, experts), generator=g).to(DEV)
    run = lambda: moe(x, logits, w13, w2, top_k, True, first_expert=half)  # noqa: E731
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_(torch.randn((tokens, hidden), generator=g).to(dtype))
    logits.copy_(torch.randn((tokens, experts), generator=g))
    graph.replay()
    torch.cuda.synchronize()
    check(out, run(), dtype)


# ---- the attention backend ---------------------------------------------------------------------


@pytest.mark.parametrize("split", [False, True], ids=["extend", "split"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_triton_backend_matches_torch_backend(dtype, split):
    """A mixed step: its two leading decodes on the extend kernel with the prompts, or (split) on
    the decode kernel before the prompts' extend kernel."""
    from pagoda_daemon.attention.backend import AttentionMetadata
    from pagoda_daemon.attention.torch_paged import TorchPagedAttention
    from pagoda_daemon.attention.triton_backend import TritonPagedAttention

    q_lens, ctx = [1, 1, 64, 300, 7], [500, 15, 128, 0, 33]
    b = Batch(q_lens, ctx, 16, 4, 128, 16, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    k = torch.randn((b.q.shape[0], 4, 128), generator=g).to(dtype).to(DEV)
    v = torch.randn_like(k)
    tables = b.block_tables.cpu()
    slots = [int(tables[i, p // 16]) * 16 + p % 16 for i, (ql, c) in enumerate(zip(q_lens, ctx))
             for p in range(c, c + ql)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEV), query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
        block_tables=b.block_tables, query_start_loc_cpu=b.query_start_loc.tolist(), seq_lens_cpu=b.seq_lens_list,
        max_query_len=b.max_query_len, max_seq_len=b.max_seq_len)
    c1, c2 = b.kv_cache.clone(), b.kv_cache.clone()
    ref = TorchPagedAttention(16, 4, 128, 128**-0.5).forward(b.q, k, v, c1, meta)
    triton = TritonPagedAttention(16, 4, 128, 128**-0.5)
    if split:
        triton.split_decodes_from_context = 0
    out = triton.forward(b.q, k, v, c2, meta)
    assert torch.equal(c1, c2)
    check(out, ref, dtype)


# ---- sampling ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_sampling_greedy_rows_are_argmax(batch, dtype):
    """A real vocabulary (151,936): temperature-0 rows equal torch.argmax, ties included."""
    from pagoda_kernels.sampling import sample_tokens

    gen = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, 151936, generator=gen) * 3).to(dtype).cuda()
    logits[0, 151935] = logits[0, 7] = logits[0].max() + 1  # a tie: the lower index wins
    out = sample_tokens(logits, torch.zeros(batch, device="cuda"), seed=batch)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_sampling_follows_softmax_over_temperature():
    """20,000 rows of the same 12 logits at T = 0.7: frequencies within 0.01 of softmax(l / T)
    and far from softmax(l) (the assertion could fail if temperature were ignored)."""
    from pagoda_kernels.sampling import sample_tokens

    gen = torch.Generator().manual_seed(3)
    row = torch.randn(12, generator=gen) * 2
    logits = row.repeat(20000, 1).to(torch.bfloat16).cuda()
    temp = torch.full((20000,), 0.7, device="cuda")
    freq = torch.bincount(sample_tokens(logits, temp, seed=11), minlength=12).float().cpu() / 20000
    want = (logits[0].float().cpu() / 0.7).softmax(-1)
    assert (freq - want).abs().max() < 0.01
    assert (freq - logits[0].float().cpu().softmax(-1)).abs().max() > 0.03
