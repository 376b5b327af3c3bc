"""Greedy output is token-identical to transformers' generate on the same weights (CPU, float32).

Each case runs a batch of 9 prompts of different lengths (1 token to several blocks and
several prefill chunks, in shuffled arrival order) through one engine configuration and
compares every generated token with transformers' greedy `generate`.
"""

from __future__ import annotations

import pytest

from benchmarks.parity import CONFIGS, LENGTHS, hf_greedy, random_prompts, run_case
from pagoda_daemon import LLM, SamplingParams


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_matches_transformers(tiny_models, arch, config_name):
    r = run_case(tiny_models[arch], arch, "float32", "cpu", config_name, max_tokens=24)
    assert len(r["first_divergence"]) == len(LENGTHS) >= 8
    assert max(r["prompt_lengths"]) > 4 * 16  # several blocks, and several prefill chunks
    assert r["first_divergence"] == [None] * len(LENGTHS), r
    assert r["finish_reasons"] == ["length"]
    assert r["all_blocks_free"], "blocks leaked"
    if config_name in ("tiny-cache-preemption", "async-preemption"):
        assert r["preemptions"] > 0, "the cache was meant to be too small for the batch"
    if config_name == "shared-prefix-cached":
        assert r["prefix_cache_hits"] >= 2 * 16 * (len(LENGTHS) - 1), r
    if config_name == "no-prefix-caching":
        assert r["prefix_cache_hits"] == 0


def test_repeated_prompt_is_served_from_prefix_cache_with_same_output(tiny_models):
    path = tiny_models["llama"]
    llm = LLM(path, num_kv_blocks=64, max_model_len=512)
    prompt = random_prompts(llm.engine.model_config.vocab_size, [75], seed=7)[0]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    hits_before = llm.get_stats().prefix_cache.hits
    second = llm.generate([prompt], params)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(path, prompt, 10)
    assert llm.get_stats().prefix_cache.hits - hits_before == 64  # 4 full blocks of the 75-token prompt
    assert second.num_cached_tokens == 64
