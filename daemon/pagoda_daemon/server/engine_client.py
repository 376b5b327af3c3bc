"""The API server's handle on the EngineCore processes: one, or one per data-parallel rank.

Tokenisation, validation and detokenisation happen here; the cores see token ids. Each
request goes to one core (engine_router.py: where its prefix was sent before, within a bound on
the load, else the least loaded) and stays there. One task per
core reads its output socket and routes each request's outputs to its collector
(server/output_collector.py: outputs a slow reader has not taken yet are merged); a
watchdog notices within a fraction of a second when a core process dies and fails every
in-flight request with a clear error instead of letting it hang (the daemon then exits, so
the pod restarts with all its engines: one dead engine is a dead replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.engine.input_processor import (
    InputProcessor,
    PromptType,
    cache_salt_keys,
    resolve_eos_token_id,
)
from pagoda_daemon.engine.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineFailed,
    EngineReady,
    EngineStarting,
    EngineStats,
    FinishRequest,
    ResizeExperts,
    Shutdown,
    WakeUp,
)
from pagoda_daemon.engine.output_processor import OutputProcessor
from pagoda_daemon.lora.request import LoRARequest, lora_cache_keys
from pagoda_daemon.models import loader
from pagoda_daemon.outputs import RequestOutput, RequestOutputKind
from pagoda_daemon.pooling import PoolingParams
from pagoda_daemon.sampling_params import SamplingParams
from pagoda_daemon.server import wire
from pagoda_daemon.server.core_process import run_engine_core
from pagoda_daemon.server.engine_router import EngineRouter, block_hashes
from pagoda_daemon.server.errors import APIError
from pagoda_daemon.server.output_collector import OutputCollector

log = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.2
DRAIN_POLL_S = 0.05
WAKE_FRAME = wire.encode(WakeUp())
SHUTDOWN_SEND_S = 2.0  # the core reads its input between steps; a live one takes the Shutdown at once


class EngineDeadError(RuntimeError):
    """The engine cannot finish this request: it died (500 `engine_dead`)."""

    def api_error(self) -> APIError:
        return APIError(f"the engine failed: {self}", 500, code="engine_dead")


class ServerShuttingDownError(EngineDeadError):
    """The server stopped before this request finished (its drain timeout ran out):
    503 `server_shutting_down`, so a client or router retries elsewhere."""

    def api_error(self) -> APIError:
        return APIError(f"the server is shutting down: {self}", 503, code="server_shutting_down",
                        headers={"Retry-After": "1"})


@dataclass
class _Core:
    """One engine core process (data-parallel rank `index`) and what the client knows of it."""

    index: int
    to_core: zmq.asyncio.Socket
    from_core: zmq.asyncio.Socket
    process: multiprocessing.process.BaseProcess | None = None
    ready: EngineReady | None = None
    startup: list[EngineStarting] = field(default_factory=list)  # the start-up phases entered so far
    gauges: EngineStats | None = None  # its latest stats
    in_flight: int = 0
    routed: int = 0  # requests sent to it since start


@dataclass
class _Tracked:
    """What the client keeps per in-flight request (for routing and metrics)."""

    collector: OutputCollector
    prompt_tokens: int
    core: _Core
    generated: int = 0
    max_tokens: int | None = None


@dataclass(frozen=True)
class PreparedRequest:
    """One request, validated and encoded, ready to be submitted."""

    request_id: str
    prompt_text: str | None
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    frame: bytes
    salt_keys: tuple = ()  # its cache salt's block-hash keys: where its prefix was sent before (engine_router.py)


class ResizeBusy(Exception):
    """An elastic resize is under way: one at a time."""


class EngineClient:
    def __init__(self, config: EngineConfig, metrics=None, log_level: str = "INFO",
                 kv_events_endpoint: str | None = None, model: loader.EngineModel | None = None,
                 stats_log_interval: float = 0.0) -> None:
        self.config = config
        self.kv_events_endpoint = kv_events_endpoint
        self.metrics = metrics
        model = model or loader.load_engine_model(config)
        self.model_config, self.tokenizer, self.pair_format = model.config, model.tokenizer, model.pair_format
        self.eos_token_id = resolve_eos_token_id(self.tokenizer, self.model_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor: InputProcessor | None = None  # needs max_model_len, known once ready
        self.ready_info: EngineReady | None = None  # once every core is ready: them together
        self.dead_reason: str | None = None
        self.draining = False  # set on SIGTERM: no new requests, in-flight ones get until the drain timeout
        self._dead = asyncio.Event()
        self.requests: dict[str, _Tracked] = {}
        self._stats: EngineStats | None = None  # the core's gauges, and its counters summed
        self._resize_requested: int | None = None  # the latest elastic resize asked of the core
        self.stats_log_interval = stats_log_interval  # seconds between engine-stats log lines; 0: none
        self._period: EngineStats | None = None  # the counters since the last engine-stats line
        self._period_tokens = 0  # tokens the engine's steps computed since then
        self._log_level = log_level
        self._tmp = tempfile.TemporaryDirectory(prefix="pagoda-")
        self._ctx = zmq.asyncio.Context()
        self._cores = [_Core(d, self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL))
                       for d in range(config.data_parallel_size)]
        self._router = EngineRouter(len(self._cores)) if len(self._cores) > 1 else None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False  # shutdown() under way: engines leaving are not failures

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        spawn = multiprocessing.get_context("spawn")
        if self.config.data_parallel_experts:  # the engines' processes meet in this private folder
            self.config = dataclasses.replace(self.config, data_parallel_rendezvous=f"{self._tmp.name}/engines")
        for core in self._cores:
            in_addr = f"ipc://{self._tmp.name}/in{core.index}"
            out_addr = f"ipc://{self._tmp.name}/out{core.index}"
            core.to_core.setsockopt(zmq.LINGER, 0)
            core.to_core.bind(in_addr)
            core.from_core.bind(out_addr)
            core.process = spawn.Process(
                target=run_engine_core, name=f"pagoda-engine-core-{core.index}", daemon=True,
                args=(self.config.for_data_parallel_rank(core.index), in_addr, out_addr, os.getpid(), self._log_level,
                      self.kv_events_endpoint),
            )
            core.process.start()
            self._tasks.append(asyncio.create_task(self._read_outputs(core)))
        self._tasks.append(asyncio.create_task(self._watchdog()))
        if self.stats_log_interval > 0:
            self._tasks.append(asyncio.create_task(self._log_stats()))

    async def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.ready_info is None:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not ready after {timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    @property
    def is_ready(self) -> bool:
        return self.ready_info is not None and self.dead_reason is None and not self.draining

    @property
    def not_ready_reason(self) -> str | None:
        """Why new requests are refused now (None when they are served)."""
        if self.dead_reason is not None:
            return self.dead_reason
        if self.draining:
            return "the server is shutting down"
        if self.ready_info is not None:
            return None
        core = next(c for c in self._cores if c.ready is None)
        engine = f"engine {core.index} of {len(self._cores)}" if len(self._cores) > 1 else "the engine"
        return f"{engine} is still starting" + (f": {core.startup[-1].phase}" if core.startup else "")

    def startup_phases(self) -> list[dict[str, object]]:
        """Each phase entered, when (seconds from the engine's start) and, once over, how long it took
        (with data parallelism, each engine's, an `engine` key saying whose)."""
        many = len(self._cores) > 1
        return [{"phase": phase, "started_s": started, **({"seconds": seconds} if seconds is not None else {}),
                 **({"engine": core.index} if many else {})}
                for core in self._cores for phase, started, seconds in _phases(core)]

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    async def wait_dead(self) -> str:
        """Until the engine has died (and its requests were failed); returns why."""
        await self._dead.wait()
        return self.dead_reason or ""

    async def drain(self, timeout_s: float) -> None:
        """Let in-flight requests finish for up to `timeout_s`, then end the rest with a
        ServerShuttingDownError (streams get an error event and [DONE], others a 503)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.requests:
            log.warning("drain timeout: ending %d in-flight requests", len(self.requests))
            self._fail_in_flight(ServerShuttingDownError(f"the drain timeout of {timeout_s:g} s ran out"))

    async def shutdown(self) -> None:
        self._stopping = True
        live = [c.process for c in self._cores if c.process is not None and c.process.is_alive()]
        if self.dead_reason is None:  # a dead core (still exiting) reads nothing: the send would wait forever
            for core in self._cores:
                with contextlib.suppress(zmq.ZMQError, TimeoutError):
                    await asyncio.wait_for(core.to_core.send(wire.encode(Shutdown())), SHUTDOWN_SEND_S)
        await asyncio.gather(*(asyncio.to_thread(p.join, 5) for p in live))
        for process in live:  # the others also end with this process (core_process.py)
            if process.is_alive():
                process.kill()
        for t in self._tasks:
            t.cancel()
        for core in self._cores:
            core.to_core.close(0)
            core.from_core.close(0)
        self._ctx.term()
        self._tmp.cleanup()

    # ---- requests ---------------------------------------------------------------------

    def validate(self, prompt: PromptType, params: SamplingParams, *, add_special_tokens: bool = True,
                 truncate_prompt_tokens: int | None = None, pooling: bool = False) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt (``pooling``: an embedding input); ValueError on bad input."""
        if self.input_processor is None:
            raise EngineDeadError("the engine is not ready")
        return self.input_processor.process(prompt, params, add_special_tokens=add_special_tokens,
                                            truncate_prompt_tokens=truncate_prompt_tokens, pooling=pooling)

    @property
    def num_in_flight(self) -> int:
        return len(self.requests)

    def prepare(self, request_id: str, prompt_text: str | None, prompt_ids: list[int], params: SamplingParams,
                cache_salt: str | None = None, arrival: float | None = None,
                kv_source: str | None = None, lora: LoRARequest | None = None,
                pooling: PoolingParams | None = None) -> PreparedRequest:
        """Encode one (validated) request for the core; ValueError when it cannot be. Nothing is
        registered yet, so a failure here leaves nothing behind."""
        arrival = time.monotonic() if arrival is None else arrival
        salt = cache_salt_keys(cache_salt)
        frame = wire.encode_add(request_id, prompt_ids, params, self.eos_token_id, salt, arrival, kv_source, lora,
                                pooling)
        # the keys the core's block hashes take (the adapter's added by Request), for routing by prefix
        return PreparedRequest(request_id, prompt_text, prompt_ids, params, arrival, frame,
                               salt + lora_cache_keys(lora))

    def submit(self, request: PreparedRequest,
               output_kind: RequestOutputKind = RequestOutputKind.DELTA) -> AsyncIterator[RequestOutput]:
        """Admit a prepared request now, so it counts as in flight at once, and return the
        iterator of its outputs (DELTA: each carries only what is new, so streaming costs what
        it sends; FINAL_ONLY: one output at the end); closing the iterator early aborts the
        request. All or nothing: on any exception the request is not left registered."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in flight")
        core = self._cores[0]
        if self._router is not None:
            hashes = block_hashes(request.prompt_ids, self.config.block_size, request.salt_keys)
            core = self._cores[self._router.choose(hashes, [c.in_flight for c in self._cores],
                                                   [c.routed for c in self._cores])]
        tracked = _Tracked(OutputCollector(output_kind), len(request.prompt_ids), core,
                           max_tokens=request.params.max_tokens)
        self.requests[rid] = tracked
        core.in_flight += 1
        try:
            self.output_processor.add_request(rid, request.prompt_text, request.prompt_ids, request.params,
                                              output_kind, request.arrival)
            core.to_core.send(request.frame)
            if self.config.data_parallel_experts:  # the others run this request's MoE layers too
                for other in self._cores:
                    if other is not core and other.in_flight == 0:  # the ones that may be waiting idle
                        other.to_core.send(WAKE_FRAME)
        except BaseException:
            self._forget(rid)
            self.output_processor.abort_request(rid)
            raise
        core.routed += 1
        return self._outputs(rid, tracked)

    def _forget(self, request_id: str) -> None:
        """The request is no longer in flight (finished, failed or abandoned by its reader)."""
        tracked = self.requests.pop(request_id, None)
        if tracked is not None:
            tracked.core.in_flight -= 1

    async def _outputs(self, request_id: str, tracked: _Tracked) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                try:
                    item = await tracked.collector.get()
                except Exception:
                    finished = True
                    raise
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._forget(request_id)
            if not finished:  # the caller went away (client disconnect): give the blocks back
                aborted = self.output_processor.abort_request(request_id)
                if aborted is not None and self.metrics is not None:
                    self._record_finished(aborted, tracked, time.monotonic())
                if self.dead_reason is None:
                    with contextlib.suppress(zmq.ZMQError):
                        await tracked.core.to_core.send(wire.encode(AbortRequests([request_id])))

    # ---- background tasks -------------------------------------------------------------

    async def _read_outputs(self, core: _Core) -> None:
        while True:
            message = wire.decode_from_core(await core.from_core.recv())
            if isinstance(message, EngineCoreOutputs):
                self._route(core, message.outputs)
                self._record_stats(core, message.stats)
            elif isinstance(message, EngineStarting):
                core.startup.append(message)
            elif isinstance(message, EngineReady):
                core.ready = message
                if self._router is not None:
                    self._router.set_capacity(core.index, message.num_kv_blocks)
                log.info("engine %sready: %s", f"{core.index} " if len(self._cores) > 1 else "", message)
                if all(c.ready is not None for c in self._cores):
                    self._on_ready([c.ready for c in self._cores if c.ready is not None])
            elif isinstance(message, EngineFailed):
                self._fail_all(f"engine {core.index}: {message.reason}" if len(self._cores) > 1 else message.reason)

    def _on_ready(self, engines: list[EngineReady]) -> None:
        """Every engine is ready: what they offer together (the shortest model length, every
        block and GPU), for /ready, the input checks and the metrics."""
        first = engines[0]
        self.ready_info = msgspec.structs.replace(
            first, max_model_len=min(e.max_model_len for e in engines),
            num_kv_blocks=sum(e.num_kv_blocks for e in engines),
            gpus=sorted({g for e in engines for g in e.gpus}),
            numa_nodes=sorted({n for e in engines for n in e.numa_nodes}),
            startup_seconds=max(e.startup_seconds for e in engines))
        info = self.ready_info
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size, info.max_model_len,
                                              self.config.scheduling_policy, self.pair_format)
        if self.metrics is not None:
            self.metrics.set_placement(info.gpus, info.numa_nodes, info.expert_parallel_size)
            self.metrics.set_cache_config(info.block_size, info.num_kv_blocks, self.config.enable_prefix_caching)
            slowest: dict[str, float] = {}  # each phase as long as the slowest engine took
            for phase, _, seconds in (p for c in self._cores for p in _phases(c)):
                if seconds is not None:
                    slowest[phase] = max(slowest.get(phase, 0.0), seconds)
            self.metrics.set_startup(slowest)

    def _route(self, core: _Core, core_outputs) -> None:
        now = time.monotonic()
        processed = self.output_processor.process(core_outputs)
        for rid, stop_str in processed.stop_string_finished:
            core.to_core.send(wire.encode(FinishRequest(rid, stop_str)))  # zmq.asyncio send: fire and forget
        if self.metrics is not None:
            for seconds, n in processed.inter_token:
                self.metrics.observe_inter_token(seconds, n)
        for core_out in core_outputs:
            tracked = self.requests.get(core_out.request_id)
            if tracked is not None:
                tracked.generated += len(core_out.new_token_ids)
        for out in processed.outputs:
            tracked = self.requests.get(out.request_id)
            if tracked is None:
                continue
            if out.finished:
                # done here, not only when its reader finishes: a reader that never started must not leak it
                self._forget(out.request_id)
                if self.metrics is not None:
                    self._record_finished(out, tracked, now)
            tracked.collector.put(out)

    def _record_finished(self, out: RequestOutput, tracked: _Tracked, now: float) -> None:
        timing = out.metrics
        assert timing is not None and self.metrics is not None
        # imported here: metrics exist, so prometheus_client is installed
        from pagoda_daemon.telemetry.metrics import FinishedRequest

        scheduled = None if timing.queue_time is None else timing.arrival_time + timing.queue_time
        first, last = timing.first_token_time, timing.last_token_time
        self.metrics.observe_finished(FinishedRequest(
            out.outputs[0].finish_reason or "abort", now - timing.arrival_time, timing.queue_time,
            timing.time_to_first_token, tracked.prompt_tokens, tracked.generated,
            cached_tokens=out.num_cached_tokens, max_tokens=tracked.max_tokens,
            prefill_s=None if scheduled is None or first is None else max(first - scheduled, 0.0),
            decode_s=None if first is None or last is None else last - first,
        ))
        self.metrics.add_tokens(tracked.prompt_tokens, tracked.generated)

    def _record_stats(self, core: _Core, stats: EngineStats) -> None:
        """The core's gauges replace its last ones (the engines' gauges together are the replica's);
        its counters (since its previous stats) add up."""
        core.gauges = stats
        stats = stats.with_gauges_of([c.gauges for c in self._cores if c.gauges is not None])
        self._stats = stats if self._stats is None else self._stats.add_counters(stats)
        self._period = stats if self._period is None else self._period.add_counters(stats)
        self._period_tokens += sum(stats.step_tokens)
        if self.metrics is not None:
            self.metrics.record_engine_stats(stats)

    # ---- elastic expert parallelism --------------------------------------------------------

    def elastic_state(self) -> dict | None:
        """The replica's expert-parallel size, bounds and latest resize (its phase, seconds,
        error; transitions, failures and bytes moved since start). None: elastic EP is off."""
        c = self.config
        if not c.elastic_ep:
            return None
        e = self._stats.elastic if self._stats is not None else None
        state = (_as_dict(e) if e is not None else
                 {"size": c.expert_parallel_size, "min_size": c.elastic_ep_min_size, "max_size": c.elastic_ep_max_size,
                  "phase": "idle"})
        return {**state, "requested": self._resize_requested}

    def is_resizing(self) -> bool:
        """A resize was asked for and the core has not reported it done or failed yet."""
        e = self._stats.elastic if self._stats is not None else None
        if self._resize_requested is None:
            return False
        return e is None or e.target != self._resize_requested or e.phase not in ("done", "failed")

    def resize_experts(self, size: int) -> None:
        """Ask the core for `size` expert-parallel ranks (ValueError: out of bounds; ResizeBusy:
        one is under way). The core resizes between two steps; the stats say how it went."""
        self.config.check_elastic_size(size)
        if self.is_resizing():
            raise ResizeBusy(f"a resize to {self._resize_requested} is under way")
        self._resize_requested = size
        self._cores[0].to_core.send(wire.encode(ResizeExperts(size)))  # elastic EP: one engine (config.py)

    @property
    def last_stats(self) -> dict:
        """The engines' last stats, with the requests this client holds (`in_flight`); with data
        parallelism, each engine's too (`engines`: where requests went and what each runs)."""
        stats = {} if self._stats is None else _as_dict(self._stats)
        if len(self._cores) > 1:
            stats["engines"] = [
                {"engine": c.index, "in_flight": c.in_flight, "requests": c.routed,
                 **({} if c.gauges is None else {"num_running": c.gauges.num_running,
                                                 "num_waiting": c.gauges.num_waiting,
                                                 "kv_cache_usage": c.gauges.kv_cache_usage})}
                for c in self._cores]
        return {**stats, "in_flight": self.num_in_flight}

    async def _log_stats(self) -> None:
        """Every interval with engine steps in it, one line as vLLM's: tokens per second, the
        queue, KV cache use and prefix-cache hits (an idle engine says nothing)."""
        while True:
            await asyncio.sleep(self.stats_log_interval)
            period, tokens, self._period, self._period_tokens = self._period, self._period_tokens, None, 0
            if period is None or period.num_steps == 0:
                continue
            hits = period.prefix_cache.hits / period.prefix_cache.queries if period.prefix_cache.queries else 0.0
            log.info("engine: %.1f tokens/s over %d steps, running %d, waiting %d, KV cache %.1f%%, "
                     "prefix-cache hits %.1f%%, preemptions %d", tokens / self.stats_log_interval,
                     period.num_steps, period.num_running, period.num_waiting, 100 * period.kv_cache_usage,
                     100 * hits, period.num_preemptions)

    async def _watchdog(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if self._stopping:  # the engines exit because they were asked to: no failure
                return
            for core in self._cores:
                if core.process is not None and not core.process.is_alive():
                    which = f"engine {core.index}'s" if len(self._cores) > 1 else "the engine"
                    self._fail_all(f"{which} process exited (exit code {core.process.exitcode})")
                    break

    def _fail_all(self, reason: str) -> None:
        if self.dead_reason is None:
            log.error("engine failed: %s", reason)
            self.dead_reason = reason
        self._fail_in_flight(EngineDeadError(reason))
        self._dead.set()

    def _fail_in_flight(self, error: EngineDeadError) -> None:
        for tracked in self.requests.values():
            tracked.collector.put(error)


def _phases(core: _Core) -> list[tuple[str, float, float | None]]:
    """A core's start-up phases: (name, seconds from its start, seconds it took, or None while under way)."""
    # A phase ends where the next begins; the last, at ready (or not yet).
    ends = [p.seconds for p in core.startup[1:]] + [core.ready.startup_seconds if core.ready else None]
    return [(p.phase, p.seconds, None if end is None else round(end - p.seconds, 3))
            for p, end in zip(core.startup, ends)]


def _as_dict(struct: msgspec.Struct) -> dict:
    """A stats struct as a JSON object, nested structs too (the array-like wire form is for the engine)."""
    return {key: _as_dict(value) if isinstance(value, msgspec.Struct) else value
            for key, value in msgspec.structs.asdict(struct).items()}
