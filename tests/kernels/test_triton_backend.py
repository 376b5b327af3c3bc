"""TritonPagedAttention against TorchPagedAttention, on random paged batches of every step
kind the model runner produces: mixed decodes and prefills with cached prefixes,
decode-only, prefill-only, and the cache-less profiling pass."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interp import TOL, PagedBatch, assert_close, randint, randn

from pagoda_daemon.attention.backend import AttentionMetadata  # isort: skip
from pagoda_daemon.attention.torch_paged import TorchPagedAttention  # isort: skip
from pagoda_daemon.attention.triton_backend import TritonPagedAttention  # isort: skip


def _meta(b: PagedBatch, has_kv_cache=True) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=b.slot_mapping, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
        block_tables=b.block_tables, query_start_loc_cpu=b.query_start_loc.tolist(), seq_lens_cpu=b.seq_lens_list,
        max_query_len=b.max_query_len, max_seq_len=b.max_seq_len,
        is_prefill_only=all(c == 0 for c in b.ctx_lens), has_kv_cache=has_kv_cache,
    )


def _step_lens(gen, kind: str, page: int):
    if kind == "mixed":  # decodes, a chunk after a prefix hit, a fresh prefill, a ragged extend
        q_lens = [1, 1, page, randint(gen, 2, 30, 1)[0], randint(gen, 2, 20, 1)[0]]
        ctx = [randint(gen, 1, 60, 1)[0], page - 1, 2 * page, 0, randint(gen, 1, 40, 1)[0]]
    elif kind == "interleaved":  # a decode after a prefill goes with the prefill kernel's rows
        q_lens = [1, randint(gen, 2, 30, 1)[0], 1, 1, page]
        ctx = [randint(gen, 1, 60, 1)[0], 0, page + 3, 2 * page, 1]
    elif kind == "decode":
        q_lens, ctx = [1] * 4, [0, page, *randint(gen, 1, 90, 2)]
    else:  # prefill-only
        q_lens, ctx = randint(gen, 1, 40, 3), [0, 0, 0]
    return q_lens, ctx


@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "head_dim", "window"),
                         [(torch.float32, 4, 2, 64, None), (torch.float16, 8, 2, 80, None),
                          (torch.float16, 4, 1, 128, 24)])
@pytest.mark.parametrize("kind", ["mixed", "mixed-split", "interleaved", "decode", "prefill"])
def test_triton_backend_matches_torch_backend(gen, dtype, heads, kv_heads, head_dim, window, kind, monkeypatch):
    page = 16
    if kind == "mixed-split":  # the leading decodes on their own kernel (as from 32k context tokens on)
        monkeypatch.setattr(TritonPagedAttention, "split_decodes_from_context", 0)
        kind = "mixed"
    q_lens, ctx = _step_lens(gen, kind, page)
    b = PagedBatch(gen, q_lens, ctx, heads, kv_heads, head_dim, page, dtype)
    k = randn(gen, b.num_tokens, kv_heads, head_dim, dtype=dtype)
    v = randn(gen, b.num_tokens, kv_heads, head_dim, dtype=dtype)
    args = (heads, kv_heads, head_dim, head_dim**-0.5, window)
    cache_torch, cache_triton = b.kv_cache.clone(), b.kv_cache.clone()
    meta = _meta(b)
    ref = TorchPagedAttention(*args).forward(b.q, k, v, cache_torch, meta)
    out = TritonPagedAttention(*args).forward(b.q, k, v, cache_triton, meta)
    assert torch.equal(cache_triton, cache_torch)
    assert_close(out, ref, TOL[dtype])


def test_a_mixed_step_gives_its_leading_decodes_to_the_decode_kernel(gen, monkeypatch):
    """The decodes at the head of a mixed step go to the decode kernel (one plan for all
    layers), the rest to the extend kernel with its query offsets rebased; same output."""
    page, heads, kv_heads, head_dim = 16, 4, 2, 64
    b = PagedBatch(gen, [1, 1, 1, 9, 1], [40, page, 3, 7, 20], heads, kv_heads, head_dim, page, torch.float32)
    k, v = randn(gen, b.num_tokens, kv_heads, head_dim), randn(gen, b.num_tokens, kv_heads, head_dim)
    meta = _meta(b)
    context = (40 + 1) + (page + 1) + (3 + 1)  # each decode's cached tokens and its new one
    assert meta.num_leading_decodes == 3 and meta.leading_decode_context == context
    backend = TritonPagedAttention(heads, kv_heads, head_dim, head_dim**-0.5)
    backend.split_decodes_from_context = context  # their context reaches the threshold
    calls: list[tuple[str, int]] = []
    decode, extend = backend._decode, backend._extend
    monkeypatch.setattr(backend, "_decode", lambda q, *a, **kw: calls.append(("decode", q.shape[0])) or decode(q, *a, **kw))
    monkeypatch.setattr(backend, "_extend", lambda q, *a, **kw: calls.append(("extend", q.shape[0])) or extend(q, *a, **kw))
    cache = b.kv_cache.clone()
    out = backend.forward(b.q, k, v, cache, meta)
    out2 = backend.forward(b.q, k, v, cache, meta)  # a second layer: the plan and offsets are reused
    assert calls == [("decode", 3), ("extend", 10)] * 2
    assert torch.equal(meta.backend_state["rest"][0].cpu(), torch.tensor([0, 9, 10], dtype=torch.int32))
    ref = TorchPagedAttention(heads, kv_heads, head_dim, head_dim**-0.5).forward(b.q, k, v, b.kv_cache.clone(), meta)
    assert_close(out, ref, TOL[torch.float32])
    assert torch.equal(out, out2)
    # one context token short of the threshold: the whole step on the extend kernel, same output
    calls.clear()
    backend.split_decodes_from_context += 1
    meta = _meta(b)
    out3 = backend.forward(b.q, k, v, b.kv_cache.clone(), meta)
    assert calls == [("extend", 13)]
    assert_close(out3, ref, TOL[torch.float32])


@pytest.mark.parametrize("decodes", [1, 2, 3, 4, 5])
def test_the_rest_of_a_mixed_step_reaches_the_extend_kernel_aligned(gen, monkeypatch, decodes):
    """Triton compiles a kernel variant per 16-byte alignment of its pointer arguments and per
    integer argument (1, a multiple of 16, other): however many decodes lead a step, what the
    extend kernel gets is aligned and its block table keeps the engine's row stride (the model
    runner hands the backend a column slice of its full-width table), so it runs the variant the
    warm-up compiled."""
    page, heads, kv_heads, head_dim = 16, 4, 2, 64
    b = PagedBatch(gen, [1] * decodes + [5, 1], [9] * decodes + [7, 20], heads, kv_heads, head_dim, page,
                   torch.float32)
    k, v = randn(gen, b.num_tokens, kv_heads, head_dim), randn(gen, b.num_tokens, kv_heads, head_dim)
    backend = TritonPagedAttention(heads, kv_heads, head_dim, head_dim**-0.5)
    backend.split_decodes_from_context = 0  # the split, whatever the context
    seen: list[torch.Tensor] = []
    extend = backend._extend

    def spy(*args, **kwargs):
        seen.extend(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        return extend(*args, **kwargs)

    monkeypatch.setattr(backend, "_extend", spy)
    meta = _meta(b)
    width = 64  # the engine's table: max_model_len / page columns, of which a step uses the first few
    full = torch.zeros(b.block_tables.shape[0], width, dtype=torch.int32)
    full[:, : b.block_tables.shape[1]] = b.block_tables
    meta.block_tables = full[:, : b.block_tables.shape[1]]
    backend.forward(b.q, k, v, b.kv_cache.clone(), meta)
    assert len(seen) >= 6 and all(t.data_ptr() % 16 == 0 for t in seen), [t.data_ptr() % 16 for t in seen]
    (tables,) = [t for t in seen if t.dim() == 2 and t.dtype == torch.int32]
    assert tables.stride(0) == width and torch.equal(tables, b.block_tables[decodes:])


def test_triton_backend_without_cache(gen):
    """The memory-profiling pass: no cache, attention over the fresh K/V."""
    b = PagedBatch(gen, randint(gen, 1, 30, 3), [0, 0, 0], 4, 2, 64, 16, torch.float32)
    k, v = randn(gen, b.num_tokens, 2, 64), randn(gen, b.num_tokens, 2, 64)
    meta = _meta(b, has_kv_cache=False)
    ref = TorchPagedAttention(4, 2, 64, 0.125).forward(b.q, k, v, None, meta)
    out = TritonPagedAttention(4, 2, 64, 0.125).forward(b.q, k, v, None, meta)
    assert_close(out, ref, TOL[torch.float32])


def test_triton_backend_fp8_cache(gen):
    """An fp8 cache: the write quantises with the backend's scales and both reads dequantise."""
    from pagoda_kernels.reference import paged_attention_ref, write_kv_cache_ref

    b = PagedBatch(gen, [1, 5, 1], [33, 16, 7], 4, 2, 64, 16, torch.float16, torch.float8_e4m3fn)
    k = randn(gen, b.num_tokens, 2, 64, dtype=torch.float16)
    v = randn(gen, b.num_tokens, 2, 64, dtype=torch.float16)
    backend = TritonPagedAttention(4, 2, 64, 0.125)
    backend.k_scale, backend.v_scale = 0.02, 0.05
    expected = b.kv_cache.clone()
    write_kv_cache_ref(k, v, expected, b.slot_mapping, 0.02, 0.05)
    out = backend.forward(b.q, k, v, b.kv_cache, _meta(b))
    assert torch.equal(b.kv_cache.view(torch.uint8), expected.view(torch.uint8))
    ref = paged_attention_ref(b.q, expected, b.block_tables, b.query_start_loc, b.seq_lens, 0.125, None, 0.02, 0.05)
    assert_close(out, ref, TOL[torch.float16])


@pytest.mark.parametrize("pieces", [False, True], ids=["one-pass", "pieces"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_greedy_tokens_identical_with_triton_backend(tiny_models, monkeypatch, arch, pieces):
    """The whole engine (chunked prefill, prefix caching) in float32: the Triton backend
    gives the torch backend's greedy tokens, which are transformers' (tests/engine). With
    ``pieces`` the Triton engine pads its steps to the token grid and runs those that carry
    prompts piece by piece, as the GPU's piecewise graphs do (worker/piecewise_graphs.py): the
    kernels' RoPE in place, attention into the pieces' static buffers."""
    import pagoda_daemon.attention as attention
    from benchmarks.parity import random_prompts
    from pagoda_daemon import LLM, SamplingParams

    torch_backend = attention.get_attention_backend
    tokens = {}
    for name in ("torch", "triton"):
        chosen = (lambda n, d: TritonPagedAttention) if name == "triton" else torch_backend
        monkeypatch.setattr(attention, "get_attention_backend", chosen)
        llm = LLM(tiny_models[arch], dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256,
                  max_num_batched_tokens=32, enable_prefix_caching=True, numa_policy="none",
                  pad_eager_steps=pieces and name == "triton")
        runner = llm.engine.core.executor.worker.runner
        assert (runner.piecewise is not None) == (pieces and name == "triton")
        prompts = random_prompts(llm.engine.model_config.vocab_size, [5, 40, 17, 23], seed=1, shared_prefix=4)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        tokens[name] = [o.outputs[0].token_ids for o in outs]
        attn = llm.engine.core.executor.worker.runner.model.model.layers[0].self_attn.attn
        assert isinstance(attn, TritonPagedAttention if name == "triton" else TorchPagedAttention)
    assert tokens["triton"] == tokens["torch"]
