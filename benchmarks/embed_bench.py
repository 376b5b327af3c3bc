"""Embedding throughput: every prompt of a workload pooled into one vector, all submitted at
once, through Pagoda's engine core (``runner pooling``, last-token pooling, unit length), on a
random-weight model:

    python -m benchmarks.embed_bench benchmarks/configs/qwen3-0.6b --workloads short,long

``benchmarks/vllm_embed.py`` runs the same workloads through vLLM's ``LLM.embed``. Each workload
runs ``--rounds`` times on one engine, each time on prompts of its own (nothing comes from the
prefix cache); a ROUND line per run and a RESULT line (the last run) per workload report
prompts/s and prompt tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.throughput import start_core, sync, token_workload

# name -> (prompts, shortest, longest): search queries and passages, whole documents, and
# passages up to the 512 tokens a BERT-family encoder holds
WORKLOADS = {"short": (4096, 16, 256), "long": (512, 1024, 4096), "passages": (2048, 256, 512)}


def add_embed_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model", help="a directory with config.json (weights are random)")
    ap.add_argument("--workloads", default="short,long", help=f"comma-separated, of {sorted(WORKLOADS)}")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each workload, each with prompts of its own")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    # explicit on both sides: vLLM's "auto" turns a float32 checkpoint (BERT's) into float16
    ap.add_argument("--dtype", default="bfloat16")


def prompts_of(name: str, rounds: int, vocab_size: int = 10001) -> list[list[list[int]]]:
    """The workload's prompts for each round, a fresh set each time (the same for every engine): a
    round never reads an earlier round's prompts from the prefix cache."""
    count, low, high = WORKLOADS[name]
    prompts = token_workload(count * rounds, low, high, 1, 1, vocab_size)[0]
    return [prompts[r * count : (r + 1) * count] for r in range(rounds)]


def time_rounds(engine: str, name: str, rounds: list[list[list[int]]], embed, **extra) -> None:
    """Run ``embed(prompts)`` (all of one round's prompts at once; returns how many vectors came
    back) for each round: a ROUND line for each, a RESULT line for the last."""
    result: dict = {}
    for round_index, prompts in enumerate(rounds):
        tokens = sum(map(len, prompts))
        sync()
        start = time.perf_counter()
        vectors = embed(prompts)
        sync()
        seconds = time.perf_counter() - start
        result = {"engine": engine, "workload": name, "round": round_index, "seconds": round(seconds, 3),
                  "prompts": len(prompts), "vectors": vectors, "prompt_tokens": tokens,
                  "prompts_s": round(len(prompts) / seconds, 1), "prompt_tok_s": round(tokens / seconds, 1), **extra}
        print("ROUND", json.dumps(result), flush=True)
    print("RESULT", json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    from pagoda_daemon.engine.request import Request
    from pagoda_daemon.pooling import NOTHING_SAMPLED

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_embed_args(ap)
    ap.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    core = start_core(args, runner="pooling")
    init_s = time.perf_counter() - started
    assert core.pooling is not None
    params = core.pooling.params()
    batches = iter(range(1 << 30))

    def embed(prompts: list[list[int]]) -> int:
        batch = next(batches)
        for i, p in enumerate(prompts):
            core.add_request(Request(f"{batch}-{i}", p, NOTHING_SAMPLED, None, core.config.block_size,
                                     pooling=params))
        vectors = 0
        while core.has_unfinished_requests():
            vectors += sum(o.pooled is not None for o in core.step())
        return vectors

    for name in args.workloads.split(","):
        rounds = prompts_of(name, args.rounds, core.model_config.vocab_size)
        time_rounds("pagoda", name, rounds, embed, init_s=round(init_s, 1), model=os.path.basename(args.model), dtype=args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
