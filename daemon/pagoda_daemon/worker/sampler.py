"""Turn logits into tokens: penalties, temperature, top-k/top-p/min-p, seeded sampling, logprobs.

Seeded rows draw from their own generator one row at a time, so a request with a
seed samples the same tokens whatever else shares its batch.

A batch that needs nothing but temperature (greedy rows included) samples on CUDA through
one fused Triton kernel (`pagoda_kernels.sampling`: Gumbel-max over the logits in one read,
instead of the half dozen passes and launches below); everything else takes the torch path.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import torch

from pagoda_daemon.attention.backend import triton_kernels_available

_NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """Per-row parameters of one step's sampling, built by the model runner."""

    temperature: torch.Tensor  # [B] float32; 0 means greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [B] int64, 0 = off
    top_p: torch.Tensor | None = None  # [B] float32, 1.0 = off
    min_p: torch.Tensor | None = None  # [B] float32, 0.0 = off
    generators: dict[int, torch.Generator] | None = None  # row -> generator, for seeded rows
    # penalties (None when no row uses them)
    presence_penalty: torch.Tensor | None = None  # [B]
    frequency_penalty: torch.Tensor | None = None  # [B]
    repetition_penalty: torch.Tensor | None = None  # [B]
    prompt_token_ids: torch.Tensor | None = None  # [B, P] padded with vocab_size
    output_token_ids: torch.Tensor | None = None  # [B, O] padded with vocab_size
    max_num_logprobs: int | None = None
    # logit masks (None when no row uses them): allowed_token_ids as a [B, V] bool mask of the
    # tokens a row may sample, and the (row, token) pairs bad_words bans this step
    allowed: torch.Tensor | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids)
    # logit_bias: (rows, token ids, biases) added to the logits before penalties (None when no row has one)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # constrained decoding: [B, ceil(V/32)] int32, bit t of row i set = token t allowed (xgrammar's
    # layout), read only at the rows listed in token_bitmask_rows (the others sample unconstrained)
    token_bitmask: torch.Tensor | None = None
    token_bitmask_rows: list[int] | None = None


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64
    sampled_logprob: torch.Tensor | None = None  # [B]
    top_logprobs: torch.Tensor | None = None  # [B, N]
    top_ids: torch.Tensor | None = None  # [B, N]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens; presence/frequency over output tokens."""
    bsz, vocab = logits.shape
    out_counts = torch.zeros(bsz, vocab + 1, dtype=logits.dtype, device=logits.device)
    out_counts.scatter_add_(1, batch.output_token_ids, torch.ones_like(batch.output_token_ids, dtype=logits.dtype))
    out_counts = out_counts[:, :vocab]
    prompt_mask = torch.zeros(bsz, vocab + 1, dtype=torch.bool, device=logits.device)
    prompt_mask.scatter_(1, batch.prompt_token_ids, True)
    seen = prompt_mask[:, :vocab] | (out_counts > 0)
    rep = batch.repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - batch.frequency_penalty.unsqueeze(1) * out_counts
    logits = logits - batch.presence_penalty.unsqueeze(1) * (out_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the k highest logits and the smallest top set whose probability reaches p."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator] | None) -> torch.Tensor:
    """Exponential race (argmax p/q, q ~ Exp(1)): one draw per row, seeded rows by their own generator."""
    q = torch.empty_like(probs).exponential_()
    for row, gen in (generators or {}).items():
        q[row].exponential_(generator=gen)
    return probs.div(q).argmax(dim=-1)


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Each row's logit_bias added to its logits, out of place (the raw logits stay for logprobs)."""
    if batch.logit_bias is None:
        return logits
    rows, tokens, biases = batch.logit_bias
    return logits.index_put((rows, tokens), biases, accumulate=True)


def apply_masks(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """allowed_token_ids and bad_words: what a row may not sample gets -inf."""
    if batch.allowed is not None:
        logits = logits.masked_fill(~batch.allowed, _NEG_INF)
    if batch.banned is not None:
        rows, tokens = batch.banned
        logits = logits.index_put((rows, tokens), torch.tensor(_NEG_INF, device=logits.device))
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set every token a row's grammar forbids to -inf, in place, in the listed rows only (all
    rows when None). The logits are the step's own (the runner's copy or a graph's output
    buffer, rewritten by the next replay), so no copy is made; the sampled token's logprob is
    then taken over the allowed tokens, as in vLLM."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


def _temperature_only(batch: SamplingBatch) -> bool:
    """True when the batch needs no more than temperature scaling (or greedy) per row."""
    return (batch.top_k is None and batch.top_p is None and batch.min_p is None and not batch.generators
            and batch.repetition_penalty is None and batch.presence_penalty is None
            and batch.frequency_penalty is None and batch.allowed is None and batch.banned is None
            and batch.logit_bias is None)


class Sampler:
    """seed: the fused path draws one 64-bit Philox seed per step from `random.Random(seed)`,
    so a run's samples follow from the engine seed without a device sync. fused: None uses
    the fused kernel where it applies (CUDA logits, Triton installed, a temperature-only
    batch); True uses it for every temperature-only batch, CPU tensors included (the tests
    run it there under TRITON_INTERPRET=1); False never uses it."""

    def __init__(self, seed: int = 0, fused: bool | None = None) -> None:
        self.fused = fused
        self._rng = random.Random(seed)

    def seed_state(self) -> bytes:
        """The per-step seed source's state, as bytes (a rank joining a replica takes rank 0's)."""
        version, internal, gauss = self._rng.getstate()
        return json.dumps([version, list(internal), gauss]).encode()

    def set_seed_state(self, state: bytes) -> None:
        version, internal, gauss = json.loads(state)
        self._rng.setstate((version, tuple(internal), gauss))

    def _use_fused(self, logits: torch.Tensor, batch: SamplingBatch) -> bool:
        if self.fused is False or not _temperature_only(batch):
            return False
        if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False
        return self.fused or (logits.is_cuda and triton_kernels_available())

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if batch.token_bitmask is not None:
            apply_token_bitmask(logits, batch.token_bitmask, batch.token_bitmask_rows)
        if self._use_fused(logits, batch):
            from pagoda_kernels.sampling import sample_tokens

            if logits.stride(-1) != 1:
                logits = logits.contiguous()
            temperature = batch.temperature.to(device=logits.device, dtype=torch.float32)
            sampled = sample_tokens(logits, temperature, self._rng.getrandbits(64))
        else:
            logits = logits.to(torch.float32)
            sampled = self._sample_torch(logits, batch)
        out = SamplerOutput(sampled=sampled)
        if batch.max_num_logprobs is not None:  # of the raw logits: before penalties and temperature
            raw_logprobs = logits.to(torch.float32).log_softmax(dim=-1)
            out.sampled_logprob = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
            if batch.max_num_logprobs > 0:
                out.top_logprobs, out.top_ids = raw_logprobs.topk(batch.max_num_logprobs, dim=-1)
        return out

    @staticmethod
    def _sample_torch(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits: float32 (not modified). The order is vLLM's: logit_bias, then penalties."""
        logits = apply_logit_bias(logits, batch)
        if batch.repetition_penalty is not None:
            logits = apply_penalties(logits, batch)
        logits = apply_masks(logits, batch)
        greedy = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy
        temp = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
        scaled = logits / temp.unsqueeze(1)
        scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
        if batch.min_p is not None:
            scaled = apply_min_p(scaled, batch.min_p)
        sampled = random_sample(scaled.softmax(dim=-1), batch.generators)
        return torch.where(batch.temperature > 0, sampled, greedy)
