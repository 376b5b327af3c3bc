"""vLLM's side of benchmarks/structured_outputs.py: the same workload, schemas, rounds and checks
on vLLM (0.26.0 from the anchor kit), run with vLLM's own site-packages:

    PYTHONPATH=/tmp/vsite python3 benchmarks/vllm_structured.py MODEL_DIR [--rounds ...]

MODEL_DIR holds config.json and a tokenizer (benchmarks/synthetic_tokenizer.py builds one):
random (dummy) weights, as the anchor's bench_vllm.py, but with the tokenizer loaded (structured
outputs need it); token ids in, token ids out (detokenize=False), outputs decoded after timing.
Rounds: plain, json, matched as in structured_outputs.py; json-compact is json with vLLM's
disable_any_whitespace (no whitespace between JSON tokens). Prints one RESULT line per round
and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from random import randint, seed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.structured_schemas import SCHEMAS, assign, validate, validator_name

for k, v in {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}.items():
    os.environ.setdefault(k, v)

WARM_UP_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--json-fraction", type=float, default=0.5)
    ap.add_argument("--rounds", default="plain,json,plain,json,matched")
    ap.add_argument("--backend", default="FLASH_ATTN")
    a = ap.parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    t0 = time.perf_counter()
    llm = LLM(model=a.model, load_format="dummy", max_model_len=4096, generation_config="vllm", seed=0,
              attention_config={"backend": a.backend}, gpu_memory_utilization=0.90)
    init_s = time.perf_counter() - t0
    tokenizer = llm.get_tokenizer()

    seed(0)  # the anchor's (and nano-vllm's) random stream
    ids = [[randint(0, 10000) for _ in range(randint(100, a.max_input_len))] for _ in range(a.num_seqs)]
    max_tokens = [randint(100, a.max_output_len) for _ in range(a.num_seqs)]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
    assignment = assign(a.num_seqs, a.json_fraction)

    def plain_sp(n: int) -> SamplingParams:
        return SamplingParams(temperature=a.temperature, ignore_eos=True, max_tokens=n, detokenize=False)

    def json_sp(n: int, schema: dict, compact: bool = False) -> SamplingParams:
        return SamplingParams(temperature=a.temperature, max_tokens=n, detokenize=False,
                              structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=compact))

    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], SamplingParams(max_tokens=16, detokenize=False),
                 use_tqdm=False)  # warm-up, as bench_vllm.py
    t = time.perf_counter()
    warm = llm.generate([prompts[0]], [json_sp(64, WARM_UP_SCHEMA)], use_tqdm=False)[0].outputs[0]
    common = {"engine": "vllm", "vllm": vllm.__version__, "num_seqs": a.num_seqs, "json_fraction": a.json_fraction,
              "model": os.path.basename(os.path.normpath(a.model)), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__}
    try:
        from importlib.metadata import version

        common["xgrammar"] = version("xgrammar")
    except Exception:
        pass
    print("RESULT " + json.dumps({**common, "round": "setup", "init_s": round(init_s, 1),
                                  "grammar_warm_up_s": round(time.perf_counter() - t, 2),
                                  "finish": warm.finish_reason,
                                  "text": tokenizer.decode(warm.token_ids, skip_special_tokens=True)[:80],
                                  "tokenizer_len": len(tokenizer), "validator": validator_name()}), flush=True)

    results, last_json = [], None
    for r, kind in enumerate(a.rounds.split(",")):
        if kind == "plain":
            sps = [plain_sp(n) for n in max_tokens]
        elif kind in ("json", "json-compact"):
            sps = [plain_sp(n) if s is None else json_sp(n, SCHEMAS[s], kind == "json-compact")
                   for n, s in zip(max_tokens, assignment)]
        elif kind == "matched":
            if last_json is None:
                print(f"skipping round {r} (matched): no json round before it", flush=True)
                continue
            sps = [plain_sp(n if s is None else max(1, len(last_json[i])))
                   for i, (n, s) in enumerate(zip(max_tokens, assignment))]
        else:
            raise SystemExit(f"unknown round {kind!r}")
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        toks = [list(o.outputs[0].token_ids) for o in outs]
        finish = [o.outputs[0].finish_reason for o in outs]
        generated = sum(map(len, toks))
        res = {**common, "round": kind, "index": r, "complete": True, "time_s": round(elapsed, 3),
               "output_tokens_generated": generated, "output_tok_per_s": round(generated / elapsed, 1)}
        if kind != "plain":
            idx = [i for i, s in enumerate(assignment) if s is not None]
            lens = [len(toks[i]) for i in idx]
            valid, invalid, examples, by_schema = 0, 0, [], Counter()
            for i in idx:
                if finish[i] != "stop":
                    continue
                err = validate(tokenizer.decode(toks[i], skip_special_tokens=True), assignment[i])
                if err is None:
                    valid += 1
                else:
                    invalid += 1
                    by_schema[SCHEMAS[assignment[i]]["title"]] += 1
                    if len(examples) < 3:
                        examples.append(f"{SCHEMAS[assignment[i]]['title']}: {err[:160]}")
            res.update(constrained_requests=len(idx), constrained_finish=dict(Counter(finish[i] for i in idx)),
                       constrained_tokens=sum(lens), constrained_len_mean=round(statistics.mean(lens), 1),
                       constrained_len_median=statistics.median(lens), stopped_valid=valid, stopped_invalid=invalid,
                       unconstrained_tokens=generated - sum(lens))
            backends = {getattr(sp.structured_outputs, "_backend", None) for sp in sps if sp.structured_outputs}
            if backends:
                res["structured_backend"] = sorted(map(str, backends))
            if invalid:
                res.update(invalid_by_schema=dict(by_schema), invalid_examples=examples)
        if kind == "json":
            last_json = toks
        print("RESULT " + json.dumps(res), flush=True)
        results.append(res)

    def rate(kind: str, pick=None):
        rows = [x for x in results if x["round"] == kind]
        if pick is not None:
            rows = [rows[pick]] if -len(rows) <= pick < len(rows) else []
        return statistics.mean(x["output_tok_per_s"] for x in rows) if rows else None

    plain_rate, json_warm, json_cold, matched = rate("plain"), rate("json", -1), rate("json", 0), rate("matched")
    summary = {**common, "round": "summary", "plain_tok_per_s": plain_rate, "json_cold_tok_per_s": json_cold,
               "json_warm_tok_per_s": json_warm, "matched_tok_per_s": matched,
               "json_compact_tok_per_s": rate("json-compact")}
    if plain_rate and json_warm:
        summary["json_warm_over_plain"] = round(json_warm / plain_rate, 4)
    if plain_rate and json_cold:
        summary["json_cold_over_plain"] = round(json_cold / plain_rate, 4)
    if matched and json_warm:
        summary["json_warm_over_matched"] = round(json_warm / matched, 4)
    summary["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print("RESULT " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
