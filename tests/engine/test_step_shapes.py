"""Eager steps padded to a grid of token counts (worker/step_shapes.py): the grid's bounds, and
an engine that pads giving the same tokens and prompt logprobs as one that does not (CPU,
float32; padding is the CUDA default, forced on here)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.parity import random_prompts
from pagoda_daemon import LLM, SamplingParams
from pagoda_daemon.worker import step_shapes
from pagoda_daemon.worker.step_shapes import lm_head_sizes, padded, token_sizes


@pytest.mark.parametrize("max_tokens", [1, 2, 16, 40, 255, 256, 257, 1000, 8192, 16384, 65536])
def test_every_count_pads_to_a_size_at_most_an_eighth_larger(max_tokens):
    sizes = token_sizes(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_tokens
    for n in range(1, max_tokens + 1):
        p = padded(sizes, n)
        assert n <= p <= max_tokens
        # small steps as the decode graphs pad (under 16 rows more), big ones by at most 1/8
        assert p - n < 16 if n <= step_shapes.SMALL_STEP_TOKENS else (p - n) * 8 <= n
    assert len(token_sizes(8192)) == 60  # what start-up warms for the default budget


def test_counts_past_the_grid_and_the_lm_head_grid():
    assert padded([1, 2, 4], 5) == 5
    assert padded([], 7) == 7
    assert lm_head_sizes(256)[:5] == [1, 2, 4, 8, 16] and lm_head_sizes(256)[-1] == 256
    assert lm_head_sizes(1) == [1]


def _run(path: str, pad: bool, seed: int, rows: list[tuple[int, int]] | None = None):
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=40,
              async_scheduling=True, pad_eager_steps=pad, max_piecewise_graph_tokens=0)  # one pass a step
    if rows is not None:  # (rows the model ran, the step's own tokens), per forward pass
        def record(_module, args):
            rows.append((args[0].shape[0], args[3].num_tokens))
        llm.engine.core.executor.worker.runner.model.register_forward_pre_hook(record)
    vocab = llm.engine.model_config.vocab_size
    lengths = torch.randint(1, 90, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    prompts = random_prompts(vocab, lengths, seed=seed)
    prompts.append(prompts[0] + prompts[1])  # a prefix-cache hit on a full block or more, when long enough
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, prompt_logprobs=2)
    first = llm.generate(prompts, params)
    again = llm.generate(prompts[:2], params)  # served from the prefix cache
    core = llm.engine.core
    free = core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    core.shutdown()
    return [(o.outputs[0].token_ids, o.prompt_logprobs) for o in first + again], free


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_padded_steps_give_the_same_tokens_and_prompt_logprobs(tiny_models, arch):
    rows: list[tuple[int, int]] = []
    seed = int(torch.randint(0, 2**31, ()).item())
    got, free = _run(tiny_models[arch], True, seed, rows)
    want, _ = _run(tiny_models[arch], False, seed)
    sizes = token_sizes(40)
    assert any(ran > own for ran, own in rows), "no step was padded"
    assert all(ran == padded(sizes, own) for ran, own in rows)
    assert free, "blocks leaked"
    for (tokens, plp), (want_tokens, want_plp) in zip(got, want, strict=True):
        assert tokens == want_tokens, seed
        assert len(plp) == len(want_plp)
        for entry, want_entry in zip(plp, want_plp):
            assert (entry is None) == (want_entry is None)
            if entry is not None:
                assert entry.keys() == want_entry.keys()
                assert list(entry.values()) == pytest.approx(list(want_entry.values()), abs=1e-5), seed


def test_warm_up_runs_each_gemm_once_at_every_size(tiny_models, monkeypatch):
    llm = LLM(tiny_models["qwen3_moe"], dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=128,
              max_num_batched_tokens=40, max_num_seqs=8)
    model = llm.engine.core.executor.worker.runner.model
    calls: list[tuple[int, tuple[int, ...]]] = []
    real = step_shapes.F.linear
    monkeypatch.setattr(step_shapes.F, "linear", lambda x, w, b=None: calls.append((x.shape[0], tuple(w.shape)))
                        or real(x, w, b))
    step_shapes.warm_gemms(model, token_sizes(40), lm_head_sizes(8))
    lm_head = tuple(model.lm_head.weight.shape)
    shapes = {w for _, w in calls}
    # q/k/v, o, the router, the dense MLP's two if any, and the LM head: each once per size
    assert lm_head in shapes and len(shapes) >= 4
    for w in shapes:
        counts = sorted(n for n, s in calls if s == w)
        assert counts == (lm_head_sizes(8) if w == lm_head else token_sizes(40))
    llm.engine.core.shutdown()
