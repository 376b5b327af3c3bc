"""The shapes eager steps run at on a GPU: token counts padded to a grid, warmed up at start-up.

cuBLAS pays host time the first time it meets a GEMM shape: 0.7-10.4 ms for the four GEMMs
of a Qwen3-0.6B layer at a new row count, 0.11-0.24 ms the second time (H100, 2026-11-22,
docs/benchmarks/2026-11-22-batch1-matmuls-and-final-figures-h100.md). Decode steps replay CUDA
graphs and never meet a new shape, but a step that carries a prompt (a prefill, or decodes
mixed with a prefill chunk) runs eagerly at "this prompt's length plus the running decodes"
rows: while serving, nearly every such step was a shape cuBLAS had not seen, and the stall
landed on the new request's first token and on every running request's next one.

So an eager step's token rows are padded up to the next size of a grid (``token_sizes``),
the rows that compute logits likewise (``lm_head_sizes``), and the worker runs every GEMM of
the model once at each size before serving (``warm_gemms``). The pad rows are token 0 at
position 0; they write no KV cache and attention leaves them zero (the model's Attention
passes the real rows only), and nothing reads their outputs.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
import torch.nn.functional as F

from pagoda_daemon.worker.cuda_graphs import capture_sizes

log = logging.getLogger(__name__)

# Up to this many rows a step is padded like a decode graph (1, 2, 4, 8, then multiples of 16);
# above, eight sizes per doubling: at most 1/8 of a step's GEMM rows are padding.
SMALL_STEP_TOKENS = 256


def token_sizes(max_tokens: int) -> list[int]:
    """The token counts eager steps are padded to, up to and including ``max_tokens`` (60 for
    8,192: about 1 s of GEMMs to warm on an H100 at Llama-3-8B's shapes)."""
    sizes = [s for s in capture_sizes(min(max_tokens, SMALL_STEP_TOKENS)) if s < max_tokens]
    size = SMALL_STEP_TOKENS
    while size < max_tokens:
        sizes.append(size)
        size += 1 << (size.bit_length() - 4)  # an eighth of the power of two below
    return sorted({*sizes, max_tokens})


def lm_head_sizes(max_seqs: int) -> list[int]:
    """The row counts the LM head runs at in an eager step (one row per sampling sequence)."""
    return capture_sizes(max_seqs)


def padded(sizes: list[int], n: int) -> int:
    """The smallest size of the grid that holds n rows (n itself past the grid's end)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else n


@torch.inference_mode()
def warm_gemms(model: torch.nn.Module, token_rows: list[int], lm_head_rows: list[int]) -> float:
    """Run each distinct GEMM of the model once at every size it may meet in an eager step
    (the LM head at ``lm_head_rows``, the others at ``token_rows``), so that cuBLAS has chosen
    its kernels before the first request. Calls ``F.linear`` on the weights directly: no
    collective runs, so ranks warm up independently. Returns the seconds it took."""
    from pagoda_daemon.distributed.parallel_state import TensorParallel
    from pagoda_daemon.models.layers import Linear

    started = time.perf_counter()
    lm_head = getattr(model, "lm_head", None)
    # data-parallel attention: a MoE router sees the rows of every engine (parallel_state.spread_tokens)
    gathered: dict[int, int] = {}
    for m in model.modules():
        tp, gate = getattr(m, "tp", None), getattr(m, "gate", None)
        if isinstance(gate, Linear) and isinstance(tp, TensorParallel) and tp.spread_tokens:
            gathered[id(gate)] = tp.size
    seen: set[tuple] = set()
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        weight, bias = module.weight, module.bias
        times = gathered.get(id(module), 1)
        key = (module is lm_head, tuple(weight.shape), weight.dtype, bias is not None, times)
        if key in seen:
            continue
        seen.add(key)
        rows = lm_head_rows if module is lm_head else [n * times for n in token_rows]
        x = torch.randn(max(rows), weight.shape[1], dtype=weight.dtype, device=weight.device)
        for n in rows:
            F.linear(x[:n], weight, bias)
    if torch.cuda.is_available() and any(p.is_cuda for p in model.parameters()):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    log.info("start-up: %d GEMM shapes warmed at %d token counts (eager steps are padded to them) in %.1f s",
             len(seen), len(token_rows), seconds)
    return seconds
