"""KV offload on a multi-turn workload whose conversations outgrow the GPU's KV cache (issue #19):
`pagoda serve` once per configuration — offload off, host memory, disk, both (host memory
written through; cpu-wb and both-wb write it back) — each driven by
the same `pagoda bench` conversations (token ids on a long shared context, every turn re-reading
the conversation so far), reporting TTFT p50/p99, throughput and the offload counters.

    python -m benchmarks.kv_offload MODEL_DIR [--tokenizer DIR] [--load-format dummy] \\
        [--num-kv-blocks N] [--conversations 100] [--turns 10] [--shared-len 2000] [--document-len 0] \\
        [--max-concurrency N | --conversation-rate R --turn-delay S] \\
        [--configs off,cpu,disk,both] [--cpu-gib 16] [--disk-gib 64] [--out results.jsonl]

MODEL_DIR may be a config-only directory (benchmarks/configs/...) with `--load-format dummy` and
a tokenizer from `python -m benchmarks.synthetic_tokenizer`. `--num-kv-blocks` makes the GPU
cache small enough that prefixes must come back from the tiers (the goal: TTFT p50 ≥ 3× lower
with host-memory offload than with recompute); without it, the cache is sized as in production
(the goal there: ≤ 2% throughput lost). One RESULT line of JSON per configuration.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagoda_daemon.bench.datasets import conversation_requests
from pagoda_daemon.bench.run import PointConfig, run_point
from pagoda_daemon.demo import free_port, wait_ready

OFFLOAD_METRICS = ("vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total",
                   "vllm:prefix_cache_hits_total", "pagoda:kv_offload_loaded_bytes_total",
                   "pagoda:kv_offload_saved_bytes_total", "pagoda:kv_offload_transfer_seconds_total",
                   "pagoda:kv_offload_failed_loads_total")


# -wb: host memory written back; cpu and both write it through (as before the option existed)
CONFIGS = ("off", "cpu", "cpu-wb", "disk", "both", "both-wb")


def offload_flags(config: str, cpu_gib: float, disk_gib: float, disk_dir: str) -> list[str]:
    if config not in CONFIGS:
        raise ValueError(f"--configs: {config!r} is not one of {', '.join(CONFIGS)}")
    flags = []
    if config in ("cpu", "both"):
        flags += ["--kv-offload-write-policy", "write-through"]
    if config.endswith("-wb"):
        flags += ["--kv-offload-write-policy", "write-back"]
        config = config.removesuffix("-wb")
    if config in ("cpu", "both"):
        flags += ["--kv-offload-cpu-gib", str(cpu_gib)]
    if config in ("disk", "both"):
        flags += ["--kv-offload-disk-path", disk_dir, "--kv-offload-disk-gib", str(disk_gib)]
    return flags


# Where a turn's TTFT goes, as the server measures it: the API process reading, parsing and
# checking it (admission), waiting for its first step (a free KV block, a step boundary), then
# from that step to its first token (loads and prefill); ttft is the engine's, after admission.
PHASE_HISTOGRAMS = {"admission": "pagoda:request_admission_seconds", "queue": "vllm:request_queue_time_seconds",
                    "prefill": "vllm:request_prefill_time_seconds", "ttft": "vllm:time_to_first_token_seconds"}


def engine_phases_ms(text: str) -> dict[str, float]:
    """The mean of each PHASE_HISTOGRAMS histogram over the run, in ms, from its _sum and _count."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in PHASE_HISTOGRAMS.values():
            sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return {phase: round(1000 * sums[f"{h}_sum"] / sums[f"{h}_count"], 3)
            for phase, h in PHASE_HISTOGRAMS.items() if sums.get(f"{h}_count")}


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for phase, ms in engine_phases_ms(text).items():
        out[f"mean_{phase}_ms"] = ms
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in OFFLOAD_METRICS:
            medium = line.split('medium="', 1)[1].split('"', 1)[0] if 'medium="' in line else ""
            key = f"{name}[{medium}]" if medium else name
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def serve(model: str, extra: list[str], log_path: Path, ready_timeout_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagoda_daemon", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "bench", *extra]
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, ready_timeout_s)
    except (RuntimeError, TimeoutError) as e:
        proc.kill()
        raise type(e)(f"pagoda serve: {e}: {log_path.read_text()[-2000:]}") from None
    return proc, url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokenizer")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-kv-blocks", type=int)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--conversations", type=int, default=100)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--shared-len", type=int, default=2000, help="tokens of the context every conversation shares")
    ap.add_argument("--document-len", type=int, default=0,
                    help="tokens of each conversation's own document after the shared context (prefixes no other "
                         "conversation shares, which the GPU cache cannot keep for all)")
    ap.add_argument("--turn-len", type=int, default=200, help="tokens of each user turn")
    ap.add_argument("--output-len", type=int, default=100, help="tokens of each answer (also replayed as history)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="conversations in flight (default: all)")
    ap.add_argument("--turn-delay", type=float, default=1.0,
                    help="seconds a user pauses between turns (other conversations run meanwhile)")
    ap.add_argument("--conversation-rate", type=float, default=math.inf,
                    help="conversations starting per second (Poisson; default: all at once)")
    ap.add_argument("--configs", default="off,cpu,disk,both")
    ap.add_argument("--cpu-gib", type=float, default=16.0)
    ap.add_argument("--disk-gib", type=float, default=64.0)
    ap.add_argument("--disk-dir", help="the disk tier's parent directory (default: a temporary one)")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--extra", default="", help="more `pagoda serve` flags, space-separated")
    ap.add_argument("--out", type=Path, help="append the RESULT lines here too")
    ap.add_argument("--label", default="", help="names the tree or variant in the RESULT lines")
    args = ap.parse_args(argv)
    if args.document_len < 0:
        ap.error("--document-len must be at least 0")

    with open(Path(args.model) / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    requests = conversation_requests(args.conversations, args.turns, args.shared_len, args.turn_len,
                                     args.output_len, args.output_len, vocab, document_len=args.document_len, seed=0)
    common = ["--device", args.device, "--load-format", args.load_format, "--max-model-len", str(args.max_model_len),
              *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
              *(["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else []), *args.extra.split()]
    work = Path(tempfile.mkdtemp(prefix="kv-offload-bench-", dir=args.disk_dir))
    try:
        for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
            disk = work / f"disk-{config}"
            proc, url = serve(args.model, [*common, *offload_flags(config, args.cpu_gib, args.disk_gib, str(disk))],
                              work / f"serve-{config}.log", args.ready_timeout)
            try:
                point = run_point(PointConfig(base_url=url, model="bench", max_concurrency=args.max_concurrency,
                                              turn_delay_s=args.turn_delay, request_rate=args.conversation_rate),
                                  requests)
                counters = scrape(url)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
            result = {"bench": "kv_offload", "label": args.label, "config": config,
                      "model": os.path.basename(args.model.rstrip("/")),
                      "cpu_gib": args.cpu_gib if config.startswith(("cpu", "both")) else None,
                      "disk_gib": args.disk_gib if config.startswith(("disk", "both")) else None,
                      "conversations": args.conversations, "turns": args.turns, "shared_len": args.shared_len,
                      "document_len": args.document_len,
                      "max_concurrency": args.max_concurrency, "turn_delay_s": args.turn_delay,
                      "conversation_rate": None if math.isinf(args.conversation_rate) else args.conversation_rate,
                      "turn_len": args.turn_len, "output_len": args.output_len,
                      "num_kv_blocks": args.num_kv_blocks, "completed": point["completed"], "failed": point["failed"],
                      "errors": point["errors"], "duration_s": point["duration_s"],
                      "output_throughput": point["output_throughput"], "ttft_ms": point["ttft_ms"],
                      "tpot_ms": point["tpot_ms"], "offload": counters,
                      "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            line = "RESULT " + json.dumps(result)
            print(line, flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(result) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
