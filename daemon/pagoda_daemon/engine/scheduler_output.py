"""What the scheduler decided for one step: the contract between the engine core's
scheduler and the workers that run the step (``Executor.execute_model``).

In process, entries carry the ``Request`` itself (the runner reads its token ids and
sampling parameters); a multi-process executor will send each worker the new requests once
and only the per-step deltas after that, as vLLM's ``NewRequestData``/``CachedRequestData`` do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from pagoda_daemon.lora.slots import SlotLoad

if TYPE_CHECKING:
    from pagoda_daemon.engine.request import Request


class KVTransfer(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One copy of the KV offload plan (kv_offload/): a whole block, every layer, K and V.

    ``kind`` names source and destination: ``load_cpu`` (host slot -> GPU block), ``load_disk``
    (file -> GPU block), ``save_cpu`` (GPU block -> host slot), ``save_disk`` (GPU block -> file),
    ``demote`` (host slot -> file, the host tier evicting to disk), ``drop`` (delete the file) and
    ``stage_disk`` (file -> host slot, read in the background while the steps run on).
    The scheduler decides every copy and every eviction; each rank performs them in list order
    on its own slice of the heads, so the ranks' tiers never disagree."""

    kind: str
    block_hash: bytes
    gpu_block: int = -1
    slot: int = -1


# Loads that can fail on a worker: a block file deleted, cut short or corrupted after the
# scheduler's lookup found it. Host-memory loads are copies between tensors the engine owns.
FALLIBLE_LOADS = frozenset({"load_disk"})
# Copies out of a GPU block: what a step whose loads failed saved of the blocks it computed on
# top of them is forgotten.
SAVES_FROM_GPU = frozenset({"save_cpu", "save_disk"})


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # Block ids added this step; the full list when the runner sees the request afresh.
    new_block_ids: list[int]
    is_new: bool  # first schedule, or resumed after preemption: the runner rebuilds its state
    start: int = 0  # tokens computed before this step: the position of the first new token
    samples: bool = False  # this step reaches the end of the known tokens and samples the next
    pools: bool = False  # a pooling request whose prompt this step finishes: its vector comes back

    @property
    def needs_hidden_states(self) -> bool:
        """The step must hand this request's hidden states to the host side (prompt logprobs,
        pooling): it runs eagerly, not in a decode CUDA graph, which returns logits only."""
        return self.scores_prompt or self.request.pooling is not None

    @property
    def scores_prompt(self) -> bool:
        """This step computes prompt positions of a request that asked for prompt logprobs."""
        req = self.request
        return req.sampling_params.prompt_logprobs is not None and self.start < req.num_prompt_tokens - 1


@dataclass(frozen=True)
class StepAgreement:
    """What the data-parallel engines whose MoE layers run together (data-parallel attention,
    distributed/lockstep.py) agreed on for this step: each runs one forward pass of the same
    number of token rows, its own padded, an idle engine's all padding."""

    tokens: int  # the most tokens any engine's step has; 0: no engine runs a forward pass
    decode_only: bool  # every engine's step decodes one token per request (CUDA graphs may replay)
    anyone_busy: bool  # some engine has requests (else none steps, and idle ones may wait for input)
    all_stopping: bool = False  # every engine was asked to shut down: they leave together
    # EPLB in the background: the MoE layers of the move under way that every engine holds (each
    # switches no later one this step); None without one
    eplb_layers_held: int | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # since the last step: runner drops state
    preempted_request_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    # constrained decoding: a request of this step samples under a grammar. Its mask follows
    # (GrammarBitmask) once the previous step's tokens are known, so a worker runs the forward
    # pass and waits for it before it samples.
    samples_under_grammar: bool = False
    # KV offload (kv_offload/): copies done before the forward pass (blocks leaving the GPU cache,
    # saved before this step's loads and forward pass overwrite them: write-back; then blocks
    # coming back from host memory or disk, whose tokens the step counts as computed), then after
    # it (full blocks saved: write-through)
    kv_evicted: list[KVTransfer] = field(default_factory=list)
    kv_loads: list[KVTransfer] = field(default_factory=list)
    kv_saves: list[KVTransfer] = field(default_factory=list)
    # Host-memory loads for requests that compute from the next step on: they run beside this
    # step's forward pass (on a stream of their own on a GPU), and the next step waits for them,
    # so the batch does not wait for a request whose KV is coming back (after the evictions)
    kv_prefetch: list[KVTransfer] = field(default_factory=list)
    # Disk blocks read into host memory in the background, started after this step's saves: the
    # requests that need them wait, keeping their place, and come back as host-memory hits
    kv_stages: list[KVTransfer] = field(default_factory=list)
    # EPLB in the background (distributed/eplb.py): how many MoE layers every rank holds the new
    # experts of, as rank 0 saw before this step; None: each rank follows the fixed schedule
    eplb_layers_held: int | None = None
    # Data-parallel attention: the step every engine runs (None: this engine steps on its own)
    lockstep: StepAgreement | None = None
    # LoRA (lora/slots.py): the GPU slot of each adapter the step uses (by digest), and the
    # adapters to copy into their slots before the forward pass
    lora_slots: dict[str, int] = field(default_factory=dict)
    lora_loads: list[SlotLoad] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def decode_only(self) -> bool:
        """One new token per request and no hidden states wanted: a step a decode CUDA graph can run."""
        return all(s.num_new_tokens == 1 and not s.needs_hidden_states for s in self.scheduled)

    @property
    def loads_may_fail(self) -> bool:
        """Whether a KV load of this step can fail (the engine core collects such a step before
        it schedules the next, so that nothing is built on a failed load before it is undone)."""
        return any(t.kind in FALLIBLE_LOADS for t in self.kv_loads)

    def blocks_built_on(self, failed: set[int]) -> set[int]:
        """The GPU blocks whose KV is wrong when the loads into ``failed`` did not happen: those
        blocks, and every later block of a request holding one, which this step computed (or
        loaded) on top of them. Only requests new in this step can hold a block loaded by it,
        and their block lists are whole."""
        built_on: set[int] = set()
        for s in self.scheduled:
            ids = s.new_block_ids
            first = next((i for i, b in enumerate(ids) if b in failed), None) if s.is_new else None
            if first is not None:
                built_on.update(ids[first:])
        return built_on


@dataclass
class GrammarBitmask:
    """A step's allowed next tokens under constrained decoding, made while the step's forward
    pass runs (engine/grammar.py): row i of ``bitmask`` (packed int32, bit t set = token t
    allowed, xgrammar's layout) applies to row ``rows[i]`` of the step's sampled logits. Rows
    not listed sample unconstrained."""

    rows: list[int] = field(default_factory=list)
    bitmask: np.ndarray | None = None
