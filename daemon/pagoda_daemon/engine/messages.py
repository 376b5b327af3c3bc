"""Every message between the frontend (API server, offline LLM) and the engine core, typed.

One declaration per message, used on both sides of the ZMQ sockets (``server/wire.py``
encodes and decodes them) and in process. msgspec structs, ``array_like`` so a message is a
msgpack array of its fields (smaller and faster than maps; vLLM's ``v1/engine/__init__.py``
does the same), tagged so that one decoder per direction tells the kinds apart. Standard
library and msgspec only: no torch on this path.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagoda_daemon.lora.request import LoRARequest
from pagoda_daemon.pooling import PoolingParams

# ---- frontend -> engine core ----------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True, gc=False):
    """One tokenized, validated request. ``sampling_params`` holds SamplingParams' fields: the
    core builds SamplingParams from them again, so its checks run on this side too."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    eos_token_id: int | None
    extra_keys: list[list[Any]]  # block-hash extra keys (cache_salt), as lists
    arrival_time: float
    kv_source: str | None = None  # the prefill instance holding the prompt's KV (kv_offload/transfer.py)
    lora: LoRARequest | None = None  # the adapter it runs with (its digest is among extra_keys)
    pooling: PoolingParams | None = None  # an embedding request: one vector back, nothing sampled


class AbortRequests(msgspec.Struct, tag="abort", array_like=True, gc=False):
    request_ids: list[str]


class FinishRequest(msgspec.Struct, tag="finish", array_like=True, gc=False):
    """The frontend found a stop string: the core stops the request."""

    request_id: str
    stop_reason: int | str | None


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, gc=False):
    pass


class ResizeExperts(msgspec.Struct, tag="resize_experts", array_like=True, gc=False):
    """Elastic EP: serve with this many expert-parallel ranks (the admin endpoint asks)."""

    size: int


class WakeUp(msgspec.Struct, tag="wake", array_like=True, gc=False):
    """Data-parallel attention: another engine was sent a request, so this idle one should agree
    the next step at once rather than at the end of its idle wait (distributed/lockstep.py)."""


ToCore = AddRequest | AbortRequests | FinishRequest | Shutdown | ResizeExperts | WakeUp

# ---- engine core -> frontend ----------------------------------------------------------------


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request: only what is new (never a reference to the
    Request itself, never its whole token list)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[dict[int, float]] = []
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first schedule, sent with the final output
    # with the first output of a request that asked for them: one entry per prompt token (None
    # for the first, which nothing scores)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # a pooling request's vector, with its final output: float32, little-endian (pooling.py)
    pooled: bytes | None = None


class PrefixCacheStats(msgspec.Struct, array_like=True, gc=False):
    """Counted in tokens, as vLLM's prefix_cache_queries/hits counters are."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BalancerStats(msgspec.Struct, array_like=True, gc=False):
    """EPLB since the previous stats: rebalances, expert slots moved, and the busiest rank's
    load over the mean at the last rebalance, before and after it (1.0: even; 0: none yet);
    and that rank's routed (token, expert) pairs per MoE layer per step over the last window."""

    rebalances: int = 0
    slots_moved: int = 0
    imbalance_before: float = 0.0
    imbalance_after: float = 0.0
    rank_load_per_step: float = 0.0

    def add(self, later: BalancerStats | None) -> BalancerStats:
        """Counters summed; the imbalance of the latest rebalance."""
        if later is None:
            return self
        last = later if later.rebalances else self
        return BalancerStats(self.rebalances + later.rebalances, self.slots_moved + later.slots_moved,
                             last.imbalance_before, last.imbalance_after, last.rank_load_per_step)


class StructuredOutputStats(msgspec.Struct, array_like=True, gc=False):
    """Constrained decoding since the previous stats: requests that asked for a grammar, grammars
    compiled (with each compile's seconds), requests served from the compiled-grammar cache,
    compiles that failed, the seconds of each step's mask fill (the limit of constrained
    throughput: docs/benchmarks/2026-11-25-structured-outputs-overlap-h100.md) and the rows
    those fills filled."""

    requests: int = 0
    compiles: int = 0
    cache_hits: int = 0
    failures: int = 0
    compile_seconds: list[float] = msgspec.field(default_factory=list)
    mask_fill_seconds: list[float] = msgspec.field(default_factory=list)
    mask_fill_rows: int = 0

    def add(self, later: StructuredOutputStats | None) -> StructuredOutputStats:
        """Counters summed (compile times are per period: a running total keeps none)."""
        if later is None:
            return self
        return StructuredOutputStats(self.requests + later.requests, self.compiles + later.compiles,
                                     self.cache_hits + later.cache_hits, self.failures + later.failures,
                                     mask_fill_rows=self.mask_fill_rows + later.mask_fill_rows)


class KVOffloadStats(msgspec.Struct, array_like=True, gc=False):
    """KV offload (kv_offload/) since the previous stats: tokens looked up in the offload tiers
    and tokens found there (vLLM's external prefix cache counters), bytes copied back to the GPU
    and saved, per tier (``cpu``, ``disk``; summed over the ranks), the seconds rank 0 spent
    copying, the blocks whose load failed (their requests were recomputed), and the bytes fetched
    from another instance (kv_offload/transfer.py)."""

    queries: int = 0
    hits: int = 0
    loaded_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    saved_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    transfer_seconds: float = 0.0
    failed_loads: int = 0
    fetched_bytes: int = 0  # KV fetched from another instance (prefill/decode between hosts), over the ranks

    def add(self, later: KVOffloadStats | None) -> KVOffloadStats:
        if later is None:
            return self
        loaded, saved = dict(self.loaded_bytes), dict(self.saved_bytes)
        for mine, theirs in ((loaded, later.loaded_bytes), (saved, later.saved_bytes)):
            for tier, n in theirs.items():
                mine[tier] = mine.get(tier, 0) + n
        return KVOffloadStats(self.queries + later.queries, self.hits + later.hits, loaded, saved,
                              self.transfer_seconds + later.transfer_seconds, self.failed_loads + later.failed_loads,
                              self.fetched_bytes + later.fetched_bytes)


# An elastic resize's phases (executor/resize.py), as the admin endpoint and the metrics name them.
ELASTIC_PHASES = ("idle", "preparing", "transferring", "capturing", "done", "failed")


class ElasticStats(msgspec.Struct, array_like=True, gc=False):
    """Elastic EP: the size served now and the state of the latest transition (gauges), and
    transitions, failures and bytes moved since the previous stats (counters)."""

    size: int
    min_size: int
    max_size: int
    phase: str = "idle"  # one of ELASTIC_PHASES
    target: int = 0  # the size the latest transition was asked for
    last_seconds: float = 0.0  # how long the latest finished transition took
    last_error: str = ""
    transitions: int = 0
    failures: int = 0
    bytes_moved: int = 0
    # rank 0's seconds in each part of the latest transition (prepare, leave, worlds, plan, transfer,
    # joiners, vote, layout, capture, gather: executor/resize.py), so that a slow one says where
    last_seconds_by_part: dict[str, float] = msgspec.field(default_factory=dict)
    gpus: list[int] = msgspec.field(default_factory=list)  # the ranks' GPUs and NUMA nodes after the
    numa_nodes: list[int] = msgspec.field(default_factory=list)  # latest transition (READY's before one)

    def add(self, later: ElasticStats | None) -> ElasticStats:
        if later is None:
            return self
        return msgspec.structs.replace(later, transitions=self.transitions + later.transitions,
                                       failures=self.failures + later.failures,
                                       bytes_moved=self.bytes_moved + later.bytes_moved)


class LoRAStats(msgspec.Struct, array_like=True, gc=False):
    """With LoRA on: the adapters (names) of the running and of the waiting requests, and the
    slots; vLLM's vllm:lora_requests_info, which LoRA-aware routers read."""

    max_loras: int
    running: list[str] = msgspec.field(default_factory=list)
    waiting: list[str] = msgspec.field(default_factory=list)


class EngineStats(msgspec.Struct, array_like=True, gc=False):
    """Gauges (running, waiting, KV usage, blocks) and counters (steps, preemptions, prefix-cache
    tokens). From ``EngineCore.make_stats()`` the counters are those since the previous call;
    ``LLM.get_stats()`` returns them summed since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_cache: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    step_tokens: list[int] = msgspec.field(default_factory=list)  # tokens of each step since the previous stats
    balancer: BalancerStats | None = None  # with EPLB only
    structured_outputs: StructuredOutputStats | None = None  # once a request asked for a grammar
    kv_offload: KVOffloadStats | None = None  # with KV offload on
    elastic: ElasticStats | None = None  # with elastic expert parallelism on
    lora: LoRAStats | None = None  # with LoRA on (a gauge: the latest)

    def add_counters(self, later: EngineStats) -> EngineStats:
        """These counters plus a later snapshot's, with the later gauges (and the later
        step_tokens only: a running total keeps no per-step list)."""
        return EngineStats(
            later.num_running, later.num_waiting, later.kv_cache_usage, later.num_kv_blocks,
            later.num_free_kv_blocks, self.num_steps + later.num_steps, self.num_preemptions + later.num_preemptions,
            PrefixCacheStats(self.prefix_cache.queries + later.prefix_cache.queries,
                             self.prefix_cache.hits + later.prefix_cache.hits),
            later.step_tokens,
            later.balancer if self.balancer is None else self.balancer.add(later.balancer),
            later.structured_outputs if self.structured_outputs is None
            else self.structured_outputs.add(later.structured_outputs),
            later.kv_offload if self.kv_offload is None else self.kv_offload.add(later.kv_offload),
            later.elastic if self.elastic is None else self.elastic.add(later.elastic),
            later.lora,
        )

    def with_gauges_of(self, engines: list[EngineStats]) -> EngineStats:
        """These counters with the gauges of several engines together (data parallelism, the
        engines' latest stats): requests and blocks summed, KV usage over all their blocks, the
        adapters of any engine's running and waiting requests."""
        if len(engines) <= 1:
            return self
        blocks = sum(e.num_kv_blocks for e in engines)
        loras = [e.lora for e in engines if e.lora is not None]
        lora = None if not loras else LoRAStats(loras[0].max_loras, sorted({n for x in loras for n in x.running}),
                                                sorted({n for x in loras for n in x.waiting}))
        return msgspec.structs.replace(
            self, num_running=sum(e.num_running for e in engines), num_waiting=sum(e.num_waiting for e in engines),
            kv_cache_usage=sum(e.kv_cache_usage * e.num_kv_blocks for e in engines) / blocks if blocks else 0.0,
            num_kv_blocks=blocks, num_free_kv_blocks=sum(e.num_free_kv_blocks for e in engines), lora=lora)


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True, gc=False):
    outputs: list[EngineCoreOutput]
    stats: EngineStats


class EngineStarting(msgspec.Struct, tag="starting", array_like=True, gc=False):
    """Sent as the engine enters each start-up phase (``STARTUP_PHASES``); ``/ready`` shows
    where a starting engine is, and how long each phase took once it is ready."""

    phase: str
    seconds: float  # since the engine core began to start


# In order; the engine core reports each as it enters it (engine_core.py, core_process.py).
STARTUP_PHASES = ("loading weights", "profiling memory", "allocating KV cache and capturing CUDA graphs",
                  "warming up")


class EngineReady(msgspec.Struct, tag="ready", array_like=True, gc=False):
    """Sent once, when the engine has warmed up; ``/ready`` shows it."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    device: str
    dtype: str
    gpus: list[int]
    numa_nodes: list[int]
    expert_parallel_size: int = 1
    startup_seconds: float = 0.0  # from the engine core's first phase to ready


class EngineFailed(msgspec.Struct, tag="failed", array_like=True, gc=False):
    reason: str


FromCore = EngineCoreOutputs | EngineStarting | EngineReady | EngineFailed
