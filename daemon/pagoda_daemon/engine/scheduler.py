"""Continuous batching with chunked prefill and preemption by recompute.

One token budget per step is shared by running requests (decodes and unfinished
prefill chunks, served first, in FCFS order) and then by waiting ones. When blocks
run out, the latest-arrived running request is preempted: its blocks are freed and
it goes back to the front of the queue, to be recomputed (cheaply, from the prefix
cache where its blocks survive). Under the "priority" policy both the queue and the
running list are kept in (priority, arrival) order, as vLLM orders them: the most urgent
request is served and admitted first, and the least urgent running one is preempted first
(the end of the list, which the step has not reached yet when it runs out of blocks).

A request's progress advances when it is scheduled, not when its step returns, so the
next step can be scheduled while this one still runs on the GPU (async scheduling, see
EngineCore). A step that reaches the end of a request's tokens samples one more token,
which counts as *pending* until update_from_output brings it to the host: the next
schedule already gives that request its decode step (the model runner takes the
pending token straight from the previous step's device output).

A waiting request whose prefix comes back from the KV offload tiers' host memory joins the
step while the step's host loads stay within the connector's ``step_load_blocks``: they cross
beside the forward pass, each layer's attention waiting for its own. Beyond that, it is
admitted without joining the step: its blocks cross beside the step (``kv_prefetch``) and it
computes from the next step, so the batch does not wait for a large copy (docs/kv-offload.md,
"Loads beside the step"). A request whose prefix is on disk waits, keeping its place, while its
blocks are read into host memory in the background (``kv_stages``), then comes back that way.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda_daemon.config import SCHEDULING_POLICIES
from pagoda_daemon.engine.grammar import GrammarManager
from pagoda_daemon.engine.kv_cache_manager import KVCacheManager
from pagoda_daemon.engine.messages import LoRAStats
from pagoda_daemon.engine.request import Request, RequestStatus
from pagoda_daemon.engine.scheduler_output import (
    SAVES_FROM_GPU,
    GrammarBitmask,
    ScheduledRequest,
    SchedulerOutput,
)
from pagoda_daemon.lora.slots import SlotTable

if TYPE_CHECKING:
    from pagoda_daemon.engine.block_hash import BlockHash
    from pagoda_daemon.kv_offload.connector import OffloadConnector

log = logging.getLogger(__name__)

# step_tokens kept between two stats reads at most (a reader that never reads stats, such as a
# long offline run, must not grow it without bound)
MAX_STEPS_RECORDED = 4096


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    step_tokens: list[int] = field(default_factory=list)  # tokens scheduled, per step


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        grammars: GrammarManager | None = None,
        connector: OffloadConnector | None = None,
        policy: str = "fcfs",
        max_loras: int = 0,
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.by_priority = policy == "priority"
        # LoRA: at most max_loras adapters among the running requests, hence in any step; each
        # step's adapters are given GPU slots (0: adapters are refused)
        self.max_loras = max_loras
        self.lora_slots = SlotTable(max_loras) if max_loras else None
        self.kv_cache = kv_cache
        # KV offload's scheduler half (kv_offload/), or None: further prefix blocks come back
        # from host memory or disk, and full blocks are saved there (as the GPU cache evicts
        # them, or once computed: kv_offload_write_policy).
        self.connector = connector
        self._num_offered: dict[str, int] = {}  # per request: leading full blocks offered to the connector
        # Requests admitted with their KV prefetched from host memory, beside the step that
        # admitted them: they compute from a later step, the runner meets them then
        self._prefetching: set[str] = set()
        if connector is not None and connector.write_back:  # offered as the GPU cache evicts them
            kv_cache.record_evictions()
        self.grammars = grammars  # None: no tokenizer, so structured outputs are refused
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.stats = SchedulerStats()
        # Requests whose sampling needs every earlier output token on the host (penalties):
        # while any is unfinished, the engine does not schedule ahead.
        self.num_needing_host_tokens = 0
        # finished by the scheduler itself (a grammar that failed to compile): the engine reports them
        self.failed: list[Request] = []

    def lora_stats(self) -> LoRAStats | None:
        """The adapters of the running and of the waiting requests (names, each once), with LoRA on."""
        if self.lora_slots is None:
            return None
        def names(requests) -> list[str]:
            return sorted({r.lora.name for r in requests if r.lora is not None})
        return LoRAStats(self.max_loras, names(self.running), names(self.waiting))

    def make_stats(self) -> SchedulerStats:
        """Steps and preemptions since the previous call (get and reset)."""
        stats, self.stats = self.stats, SchedulerStats()
        return stats

    # ---- queue management -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.sampling_params.priority != 0 and not self.by_priority:
            raise ValueError("a request priority other than 0 needs the priority scheduling policy")
        if request.lora is not None and self.lora_slots is None:
            raise ValueError(f"adapter {request.lora.name!r}: this engine serves no LoRA adapters (--enable-lora)")
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if self.grammars is None:
                raise ValueError("structured outputs need the model's tokenizer, which this engine has not loaded")
            request.grammar = self.grammars.grammar_for(constraint,
                                                        request.sampling_params.structured_outputs_after_token_id)
        self.requests[request.request_id] = request
        if self.by_priority:
            bisect.insort(self.waiting, request, key=_urgency)
        else:
            self.waiting.append(request)
        if request.sampling_params.needs_host_tokens:
            self.num_needing_host_tokens += 1

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(req)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.max_num_batched_tokens

        # 1. Running requests first: decodes and the next chunk of partial prefills.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending_tokens and self._length_reached(req, req.num_pending_tokens):
                i += 1  # its pending token ends it: nothing more to compute
                continue
            if req.pooling is not None and req.num_computed_tokens >= req.num_tokens:
                i += 1  # its prompt is computed: its vector is on its way, and it ends with it
                continue
            num_new = min(req.num_tokens + req.num_pending_tokens - req.num_computed_tokens, budget)
            first_step = req.request_id in self._prefetching  # its KV came back beside an earlier step
            if first_step and num_new < req.num_tokens - req.num_computed_tokens and not self.enable_chunked_prefill:
                i += 1  # its prompt waits for a step with room for all of it
                continue
            new_blocks = self.kv_cache.allocate_slots(req, num_new)
            while new_blocks is None:
                victim = self.running.pop()  # latest arrival loses its blocks
                self._preempt(victim, out)
                if victim is req:
                    break
                new_blocks = self.kv_cache.allocate_slots(req, num_new)
            if new_blocks is None:
                break  # req itself was preempted; everything after it already was too
            if first_step:
                self._prefetching.discard(req.request_id)
                block_ids = self.kv_cache.block_ids(req.request_id)
            else:
                block_ids = [b.block_id for b in new_blocks]
            out.scheduled.append(self._advance(req, num_new, block_ids, first_step))
            budget -= num_new
            i += 1

        # 2. Waiting requests, in order, unless this step had to preempt. One whose grammar is
        # still compiling, or whose prompt's KV is still arriving from another instance, keeps
        # its place and lets those behind it go first.
        held_back: deque[Request] = deque()
        adapters = {r.lora.digest for r in self.running if r.lora is not None}
        prefetched_blocks: set[int] = set()  # GPU blocks this step's prefetches fill
        step_loaded_blocks = 0  # host-memory blocks this step loads for itself, beside its forward pass
        while self.waiting and budget > 0 and not out.preempted_request_ids:
            if len(self.running) >= self.max_num_seqs:
                break
            req = self.waiting[0]
            if req.grammar is not None and not req.grammar.ready():
                held_back.append(self.waiting.popleft())
                continue
            if req.grammar is not None and req.grammar.error is not None:
                self._fail(req, f"structured output could not be compiled: {req.grammar.error}")
                continue
            if req.lora is not None and req.lora.digest not in adapters and len(adapters) >= self.max_loras:
                held_back.append(self.waiting.popleft())  # its adapter waits for a running one to finish
                continue
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(req)
            if prefetched_blocks and any(b.block_id in prefetched_blocks for b in computed_blocks):
                held_back.append(self.waiting.popleft())  # its prefix is still coming back: next step
                continue
            # then the offload tiers, for the blocks after the GPU's hits: counted as computed, like
            # prefix-cache hits (the last token never is), and loaded before the step's forward
            # pass, or, from host memory, beside it for the next step to compute the rest
            offload_hashes = self._offload_candidates(req, len(computed_blocks))
            num_loaded_blocks = self.connector.lookup(offload_hashes) if offload_hashes and self.connector else 0
            if (self.connector is not None and num_loaded_blocks < len(offload_hashes)
                    and self.connector.arriving(offload_hashes[num_loaded_blocks:], req.kv_source, req.request_id)):
                held_back.append(self.waiting.popleft())
                continue
            if num_loaded_blocks and self.connector is not None and self.connector.staging(offload_hashes[:num_loaded_blocks], req.request_id):
                held_back.append(self.waiting.popleft())  # its disk blocks come to host memory meanwhile
                continue
            num_loaded = num_loaded_blocks * self.kv_cache.block_size
            num_new = req.num_tokens - num_cached - num_loaded
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            # host-memory hits cross beside a step: this one's, while they fit its share, else the
            # one before the step that computes the request (a prefetch)
            beside = bool(num_loaded_blocks) and self.connector is not None and self.connector.can_prefetch(
                offload_hashes[:num_loaded_blocks])
            prefetch = beside and self.connector is not None and (
                step_loaded_blocks + num_loaded_blocks > self.connector.step_load_blocks)
            if prefetch:
                num_new = 0  # computed from the next step, once its KV is back
            new_blocks = self.kv_cache.allocate_slots(req, num_loaded + num_new, computed_blocks)
            if new_blocks is None:
                break
            self.waiting.popleft()
            if self.connector is not None and offload_hashes:
                self.connector.stats.queries += len(offload_hashes) * self.kv_cache.block_size
                self.connector.stats.hits += num_loaded
                if num_loaded_blocks:
                    start = len(computed_blocks)
                    loaded_ids = [b.block_id for b in new_blocks[start : start + num_loaded_blocks]]
                    loads = self.connector.plan_loads(offload_hashes[:num_loaded_blocks], loaded_ids)
                    if prefetch:
                        out.kv_prefetch += loads
                        prefetched_blocks.update(loaded_ids)
                    else:
                        out.kv_loads += loads
                        if beside:
                            step_loaded_blocks += num_loaded_blocks
            num_cached += num_loaded
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.lora is not None:
                adapters.add(req.lora.digest)
            if self.by_priority:
                bisect.insort(self.running, req, key=_urgency)
            else:
                self.running.append(req)
            if prefetch:
                self._prefetching.add(req.request_id)
                continue
            all_ids = self.kv_cache.block_ids(req.request_id)
            out.scheduled.append(self._advance(req, num_new, all_ids, True))
            budget -= num_new
        self.waiting.extendleft(reversed(held_back))
        evicted = self.kv_cache.take_evicted()  # recorded for a write-back connector only
        if self.connector is not None:
            self._plan_saves(out, evicted)
            out.kv_stages = self.connector.take_stages()  # read after the saves (which free their slots)

        out.samples_under_grammar = any(s.samples and s.request.grammar is not None for s in out.scheduled)
        if self.lora_slots is not None:
            loras = [s.request.lora for s in out.scheduled if s.request.lora is not None]
            if loras:
                out.lora_slots, out.lora_loads = self.lora_slots.assign(loras)

        out.num_scheduled_tokens = self.max_num_batched_tokens - budget
        self.stats.num_steps += 1
        if out.num_scheduled_tokens and len(self.stats.step_tokens) < MAX_STEPS_RECORDED:
            self.stats.step_tokens.append(out.num_scheduled_tokens)
        return out

    def _offload_candidates(self, req: Request, num_gpu_hits: int) -> list:
        """The block hashes to ask the offload tiers for: those after the GPU's hits, short of
        the block holding the last token (its logits are needed). None when every prompt
        position must be computed (prompt logprobs, mean pooling)."""
        if self.connector is None or req.computes_every_position:
            return []
        max_blocks = (req.num_tokens - 1) // self.kv_cache.block_size
        return req.block_hashes[num_gpu_hits:max_blocks]

    def _plan_saves(self, out: SchedulerOutput, evicted: list[tuple[BlockHash, int]]) -> None:
        """Offer the connector every block this step fills (saved after the forward pass,
        unless a tier has it), or, writing back, every cached block this step's allocations
        evicted from the GPU (saved before the step overwrites it). Runs after every lookup of
        the step, so a block saved by this step is never loaded by it."""
        assert self.connector is not None
        if self.connector.write_back:
            out.kv_evicted = self.connector.plan_evicted(evicted)
            out.kv_saves = self.connector.take_saves()
            return
        bs = self.kv_cache.block_size
        for s in out.scheduled:
            req = s.request
            rid = req.request_id
            full = min(req.num_computed_tokens // bs, len(req.block_hashes))
            offered = self._num_offered.get(rid, 0)
            if full <= offered:
                continue
            held = self.kv_cache.req_blocks[rid]
            for i in range(offered, full):
                self.connector.plan_save(req.block_hashes[i], held[i].block_id)
            self._num_offered[rid] = full
        out.kv_saves = self.connector.take_saves()

    def grammar_bitmask(self, sched: SchedulerOutput) -> Future[GrammarBitmask]:
        """Start filling the masks of this step's constrained rows. Called once the previous
        step's tokens are accepted (the engine core calls it while this step's forward pass
        runs); a request that finished meanwhile (its grammar ended, an abort) gets no row: its
        sample is dropped; nor does one whose constraint has not started (still thinking): it
        samples freely. No token may be accepted before the masks are in."""
        rows, matchers = [], []
        row = 0
        for s in sched.scheduled:
            if not s.samples:
                continue
            req = s.request
            if (req.grammar is not None and req.grammar.active and not req.status.finished
                    and not req.grammar.terminated):
                rows.append(row)
                matchers.append(req.grammar.matcher)
            row += 1
        if not matchers or self.grammars is None:
            nothing: Future[GrammarBitmask] = Future()
            nothing.set_result(GrammarBitmask())
            return nothing
        return self.grammars.fill_masks(rows, matchers)

    @staticmethod
    def _advance(req: Request, num_new: int, block_ids: list[int], is_new: bool) -> ScheduledRequest:
        start = req.num_computed_tokens
        req.num_computed_tokens += num_new
        done = req.num_computed_tokens == req.num_tokens + req.num_pending_tokens
        if req.pooling is not None:  # nothing sampled: the prompt's vector comes back instead
            return ScheduledRequest(req, num_new, block_ids, is_new, start, pools=done)
        if done:
            req.num_pending_tokens += 1
        return ScheduledRequest(req, num_new, block_ids, is_new, start, done)

    def _length_reached(self, req: Request, num_pending: int = 0) -> bool:
        """Whether the request's tokens, with `num_pending` still to arrive, reach max_tokens or max_model_len."""
        max_tokens = req.sampling_params.max_tokens
        return (max_tokens is not None and req.num_output_tokens + num_pending >= max_tokens) or (
            req.num_tokens + num_pending >= self.max_model_len
        )

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv_cache.free(req)
        self._num_offered.pop(req.request_id, None)
        self._prefetching.discard(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._requeue([req])
        out.preempted_request_ids.append(req.request_id)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, int], failed_kv_blocks: list[int] | None = None,
    ) -> tuple[list[Request], dict[str, int]]:
        """Append the step's sampled tokens; returns the requests that finished and the tokens
        accepted (a token is dropped when its request finished while the step ran: an abort,
        a stop string, or an EOS sampled by the step before, when scheduling ran ahead; or when
        its request read a block whose KV offload load failed: it is computed again)."""
        recomputed = (self._recompute_failed_loads(scheduler_output, set(failed_kv_blocks))
                      if failed_kv_blocks else set())
        finished = []
        accepted: dict[str, int] = {}
        for sched in scheduler_output.scheduled:
            if sched.pools:
                req = sched.request
                if req.status.finished or req.request_id in recomputed:
                    continue  # aborted meanwhile, or computed again: its vector then comes from that step
                # A request preempted while this step ran keeps its vector, as a sampled token is kept.
                req.stop_reason = None
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                finished.append(req)
                continue
            if not sched.samples:
                continue  # a prefill chunk that did not reach the end of the prompt
            req = sched.request
            req.num_pending_tokens -= 1
            if req.status.finished or req.request_id in recomputed:
                continue
            token = sampled[req.request_id]
            if req.grammar is not None and not req.grammar.accept(token):
                # The mask left nothing to sample (the constraint meets allowed_token_ids, bad_words or
                # min_tokens with no token in common, or no token of the vocabulary spells what it
                # needs next): the sampled token is noise and is dropped.
                self._fail(req, "the output constraint left no token to sample: no token of the vocabulary "
                                "continues it, or none together with this request's allowed_token_ids, bad_words "
                                "or min_tokens", report=False)
                finished.append(req)
                continue
            # A request preempted while this step ran keeps its token: it is a real output.
            req.append_output_token(token)
            accepted[req.request_id] = token
            status = self._check_stop(req, token)
            if status is not None:
                self._finish(req, status)
                finished.append(req)
        return finished, accepted

    def _recompute_failed_loads(self, sched: SchedulerOutput, failed: set[int]) -> set[str]:
        """Undo a step for the requests that read a block whose KV load failed (on any rank).
        That block and those computed on top of it leave the prefix cache; the tier copies the
        loads came from, and what the step saved of those blocks, are forgotten; each such request
        goes back to the front of the queue, to be computed again from the blocks before the
        failure (right, and still cached). The step's other requests keep their tokens: a
        request's attention reads its own blocks only. Such a step is collected before the next
        is scheduled (SchedulerOutput.loads_may_fail), so nothing else has built on it."""
        built_on = sched.blocks_built_on(failed)
        self.kv_cache.forget_blocks(built_on)
        if self.connector is not None:
            failed_loads = [t for t in sched.kv_loads if t.gpu_block in failed]
            self.connector.stats.failed_loads += len(failed_loads)
            self.connector.forget(failed_loads + [t for t in sched.kv_saves
                                                  if t.kind in SAVES_FROM_GPU and t.gpu_block in built_on])
        undone = []
        for s in sched.scheduled:
            req = s.request
            if s.is_new and req.status == RequestStatus.RUNNING and failed.intersection(s.new_block_ids):
                log.warning("request %s read KV blocks whose load failed: computing it again", req.request_id)
                self.running.remove(req)
                self.kv_cache.free(req)
                self._num_offered.pop(req.request_id, None)
                req.status = RequestStatus.WAITING
                req.num_computed_tokens = 0
                undone.append(req)
        self._requeue(undone)
        return {r.request_id for r in undone}

    def _requeue(self, requests: list[Request]) -> None:
        """Requests taken back from running: to the front of the queue (they arrived before
        those waiting), or under the priority policy to their place in it."""
        if self.by_priority:
            for req in requests:
                bisect.insort(self.waiting, req, key=_urgency)
        else:
            self.waiting.extendleft(reversed(requests))

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.grammar is not None and req.grammar.terminated:  # complete: its stop token was accepted
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token == req.eos_token_id:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if self._length_reached(req):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _fail(self, req: Request, reason: str, report: bool = True) -> None:
        """Finish a request the engine cannot serve (finish_reason abort, the reason as stop_reason);
        the engine core reports it (take_failed) unless the step's outputs do (report False)."""
        log.warning("request %s failed: %s", req.request_id, reason)
        req.stop_reason = reason
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        if report:
            self.failed.append(req)

    def take_failed(self) -> list[Request]:
        failed, self.failed = self.failed, []
        return failed

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Finish from outside the core (a stop string seen by the detokenizer)."""
        req = self.requests.get(request_id)
        if req is not None:
            req.stop_reason = stop_reason
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv_cache.free(req)
        self._num_offered.pop(req.request_id, None)
        self._prefetching.discard(req.request_id)
        del self.requests[req.request_id]
        if req.sampling_params.needs_host_tokens:
            self.num_needing_host_tokens -= 1
        self._finished_ids.append(req.request_id)


def _urgency(req: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority value first, then earlier arrival (vLLM's)."""
    return req.sampling_params.priority, req.arrival_time
