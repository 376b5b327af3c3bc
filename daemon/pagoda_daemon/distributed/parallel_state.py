"""Where this process sits in a tensor-parallel group, and the two collectives the model uses.

One ``TensorParallel`` per worker, handed to the model at construction (no process-global
state): rank, size and the torch.distributed process group. torch.distributed is the engine
of every collective (NCCL on GPUs, gloo on CPU, where CI proves the logic); a group of size
one is a no-op, so the one-GPU path runs exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None for size 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside a group of {self.size}")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (the row-parallel layers' partial products)."""
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of the last dimension, concatenated in rank order (the logits)."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, rows, experts' columns): an even split or an error."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.size}")
        return total // self.size


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


def tensor_parallel_group(size: int) -> TensorParallel:
    """The group an engine of tensor-parallel `size` runs in. Size 1: none. Larger: this process
    must already be one rank of a torch.distributed world of exactly that size (one process per
    rank, started by a launcher such as torchrun, as vLLM's external launcher mode expects); every
    rank then runs the same engine on the same requests, and the model's collectives keep the
    ranks in step."""
    if size == 1:
        return SINGLE
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"tensor_parallel_size {size} needs one process per rank in an initialised "
                         "torch.distributed world (start the ranks with a launcher such as torchrun)")
    if dist.get_world_size() != size:
        raise ValueError(f"tensor_parallel_size {size} does not match the torch.distributed world of "
                         f"{dist.get_world_size()} processes")
    return TensorParallel(dist.get_rank(), size, dist.group.WORLD)


def min_over_ranks(value: int, tp: TensorParallel) -> int:
    """The smallest of every rank's value (the KV blocks each rank can hold: all must agree)."""
    if not tp.enabled:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend(tp.group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return int(t.item())
