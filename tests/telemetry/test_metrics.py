"""EngineMetrics: vLLM's exact exposed names, one label, and counters/histograms that move by
exactly what was recorded, read back through prometheus_client's own text parser."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pagoda_daemon.engine.messages import EngineStats, PrefixCacheStats
from pagoda_daemon.telemetry.metrics import (
    INTER_TOKEN_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    EngineMetrics,
    FinishedRequest,
    build_1_2_5_buckets,
)

MODEL = "tiny-llama"

COUNTERS = [
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
]
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
    "vllm:inter_token_latency_seconds": INTER_TOKEN_BUCKETS,
    "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_prompt_tokens": None,
    "vllm:request_generation_tokens": None,
}


def scrape(metrics: EngineMetrics) -> dict[tuple[str, frozenset], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def key(name: str, **labels: str) -> tuple[str, frozenset]:
    return name, frozenset({"model_name": MODEL, **labels}.items())


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    k = key(name, **labels)
    return after[k] - before.get(k, 0.0)


@pytest.fixture
def metrics() -> EngineMetrics:
    return EngineMetrics(MODEL, max_model_len=2048)


def test_exposed_names_types_and_labels(metrics):
    body, _ = metrics.render()
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    sample_names = {s.name for f in families.values() for s in f.samples}
    for name in COUNTERS:
        assert name in sample_names, name
        assert families[name.removesuffix("_total")].type == "counter"
    for name in GAUGES:
        assert families[name].type == "gauge"
    for name in HISTOGRAMS:
        assert families[name].type == "histogram"
        assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= sample_names
    # Every finished_reason series exists from the first scrape, at zero.
    samples = scrape(metrics)
    for reason in ("stop", "length", "abort"):
        assert samples[key("vllm:request_success_total", finished_reason=reason)] == 0
    # vLLM's names and the one label (request_success adds finished_reason), plus Pagoda's own
    # pagoda:placement_info / pagoda:expert_parallel_size.
    for family in families.values():
        assert family.name.startswith(("vllm:", "pagoda:"))
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL
            assert set(s.labels) <= {"model_name", "finished_reason", "le", "gpus", "numa_nodes"}


def test_placement_info_for_the_operator(metrics):
    metrics.set_placement([0, 1], [1], expert_parallel_size=2)
    metrics.set_placement([3], [0])  # set again: only the latest placement is exported
    samples = scrape(metrics)
    placement = {k: v for k, v in samples.items() if k[0] == "pagoda:placement_info"}
    assert placement == {key("pagoda:placement_info", gpus="3", numa_nodes="0"): 1.0}
    assert samples[key("pagoda:expert_parallel_size")] == 1


def test_an_elastic_resize_moves_the_size_the_phase_and_the_placement(metrics):
    from pagoda_daemon.engine.messages import ElasticStats

    metrics.set_placement([0, 1], [0], expert_parallel_size=2)
    moving = ElasticStats(2, 1, 4, phase="transferring", target=4)
    metrics.record_engine_stats(EngineStats(0, 0, 0.0, 64, 64, elastic=moving))
    s = scrape(metrics)
    assert s[key("pagoda:elastic_ep_phase", phase="transferring")] == 1
    assert s[key("pagoda:elastic_ep_phase", phase="done")] == 0
    done = ElasticStats(4, 1, 4, phase="done", target=4, last_seconds=1.5, transitions=1, bytes_moved=1024,
                        gpus=[0, 1, 2, 3], numa_nodes=[0, 1])
    metrics.record_engine_stats(EngineStats(0, 0, 0.0, 64, 64, elastic=done))
    s = scrape(metrics)
    assert s[key("pagoda:expert_parallel_size")] == 4
    assert s[key("pagoda:elastic_ep_transitions_total", outcome="done")] == 1
    assert s[key("pagoda:elastic_ep_transitions_total", outcome="failed")] == 0
    assert s[key("pagoda:elastic_ep_bytes_moved_total")] == 1024
    assert s[key("pagoda:elastic_ep_transition_seconds_count")] == 1
    placement = {k: v for k, v in s.items() if k[0] == "pagoda:placement_info"}
    assert placement == {key("pagoda:placement_info", gpus="0,1,2,3", numa_nodes="0,1"): 1.0}


def test_histogram_buckets_are_vllms(metrics):
    samples = scrape(metrics)
    for name, buckets in HISTOGRAMS.items():
        les = sorted(
            float(dict(labels)["le"])
            for (n, labels) in samples
            if n == f"{name}_bucket" and dict(labels)["le"] != "+Inf"
        )
        expected = buckets if buckets is not None else build_1_2_5_buckets(2048)
        assert les == [float(b) for b in expected], name
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(2048)[-1] == 2000


def stats(running: int = 0, waiting: int = 0, usage: float = 0.0, queries: int = 0, hits: int = 0,
          preemptions: int = 0) -> EngineStats:
    return EngineStats(running, waiting, usage, 64, 64, num_preemptions=preemptions,
                       prefix_cache=PrefixCacheStats(queries, hits))


def test_gauges(metrics):
    metrics.record_engine_stats(stats(running=3, waiting=5, usage=0.25))
    s = scrape(metrics)
    assert s[key("vllm:num_requests_running")] == 3
    assert s[key("vllm:num_requests_waiting")] == 5
    assert s[key("vllm:kv_cache_usage_perc")] == 0.25
    metrics.record_engine_stats(stats(usage=1.5))  # clamped to a fraction
    s = scrape(metrics)
    assert s[key("vllm:num_requests_running")] == 0
    assert s[key("vllm:kv_cache_usage_perc")] == 1.0


def test_counters_move_by_exact_deltas(metrics):
    before = scrape(metrics)
    metrics.record_engine_stats(stats(queries=48, hits=32, preemptions=2))
    metrics.record_engine_stats(stats(queries=16, hits=0))
    metrics.add_tokens(prompt_tokens=40, generation_tokens=1)
    metrics.add_tokens(prompt_tokens=0, generation_tokens=7)
    after = scrape(metrics)
    assert delta(before, after, "vllm:prefix_cache_queries_total") == 64
    assert delta(before, after, "vllm:prefix_cache_hits_total") == 32
    assert delta(before, after, "vllm:prompt_tokens_total") == 40
    assert delta(before, after, "vllm:generation_tokens_total") == 8
    assert delta(before, after, "vllm:num_preemptions_total") == 2


def test_observe_finished(metrics):
    before = scrape(metrics)
    metrics.observe_finished(FinishedRequest(
        "stop", e2e_s=1.2, queue_s=0.1, ttft_s=0.3, prompt_tokens=17, generation_tokens=9, cached_tokens=16,
        max_tokens=20, prefill_s=0.2, decode_s=0.8))
    metrics.observe_finished(FinishedRequest(
        "length", e2e_s=2.0, queue_s=0.2, ttft_s=0.4, prompt_tokens=3, generation_tokens=16, max_tokens=16,
        prefill_s=0.2, decode_s=1.5))
    # Aborted while waiting: never scheduled, no first token.
    metrics.observe_finished(FinishedRequest(
        "abort", e2e_s=0.05, queue_s=None, ttft_s=None, prompt_tokens=5, generation_tokens=0))
    after = scrape(metrics)
    # the phases of the two that ran; the aborted one has none
    assert delta(before, after, "vllm:request_prefill_time_seconds_count") == 2
    assert delta(before, after, "vllm:request_decode_time_seconds_sum") == pytest.approx(2.3)
    assert delta(before, after, "vllm:request_inference_time_seconds_sum") == pytest.approx(2.7)
    assert delta(before, after, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.1 + 0.1)
    assert delta(before, after, "vllm:prompt_tokens_cached_total") == 16
    assert delta(before, after, "vllm:request_prefill_kv_computed_tokens_sum") == 1 + 3
    assert delta(before, after, "vllm:request_max_num_generation_tokens_sum") == 36

    for reason, n in (("stop", 1), ("length", 1), ("abort", 1)):
        assert delta(before, after, "vllm:request_success_total", finished_reason=reason) == n
    assert delta(before, after, "vllm:e2e_request_latency_seconds_count") == 3
    assert delta(before, after, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(3.25)
    assert delta(before, after, "vllm:request_queue_time_seconds_count") == 2
    assert delta(before, after, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.3)
    assert delta(before, after, "vllm:time_to_first_token_seconds_count") == 2
    assert delta(before, after, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.7)
    assert delta(before, after, "vllm:request_prompt_tokens_count") == 3
    assert delta(before, after, "vllm:request_prompt_tokens_sum") == 25
    assert delta(before, after, "vllm:request_generation_tokens_sum") == 25
    # Buckets are cumulative: the 0.3 s and 0.4 s TTFTs both fall in le=0.5, neither in le=0.25.
    assert delta(before, after, "vllm:time_to_first_token_seconds_bucket", le="0.25") == 0
    assert delta(before, after, "vllm:time_to_first_token_seconds_bucket", le="0.5") == 2
    assert delta(before, after, "vllm:e2e_request_latency_seconds_bucket", le="0.3") == 1
    assert delta(before, after, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == 3
    assert delta(before, after, "vllm:request_generation_tokens_bucket", le="10.0") == 2
    # No counter moved that should not have.
    assert delta(before, after, "vllm:prompt_tokens_total") == 0


def test_observe_admission(metrics):
    before = scrape(metrics)
    metrics.observe_admission(0.003)
    metrics.observe_admission(1.2)
    after = scrape(metrics)
    assert delta(before, after, "pagoda:request_admission_seconds_count") == 2
    assert delta(before, after, "pagoda:request_admission_seconds_sum") == pytest.approx(1.203)
    assert delta(before, after, "pagoda:request_admission_seconds_bucket", le="0.005") == 1
    assert delta(before, after, "pagoda:request_admission_seconds_bucket", le="2.5") == 2


def test_observe_inter_token(metrics):
    before = scrape(metrics)
    metrics.observe_inter_token(0.02)
    metrics.observe_inter_token(0.06, count=3)
    after = scrape(metrics)
    assert delta(before, after, "vllm:inter_token_latency_seconds_count") == 4
    assert delta(before, after, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.2)
    assert delta(before, after, "vllm:inter_token_latency_seconds_bucket", le="0.025") == 1
    assert delta(before, after, "vllm:inter_token_latency_seconds_bucket", le="0.075") == 4


def test_instances_do_not_collide():
    a, b = EngineMetrics(MODEL), EngineMetrics(MODEL)  # would raise on a shared registry
    a.add_tokens(5, 0)
    assert scrape(a)[key("vllm:prompt_tokens_total")] == 5
    assert scrape(b)[key("vllm:prompt_tokens_total")] == 0
    registry = CollectorRegistry()
    c = EngineMetrics("other", registry=registry)
    assert c.registry is registry
    with pytest.raises(ValueError):  # same names twice in one registry
        EngineMetrics("third", registry=registry)
