"""The engine<->frontend contract: every message round-trips through the wire exactly, the
module stays torch-free, and a frame the core cannot read names the request it fails."""

from __future__ import annotations

import math
import subprocess
import sys

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda_daemon.engine.messages import (
    STARTUP_PHASES,
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineFailed,
    EngineReady,
    EngineStarting,
    EngineStats,
    FinishRequest,
    PrefixCacheStats,
    Shutdown,
)
from pagoda_daemon.sampling_params import SamplingParams
from pagoda_daemon.server import wire

ids = st.text(min_size=1, max_size=40).filter(lambda s: s.isprintable())
tokens = st.lists(st.integers(0, 2**31 - 1), max_size=50)
finite = st.floats(allow_nan=False, allow_infinity=False)
reasons = st.none() | st.integers(0, 2**31) | st.text(max_size=20)
outputs = st.builds(
    EngineCoreOutput, ids, tokens, st.sampled_from([None, "stop", "length", "abort"]), reasons,
    st.lists(st.dictionaries(st.integers(0, 2**31), st.floats(max_value=0.0, allow_nan=False), max_size=5),
             max_size=3),
    st.integers(0, 2**31), st.none() | finite,
)
stats = st.builds(EngineStats, st.integers(0, 10**6), st.integers(0, 10**6), finite, st.integers(0, 10**6),
                  st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6),
                  st.builds(PrefixCacheStats, st.integers(0, 10**9), st.integers(0, 10**9)))


@settings(max_examples=200, deadline=None)
@given(st.lists(outputs, max_size=8), stats)
def test_outputs_and_stats_round_trip(outs, s):
    message = EngineCoreOutputs(outs, s)
    assert wire.decode_from_core(wire.encode(message)) == message


@settings(max_examples=100, deadline=None)
@given(ids, tokens.filter(bool), st.none() | st.integers(0, 2**31), finite,
       st.lists(st.lists(st.text(max_size=10), max_size=2), max_size=2),
       st.none() | st.dictionaries(st.integers(0, 2**31 - 1), st.floats(-100, 100), max_size=5))
def test_a_request_round_trips_and_rebuilds_the_same_sampling_params(rid, prompt, eos, arrival, extra, bias):
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=17, stop=["x"], seed=-5, logprobs=3,
                            logit_bias=bias)
    add = wire.add_request(rid, prompt, params, eos, tuple(tuple(k) for k in extra), arrival)
    decoded = wire.decode_to_core(wire.encode(add))
    assert decoded == add
    request = wire.to_request(decoded, 16, 2**31)
    assert request.sampling_params == params and request.prompt_token_ids == prompt


@pytest.mark.parametrize("message", [
    AbortRequests(["a", "b"]), FinishRequest("a", "stop here"), FinishRequest("b", 7), Shutdown(),
])
def test_control_messages_round_trip(message):
    assert wire.decode_to_core(wire.encode(message)) == message


def test_starting_ready_and_failed_round_trip():
    ready = EngineReady(4096, 1000, 16, "cuda:0", "bfloat16", [3], [1], startup_seconds=12.5)
    assert wire.decode_from_core(wire.encode(ready)) == ready and ready.expert_parallel_size == 1
    assert wire.decode_from_core(wire.encode(EngineFailed("boom"))) == EngineFailed("boom")
    starting = EngineStarting(STARTUP_PHASES[2], 3.25)
    assert wire.decode_from_core(wire.encode(starting)) == starting


@pytest.mark.parametrize("frame, request_id", [
    (msgspec.msgpack.encode(["add", "r1", ["x"], {}, None, [], 0.0]), "r1"),  # a prompt of strings
    (msgspec.msgpack.encode(["add", "r2"]), "r2"),  # fields missing
    (msgspec.msgpack.encode(["bogus", "r3"]), None),
    (msgspec.msgpack.encode({"add": 1}), None),
    (b"\xc1", None),  # not msgpack
])
def test_a_frame_the_core_cannot_read_names_the_request_it_fails(frame, request_id):
    with pytest.raises(wire.BadFrame) as e:
        wire.decode_to_core(frame)
    assert e.value.request_id == request_id


def test_a_request_that_cannot_be_encoded_fails_before_it_is_sent():
    params = SamplingParams(max_tokens=3)
    with pytest.raises(ValueError, match="cannot be encoded"):
        wire.encode_add("r", [2**70], params, None, (), 0.0)
    with pytest.raises(ValueError, match="cannot be encoded"):
        wire.encode_add("\ud800", [1], params, None, (), 0.0)


def test_stats_counters_add_and_gauges_take_the_latest():
    a = EngineStats(1, 2, 0.5, 100, 50, 10, 1, PrefixCacheStats(64, 32))
    b = EngineStats(3, 0, 0.25, 100, 75, 5, 0, PrefixCacheStats(16, 0))
    total = a.add_counters(b)
    assert (total.num_running, total.num_waiting, total.kv_cache_usage, total.num_free_kv_blocks) == (3, 0, 0.25, 75)
    assert (total.num_steps, total.num_preemptions, total.prefix_cache.queries, total.prefix_cache.hits) == (
        15, 1, 80, 32)
    assert math.isclose(total.prefix_cache.hit_rate, 0.4)


def test_the_contract_imports_no_torch():
    code = ("import sys; import pagoda_daemon.engine.messages, pagoda_daemon.server.wire; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_balancer_stats_travel_and_add_up():
    from pagoda_daemon.engine.messages import BalancerStats, EngineStats

    first = EngineStats(1, 0, 0.5, 10, 5, balancer=BalancerStats(1, 4, 1.8, 1.1, 40.0))
    idle = EngineStats(1, 0, 0.5, 10, 5, balancer=BalancerStats())
    later = EngineStats(2, 0, 0.5, 10, 5, balancer=BalancerStats(2, 3, 1.4, 1.05, 25.5))
    frame = wire.encode(EngineCoreOutputs([], later))
    assert wire.decode_from_core(frame).stats.balancer == later.balancer
    total = first.add_counters(idle)
    assert total.balancer == BalancerStats(1, 4, 1.8, 1.1, 40.0)  # no rebalance since: the last one's figures stay
    assert total.add_counters(later).balancer == BalancerStats(3, 7, 1.4, 1.05, 25.5)
    assert EngineStats(0, 0, 0.0, 1, 1).add_counters(EngineStats(0, 0, 0.0, 1, 1)).balancer is None
