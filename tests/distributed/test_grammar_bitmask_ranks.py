"""Structured outputs under tensor parallelism on CPU (gloo, float32): the engine's executor starts
rank 1 in a process of its own and feeds it each step's plan, then the step's grammar masks
(SampleTokens). Every rank samples from the same gathered logits, so rank 1, masked as rank 0 is, must
sample exactly rank 0's tokens, and every sample must be one its mask allows. Rank 0's output
must equal the one-process engine's (greedy, or seeded for the JSON requests) and match its
constraint.

Rank 1's own samples never reach the scheduler, so they are watched where they are made: a sitecustomize.py on rank 1's PYTHONPATH (the executor passes
its environment on) wraps Sampler.__call__ to log each masked step; rank 0 runs the same wrapper.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import torch
import torch.multiprocessing as mp

from benchmarks.parity import random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "code": {"type": "string", "minLength": 1, "maxLength": 1},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        "inner": {"type": "object", "properties": {"x": {"type": "null"}, "y": {"type": "number"}},
                  "required": ["x", "y"]},
    },
    "required": ["name", "code", "age", "tags", "inner"],
}
REGEX = r"[a-c]{2,5}-\d{3}"
CHOICES = ["yes", "no", "東京 🚀", "ab", "abc"]
GRAMMAR = 'root ::= "a" [0-9]{1,5} "b" ("," [x-z]){0,3}'
MAX_TOKENS = 400
GREEDY, SEEDED = (1, 2, 4, 5), (0, 3)  # the requests of requests() by how they sample
# Two logits closer than this are a tie in float32 (test_tensor_parallel.NEAR_TIE): summing the
# ranks' partial products may order them either way.
NEAR_TIE = 1e-4

# Written to rank 1's sys.path as sitecustomize.py, and run in rank 0: log every step sampled
# under a bitmask (the sampled tokens, the rows with a grammar, the samples the mask refuses).
SAMPLE_LOG = '''
import json, os
from pagoda_daemon.worker import sampler as _sampler

_call = _sampler.Sampler.__call__


def _logged(self, logits, batch):
    out = _call(self, logits, batch)
    if batch.token_bitmask is not None:
        mask = batch.token_bitmask.cpu().tolist()
        sampled = out.sampled.cpu().tolist()
        rows = list(batch.token_bitmask_rows)
        refused = [i for i in rows if not (mask[i][sampled[i] // 32] >> (sampled[i] % 32)) & 1]
        with open(os.path.join(os.environ["PAGODA_TEST_SAMPLE_LOG"], f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({"sampled": sampled, "rows": rows, "refused": refused}) + "\\n")
    return out


_sampler.Sampler.__call__ = _logged
'''


def requests(vocab: int):
    """Greedy regex, choice, EBNF and plain requests; the JSON ones sampled with seeds (greedy, the
    random model never ends a JSON value: it repeats whitespace and digits up to max_tokens)."""
    from pagoda_daemon import SamplingParams
    from pagoda_daemon.structured_outputs import StructuredOutputsParams as SO

    prompts = random_prompts(vocab, [6, 11, 3, 40, 9, 17], seed=5)
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 2}
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=3, structured_outputs=SO(json=SCHEMA)),
              SamplingParams(**greedy, structured_outputs=SO(regex=REGEX)),
              SamplingParams(**greedy, structured_outputs=SO(choice=CHOICES)),
              SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=4, structured_outputs=SO(json=SCHEMA)),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
              SamplingParams(**greedy, structured_outputs=SO(grammar=GRAMMAR))]
    return prompts, params


def run_engine(path: str, size: int) -> list[dict]:
    from pagoda_daemon import LLM

    llm = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=size, num_kv_blocks=128,
              max_model_len=512, max_num_batched_tokens=32)  # prompts in chunks: rows that do not sample
    prompts, params = requests(llm.engine.model_config.vocab_size)
    outs = llm.generate(prompts, params)
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks, "blocks leaked"
    llm.engine.core.shutdown()
    return [{"text": o.outputs[0].text, "tokens": o.outputs[0].token_ids, "finish": o.outputs[0].finish_reason,
             "logprobs": [{str(k): v for k, v in e.items()} for e in o.outputs[0].logprobs or []]} for o in outs]


def _rank0_main(_: int, path: str, out_dir: str) -> None:
    """The engine at TP = 2, rank 1 started by its executor with the sample log on its path."""
    torch.set_num_threads(1)  # two ranks on two cores (rank 1 inherits OMP_NUM_THREADS)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["PAGODA_TEST_SAMPLE_LOG"] = out_dir
    os.environ["PYTHONPATH"] = os.pathsep.join([out_dir, *filter(None, [os.environ.get("PYTHONPATH")])])
    exec(compile(SAMPLE_LOG, "sample_log", "exec"), {})  # the same log in rank 0
    Path(out_dir, "outputs.json").write_text(json.dumps(run_engine(path, 2)))


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_same_greedy(got: list[int], want: list[int], want_logprobs: list[dict], where) -> None:
    """Token-identical, except where the one-process engine's own top two allowed tokens tie: the
    outputs may part there (and only there), and nothing after it is compared."""
    for k, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top = want_logprobs[k]
            assert str(a) in top and abs(top[str(a)] - top[str(b)]) < NEAR_TIE, (where, k, a, b, top)
            return
    assert got == want, where


def test_grammar_bitmask_reaches_every_rank(tiny_models, tmp_path):
    path = tiny_models["qwen3"]
    (tmp_path / "sitecustomize.py").write_text(SAMPLE_LOG)
    mp.start_processes(_rank0_main, args=(path, str(tmp_path)), nprocs=1, start_method="spawn")
    tp2 = json.loads((tmp_path / "outputs.json").read_text())

    logs = {p.stem: read_log(p) for p in tmp_path.glob("*.jsonl")}
    assert len(logs) == 2, f"a sample log from each rank expected, got {sorted(logs)}"
    first, second = logs.values()
    assert first and any(step["rows"] for step in first), "no step sampled under a grammar"
    assert first == second, "rank 1 sampled other tokens than rank 0 (its bitmask differs)"
    assert not any(step["refused"] for step in first), "a sample the mask refused"

    tp1 = run_engine(path, 1)
    for i in GREEDY:
        assert_same_greedy(tp2[i]["tokens"], tp1[i]["tokens"], tp1[i]["logprobs"], i)
    # seeded samples part only where a float32 difference crosses a sampling boundary: ~1e-6 a step
    for i in SEEDED:
        assert tp2[i]["tokens"] == tp1[i]["tokens"], i
        assert tp2[i]["finish"] == "stop", tp2[i]
        jsonschema.validate(json.loads(tp2[i]["text"]), SCHEMA)
    assert tp2[1]["finish"] == "stop" and re.fullmatch(REGEX, tp2[1]["text"]), tp2[1]
    assert tp2[2]["finish"] == "stop" and tp2[2]["text"] in CHOICES, tp2[2]
    assert tp2[4]["finish"] == "length" and len(tp2[4]["tokens"]) == 16
    assert tp2[5]["finish"] == "stop" and re.fullmatch(r"a[0-9]{1,5}b(,[x-z]){0,3}", tp2[5]["text"]), tp2[5]
