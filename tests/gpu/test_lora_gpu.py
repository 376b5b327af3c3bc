"""LoRA on a CUDA device, on the default GPU path (Triton kernels, decode CUDA graphs, piecewise
graphs for steps with prompts, async scheduling): prompts under three PEFT adapters and none in
one batch, two slots, float32 (TF32 off) against PEFT on the same device, token for token. The
graphs replay the adapters' products from the slot and mask buffers they captured.

Skipped without a GPU (CI); run on the GPU machine by `benchmarks/run_gpu.sh lora` (which
carries peft's wheel: the GPU image has no peft).
"""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.lora_parity import divergences, engine_greedy
from tests.lora.test_lora_parity import MAX_TOKENS, _adapters, _jobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 16}, {"enforce_eager": True}],
                         ids=["graphs", "chunked-prefill-16", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_adapters_match_peft_on_cuda(tiny_models, tmp_path, arch, config):
    torch.backends.cuda.matmul.allow_tf32 = False
    path = tiny_models[arch]
    adapters = _adapters(path, tmp_path, arch == "qwen3_moe")
    seed = random.randrange(2**31)
    jobs = _jobs(512, seed)
    got, llm = engine_greedy(path, adapters, jobs, MAX_TOKENS, device="cuda", dtype="float32", max_loras=2,
                             max_lora_rank=16, **config)
    assert divergences(path, adapters, jobs, got, MAX_TOKENS, device="cuda") == [None] * len(jobs), (seed, got)
    assert llm.engine.core.worker_info.uses_cuda_graphs == ("enforce_eager" not in config)
