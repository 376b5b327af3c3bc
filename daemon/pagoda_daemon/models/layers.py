"""Building blocks shared by the decoder models.

Each op follows Hugging Face's order of operations and dtype casts exactly, so that
greedy outputs match transformers token for token. With `kernels=True` an op runs on
Pagoda's Triton kernel instead (same casts, one launch; see pagoda_kernels), which is
what the GPU path uses; the torch code stays as the CPU path and the reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda_daemon.distributed.parallel_state import SINGLE, TensorParallel, Unsummed, summed


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, kernels: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size))
        self._kernel = None
        if kernels:
            from pagoda_kernels.rmsnorm import rmsnorm

            self._kernel = rmsnorm

    def forward(self, x: torch.Tensor | Unsummed, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual). An
        ``Unsummed`` x is summed over its group first: with the add and the norm in the same
        kernel where the group's peer path takes it (a decode step's graph), else before them."""
        if isinstance(x, Unsummed):
            if (residual is not None and self._kernel is not None
                    and (fused := x.tp.sum_add_norm(x.partial, residual, self.weight, self.eps)) is not None):
                return fused
            x = x.total()
        if self._kernel is not None:
            return self._kernel(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual + x
            residual = x
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


class SiluAndMul(nn.Module):
    def __init__(self, kernels: bool = False) -> None:
        super().__init__()
        self._kernel = None
        if kernels:
            from pagoda_kernels.activation import silu_and_mul

            self._kernel = silu_and_mul

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            return self._kernel(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class Linear(nn.Module):
    """x @ W^T (+ b). With kernels, one 16-bit row on the GPU (batch-1 decode; the logits of one
    sequence) goes through `pagoda_kernels.gemv`, which streams the weights nearer the copy
    rate than the split-K kernels cuBLAS picks at that shape (docs/kernels.md). With LoRA
    enabled, a decoder layer's projections carry adapter slots (``lora``, lora/layers.py) whose
    per-token product is added to the output."""

    lora: Any = None  # LoRASlots, set by lora.layers.LoRAModelManager

    def __init__(self, in_features: int, out_features: int, bias: bool = False, kernels: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._gemv = None
        if kernels:
            from pagoda_kernels.gemv import gemv

            self._gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny(x):
            return self._gemv(x, self.weight, self.bias)
        return self.with_lora(F.linear(x, self.weight, self.bias), x)

    def with_lora(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` (this projection of x) plus the adapters' product, where adapters are enabled."""
        return out if self.lora is None else self.lora.add_delta(out, x)

    def skinny(self, x: torch.Tensor) -> bool:
        """The shape the kernel wins everywhere: at two rows it led on an H100 but not on an H200,
        at four cuBLAS is faster (docs/benchmarks/2026-11-22-batch1-matmuls-and-final-figures-h100.md).
        Not with adapter slots: their product needs the input the fused activation never writes."""
        return (self._gemv is not None and self.lora is None and x.dim() == 2 and x.shape[0] == 1 and x.is_cuda
                and x.dtype == self.weight.dtype and x.dtype in (torch.float16, torch.bfloat16)
                and x.stride(-1) == 1)

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """This projection of silu(gate) * up, the activation computed as the kernel reads its
        input (a skinny `gate_up` only: the down projection without SiluAndMul's launch)."""
        assert self.skinny(gate_up)
        return self._gemv(gate_up, self.weight, self.bias, silu_mul=True)


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (q/k/v, gate/up), column-parallel
    under tensor parallelism.

    `shards` names the checkpoint tensors that fill consecutive row ranges, each with the
    number of rows this rank holds; `checkpoint_rows` says which rows of each checkpoint tensor
    those are (start, count, the tensor's row count; default: all of them, the one-GPU case).
    The loader reads only those.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False, kernels: bool = False,
                 checkpoint_rows: dict[str, tuple[int, int, int]] | None = None) -> None:
        offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            offsets[name] = (offset, size)
            offset += size
        super().__init__(in_features, offset, bias, kernels)
        self.shard_offsets = offsets
        self.checkpoint_rows = checkpoint_rows or {name: (0, size, size) for name, size in shards.items()}


class RowParallelLinear(Linear):
    """A projection whose input features are split over the tensor-parallel ranks: each rank
    multiplies its slice, the partial products are summed over the group, then the bias is
    added once. Rank r holds the checkpoint's columns [r * in/size, (r + 1) * in/size)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, kernels: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        local = tp.split(in_features, "the input features of a row-parallel projection")
        super().__init__(local, out_features, bias, kernels)
        self.tp = tp
        self.checkpoint_cols = (tp.rank * local, local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return summed(self.partial(x))

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return summed(self.partial_silu_mul(gate_up))

    def partial(self, x: torch.Tensor) -> torch.Tensor | Unsummed:
        """The product, left for the RMSNorm after it to sum over the ranks (where there is a
        bias, which is added after the sum, or one rank: the product itself)."""
        if not self.tp.enabled:
            return super().forward(x)
        target = self.tp.all_reduce_input((*x.shape[:-1], self.weight.shape[0]), x.dtype)
        if self.skinny(x):
            out = self._gemv(x, self.weight, None, out=target)
        elif target is not None and x.dim() == 2:
            out = torch.mm(x, self.weight.t(), out=target)
        else:
            out = F.linear(x, self.weight)
        return self._unsummed(self.with_lora(out, x))  # this rank's share of the delta, summed with it

    def partial_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | Unsummed:
        if not self.tp.enabled:
            return super().forward_silu_mul(gate_up)
        target = self.tp.all_reduce_input((gate_up.shape[0], self.weight.shape[0]), gate_up.dtype)
        return self._unsummed(self._gemv(gate_up, self.weight, None, out=target, silu_mul=True))

    def _unsummed(self, partial: torch.Tensor) -> torch.Tensor | Unsummed:
        if self.bias is None:
            return Unsummed(partial, self.tp)
        return self.tp.all_reduce(partial) + self.bias


def vocab_range(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(first token id, ids held, rows per rank): the vocabulary split in equal row counts,
    the last rank's padded when the size does not divide it."""
    per_rank = -(-vocab_size // tp.size)
    start = min(tp.rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start), per_rank


class VocabParallelEmbedding(nn.Module):
    """The token embedding with its rows split over the ranks: each rank looks up the ids it
    holds (zeros elsewhere) and the group sums. One rank: a plain embedding lookup."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, self.held, rows = vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.checkpoint_rows = (self.start, self.held)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.held)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(Linear):
    """The output projection with the vocabulary split as VocabParallelEmbedding splits it;
    every rank gets the whole logits (gathered, padding dropped)."""

    def __init__(self, hidden_size: int, vocab_size: int, kernels: bool = False, tp: TensorParallel = SINGLE) -> None:
        start, held, rows = vocab_range(vocab_size, tp)
        super().__init__(hidden_size, rows, kernels=kernels)
        self.tp = tp
        self.vocab_size = vocab_size
        self.checkpoint_rows = (start, held)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if not self.tp.enabled:
            return logits
        return self.tp.all_gather_last_dim(logits)[..., : self.vocab_size]


def rope_parameters(config) -> dict:
    """The rope settings, whichever transformers generation wrote the config."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}
    params = {**legacy, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def compute_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise ValueError(f"rope_type {rope_type!r} is not supported yet (supported: default, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a cos/sin table precomputed for every position."""

    def __init__(self, head_dim: int, max_positions: int, params: dict, kernels: bool = False) -> None:
        super().__init__()
        self._kernel = None
        if kernels:
            from pagoda_kernels.rope import rope_neox

            self._kernel = rope_neox
        inv_freq = compute_inv_freq(head_dim, params)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None):
        """Rotate q [T, H, D] and k [T, KVH, D]; with q_norm and k_norm (Qwen3), normalise each
        head first. The kernel does both in one launch, in place: q and k are views of the
        qkv projection's output, which nothing reads afterwards."""
        if q_norm is not None and not self._fuses(q, q_norm, k_norm):
            q, k = q_norm(q), k_norm(k)
            q_norm = k_norm = None
        if self._kernel is not None:
            if q_norm is None:
                return self._kernel(positions, q, k, self.cos, self.sin, q, k)
            return self._kernel(positions, q, k, self.cos, self.sin, q, k, q_norm.weight, k_norm.weight, q_norm.eps)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)

    def _fuses(self, q: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> bool:
        """The kernel takes the norms when their output dtype is q's (weights in the model's dtype)."""
        return (self._kernel is not None and q_norm.eps == k_norm.eps
                and q_norm.weight.dtype == k_norm.weight.dtype == q.dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def attend_step_rows(attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None,
                     meta: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """The step's attention (``attn``: an AttentionBackend) into ``out`` (else a new tensor like
    q). Rows past the step's own (a step padded to a warmed-up size, worker/step_shapes.py) are
    left out: zero in a new ``out``, untouched in a given one."""
    n = meta.num_tokens
    if n == q.shape[0]:
        return attn.forward(q, k, v, kv_cache, meta, out)
    if out is None:
        out = torch.empty_like(q)
        out[n:].zero_()
    attn.forward(q[:n], k[:n], v[:n], kv_cache, meta, out=out[:n])
    return out
