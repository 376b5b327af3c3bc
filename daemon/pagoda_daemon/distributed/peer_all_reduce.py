"""The tensor-parallel all-reduce of small tensors, read straight from the other GPUs over
NVLink: each rank copies its partial sum into a buffer every rank of the node has mapped
(torch symmetric memory), and a kernel reads every rank's copy and adds them up
(pagoda_kernels.peer_sum). vLLM's custom all-reduce does the same for the same reason.

Why: a Llama-3-8B decode step at TP = 2 and 256 sequences runs 64 all-reduces of 2 MiB, and
NCCL's ring took 2.02 ms of the step's 11.57 ms on 2 × H100 (NV18), 31.6 µs each. Measured by
`benchmarks/all_reduce.py` on that machine (2026-11-27, bf16, in CUDA graphs), per all-reduce:
2 MiB 18.0 µs this way, 23.2 µs with torch's one-shot kernel (few programs, too few reads of
the other GPU in flight), 32.6 µs NCCL; 32 MiB 133.6 / 274.6 / 144.4 µs
(docs/benchmarks/2026-11-27-tp-all-reduce-h100-x2.md). Larger tensors (long prefill chunks)
stay on NCCL, whose ring moves fewer bytes per rank once there are more than two ranks.

Only where every rank is a GPU of this node (one pod): symmetric memory maps the other GPUs'
memory, which another host's GPU cannot offer. NVLink multicast is never used (peer_sum reads
the peers' memory point to point), so the multimem operations, which need it, are not called. If the buffer cannot be set up on some rank, every rank stays on NCCL.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# The largest tensor summed through the peers' memory. Per rank the reads take (ranks - 1) × the
# tensor over NVLink, NCCL's ring 2 × (ranks - 1) / ranks × the tensor: at two ranks the same
# bytes, and this way was faster at every size measured (64 KiB to 32 MiB, 2 × H100); at more
# ranks (not measured yet) only its latency can win, so only small tensors go this way there.
MAX_BYTES = {2: 32 << 20}
DEFAULT_MAX_BYTES = 1 << 20


@dataclass(eq=False)
class PeerAllReduce:
    """One rank's end of the buffer: sums tensors of at most ``max_numel`` elements of ``dtype``."""

    buffer: torch.Tensor  # this rank's part of the symmetric buffer
    group_name: str
    handle: Any  # the rendezvous' handle: the barrier across the ranks
    table: torch.Tensor  # every rank's buffer address, rank 0 first (int64, on the GPU)

    @property
    def max_numel(self) -> int:
        return self.buffer.numel()

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes this way: on the buffer's device, of its dtype, contiguous, small enough."""
        return (x.dtype == self.buffer.dtype and x.device == self.buffer.device and x.is_contiguous()
                and 0 < x.numel() <= self.max_numel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in a new tensor: ``x`` copied into this rank's buffer,
        a barrier (every rank's copy is in place), every buffer read and added up in rank order
        (pagoda_kernels.peer_sum), a barrier (every rank has read: the buffers may be written
        again)."""
        from pagoda_kernels.peer_sum import peer_sum

        out = torch.empty_like(x)
        self.buffer[: x.numel()].view(x.shape).copy_(x)
        self.handle.barrier(channel=0)
        peer_sum(self.table, out)
        self.handle.barrier(channel=1)
        return out


def max_bytes_for(ranks: int) -> int:
    return MAX_BYTES.get(ranks, DEFAULT_MAX_BYTES)


def create(group: Any, ranks: int, device: torch.device, dtype: torch.dtype,
           max_bytes: int | None = None) -> PeerAllReduce | None:
    """Every rank of ``group`` calls this together (it is collective). None, on every rank, where
    the path is not available: off the GPU, or where any rank failed to map the buffer."""
    if device.type != "cuda" or ranks < 2 or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    max_bytes = max_bytes or max_bytes_for(ranks)
    numel = max_bytes // torch.empty((), dtype=dtype).element_size()
    peer = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        with warnings.catch_warnings():  # required by torch 2.11, deprecated (and harmless) since
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
        handle = symm_mem.rendezvous(buffer, group.group_name)
        table = torch.tensor([handle.get_buffer(r, (numel,), dtype).data_ptr() for r in range(ranks)],
                             dtype=torch.int64, device=device)
        peer = PeerAllReduce(buffer, group.group_name, handle, table)
    except (RuntimeError, ImportError, AttributeError) as e:
        log.warning("all-reduce through the peers' memory unavailable on this rank (%s); NCCL sums every tensor", e)
    from pagoda_daemon.distributed.parallel_state import min_over_group  # it imports this module

    if not min_over_group(int(peer is not None), group) or peer is None:
        return None
    log.info("all-reduce: tensors up to %d MiB summed from the peers' memory in CUDA graphs, the rest by NCCL",
             max_bytes >> 20)
    return peer


def sum_over(group: Any, x: torch.Tensor, peer: PeerAllReduce | None) -> torch.Tensor:
    """``x`` summed over ``group``: through the peers' memory where it fits and a CUDA graph is
    being captured (the decode steps), else NCCL in place. Eager steps stay on NCCL: there the
    four launches (copy, barrier, sum, barrier) cost the host more than NCCL's one."""
    if peer is not None and peer.takes(x) and torch.cuda.is_current_stream_capturing():
        return peer(x)
    dist.all_reduce(x, group=group)
    return x
