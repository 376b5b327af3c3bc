"""`pagoda bench serve` (one point) and `pagoda bench sweep` (a workload variable swept over
one or several servers, resumable, plotted): a serving benchmark for any OpenAI-compatible
endpoint — Pagoda, vLLM, SGLang — so that two servers are measured by the same client.
`pagoda bench throughput` runs the same requests through the offline LLM."""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

from pagoda_daemon.bench import datasets
from pagoda_daemon.bench.run import ENDPOINTS, POOLING_ENDPOINTS, PointConfig, run_point
from pagoda_daemon.bench.sweep import WORKLOAD_VARS, parse_values, plot, run_sweep


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be at least 0")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0 (inf for all at once)")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError("must be in [0, 1)")
    return value


def _delay(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError("must be a finite number ≥ 0")
    return value


def _slo(text: str) -> tuple[str, float]:
    name, _, ms = text.partition(":")
    value = float(ms) if ms else math.nan
    if name not in ("ttft", "tpot", "e2el") or not 0 < value < math.inf:
        raise argparse.ArgumentTypeError("an SLO is ttft:MS, tpot:MS or e2el:MS")
    return name, value


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="completions")
    p.add_argument("--api-key", default=None, help="sent as a bearer token")
    _add_dataset_args(p)
    p.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=_rate, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=_positive_int, default=None)
    p.add_argument("--goodput", type=_slo, action="append", default=[], metavar="NAME:MS",
                   help="an SLO for goodput (ttft, tpot, e2el in ms); repeatable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=_rate, default=600.0, help="seconds per request")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    """What the requests are (bench serve, sweep and throughput alike)."""
    p.add_argument("--dataset", choices=datasets.DATASETS, default="random")
    p.add_argument("--dataset-path", help="the JSONL file for --dataset jsonl")
    p.add_argument("--vocab-size", type=_positive_int, default=None,
                   help="token ids of random prompts are drawn below this (the model's vocabulary size)")
    p.add_argument("--num-prompts", type=_positive_int, default=200)
    p.add_argument("--input-len", type=_positive_int, default=1024)
    p.add_argument("--output-len", type=_positive_int, default=128)
    p.add_argument("--range-ratio", type=_ratio, default=0.0, help="lengths drawn in len·[1-r, 1+r]")
    p.add_argument("--num-prefixes", type=_positive_int, default=8, help="shared-prefix: distinct prefixes")
    p.add_argument("--prefix-len", type=_positive_int, default=512, help="shared-prefix: tokens per prefix")
    p.add_argument("--turns", type=_positive_int, default=4,
                   help="multi-turn: turns per conversation (chat: random words; completions: token ids on a "
                        "shared context of --prefix-len tokens, turns of --input-len, answers replayed)")
    p.add_argument("--document-len", type=_non_negative_int, default=0,
                   help="multi-turn on completions: tokens of each conversation's own document after the shared "
                        "context (a RAG document, an agent's tool outputs: prefixes no other conversation shares)")
    p.add_argument("--turn-delay", type=_delay, default=0.0,
                   help="multi-turn: seconds a user pauses between an answer and the next turn")
    p.add_argument("--decode-prompts-with", metavar="TOKENIZER_DIR", default=None,
                   help="random and shared-prefix prompts sent as text: their token ids decoded by this tokenizer "
                        "(the server's tokenizer is then measured too; the rerank endpoint needs it)")
    p.add_argument("--documents-per-query", type=_positive_int, default=16,
                   help="rerank: documents of --input-len tokens ranked in each request")
    p.add_argument("--query-len", type=_positive_int, default=32, help="rerank: tokens of each query")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="one benchmark point against one server")
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--result-file", type=Path, help="write the summary JSON here (also printed)")
    _add_workload_args(serve)
    sweep = sub.add_parser("sweep", help="sweep a workload variable over one or several servers")
    sweep.add_argument("--server", action="append", required=True, metavar="LABEL=URL",
                       help="a server to benchmark, e.g. pagoda=http://127.0.0.1:8000; repeatable")
    sweep.add_argument("--workload-var", required=True, choices=list(WORKLOAD_VARS))
    sweep.add_argument("--values", required=True, help="comma-separated values of the variable")
    sweep.add_argument("--iterations", type=_positive_int, default=1)
    sweep.add_argument("--experiment-name", required=True)
    sweep.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    sweep.add_argument("--resume", action="store_true", help="skip the points an earlier run finished")
    _add_workload_args(sweep)
    offline = sub.add_parser("throughput", help="the same requests through the offline LLM (no server)")
    offline.add_argument("model_dir", help="the model: a directory, hf://org/name or s3://bucket/prefix")
    offline.add_argument("--result-file", type=Path, help="write the summary JSON here (also printed)")
    _add_dataset_args(offline)
    from pagoda_daemon.cli import add_engine_args

    add_engine_args(offline)  # its --seed seeds the requests too, as bench serve's --seed does
    return parser


def make_requests(args: argparse.Namespace, overrides: dict, seed: int) -> list[datasets.BenchRequest]:
    requests = _requests({**vars(args), **overrides}, seed)
    if args.decode_prompts_with:
        requests = datasets.as_text(requests, _decoder(args.decode_prompts_with))
    return requests


@functools.cache
def _decoder(tokenizer_dir: str) -> Callable[[list[int]], str]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"--decode-prompts-with {tokenizer_dir!r}: {e}") from e

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, clean_up_tokenization_spaces=False))

    return decode


def _requests(a: dict, seed: int) -> list[datasets.BenchRequest]:
    if a["document_len"] and (a["dataset"] != "multi-turn" or a["endpoint"] != "completions"):
        raise ValueError("--document-len applies to --dataset multi-turn on --endpoint completions")
    if a["dataset"] == "multi-turn" and a["endpoint"] == "embeddings":
        raise ValueError("--endpoint embeddings sends one input per request: --dataset multi-turn has turns")
    if a["endpoint"] == "rerank":  # a query and its documents of random token ids, sent as text
        if a["dataset"] != "random" or not a["decode_prompts_with"] or a["vocab_size"] is None:
            raise ValueError("--endpoint rerank takes --dataset random with --vocab-size and --decode-prompts-with "
                             "(its queries and documents are sent as text)")
        return datasets.rerank_requests(a["num_prompts"], a["documents_per_query"], a["query_len"], a["input_len"],
                                        a["vocab_size"], range_ratio=a["range_ratio"], seed=seed)
    if a["dataset"] in ("random", "shared-prefix") and a["vocab_size"] is None:
        raise ValueError(f"--dataset {a['dataset']} needs --vocab-size (the model's vocabulary size)")
    if a["dataset"] == "random":
        return datasets.random_requests(a["num_prompts"], a["input_len"], a["output_len"], a["vocab_size"],
                                        range_ratio=a["range_ratio"], seed=seed)
    if a["dataset"] == "shared-prefix":
        return datasets.shared_prefix_requests(a["num_prompts"], a["num_prefixes"], a["prefix_len"], a["input_len"],
                                               a["output_len"], a["vocab_size"], range_ratio=a["range_ratio"],
                                               seed=seed)
    if a["dataset"] == "jsonl":
        if not a["dataset_path"]:
            raise ValueError("--dataset jsonl needs --dataset-path")
        return datasets.jsonl_requests(a["dataset_path"], a["num_prompts"], a["output_len"], seed=seed)
    if a["endpoint"] == "completions":  # token ids: a shared context of --prefix-len, turns of --input-len
        if a["vocab_size"] is None:
            raise ValueError("--dataset multi-turn on the completions endpoint needs --vocab-size")
        return datasets.conversation_requests(a["num_prompts"], a["turns"], a["prefix_len"], a["input_len"],
                                              a["output_len"], a["output_len"], a["vocab_size"],
                                              document_len=a["document_len"], seed=seed)
    return datasets.multi_turn_requests(a["num_prompts"], a["turns"], max(1, a["input_len"] // 4), a["output_len"],
                                        seed=seed)


def _config(args: argparse.Namespace, base_url: str) -> PointConfig:
    return PointConfig(base_url=base_url.rstrip("/"), model=args.model, endpoint=args.endpoint, api_key=args.api_key,
                       request_rate=args.request_rate, burstiness=args.burstiness,
                       max_concurrency=args.max_concurrency, turn_delay_s=args.turn_delay, timeout_s=args.timeout, seed=args.seed,
                       goodput_slo_ms=dict(args.goodput))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "throughput":
            from pagoda_daemon.bench.offline import run_offline
            from pagoda_daemon.cli import engine_kwargs

            # the endpoint only shapes multi-turn requests, which run_offline refuses
            requests = make_requests(args, {"endpoint": "completions"}, args.seed)
            _report(run_offline(args.model_dir, requests, engine_kwargs(args)), args.result_file)
            return 0
        if args.command == "serve":
            result = run_point(_config(args, args.base_url), make_requests(args, {}, args.seed),
                               progress=not args.no_progress)
            _report(result, args.result_file)
            return 0 if result["completed"] else 1
        servers = []
        for entry in args.server:
            label, eq, url = entry.partition("=")
            if not eq or not url.startswith(("http://", "https://")):
                raise ValueError(f"--server {entry!r}: LABEL=http(s)://host:port")
            servers.append((label, _config(args, url)))
        values = parse_values(args.workload_var, args.values)
        points = run_sweep(servers, args.workload_var, values, args.iterations,
                           lambda overrides, seed: make_requests(args, overrides, seed), args.output_dir,
                           args.experiment_name, resume=args.resume, progress=not args.no_progress,
                           log=lambda line: print(line, file=sys.stderr))
        base = args.output_dir / args.experiment_name / (
            "throughput_vs_latency" if args.endpoint in POOLING_ENDPOINTS else "throughput_vs_ttft")
        for path in plot(points, base, title=f"{args.experiment_name}: {args.workload_var} swept"):
            print(path)
        return 0
    except (ValueError, FileExistsError) as e:
        print(f"pagoda bench: {e}", file=sys.stderr)
        return 2


def _report(result: dict, path: Path | None) -> None:
    """Print the summary JSON, and write it to `path` when one was given."""
    text = json.dumps(result, indent=1)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
