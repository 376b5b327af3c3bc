"""Scheduling one step ahead (async scheduling) changes when outputs arrive, never what they are.

The engine schedules step N+1 before step N's tokens reach the host; a request that
stops on a token sampled in step N has already been given step N+1, whose token must be
dropped. These tests run the same requests with and without it and compare every output.
The CPU runs the same code path as the GPU (the pending token is taken from the previous
step's output tensor); only the overlap itself needs a GPU (tests/gpu, benchmarks/throughput.py).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future

import pytest

from benchmarks.parity import random_prompts
from pagoda_daemon import LLM, SamplingParams


def _assert_same(ahead, sync):
    """Same tokens, finish and stop reasons; logprobs equal up to float32 noise (a wasted
    step can change a batch's size, and with it the matmul's summation order)."""
    assert [o[:3] for o in ahead] == [o[:3] for o in sync]
    for a, s in zip(ahead, sync):
        if s[3] is None:
            assert a[3] is None
            continue
        assert [list(d) for d in a[3]] == [list(d) for d in s[3]]
        for da, ds in zip(a[3], s[3]):
            assert da == pytest.approx(ds, abs=1e-4)


def _run(path, async_scheduling: bool, prompts, params, **kwargs):
    llm = LLM(path, num_kv_blocks=kwargs.pop("num_kv_blocks", 128), max_model_len=256,
              async_scheduling=async_scheduling, **kwargs)
    outs = llm.generate(prompts, params)
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks and not core.kv_cache.req_blocks
    return llm, [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
                  o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def stop_tokens(tiny_models):
    """Tokens the greedy run of each prompt produces at position 3: stopping on them ends early."""
    path = tiny_models["qwen3"]
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, async_scheduling=False)
    prompts = random_prompts(llm.engine.model_config.vocab_size, [4, 30, 9, 51, 17, 2], seed=11)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    return prompts, [o.outputs[0].token_ids[3] for o in outs]


def test_stop_tokens_lengths_seeds_and_logprobs_agree(tiny_models, stop_tokens):
    prompts, stops = stop_tokens
    params = []
    for i, stop in enumerate(stops):
        if i % 3 == 0:  # stops on a token sampled mid-run: the step scheduled ahead is wasted
            params.append(SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop], logprobs=2))
        elif i % 3 == 1:  # seeded sampling: its generator advances once per real token
            params.append(SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=5 + i))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + i, ignore_eos=True))
    _, sync = _run(tiny_models["qwen3"], False, prompts, params)
    llm, ahead = _run(tiny_models["qwen3"], True, prompts, params)
    _assert_same(ahead, sync)
    assert sync[0][1] == "stop" and len(sync[0][0]) <= 4  # the stop really cut the run short
    assert llm.engine.core.async_scheduling


def test_preemption_and_chunking_while_scheduling_ahead(tiny_models):
    path = tiny_models["llama"]
    prompts = random_prompts(500, [40, 70, 33, 90, 12], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    kwargs = dict(num_kv_blocks=18, max_num_batched_tokens=24)
    _, sync = _run(path, False, prompts, params, **kwargs)
    llm, ahead = _run(path, True, prompts, params, **kwargs)
    _assert_same(ahead, sync)
    assert llm.get_stats().num_preemptions > 0


def test_penalty_requests_make_the_engine_wait_for_tokens(tiny_models):
    """Penalties need every earlier token on the host: with one in the batch the engine
    steps synchronously, and the outputs still equal the synchronous run's."""
    prompts = random_prompts(500, [10, 20, 30], seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)]
    _, sync = _run(tiny_models["qwen3"], False, prompts, params)
    llm, ahead = _run(tiny_models["qwen3"], True, prompts, params)
    _assert_same(ahead, sync)
    assert llm.engine.core.scheduler.num_needing_host_tokens == 0


def test_constrained_requests_keep_scheduling_ahead(tiny_models):
    """A grammar's mask needs the previous token accepted, but only before sampling: the engine
    launches step N+1's forward pass, collects step N, starts filling N+1's masks, schedules
    N+2 meanwhile, and only then samples N+1. With
    grammar requests (a JSON schema that ends early, a choice, a regex) mixed with plain and
    penalty-free seeded ones, every output equals the synchronous run's, constrained outputs
    match their constraints, and the engine did schedule ahead while they ran."""
    from pagoda_daemon.structured_outputs import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "string", "maxLength": 6}},
              "required": ["a", "b"], "additionalProperties": False}
    constraints = [SO(json=schema), SO(choice=["yes", "no", "maybe"]), SO(regex=r"[a-c]{2,5}-\d{3}"), None,
                   SO(json=schema), None, SO(regex=r"x{1,3}"), None]
    prompts = random_prompts(500, [4, 30, 9, 51, 17, 2, 12, 7], seed=21)
    params = [SamplingParams(temperature=1.0, seed=50 + i, max_tokens=120, structured_outputs=c, logprobs=1)
              if c is not None else SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True)
              for i, c in enumerate(constraints)]
    _, sync = _run(tiny_models["qwen3"], False, prompts, params)
    llm, ahead = _run(tiny_models["qwen3"], True, prompts, params)
    _assert_same(ahead, sync)
    for c, out in zip(constraints, ahead):
        if c is None:
            continue
        assert out[1] == "stop", out  # each grammar ended on its own, well before max_tokens
        text = llm.tokenizer.decode(out[0], skip_special_tokens=True)
        if c.json is not None:
            value = json.loads(text)
            assert set(value) == {"a", "b"} and 0 <= value["a"] <= 99, text
        elif c.choice is not None:
            assert text in c.choice, text
        else:
            assert re.fullmatch(c.regex, text), (c.regex, text)
    core = llm.engine.core
    assert core.scheduler.num_needing_host_tokens == 0

    # scheduling ahead with a constrained request running: a step() returns before its own
    # tokens are collected, leaving it in flight
    engine = llm.engine
    engine.add_request(prompts[0], SamplingParams(temperature=1.0, seed=1, max_tokens=60,
                                                  structured_outputs=SO(json=schema)), request_id="c")
    # ... and its masks are filled by the backend's threads while the engine core schedules the
    # next step (a fill made slow here, so that the overlap cannot be a matter of luck)
    grammars = core.scheduler.grammars
    backend_fill, schedule = grammars._backend.fill, core.scheduler.schedule
    fills: list[tuple[float, float]] = []
    schedules: list[float] = []

    def slow_fill(matchers, out):
        start = time.monotonic()
        time.sleep(0.05)
        backend_fill(matchers, out)
        fills.append((start, time.monotonic()))

    def timed_schedule():
        schedules.append(time.monotonic())
        return schedule()

    grammars._backend.fill, core.scheduler.schedule = slow_fill, timed_schedule
    try:
        in_flight = 0
        while engine.has_unfinished_requests():
            engine.step()
            in_flight += core._in_flight is not None
    finally:
        grammars._backend.fill, core.scheduler.schedule = backend_fill, schedule
    assert in_flight >= 3, in_flight
    overlapped = [f for f in fills if any(f[0] < t < f[1] for t in schedules)]
    assert len(overlapped) >= len(fills) - 1 >= 2, (fills, schedules)
    kv = core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks

    # aborted while its masks are being filled: the step samples, drops its token, frees all
    engine.add_request(prompts[1], SamplingParams(temperature=1.0, seed=2, max_tokens=60,
                                                  structured_outputs=SO(json=schema)), request_id="gone")
    deadline = time.monotonic() + 30  # its matcher is built in the compile pool first
    while time.monotonic() < deadline:
        engine.step()
        if core._in_flight is not None and isinstance(core._in_flight[1], Future):
            break
        time.sleep(0.001)
    assert core._in_flight is not None and isinstance(core._in_flight[1], Future)
    engine.abort_request("gone")
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks


def test_stop_strings_and_aborts_while_a_step_is_in_flight(tiny_models):
    path = tiny_models["llama"]
    llm = LLM(path, num_kv_blocks=64, max_model_len=256, async_scheduling=True)
    engine = llm.engine
    prompts = random_prompts(500, [8, 16, 24], seed=2)
    first = engine.tokenizer.decode(llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=6,
                                                                             ignore_eos=True))[0]
                                    .outputs[0].token_ids[2:4])
    stop_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[first] if first.strip() else None)
    keep = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request(prompts[0], stop_params, request_id="stop")
    engine.add_request(prompts[1], keep, request_id="abort")
    engine.add_request(prompts[2], keep, request_id="keep")
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 6:
            engine.abort_request("abort")  # a step holding it may be in flight right now
    assert set(finished) >= {"stop", "keep"}
    assert len(finished["keep"].outputs[0].token_ids) == 40
    if stop_params.stop:
        assert finished["stop"].outputs[0].finish_reason == "stop"
    kv = engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks


def test_aborting_everything_leaves_an_idle_engine(tiny_models):
    """The step in flight when the last request is aborted holds only tokens to drop: the
    engine collects it at once and reports no unfinished work."""
    llm = LLM(tiny_models["llama"], num_kv_blocks=64, max_model_len=256, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts(500, [5, 9], seed=4)]
    for _ in range(3):
        engine.step()
    assert engine.core._in_flight is not None
    for rid in ids:
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    kv = engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
