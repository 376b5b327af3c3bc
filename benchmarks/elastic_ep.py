"""Elastic expert parallelism under the nano-vllm workload (issue #18's GPU measurement).

    python -m benchmarks.elastic_ep MODEL_DIR --start 2 --grow-to 4

On one engine, random weights: the workload at the start size, a resize to the larger size while
idle, the workload there, a resize back while idle, then the workload once more with the replica
grown under load (a quarter into the start size's run time) and shrunk a few seconds later.
Reports each transition's time and its parts (`ElasticStats.last_seconds_by_part`), the bytes of experts moved, the
throughput at each size, and for the run under load: tokens per second in one-second buckets,
the pause each transition put into serving, and the run's time against the start size's.

Prints one JSON line prefixed RESULT.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.throughput import add_engine_args, run_requests, start_core, sync, workload


def build_core(args):
    return start_core(args, expert_parallel_size=args.start, enable_eplb=True,
                      elastic_ep_min_size=min(args.start, args.grow_to), elastic_ep_max_size=max(args.start, args.grow_to),
                      **({"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}))


def resize(core, size: int) -> tuple[dict, int]:
    """Resize between steps; returns the transition's record and the tokens of the step it
    collected first."""
    moved_before = core.elastic.bytes_moved  # a counter the stats path resets; only this resize's bytes
    t = time.perf_counter()
    outputs = core.resize_experts(size)
    wall = time.perf_counter() - t
    e = core.elastic
    record = {"to": size, "outcome": e.phase, "size": e.size, "seconds": e.last_seconds, "wall_s": round(wall, 3),
              "by_part": e.last_seconds_by_part, "mib_moved": round((e.bytes_moved - moved_before) / 2**20, 1),
              "error": e.last_error}
    return record, sum(len(o.new_token_ids) for o in outputs)


def fixed_run(core, prompts, params, tag: str) -> dict:
    sync()
    t = time.perf_counter()
    generated, steps = run_requests(core, prompts, params, tag)
    sync()
    elapsed = time.perf_counter() - t
    core.kv_cache.reset_prefix_cache()
    return {"size": core.elastic.size, "time_s": round(elapsed, 3), "output_tok_per_s": round(generated / elapsed, 1),
            "output_tokens_generated": generated, "steps": len(steps)}


def run_under_load(core, prompts, params, grow_at_s: float, grow_to: int, hold_s: float) -> dict:
    """The workload, grown to `grow_to` at `grow_at_s` seconds into the run and shrunk back
    `hold_s` seconds after the growth ended: tokens by second, each transition's record and the
    serving rate around it."""
    from pagoda_daemon.engine.request import Request

    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(Request(f"elastic-{i}", p, sp, None, core.config.block_size))
    start = core.elastic.size
    pending = [(grow_at_s, grow_to)]
    events: list[tuple[float, int]] = []  # (seconds into the run, tokens)
    transitions = []
    sync()
    t0 = time.perf_counter()
    while core.has_unfinished_requests():
        now = time.perf_counter() - t0
        if pending and now >= pending[0][0]:
            _, size = pending.pop(0)
            record, tokens = resize(core, size)
            if size == grow_to:
                pending.append((time.perf_counter() - t0 + hold_s, start))
            record["at_s"] = round(now, 3)
            record["running_requests"] = len(core.scheduler.running)
            transitions.append(record)
            events.append((time.perf_counter() - t0, tokens))
        tokens = sum(len(o.new_token_ids) for o in core.step())
        events.append((time.perf_counter() - t0, tokens))
    sync()
    elapsed = time.perf_counter() - t0
    core.kv_cache.reset_prefix_cache()
    generated = sum(n for _, n in events)
    buckets = [0] * (int(elapsed) + 1)
    for t, n in events:
        buckets[int(t)] += n
    for record in transitions:  # tokens per second in the 3 s before and after the transition
        start, end = record["at_s"], record["at_s"] + record["wall_s"]
        before = sum(n for t, n in events if start - 3 <= t < start) / 3
        after = sum(n for t, n in events if end + 0.5 <= t < end + 3.5) / 3
        record["tok_per_s_3s_before"], record["tok_per_s_3s_after"] = round(before, 1), round(after, 1)
        record["tokens_forgone"] = round(before * record["wall_s"], 0)  # what the pause cost at the old rate
    return {"time_s": round(elapsed, 3), "output_tok_per_s": round(generated / elapsed, 1),
            "output_tokens_generated": generated, "transitions": transitions, "tokens_by_second": buckets,
            "leak_free": core.kv_cache.num_free_blocks == core.kv_cache.num_blocks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--start", type=int, default=2, help="the expert-parallel size the replica starts at")
    ap.add_argument("--grow-to", type=int, default=4, help="the size it is resized to and back from")
    ap.add_argument("--grow-at", type=float, default=0.25,
                    help="when to grow in the run under load, as a fraction of the start size's run time")
    ap.add_argument("--hold-s", type=float, default=5.0, help="how long the run under load serves grown")
    ap.add_argument("--settle-s", type=float, default=15.0,
                    help="idle before the run under load: the spare processes that replace the ranks a shrink let go "
                         "need about 9 s to come up (4 x H200)")
    ap.add_argument("--num-kv-blocks", type=int, default=0, help="0: profile the GPU's memory")
    args = ap.parse_args(argv)
    from pagoda_daemon.logs import configure

    configure("INFO", "rank-0")  # rank 0's transition lines beside the other ranks'
    t0 = time.perf_counter()
    core = build_core(args)
    init_s = time.perf_counter() - t0
    try:
        prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len, args.temperature,
                                   core.model_config.vocab_size)
        at_start = fixed_run(core, prompts, params, "start")
        grow_idle, _ = resize(core, args.grow_to)
        grown = fixed_run(core, prompts, params, "grown")
        shrink_idle, _ = resize(core, args.start)
        time.sleep(args.settle_s)
        loaded = run_under_load(core, prompts, params, args.grow_at * at_start["time_s"], args.grow_to, args.hold_s)
        result = {
            "bench": "elastic-ep", "model": args.model, "num_seqs": args.num_seqs,
            "prompt_tokens": sum(map(len, prompts)), "init_s": round(init_s, 1), "kv_blocks": core.kv_cache.num_blocks,
            "at_start": at_start, "grow_idle": grow_idle, "grown": grown, "shrink_idle": shrink_idle,
            "under_load": loaded,
            "under_load_over_start": round(loaded["time_s"] / at_start["time_s"], 4),
            "grown_over_start": round(grown["output_tok_per_s"] / at_start["output_tok_per_s"], 4),
        }
    finally:
        core.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
