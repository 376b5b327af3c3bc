"""Constrained decoding's cost in throughput: the nano-vllm workload with a fraction of its
requests under a JSON schema, beside the same workload unconstrained, on one engine.

    python -m benchmarks.structured_outputs benchmarks/configs/qwen3-0.6b [--tokenizer DIR]

The workload is benchmarks/throughput.py's (seed 0, 256 sequences, input and output lengths
uniform in [100, 1024], temperature 0.6, random weights, token ids in and out). Rounds, on one
engine, each timed from the first request added to the last output:

  plain    every request unconstrained, ignore_eos (the e2e benchmark's workload)
  json     the same, but a fixed random half of the requests (structured_schemas.assign) under
           one of four JSON schemas (structured_schemas.SCHEMAS): those keep their max_tokens,
           drop ignore_eos and stop where the grammar ends
  matched  unconstrained again, each formerly constrained request with ignore_eos and
           max_tokens = the length its output had in the last json round: the same tokens
           without the grammar (so json / matched is the grammar's own cost, json / plain also
           counts that constrained outputs are shorter)

The default order is plain, json, plain, json, matched: the first json round compiles the four
schemas (cold cache), the second finds them compiled. Before any round, one short request under
a schema outside the benchmark builds the tokenizer's grammar tables and compiles the masking
kernel, as a server that has served one constrained request has. Each constrained output that
finished with "stop" is decoded and validated against its schema (jsonschema where installed).

No real tokenizer is available offline: without --tokenizer, a synthetic byte-level BPE one of
Qwen3's size is built (benchmarks/synthetic_tokenizer.py). Prints one RESULT line per round and
a summary line.

The engine's fill threads (grammar.fill_threads: the CPUs this process may run on) are reported
in the setup line; --fill-threads N sets them for an experiment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter

import torch

from benchmarks.structured_schemas import SCHEMAS, assign, validate, validator_name
from pagoda_daemon.config import STRUCTURED_OUTPUTS_BACKENDS

WARM_UP_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_core(args, tokenizer):
    from pagoda_daemon.config import EngineConfig
    from pagoda_daemon.engine.engine_core import EngineCore
    from pagoda_daemon.heap import freeze_startup_heap

    config = EngineConfig(
        model=args.model, load_format="dummy", dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager, seed=0, gpu_memory_utilization=0.9,
        structured_outputs_backend=args.structured_outputs_backend,
    )
    core = EngineCore(config, tokenizer=tokenizer)
    core.warm_up()
    freeze_startup_heap()
    return core


class MaskTimer:
    """The engine core's grammar masks: the backend's fill time and rows (the engine's own
    stats), and the wall time the engine core waited for masks before it could sample (the part
    of the fills that the forward pass, the outputs' bookkeeping and the next schedule did not
    hide)."""

    def __init__(self, core) -> None:
        self.waited = 0.0
        inner = core._sample_in_flight

        def timed():
            t = time.perf_counter()
            try:
                return inner()
            finally:
                self.waited += time.perf_counter() - t

        core._sample_in_flight = timed

    def take(self, stats) -> dict:
        """The figures since the previous call; ``stats``: the engine's StructuredOutputStats
        taken since then (GrammarManager.make_stats), or None."""
        seconds = sum(stats.mask_fill_seconds) if stats is not None else 0.0
        fills = len(stats.mask_fill_seconds) if stats is not None else 0
        rows = stats.mask_fill_rows if stats is not None else 0
        out = {"mask_fill_s": round(seconds, 3), "mask_fill_steps": fills, "mask_fill_rows": rows,
               "mask_fill_us_per_row": round(seconds / rows * 1e6, 1) if rows else None,
               "mask_wait_s": round(self.waited, 3)}
        self.waited = 0.0
        return out


def run_round(core, prompts, params, tag: str, eos: int | None, timeout_s: float | None):
    """All requests added at once, stepped until done (or until timeout_s: the rest are
    aborted, and the round is marked incomplete). Returns (token ids per request, finish
    reasons, seconds, steps, complete)."""
    from pagoda_daemon.engine.request import Request

    outs: list[list[int]] = [[] for _ in prompts]
    finish: list[str | None] = [None] * len(prompts)
    sync()
    t = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(Request(f"{tag}-{i}", p, sp, eos, core.config.block_size))
    steps, complete = 0, True
    while core.has_unfinished_requests():
        for o in core.step():
            i = int(o.request_id.rsplit("-", 1)[1])
            outs[i].extend(o.new_token_ids)
            if o.finish_reason is not None:
                finish[i] = o.finish_reason
        steps += 1
        if timeout_s is not None and time.perf_counter() - t > timeout_s:
            complete = False
            break
    sync()
    elapsed = time.perf_counter() - t
    if not complete:
        core.abort_requests([f"{tag}-{i}" for i in range(len(prompts)) if finish[i] is None])
        while core.has_unfinished_requests():
            core.step()
    core.kv_cache.reset_prefix_cache()  # every round prefills from scratch
    return outs, finish, elapsed, steps, complete


def describe_constrained(outs, finish, assignment, tokenizer) -> dict:
    idx = [i for i, s in enumerate(assignment) if s is not None]
    lens = [len(outs[i]) for i in idx]
    reasons = Counter(finish[i] or "unfinished" for i in idx)
    valid, invalid, examples, by_schema = 0, 0, [], Counter()
    for i in idx:
        if finish[i] != "stop":
            continue
        err = validate(tokenizer.decode(outs[i], skip_special_tokens=True), assignment[i])
        if err is None:
            valid += 1
        else:
            invalid += 1
            by_schema[SCHEMAS[assignment[i]]["title"]] += 1
            if len(examples) < 3:
                examples.append(f"{SCHEMAS[assignment[i]]['title']}: {err[:160]}")
    return {"constrained_requests": len(idx), "constrained_finish": dict(reasons),
            "constrained_tokens": sum(lens), "constrained_len_mean": round(statistics.mean(lens), 1) if lens else 0,
            "constrained_len_median": statistics.median(lens) if lens else 0,
            "stopped_valid": valid, "stopped_invalid": invalid,
            **({"invalid_by_schema": dict(by_schema), "invalid_examples": examples} if invalid else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a directory with config.json (weights are random)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: build the synthetic one)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--json-fraction", type=float, default=0.5)
    ap.add_argument("--rounds", default="plain,json,plain,json,matched")
    ap.add_argument("--round-timeout", type=float, default=None,
                    help="stop a round after this many seconds (the rest aborted; reported as incomplete)")
    ap.add_argument("--fill-threads", type=int, default=None, help="mask-fill threads (default: the engine's)")
    ap.add_argument("--structured-outputs-backend", default=STRUCTURED_OUTPUTS_BACKENDS[0],
                    choices=STRUCTURED_OUTPUTS_BACKENDS)
    ap.add_argument("--label", default="pagoda")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from benchmarks.throughput import workload
    from pagoda_daemon.engine import grammar
    from pagoda_daemon.sampling_params import SamplingParams
    from pagoda_daemon.structured_outputs import StructuredOutputsParams

    if args.fill_threads is not None:
        threads = args.fill_threads
        grammar.fill_threads = lambda: threads  # read when the first grammar compiles
    tmp = None
    if args.tokenizer is None:
        from benchmarks.synthetic_tokenizer import build

        tmp = tempfile.TemporaryDirectory(prefix="pagoda-synth-tok-")
        args.tokenizer = build(tmp.name)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    t0 = time.perf_counter()
    core = build_core(args, tokenizer)
    init_s = time.perf_counter() - t0
    vocab = core.model_config.vocab_size
    eos = tokenizer.eos_token_id
    prompts, plain = workload(args.num_seqs, args.max_input_len, args.max_output_len, args.temperature, vocab)
    assignment = assign(args.num_seqs, args.json_fraction)
    constraints = [StructuredOutputsParams(json=s) for s in SCHEMAS]
    constrained = [p if s is None else SamplingParams(temperature=args.temperature, max_tokens=p.max_tokens,
                                                      structured_outputs=constraints[s])
                   for p, s in zip(plain, assignment)]
    timer = MaskTimer(core)

    # one constrained request outside the benchmark's schemas: tokenizer tables, masking kernel
    t = time.perf_counter()
    warm = SamplingParams(temperature=args.temperature, max_tokens=64,
                          structured_outputs=StructuredOutputsParams(json=WARM_UP_SCHEMA))
    outs, finish, _, _, _ = run_round(core, [prompts[0]], [warm], "warm", eos, 300)
    warm_up = {"grammar_warm_up_s": round(time.perf_counter() - t, 2), "finish": finish[0],
               "text": tokenizer.decode(outs[0], skip_special_tokens=True)[:80]}
    timer.take(core.scheduler.grammars.make_stats())
    common = {"engine": args.label, "num_seqs": args.num_seqs,
              "json_fraction": args.json_fraction, "model": os.path.basename(os.path.normpath(args.model)),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    print("RESULT " + json.dumps({**common, "round": "setup", "init_s": round(init_s, 1), **warm_up,
                                  "tokenizer": args.tokenizer if tmp is None else "synthetic (built)",
                                  "vocab_size": vocab, "tokenizer_len": len(tokenizer),
                                  "cuda_graphs": core.worker_info.uses_cuda_graphs,
                                  "async_scheduling": core.async_scheduling, "validator": validator_name(),
                                  "fill_threads": core.scheduler.grammars.fill_threads_used,
                                  "backend": args.structured_outputs_backend,
                                  "cpus_allowed": len(os.sched_getaffinity(0))}),
          flush=True)

    results: list[dict] = []
    last_json = None
    for r, kind in enumerate(args.rounds.split(",")):
        if kind == "plain":
            params = plain
        elif kind == "json":
            params = constrained
        elif kind == "matched":
            if last_json is None:
                print(f"skipping round {r} (matched): no complete json round before it", flush=True)
                continue
            params = [p if s is None else SamplingParams(temperature=args.temperature, ignore_eos=True,
                                                         max_tokens=max(1, len(last_json[i])))
                      for i, (p, s) in enumerate(zip(plain, assignment))]
        else:
            raise SystemExit(f"unknown round {kind!r}")
        outs, finish, elapsed, steps, complete = run_round(core, prompts, params, f"r{r}", eos, args.round_timeout)
        generated = sum(map(len, outs))
        res = {**common, "round": kind, "index": r, "complete": complete, "time_s": round(elapsed, 3),
               "output_tokens_generated": generated, "output_tok_per_s": round(generated / elapsed, 1),
               "steps": steps, "step_ms_mean": round(elapsed / steps * 1e3, 2)}
        if kind != "plain":
            res.update(describe_constrained(outs, finish, assignment, tokenizer))
            res["unconstrained_tokens"] = generated - res["constrained_tokens"]
        if kind == "json":
            stats = core.scheduler.grammars.make_stats()
            res.update(timer.take(stats))
            if stats is not None:
                res.update(grammar_compiles=stats.compiles, grammar_cache_hits=stats.cache_hits,
                           grammar_compile_s=[round(s, 2) for s in stats.compile_seconds][:8])
            if complete:
                last_json = outs
        print("RESULT " + json.dumps(res), flush=True)
        results.append(res)

    def rate(kind: str, pick=None):
        rows = [x for x in results if x["round"] == kind and x["complete"]]
        if pick is not None:
            rows = [rows[pick]] if -len(rows) <= pick < len(rows) else []
        return statistics.mean(x["output_tok_per_s"] for x in rows) if rows else None

    plain_rate, json_warm, json_cold, matched = rate("plain"), rate("json", -1), rate("json", 0), rate("matched")
    incomplete = [x for x in results if not x["complete"]]
    summary = {**common, "round": "summary", "plain_tok_per_s": plain_rate, "json_cold_tok_per_s": json_cold,
               "json_warm_tok_per_s": json_warm, "matched_tok_per_s": matched}
    if plain_rate and json_warm:
        summary["json_warm_over_plain"] = round(json_warm / plain_rate, 4)
    if plain_rate and json_cold:
        summary["json_cold_over_plain"] = round(json_cold / plain_rate, 4)
    if matched and json_warm:
        summary["json_warm_over_matched"] = round(json_warm / matched, 4)
    if incomplete:
        summary["incomplete_rounds"] = [{"round": x["round"], "index": x["index"], "time_s": x["time_s"],
                                         "output_tok_per_s": x["output_tok_per_s"]} for x in incomplete]
    summary["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print("RESULT " + json.dumps(summary), flush=True)
    core.shutdown()
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
