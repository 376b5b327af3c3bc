"""The engine core: scheduler, KV cache manager and model runner, one step at a time.

Works in token ids only; text (detokenisation, stop strings) is the frontend's job,
so this loop can later run in its own process behind a socket unchanged.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

import torch

from pagoda_daemon.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from pagoda_daemon.engine.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pagoda_daemon.engine.request import Request, RequestStatus
from pagoda_daemon.engine.scheduler import Scheduler
from pagoda_daemon.models import loader
from pagoda_daemon.telemetry.profiling import phase

log = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    """What one step produced for one request (never a reference to the Request itself)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first schedule, sent with the final output


@dataclass
class EngineStats:
    num_steps: int
    num_preemptions: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    num_free_kv_blocks: int
    prefix_cache: PrefixCacheStats


def pin_worker(device: torch.device, policy: str):
    """Pin this worker to the cores nearest its GPU; a topology problem costs a warning, not the engine."""
    from pagoda_daemon.topology import pin_this_process

    local_rank = (device.index or 0) if device.type == "cuda" else 0
    try:
        return pin_this_process(local_rank, policy)
    except (OSError, ValueError) as e:
        log.warning("CPU pinning (%s) skipped: %s", policy, e)
        return None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    return device


def resolve_dtype(name: str, model_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return loader.DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    ckpt = loader.checkpoint_dtype(model_config)
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (modules, the model, configs: they live
    as long as the process) out of the garbage collector's reach. Full collections then scan
    only what serving allocates: on an H100, one full collection over the un-frozen heap
    stalled a serving step for 200 ms (docs/benchmarks/2026-11-21-session4.md).
    vLLM's engine core does the same after start-up."""
    gc.collect()
    gc.freeze()


class EngineCore:
    def __init__(self, config: EngineConfig, model_config=None) -> None:
        from pagoda_daemon.attention import get_attention_backend
        from pagoda_daemon.worker.model_runner import ModelRunner

        self.config = config
        self.model_config = model_config or loader.load_config(config.model)
        self.device = resolve_device(config.device)
        # Pin before anything big is allocated on the host, so it lands on local memory.
        self.cpu_pin = pin_worker(self.device, config.numa_policy)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.max_model_len = self._max_model_len()
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) "
                f"must be at least max_model_len ({self.max_model_len})"
            )
        torch.manual_seed(config.seed)
        backend = get_attention_backend(config.attention_backend, self.device)
        model = loader.load_model(
            config.model, self.model_config, self.dtype, self.device, backend, self.max_model_len,
            config.load_format,
        )
        self.runner = ModelRunner(model, self.model_config, config, self.device, self.dtype, self.max_model_len)
        num_blocks = self._num_kv_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        # Schedule step N+1 while step N runs (GPU default; on CPU there is nothing to overlap).
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda")
        self._in_flight = None  # (SchedulerOutput, launched step) whose outputs are not collected yet
        self.uses_cuda_graphs = self.device.type == "cuda" and backend.uses_kernels and not config.enforce_eager
        if self.uses_cuda_graphs:
            self.runner.capture_cuda_graphs()
        elif self.device.type == "cuda" and not config.enforce_eager:
            log.info("CUDA graphs off: the %s attention backend cannot be captured", backend.name)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                       record_events=config.enable_kv_events)
        self.scheduler = Scheduler(
            self.kv_cache,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.enable_chunked_prefill,
        )
        log.info(
            "engine ready: %s, %s on %s, %s attention%s, %d KV blocks of %d tokens, max_model_len %d",
            type(model).__name__, self.dtype, self.device, backend.name,
            ", CUDA graphs" if self.uses_cuda_graphs else "", num_blocks, config.block_size, self.max_model_len,
        )

    def _max_model_len(self) -> int:
        limit = getattr(self.model_config, "max_position_embeddings", None) or 2048
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}")
        return wanted

    def _num_kv_blocks(self) -> int:
        per_block = self.runner.kv_block_bytes()
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            num_blocks = self._profile_gpu_blocks(per_block)
        else:
            budget = self.config.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
            num_blocks = budget // per_block
        needed = -(-self.max_model_len // self.config.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.config.block_size} tokens, fewer than one "
                f"sequence of max_model_len {self.max_model_len} needs ({needed}); give the cache more memory "
                f"or lower max_model_len"
            )
        return num_blocks

    def _profile_gpu_blocks(self, per_block: int) -> int:
        """KV budget = gpu_memory_utilization x the memory left free after a profiling forward pass."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.runner.profile_peak_memory()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        free_after_profile = total - non_torch - peak
        budget = int(free_after_profile * self.config.gpu_memory_utilization)
        log.info("memory profile: total %.1f GiB, peak torch %.2f GiB, other %.2f GiB, KV budget %.2f GiB",
                 total / 2**30, peak / 2**30, non_torch / 2**30, budget / 2**30)
        torch.cuda.empty_cache()
        return max(budget // per_block, 0)

    def warm_up(self) -> None:
        """Before serving, send short requests through every kind of step, so that every kernel
        is compiled before the engine reports ready: a prefill-only step, decodes, and a
        step that mixes a decode with a prefill (the paged extend path). Then forget them:
        no cached blocks, no counted steps. (tests/gpu/test_warm_up.py checks that serving
        afterwards compiles no kernel.)"""
        from pagoda_daemon.engine.scheduler import SchedulerStats
        from pagoda_daemon.sampling_params import SamplingParams

        bs = self.config.block_size
        first_len = max(1, min(bs, self.max_model_len - 4))
        first = list(range(3, 3 + first_len))
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        self.add_request(Request("__warmup_0__", first, params, None, bs))
        self.step()  # prefill only
        # Shares the first block (a prefix-cache hit where caching is on) and prefills while
        # the first request decodes.
        second = first + list(range(200, 200 + max(0, min(8, self.max_model_len - first_len - 4))))
        self.add_request(Request("__warmup_1__", second, params, None, bs))
        while self.has_unfinished_requests():
            self.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.kv_cache.reset_prefix_cache()
        self.kv_cache.pool.drain_events()  # the warm-up's blocks were never real
        self.kv_cache.stats = type(self.kv_cache.stats)()
        self.scheduler.stats = SchedulerStats()
        freeze_startup_heap()

    # ---- requests ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        self._drain_if_idle()

    def finish_request(self, request_id: str, stop_reason: int | str | None) -> None:
        """Stop a request the frontend decided is done (a stop string)."""
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED, stop_reason)
        self._drain_if_idle()

    def _drain_if_idle(self) -> None:
        """With every request finished, a step still in flight holds only tokens to drop:
        collect it now, so that an idle engine reports no unfinished work."""
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            self._finish_in_flight()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # ---- the loop ---------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch a step; return the outputs of the step that completed.

        With async scheduling, the step launched here is left running on the GPU and the
        outputs returned are those of the step launched by the previous call: scheduling,
        input preparation and output bookkeeping (CPU) overlap the GPU's work.
        """
        if self._in_flight is not None and self.scheduler.num_needing_host_tokens:
            return self._finish_in_flight()  # penalties need every token on the host first
        # phase labels name the step's parts in torch-profiler traces (bench/throughput.py).
        with phase("pagoda.schedule"):
            sched = self.scheduler.schedule()
        now = time.monotonic()
        for s in sched.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        launched = self.runner.execute(sched)
        outputs = self._finish_in_flight()
        self._in_flight = (sched, launched)
        if not self.async_scheduling or sched.is_empty or self.scheduler.num_needing_host_tokens:
            outputs += self._finish_in_flight()  # this step's own outputs, now
        return outputs

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        if self._in_flight is None:
            return []
        sched, launched = self._in_flight
        self._in_flight = None
        result = launched.result()
        with phase("pagoda.update"):
            return self._outputs(sched, result)

    def _outputs(self, sched, result) -> list[EngineCoreOutput]:
        finished, accepted = self.scheduler.update_from_output(sched, result.sampled)
        finished_ids = {r.request_id for r in finished}
        outputs = []
        for s in sched.scheduled:
            req = s.request
            token = accepted.get(req.request_id)
            if token is None and req.request_id not in finished_ids:
                continue
            lp = result.logprobs.get(req.request_id)
            queue_time = None
            if req.finish_reason is not None and req.first_scheduled_time is not None:
                queue_time = req.first_scheduled_time - req.arrival_time
            outputs.append(
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[token] if token is not None else [],
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    new_logprobs=[lp] if lp is not None else [],
                    num_cached_tokens=req.num_cached_tokens,
                    queue_time=queue_time,
                )
            )
        return outputs

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_steps=s.stats.num_steps,
            num_preemptions=s.stats.num_preemptions,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=self.kv_cache.usage(),
            num_kv_blocks=self.kv_cache.num_blocks,
            num_free_kv_blocks=self.kv_cache.num_free_blocks,
            prefix_cache=self.kv_cache.stats,
        )
