"""A step's SchedulerOutput as remote workers receive it: each request's prompt and sampling
parameters once, then per step only what changed (tokens accepted since the rank last heard
of the request, new blocks), as vLLM's NewRequestData / CachedRequestData do.

``PlanWriter`` (rank 0, beside the scheduler) turns a SchedulerOutput into a ``StepPlan``;
``RequestMirrors`` (every other rank) turns it back into a SchedulerOutput over mirror
``Request`` objects that the ModelRunner reads exactly as rank 0's runner reads the real ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import numpy as np

from pagoda_daemon.engine.request import Request
from pagoda_daemon.engine.scheduler_output import (
    GrammarBitmask,
    KVTransfer,
    ScheduledRequest,
    SchedulerOutput,
)
from pagoda_daemon.lora.request import LoRARequest
from pagoda_daemon.lora.slots import SlotLoad
from pagoda_daemon.pooling import PoolingParams
from pagoda_daemon.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    lora: LoRARequest | None = None
    pooling: PoolingParams | None = None


class ScheduledDelta(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    appended_token_ids: list[int]  # output tokens accepted since this rank last saw the request
    num_new_tokens: int
    new_block_ids: list[int]
    is_new: bool
    start: int
    samples: bool
    pools: bool = False


class StepPlan(msgspec.Struct, tag="step", array_like=True, gc=False):
    new_requests: list[NewRequest]
    scheduled: list[ScheduledDelta]
    finished_request_ids: list[str]
    num_scheduled_tokens: int
    # constrained decoding: the ranks run the forward pass and wait for SampleTokens
    samples_under_grammar: bool = False
    # KV offload copies, before and after the forward pass (the same on every rank)
    kv_loads: list[KVTransfer] = []
    kv_saves: list[KVTransfer] = []
    kv_evicted: list[KVTransfer] = []  # before the loads
    eplb_layers_held: int | None = None  # EPLB in the background: layers every rank has received
    kv_prefetch: list[KVTransfer] = []  # beside the forward pass, for the next step
    kv_stages: list[KVTransfer] = []  # disk -> host memory in the background, after the saves
    lora_slots: dict[str, int] = {}  # LoRA: each adapter of the step's slot, and the loads before it
    lora_loads: list[SlotLoad] = []


class SampleTokens(msgspec.Struct, tag="sample", array_like=True, gc=False):
    """The grammar masks of the step just planned: every rank samples, so every rank applies them."""

    rows: list[int]
    bitmask: bytes = b""  # int32 rows, one per entry of rows, native byte order


class InitCache(msgspec.Struct, tag="init_cache", array_like=True, gc=False):
    num_blocks: int


class Stop(msgspec.Struct, tag="stop", array_like=True, gc=False):
    pass


class Resize(msgspec.Struct, tag="resize", array_like=True, gc=False):
    """Elastic EP: go from old_size to new_size ranks (executor/resize.py); ``epoch`` names
    the transition's rendezvous files."""

    epoch: int
    old_size: int
    new_size: int


class MirroredRequest(msgspec.Struct, array_like=True, gc=False):
    """A request in flight as a joining rank takes it over: what the other ranks were told of
    it, its blocks, and its seeded generator's state."""

    request: NewRequest
    known_output_token_ids: list[int]
    block_ids: list[int]
    generator_state: bytes | None


class RankState(msgspec.Struct, tag="rank_state", array_like=True, gc=False):
    """What a rank joining a running replica takes from rank 0 besides weights and the KV cache."""

    requests: list[MirroredRequest]
    random_states: dict[str, bytes]
    kv_block_ids: list[int]  # the KV blocks with content (held, or a cached prefix): all a joiner copies


ToWorker = StepPlan | SampleTokens | InitCache | Stop | Resize | RankState
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ToWorker)


def encode(message: ToWorker) -> bytes:
    return _encoder.encode(message)


def decode(frame: bytes) -> ToWorker:
    return _decoder.decode(frame)


class PlanWriter:
    """Rank 0's record of what the other ranks know: how many of each request's tokens."""

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}

    def plan(self, sched: SchedulerOutput) -> StepPlan:
        new_requests, scheduled = [], []
        for rid in sched.finished_request_ids:
            self._sent.pop(rid, None)
        for s in sched.scheduled:
            req = s.request
            rid = req.request_id
            if rid not in self._sent:
                new_requests.append(NewRequest(rid, req.prompt_token_ids, dataclasses.asdict(req.sampling_params),
                                               req.lora, req.pooling))
                self._sent[rid] = req.num_prompt_tokens
            appended = req.all_token_ids[self._sent[rid]:]
            self._sent[rid] = req.num_tokens
            scheduled.append(ScheduledDelta(rid, appended, s.num_new_tokens, s.new_block_ids, s.is_new, s.start,
                                            s.samples, s.pools))
        return StepPlan(new_requests, scheduled, list(sched.finished_request_ids), sched.num_scheduled_tokens,
                        sched.samples_under_grammar, list(sched.kv_loads), list(sched.kv_saves),
                        list(sched.kv_evicted), sched.eplb_layers_held, list(sched.kv_prefetch),
                        list(sched.kv_stages), dict(sched.lora_slots), list(sched.lora_loads))

    def rank_state(self, requests: dict[str, Request], runner, kv_block_ids: list[int]) -> RankState:
        """The requests the ranks know of, as a joining rank must know them: each with the
        tokens sent so far, rank 0's block table and generator; and the KV blocks to copy."""
        mirrored = []
        for rid, sent in self._sent.items():
            req = requests.get(rid)
            if req is None or rid not in runner.requests:  # finished: the next plan tells the ranks
                continue
            blocks, generator = runner.request_state(rid)
            mirrored.append(MirroredRequest(
                NewRequest(rid, req.prompt_token_ids, dataclasses.asdict(req.sampling_params), req.lora, req.pooling),
                req.all_token_ids[req.num_prompt_tokens:sent], blocks, generator))
        return RankState(mirrored, runner.random_states(), kv_block_ids)

    @staticmethod
    def sample_tokens(grammar: GrammarBitmask) -> SampleTokens:
        return SampleTokens(list(grammar.rows), b"" if grammar.bitmask is None else grammar.bitmask.tobytes())


class RequestMirrors:
    """A worker rank's copies of the requests in flight, kept in step by the plans."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.requests: dict[str, Request] = {}

    def apply(self, plan: StepPlan) -> SchedulerOutput:
        for rid in plan.finished_request_ids:
            self.requests.pop(rid, None)
        for new in plan.new_requests:
            # no prefix-cache hashing here: only rank 0 schedules
            req = Request(new.request_id, new.prompt_token_ids, SamplingParams(**new.sampling_params), None,
                          self.block_size, lora=new.lora, pooling=new.pooling)
            req.block_hashes.clear()
            self.requests[new.request_id] = req
        scheduled = []
        for d in plan.scheduled:
            req = self.requests[d.request_id]
            req.output_token_ids.extend(d.appended_token_ids)
            req.all_token_ids.extend(d.appended_token_ids)
            scheduled.append(ScheduledRequest(req, d.num_new_tokens, d.new_block_ids, d.is_new, d.start, d.samples,
                                              d.pools))
        return SchedulerOutput(scheduled, list(plan.finished_request_ids), [], plan.num_scheduled_tokens,
                               plan.samples_under_grammar, kv_evicted=list(plan.kv_evicted),
                               kv_loads=list(plan.kv_loads), kv_saves=list(plan.kv_saves),
                               kv_prefetch=list(plan.kv_prefetch), kv_stages=list(plan.kv_stages),
                               eplb_layers_held=plan.eplb_layers_held, lora_slots=dict(plan.lora_slots),
                               lora_loads=list(plan.lora_loads))

    def adopt(self, state: RankState, runner) -> None:
        """A joining rank: take over rank 0's requests and random state."""
        for m in state.requests:
            self.apply(StepPlan([m.request], [], [], 0))
            req = self.requests[m.request.request_id]
            req.output_token_ids.extend(m.known_output_token_ids)
            req.all_token_ids.extend(m.known_output_token_ids)
            runner.adopt_request(m.request.request_id, m.block_ids, m.generator_state)
        runner.set_random_states(state.random_states)

    @staticmethod
    def grammar_bitmask(message: SampleTokens) -> GrammarBitmask:
        if not message.rows:
            return GrammarBitmask()
        return GrammarBitmask(list(message.rows),
                              np.frombuffer(message.bitmask, dtype=np.int32).reshape(len(message.rows), -1))
