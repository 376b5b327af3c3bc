"""Qwen3-MoE: Qwen3 attention with a sparse mixture-of-experts MLP (no shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda_daemon.models.layers import Linear
from pagoda_daemon.models.llama import MLP, DecoderLayer, Qwen3ForCausalLM


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """Softmax routing in float32, top-k, optional renormalisation (Qwen3's norm_topk_prob)."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """Expert by expert in plain torch: the reference the fused kernel is checked against.

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; weights/ids [T, k].
    """
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    inter = w2.shape[2]
    for e in torch.unique(ids).tolist():
        token_idx, slot = torch.where(ids == e)
        gate_up = F.linear(x[token_idx], w13[e])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h, w2[e]) * weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(x.dtype))
    return out


class SparseMoE(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = Linear(hidden, self.num_experts)
        # Experts stacked for grouped GEMMs; the loader fills them from per-expert tensors.
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize)
        return moe_reference(x, self.w13, self.w2, weights, ids)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_layer(self, config, backend, rotary, index: int) -> DecoderLayer:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = index not in (getattr(config, "mlp_only_layers", None) or []) and (index + 1) % step == 0
        mlp = SparseMoE(config) if sparse and config.num_experts_per_tok > 0 else MLP(
            config.hidden_size, config.intermediate_size
        )
        return DecoderLayer(config, backend, rotary, self.qk_norm, mlp)

    @staticmethod
    def expert_param(name: str) -> tuple[str, int, str] | None:
        """`...mlp.experts.7.up_proj.weight` -> (`...mlp.w13`, 7, "up_proj")."""
        if ".mlp.experts." not in name:
            return None
        prefix, rest = name.split(".mlp.experts.", 1)
        expert, proj, _ = rest.split(".", 2)
        target = "w2" if proj == "down_proj" else "w13"
        return f"{prefix}.mlp.{target}", int(expert), proj
