"""Greedy answers of one server to fixed token-id prompts, one request at a time, as JSON: run it
against the prefill/decode proxy and against a single instance, then `--compare` the two files
(issue #19: disaggregated outputs identical to a single instance's).

    python -m benchmarks.pd_parity --url http://127.0.0.1:18000 --out a.json [--prompts 16]
    python -m benchmarks.pd_parity --compare a.json b.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import httpx


def answers(url: str, model: str, num_prompts: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    with httpx.Client(timeout=300) as client:
        for _ in range(num_prompts):
            prompt = [rng.randrange(10, vocab_size) for _ in range(rng.randrange(1000, 3000))]
            body = {"model": model, "prompt": prompt, "max_tokens": 64, "temperature": 0.0, "ignore_eos": True,
                    "logprobs": 0, "return_tokens_as_token_ids": True}  # the answer's ids: "token_id:N"
            r = client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            out.append(r.json()["choices"][0]["logprobs"]["tokens"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--model", default="m")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--vocab-size", type=int, default=151936)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", nargs=2, type=Path)
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        same = sum(x == y for x, y in zip(a, b, strict=True))
        print(f"PD_PARITY {same}/{len(a)} answers identical")
        return 0 if same == len(a) else 1
    result = answers(args.url, args.model, args.prompts, args.vocab_size, args.seed)
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
