"""Scheduler policy without a model: budgets, chunking, preemption order, aborts."""

from __future__ import annotations

import itertools

import pytest

from pagoda_daemon.engine.kv_cache_manager import KVCacheManager
from pagoda_daemon.engine.request import Request, RequestStatus
from pagoda_daemon.engine.scheduler import Scheduler
from pagoda_daemon.sampling_params import SamplingParams

BS = 16


def make_scheduler(num_blocks=64, max_num_seqs=8, max_tokens_per_step=64, max_model_len=512, caching=True):
    kv = KVCacheManager(num_blocks, BS, caching)
    return Scheduler(kv, max_num_seqs, max_tokens_per_step, max_model_len)


def make_request(rid, prompt_len, max_tokens=8, first_token=100):
    tokens = list(range(first_token, first_token + prompt_len))
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), eos_token_id=None, block_size=BS)


def run_step(sched: Scheduler, token=7):
    """One step with a fake model that samples `token` for every request that reached its end."""
    out = sched.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
    return out, sched.update_from_output(out, sampled)[0]


def test_token_budget_and_chunked_prefill_mix_with_decodes():
    sched = make_scheduler(max_tokens_per_step=32)
    sched.add_request(make_request("short", 10))
    out, _ = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("short", 10)]
    sched.add_request(make_request("long", 80))
    out, _ = run_step(sched)
    # the running decode goes first, the long prompt takes what is left of the budget
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("short", 1), ("long", 31)]
    assert out.num_scheduled_tokens == 32
    out, _ = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("short", 1), ("long", 31)]
    out, _ = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("short", 1), ("long", 18)]
    long = sched.requests["long"]
    assert long.num_output_tokens == 1  # sampled only after its last chunk


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=3, max_tokens_per_step=1000)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 4))
    out, _ = run_step(sched)
    assert len(out.scheduled) == 3 and sched.num_waiting == 2


def test_preemption_takes_the_latest_arrival_and_it_resumes_first():
    # 6 blocks: two requests of 40 prompt tokens (3 blocks each) fill the cache;
    # decoding past 48 tokens needs a 4th block, so the later one is preempted.
    sched = make_scheduler(num_blocks=6, max_tokens_per_step=200, max_model_len=64, caching=False)
    sched.add_request(make_request("early", 40, max_tokens=20))
    sched.add_request(make_request("late", 40, max_tokens=20, first_token=500))
    preempted = []
    for _ in range(40):
        out, _ = run_step(sched)
        preempted += out.preempted_request_ids
        if not sched.has_unfinished_requests():
            break
    assert preempted and set(preempted) == {"late"}
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache.num_free_blocks == 6
    assert sched.stats.num_preemptions == len(preempted)


def test_resumed_request_recomputes_prompt_and_outputs():
    sched = make_scheduler(num_blocks=6, max_tokens_per_step=200, max_model_len=64, caching=False)
    late = make_request("late", 40, max_tokens=20, first_token=500)
    sched.add_request(make_request("early", 40, max_tokens=20))
    sched.add_request(late)
    counter = itertools.count()
    resumed_with = None
    for _ in range(60):
        out = sched.schedule()
        for s in out.scheduled:
            if s.request is late and s.is_new and late.num_preemptions:
                resumed_with = (s.start, s.num_new_tokens, late.num_tokens)
        sampled = {s.request.request_id: next(counter) % 50 + 1 for s in out.scheduled if s.samples}
        sched.update_from_output(out, sampled)
        if not sched.has_unfinished_requests():
            break
    assert resumed_with is not None
    computed, new, total = resumed_with
    assert computed == 0 and new == total > 40  # prompt and already generated tokens, all recomputed
    assert late.num_output_tokens == 20


@pytest.mark.parametrize("abort_after_steps", [0, 1, 2, 5])
def test_abort_at_any_point_returns_all_blocks(abort_after_steps):
    sched = make_scheduler(num_blocks=8, max_tokens_per_step=24, caching=True)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 30, max_tokens=30, first_token=100 * i))
    for _ in range(abort_after_steps):
        run_step(sched)
    sched.abort_requests(["r0", "r1", "r2", "unknown"])
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache.num_free_blocks == 8
    assert sched.kv_cache.req_blocks == {}


def test_stops_on_max_tokens_stop_token_and_eos_respecting_min_tokens():
    sched = make_scheduler()
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[9]),
                  eos_token_id=5, block_size=BS)
    sched.add_request(req)
    run_step(sched, token=5)  # EOS before min_tokens: ignored
    assert req.status == RequestStatus.RUNNING
    run_step(sched, token=9)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 9
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def make_priority_scheduler(**kw):
    kv = KVCacheManager(kw.pop("num_blocks", 64), BS, kw.pop("caching", True))
    return Scheduler(kv, kw.pop("max_num_seqs", 8), kw.pop("max_tokens_per_step", 64), kw.pop("max_model_len", 512),
                     policy="priority")


def prioritized(rid, prompt_len, priority, arrival, max_tokens=8, first_token=100):
    tokens = list(range(first_token, first_token + prompt_len))
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, priority=priority), eos_token_id=None,
                   block_size=BS, arrival_time=arrival)


def test_priority_policy_admits_by_priority_then_arrival():
    import random

    rng = random.Random()
    sched = make_priority_scheduler(max_num_seqs=1, max_tokens_per_step=1000)
    levels = [rng.randrange(-3, 3) for _ in range(12)]
    arrivals = rng.sample(range(1000), 12)  # arrival times unrelated to the order of add_request
    for i, (level, arrival) in enumerate(zip(levels, arrivals)):
        sched.add_request(prioritized(f"r{i}", 5, level, float(arrival), max_tokens=1, first_token=10 * i))
    order = []
    while sched.has_unfinished_requests():
        out, _ = run_step(sched)
        order += [s.request.request_id for s in out.scheduled if s.num_new_tokens > 1]
    assert order == [f"r{i}" for i in sorted(range(12), key=lambda i: (levels[i], arrivals[i]))]
    assert sched.kv_cache.num_free_blocks == 64


def test_priority_policy_preempts_the_least_urgent_and_requeues_it_in_order():
    # 9 blocks: three requests of 40 tokens (3 blocks each) fill the cache; the first to need a
    # 4th block makes the scheduler preempt: the least urgent (priority 5), not the latest arrival
    sched = make_priority_scheduler(num_blocks=9, max_tokens_per_step=200, max_model_len=64, caching=False)
    sched.add_request(prioritized("urgent-late", 40, -1, 3.0, max_tokens=20, first_token=100))
    sched.add_request(prioritized("lazy-early", 40, 5, 1.0, max_tokens=20, first_token=200))
    sched.add_request(prioritized("normal", 40, 0, 2.0, max_tokens=20, first_token=300))
    out, _ = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["urgent-late", "normal", "lazy-early"]
    preempted = []
    while sched.has_unfinished_requests():
        out, _ = run_step(sched)
        preempted += out.preempted_request_ids
        assert [r.request_id for r in sched.running] == sorted(
            (r.request_id for r in sched.running), key=lambda rid: {"urgent-late": 0, "normal": 1, "lazy-early": 2}[rid])
    assert preempted and preempted[0] == "lazy-early" and "urgent-late" not in preempted
    assert sched.kv_cache.num_free_blocks == 9


def test_fcfs_scheduler_refuses_a_priority():
    sched = make_scheduler()
    with pytest.raises(ValueError, match="priority scheduling policy"):
        sched.add_request(prioritized("p", 5, 1, 0.0))
    sched.add_request(prioritized("zero", 5, 0, 0.0))  # 0 is every request's priority under fcfs
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        Scheduler(KVCacheManager(8, BS, True), 1, 16, 64, policy="lifo")
