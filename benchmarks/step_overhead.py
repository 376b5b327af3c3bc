"""CPU time the engine spends around the model each step: scheduling, input preparation,
sampling-batch construction and output bookkeeping, at N running requests.

Runs the real Scheduler, KVCacheManager and ModelRunner input preparation on a tiny
model without the forward pass, so the figure is the engine's Python overhead alone.

    python -m benchmarks.step_overhead --num-requests 256 --steps 200
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)

    from pagoda_daemon.config import EngineConfig
    from pagoda_daemon.engine.engine_core import EngineCore
    from pagoda_daemon.engine.request import Request
    from pagoda_daemon.models.tiny import build_tiny_model
    from pagoda_daemon.sampling_params import SamplingParams

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model("qwen3", tmp, max_position_embeddings=4096)
        budget = max(8192, args.num_requests)
        # Requests admitted early decode while later prompts prefill: leave room for those tokens too.
        max_new = args.steps + -(-args.num_requests * args.prompt_len // budget) + 8
        max_len = args.prompt_len + max_new + 1
        blocks_per_seq = -(-max_len // args.block_size)
        config = EngineConfig(
            model=str(path), device="cpu", block_size=args.block_size, max_num_seqs=args.num_requests,
            max_num_batched_tokens=budget, max_model_len=max_len,
            num_kv_blocks=blocks_per_seq * args.num_requests + 1,
        )
        core = EngineCore(config)
    sched, runner = core.scheduler, core.executor.worker.runner
    params = SamplingParams(temperature=args.temperature, max_tokens=max_new, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(args.num_requests):
        prompt = torch.randint(3, 500, (args.prompt_len,), generator=g).tolist()
        sched.add_request(Request(str(i), prompt, params, None, args.block_size))

    # Prefill everything (in budget-sized steps) without timing; then time decode steps.
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running) or sched.waiting:
        out = sched.schedule()
        runner._update_states(out)
        sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})

    timings = {"schedule": [], "prepare_inputs": [], "sampling_batch": [], "update": [], "total": []}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        runner._update_states(out)
        rows = runner.prepare_inputs(out).sample_rows
        t2 = time.perf_counter()
        runner._sampling_batch(out, rows)
        t3 = time.perf_counter()
        sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
        t4 = time.perf_counter()
        if len(out.scheduled) != args.num_requests:
            raise RuntimeError(f"expected {args.num_requests} decodes per step, got {len(out.scheduled)}")
        for k, v in zip(timings, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            timings[k].append(v * 1e6)

    result = {
        "num_running": args.num_requests,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "median_us": {k: round(statistics.median(v), 1) for k, v in timings.items()},
        "p90_us": {k: round(sorted(v)[int(0.9 * len(v))], 1) for k, v in timings.items()},
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
