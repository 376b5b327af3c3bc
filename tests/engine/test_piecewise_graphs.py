"""Steps that carry prompts run piece by piece (worker/piecewise_graphs.py): on CPU the pieces run
without graphs, through the same static buffers and in the same order a GPU replays them, and
greedy tokens and prompt logprobs equal those of the one-pass forward (float32). The capture
itself needs a GPU: tests/gpu/test_cuda_graphs.py."""

from __future__ import annotations

import pytest
import torch

from benchmarks.parity import hf_greedy, random_prompts
from pagoda_daemon import LLM, SamplingParams
from pagoda_daemon.worker.piecewise_graphs import PiecewiseGraphRunner


def _generate(path: str, seed: int, piecewise: bool, sizes_seen: list[int] | None = None):
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=40,
              async_scheduling=True, pad_eager_steps=True, max_piecewise_graph_tokens=32)
    runner = llm.engine.core.executor.worker.runner
    if not piecewise:
        runner.piecewise = None  # one pass per step, padded as the pieces are
    else:
        assert runner.piecewise is not None and runner.piecewise.sizes[-1] == 32  # set up at start
        assert runner.piecewise.covered == set(runner.piecewise.sizes)
        if sizes_seen is not None:
            run = runner.piecewise.run
            runner.piecewise.run = lambda size, *a: sizes_seen.append(size) or run(size, *a)
    lengths = torch.randint(1, 90, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    prompts = random_prompts(llm.engine.model_config.vocab_size, lengths, seed=seed)
    prompts.append(prompts[0] + prompts[1])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params) + llm.generate(prompts[:2], params)  # then from the prefix cache
    core = llm.engine.core
    free = core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    core.shutdown()
    return prompts, [(o.outputs[0].token_ids, o.prompt_logprobs) for o in outs], free


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_piece_by_piece_gives_the_one_pass_tokens_and_transformers(tiny_models, arch):
    seed = int(torch.randint(0, 2**31, ()).item())
    seen: list[int] = []
    prompts, got, free = _generate(tiny_models[arch], seed, True, seen)
    _, want, _ = _generate(tiny_models[arch], seed, False)
    assert free, "blocks leaked"
    assert seen and set(seen) <= {1, 2, 4, 8, 16, 32}, seen  # steps up to 32 tokens, padded to the grid
    assert any(s >= 16 for s in seen), "no step carried a prompt chunk"
    for (tokens, plp), (want_tokens, want_plp) in zip(got, want, strict=True):
        assert tokens == want_tokens, seed
        for entry, want_entry in zip(plp, want_plp, strict=True):
            assert (entry is None) == (want_entry is None)
            if entry is not None:
                assert list(entry.values()) == pytest.approx(list(want_entry.values()), abs=1e-5), seed
    for prompt, (tokens, _) in zip(prompts, got):
        assert tokens == hf_greedy(tiny_models[arch], prompt, 8), seed


def test_no_piecewise_runner_where_it_does_not_apply(tiny_models):
    llm = LLM(tiny_models["qwen3"], dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=128,
              max_num_batched_tokens=40, pad_eager_steps=False)
    runner = llm.engine.core.executor.worker.runner
    assert runner.piecewise_runner() is None  # no token grid without padding
    llm.engine.core.shutdown()
    llm = LLM(tiny_models["qwen3"], dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=128,
              max_num_batched_tokens=40, pad_eager_steps=True, max_piecewise_graph_tokens=0)
    assert llm.engine.core.executor.worker.runner.piecewise_runner() is None
    llm.engine.core.shutdown()
    assert PiecewiseGraphRunner.covers.__doc__
