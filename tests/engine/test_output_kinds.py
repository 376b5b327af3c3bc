"""Outputs as deltas: a streamed request's outputs carry only what is new, so the work per
output does not grow with the output's length; put together they are exactly the cumulative
output, stop strings across output boundaries included."""

from __future__ import annotations

import random

import pytest

from pagoda_daemon import LLM, SamplingParams
from pagoda_daemon.outputs import RequestOutputKind


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], num_kv_blocks=128, max_model_len=256)


def run(llm: LLM, prompt: list[int], params: SamplingParams, kind: RequestOutputKind):
    engine = llm.engine
    # Every run computes its prompt afresh: a prefix-cache hit takes another path through the
    # kernels, equal in tokens but not bit-equal in logprobs, and the runs are compared exactly.
    assert engine.core.kv_cache.reset_prefix_cache()
    rid = engine.add_request(prompt, params, output_kind=kind)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_deltas_add_up_to_the_cumulative_output_and_never_grow(llm):
    rng = random.Random()
    prompt = [rng.randrange(3, llm.engine.model_config.vocab_size) for _ in range(rng.randrange(4, 30))]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, logprobs=2)
    cumulative = run(llm, prompt, params, RequestOutputKind.CUMULATIVE)[-1].outputs[0]
    deltas = [o.outputs[0] for o in run(llm, prompt, params, RequestOutputKind.DELTA)]
    assert max(len(d.token_ids) for d in deltas) == 1  # one token per step: constant work per output
    assert [t for d in deltas for t in d.token_ids] == cumulative.token_ids
    assert "".join(d.text for d in deltas) == cumulative.text
    assert [lp for d in deltas for lp in d.logprobs] == cumulative.logprobs
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])


def test_final_only_gives_one_complete_output(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompt = [5, 9, 13, 17]
    outs = run(llm, prompt, params, RequestOutputKind.FINAL_ONLY)
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].token_ids == run(llm, prompt, params, RequestOutputKind.CUMULATIVE)[-1].outputs[0].token_ids


def test_a_stop_string_spanning_deltas_is_cut_exactly_and_never_leaks(llm):
    prompt = "Continuous batching lets new requests join"
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = run(llm, llm.tokenizer.encode(prompt), params, RequestOutputKind.CUMULATIVE)[-1].outputs[0].text
    clean = [i for i in range(4, len(text) - 8) if "\ufffd" not in text[i : i + 5]]
    assert clean, f"no clean window in {text!r}"
    stop = text[clean[len(clean) // 2] :][:5]  # five characters: usually more than one token
    cut = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    deltas = [o.outputs[0] for o in run(llm, llm.tokenizer.encode(prompt), cut, RequestOutputKind.DELTA)]
    assert "".join(d.text for d in deltas) == text[: text.find(stop)]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop


def test_one_timing_record_per_request():
    from pagoda_daemon.outputs import RequestTiming

    timing = RequestTiming(arrival_time=10.0)
    assert timing.tokens_arrived(1, 10.5) is None and timing.time_to_first_token == 0.5
    assert timing.tokens_arrived(4, 11.5) == 0.25  # four tokens in one second
    assert timing.last_token_time == 11.5


def test_the_final_output_carries_the_requests_timing(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    final = run(llm, [5, 9, 13, 17], params, RequestOutputKind.DELTA)[-1]
    t = final.metrics
    assert t is not None and t.queue_time is not None and t.queue_time >= 0
    assert t.arrival_time <= t.first_token_time <= t.last_token_time
