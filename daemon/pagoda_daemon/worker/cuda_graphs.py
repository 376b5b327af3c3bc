"""CUDA graphs for decode-only steps: one graph per padded batch size, captured at start-up.

A decode step of B sequences launches hundreds of small kernels; replaying a captured
graph launches them all at once, which is what makes small models fast (the CPU no
longer paces the GPU). A step of B sequences replays the graph of the smallest captured
size >= B. The graphs read their inputs from the runner's StagingBuffers device tensors,
the same storage every step, so a replay costs nothing beyond the usual host-to-device
copies. Rows past B are padding: cache slot -1 (the cache-write kernel skips it), context
length 1, token 0; their outputs are never read.

The graph ends with the logits of every row. Outside a graph the LM head would be a cuBLAS
call whose row count changes whenever a sequence finishes, and cuBLAS pays 0.2-10 ms of host
time the first time it sees a shape (H100, 2026-11-22: docs/benchmarks/2026-11-22-batch1-matmuls-and-final-figures-h100.md);
inside, that cost is paid once per size, at capture, and the step launches nothing more.

What must hold for a graph to be valid at replay (checked in tests/gpu):
- every shape in the forward pass depends on the padded batch size only (the Triton
  backend's decode path: `uses_kernels`; its work plan is computed on the device inside
  the graph, from the replayed step's context lengths);
- the inputs live at the same addresses at capture and replay (StagingBuffers);
- the KV cache is allocated before capture and never reallocated.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from pagoda_daemon.attention.backend import AttentionMetadata

log = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to the maximum (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sorted({*sizes, max_batch_size})


class CudaGraphRunner:
    def __init__(self, model, buffers, max_batch_size: int, max_seq_len: int, device: torch.device,
                 graph_capture: Callable[[], AbstractContextManager[None]] = nullcontext) -> None:
        self.model = model
        self.graph_capture = graph_capture  # entered around each capture (TensorParallel.graph_capture)
        self.buffers = buffers
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.num_replays = 0
        self.input_addresses: dict[str, int] = {}  # where the graphs read their inputs (tests check)

    def padded_size(self, num_seqs: int) -> int | None:
        """The graph size a decode step of num_seqs sequences replays, or None (run eagerly)."""
        if not self.graphs or num_seqs > self.max_batch_size:
            return None
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def metadata(self, size: int) -> AttentionMetadata:
        """Decode metadata over the first `size` rows of the staging buffers (device side)."""
        b = self.buffers
        return AttentionMetadata(
            slot_mapping=b.slot_mapping.device[:size],
            query_start_loc=b.query_start_loc.device[: size + 1],
            seq_lens=b.seq_lens.device[:size],
            block_tables=b.block_tables.device[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,  # host copies only feed shape decisions, which depend on size alone
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            is_prefill_only=False,
        )

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture one graph per size, largest first so that smaller ones reuse its memory pool."""
        start = time.perf_counter()
        b = self.buffers
        n = self.max_batch_size
        # Padding rows everywhere: no cache writes, a context of one token.
        b.input_ids.np[:n] = 0
        b.positions.np[:n] = 0
        b.slot_mapping.np[:n] = -1
        b.seq_lens.np[:n] = 1
        b.query_start_loc.np[: n + 1] = range(n + 1)
        for buf in (b.input_ids, b.positions, b.slot_mapping, b.seq_lens):
            buf.to_device(n)
        b.query_start_loc.to_device(n + 1)
        b.block_tables.device.zero_()
        self.input_addresses = self.current_input_addresses()
        pool = None
        for size in reversed(self.sizes):
            inputs = (b.input_ids.device[:size], b.positions.device[:size], kv_caches)
            # compiles this size's kernels (and picks its cuBLAS kernels) outside the capture
            self.model.compute_logits(self.model(*inputs, self.metadata(size)))
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), self.graph_capture():
                # fresh metadata: the per-step work the backend keeps in it must be captured
                self.outputs[size] = self.model.compute_logits(self.model(*inputs, self.metadata(size)))
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d CUDA graphs for decode batches of %d..%d sequences in %.1f s",
                 len(self.graphs), self.sizes[0], self.sizes[-1], self.capture_seconds)

    def release(self) -> None:
        """Free every graph (and with the last one their memory pool). Graphs that captured NCCL
        collectives must be gone before the process group is destroyed: destroy waits on them
        forever otherwise (PyTorch issue 115388; seen on 2 × H200, 2026-11-26)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def current_input_addresses(self) -> dict[str, int]:
        b = self.buffers
        names = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")
        return {name: getattr(b, name).device.data_ptr() for name in names}

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` and return its logits [size, vocab]; the inputs must already
        sit in the staging buffers."""
        self.num_replays += 1
        self.graphs[size].replay()
        return self.outputs[size]
