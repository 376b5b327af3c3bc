"""`pagoda bench throughput`: the requests `pagoda bench serve` would send, run through the offline
`LLM` instead (vLLM's `bench throughput`), so that one workload is measured offline and online
with the same prompts and lengths. Greedy, `ignore_eos`, each request's own output length, as
`bench serve` asks; the LLM is built and warmed up before the clock starts."""

from __future__ import annotations

import time
from collections.abc import Sequence

from pagoda_daemon.bench.datasets import BenchRequest


def run_offline(model: str, requests: Sequence[BenchRequest], engine_args: dict) -> dict:
    """Build an LLM on `model`, generate every request in one batch, and report its rates."""
    from pagoda_daemon import LLM, SamplingParams

    prompts = [r.prompt for r in requests if not r.turns and r.prompt is not None]
    if len(prompts) < len(requests):
        raise ValueError("multi-turn conversations need each answer before their next turn: use bench serve")
    started = time.perf_counter()
    llm = LLM(model, **engine_args)
    ready_s = time.perf_counter() - started
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    began = time.perf_counter()
    outputs = llm.generate(prompts, params)
    duration = time.perf_counter() - began
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "num_requests": len(requests), "duration_s": duration, "engine_ready_s": ready_s,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "request_throughput": len(requests) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
    }
