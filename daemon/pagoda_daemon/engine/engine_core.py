"""The engine core: scheduler, KV cache manager and model runner, one step at a time.

Works in token ids only; text (detokenisation, stop strings) is the frontend's job,
so this loop can later run in its own process behind a socket unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import msgspec

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.distributed.layout import check_layout
from pagoda_daemon.engine.grammar import GrammarManager
from pagoda_daemon.engine.kv_cache_manager import KVCacheManager
from pagoda_daemon.engine.messages import (
    STARTUP_PHASES,
    BalancerStats,
    ElasticStats,
    EngineCoreOutput,
    EngineStats,
)
from pagoda_daemon.engine.request import Request, RequestStatus
from pagoda_daemon.engine.scheduler import Scheduler
from pagoda_daemon.engine.scheduler_output import GrammarBitmask, SchedulerOutput
from pagoda_daemon.executor.abstract import Executor
from pagoda_daemon.models import loader
from pagoda_daemon.models.registry import max_positions
from pagoda_daemon.pooling import engine_pooling, is_encoder
from pagoda_daemon.telemetry.profiling import phase

if TYPE_CHECKING:
    from pagoda_daemon.worker.model_runner import LaunchedStep

log = logging.getLogger(__name__)
WAITING_STEP_S = 0.001  # an empty step's pause while every request waits for something beside the engine


def default_executor(config: EngineConfig, model_config, max_model_len: int,
                     exit_on_worker_death: bool = False) -> Executor:
    """One worker in this process; under tensor/expert parallelism, this process's worker is
    rank 0 and the executor starts the others, unless a launcher started every rank already (a
    torch.distributed world is up: then each rank runs its own engine, one worker each).
    `exit_on_worker_death`: a process that only runs the engine (`pagoda serve`'s engine core)
    exits at once when another rank dies, rather than wait in a collective."""
    import torch.distributed as dist

    if (config.world_size > 1 or config.elastic_ep) and not dist.is_initialized():  # elastic: ranks may join
        from pagoda_daemon.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, model_config, max_model_len, exit_on_worker_death)
    from pagoda_daemon.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config, model_config, max_model_len)


def _eos_ids(model_config) -> list[int]:
    eos = getattr(model_config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


class EngineCore:
    def __init__(self, config: EngineConfig, model_config=None, executor: Executor | None = None,
                 exit_on_worker_death: bool = False, on_phase: Callable[[str], None] | None = None,
                 tokenizer=None) -> None:
        """``on_phase`` hears each start-up phase (messages.STARTUP_PHASES) as it begins.
        ``tokenizer``: the frontend's, where it shares this process (else the core loads its own
        when the first structured-output request arrives)."""
        enter = on_phase or (lambda _name: None)
        self.model_config = model_config or loader.engine_model_config(config)
        # a pooling engine (embeddings, pooling.py) or a generating one; the workers see which
        self.pooling = engine_pooling(config, self.model_config)
        config = dataclasses.replace(config, runner="pooling" if self.pooling is not None else "generate")
        encoder = is_encoder(getattr(self.model_config, "architectures", None))
        if encoder:
            # bidirectional attention: a prompt's states depend on all of it, so it is computed
            # whole, in one step, and no prefix of it is reused (models/bert.py)
            config = dataclasses.replace(config, enable_chunked_prefill=False, enable_prefix_caching=False)
        self.config = config
        self.max_model_len = self._max_model_len()
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            why = "an encoder computes each prompt in one step" if encoder else "without chunked prefill"
            raise ValueError(f"{why}, max_num_batched_tokens ({config.max_num_batched_tokens}) "
                             f"must be at least max_model_len ({self.max_model_len})")
        check_layout(self.model_config, config.tensor_parallel_size, config.expert_parallel_size, config.enable_eplb,
                     config.num_redundant_experts, config.elastic_ep_max_size, config.data_experts_engines)
        from pagoda_daemon.kv_offload import tiered

        tiered.check_options(config)  # a disk path that cannot work fails the start before anything loads
        enter(STARTUP_PHASES[0])
        self.executor = executor or default_executor(config, self.model_config, self.max_model_len,
                                                     exit_on_worker_death)
        enter(STARTUP_PHASES[1])
        num_blocks = self._num_kv_blocks()
        enter(STARTUP_PHASES[2])
        self.executor.initialize_cache(num_blocks)
        self.worker_info = self.executor.info()
        # Data-parallel attention: every step agreed with the other engines first (lockstep.py)
        self.lockstep = self.executor.lockstep()
        # Schedule step N+1 while step N runs (GPU default; on CPU there is nothing to overlap).
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.worker_info.device.startswith("cuda"))
        # the step launched but not collected yet, with what was scheduled for it; until its
        # sampling is launched, the grammar masks it waits for
        self._in_flight: tuple[SchedulerOutput, LaunchedStep | Future[GrammarBitmask]] | None = None
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                       record_events=config.enable_kv_events)
        self.connector = tiered.build_connector(config, self.worker_info.dtype,
                                                max(i.kv_block_bytes for i in self.executor.worker_infos()),
                                                self.worker_info.kv_transfer_cpu)
        self.scheduler = Scheduler(
            self.kv_cache,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.enable_chunked_prefill,
            GrammarManager(self._tokenizer_loader(tokenizer), self.model_config.vocab_size,
                           _eos_ids(self.model_config), config.structured_outputs_backend),
            self.connector,
            config.scheduling_policy,
            config.max_loras if config.enable_lora else 0,
        )
        self.elastic = (ElasticStats(config.expert_parallel_size, config.elastic_ep_min_size,
                                     config.elastic_ep_max_size) if config.elastic_ep else None)
        info = self.worker_info
        log.info(
            "engine ready: %s on %s, %s attention%s, %d KV blocks of %d tokens, max_model_len %d",
            info.dtype, info.device, info.attention_backend, ", CUDA graphs" if info.uses_cuda_graphs else "",
            num_blocks, config.block_size, self.max_model_len,
        )

    def _tokenizer_loader(self, tokenizer) -> Callable[[], object]:
        if tokenizer is not None:
            return lambda: tokenizer
        path = self.config.tokenizer or self.config.model
        return lambda: loader.load_tokenizer(path)

    def _max_model_len(self) -> int:
        limit = max_positions(self.model_config) or 2048
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the {limit} positions the model's "
                             f"max_position_embeddings holds")
        return wanted

    def _num_kv_blocks(self) -> int:
        num_blocks = self.executor.available_kv_blocks()
        needed = -(-self.max_model_len // self.config.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.config.block_size} tokens, fewer than one "
                f"sequence of max_model_len {self.max_model_len} needs ({needed}); give the cache more memory "
                f"or lower max_model_len"
            )
        return num_blocks

    def warm_up(self) -> None:
        """Before serving, send short requests through every kind of step, so that every kernel
        is compiled before the engine reports ready: a prefill-only step, decodes, and a
        step that mixes a decode with a prefill (the paged extend path). Then forget them:
        no cached blocks, no counted steps. (tests/gpu/test_warm_up.py checks that serving
        afterwards compiles no kernel.) KV offload is off meanwhile: nothing is looked up,
        loaded or saved for them."""
        self.scheduler.connector = None  # no offload traffic for made-up requests
        try:
            self._warm_up_steps()
        finally:
            self.scheduler.connector = self.connector

    def _warm_up_steps(self) -> None:
        from pagoda_daemon.sampling_params import SamplingParams

        bs = self.config.block_size
        first_len = max(1, min(bs, self.max_model_len - 4))
        first = list(range(3, 3 + first_len))
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        pooling = self.pooling.params() if self.pooling is not None else None  # a pooling engine pools
        self.add_request(Request("__warmup_0__", first, params, None, bs, pooling=pooling))
        self.step()  # prefill only
        # Shares the first block (a prefix-cache hit where caching is on) and prefills while
        # the first request decodes.
        second = first + list(range(200, 200 + max(0, min(8, self.max_model_len - first_len - 4))))
        self.add_request(Request("__warmup_1__", second, params, None, bs, pooling=pooling))
        while self.has_unfinished_requests():
            self.step()
        self.executor.synchronize()
        self.kv_cache.reset_prefix_cache()
        self.kv_cache.take_events()  # the warm-up's blocks were never real
        self.make_stats()  # nor its steps and cache hits

    # ---- requests ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if self.pooling is None and request.pooling is not None:
            raise ValueError("this engine generates text (runner generate): it serves no embeddings")
        if self.pooling is not None:
            if request.pooling is None:
                raise ValueError("this engine serves embeddings (runner pooling): it generates no text")
            if request.pooling.type != self.pooling.type:
                raise ValueError(f"this engine pools by {self.pooling.type}, not {request.pooling.type}")
            request.pooling.check(self.pooling.hidden_size)
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
        input preparation and output bookkeeping (CPU) overlap the GPU's work. A step with
        constrained rows samples later: its grammar masks need the previous step's tokens, so
        the backend's threads fill them after those are accepted, behind this step's forward
        pass, the outputs' bookkeeping and the next call's scheduling; the next call (or the
        collection of this step) waits for them and launches the sampling.

        With data-parallel attention (``self.lockstep``), the engines agree on each step first:
        if any has work, every one runs a forward pass of the same number of rows (an idle engine
        runs its MoE layers on padding for the others' tokens); if none has, none steps.
        """
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None and self.scheduler.num_needing_host_tokens:
            outputs = self._finish_in_flight()  # penalties need every token on the host first
            if self.lockstep is None:
                return outputs
        connector = self.scheduler.connector
        if connector is not None:  # disk blocks now in host memory: their requests may go on
            connector.staged(self.executor.take_staged_kv())
        # phase labels name the step's parts in torch-profiler traces (benchmarks/throughput.py).
        with phase("pagoda.schedule"):
            sched = (self.scheduler.schedule() if self.lockstep is None or self.scheduler.has_unfinished_requests()
                     else SchedulerOutput())
        if self.lockstep is not None:  # every engine runs this step, padded to the same rows, or none does
            with phase("pagoda.lockstep"):
                sched.lockstep = self.lockstep.agree(sched, self.has_unfinished_requests())
            if not sched.lockstep.anyone_busy:
                return outputs
        if (sched.is_empty and self._in_flight is None and not sched.kv_prefetch
                and not (sched.lockstep and sched.lockstep.tokens)):
            # every request waits (a grammar compiling, KV arriving from another instance): yield
            # to the threads doing that work rather than spin (a 100-block fetch on loopback took
            # 2,600 empty steps on 2 cores without this)
            time.sleep(WAITING_STEP_S)
        now = time.monotonic()
        for s in sched.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        self._sample_in_flight()  # the previous step's sampling comes before this step's inputs
        launched = self.executor.execute_model(sched)
        outputs += self._failed_outputs() + self._finish_in_flight()
        # None: constrained rows, whose masks need the tokens accepted just now
        self._in_flight = (sched, launched if launched is not None else self.scheduler.grammar_bitmask(sched))
        if (not self.async_scheduling or sched.is_empty or self.scheduler.num_needing_host_tokens
                or sched.loads_may_fail or not self.scheduler.has_unfinished_requests()):
            # this step's own outputs, now (with nothing left to schedule, a step launched for
            # requests that finished meanwhile holds only tokens to drop: an idle engine has none;
            # a step whose KV loads may fail is undone for their requests before anything builds on it)
            outputs += self._finish_in_flight()
        return outputs

    def _sample_in_flight(self) -> None:
        """Launch the sampling of the step in flight, if it waits for its grammar masks."""
        if self._in_flight is None:
            return
        sched, masks = self._in_flight
        if not isinstance(masks, Future):
            return
        with phase("pagoda.grammar_bitmask"):
            bitmask = masks.result()
        self._in_flight = (sched, self.executor.sample_tokens(bitmask))

    def _failed_outputs(self) -> list[EngineCoreOutput]:
        """Requests the scheduler finished on its own (a grammar that did not compile)."""
        return [EngineCoreOutput(request_id=r.request_id, new_token_ids=[], finish_reason=r.finish_reason,
                                 stop_reason=r.stop_reason) for r in self.scheduler.take_failed()]

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        if self._in_flight is None:
            return []
        self._sample_in_flight()
        sched, launched = self._in_flight
        self._in_flight = None
        assert not isinstance(launched, Future)
        result = launched.result()
        with phase("pagoda.update"):
            return self._outputs(sched, result)

    def _outputs(self, sched, result) -> list[EngineCoreOutput]:
        finished, accepted = self.scheduler.update_from_output(sched, result.sampled, result.failed_kv_blocks)
        finished_ids = {r.request_id for r in finished}
        outputs = []
        for s in sched.scheduled:
            req = s.request
            scored = result.prompt_logprobs.get(req.request_id)
            if scored is not None and req.prompt_logprobs is not None:
                first, entries = scored
                # a request recomputed after preemption scores its prompt again: keep the first
                req.prompt_logprobs.extend(entries[len(req.prompt_logprobs) - first:])
            token = accepted.get(req.request_id)
            if token is None and req.request_id not in finished_ids:
                continue
            prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None  # sent once
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
                    prompt_logprobs=prompt_logprobs,
                    pooled=result.pooled.get(req.request_id),
                )
            )
        return outputs

    # ---- elastic expert parallelism ----------------------------------------------------

    def resize_experts(self, size: int, on_phase: Callable[[str], None] | None = None) -> list[EngineCoreOutput]:
        """Serve on `size` expert-parallel ranks from the next step, without failing a request:
        the step in flight is collected first (its outputs are returned), the transition runs
        between steps (executor/resize.py), and a failed one leaves the replica serving at its
        old size with the reason in ``self.elastic``. ``on_phase`` hears each phase."""
        self.config.check_elastic_size(size)
        assert self.elastic is not None
        outputs = self._failed_outputs() + self._finish_in_flight()
        if size == self.elastic.size:
            self.elastic.target, self.elastic.phase = size, "done"
            return outputs
        started = time.monotonic()
        state = self.elastic
        old = state.size

        def enter(name: str) -> None:
            state.phase, state.target = name, size
            if on_phase is not None:
                on_phase(name)

        outcome = self.executor.resize(size, self.scheduler.requests, self.kv_cache.block_ids_with_content(), enter)
        state.size, state.last_seconds = outcome.size, round(time.monotonic() - started, 3)
        state.last_seconds_by_part = dict(outcome.seconds)
        state.phase, state.last_error = ("done", "") if outcome.committed else ("failed", outcome.error)
        state.transitions += 1
        state.failures += not outcome.committed
        state.bytes_moved += outcome.bytes_moved
        ranks = self.executor.worker_infos()
        state.gpus = [r.gpu for r in ranks if r.gpu is not None]
        state.numa_nodes = sorted({r.numa_node for r in ranks if r.numa_node is not None})
        log.info("elastic EP: %s %d -> %d in %.2f s (%.1f MiB of experts moved)%s",
                 "resized" if outcome.committed else "rolled back a resize", old, size, state.last_seconds,
                 outcome.bytes_moved / 2**20,
                 f": {outcome.error}" if outcome.error else "")
        self.config = dataclasses.replace(self.config, expert_parallel_size=outcome.size)
        return outputs

    def _take_elastic_stats(self) -> ElasticStats | None:
        """The gauges now and the counters since the previous call."""
        if self.elastic is None:
            return None
        now = msgspec.structs.replace(self.elastic)
        self.elastic.transitions = self.elastic.failures = self.elastic.bytes_moved = 0
        return now

    def shutdown(self) -> None:
        try:
            self._sample_in_flight()  # no worker is left inside a step waiting for its masks
        except Exception:
            log.exception("the step in flight could not sample before shutdown")
        self.executor.shutdown()
        if self.connector is not None:
            self.connector.close()
        if self.scheduler.grammars is not None:
            self.scheduler.grammars.shutdown()

    def make_stats(self) -> EngineStats:
        """The gauges now, and the counters (steps, preemptions, prefix-cache tokens) since the
        previous call: each consumer adds them to its own totals."""
        s = self.scheduler.make_stats()
        balancer = self.executor.balancer()
        return EngineStats(
            num_steps=s.num_steps,
            num_preemptions=s.num_preemptions,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage(),
            num_kv_blocks=self.kv_cache.num_blocks,
            num_free_kv_blocks=self.kv_cache.num_free_blocks,
            prefix_cache=self.kv_cache.make_stats(),
            step_tokens=s.step_tokens,
            balancer=None if balancer is None else BalancerStats(*balancer.take_stats()),
            structured_outputs=None if self.scheduler.grammars is None else self.scheduler.grammars.make_stats(),
            kv_offload=self._offload_stats(),
            elastic=self._take_elastic_stats(),
            lora=self.scheduler.lora_stats(),
        )

    def take_kv_events(self) -> list:
        """The KV events since the last call: the GPU prefix cache's, then the offload tiers'."""
        events = self.kv_cache.take_events()
        return events + self.connector.take_events() if self.connector is not None else events

    def _offload_stats(self):
        if self.connector is None:
            return None
        stats = self.connector.take_stats()
        offload = getattr(getattr(self.executor, "worker", None), "offload", None)  # rank 0's worker half
        if offload is not None:
            stats.transfer_seconds += offload.take_transfer_seconds()
        return stats
