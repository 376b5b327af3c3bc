"""One step on one device: flatten the scheduled batch, run the model, sample.

Per-step inputs are written into preallocated host buffers (pinned on GPU) and
copied to preallocated device buffers, so a step allocates nothing on the host side
and every host-to-device transfer is a single async copy per tensor. `execute` returns
as soon as the step is launched; its sampled tokens travel to the host behind an event
(`LaunchedStep.result()` is the step's one host sync), which is what lets the engine
schedule the next step while this one runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda_daemon.attention.backend import AttentionMetadata, KVCacheSpec
from pagoda_daemon.engine.request import Request
from pagoda_daemon.engine.scheduler_output import GrammarBitmask, SchedulerOutput, StepAgreement
from pagoda_daemon.lora.layers import LoRAModelManager
from pagoda_daemon.telemetry.profiling import phase
from pagoda_daemon.worker import step_shapes
from pagoda_daemon.worker.cuda_graphs import CudaGraphRunner
from pagoda_daemon.worker.piecewise_graphs import PiecewiseGraphRunner
from pagoda_daemon.worker.pooler import PooledRows, Pooler
from pagoda_daemon.worker.sampler import Sampler, SamplingBatch
from pagoda_daemon.worker.staging_buffers import StagingBuffers, StepInputs

log = logging.getLogger(__name__)


def torch_seed(seed: int) -> int:
    """A request's seed as torch's generators take it ([-2**63, 2**64)): SamplingParams keeps seeds
    in int64, and anything else wraps here rather than failing the step (a last line of defence)."""
    return seed if -(2**63) <= seed < 2**64 else seed % 2**64


@dataclass
class RunnerRequestState:
    """What the runner remembers of a request between steps."""

    block_table: np.ndarray  # the request's block ids in its first num_blocks entries (int32)
    num_blocks: int = 0
    generator: torch.Generator | None = None
    # the request's logit_bias as (token ids, biases) CPU tensors, built at its first sampled step
    # and reused at every later one (up to 65,536 entries converted once, not at every step)
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_blocks(self, block_ids: list[int]) -> None:
        self.block_table[: len(block_ids)] = block_ids
        self.num_blocks = len(block_ids)

    def add_blocks(self, block_ids: list[int]) -> None:
        if block_ids:
            self.block_table[self.num_blocks : self.num_blocks + len(block_ids)] = block_ids
            self.num_blocks += len(block_ids)


@dataclass
class StepResult:
    sampled: dict[str, int]  # request id -> token, only for requests that reached the end of their tokens
    logprobs: dict[str, dict[int, float]]
    # request id -> (position of the first prompt token scored, one entry per scored token), for
    # requests that asked for prompt logprobs and had prompt tokens in this step
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    # GPU blocks whose KV offload loads failed on some rank (Worker.execute_model): their
    # requests' tokens from this step are wrong, and the scheduler recomputes them
    failed_kv_blocks: list[int] = field(default_factory=list)
    # request id -> its pooled vector (float32 little-endian bytes), for pooling requests whose
    # prompt the step finished
    pooled: dict[str, bytes] = field(default_factory=dict)


@dataclass
class PromptLogprobRows:
    """Where the prompt logprobs of one step come from: the hidden-state rows (flattened batch)
    whose logits score the next prompt token, per request."""

    request_ids: list[str] = field(default_factory=list)
    first_positions: list[int] = field(default_factory=list)  # the first scored token's position
    counts: list[int] = field(default_factory=list)
    num_top: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)  # the prompt token each row scores

    def add(self, request, start: int, num_new: int, first_row: int) -> None:
        """Positions start..start+num_new-1 were computed; each p < prompt_len - 1 scores token p+1."""
        end = min(start + num_new, request.num_prompt_tokens - 1)
        if end <= start:
            return
        self.request_ids.append(request.request_id)
        self.first_positions.append(start + 1)
        self.counts.append(end - start)
        self.num_top.append(request.sampling_params.prompt_logprobs)
        self.rows.extend(range(first_row, first_row + end - start))
        self.targets.extend(request.all_token_ids[start + 1 : end + 1])


# Prompt logprobs take a [rows, vocab] float32 log-softmax: at most this many rows at a time.
PROMPT_LOGPROBS_ROWS_PER_PASS = 1024


class LaunchedStep:
    """A step on its way: the sampled tokens (and logprobs) are being copied to pinned host
    memory behind a CUDA event; result() waits for them."""

    def __init__(self, request_ids: list[str], num_logprobs: list[int | None], host: dict[str, torch.Tensor],
                 event: torch.cuda.Event | None,
                 prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] | None = None,
                 pooled: PooledRows | None = None) -> None:
        self.request_ids = request_ids
        self.num_logprobs = num_logprobs
        self.host = host
        self.event = event
        self.prompt_logprobs = prompt_logprobs or {}
        self.pooled = pooled  # on its way to pinned host memory, behind the same event
        self.failed_kv_blocks: list[int] = []
        # the disk files the step saved, written beside the steps: its outputs wait for them
        self.kv_writes: list[Future[None]] = []

    @classmethod
    def empty(cls) -> LaunchedStep:
        return cls([], [], {}, None)

    def wait(self) -> None:
        """Wait for the step's GPU work (a rank that does not read the tokens waits only)."""
        if self.event is not None:
            with phase("pagoda.wait_for_gpu"):
                self.event.synchronize()  # the one host sync of the step
        if self.kv_writes:
            with phase("pagoda.kv_offload_wait_for_writes"):
                futures.wait(self.kv_writes)

    def result(self) -> StepResult:
        self.wait()  # also a step that sampled nothing: the next step but one reuses its input buffers
        pooled = self.pooled.finish() if self.pooled is not None else {}
        if not self.request_ids:
            return StepResult({}, {}, self.prompt_logprobs, self.failed_kv_blocks, pooled)
        tokens = self.host["sampled"].tolist()
        sampled = dict(zip(self.request_ids, tokens))
        logprobs: dict[str, dict[int, float]] = {}
        if "sampled_logprob" in self.host:
            chosen = self.host["sampled_logprob"].tolist()
            rows = len(self.request_ids)
            top_ids = self.host["top_ids"].tolist() if "top_ids" in self.host else [[]] * rows
            top_lps = self.host["top_logprobs"].tolist() if "top_logprobs" in self.host else [[]] * rows
            for j, rid in enumerate(self.request_ids):
                n = self.num_logprobs[j]
                if n is None:
                    continue
                entry = {tokens[j]: chosen[j]}
                for tid, lp in zip(top_ids[j][:n], top_lps[j][:n]):
                    entry.setdefault(tid, lp)
                logprobs[rid] = entry
        return StepResult(sampled, logprobs, self.prompt_logprobs, self.failed_kv_blocks, pooled)


@dataclass
class PendingSample:
    """A step whose forward pass is launched and whose sampling is still to come."""

    sched: SchedulerOutput
    logits: torch.Tensor
    rows: list[int]  # the scheduled entries that sample, in logits row order
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]]
    pooled: PooledRows | None = None


class ModelRunner:
    def __init__(self, model, model_config, engine_config, device: torch.device, dtype: torch.dtype,
                 max_model_len: int) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = engine_config.block_size
        self.max_num_seqs = engine_config.max_num_seqs
        self.max_num_tokens = engine_config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.vocab_size = model_config.vocab_size
        self.num_layers = model.kv_cache_spec().num_layers
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.buffers = StagingBuffers(self.max_num_tokens, self.max_num_seqs, self.max_blocks_per_seq, device)
        self.sampler = Sampler(seed=engine_config.seed)
        self.requests: dict[str, RunnerRequestState] = {}
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[torch.Tensor | None] = [None] * self.num_layers
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(engine_config.seed)
        self.cuda_graphs: CudaGraphRunner | None = None
        self._last_sampled: torch.Tensor | None = None  # the last launched step's samples, on the device
        self._last_rows: dict[str, int] = {}
        self.max_cudagraph_batch_size = min(engine_config.max_cudagraph_batch_size, self.max_num_seqs,
                                            self.max_num_tokens)
        self._prompt_rows = PromptLogprobRows()  # the eager step being prepared
        # a pooling engine's requests' partial vectors between steps (worker/pooler.py); None: it generates
        self.pooler = Pooler() if engine_config.runner == "pooling" else None
        # a sequence classifier's head, run on each pooled row (models/bert.py); None: vectors are the reply
        self.classify: Callable[[torch.Tensor], torch.Tensor] | None = (
            getattr(model, "classify", None) if self.pooler is not None else None)
        self.takes_token_types = getattr(model, "takes_token_types", False)
        self._pending: PendingSample | None = None  # a step waiting for its grammar masks
        # Eager steps padded to a grid of token counts warmed up at start-up (step_shapes.py):
        # on by default on CUDA, where cuBLAS stalls the host on every new shape.
        pad = engine_config.pad_eager_steps
        self.pads_eager_steps = device.type == "cuda" if pad is None else pad
        self.token_sizes = step_shapes.token_sizes(self.max_num_tokens) if self.pads_eager_steps else []
        self.lm_head_sizes = step_shapes.lm_head_sizes(self.max_num_seqs) if self.pads_eager_steps else []
        self.piecewise: PiecewiseGraphRunner | None = None
        self.max_piecewise_tokens = engine_config.max_piecewise_graph_tokens
        self.lora: LoRAModelManager | None = None  # adapter slots in the projections (--enable-lora)
        if engine_config.enable_lora:
            self.lora = LoRAModelManager(model, model_config, engine_config.max_loras, engine_config.max_lora_rank,
                                         self.max_num_tokens, device)

    # ---- KV cache --------------------------------------------------------------------

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int) -> None:
        self.kv_cache = torch.zeros(spec.shape(num_blocks, self.block_size), dtype=self.dtype, device=self.device)
        self.kv_caches = list(self.kv_cache.unbind(0))

    @torch.inference_mode()
    def profile_peak_memory(self) -> None:
        """Run the largest step the scheduler can produce, without a cache, to find peak activations."""
        num_tokens = self.max_num_tokens
        num_seqs = max(1, min(self.max_num_seqs, -(-num_tokens // self.max_model_len)))
        lens = [num_tokens // num_seqs] * num_seqs
        lens[-1] += num_tokens - sum(lens)
        starts = np.concatenate([[0], np.cumsum(lens)]).tolist()
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=ids, query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros((num_seqs, 1), dtype=torch.int32, device=self.device),
            query_start_loc_cpu=starts, seq_lens_cpu=lens, max_query_len=max(lens), max_seq_len=max(lens),
            is_prefill_only=True, has_kv_cache=False,
        )
        hidden = self.model(ids, positions, [None] * self.num_layers, meta)
        if self.pooler is not None:
            return  # a pooling engine computes no logits (an encoder has no head to compute them with)
        # the logits of the largest decode batch, and the sampler's float copy of them: at 1,024
        # sequences of a 151,936-token vocabulary, 0.6 GiB each
        rows = min(num_tokens, self.max_num_seqs)
        torch.softmax(self.model.compute_logits(hidden[:rows]).float(), dim=-1)

    def prepare_eager_steps(self) -> None:
        """With padding on: every GEMM at every padded size an eager step may run at; and on a
        CPU, steps that carry prompts run piece by piece as a GPU's piecewise graphs would
        (without graphs: the CPU's tests prove the pieces, tensor and expert parallel included)."""
        if not self.pads_eager_steps:
            return
        step_shapes.warm_gemms(self.model, self.token_sizes, self.lm_head_sizes)
        if self.device.type == "cpu":
            self.piecewise = self.piecewise_runner()
            if self.piecewise is not None:
                self.piecewise.run_eagerly()

    def capture_cuda_graphs(self, graph_capture: Callable[[], AbstractContextManager[None]] = nullcontext) -> None:
        """Capture decode graphs and the piecewise graphs of steps with prompts over the allocated KV
        cache (call once, after allocate_kv_cache); `graph_capture` is entered around each graph's
        capture (the tensor-parallel group's). A pooling engine captures no decode graph: its steps
        compute prompts only and hand their hidden states over, which a decode graph does not."""
        assert self.kv_cache is not None, "allocate the KV cache before capturing graphs"
        if self.pooler is None:
            graphs = CudaGraphRunner(self.model, self.buffers, self.max_cudagraph_batch_size, self.max_model_len,
                                     self.device, graph_capture)
            graphs.capture(self.kv_caches)
            self.cuda_graphs = graphs
        self.piecewise = self.piecewise_runner(graph_capture)
        if self.piecewise is not None:
            self.piecewise.capture(self.kv_caches)

    def piecewise_runner(self, graph_capture: Callable[[], AbstractContextManager[None]] = nullcontext
                         ) -> PiecewiseGraphRunner | None:
        """The runner for steps that carry prompts, over the token grid up to
        max_piecewise_graph_tokens; None where it does not apply (padding off, no pieces asked)."""
        sizes = [s for s in self.token_sizes if s <= self.max_piecewise_tokens]
        if not sizes or not hasattr(self.model, "model"):
            return None
        return PiecewiseGraphRunner(self.model, self.buffers, sizes, self.device, graph_capture)

    def release_cuda_graphs(self) -> None:
        """Drop the captured graphs; later decode steps run eagerly."""
        if self.cuda_graphs is not None:
            self.cuda_graphs.release()
            self.cuda_graphs = None
        if self.piecewise is not None:
            self.piecewise.release()
            self.piecewise = None

    def graph_size(self, sched: SchedulerOutput) -> int | None:
        """The captured batch size this step replays, or None when it runs eagerly."""
        if sched.lockstep is not None:
            return self.lockstep_shape(sched.lockstep)[0]
        if self.cuda_graphs is None or not sched.decode_only:
            return None
        return self.cuda_graphs.padded_size(len(sched.scheduled))

    def lockstep_shape(self, agreed: StepAgreement) -> tuple[int | None, int]:
        """(the graph size every data-parallel engine replays or None, the token rows each runs):
        the same on every engine, which shares this configuration."""
        if agreed.decode_only and self.cuda_graphs is not None:
            size = self.cuda_graphs.padded_size(agreed.tokens)
            if size is not None:
                return size, size
        return None, step_shapes.padded(self.token_sizes, agreed.tokens) if self.token_sizes else agreed.tokens

    # ---- one step --------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
            if self.pooler is not None:
                self.pooler.forget(rid)
        for s in sched.scheduled:
            rid = s.request.request_id
            state = self.requests.get(rid)
            if state is None:
                state = RunnerRequestState(np.zeros(self.max_blocks_per_seq, dtype=np.int32))
                seed = s.request.sampling_params.seed
                if seed is not None:
                    state.generator = torch.Generator(device=self.device)
                    state.generator.manual_seed(torch_seed(seed))
                self.requests[rid] = state
            if s.is_new:  # first schedule or resumed after preemption: the block list is whole
                state.set_blocks(s.new_block_ids)
            else:
                state.add_blocks(s.new_block_ids)

    def prepare_inputs(self, sched: SchedulerOutput, pad_to: int | None = None) -> StepInputs:
        """Fill the staging buffers for this step. With pad_to (a CUDA-graph size), rows past
        the batch up to pad_to become padding the graph can run over harmlessly. An eager step
        agreed with other data-parallel engines runs the rows they agreed on."""
        b = self.buffers
        b.flip()
        ids_np, pos_np, slot_np = b.input_ids.np, b.positions.np, b.slot_mapping.np
        qsl_np, lens_np, bt_np, li_np = b.query_start_loc.np, b.seq_lens.np, b.block_tables.np, b.logits_indices.np
        num_seqs = len(sched.scheduled)
        starts = np.empty(num_seqs, dtype=np.int64)
        qsl_np[0] = 0
        t = 0
        num_logits = 0
        sample_rows: list[int] = []
        pending_dst: list[int] = []
        pending_src: list[int] = []
        prompt_rows = PromptLogprobRows()
        for i, s in enumerate(sched.scheduled):
            req = s.request
            start, n = s.start, s.num_new_tokens
            if s.scores_prompt:
                prompt_rows.add(req, start, n, t)
            if start >= req.num_tokens:  # the previous step's sample, not on the host yet
                ids_np[t] = 0
                pending_dst.append(t)
                pending_src.append(self._last_rows[req.request_id])
            elif n == 1:
                ids_np[t] = req.all_token_ids[start]
            else:
                ids_np[t : t + n] = req.all_token_ids[start : start + n]
            state = self.requests[req.request_id]  # an array row copy: a third of a list's cost
            bt_np[i, : state.num_blocks] = state.block_table[: state.num_blocks]
            starts[i] = start
            t += n
            qsl_np[i + 1] = t
            lens_np[i] = start + n
            if s.samples:
                li_np[num_logits] = t - 1
                num_logits += 1
                sample_rows.append(i)
        q_lens = np.diff(qsl_np[: num_seqs + 1])
        seq_index = np.repeat(np.arange(num_seqs), q_lens)
        pos = np.arange(t) - np.repeat(qsl_np[:num_seqs].astype(np.int64) - starts, q_lens)
        pos_np[:t] = pos
        slot_np[:t] = bt_np[seq_index, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size
        n_rows = num_seqs
        if pad_to is not None:  # decode-only: one token per row, so rows and tokens line up
            ids_np[t:pad_to] = 0
            pos_np[t:pad_to] = 0
            slot_np[t:pad_to] = -1
            lens_np[num_seqs:pad_to] = 1
            t = n_rows = pad_to
        # An eager step with padding on runs padded_t token rows (token 0 at position 0 past
        # the step's own); the cache slots and the attention metadata cover the real ones only.
        if pad_to is None and sched.lockstep is not None:  # the rows every data-parallel engine runs
            padded_t = self.lockstep_shape(sched.lockstep)[1]
        else:
            padded_t = step_shapes.padded(self.token_sizes, t) if pad_to is None and self.token_sizes else t
        ids_np[t:padded_t] = 0
        pos_np[t:padded_t] = 0
        slot_np[t:padded_t] = -1  # where the piecewise graphs write the pad rows' K/V: nowhere
        if self.lora is not None:
            self._set_lora_rows(sched, np.diff(qsl_np[: num_seqs + 1]), padded_t)
        token_types = self._token_types(sched, qsl_np, pos_np, padded_t) if self.takes_token_types else None
        input_ids = b.input_ids.to_device(padded_t)
        if pending_dst:
            dst = b.pending_dst.fill(pending_dst)
            input_ids.index_copy_(0, dst, self._last_sampled.index_select(0, b.pending_src.fill(pending_src)))
        positions = b.positions.to_device(padded_t)
        slot_mapping = b.slot_mapping.to_device(padded_t)[:t]
        seq_lens = b.seq_lens.to_device(n_rows)
        block_tables = b.block_tables.to_device(n_rows)
        if pad_to is not None:  # the graph reads its inputs from the buffers in place
            return StepInputs(b.logits_indices.to_device(num_logits), sample_rows)
        # the LM head's rows padded too (with row 0): the logits past num_logits are dropped
        lm_rows = step_shapes.padded(self.lm_head_sizes, num_logits) if self.lm_head_sizes and num_logits else num_logits
        li_np[num_logits:lm_rows] = 0
        lm_head_indices = b.logits_indices.to_device(lm_rows)
        logits_indices = lm_head_indices[:num_logits]
        self._prompt_rows = prompt_rows

        seq_lens_cpu = lens_np[:num_seqs].tolist()
        qsl_cpu = qsl_np[: num_seqs + 1].tolist()
        max_blocks = -(-max(seq_lens_cpu) // self.block_size) if num_seqs else 1
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=b.query_start_loc.to_device(num_seqs + 1),
            seq_lens=seq_lens,
            block_tables=block_tables[:, :max_blocks],
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=int(q_lens.max()) if num_seqs else 0,
            max_seq_len=max(seq_lens_cpu) if num_seqs else 0,
            is_prefill_only=bool((starts == 0).all()),
        )
        return StepInputs(logits_indices, sample_rows, input_ids, positions, meta, lm_head_indices, token_types)

    def _token_types(self, sched: SchedulerOutput, qsl_np: np.ndarray, pos_np: np.ndarray, rows: int) -> torch.Tensor:
        """Each token row's type: 1 from a text pair's second text on, else 0 (padding too)."""
        buf = self.buffers.token_types
        buf.np[:rows] = 0
        for i, s in enumerate(sched.scheduled):
            start = s.request.pooling.token_type_start if s.request.pooling is not None else None
            if start is not None:
                lo, hi = qsl_np[i], qsl_np[i + 1]
                buf.np[lo:hi] = pos_np[lo:hi] >= start
        return buf.to_device(rows)

    def _set_lora_rows(self, sched: SchedulerOutput, q_lens: np.ndarray, rows: int) -> None:
        """Each token row's adapter slot (-1: the base model, and every padding row)."""
        assert self.lora is not None
        buf = self.buffers.lora_slots
        seq_slots = [sched.lora_slots[s.request.lora.digest] if s.request.lora is not None else -1
                     for s in sched.scheduled]
        t = int(q_lens.sum())
        buf.np[:t] = np.repeat(np.asarray(seq_slots, dtype=np.int64), q_lens)
        buf.np[t:rows] = -1
        self.lora.set_token_slots(buf.to_device(rows))

    def _sampling_batch(self, sched: SchedulerOutput, rows: list[int]) -> SamplingBatch:
        reqs = [sched.scheduled[i].request for i in rows]
        params = [r.sampling_params for r in reqs]
        b = self.buffers
        batch = SamplingBatch(
            temperature=b.temperature.fill([p.temperature for p in params]),
            all_greedy=all(p.greedy for p in params),
        )
        if not batch.all_greedy:
            if any(p.top_k > 0 for p in params):  # clamped: k past the vocabulary is all of it (as in vLLM)
                batch.top_k = b.top_k.fill([min(p.top_k, self.vocab_size) for p in params])
            if any(p.top_p < 1.0 for p in params):
                batch.top_p = b.top_p.fill([p.top_p for p in params])
            if any(p.min_p > 0.0 for p in params):
                batch.min_p = b.min_p.fill([p.min_p for p in params])
            gens = {j: self.requests[r.request_id].generator for j, r in enumerate(reqs)}
            batch.generators = {j: g for j, g in gens.items() if g is not None and params[j].temperature > 0}
        if any(p.uses_penalties for p in params):
            batch.presence_penalty = b.presence_penalty.fill([p.presence_penalty for p in params])
            batch.frequency_penalty = b.frequency_penalty.fill([p.frequency_penalty for p in params])
            batch.repetition_penalty = b.repetition_penalty.fill([p.repetition_penalty for p in params])
            width = self.max_model_len + 1
            batch.prompt_token_ids = b.token_matrix("prompt", [r.prompt_token_ids for r in reqs], self.vocab_size, width)
            batch.output_token_ids = b.token_matrix("output", [r.output_token_ids for r in reqs], self.vocab_size, width)
        if any(p.allowed_token_ids is not None for p in params):
            allowed = torch.ones(len(params), self.vocab_size, dtype=torch.bool)
            for j, p in enumerate(params):
                if p.allowed_token_ids is not None:
                    allowed[j] = False
                    allowed[j, p.allowed_token_ids] = True
            batch.allowed = allowed.to(self.device, non_blocking=True)
        banned = [(j, word[-1]) for j, r in enumerate(reqs) if r.sampling_params.bad_words_token_ids
                  for word in r.sampling_params.bad_words_token_ids
                  if len(word) == 1 or r.output_token_ids[len(r.output_token_ids) - len(word) + 1:] == word[:-1]]
        if banned:
            banned_rows, banned_tokens = zip(*banned)
            batch.banned = (torch.tensor(banned_rows, device=self.device),
                            torch.tensor(banned_tokens, device=self.device))
        batch.logit_bias = self._logit_bias(reqs)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        batch.max_num_logprobs = min(max(wanted), self.vocab_size) if wanted else None
        return batch

    def _logit_bias(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(rows, token ids, biases) of the rows whose request has a logit_bias, on the device."""
        parts = []
        for row, req in enumerate(reqs):
            bias = req.sampling_params.logit_bias
            if not bias:
                continue
            state = self.requests[req.request_id]
            if state.logit_bias is None:
                state.logit_bias = (torch.tensor(list(bias), dtype=torch.int64),
                                    torch.tensor(list(bias.values()), dtype=torch.float32))
            parts.append((row, *state.logit_bias))
        if not parts:
            return None
        rows = torch.cat([torch.full((len(tokens),), row, dtype=torch.int64) for row, tokens, _ in parts])
        tokens = torch.cat([tokens for _, tokens, _ in parts])
        biases = torch.cat([biases for _, _, biases in parts])
        return (rows.to(self.device, non_blocking=True), tokens.to(self.device, non_blocking=True),
                biases.to(self.device, non_blocking=True))

    def _token_bitmask(self, grammar: GrammarBitmask, num_rows: int) -> torch.Tensor:
        """The grammar rows at their sampled rows, on the device. Rows without a grammar are left
        as they were in the buffer: the sampler masks only ``grammar.rows``."""
        assert grammar.bitmask is not None
        pin = self.device.type == "cuda"
        host = torch.empty((num_rows, grammar.bitmask.shape[1]), dtype=torch.int32, pin_memory=pin)
        host.numpy()[grammar.rows] = grammar.bitmask
        return host.to(self.device, non_blocking=True) if pin else host

    def _runs_eagerly(self, graph_size: int | None, rows: int) -> bool:
        """Whether a step of ``rows`` padded rows runs its MoE layers outside any CUDA graph."""
        return graph_size is None and not (self.piecewise is not None and self.piecewise.replays(rows))

    @contextmanager
    def _moe_dispatch(self, real_rows: int, eager: bool) -> Iterator[None]:
        """Around a forward pass: with the experts spread over data-parallel engines by
        all-to-all (token_dispatch.py), a pass that every engine runs eagerly sends only its first
        ``real_rows`` rows; a pass that some engine replays in a CUDA graph gathers, as the graph
        does (the engines' collectives must match one for one)."""
        step_rows = getattr(self.model, "step_rows", None)
        if step_rows is None or not eager:
            yield
            return
        step_rows.rows = real_rows
        try:
            yield
        finally:
            step_rows.rows = None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput,
                wait_for_kv_layer: Callable[[int], None] | None = None) -> LaunchedStep | None:
        """Launch the step and start its sampled tokens on their way to the host; with
        constrained rows, launch the forward pass only and return None (then sample()).
        ``wait_for_kv_layer``: called before each layer's attention (KV offload loads still
        crossing; before the whole pass when it replays one graph)."""
        self._update_states(sched)
        if sched.is_empty:
            if sched.lockstep is not None and sched.lockstep.tokens:  # the other engines' tokens, our experts
                graph_size, padded_rows = self.lockstep_shape(sched.lockstep)
                with phase("pagoda.forward"), self._moe_dispatch(0, self._runs_eagerly(graph_size, padded_rows)):
                    self.model.run_experts_only(padded_rows)
            # nothing to wait for: no staging buffer is read, and waiting for the device here would
            # hold the next agreement, hence the other engines' next steps, until this one has run
            return LaunchedStep.empty()
        if sched.lora_loads:
            assert self.lora is not None, "adapter loads for an engine without --enable-lora"
            with phase("pagoda.lora_load"):
                for load in sched.lora_loads:
                    started = time.perf_counter()
                    self.lora.load(load.slot, load.lora)
                    log.info("LoRA adapter %r into slot %d in %.1f ms", load.lora.name, load.slot,
                             (time.perf_counter() - started) * 1e3)
        with phase("pagoda.prepare_inputs"):
            graph_size = self.graph_size(sched)
            inputs = self.prepare_inputs(sched, graph_size)
            rows = inputs.sample_rows
            if inputs.meta is not None:  # (None: a step that replays one graph, waited for below)
                inputs.meta.wait_for_kv_layer = wait_for_kv_layer
        with phase("pagoda.forward"):
            if graph_size is not None and wait_for_kv_layer is not None:
                for index in range(self.num_layers):
                    wait_for_kv_layer(index)
            if graph_size is not None:  # the graph computes every row's logits
                all_logits = self.cuda_graphs.replay(graph_size)
                every_row = len(rows) == len(sched.scheduled)  # then logits_indices is 0, 1, 2, ...
                logits = all_logits[: len(rows)] if every_row else all_logits[inputs.logits_indices]
            else:
                size = inputs.input_ids.shape[0]
                with self._moe_dispatch(sched.num_scheduled_tokens, self._runs_eagerly(None, size)):
                    if self.piecewise is not None and self.piecewise.covers(size):  # graphs of all but attention
                        hidden = self.piecewise.run(size, inputs.meta, self.kv_caches)
                    else:
                        types = {"token_types": inputs.token_types} if inputs.token_types is not None else {}
                        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, **types)
                logits = self.model.compute_logits(hidden[inputs.lm_head_indices])[: len(rows)] if rows else None
        prompt_logprobs = self._prompt_logprobs(hidden, self._prompt_rows) if graph_size is None else {}
        pooled = self._pool(sched, hidden, inputs) if graph_size is None else None
        if not rows:  # nothing sampled, but its inputs' buffers are free only once it has run
            return LaunchedStep([], [], {}, self._step_done(), prompt_logprobs, pooled)
        pending = PendingSample(sched, logits, rows, prompt_logprobs, pooled)
        if sched.samples_under_grammar:
            self._pending = pending  # sample() finishes the step once the masks are made
            return None
        return self._sample(pending, None)

    def sample(self, grammar: GrammarBitmask) -> LaunchedStep:
        """Sample the step execute() left waiting for its grammar masks."""
        pending, self._pending = self._pending, None
        assert pending is not None, "sample() without a step waiting for its masks"
        return self._sample(pending, grammar if grammar.rows else None)

    @torch.inference_mode()
    def _sample(self, pending: PendingSample, grammar: GrammarBitmask | None) -> LaunchedStep:
        sched, logits, rows = pending.sched, pending.logits, pending.rows
        with phase("pagoda.sample"):
            batch = self._sampling_batch(sched, rows)
            if grammar is not None:
                batch.token_bitmask = self._token_bitmask(grammar, len(rows))
                batch.token_bitmask_rows = grammar.rows
            out = self.sampler(logits, batch)
            reqs = [sched.scheduled[i].request for i in rows]
            rids = [r.request_id for r in reqs]
            # The next step may need these tokens as inputs before the host has seen them.
            self._last_sampled = out.sampled
            self._last_rows = {rid: j for j, rid in enumerate(rids)}
            host = {"sampled": self._to_host(out.sampled)}
            for name in ("sampled_logprob", "top_ids", "top_logprobs"):
                value = getattr(out, name)
                if value is not None:
                    host[name] = self._to_host(value)
            event = self._step_done()
        return LaunchedStep(rids, [r.sampling_params.logprobs for r in reqs], host, event, pending.prompt_logprobs,
                            pending.pooled)

    def _pool(self, sched: SchedulerOutput, hidden: torch.Tensor, inputs: StepInputs) -> PooledRows | None:
        """The vectors of the pooling requests this step finished, started on their way to the host."""
        if self.pooler is None or inputs.meta is None:
            return None
        pooled = self.pooler.pool(sched, hidden, inputs.meta.query_start_loc_cpu)
        if pooled is not None and pooled.vectors is not None:
            vectors = self.classify(pooled.vectors) if self.classify is not None else pooled.vectors
            pooled.vectors = self._to_host(vectors)
        return pooled

    def _step_done(self) -> torch.cuda.Event | None:
        """An event behind the step's work on the device, for whoever waits for it."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         where: PromptLogprobRows) -> dict[str, tuple[int, list[dict[int, float]]]]:
        """Log-probabilities of each scored prompt token (and the top N at its position) from the
        raw logits, as the sampled tokens' logprobs are. Synchronous: a request asking for these
        is scoring a prompt, not racing for latency."""
        if not where.rows:
            return {}
        top_n = min(max(where.num_top), self.vocab_size)
        chosen_parts, top_lp_parts, top_id_parts = [], [], []
        for lo in range(0, len(where.rows), PROMPT_LOGPROBS_ROWS_PER_PASS):
            rows = torch.tensor(where.rows[lo : lo + PROMPT_LOGPROBS_ROWS_PER_PASS], device=self.device)
            targets = torch.tensor(where.targets[lo : lo + PROMPT_LOGPROBS_ROWS_PER_PASS], device=self.device)
            logprobs = self.model.compute_logits(hidden[rows]).to(torch.float32).log_softmax(dim=-1)
            chosen_parts.append(logprobs.gather(1, targets.unsqueeze(1)).squeeze(1))
            if top_n > 0:
                top_lp, top_id = logprobs.topk(top_n, dim=-1)
                top_lp_parts.append(top_lp)
                top_id_parts.append(top_id)
        chosen = torch.cat(chosen_parts).tolist()
        top_lps = torch.cat(top_lp_parts).tolist() if top_n > 0 else [[]] * len(chosen)
        top_ids = torch.cat(top_id_parts).tolist() if top_n > 0 else [[]] * len(chosen)
        out: dict[str, tuple[int, list[dict[int, float]]]] = {}
        k = 0
        for rid, first, count, n in zip(where.request_ids, where.first_positions, where.counts, where.num_top):
            entries = []
            for j in range(k, k + count):
                entry = {where.targets[j]: chosen[j]}
                for tid, lp in zip(top_ids[j][:n], top_lps[j][:n]):
                    entry.setdefault(tid, lp)
                entries.append(entry)
            out[rid] = (first, entries)
            k += count
        return out


    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)  # cached by torch's host allocator
        return host.copy_(tensor, non_blocking=True)

    # ---- elastic EP: the state a joining rank takes over from rank 0 ----------------------

    def random_states(self) -> dict[str, bytes]:
        """Every random state a step draws from. Ranks sample the same tokens only while these
        agree: a rank that joins a running replica takes rank 0's."""
        states = {"host": torch.get_rng_state().numpy().tobytes(),
                  "runner": self.generator.get_state().numpy().tobytes(),
                  "sampler": self.sampler.seed_state()}
        if self.device.type == "cuda":
            states["device"] = torch.cuda.get_rng_state(self.device).numpy().tobytes()
        return states

    def set_random_states(self, states: dict[str, bytes]) -> None:
        torch.set_rng_state(_state_tensor(states["host"]))
        self.generator.set_state(_state_tensor(states["runner"]))
        self.sampler.set_seed_state(states["sampler"])
        if "device" in states:
            torch.cuda.set_rng_state(_state_tensor(states["device"]), self.device)

    def request_state(self, request_id: str) -> tuple[list[int], bytes | None]:
        """(block ids, seeded generator's state) of a request in flight."""
        state = self.requests[request_id]
        generator = None if state.generator is None else state.generator.get_state().numpy().tobytes()
        return state.block_table[: state.num_blocks].tolist(), generator

    def adopt_request(self, request_id: str, block_ids: list[int], generator: bytes | None) -> None:
        state = RunnerRequestState(np.zeros(self.max_blocks_per_seq, dtype=np.int32))
        state.set_blocks(block_ids)
        if generator is not None:
            state.generator = torch.Generator(device=self.device)
            state.generator.set_state(_state_tensor(generator))
        self.requests[request_id] = state


def _state_tensor(data: bytes) -> torch.Tensor:
    """A generator state sent as bytes, as torch's set_state takes it."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
