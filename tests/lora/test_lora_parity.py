"""LoRA against transformers + PEFT on the same weights: prompts under three real PEFT adapters
(different ranks, targets, rsLoRA) and under none, mixed in one batch with two GPU slots, so the
scheduler holds requests back and the slots are reloaded; greedy tokens must be identical (up to float32 near ties, where the order of the sums decides), in
the one-process engine (eager, chunked, and piece by piece as the GPU's graphs run) and with
tensor parallelism (gloo, rank 1 in a process of its own)."""

from __future__ import annotations

import json
import random

import pytest
import torch.multiprocessing as mp

from benchmarks.lora_parity import (
    ALL_TARGETS,
    ATTENTION_TARGETS,
    _peft_model,
    divergences,
    engine_greedy,
    make_adapter,
)
from tests.processes import warm_start_method

MAX_TOKENS = 10
ENGINE = {"device": "cpu", "max_loras": 2, "max_lora_rank": 16, "num_kv_blocks": 128}
CONFIGS = {
    "default": {},
    "chunked-prefill-16": {"max_num_batched_tokens": 16},
    "piecewise": {"pad_eager_steps": True},  # steps run piece by piece, as the GPU's graphs do
}


def _adapters(model_path: str, root, moe: bool) -> dict[str, str]:
    """Three adapters: rank 4 on every projection, rank 8 rsLoRA on q/v, rank 16 on o/down (the
    attention alone on an MoE model, whose MLPs are experts)."""
    every = ATTENTION_TARGETS if moe else ALL_TARGETS
    last = ("o_proj",) if moe else ("o_proj", "down_proj")
    seed = random.randrange(2**31)
    return {
        "every": make_adapter(model_path, root / "every", seed, 4, 8.0, every),
        "qv-rs": make_adapter(model_path, root / "qv", seed + 1, 8, 16.0, ("q_proj", "v_proj"), rslora=True),
        "out": make_adapter(model_path, root / "out", seed + 2, 16, 32.0, last),
    }


def _jobs(vocab: int, seed: int) -> list[tuple[list[int], str | None]]:
    rng = random.Random(seed)
    names = [None, "every", "qv-rs", "out", "every", None, "out", "qv-rs", "every"]
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))], name) for name in names]


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> dict[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("adapters")
    return {arch: _adapters(tiny_models[arch], root / arch, arch == "qwen3_moe") for arch in tiny_models}


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_adapters_in_one_batch_match_peft(tiny_models, adapters, arch, config_name):
    path = tiny_models[arch]
    seed = random.randrange(2**31)
    jobs = _jobs(_peft_model(path, None, "cpu").config.vocab_size, seed)
    got, llm = engine_greedy(path, adapters[arch], jobs, MAX_TOKENS, **ENGINE, **CONFIGS[config_name])
    assert divergences(path, adapters[arch], jobs, got, MAX_TOKENS) == [None] * len(jobs), (seed, got)
    core = llm.engine.core
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks and not core.kv_cache.req_blocks, "blocks leaked"
    # three adapters, two slots: the third waited for a slot and some adapter was loaded twice
    assert len(set(core.executor.worker.runner.lora.held) - {None}) == 2


def test_an_adapter_never_reads_the_base_models_cached_prefix(tiny_models, adapters):
    """The same prompt under the base model, then under an adapter, then under it again: the
    adapter's first run computes its prompt (a KV cache computed without it is wrong for it),
    its second reads its own."""
    from pagoda_daemon.llm import LLM
    from pagoda_daemon.sampling_params import SamplingParams

    path = tiny_models["qwen3"]
    llm = LLM(path, enable_lora=True, **ENGINE)
    lora = llm.lora("every", adapters["qwen3"]["every"])
    prompt = [random.randrange(3, 400) for _ in range(48)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    base, first, second = (llm.generate([prompt], params, lora_request=r)[0] for r in (None, lora, lora))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 32
    assert first.outputs[0].token_ids == second.outputs[0].token_ids != base.outputs[0].token_ids


def _tensor_parallel_main(_: int, path: str, adapters: dict[str, str], seed: int, out: str) -> None:
    jobs = _jobs(512, seed)
    got, _ = engine_greedy(path, adapters, jobs, MAX_TOKENS, **ENGINE, tensor_parallel_size=2,
                           max_num_batched_tokens=24)
    with open(out, "w") as f:
        json.dump({"jobs": jobs, "got": got}, f)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_adapters_under_tensor_parallelism_match_peft(tiny_models, adapters, tmp_path, arch):
    """Each rank holds its slice of every adapter (B's rows where the base weight is split by
    rows, A's columns where by columns) and the row-parallel delta is summed with the base's."""
    path = tiny_models[arch]
    seed = random.randrange(2**31)
    mp.start_processes(_tensor_parallel_main, args=(path, adapters[arch], seed, str(tmp_path / "out.json")),
                       nprocs=1, start_method=warm_start_method())
    result = json.loads((tmp_path / "out.json").read_text())
    jobs = [(prompt, name) for prompt, name in result["jobs"]]
    assert divergences(path, adapters[arch], jobs, result["got"], MAX_TOKENS) == [None] * len(jobs), seed
