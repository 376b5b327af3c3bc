"""A long-lived process's start-up heap, kept out of the garbage collector's way."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (modules, the model or the tokenizer,
    configs: they live as long as the process) out of the collector's reach, so that full
    collections scan only what serving allocates. vLLM's engine core and API server do the same
    after start-up. Measured: on an H100, one full collection over the engine core's un-frozen
    heap stalled a serving step for 200 ms (docs/benchmarks/2026-11-21-run-variance-and-vllm-pairs-h100.md);
    in the API process (256,000 tracked objects, 400 streams at once on the 2-core development
    VM, 2026-11-27) three full collections took 741-761 ms, the longest 272-292 ms, against
    212-224 ms and 87-99 ms frozen (docs/benchmarks/2026-11-27-serving-admission-h100.md)."""
    gc.collect()
    gc.freeze()
