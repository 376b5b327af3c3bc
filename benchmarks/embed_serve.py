"""Embeddings through a server's ``/v1/embeddings`` (Pagoda's or vLLM's), as clients send them:
requests of ``--batch`` inputs each (the short workload of embed_bench.py: random token ids, 16–256
tokens), ``--concurrency`` in flight at a time, base64 replies (the openai client's default):

    python -m benchmarks.embed_serve --url http://127.0.0.1:18000 --model m --concurrency 64 --batch 1

Each round sends prompts of its own (none comes from the prefix cache); a ROUND line per round and
a RESULT line (the last) report requests/s, inputs/s, tokens/s and latency percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from benchmarks.embed_bench import prompts_of


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def one_round(url: str, model: str, prompts: list[list[int]], concurrency: int, batch: int) -> dict:
    import httpx

    latencies: list[float] = []
    failures = 0
    starts = iter(range(0, len(prompts), batch))
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def worker() -> None:
            nonlocal failures
            for start in starts:  # one iterator shared by the workers: each request is sent once
                body = {"model": model, "input": prompts[start : start + batch], "encoding_format": "base64"}
                sent = time.perf_counter()
                reply = await client.post(url + "/v1/embeddings", json=body)
                if reply.status_code != 200 or len(reply.json()["data"]) != len(body["input"]):
                    if not failures:
                        print("first failure:", reply.status_code, reply.text[:300], file=sys.stderr)
                    failures += 1
                latencies.append(time.perf_counter() - sent)

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - began
    tokens = sum(map(len, prompts))
    return {"seconds": round(seconds, 3), "requests": len(latencies), "failures": failures,
            "requests_s": round(len(latencies) / seconds, 1), "inputs_s": round(len(prompts) / seconds, 1),
            "prompt_tok_s": round(tokens / seconds, 1), "p50_ms": round(1e3 * percentile(latencies, 0.5), 2),
            "p99_ms": round(1e3 * percentile(latencies, 0.99), 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--server", default="", help="a label for the rows (pagoda, vllm)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="inputs per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab-size", type=int, default=10001, help="token ids below this (a smaller model's)")
    ap.add_argument("--inputs", type=int, default=0, help="the first N inputs of each round (0: all 4,096)")
    args = ap.parse_args(argv)
    result: dict = {}
    for round_index, prompts in enumerate(prompts_of("short", args.rounds, args.vocab_size)):
        prompts = prompts[: args.inputs] if args.inputs else prompts
        result = {"server": args.server, "concurrency": args.concurrency, "batch": args.batch, "round": round_index,
                  **asyncio.run(one_round(args.url, args.model, prompts, args.concurrency, args.batch))}
        print("ROUND", json.dumps(result), flush=True)
    print("RESULT", json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
