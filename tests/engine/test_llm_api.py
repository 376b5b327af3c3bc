"""The offline API end to end: inputs, stopping, errors, lifetimes, and block accounting."""

from __future__ import annotations

import gc
import weakref

import pytest

from benchmarks.parity import hf_greedy, random_prompts
from pagoda_daemon import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=64)


def all_blocks_free(llm: LLM) -> bool:
    kv = llm.engine.core.kv_cache
    return kv.num_free_blocks == kv.num_blocks and not kv.req_blocks


def test_strings_and_token_ids_give_the_same_result(llm, tiny_models):
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    by_text, by_ids = llm.generate([text, ids], params)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == hf_greedy(tiny_models["llama"], ids, 6)
    assert by_text.prompt == text and by_ids.prompt is None
    assert by_text.outputs[0].text == llm.tokenizer.decode(by_text.outputs[0].token_ids, skip_special_tokens=True)


def test_stop_string_cuts_engine_output_exactly(llm):
    prompt = "Continuous batching lets new requests join"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate([prompt], params)[0].outputs[0]
    text = full.text
    # a stop string from the middle of the generated text, away from undecodable bytes
    clean = [i for i in range(4, len(text) - 6) if "\ufffd" not in text[i : i + 3]]
    assert clean, f"no clean window in {text!r}"
    start = clean[len(clean) // 2]
    stop = text[start : start + 3]
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    out = cut.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    with_stop = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                      include_stop_str_in_output=True))[0]
    assert with_stop.outputs[0].text == text[: text.find(stop) + len(stop)]
    assert all_blocks_free(llm)


def test_stop_token_ids_and_min_tokens(llm):
    prompt = random_prompts(llm.engine.model_config.vocab_size, [10], seed=3)[0]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop_at = base.token_ids[4]
    first = base.token_ids.index(stop_at)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert out.outputs[0].token_ids == base.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at],
                                                 min_tokens=12))[0]
    assert late.outputs[0].token_ids == base.token_ids and late.outputs[0].finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_models):
    llm = LLM(tiny_models["qwen3"], num_kv_blocks=64, max_model_len=256)
    prompt = random_prompts(llm.engine.model_config.vocab_size, [8], seed=4)[0]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    # Make the 3rd generated token the EOS token for this engine: the request must stop there.
    llm.engine.eos_token_id = base.token_ids[2]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(base.token_ids[2]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    ignored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert ignored.outputs[0].token_ids == base.token_ids


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([5] * 300, SamplingParams(), "context"),
        ([10**9], SamplingParams(), "out of range"),
        (3.5, SamplingParams(), "string or a list"),
    ],
)
def test_bad_prompts_raise_value_error(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(stop=[""]), "stop"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=param):
        SamplingParams(**kwargs)


def test_bad_model_paths_and_architectures(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported model architecture"):
        LLM(str(tmp_path))


def test_a_bad_request_does_not_disturb_the_others(llm):
    engine = llm.engine
    prompts = random_prompts(engine.model_config.vocab_size, [20, 40], seed=9)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ids = [engine.add_request(prompts[0], params)]
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request([5] * 1000, params)
    ids.append(engine.add_request(prompts[1], params))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[i] for i in ids] == expected
    assert all_blocks_free(llm)


def test_abort_midway_frees_blocks_and_reports_abort(llm):
    engine = llm.engine
    prompts = random_prompts(engine.model_config.vocab_size, [70, 30, 50], seed=10)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()  # the 70-token prompt is mid-prefill (budget 64)
    engine.step()
    out = engine.abort_request(ids[0])
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    for _ in range(3):
        engine.step()
    engine.abort_request(ids[1])
    engine.abort_request(ids[2])
    assert not engine.has_unfinished_requests()
    assert all_blocks_free(llm)


def test_finished_requests_are_freed_by_reference_counting(llm):
    engine = llm.engine
    gc.disable()
    try:
        rid = engine.add_request("Paged attention", SamplingParams(max_tokens=4, ignore_eos=True))
        ref = weakref.ref(engine.core.scheduler.requests[rid])
        aborted_id = engine.add_request("Continuous batching", SamplingParams(max_tokens=50, ignore_eos=True))
        aborted_ref = weakref.ref(engine.core.scheduler.requests[aborted_id])
        engine.step()
        engine.abort_request(aborted_id)
        while engine.has_unfinished_requests():
            engine.step()
        assert ref() is None, "a finished Request is kept alive (reference cycle or leak)"
        assert aborted_ref() is None, "an aborted Request is kept alive"
    finally:
        gc.enable()


def test_stats_are_readable(llm):
    llm.generate(["The quick brown fox"], SamplingParams(max_tokens=3))
    stats = llm.get_stats()
    assert stats.num_steps > 0 and stats.num_kv_blocks == 128
    assert 0.0 <= stats.prefix_cache.hit_rate <= 1.0
    assert stats.kv_cache_usage == 0.0


def test_engine_pins_itself_before_allocating(tiny_models):
    import os

    before = os.sched_getaffinity(0)
    try:
        llm = LLM(tiny_models["qwen3"], num_kv_blocks=32, max_model_len=128, numa_policy="auto")
        pin = llm.engine.core.executor.worker.cpu_pin
        assert pin is not None and pin.cpus and pin.cpus <= before
        assert os.sched_getaffinity(0) == set(pin.cpus)
        with pytest.raises(ValueError, match="numa_policy"):
            LLM(tiny_models["qwen3"], numa_policy="sometimes")
    finally:
        os.sched_setaffinity(0, before)


def test_priority_orders_the_queue_offline(tiny_models, llm):
    """vLLM's LLM.generate(priority=...): under scheduling_policy="priority" with one sequence at
    a time, requests start in (priority, arrival) order; the default engine refuses a priority."""
    import random

    levels = random.Random().sample(range(-50, 50), 6)
    prompts = random_prompts(llm.engine.model_config.vocab_size, [7] * 6, seed=31)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match=r"^priority ") as e:
        llm.generate(prompts, params, priority=levels)
    assert e.value.param == "priority"
    with pytest.raises(ValueError, match="2 priorities"):
        llm.generate(prompts, params, priority=levels[:2])
    ordered = LLM(tiny_models["llama"], scheduling_policy="priority", max_num_seqs=1, num_kv_blocks=64,
                  max_model_len=128)
    outs = ordered.generate(prompts, params, priority=levels)
    started = sorted(range(6), key=lambda i: outs[i].metrics.first_token_time)
    assert started == sorted(range(6), key=lambda i: levels[i])
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
