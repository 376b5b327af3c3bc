"""Tensor parallelism on CPU: gloo, float32, one process per rank, every rank running the engine
on the same requests (the model's collectives keep them in step). Greedy output must be
token-identical to transformers and to the one-process engine, with chunked prefill, prefix
caching and preemption exercised, and prompt logprobs must match, for Llama, Qwen3 and
Qwen3-MoE at TP = 2 and 4 (4 heads, 2 KV heads: at 4 each KV head lives on two ranks)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from benchmarks.parity import CONFIGS, hf_greedy, random_prompts

CASES = ["default", "chunked-prefill-16", "shared-prefix-cached", "tiny-cache-preemption"]
LENGTHS = [1, 5, 17, 33, 48, 70, 95, 120, 9]
MAX_TOKENS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, path: str, arch: str, seed: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from pagoda_daemon import LLM, SamplingParams

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        results = {}
        for case in CASES:
            engine_kwargs, shared_prefix = CONFIGS[case]
            llm = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=size,
                      **{"num_kv_blocks": 256, "max_model_len": 512, **engine_kwargs})
            vocab = llm.engine.model_config.vocab_size
            prompts = random_prompts(vocab, [max(n, shared_prefix + 1) for n in LENGTHS], seed=seed,
                                     shared_prefix=shared_prefix)
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)
            outs = llm.generate(prompts, params)
            stats = llm.get_stats()
            results[case] = {
                "prompts": prompts,
                "tokens": [o.outputs[0].token_ids for o in outs],
                "prompt_logprobs": [[None if e is None else e[t] for e, t in zip(o.prompt_logprobs, p)]
                                    for o, p in zip(outs, prompts)],
                "preemptions": stats.num_preemptions,
                "free": llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.kv_cache.num_blocks,
            }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_ranks(size: int, path: str, arch: str, seed: int, out_dir: Path) -> list[dict]:
    mp.start_processes(_rank_main, args=(size, _free_port(), path, arch, seed, str(out_dir)), nprocs=size,
                       start_method="spawn")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(size)]


def hf_prompt_logprobs(path: str, prompt: list[int]) -> list[float]:
    from benchmarks.parity import hf_model

    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return [logits[p - 1, prompt[p]].item() for p in range(1, len(prompt))]


# Two logits closer than this are a tie in float32: summing the heads' and the intermediate
# dimension's partial products over ranks (as tensor parallelism does) may order them either way.
NEAR_TIE = 1e-4


def assert_same_greedy(path: str, prompt: list[int], got: list[int], want: list[int], where) -> None:
    """Token-identical, except where transformers' own top two logits tie: the sequences may part
    there (and only there) and nothing after it is compared."""
    from benchmarks.parity import hf_model

    for k, (a, b) in enumerate(zip(got, want)):
        if a == b:
            continue
        with torch.no_grad():
            logits = hf_model(path)(torch.tensor([prompt + want[:k]])).logits[0, -1].float()
        gap = (logits[b] - logits[a]).item()
        assert gap < NEAR_TIE, (where, len(prompt), k, a, b, gap)
        return
    if len(want) < len(got):  # transformers' generate stopped at the checkpoint's EOS; ignore_eos went on
        assert want[-1] == hf_model(path).generation_config.eos_token_id, (where, want)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_tensor_parallel_matches_transformers(tiny_models, tmp_path, arch, size):
    path = tiny_models[arch]
    seed = int(torch.randint(0, 2**31, ()).item())
    ranks = run_ranks(size, path, arch, seed, tmp_path)
    for case in CASES:
        first = ranks[0][case]
        for other in ranks[1:]:
            assert other[case]["tokens"] == first["tokens"], (case, "ranks disagree")
        assert first["free"], (case, "blocks leaked")
        if case == "tiny-cache-preemption":
            assert first["preemptions"] > 0, "the cache was meant to be too small for the batch"
        for prompt, tokens, plp in zip(first["prompts"], first["tokens"], first["prompt_logprobs"]):
            assert_same_greedy(path, prompt, tokens, hf_greedy(path, prompt, MAX_TOKENS), (case, seed))
            assert plp[0] is None
            assert plp[1:] == pytest.approx(hf_prompt_logprobs(path, prompt), abs=1e-4), (case, seed)


def test_a_size_that_does_not_divide_the_heads_is_refused(tiny_models):
    from pagoda_daemon.distributed.parallel_state import TensorParallel
    from pagoda_daemon.models.llama import Attention
    from pagoda_daemon.models.loader import load_config

    config = load_config(tiny_models["llama"])
    with pytest.raises(ValueError, match=r"number of attention heads \(4\) is not divisible by the tensor-parallel size 3"):
        Attention(config, type("B", (), {"uses_kernels": False, "__call__": None}), None, False,
                  TensorParallel(0, 3))
