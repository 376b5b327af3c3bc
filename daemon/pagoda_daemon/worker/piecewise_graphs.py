"""CUDA graphs for the steps that carry prompts: everything but attention, per token count.

A step with a prompt in it (a prefill, or decodes mixed with a prefill chunk) cannot replay a
decode graph: its attention's launch shapes follow the step's sequences. Run eagerly, the host
paces it: a 562-token prompt joining 4 decodes of the Qwen3-0.6B shape took 24.7 ms of host time
in the forward passes until its first token, 16.0 ms of it Python around 343 Triton launches,
for a few ms of GPU work (H100, 2026-11-27, docs/benchmarks/2026-11-27-serving-ttft-h100.md).

So, as vLLM's piecewise graphs do, each step of up to ``max_tokens`` tokens (padded to the token
grid, step_shapes.py) replays one graph per piece between two attentions: the embedding and layer
0's norm and projections; then, per layer boundary, the previous layer's output projection,
norm and MLP and the next layer's norm and projections; and last the final norm. Attention runs
eagerly between them, on the step's own rows. The pieces hand each other their tensors through
static buffers (q, k, v, the attention output, the residual stream, the final hidden states),
the same storage for every size, so that a piece's intermediates die with it and every size's
graphs share one memory pool.

Under tensor or expert parallelism the pieces hold the ranks' sums (the row-parallel projections,
the MoE layers); every rank captures and replays the same pieces in the same order, and each
piece's capture is wrapped in the group's ``graph_capture`` as a decode graph's is (the peer
all-reduce's slots start each graph at slot 0 and leave it free).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

log = logging.getLogger(__name__)


class PiecewiseGraphRunner:
    def __init__(self, model, buffers, sizes: list[int], device: torch.device,
                 graph_capture: Callable[[], AbstractContextManager[None]] = nullcontext) -> None:
        self.body = model.model  # DecoderModel (or an encoder's body): embed, layers, finish
        self.takes_token_types = getattr(model, "takes_token_types", False)
        self.layers = list(self.body.layers)
        self.buffers = buffers
        self.sizes = sizes
        self.max_tokens = sizes[-1]
        self.device = device
        self.graph_capture = graph_capture
        attn = self.layers[0].self_attn
        hidden = self.body.hidden_size
        dtype = next(self.body.parameters()).dtype  # the token embedding's: the activations'
        t = self.max_tokens

        def static(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.q = static(t, attn.num_heads, attn.head_dim)
        self.k = static(t, attn.num_kv_heads, attn.head_dim)
        self.v = static(t, attn.num_kv_heads, attn.head_dim)
        self.o = static(t, attn.num_heads, attn.head_dim)
        self.residual = static(t, hidden)
        self.hidden = static(t, hidden)
        self.kv_caches: list = []  # the layers' caches: the pieces write each step's K/V into them
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.covered: set[int] = set()  # the sizes steps run piece by piece: captured ones (or all, run_eagerly)
        self.capture_seconds = 0.0

    def covers(self, num_tokens: int) -> bool:
        """Whether a step padded to ``num_tokens`` rows runs piece by piece (else as one eager pass)."""
        return num_tokens in self.covered

    def replays(self, num_tokens: int) -> bool:
        """Whether a step padded to ``num_tokens`` rows replays captured pieces (not run eagerly)."""
        return num_tokens in self.graphs

    def run_eagerly(self) -> None:
        """Every size piece by piece without graphs: the same buffers and order a GPU replays,
        where no graph can be captured (the CPU tests)."""
        self.covered = set(self.sizes)

    @torch.inference_mode()
    def piece(self, index: int, size: int) -> None:
        """Piece ``index`` (0 .. number of layers) of a step of ``size`` rows, from and into the
        static buffers: what a graph captures, and what a step runs when there is no graph."""
        b = self.buffers
        positions = b.positions.device[:size]
        if index == 0:
            types = {"token_types": b.token_types.device[:size]} if self.takes_token_types else {}
            hidden, residual = self.body.embed(b.input_ids.device[:size], positions, **types), None
        else:
            hidden, residual = self.layers[index - 1].after_attention(self.o[:size], self.residual[:size])
        if index == len(self.layers):
            self.hidden[:size].copy_(self.body.finish(hidden, residual))
            return
        layer = self.layers[index]
        q, k, v, residual = layer.before_attention(positions, hidden, residual)
        # the step's K/V into the cache here, inside the graph (pad rows have slot -1): one eager
        # launch a layer fewer between the pieces (the attention is told: meta.kv_written)
        layer.self_attn.attn.write_kv(k, v, self.kv_caches[index], b.slot_mapping.device[:size])
        self.q[:size].copy_(q)
        self.k[:size].copy_(k)
        self.v[:size].copy_(v)
        self.residual[:size].copy_(residual)

    def run(self, size: int, meta, kv_caches: list) -> torch.Tensor:
        """A step of ``size`` (padded) rows whose inputs sit in the staging buffers: the graphs of
        that size (or the pieces run eagerly, without them), attention between; the final hidden
        states [size, hidden]."""
        graphs = self.graphs.get(size)
        self.kv_caches = kv_caches
        meta.kv_written = True
        n = meta.num_tokens
        if n < size:
            self.o[n:size].zero_()  # the pad rows' attention output: nothing, as in an eager step
        for index, layer in enumerate(self.layers):
            self._piece(graphs, index, size)
            if meta.wait_for_kv_layer is not None:  # this layer's offloaded KV may still be crossing
                meta.wait_for_kv_layer(index)
            layer.self_attn.attend(self.q[:size], self.k[:size], self.v[:size], kv_caches[index], meta,
                                   out=self.o[:size])
        self._piece(graphs, len(self.layers), size)
        return self.hidden[:size]

    def _piece(self, graphs: list[torch.cuda.CUDAGraph] | None, index: int, size: int) -> None:
        if graphs is None:
            self.piece(index, size)
        else:
            graphs[index].replay()

    @torch.inference_mode()
    def capture(self, kv_caches: list) -> None:
        """Every piece at every size, largest size first, into one memory pool (the pieces'
        intermediates die at each piece's end, so sizes reuse it). The pieces write K/V into
        ``kv_caches``, which must stay where they are while the graphs live."""
        start = time.perf_counter()
        self.kv_caches = kv_caches
        slots = self.buffers.slot_mapping
        slots.np[: self.max_tokens] = -1  # the capture's own passes write nothing into the cache
        slots.to_device(self.max_tokens)
        pool = None
        for size in reversed(self.sizes):
            for index in range(len(self.layers) + 1):  # compiles kernels and picks cuBLAS's outside the capture
                self.piece(index, size)
            torch.cuda.synchronize(self.device)
            graphs = []
            for index in range(len(self.layers) + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool), self.graph_capture():
                    self.piece(index, size)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[size] = graphs
            self.covered.add(size)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        log.info("captured piecewise CUDA graphs for steps of up to %d tokens: %d sizes x %d pieces in %.1f s",
                 self.max_tokens, len(self.sizes), len(self.layers) + 1, self.capture_seconds)

    def release(self) -> None:
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.reset()
        self.graphs.clear()
        self.covered.clear()
