"""After the engine's warm-up, serving compiles no Triton kernel.

A kernel compiled mid-run stalls every request of that step for up to a second: three
such compiles (new specialisations of an integer argument or of a pointer's alignment)
made the first of three identical throughput runs 26% slower on an H100
(docs/benchmarks/2026-11-21-run-variance-and-vllm-pairs-h100.md). Each case runs the throughput benchmark
in a fresh process, where Triton's in-memory caches start empty, on a workload whose
batches vary widely: 48 requests finishing one by one, chunked prefill, a vocabulary that
the sampler splits into several chunks; once with CUDA graphs and once eager.

Skipped without a GPU; run on the GPU machine by `benchmarks/run_gpu.sh gpu-tests`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
def test_serving_after_warm_up_compiles_no_kernel(tmp_path, eager):
    from pagoda_daemon.models.tiny import tiny_config

    # head size 128 and 2 query heads per KV head, as the models served; random weights
    tiny_config("qwen3", 20000, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=2, head_dim=128, architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path)
    cmd = [sys.executable, "-m", "benchmarks.throughput", str(tmp_path), "--num-seqs", "48",
           "--max-input-len", "400", "--max-output-len", "160", "--max-num-batched-tokens", "1024",
           "--max-model-len", "1024"] + (["--enforce-eager"] if eager else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))
    compiles = result["triton_compiles"]
    assert compiles["supported"], "this Triton has no knobs.runtime JIT hooks to watch compiles with"
    assert result["output_tokens_generated"] == result["output_tokens_requested"]
    assert compiles["compiles"] == 0, json.dumps(compiles["kernels"], indent=1)[:6000]


def test_the_offline_llm_compiles_nothing_in_its_first_batch(tmp_path):
    """`LLM(...)` warms up as the server does: its first `generate` compiles no Triton kernel."""
    from pagoda_daemon.models.tiny import tiny_config

    tiny_config("qwen3", 20000, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=2, head_dim=128, architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path)
    cmd = [sys.executable, "-m", "benchmarks.throughput", str(tmp_path), "--offline-llm", "--num-seqs", "48",
           "--max-input-len", "400", "--max-output-len", "160", "--max-num-batched-tokens", "1024",
           "--max-model-len", "1024"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))
    (first,) = result["rounds"]
    assert first["triton_compiles"] == 0 and first["output_tokens_generated"] > 0
