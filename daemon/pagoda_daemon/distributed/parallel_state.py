"""Where this process sits among a replica's ranks, and the two collectives the model uses.

One ``TensorParallel`` per worker, handed to the model at construction (no process-global
state): rank, size, the torch.distributed process group, and how many groups the MoE experts
are spread over. torch.distributed is the engine of every collective (NCCL on GPUs, gloo on
CPU, where CI proves the logic); a group of size one is a no-op, so the one-GPU path runs
exactly as before.

Layout of ``tensor × expert`` ranks (elastic expert parallelism replicates the dense part
instead: ``TensorParallel.dense``): attention, dense MLPs, embedding and LM head are sharded
over all of them; a MoE layer's experts are spread over ``expert`` groups of consecutive ranks
(each rank holds its group's experts whole when ``tensor`` is 1, or a ``1/tensor`` slice of
each). Every rank sees every token (the attention's all-reduce gives each the whole hidden
state), so a rank runs its experts on the tokens routed to them and one all-reduce combines
the ranks' outputs: the all-gather + reduce form of dispatch and combine.
"""

from __future__ import annotations

import datetime
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagoda_daemon.distributed.peer_all_reduce import PeerAllReduce, sum_over


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None for size 1
    expert_groups: int = 1  # expert-parallel size: the MoE experts are spread over this many groups
    eplb: bool = False  # experts placed by the load balancer (eplb.py) rather than in order
    redundant_experts: int = 0  # with eplb: extra expert slots, for copies of the busiest experts
    # Elastic expert parallelism: attention, dense layers, embedding and LM head whole on every
    # rank (only the experts are spread), so that any number of ranks can serve (docs/elastic-ep.md).
    replicated_dense: bool = False
    # Data-parallel attention (distributed/lockstep.py): the ranks are data-parallel engines, each
    # with its own requests; a MoE layer gathers every rank's tokens, runs this rank's experts on
    # all of them and hands each rank back the sum for its own (all-gather + reduce-scatter).
    # Implies replicated_dense.
    spread_tokens: bool = False
    # With spread_tokens, in eager steps: each token sent only to the ranks holding its experts, by
    # all-to-all (token_dispatch.py, --all2all-backend alltoallv), not gathered everywhere
    alltoallv: bool = False
    # Small tensors summed from the other GPUs' memory over NVLink instead of by NCCL
    # (peer_all_reduce.py); None: NCCL sums everything.
    peer: PeerAllReduce | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside a group of {self.size}")
        if self.expert_groups < 1 or self.size % self.expert_groups:
            raise ValueError(f"expert-parallel size {self.expert_groups} does not divide the {self.size} ranks")
        if self.spread_tokens and not self.replicated_dense:
            raise ValueError("data-parallel attention keeps attention and the dense layers whole on every rank")
        if self.alltoallv and not self.spread_tokens:
            raise ValueError("the all-to-all dispatch moves tokens between data-parallel engines (spread_tokens)")

    @property
    def expert_group(self) -> int:
        """Which group of experts this rank holds."""
        return self.rank // (self.size // self.expert_groups)

    @property
    def expert_slicing(self) -> tuple[int, int]:
        """(this rank's slice, slices) of each of its experts' intermediate dimension."""
        per_group = self.size // self.expert_groups
        return self.rank % per_group, per_group

    def local_experts(self, num_experts: int) -> tuple[int, int]:
        """(first, count) of the expert slots this rank holds: an even split or an error. Without
        EPLB slot i holds expert i; with it, the balancer's placement says which expert."""
        slots = num_experts + self.redundant_experts
        if slots % self.expert_groups:
            raise ValueError(f"the number of experts ({num_experts}) plus redundant experts "
                             f"({self.redundant_experts}) is not divisible by the expert-parallel size "
                             f"{self.expert_groups}")
        count = slots // self.expert_groups
        return self.expert_group * count, count

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def engine(self) -> TensorParallel:
        """The ranks that run this engine's requests together (they must agree on its KV cache
        and on failed KV loads): all of them, or this one alone with data-parallel attention."""
        return SINGLE if self.spread_tokens else self

    @property
    def dense(self) -> TensorParallel:
        """The group attention and the dense layers are split over: this one, or none where
        they are replicated on every rank."""
        return SINGLE if self.replicated_dense else self

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group (the row-parallel layers' partial products): the returned tensor,
        which may be ``x`` itself, summed in place, or a new one."""
        return sum_over(self.group, x, self.peer) if self.enabled else x

    def sum_add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sum of ``x`` over the group, the residual added and RMSNorm applied, in one kernel
        (``(normed, new residual)``), where the peer path sums ``x``; None elsewhere (the caller
        sums by :meth:`all_reduce` and norms)."""
        if not self.enabled or self.peer is None or not self.peer.sums_now(x):
            return None
        if residual.shape != x.shape or residual.dtype != x.dtype:
            return None
        return self.peer.sum_add_norm(x, residual, weight, eps)

    def all_reduce_input(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where a partial product of ``shape`` that :meth:`all_reduce` sums next is best written
        (the peer path's buffer, sparing a copy), or None: anywhere."""
        return self.peer.input_slot(shape, dtype) if self.peer is not None else None

    def graph_capture(self) -> AbstractContextManager[None]:
        """Around the capture of each CUDA graph whose all-reduces may go through the peers' memory."""
        return self.peer.graph_capture() if self.peer is not None else nullcontext()

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of the last dimension, concatenated in rank order (the logits)."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, in rank order (each rank has as many: the step agreement pads them)."""
        if x.is_cuda:
            out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
            dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
            return out
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts)

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of ``x``'s rows, this rank's share of them (the inverse of
        :meth:`all_gather_rows`)."""
        rows = x.shape[0] // self.size
        if x.is_cuda:
            out = x.new_empty((rows, *x.shape[1:]))
            dist.reduce_scatter_tensor(out, x.contiguous(), group=self.group)
            return out
        dist.all_reduce(x, group=self.group)  # gloo has no reduce-scatter: sum everything, keep ours
        return x[self.rank * rows : (self.rank + 1) * rows]

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, rows, experts' columns): an even split or an error."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.size}")
        return total // self.size


@dataclass(frozen=True)
class Unsummed:
    """A row-parallel product not yet summed over ``tp``: what a layer hands the RMSNorm after
    it, which sums it (``RMSNorm`` in models/layers.py), through the peers' memory together with
    its residual add and norm where it can (:meth:`TensorParallel.sum_add_norm`)."""

    partial: torch.Tensor
    tp: TensorParallel

    def total(self) -> torch.Tensor:
        return self.tp.all_reduce(self.partial)


def summed(x: torch.Tensor | Unsummed) -> torch.Tensor:
    """``x`` itself, or its partial products summed over their group."""
    return x.total() if isinstance(x, Unsummed) else x


SINGLE = TensorParallel()


def kv_heads_per_rank(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(KV heads this rank holds, the first of them). With more ranks than KV heads each head
    is replicated over size // num_kv_heads ranks, as in vLLM."""
    if tp.size <= num_kv_heads:
        per_rank = tp.split(num_kv_heads, "the number of KV heads")
        return per_rank, tp.rank * per_rank
    if tp.size % num_kv_heads:
        raise ValueError(f"the tensor-parallel size {tp.size} is neither a divisor nor a multiple of the "
                         f"number of KV heads ({num_kv_heads})")
    return 1, tp.rank // (tp.size // num_kv_heads)


def tensor_parallel_group(size: int, expert_groups: int = 1) -> TensorParallel:
    """The group an engine of `size` ranks (tensor × expert) runs in, its MoE experts spread over
    `expert_groups` of them. Size 1: none. Larger: this process
    must already be one rank of a torch.distributed world of exactly that size (one process per
    rank, started by a launcher such as torchrun, as vLLM's external launcher mode expects); every
    rank then runs the same engine on the same requests, and the model's collectives keep the
    ranks in step."""
    if size == 1:
        return SINGLE
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{size} ranks (tensor × expert parallel size) need one process each in an initialised "
                         "torch.distributed world (start the ranks with a launcher such as torchrun)")
    if dist.get_world_size() != size:
        raise ValueError(f"{size} ranks (tensor × expert parallel size) do not match the torch.distributed world of "
                         f"{dist.get_world_size()} processes")
    return TensorParallel(dist.get_rank(), size, dist.group.WORLD, expert_groups)


def _reduce_ints(values: list[int], op: dist.ReduceOp.RedOpType, group: Any) -> list[int]:
    """Every rank's ``values`` reduced element-wise with ``op`` (on the group's device: NCCL takes
    GPU tensors only)."""
    t = torch.tensor(values, dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def min_over_group(value: int, group: Any) -> int:
    """The smallest of every rank's value in ``group`` (collective)."""
    return _reduce_ints([value], dist.ReduceOp.MIN, group)[0]


def min_over_ranks(value: int, tp: TensorParallel) -> int:
    """The smallest of every rank's value (the KV blocks each rank can hold: all must agree)."""
    if not tp.enabled:
        return value
    return min_over_group(value, tp.group)


def any_over_ranks(flags: list[bool], tp: TensorParallel) -> list[bool]:
    """Each flag set where any rank set it (KV loads that failed on some rank: the scheduler must
    undo the same requests whichever rank's file was bad)."""
    if not tp.enabled:
        return flags
    return any_over_group(flags, tp.group)


def any_over_group(flags: list[bool], group: Any) -> list[bool]:
    """Each flag set where any rank of ``group`` set it (collective)."""
    if not flags:
        return flags
    return [bool(v) for v in _reduce_ints([int(f) for f in flags], dist.ReduceOp.MAX, group)]


def gloo_group_like(tp: TensorParallel, timeout_s: float) -> Any:
    """A gloo group over the ranks of ``tp`` (None with one rank), for collectives run beside the
    steps' own, from a thread of their own; every rank creates it together."""
    if not tp.enabled:
        return None
    return dist.new_group(dist.get_process_group_ranks(tp.group), backend="gloo",
                          timeout=datetime.timedelta(seconds=timeout_s))
