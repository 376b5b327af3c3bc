"""Qwen3-MoE: Qwen3 attention with a sparse mixture-of-experts MLP (no shared experts)."""

from __future__ import annotations

import torch
from torch import nn

from pagoda_daemon.distributed import token_dispatch
from pagoda_daemon.distributed.parallel_state import SINGLE, TensorParallel, Unsummed
from pagoda_daemon.models.layers import Linear
from pagoda_daemon.models.llama import MLP, DecoderLayer, Qwen3ForCausalLM

# One implementation of routing and the expert loop: the kernels' pure-torch twins.
from pagoda_kernels.reference import local_expert_ids
from pagoda_kernels.reference import moe_ref as moe_reference
from pagoda_kernels.reference import route_topk_ref as route_topk


class SparseMoE(nn.Module):
    """A rank holds the experts of its expert group (all of them without expert parallelism),
    each whole or, with several ranks per group, its slice of the intermediate dimension
    (gate/up rows, down columns). The router is replicated: every rank routes every token, runs
    its experts on the tokens routed to them, and the ranks' outputs are summed
    (parallel_state.py).

    With EPLB (``tp.eplb``) the rank's slots hold whichever experts the balancer placed there
    (``placement``: the expert of every physical slot of the replica), an expert may have
    copies on several ranks, each taking the tokens whose index falls to it, and the layer
    counts the tokens routed to each expert (``expert_load``) for the next rebalance: only the
    step's own tokens (``counted_rows``, set each step by the balancer), never padding rows, and
    with data-parallel attention only this engine's, so that the sum over the ranks counts each
    token once (an idle engine's padding rows, all zeros, route to the same few experts)."""

    expert_load: torch.Tensor  # buffers, with EPLB only
    replica_slots: torch.Tensor
    replica_counts: torch.Tensor
    # With EPLB: a 0-d tensor shared by every MoE layer, the real token rows of this rank's step
    # (eplb.ExpertBalancer.count_rows); None: every row counts
    counted_rows: torch.Tensor | None = None
    # With data-parallel attention dispatched by all-to-all: the real rows of the engine's step,
    # shared by every MoE layer of the model (set by ModelRunner._moe_dispatch; token_dispatch.py)
    step_rows: token_dispatch.StepRows | None = None

    def __init__(self, config, kernels: bool = False, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.tp = tp
        hidden = config.hidden_size
        self.first_expert, local = tp.local_experts(self.num_experts)  # the first slot, with EPLB
        slice_rank, slices = tp.expert_slicing
        full_inter = config.moe_intermediate_size
        if full_inter % slices:
            raise ValueError(f"the experts' intermediate size ({full_inter}) is not divisible by the "
                             f"tensor-parallel size {slices}")
        inter = full_inter // slices
        self.gate = Linear(hidden, self.num_experts)
        # This rank's experts stacked for grouped GEMMs; the loader fills them from per-expert
        # tensors, reading only these experts, and of each this rank's rows of gate/up and
        # columns of down (checkpoint_inter: start, size, the checkpoint's size).
        self.w13 = nn.Parameter(torch.empty(local, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, inter))
        self.checkpoint_inter = (slice_rank * inter, inter, full_inter)
        self.eplb = tp.eplb
        if self.eplb:
            from pagoda_daemon.distributed.eplb import initial_placement

            self.slots_per_rank = local
            self.max_copies = 1 + tp.redundant_experts
            self.register_buffer("expert_load", torch.zeros(self.num_experts, dtype=torch.int64), persistent=False)
            self.register_buffer("replica_slots", torch.zeros(self.num_experts, self.max_copies, dtype=torch.int64),
                                 persistent=False)
            self.register_buffer("replica_counts", torch.ones(self.num_experts, dtype=torch.int64), persistent=False)
            self.set_placement(initial_placement(self.num_experts, tp.expert_groups, local))
        self._route = route_topk
        self._fused = None
        if kernels:  # the fused Triton MoE: no host sync, so decode steps can be graph-captured
            from pagoda_kernels.fused_moe import fused_moe
            from pagoda_kernels.fused_moe import route_topk as route_topk_kernel

            self._route, self._fused = route_topk_kernel, fused_moe

    def set_placement(self, placement: list[int]) -> None:
        """The expert of each physical slot; the copy tables follow, updated in place (CUDA
        graphs captured over them stay valid)."""
        from pagoda_daemon.distributed.eplb import replica_table

        self.placement = list(placement)
        slots, counts = replica_table(self.placement, self.num_experts, self.max_copies)
        self.replica_slots.copy_(slots)
        self.replica_counts.copy_(counts)

    def resize(self, tp: TensorParallel, placement: list[int], w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Take another expert-parallel layout (elastic EP, with EPLB): this rank's slots of
        it, their weights, and the placement of the whole replica. The copy tables grow or
        shrink with the redundant slots: CUDA graphs are captured again afterwards."""
        self.tp = tp
        self.first_expert, local = tp.local_experts(self.num_experts)
        if w13.shape[0] != local or w2.shape[0] != local:
            raise ValueError(f"{w13.shape[0]} expert slots given where the layout puts {local} on this rank")
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.slots_per_rank = local
        self.max_copies = 1 + tp.redundant_experts
        device = self.replica_slots.device
        self.replica_slots = torch.zeros(self.num_experts, self.max_copies, dtype=torch.int64, device=device)
        self.replica_counts = torch.ones(self.num_experts, dtype=torch.int64, device=device)
        self.expert_load.zero_()
        self.set_placement(placement)

    def local_slots(self, expert: int) -> list[int]:
        """Where this rank keeps `expert` (its index in w13/w2), if anywhere (the loader asks)."""
        count = self.w13.shape[0]
        if not self.eplb:
            local = expert - self.first_expert
            return [local] if 0 <= local < count else []
        return [s for s in range(count) if self.placement[self.first_expert + s] == expert]

    def _slot_ids(self, ids: torch.Tensor, only_real_rows: bool = False) -> torch.Tensor:
        """Experts -> the slots of the replica that compute them (EPLB: an expert's tokens split
        over its copies by token index; without EPLB a slot is its expert). ``only_real_rows``:
        every row routed is one of this engine's real ones (all-to-all dispatch), all counted."""
        if not self.eplb:
            return ids
        ids = ids.long()
        token = torch.arange(ids.shape[0], device=ids.device)[:, None]
        counted = torch.ones_like(token) if only_real_rows else self._counted(token)
        self.expert_load.scatter_add_(0, ids.flatten(), counted.expand_as(ids).flatten())
        copy = token % self.replica_counts[ids]
        return self.replica_slots[ids, copy]

    def _counted(self, token: torch.Tensor) -> torch.Tensor:
        """1 for the rows whose routing counts toward ``expert_load``, else 0 (on the device: no
        host sync, so CUDA graphs capture it). With data-parallel attention the rows are every
        engine's, this engine's at ``rank × rows / engines``."""
        if self.counted_rows is None:
            return torch.ones_like(token)
        first = self.tp.rank * (token.shape[0] // self.tp.size) if self.tp.spread_tokens else 0
        return ((token >= first) & (token < first + self.counted_rows)).long()

    def forward(self, x: torch.Tensor) -> torch.Tensor | Unsummed:
        """The experts' output, its sum over the ranks left to the norm after it; with
        data-parallel attention, every rank's tokens in, this rank's summed out."""
        if self.tp.spread_tokens:
            if self.tp.alltoallv and self.step_rows is not None and self.step_rows.rows is not None:
                return self._experts_dispatched(x, self.step_rows.rows)
            out = self._experts(self.tp.all_gather_rows(x))
            return self.tp.reduce_scatter_rows(out)
        out = self._experts(x)
        return Unsummed(out, self.tp) if self.tp.enabled else out

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the tokens routed to them (zero rows for the others')."""
        weights, ids = self._route(self.gate(x), self.top_k, self.renormalize)
        slots = self._slot_ids(ids)  # this rank computes slots first_expert.. (the kernel skips the others)
        # written where the all-reduce sums it from (the peers' buffer), if anywhere
        return self._compute(x, weights, slots, self.tp.all_reduce_input(tuple(x.shape), x.dtype))

    def _experts_dispatched(self, x: torch.Tensor, real_rows: int) -> torch.Tensor:
        """Data-parallel attention by all-to-all (token_dispatch.py): this engine's real rows
        routed here, each sent to the ranks holding its experts, computed there, summed back."""
        rows = x.shape[0]
        real = min(real_rows, rows)
        mine = x[:real]
        if real:
            weights, ids = self._route(self.gate(mine), self.top_k, self.renormalize)
            slots = self._slot_ids(ids, only_real_rows=True)
        else:  # an engine lending its experts only: it sends nothing
            weights = torch.empty((0, self.top_k), dtype=torch.float32, device=x.device)
            slots = torch.empty((0, self.top_k), dtype=torch.int64, device=x.device)
        sent = token_dispatch.dispatch(mine, weights, slots, self.w13.shape[0], self.tp.group, self.tp.size)
        out = self._compute(sent.x, sent.weights, sent.slots) if sent.x.shape[0] else sent.x
        return token_dispatch.combine(sent, out, rows, self.tp.group)

    def _compute(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's expert slots (``first_expert``..) on ``x``'s rows, each weighted as routed;
        the slots of other ranks add nothing."""
        if self._fused is not None:
            # the rows spread over every rank's experts: what the grouped GEMMs' tiles are sized by
            out = self._fused(x, self.w13, self.w2, weights, slots, first_expert=self.first_expert, out=out,
                              global_experts=self.num_experts)
        else:
            local = self.w13.shape[0]
            every_expert_here = local == self.num_experts and not self.eplb
            out = moe_reference(x, self.w13, self.w2, weights,
                                slots if every_expert_here else local_expert_ids(slots, self.first_expert, local))
        return out


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # the real rows of each step, which the MoE layers read with the all-to-all dispatch
        self.step_rows = token_dispatch.StepRows()
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.step_rows = self.step_rows

    def make_layer(self, config, backend, rotary, index: int) -> DecoderLayer:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = index not in (getattr(config, "mlp_only_layers", None) or []) and (index + 1) % step == 0
        kernels = backend.uses_kernels
        mlp = SparseMoE(config, kernels, self.tp) if sparse and config.num_experts_per_tok > 0 else MLP(
            config.hidden_size, config.intermediate_size, kernels, self.tp.dense
        )
        return DecoderLayer(config, backend, rotary, self.qk_norm, mlp, self.tp.dense)

    def run_experts_only(self, rows: int) -> None:
        """Data-parallel attention, an engine without tokens this step (distributed/lockstep.py):
        its MoE layers in order on ``rows`` padding rows, so that the other engines' tokens reach
        its experts. Nothing it computes is kept."""
        weight = self.lm_head.weight
        x = torch.zeros(rows, self.config.hidden_size, dtype=weight.dtype, device=weight.device)
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module(x)

    def has_experts(self) -> bool:
        return any(isinstance(m, SparseMoE) for m in self.modules())

    @staticmethod
    def expert_param(name: str) -> tuple[str, int, str] | None:
        """`...mlp.experts.7.up_proj.weight` -> (`...mlp.w13`, 7, "up_proj")."""
        if ".mlp.experts." not in name:
            return None
        prefix, rest = name.split(".mlp.experts.", 1)
        expert, proj, _ = rest.split(".", 2)
        target = "w2" if proj == "down_proj" else "w13"
        return f"{prefix}.mlp.{target}", int(expert), proj
