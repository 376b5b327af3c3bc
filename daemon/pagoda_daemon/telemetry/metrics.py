"""Prometheus metrics under vLLM's names, so vLLM routers, autoscalers and dashboards work unchanged.

Every metric carries one label, `model_name` (the served model name). Each `EngineMetrics`
owns its `CollectorRegistry` (or uses the one it is given), so several engines or tests in
one process never collide in the global registry. docs/metrics.md lists every metric.

prometheus_client appends `_total` to counter names by itself: counters are declared here
without it (`vllm:prompt_tokens`) and exposed as `vllm:prompt_tokens_total`, exactly as vLLM
exposes them. All methods are thread-safe (prometheus_client locks per value).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pagoda_daemon.engine.messages import ELASTIC_PHASES, EngineStats

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


# a step's mask fill: tens of µs for a few rows of cheap states, tens of ms for 128 rows inside
# length-bounded strings (docs/benchmarks/2026-11-25-structured-outputs-overlap-h100.md)
GRAMMAR_MASK_FILL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
# a regex or choice compiles in about a millisecond, a large JSON schema against a 150k-token
# vocabulary in a second or more
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's request_params_n buckets


def iteration_token_buckets(max_num_batched_tokens: int) -> list[int]:
    """vLLM's iteration_tokens_total buckets: 1, 8, 16, 32, ... up to the step's token budget."""
    buckets = [1, 8]
    while buckets[-1] < max_num_batched_tokens:
        buckets.append(buckets[-1] * 2)
    return buckets


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


@dataclass
class FinishedRequest:
    """What the metrics record of one finished generation (times in seconds)."""

    finished_reason: str
    e2e_s: float
    queue_s: float | None  # arrival to first schedule
    ttft_s: float | None
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int = 0
    max_tokens: int | None = None
    prefill_s: float | None = None  # first schedule to first token
    decode_s: float | None = None  # first token to last token


class EngineMetrics:
    """The serving metrics of one engine (one served model)."""

    def __init__(
        self, model_name: str, registry: CollectorRegistry | None = None, max_model_len: int = 32768,
        max_num_batched_tokens: int = 8192,
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
        # vLLM's LoRA gauge, read by LoRA-aware routers: one series, its labels the adapters (comma-separated
        # names) of the running and the waiting requests, its value the time of the latest stats
        self._lora_info = Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r,
        )

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

        def histogram(name: str, doc: str, buckets) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        # Phases of a finished request (vLLM's meanings: prefill is first schedule to first
        # token, decode first to last token, inference the two together).
        self._tpot = histogram("vllm:request_time_per_output_token_seconds",
                               "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_BUCKETS)
        self._prefill = histogram("vllm:request_prefill_time_seconds",
                                  "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self._decode = histogram("vllm:request_decode_time_seconds",
                                 "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self._inference = histogram("vllm:request_inference_time_seconds",
                                    "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self._max_generation = histogram("vllm:request_max_num_generation_tokens",
                                         "Histogram of maximum number of requested generation tokens.", token_buckets)
        self._prefill_computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                           "Histogram of new KV tokens computed during prefill (excluding cached "
                                           "tokens).", token_buckets)
        self._params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self._params_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.", token_buckets)
        self._iteration_tokens = histogram("vllm:iteration_tokens_total",
                                           "Histogram of number of tokens per engine_step.",
                                           iteration_token_buckets(max_num_batched_tokens))
        self._prompt_tokens_cached = Counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local prefix cache).", labels, registry=r,
        ).labels(model_name)
        self._cache_config = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", ["block_size", "num_gpu_blocks",
                                                                                   "enable_prefix_caching"], registry=r,
        )

        # Pagoda's own: where this replica runs, for the operator's status.placement.
        self._placement = Gauge(
            "pagoda:placement_info", "Where this replica's engine runs (value 1; the labels carry the facts).",
            ["model_name", "gpus", "numa_nodes"], registry=r,
        )
        self._eplb_rebalances = Counter(
            "pagoda:eplb_rebalances", "Expert-load rebalances (EPLB) since start.", labels, registry=r
        ).labels(model_name)
        self._eplb_moved = Counter(
            "pagoda:eplb_expert_slots_moved", "Expert slots whose weights EPLB moved between ranks.", labels,
            registry=r,
        ).labels(model_name)
        self._eplb_imbalance = Gauge(
            "pagoda:eplb_rank_load_imbalance",
            "At the last rebalance: the busiest expert-parallel rank's tokens over the mean, with the old "
            "placement (when=before) and the new one (when=after); 1.0 is even.",
            [*labels, "when"], registry=r,
        )
        self._eplb_rank_load = Gauge(
            "pagoda:eplb_rank_load_per_step",
            "Over the last EPLB window: the busiest expert-parallel rank's routed (token, expert) pairs per MoE "
            "layer per step, with the new placement (the expert load an elastic replica's size divides).",
            labels, registry=r,
        ).labels(model_name)
        self._model_info = Gauge(
            "pagoda:model_info", "The model this replica serves: its source URI and the revision it resolved to "
            "(value 1; only for a model fetched from hf:// or s3://).", ["model_name", "source", "revision"],
            registry=r,
        )
        self._expert_parallel = Gauge(
            "pagoda:expert_parallel_size", "Current expert-parallel size of this replica.", labels, registry=r
        ).labels(model_name)
        # Elastic expert parallelism (executor/resize.py; docs/elastic-ep.md)
        self._elastic_transitions = Counter(
            "pagoda:elastic_ep_transitions", "Expert-parallel resizes since start, by outcome (done, or failed and "
            "rolled back).", [*labels, "outcome"], registry=r,
        )
        self._elastic_seconds = Histogram(
            "pagoda:elastic_ep_transition_seconds", "How long each expert-parallel resize paused scheduling.", labels,
            buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120), registry=r,
        ).labels(model_name)
        self._elastic_bytes = Counter(
            "pagoda:elastic_ep_bytes_moved", "Expert weight bytes resizes moved between ranks.", labels, registry=r,
        ).labels(model_name)
        self._elastic_phase = Gauge(
            "pagoda:elastic_ep_phase", "The latest expert-parallel resize's phase (1 for the current one).",
            [*labels, "phase"], registry=r,
        )
        self._elastic_phase_shown: str | None = None  # stats come every step; the gauges move on a change
        # KV offload (kv_offload/): vLLM's names for a KV connector's lookups, then Pagoda's own
        self._offload_queries = Counter(
            "vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance "
            "cache sharing, in terms of number of queried tokens.", labels, registry=r,
        ).labels(model_name)
        self._offload_hits = Counter(
            "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache "
            "sharing, in terms of number of cached tokens.", labels, registry=r,
        ).labels(model_name)
        self._offload_loaded = Counter(
            "pagoda:kv_offload_loaded_bytes", "KV bytes copied back to the GPU from an offload tier (all ranks).",
            [*labels, "medium"], registry=r,
        )
        self._offload_saved = Counter(
            "pagoda:kv_offload_saved_bytes", "KV bytes written to an offload tier (all ranks).",
            [*labels, "medium"], registry=r,
        )
        self._offload_seconds = Counter(
            "pagoda:kv_offload_transfer_seconds", "Seconds the engine's first rank spent copying KV blocks to and "
            "from the offload tiers.", labels, registry=r,
        ).labels(model_name)
        self._offload_failed_loads = Counter(
            "pagoda:kv_offload_failed_loads", "KV blocks whose load from an offload tier failed (a block file changed "
            "after its lookup); the requests reading them were recomputed.", labels, registry=r,
        ).labels(model_name)
        self._transfer_fetched = Counter(
            "pagoda:kv_transfer_fetched_bytes", "KV bytes fetched from another instance's transfer port into the "
            "disk tier (prefill/decode disaggregation between hosts; all ranks).", labels, registry=r,
        ).labels(model_name)
        self._grammar_requests = Counter(
            "pagoda:structured_output_requests", "Requests with an output constraint (JSON schema, regex, choice, "
            "grammar, or a forced tool call).", labels, registry=r,
        ).labels(model_name)
        self._grammar_cache_hits = Counter(
            "pagoda:grammar_cache_hits", "Constrained requests whose grammar was already compiled (or compiling).",
            labels, registry=r,
        ).labels(model_name)
        self._grammar_failures = Counter(
            "pagoda:grammar_compile_failures", "Grammars that failed to compile in the engine (their requests are "
            "aborted).", labels, registry=r,
        ).labels(model_name)
        self._grammar_compile = histogram("pagoda:grammar_compile_seconds",
                                          "Histogram of the time to compile one grammar against the vocabulary.",
                                          GRAMMAR_COMPILE_BUCKETS)
        self._grammar_mask_fill = histogram(
            "pagoda:grammar_mask_fill_seconds", "Histogram of the time the engine core took to fill one step's "
            "grammar masks (while the step's forward pass runs).", GRAMMAR_MASK_FILL_BUCKETS)
        # The time before vLLM's arrival stamp (which its TTFT and e2e histograms start from):
        # 400 requests at once on an H100 waited up to 1.9 s there for a parse (2026-11-27).
        self._admission = histogram(
            "pagoda:request_admission_seconds", "Histogram of the time from a request's arrival at the API server "
            "(its headers read) to its submission to the engine: body, parsing, tokenizing, checks.", TTFT_BUCKETS)
        self._startup = Gauge(
            "pagoda:startup_phase_seconds", "How long each start-up phase of the engine took.",
            ["model_name", "phase"], registry=r,
        )

    def set_cache_config(self, block_size: int, num_blocks: int, enable_prefix_caching: bool) -> None:
        """Once the engine is up (llm-d's prefix-aware routing reads the block size here)."""
        self._cache_config.clear()
        self._cache_config.labels(str(block_size), str(num_blocks), str(enable_prefix_caching)).set(1)

    def set_startup(self, phases: dict[str, float]) -> None:
        """Once the engine is up: the seconds each start-up phase took (loading weights, ...)."""
        for phase, seconds in phases.items():
            self._startup.labels(self.model_name, phase).set(seconds)

    def set_model_source(self, source: str, revision: str) -> None:
        """A fetched model's source and resolved revision, for the operator's status."""
        self._model_info.clear()
        self._model_info.labels(self.model_name, source, revision).set(1)

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
        if stats.lora is not None:
            self._lora_info.clear()
            self._lora_info.labels(str(stats.lora.max_loras), ",".join(stats.lora.running),
                                   ",".join(stats.lora.waiting)).set(time.time())
        # the fraction (0..1) of blocks held by live requests
        self._kv_usage.set(min(max(stats.kv_cache_usage, 0.0), 1.0))
        if stats.prefix_cache.queries:
            self._prefix_queries.inc(stats.prefix_cache.queries)
        if stats.prefix_cache.hits:
            self._prefix_hits.inc(stats.prefix_cache.hits)
        if stats.num_preemptions:
            self._preemptions.inc(stats.num_preemptions)
        for n in stats.step_tokens:
            self._iteration_tokens.observe(n)
        g = stats.structured_outputs
        if g is not None:
            self._grammar_requests.inc(g.requests)
            self._grammar_cache_hits.inc(g.cache_hits)
            self._grammar_failures.inc(g.failures)
            for seconds in g.compile_seconds:
                self._grammar_compile.observe(seconds)
            for seconds in g.mask_fill_seconds:
                self._grammar_mask_fill.observe(seconds)
        o = stats.kv_offload
        if o is not None:
            self._offload_queries.inc(o.queries)
            self._offload_hits.inc(o.hits)
            for tier, n in o.loaded_bytes.items():
                self._offload_loaded.labels(self.model_name, tier.upper()).inc(n)
            for tier, n in o.saved_bytes.items():
                self._offload_saved.labels(self.model_name, tier.upper()).inc(n)
            self._offload_seconds.inc(o.transfer_seconds)
            self._offload_failed_loads.inc(o.failed_loads)
            self._transfer_fetched.inc(o.fetched_bytes)
        e = stats.elastic
        if e is not None:
            self._expert_parallel.set(e.size)
            if e.transitions:  # the ranks, hence the GPUs the operator shows in status.placement, changed
                self.set_placement(e.gpus, e.numa_nodes, e.size)
            if e.phase != self._elastic_phase_shown:
                self._elastic_phase_shown = e.phase
                for phase in ELASTIC_PHASES:
                    self._elastic_phase.labels(self.model_name, phase).set(1 if phase == e.phase else 0)
            if e.transitions:
                self._elastic_transitions.labels(self.model_name, "done").inc(e.transitions - e.failures)
                self._elastic_transitions.labels(self.model_name, "failed").inc(e.failures)
                self._elastic_seconds.observe(e.last_seconds)
                self._elastic_bytes.inc(e.bytes_moved)
        b = stats.balancer
        if b is not None and b.rebalances:
            self._eplb_rebalances.inc(b.rebalances)
            self._eplb_moved.inc(b.slots_moved)
            self._eplb_imbalance.labels(self.model_name, "before").set(b.imbalance_before)
            self._eplb_imbalance.labels(self.model_name, "after").set(b.imbalance_after)
            self._eplb_rank_load.set(b.rank_load_per_step)

    def add_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Deltas: prompt tokens computed (prefill) and tokens generated since the last call."""
        if prompt_tokens:
            self._prompt_tokens.inc(prompt_tokens)
        if generation_tokens:
            self._generation_tokens.inc(generation_tokens)

    # -- per request ----------------------------------------------------------------------

    def observe_finished(self, r: FinishedRequest) -> None:
        """One finished request. Phases it never reached (aborted while waiting: no queue time,
        no first token) leave their histograms alone."""
        counter = self._success.get(r.finished_reason)
        if counter is None:  # an unexpected reason still counts, under its own label value
            counter = self._success_family.labels(self.model_name, r.finished_reason)
        counter.inc()
        self._e2e.observe(r.e2e_s)
        if r.queue_s is not None:
            self._queue.observe(r.queue_s)
        if r.ttft_s is not None:
            self._ttft.observe(r.ttft_s)
        self._req_prompt_tokens.observe(r.prompt_tokens)
        self._req_generation_tokens.observe(r.generation_tokens)
        if r.max_tokens is not None:
            self._max_generation.observe(r.max_tokens)
        if r.queue_s is not None:  # it was scheduled: its prompt went through prefill
            self._prefill_computed.observe(r.prompt_tokens - r.cached_tokens)
        if r.cached_tokens:
            self._prompt_tokens_cached.inc(r.cached_tokens)
        if r.prefill_s is not None:
            self._prefill.observe(r.prefill_s)
        if r.decode_s is not None:
            self._decode.observe(r.decode_s)
            self._inference.observe((r.prefill_s or 0.0) + r.decode_s)
            if r.generation_tokens > 1:
                self._tpot.observe(r.decode_s / (r.generation_tokens - 1))

    def observe_request_params(self, n: int, max_tokens: int | None) -> None:
        """One API request's n and max_tokens (before it fans out into n generations)."""
        self._params_n.observe(n)
        if max_tokens is not None:
            self._params_max_tokens.observe(max_tokens)

    def observe_admission(self, seconds: float) -> None:
        """One API request's wait between its arrival and its submission to the engine."""
        self._admission.observe(seconds)

    def observe_inter_token(self, seconds: float, count: int = 1) -> None:
        """Record `count` inter-token intervals of `seconds` each (an output that carries k
        tokens records its gap / k, k times)."""
        for _ in range(count):
            self._itl.observe(seconds)

    # -- exposition -----------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for GET /metrics, Prometheus text format 0.0.4."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
