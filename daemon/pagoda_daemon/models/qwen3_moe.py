"""Qwen3-MoE: Qwen3 attention with a sparse mixture-of-experts MLP (no shared experts)."""

from __future__ import annotations

import torch
from torch import nn

from pagoda_daemon.distributed.parallel_state import SINGLE, TensorParallel
from pagoda_daemon.models.layers import Linear
from pagoda_daemon.models.llama import MLP, DecoderLayer, Qwen3ForCausalLM

# One implementation of routing and the expert loop: the kernels' pure-torch twins.
from pagoda_kernels.reference import moe_ref as moe_reference
from pagoda_kernels.reference import route_topk_ref as route_topk


class SparseMoE(nn.Module):
    """Under tensor parallelism every rank holds every expert's slice of the intermediate
    dimension (gate/up rows, down columns) and the ranks' outputs are summed; the router is
    replicated."""

    def __init__(self, config, kernels: bool = False, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.tp = tp
        hidden = config.hidden_size
        inter = tp.split(config.moe_intermediate_size, "the experts' intermediate size")
        self.gate = Linear(hidden, self.num_experts)
        # Experts stacked for grouped GEMMs; the loader fills them from per-expert tensors,
        # reading this rank's rows of gate/up and columns of down (checkpoint_inter).
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, inter))
        self.checkpoint_inter = (tp.rank * inter, inter)
        self._kernel = None
        if kernels:  # the fused Triton MoE: no host sync, so decode steps can be graph-captured
            from pagoda_kernels.fused_moe import moe

            self._kernel = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            out = self._kernel(x, self.gate(x), self.w13, self.w2, self.top_k, self.renormalize)
        else:
            weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize)
            out = moe_reference(x, self.w13, self.w2, weights, ids)
        return self.tp.all_reduce(out)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_layer(self, config, backend, rotary, index: int) -> DecoderLayer:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = index not in (getattr(config, "mlp_only_layers", None) or []) and (index + 1) % step == 0
        kernels = backend.uses_kernels
        mlp = SparseMoE(config, kernels, self.tp) if sparse and config.num_experts_per_tok > 0 else MLP(
            config.hidden_size, config.intermediate_size, kernels, self.tp
        )
        return DecoderLayer(config, backend, rotary, self.qk_norm, mlp, self.tp)

    @staticmethod
    def expert_param(name: str) -> tuple[str, int, str] | None:
        """`...mlp.experts.7.up_proj.weight` -> (`...mlp.w13`, 7, "up_proj")."""
        if ".mlp.experts." not in name:
            return None
        prefix, rest = name.split(".mlp.experts.", 1)
        expert, proj, _ = rest.split(".", 2)
        target = "w2" if proj == "down_proj" else "w13"
        return f"{prefix}.mlp.{target}", int(expert), proj
