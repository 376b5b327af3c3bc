"""One step on one device: flatten the scheduled batch, run the model, sample.

Per-step inputs are written into preallocated host buffers (pinned on GPU) and
copied to preallocated device buffers, so a step allocates nothing on the host side
and every host-to-device transfer is a single async copy per tensor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda_daemon.attention.backend import AttentionMetadata
from pagoda_daemon.engine.scheduler import SchedulerOutput
from pagoda_daemon.worker.sampler import Sampler, SamplingBatch

log = logging.getLogger(__name__)


@dataclass
class RunnerRequestState:
    """What the runner remembers of a request between steps."""

    block_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


@dataclass
class StepResult:
    sampled: dict[str, int]  # request id -> token, only for requests that reached the end of their tokens
    logprobs: dict[str, dict[int, float]]


class StagingBuffers:
    """Host-side inputs of a step with their device twins, sized for the largest step."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device

        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            dev = host if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
            return host, host.numpy(), dev

        self.input_ids = pair(max_tokens, torch.int64)
        self.positions = pair(max_tokens, torch.int64)
        self.slot_mapping = pair(max_tokens, torch.int64)
        self.query_start_loc = pair(max_seqs + 1, torch.int32)
        self.seq_lens = pair(max_seqs, torch.int32)
        self.block_tables = pair((max_seqs, max_blocks), torch.int32)
        self.logits_indices = pair(max_seqs, torch.int64)
        # per-row sampling parameters
        self.temperature = pair(max_seqs, torch.float32)
        self.top_k = pair(max_seqs, torch.int64)
        self.top_p = pair(max_seqs, torch.float32)
        self.min_p = pair(max_seqs, torch.float32)
        self.presence_penalty = pair(max_seqs, torch.float32)
        self.frequency_penalty = pair(max_seqs, torch.float32)
        self.repetition_penalty = pair(max_seqs, torch.float32)
        self._pair = pair
        self._max_seqs = max_seqs
        self.penalty_tokens: dict[str, tuple] = {}  # prompt/output token matrices, made on first use

    def token_matrix(self, name: str, rows: list[list[int]], pad: int, max_len: int) -> torch.Tensor:
        """Rows of token ids padded with `pad`, through a reusable buffer of max_len columns."""
        if name not in self.penalty_tokens:
            self.penalty_tokens[name] = self._pair((self._max_seqs, max_len), torch.int64)
        host, host_np, dev = self.penalty_tokens[name]
        width = max(1, max(len(r) for r in rows))
        host_np[: len(rows), :width] = pad
        for i, r in enumerate(rows):
            host_np[i, : len(r)] = r
        if dev is host:
            return host[: len(rows), :width]
        dev[: len(rows), :width].copy_(host[: len(rows), :width], non_blocking=True)
        return dev[: len(rows), :width]

    def fill(self, buf, values) -> torch.Tensor:
        buf[1][: len(values)] = values
        return self.to_device(buf, len(values))

    def to_device(self, buf, n) -> torch.Tensor:
        host, _, dev = buf
        if dev is host:
            return host[:n]
        dev[:n].copy_(host[:n], non_blocking=True)
        return dev[:n]


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
        self.num_layers = model_config.num_hidden_layers
        self.num_kv_heads = model_config.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.head_dim
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.buffers = StagingBuffers(self.max_num_tokens, self.max_num_seqs, self.max_blocks_per_seq, device)
        self.sampler = Sampler()
        self.requests: dict[str, RunnerRequestState] = {}
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[torch.Tensor | None] = [None] * self.num_layers
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(engine_config.seed)

    # ---- KV cache --------------------------------------------------------------------

    def kv_block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
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
        self.model.compute_logits(hidden[-min(num_seqs, self.max_num_seqs):])

    # ---- one step --------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
        for s in sched.scheduled:
            rid = s.request.request_id
            state = self.requests.get(rid)
            if state is None:
                state = RunnerRequestState()
                seed = s.request.sampling_params.seed
                if seed is not None:
                    state.generator = torch.Generator(device=self.device)
                    state.generator.manual_seed(seed)
                self.requests[rid] = state
            if s.is_new:  # first schedule or resumed after preemption: the block list is whole
                state.block_ids = list(s.new_block_ids)
            else:
                state.block_ids.extend(s.new_block_ids)

    def prepare_inputs(self, sched: SchedulerOutput):
        b = self.buffers
        ids_np, pos_np, slot_np = b.input_ids[1], b.positions[1], b.slot_mapping[1]
        qsl_np, lens_np, bt_np, li_np = b.query_start_loc[1], b.seq_lens[1], b.block_tables[1], b.logits_indices[1]
        num_seqs = len(sched.scheduled)
        starts = np.empty(num_seqs, dtype=np.int64)
        qsl_np[0] = 0
        t = 0
        num_logits = 0
        max_blocks = 1
        sample_rows: list[int] = []
        for i, s in enumerate(sched.scheduled):
            req = s.request
            start, n = req.num_computed_tokens, s.num_new_tokens
            if n == 1:
                ids_np[t] = req.all_token_ids[start]
            else:
                ids_np[t : t + n] = req.all_token_ids[start : start + n]
            block_ids = self.requests[req.request_id].block_ids
            bt_np[i, : len(block_ids)] = block_ids
            max_blocks = max(max_blocks, len(block_ids))
            starts[i] = start
            t += n
            qsl_np[i + 1] = t
            lens_np[i] = start + n
            if start + n == req.num_tokens:  # reached the end: this step samples its next token
                li_np[num_logits] = t - 1
                num_logits += 1
                sample_rows.append(i)
        q_lens = np.diff(qsl_np[: num_seqs + 1])
        seq_index = np.repeat(np.arange(num_seqs), q_lens)
        pos = np.arange(t) - np.repeat(qsl_np[:num_seqs].astype(np.int64) - starts, q_lens)
        pos_np[:t] = pos
        slot_np[:t] = bt_np[seq_index, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size

        seq_lens_cpu = lens_np[:num_seqs].tolist()
        qsl_cpu = qsl_np[: num_seqs + 1].tolist()
        meta = AttentionMetadata(
            slot_mapping=b.to_device(b.slot_mapping, t),
            query_start_loc=b.to_device(b.query_start_loc, num_seqs + 1),
            seq_lens=b.to_device(b.seq_lens, num_seqs),
            block_tables=b.to_device(b.block_tables, num_seqs)[:, :max_blocks],
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
            max_query_len=int(q_lens.max()) if num_seqs else 0,
            max_seq_len=max(seq_lens_cpu) if num_seqs else 0,
            is_prefill_only=bool((starts == 0).all()),
        )
        input_ids = b.to_device(b.input_ids, t)
        positions = b.to_device(b.positions, t)
        logits_indices = b.to_device(b.logits_indices, num_logits)
        return input_ids, positions, meta, logits_indices, sample_rows

    def _sampling_batch(self, sched: SchedulerOutput, rows: list[int]) -> SamplingBatch:
        reqs = [sched.scheduled[i].request for i in rows]
        params = [r.sampling_params for r in reqs]
        b = self.buffers
        batch = SamplingBatch(
            temperature=b.fill(b.temperature, [p.temperature for p in params]),
            all_greedy=all(p.greedy for p in params),
        )
        if not batch.all_greedy:
            if any(p.top_k > 0 for p in params):
                batch.top_k = b.fill(b.top_k, [p.top_k for p in params])
            if any(p.top_p < 1.0 for p in params):
                batch.top_p = b.fill(b.top_p, [p.top_p for p in params])
            if any(p.min_p > 0.0 for p in params):
                batch.min_p = b.fill(b.min_p, [p.min_p for p in params])
            gens = {j: self.requests[r.request_id].generator for j, r in enumerate(reqs)}
            batch.generators = {j: g for j, g in gens.items() if g is not None and params[j].temperature > 0}
        if any(p.uses_penalties for p in params):
            batch.presence_penalty = b.fill(b.presence_penalty, [p.presence_penalty for p in params])
            batch.frequency_penalty = b.fill(b.frequency_penalty, [p.frequency_penalty for p in params])
            batch.repetition_penalty = b.fill(b.repetition_penalty, [p.repetition_penalty for p in params])
            width = self.max_model_len + 1
            batch.prompt_token_ids = b.token_matrix("prompt", [r.prompt_token_ids for r in reqs], self.vocab_size, width)
            batch.output_token_ids = b.token_matrix("output", [r.output_token_ids for r in reqs], self.vocab_size, width)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        batch.max_num_logprobs = max(wanted) if wanted else None
        return batch

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        self._update_states(sched)
        if sched.is_empty:
            return StepResult({}, {})
        input_ids, positions, meta, logits_indices, rows = self.prepare_inputs(sched)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not rows:
            return StepResult({}, {})
        logits = self.model.compute_logits(hidden[logits_indices])
        batch = self._sampling_batch(sched, rows)
        out = self.sampler(logits, batch)
        tokens = out.sampled.tolist()  # the one host sync of the step
        rids = [sched.scheduled[i].request.request_id for i in rows]
        sampled = dict(zip(rids, tokens))
        logprobs: dict[str, dict[int, float]] = {}
        if out.sampled_logprob is not None:
            chosen = out.sampled_logprob.tolist()
            top_ids = out.top_ids.tolist() if out.top_ids is not None else [[] for _ in rows]
            top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else [[] for _ in rows]
            for j, rid in enumerate(rids):
                n = sched.scheduled[rows[j]].request.sampling_params.logprobs
                if n is None:
                    continue
                entry = {tokens[j]: chosen[j]}
                for tid, lp in zip(top_ids[j][:n], top_lps[j][:n]):
                    entry.setdefault(tid, lp)
                logprobs[rid] = entry
        return StepResult(sampled, logprobs)
