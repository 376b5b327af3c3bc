"""CUDA graphs for decode steps: same tokens as eager execution, padding that never leaks,
batches past the largest graph run eagerly, inputs at the captured addresses.

Skipped without a GPU; run on the GPU machine by `benchmarks/run_gpu.sh tests`.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagoda_daemon import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _generate(path, prompts, dtype, **kwargs):
    llm = LLM(path, dtype=dtype, device="cuda", num_kv_blocks=256, max_model_len=512, **kwargs)
    # different max_tokens: the decode batch shrinks 7 -> 1 and replays padded sizes 8, 4, 2, 1
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_graphs_give_the_eager_tokens_in_float32(tiny_models, arch):
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = _prompts(500, [3, 17, 40, 1, 65, 9, 30], seed=len(arch))
    eager_llm, eager = _generate(tiny_models[arch], prompts, "float32", enforce_eager=True)
    assert eager_llm.engine.core.executor.worker.runner.cuda_graphs is None
    llm, graphed = _generate(tiny_models[arch], prompts, "float32")
    graphs = llm.engine.core.executor.worker.runner.cuda_graphs
    assert graphs is not None and graphs.num_replays > 0
    assert graphed == eager
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_graph_inputs_stay_at_the_captured_addresses_and_padding_writes_nothing(tiny_models):
    llm = LLM(tiny_models["qwen3"], dtype="bfloat16", device="cuda", num_kv_blocks=64, max_model_len=256)
    runner = llm.engine.core.executor.worker.runner
    graphs = runner.cuda_graphs
    before = runner.kv_cache.clone()
    # 3 sequences decode together: the graph of size 4 runs with one padding row
    prompts = _prompts(500, [5, 6, 7], seed=3)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert graphs.num_replays > 0
    assert graphs.current_input_addresses() == graphs.input_addresses
    # Only the three blocks the requests held changed (each holds < 16 tokens): the padding
    # row's slot -1 wrote nothing, not even into block 0, which its block-table row points at.
    changed = (runner.kv_cache != before).flatten(3).any(-1).any(0).any(0)  # per block
    assert int(changed.sum()) == 3, changed.nonzero().flatten().tolist()


def test_batches_past_the_largest_graph_run_eagerly(tiny_models):
    prompts = _prompts(500, [4, 8, 12, 16, 20, 24], seed=5)
    _, eager = _generate(tiny_models["llama"], prompts, "float32", enforce_eager=True)
    llm, small = _generate(tiny_models["llama"], prompts, "float32", max_cudagraph_batch_size=4)
    graphs = llm.engine.core.executor.worker.runner.cuda_graphs
    assert graphs.sizes == [1, 2, 4]
    assert graphs.padded_size(5) is None and graphs.padded_size(3) == 4
    assert small == eager


def test_released_graphs_leave_decode_eager_and_the_same(tiny_models):
    """What a rank does before it leaves its NCCL world: the graphs go, decoding goes on eagerly."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = _prompts(500, [7, 3, 25], seed=11)
    llm, graphed = _generate(tiny_models["qwen3"], prompts, "float32")
    worker = llm.engine.core.executor.worker
    worker.release_cuda_graphs()
    assert worker.runner.cuda_graphs is None
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == graphed


def test_torch_backend_and_enforce_eager_capture_nothing(tiny_models):
    for kwargs in (dict(attention_backend="torch"), dict(enforce_eager=True)):
        llm = LLM(tiny_models["llama"], dtype="bfloat16", device="cuda", num_kv_blocks=32, max_model_len=128,
                  **kwargs)
        assert llm.engine.core.executor.worker.runner.cuda_graphs is None
        assert not llm.engine.core.worker_info.uses_cuda_graphs


def test_auto_backend_is_triton_on_cuda(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="bfloat16", device="cuda", num_kv_blocks=32, max_model_len=128)
    layer = llm.engine.core.executor.worker.runner.model.model.layers[0]
    assert layer.self_attn.attn.name == "triton"
    assert layer.input_layernorm._kernel is not None  # the model runs on the fused kernels too


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_piecewise_graphs_give_the_eager_tokens_in_float32(tiny_models, arch):
    """Steps that carry prompts replay the pieces between attentions (worker/piecewise_graphs.py):
    chunks of 48 tokens and mixed steps, same tokens as without graphs, every chunk covered."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = _prompts(500, [3, 17, 40, 1, 65, 9, 30, 120], seed=len(arch) + 1)
    _, eager = _generate(tiny_models[arch], prompts, "float32", enforce_eager=True, max_num_batched_tokens=48)
    llm, graphed = _generate(tiny_models[arch], prompts, "float32", max_num_batched_tokens=48)
    runner = llm.engine.core.executor.worker.runner
    piecewise = runner.piecewise
    assert piecewise is not None and piecewise.sizes[-1] == 48 and piecewise.covered == set(piecewise.sizes)
    assert graphed == eager
    sizes: list[int] = []
    run = piecewise.run
    piecewise.run = lambda size, *a: sizes.append(size) or run(size, *a)
    again = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True)
                                   for i in range(len(prompts))])
    assert [o.outputs[0].token_ids for o in again] == eager  # the prompts now from the prefix cache
    assert sizes, "no step ran piece by piece"
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
