"""Constrained decoding on the GPU path: CUDA graphs, bfloat16 logits masked in place, and
scheduling ahead (the grammar masks are filled while the step's forward pass runs and applied
before it samples).

Random weights sample about uniformly among the tokens a mask allows, so any step that sampled
without its mask (a mask applied to the wrong row, a step sampled before its mask arrived, a
graph's output buffer rewritten under it) shows up as output that does not match its
constraint. Plain requests beside them must keep their lengths, and nothing may leak.

Skipped without a GPU; run on the GPU machine by `benchmarks/run_gpu.sh gpu-tests`.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from benchmarks.parity import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                         "name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["id", "name", "tags"], "additionalProperties": False}
CHOICES = ["red", "green", "blue", "東京"]
REGEX = r"[a-f]{3,6}-\d{2}"


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["ahead", "sync"])
def test_constrained_rows_under_graphs_and_scheduling_ahead(tiny_models, async_scheduling, backend):
    pytest.importorskip(backend)
    import jsonschema

    from pagoda_daemon import LLM, SamplingParams
    from pagoda_daemon.structured_outputs import StructuredOutputsParams as SO

    llm = LLM(tiny_models["qwen3"], device="cuda", dtype="bfloat16", num_kv_blocks=512, max_model_len=1024,
              max_num_seqs=64, async_scheduling=async_scheduling, structured_outputs_backend=backend)
    core = llm.engine.core
    assert core.worker_info.uses_cuda_graphs and core.async_scheduling == async_scheduling
    kinds = ["json", "plain", "choice", "plain", "regex", "plain"] * 8
    constraint = {"json": SO(json=SCHEMA), "choice": SO(choice=CHOICES), "regex": SO(regex=REGEX)}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured_outputs=constraint[k])
              if k != "plain" else SamplingParams(temperature=0.8, seed=i, max_tokens=20 + i, ignore_eos=True)
              for i, k in enumerate(kinds)]
    prompts = random_prompts(llm.engine.model_config.vocab_size, [3 + 7 * i for i in range(len(kinds))], seed=7)

    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, request_id=str(i))
    done, in_flight = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0]
        in_flight += core._in_flight is not None
    assert len(done) == len(kinds)
    for i, kind in enumerate(kinds):
        out = done[i]
        if kind == "plain":
            assert out.finish_reason == "length" and len(out.token_ids) == 20 + i
            continue
        assert out.finish_reason == "stop", (i, kind, out.text, out.finish_reason)
        if kind == "json":
            jsonschema.validate(json.loads(out.text), SCHEMA)
        elif kind == "choice":
            assert out.text in CHOICES, out.text
        else:
            assert re.fullmatch(REGEX, out.text), out.text
    assert (in_flight > 0) == async_scheduling
    kv = core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks, "blocks leaked"
    assert core.scheduler.num_needing_host_tokens == 0
    core.shutdown()
