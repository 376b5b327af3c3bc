"""Elastic expert parallelism on CPU (gloo, float32, one process per rank): a replica of the tiny
Qwen3-MoE resized 2 → 3 → 4 → 2 while requests run, every request completes with the tokens a
fixed-size replica gives, nothing leaks, and a joining rank that dies in the middle of its
transfer rolls the replica back to its old size, still serving."""

from __future__ import annotations

import random

import pytest

from benchmarks.parity import random_prompts
from pagoda_daemon.distributed.elastic import (
    Layout,
    layout_for,
    moved_bytes,
    redundant_experts_for,
    resized_placement,
    transfer_plan,
)
from pagoda_daemon.executor.resize import FAULT_ENV

ELASTIC = {"enable_eplb": True, "elastic_ep_min_size": 1, "elastic_ep_max_size": 4, "eplb_step_interval": 7}
LENGTHS = [5, 17, 33, 48, 70, 9, 100, 21]


# ---- the arithmetic ---------------------------------------------------------------------------


@pytest.mark.parametrize("experts,ranks,configured,expected", [(8, 2, 0, 0), (8, 3, 0, 1), (8, 3, 2, 4), (128, 5, 0, 2),
                                                              (8, 4, 3, 4), (8, 1, 3, 0)])
def test_redundant_slots_make_every_size_even(experts, ranks, configured, expected):
    assert redundant_experts_for(experts, ranks, configured) == expected
    assert (experts + expected) % ranks == 0


@pytest.mark.parametrize("experts,sizes", [(8, [2, 3, 4, 2]), (16, [4, 2, 3, 5, 4]), (128, [2, 7, 8, 3]),
                                           (8, [1, 3, 1, 2])])
def test_a_resize_places_every_expert_and_moves_only_what_changes(experts, sizes):
    rng = random.Random(experts)
    load = [rng.random() * 100 for _ in range(experts)]
    before = layout_for(experts, sizes[0], 0)
    placement = [s % experts for s in range(before.total)]
    for size in sizes[1:]:
        after = layout_for(experts, size, 0)
        new = resized_placement(load, placement, before, after)
        assert len(new) == after.total and set(new) == set(range(experts))
        for r in range(after.ranks):  # no rank holds two copies of one expert
            mine = new[r * after.slots:(r + 1) * after.slots]
            assert len(set(mine)) == len(mine)
        plan = transfer_plan(placement, new, before, after)
        assert [d for d, _ in plan] == list(range(after.total))
        assert all(placement[src] == new[dest] for dest, src in plan)  # every source holds its expert
        for dest, src in plan:  # a rank that already holds an expert copies it in place
            here = [s for s in range(before.total) if placement[s] == new[dest]
                    and before.rank_of(s) == after.rank_of(dest)]
            assert (before.rank_of(src) == after.rank_of(dest)) == bool(here)
        placement, before = new, after
    same = Layout(2, 4)
    assert moved_bytes(transfer_plan(list(range(8)), list(range(8)), same, same), same, same, 10) == 0


# ---- the engine --------------------------------------------------------------------------------


def _run(path: str, resizes: dict[int, int], extra: dict | None = None, fault_at: int | None = None,
         start: int = 2, device: str = "cpu", prompts: list[list[int]] | None = None,
         arrivals: list[int] | None = None):
    """Requests arrive over the first steps (request i at step arrivals[i], 2i unless given); at
    step i the replica is resized to resizes[i]. Returns (tokens by request, (size, phase,
    error, seconds) of each resize, no block leaked)."""
    from pagoda_daemon import LLM, SamplingParams

    llm = LLM(path, dtype="float32", device=device, expert_parallel_size=start, num_kv_blocks=96,
              max_model_len=256, max_num_batched_tokens=64, **{**ELASTIC, **(extra or {})})
    engine, core = llm.engine, llm.engine.core
    prompts = prompts or random_prompts(engine.model_config.vocab_size, LENGTHS, seed=11)
    arriving = {step: i for i, step in enumerate(arrivals or [2 * i for i in range(len(prompts))])}
    tokens: dict[str, list[int]] = {}
    outcomes = []
    try:
        step = 0
        while step <= max(arriving) or engine.has_unfinished_requests():
            if step in arriving:
                i = arriving[step]
                params = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i if i % 4 == 1 else None,
                                        max_tokens=10 + i, ignore_eos=True)
                engine.add_request(prompts[i], params, request_id=str(i))
            if step in resizes:
                if fault_at == step:
                    import os

                    os.environ[FAULT_ENV] = "exit-in-transfer"
                try:
                    for out in engine.output_processor.process(core.resize_experts(resizes[step])).outputs:
                        if out.finished:
                            tokens[out.request_id] = out.outputs[0].token_ids
                finally:
                    import os

                    os.environ.pop(FAULT_ENV, None)
                e = core.elastic
                outcomes.append((e.size, e.phase, e.last_error, e.last_seconds, e.last_seconds_by_part))
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
            step += 1
        leak_free = core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
        return tokens, outcomes, leak_free
    finally:
        core.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_resizing_while_serving_keeps_every_request_and_its_tokens(tiny_models, async_scheduling):
    """Greedy, seeded and unseeded sampled requests (each rank samples, so joiners must take
    rank 0's random state) span the transitions; the tokens are those of a replica that kept its
    size, because only the experts' placement changed."""
    path = tiny_models["qwen3_moe"]
    extra = {"async_scheduling": async_scheduling}
    fixed, _, _ = _run(path, {}, extra)
    tokens, outcomes, leak_free = _run(path, {3: 3, 7: 4, 12: 2}, extra)
    assert [o[:2] for o in outcomes] == [(3, "done"), (4, "done"), (2, "done")]
    grow, _, shrink = (o[4] for o in outcomes)
    assert {"prepare", "leave", "worlds", "plan", "transfer", "joiners", "vote", "layout", "capture", "gather"} <= set(grow)
    assert sum(grow.values()) <= outcomes[0][3] and set(shrink) >= {"worlds", "transfer"}
    assert sorted(tokens) == sorted(fixed) == [str(i) for i in range(len(LENGTHS))]
    assert tokens == fixed
    assert leak_free


def test_a_prefix_cached_before_a_growth_is_read_after_it(tiny_models):
    """A joining rank copies only the KV blocks with content: those of requests in flight and
    those of finished requests kept as cached prefixes. A request arriving after the growth
    reuses a prefix that no request held during it, and decodes as on a replica that kept its size."""
    path = tiny_models["qwen3_moe"]
    from pagoda_daemon.models.loader import load_config

    vocab = load_config(path).vocab_size
    prefix, a, b = random_prompts(vocab, [64, 7, 9], seed=5)
    prompts = [prefix + a, prefix + b]
    fixed, _, _ = _run(path, {}, prompts=prompts, arrivals=[0, 16])
    tokens, outcomes, leak_free = _run(path, {14: 3}, prompts=prompts, arrivals=[0, 16])
    assert [o[:2] for o in outcomes] == [(3, "done")]
    assert tokens == fixed and leak_free


def test_one_rank_grows_to_three_and_back_to_one(tiny_models):
    """At one rank every expert is on rank 0 and nothing is all-reduced; a replica can idle there."""
    path = tiny_models["qwen3_moe"]
    fixed, _, _ = _run(path, {}, start=1)
    tokens, outcomes, leak_free = _run(path, {3: 3, 9: 1}, start=1)
    assert [o[:2] for o in outcomes] == [(3, "done"), (1, "done")]
    assert tokens == fixed and leak_free


def test_a_joiner_that_dies_mid_transfer_rolls_back_and_the_replica_serves_on(tiny_models):
    path = tiny_models["qwen3_moe"]
    fixed, _, _ = _run(path, {})
    tokens, outcomes, leak_free = _run(path, {3: 3, 9: 3}, fault_at=3)
    (size, phase, error, *_), after = outcomes
    assert (size, phase) == (2, "failed") and error
    assert after[:2] == (3, "done")  # the next resize, with a healthy joiner, goes through
    assert tokens == fixed and leak_free


def test_elastic_requirements_are_named_in_one_message(tiny_models):
    from pagoda_daemon.config import EngineConfig

    with pytest.raises(ValueError) as e:
        EngineConfig(model=tiny_models["qwen3_moe"], expert_parallel_size=5, tensor_parallel_size=2,
                     elastic_ep_min_size=2, elastic_ep_max_size=4, kv_offload_cpu_gib=1.0)
    for words in ("within the elastic bounds", "enable_eplb", "tensor_parallel_size 1", "KV offload"):
        assert words in str(e.value)
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig(model=tiny_models["qwen3_moe"], enable_eplb=True, elastic_ep_min_size=0, elastic_ep_max_size=4)
    with pytest.raises(ValueError, match="which must be at least 2"):
        EngineConfig(model=tiny_models["qwen3_moe"], enable_eplb=True, elastic_ep_min_size=1, elastic_ep_max_size=1)
    with pytest.raises(ValueError, match="at most elastic_ep_max_size"):
        EngineConfig(model=tiny_models["qwen3_moe"], enable_eplb=True, elastic_ep_min_size=4, elastic_ep_max_size=0)
    with pytest.raises(ValueError, match=r"moves the experts at each resize itself \(eplb_async_steps 0\)"):
        EngineConfig(model=tiny_models["qwen3_moe"], enable_eplb=True, elastic_ep_min_size=1, elastic_ep_max_size=4,
                     eplb_async_steps=5)
