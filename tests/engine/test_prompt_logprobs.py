"""Prompt logprobs (what lm-eval's loglikelihood tasks read through `echo`) equal the
log-softmax of transformers' logits on the same weights (CPU, float32), however the prompt was
scheduled: in one step, in chunks, after a preemption, beside a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch

from benchmarks.parity import CONFIGS, hf_model, random_prompts
from pagoda_daemon import LLM, SamplingParams

LENGTHS = [1, 2, 17, 33, 48, 70, 95, 120, 9]  # more than the preemption config's cache holds at once


def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p is the log-distribution of token p + 1."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


@pytest.mark.parametrize("config_name", ["default", "chunked-prefill-16", "async-preemption", "shared-prefix-cached"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_prompt_logprobs_match_transformers(tiny_models, arch, config_name):
    path = tiny_models[arch]
    engine_kwargs, shared_prefix = CONFIGS[config_name]
    llm = LLM(path, dtype="float32", **{"num_kv_blocks": 256, "max_model_len": 512, **engine_kwargs})
    vocab = llm.engine.model_config.vocab_size
    seed = int(torch.randint(0, 2**31, ()).item())
    lengths = [max(n, shared_prefix + 1) for n in LENGTHS]
    prompts = random_prompts(vocab, lengths, seed=seed, shared_prefix=shared_prefix)
    if shared_prefix:  # a first request fills the cache with the shared prefix
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2))
    top = 3
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=top)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None, (seed, len(prompt))
        assert out.num_cached_tokens == 0  # prompt logprobs read no cached block
        if len(prompt) == 1:
            continue
        want = hf_prompt_logprobs(path, prompt)
        for p in range(1, len(prompt)):
            entry = got[p]
            token = prompt[p]
            assert entry[token] == pytest.approx(want[p - 1, token].item(), abs=1e-4), (seed, p)
            top_ids = want[p - 1].topk(top).indices.tolist()
            assert set(top_ids) <= set(entry) and len(entry) <= top + 1, (seed, p, entry)
            for t in top_ids:
                assert entry[t] == pytest.approx(want[p - 1, t].item(), abs=1e-4)
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks, "blocks leaked"
    if config_name == "async-preemption":
        assert llm.get_stats().num_preemptions > 0, "the cache was meant to be too small for the batch"


def test_prompt_logprobs_zero_gives_the_prompt_token_only(tiny_models):
    llm = LLM(tiny_models["llama"], num_kv_blocks=64, max_model_len=256)
    prompt = random_prompts(llm.engine.model_config.vocab_size, [20], seed=3)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]


def test_allowed_token_ids_and_bad_words_bind_sampling(tiny_models):
    llm = LLM(tiny_models["qwen3"], num_kv_blocks=64, max_model_len=256)
    vocab = llm.engine.model_config.vocab_size
    prompt = random_prompts(vocab, [12], seed=int(torch.randint(0, 2**31, ()).item()))[0]
    allowed = sorted(torch.randperm(vocab)[:5].tolist())
    for temperature in (0.0, 1.0):
        out = llm.generate([prompt], SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True,
                                                    allowed_token_ids=allowed))[0]
        assert set(out.outputs[0].token_ids) <= set(allowed)
    # greedy output without a ban, then ban its first token and a two-token word of it
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    first = free.token_ids[0]
    banned = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                   bad_words_token_ids=[[first]]))[0].outputs[0]
    assert first not in banned.token_ids
    pair = free.token_ids[2:4]
    if pair[0] != pair[1]:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                    bad_words_token_ids=[pair]))[0].outputs[0]
        assert out.token_ids[:3] == free.token_ids[:3] and out.token_ids[3] != pair[1]
