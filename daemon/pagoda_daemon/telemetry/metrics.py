"""Prometheus metrics under vLLM's names, so vLLM routers, autoscalers and dashboards work unchanged.

Every metric carries one label, `model_name` (the served model name). Each `EngineMetrics`
owns its `CollectorRegistry` (or uses the one it is given), so several engines or tests in
one process never collide in the global registry. docs/metrics.md lists every metric.

prometheus_client appends `_total` to counter names by itself: counters are declared here
without it (`vllm:prompt_tokens`) and exposed as `vllm:prompt_tokens_total`, exactly as vLLM
exposes them. All methods are thread-safe (prometheus_client locks per value).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pagoda_daemon.engine.messages import EngineStats

FINISHED_REASONS = ("stop", "length", "abort")

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), kept identical so that histogram
# quantiles in shared dashboards mean the same thing for both servers.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including `max_value` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class EngineMetrics:
    """The serving metrics of one engine (one served model)."""

    def __init__(
        self, model_name: str, registry: CollectorRegistry | None = None, max_model_len: int = 32768
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = ["model_name"]

        # Scheduler state (gauges, set once per engine step).
        self._running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r
        ).labels(model_name)
        self._waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r
        ).labels(model_name)
        self._kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r
        ).labels(model_name)

        # Counters (declared without `_total`; prometheus_client appends it).
        self._prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        ).labels(model_name)
        self._prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=r,
        ).labels(model_name)
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(model_name)
        self._generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(model_name)
        self._preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r
        ).labels(model_name)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        # Pre-create every reason so each series exists (at 0) from the first scrape, as in vLLM.
        self._success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self._success_family = success

        # Per-request histograms.
        token_buckets = build_1_2_5_buckets(max_model_len)
        self._req_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            labels,
            buckets=token_buckets,
            registry=r,
        ).labels(model_name)
        self._req_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            labels,
            buckets=token_buckets,
            registry=r,
        ).labels(model_name)
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=INTER_TOKEN_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)

        # Pagoda's own: where this replica runs, for the operator's status.placement.
        self._placement = Gauge(
            "pagoda:placement_info", "Where this replica's engine runs (value 1; the labels carry the facts).",
            ["model_name", "gpus", "numa_nodes"], registry=r,
        )
        self._expert_parallel = Gauge(
            "pagoda:expert_parallel_size", "Current expert-parallel size of this replica.", labels, registry=r
        ).labels(model_name)

    def set_placement(self, gpus: list[int], numa_nodes: list[int], expert_parallel_size: int = 1) -> None:
        """Once the engine is up: its GPUs and NUMA nodes (comma-separated labels) and EP size."""
        self._placement.clear()
        self._placement.labels(self.model_name, ",".join(map(str, gpus)), ",".join(map(str, numa_nodes))).set(1)
        self._expert_parallel.set(expert_parallel_size)

    # -- per engine step ------------------------------------------------------------------

    def record_engine_stats(self, stats: EngineStats) -> None:
        """The engine core's gauges, and its counters since its previous stats (added here)."""
        self._running.set(stats.num_running)
        self._waiting.set(stats.num_waiting)
        # the fraction (0..1) of blocks held by live requests
        self._kv_usage.set(min(max(stats.kv_cache_usage, 0.0), 1.0))
        if stats.prefix_cache.queries:
            self._prefix_queries.inc(stats.prefix_cache.queries)
        if stats.prefix_cache.hits:
            self._prefix_hits.inc(stats.prefix_cache.hits)
        if stats.num_preemptions:
            self._preemptions.inc(stats.num_preemptions)

    def add_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Deltas: prompt tokens computed (prefill) and tokens generated since the last call."""
        if prompt_tokens:
            self._prompt_tokens.inc(prompt_tokens)
        if generation_tokens:
            self._generation_tokens.inc(generation_tokens)

    # -- per request ----------------------------------------------------------------------

    def observe_finished(
        self,
        finished_reason: str,
        e2e_s: float,
        queue_s: float | None,
        ttft_s: float | None,
        prompt_tokens: int,
        generation_tokens: int,
    ) -> None:
        """One finished request. `queue_s` / `ttft_s` are None when the request never got
        that far (e.g. aborted while waiting); those histograms are then left alone."""
        counter = self._success.get(finished_reason)
        if counter is None:  # an unexpected reason still counts, under its own label value
            counter = self._success_family.labels(self.model_name, finished_reason)
        counter.inc()
        self._e2e.observe(e2e_s)
        if queue_s is not None:
            self._queue.observe(queue_s)
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        self._req_prompt_tokens.observe(prompt_tokens)
        self._req_generation_tokens.observe(generation_tokens)

    def observe_inter_token(self, seconds: float, count: int = 1) -> None:
        """Record `count` inter-token intervals of `seconds` each (an output that carries k
        tokens records its gap / k, k times)."""
        for _ in range(count):
            self._itl.observe(seconds)

    # -- exposition -----------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for GET /metrics, Prometheus text format 0.0.4."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
