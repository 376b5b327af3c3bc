"""The tensor-parallel all-reduce of small tensors, read straight from the other GPUs over
NVLink: each rank puts its partial sum in a buffer every rank of the node has mapped (torch
symmetric memory; the row-parallel projections and the MoE combine write their products there
directly), and one kernel waits until every rank's part is in place, then reads them all and adds
them up (pagoda_kernels.peer_sum). vLLM's custom all-reduce does the same for the same reason.

Why: a Llama-3-8B decode step at TP = 2 and 256 sequences runs 64 all-reduces of 2 MiB, and
NCCL's ring took 2.02 ms of the step's 11.57 ms on 2 × H100 (NV18), 31.6 µs each. Measured by
`benchmarks/all_reduce.py` on that machine (2026-11-27, bf16, in CUDA graphs), per all-reduce:
2 MiB 18.0 µs this way, 23.2 µs with torch's one-shot kernel (few programs, too few reads of
the other GPU in flight), 32.6 µs NCCL; 32 MiB 133.6 / 274.6 / 144.4 µs
(docs/benchmarks/2026-11-27-tp-all-reduce-h100-x2.md, with two barriers and a copy per sum; with
one and none, 12.9 µs for 2 MiB on 2 × H200 against NCCL's 31.4, and Llama-3-8B at TP = 2 3.2-3.4%
faster end to end: 2026-11-27-tp-all-reduce-slots-h100-h200-x2.md). Larger tensors (long prefill chunks)
stay on NCCL, whose ring moves fewer bytes per rank once there are more than two ranks.

Only where every rank is a GPU of this node (one pod): symmetric memory maps the other GPUs'
memory, which another host's GPU cannot offer. NVLink multicast is never used (peer_sum reads
the peers' memory point to point), so the multimem operations, which need it, are not called.
If the buffer cannot be set up on some rank, every rank stays on NCCL.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
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
    """One rank's end of the buffer: sums tensors of at most ``max_numel`` elements of ``dtype``,
    inside the CUDA graphs captured under :meth:`graph_capture`.

    The buffer has two slots, used in turn, so that the barrier at the start of each sum is
    the only one: a rank writes slot s again only two all-reduces later, after the barrier of
    the one between, which no rank passes before it has finished reading slot s. (With one slot
    a second barrier after each sum kept the writers off the buffer: 65 more barriers of 4.1 µs
    in each decode step of Llama-3-8B at TP = 2 on 2 × H100, 2026-11-27.) The barrier is part of
    the summing kernel (pagoda_kernels.peer_sum)."""

    buffer: torch.Tensor  # this rank's part of the symmetric buffer: two slots of max_numel
    group_name: str
    handle: Any  # the rendezvous' handle, kept for as long as the peers' memory is mapped
    tables: torch.Tensor  # [2, ranks] int64 on the GPU: each slot's address on every rank, rank 0 first
    pads: torch.Tensor  # [ranks] int64 on the GPU: each rank's signal pad (the barrier's flags)
    rank: int
    max_programs: int  # as many as the pads have flags for
    capturing: bool = False  # inside graph_capture: the only place this path is taken
    calls: int = 0  # all-reduces since the capture began; slot = calls % 2

    @property
    def max_numel(self) -> int:
        return self.buffer.numel() // 2

    def fits(self, numel: int, dtype: torch.dtype) -> bool:
        return dtype == self.buffer.dtype and 0 < numel <= self.max_numel

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes this way: on the buffer's device, of its dtype, contiguous, small enough."""
        return x.device == self.buffer.device and x.is_contiguous() and self.fits(x.numel(), x.dtype)

    def sums_now(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is summed this way now: inside a capture, and one it takes."""
        return self.capturing and self.takes(x)

    def slot(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The slot the next all-reduce sums, as a tensor of ``shape``."""
        start = (self.calls % 2) * self.max_numel
        return self.buffer[start: start + math.prod(shape)].view(shape)

    def input_slot(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where a partial product of ``shape`` that the next sum takes is best written: its slot
        (a matmul that writes there spares the copy), while a graph is being captured and the
        product fits; else None."""
        return self.slot(shape) if self.capturing and self.fits(math.prod(shape), dtype) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in a new tensor: ``x`` in this rank's slot (copied there
        unless it was computed there), then one kernel: a barrier (every rank's part is in place),
        every rank's slot read and added up in rank order."""
        self._stage(x)
        out = self._sum(self.calls % 2, torch.empty_like(x))
        self.calls += 1
        return out

    def _stage(self, x: torch.Tensor) -> None:
        """``x`` in this rank's slot for the next sum, copied there unless it was computed there."""
        dst = self.slot(tuple(x.shape))
        if x.data_ptr() != dst.data_ptr():
            dst.copy_(x)

    def sum_add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(sum + residual) * weight, sum + residual), where sum is every rank's ``x``: the
        all-reduce and the RMSNorm after it in one kernel, ``x`` placed as :meth:`__call__` places it."""
        from pagoda_kernels.peer_sum import peer_sum_add_norm

        self._stage(x)
        out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        normed = peer_sum_add_norm(self.tables[self.calls % 2], self.pads, self.rank, residual.contiguous(), weight,
                                   eps, out, torch.empty_like(x), self.max_programs)
        self.calls += 1
        return normed

    def barrier(self) -> None:
        """Every rank here, none still reading a slot (the summing kernel with nothing to sum)."""
        self._sum(0, self.buffer[:0])

    def _sum(self, slot: int, out: torch.Tensor) -> torch.Tensor:
        from pagoda_kernels.peer_sum import peer_sum

        return peer_sum(self.tables[slot], self.pads, self.rank, out, self.max_programs)

    @contextmanager
    def graph_capture(self) -> Iterator[None]:
        """Around the capture of one CUDA graph. Graphs are replayed in any order, so each starts
        at slot 0 and leaves slot 0 free: where its last all-reduce used slot 0 (an odd count, as
        Llama-3-8B's 65: two in each of 32 layers and the embedding's), a barrier ends it."""
        self.capturing, self.calls = True, 0
        try:
            yield
        finally:
            if self.calls % 2:
                self.barrier()
            self.capturing, self.calls = False, 0


def max_bytes_for(ranks: int) -> int:
    return MAX_BYTES.get(ranks, DEFAULT_MAX_BYTES)


def create(group: Any, ranks: int, device: torch.device, dtype: torch.dtype,
           max_bytes: int | None = None) -> PeerAllReduce | None:
    """Every rank of ``group`` calls this together (it is collective). None, on every rank, where
    the path is not available: off the GPU, or where any rank cannot map the buffer. The ranks
    agree before the rendezvous (a rank that cannot take part would leave the others waiting in
    it) and after it."""
    if device.type != "cuda" or ranks < 2 or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    from pagoda_daemon.distributed.parallel_state import min_over_group  # it imports this module
    from pagoda_kernels.peer_sum import max_programs_for

    max_bytes = max_bytes or max_bytes_for(ranks)
    element_size = torch.empty((), dtype=dtype).element_size()
    numel = max_bytes // element_size
    buffer, peer = None, None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if group.group_name in symm_mem._group_name_to_store:
            # torch keeps the first store it was given for a group name for the life of the
            # process, and a new world's group reuses the name ("0"): the rendezvous would
            # wait on the old world's store. So an engine started after another in the same
            # process (tests; not `pagoda serve`) sums by NCCL.
            raise RuntimeError(f"symmetric memory was set up for a process group named {group.group_name!r} "
                               "earlier in this process")
        buffer = symm_mem.empty(2 * numel, dtype=dtype, device=device)
        with warnings.catch_warnings():  # required by torch 2.11, deprecated (and harmless) since
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
    except (RuntimeError, ImportError, AttributeError) as e:
        log.warning("all-reduce through the peers' memory unavailable on this rank (%s); NCCL sums every tensor", e)
    if not min_over_group(int(buffer is not None), group) or buffer is None:
        return None
    try:
        handle = symm_mem.rendezvous(buffer, group.group_name)
        bases = [handle.get_buffer(r, (2 * numel,), dtype).data_ptr() for r in range(ranks)]
        tables = torch.tensor([[base + s * numel * element_size for base in bases] for s in (0, 1)], dtype=torch.int64,
                              device=device)
        pads = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        pad = handle.get_signal_pad(handle.rank)  # zeroed by torch: no flag raised
        peer = PeerAllReduce(buffer, group.group_name, handle, tables, pads, handle.rank,
                             max_programs_for(ranks, pad.numel() * pad.element_size()))
    except (RuntimeError, AttributeError) as e:
        log.warning("all-reduce through the peers' memory: rendezvous failed on this rank (%s); NCCL sums every "
                    "tensor", e)
    if not min_over_group(int(peer is not None), group) or peer is None:
        return None
    log.info("all-reduce: tensors up to %d MiB summed from the peers' memory in CUDA graphs, the rest by NCCL",
             max_bytes >> 20)
    return peer


def sum_over(group: Any, x: torch.Tensor, peer: PeerAllReduce | None) -> torch.Tensor:
    """``x`` summed over ``group``: through the peers' memory where it fits and a CUDA graph is
    being captured under ``peer.graph_capture`` (the decode steps), else NCCL in place. Eager
    steps stay on NCCL: there the launches (copy, barrier, sum) cost the host more than NCCL's one."""
    if peer is not None and peer.sums_now(x):
        return peer(x)
    dist.all_reduce(x, group=group)
    return x
