"""Parity with Hugging Face transformers: the engine's correctness anchor.

Helpers used by the tests, and a report for the GPU machine:

    python -m benchmarks.parity --device cuda --dtypes float32 bfloat16

For each architecture, dtype and engine configuration it runs a batch of prompts
through the engine and through transformers' greedy `generate` on the same weights,
and reports, per prompt, the first generated position where they differ (or none).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import tempfile
import time

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str, dtype: str = "float32", device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int, dtype: str = "float32",
              device: str = "cpu") -> list[int]:
    """transformers' own greedy generate, never stopping early (as ignore_eos does)."""
    return list(_hf_greedy(path, tuple(prompt_ids), max_new_tokens, dtype, device))


@functools.lru_cache(maxsize=1024)
def _hf_greedy(path: str, prompt_ids: tuple[int, ...], max_new_tokens: int, dtype: str, device: str):
    from transformers import GenerationConfig

    model = hf_model(path, dtype, device)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=2)
    ids = torch.tensor([prompt_ids], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return tuple(out[0, len(prompt_ids):].tolist())


def random_prompts(vocab_size: int, lengths: list[int], seed: int, shared_prefix: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths; the first `shared_prefix` tokens are common to all."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(n - shared_prefix)] for n in lengths]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# engine configurations: kwargs and the shared-prefix length of the prompts
CONFIGS = {
    "default": (dict(), 0),
    "chunked-prefill-16": (dict(max_num_batched_tokens=16), 0),
    "no-prefix-caching": (dict(enable_prefix_caching=False, max_num_batched_tokens=40), 0),
    "shared-prefix-cached": (dict(max_num_batched_tokens=48), 40),
    "tiny-cache-preemption": (dict(num_kv_blocks=20, max_model_len=256, max_num_batched_tokens=64), 0),
    # scheduling one step ahead (the GPU default; forced here so the CPU runs it too)
    "async-chunked": (dict(async_scheduling=True, max_num_batched_tokens=16), 0),
    "async-preemption": (dict(async_scheduling=True, num_kv_blocks=20, max_model_len=256,
                              max_num_batched_tokens=64), 0),
    # eager steps padded to the token grid (the CUDA default; forced here), mixed with decodes
    "padded-eager": (dict(pad_eager_steps=True, async_scheduling=True, max_num_batched_tokens=40), 0),
}
LENGTHS = [1, 5, 17, 33, 48, 70, 95, 120, 9]


def run_case(path: str, arch: str, dtype: str, device: str, config_name: str, max_tokens: int,
             attention_backend: str = "auto") -> dict:
    from pagoda_daemon import LLM, SamplingParams

    engine_kwargs, shared_prefix = CONFIGS[config_name]
    engine_kwargs = {"num_kv_blocks": 256, "max_model_len": 512, "attention_backend": attention_backend,
                     **engine_kwargs}
    llm = LLM(path, dtype=dtype, device=device, **engine_kwargs)
    vocab = llm.engine.model_config.vocab_size
    lengths = [max(n, shared_prefix + 1) for n in LENGTHS]
    prompts = random_prompts(vocab, lengths, seed=sum(map(ord, arch)), shared_prefix=shared_prefix)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    random.Random(0).shuffle(prompts)  # arrival order unrelated to length
    outputs = llm.generate(prompts, params)
    divergences = []
    for prompt, out in zip(prompts, outputs):
        ref = hf_greedy(path, prompt, max_tokens, dtype, device)
        divergences.append(first_divergence(out.outputs[0].token_ids, ref))
    stats = llm.get_stats()
    kv = llm.engine.core.kv_cache
    return {
        "arch": arch, "dtype": dtype, "device": device, "config": config_name, "attention": attention_backend,
        "prompt_lengths": lengths, "max_tokens": max_tokens,
        "first_divergence": divergences,
        "identical": sum(d is None for d in divergences),
        "finish_reasons": sorted({o.outputs[0].finish_reason for o in outputs}),
        "preemptions": stats.num_preemptions, "prefix_cache_hits": stats.prefix_cache.hits,
        "all_blocks_free": kv.num_free_blocks == kv.num_blocks and not kv.req_blocks,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--archs", nargs="+", default=["llama", "qwen3", "qwen3_moe"])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    args = ap.parse_args(argv)

    from pagoda_daemon.models.tiny import build_tiny_model

    results, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        for i, arch in enumerate(args.archs):
            path = str(build_tiny_model(arch, f"{tmp}/{arch}", seed=i + 1))
            for dtype in args.dtypes:
                for config_name in args.configs:
                    t0 = time.time()
                    r = run_case(path, arch, dtype, args.device, config_name, args.max_tokens,
                                 args.attention_backend)
                    r["seconds"] = round(time.time() - t0, 1)
                    results.append(r)
                    print(json.dumps(r), flush=True)
                    if dtype == "float32" and r["identical"] != len(r["first_divergence"]):
                        failed = True
    summary = {
        "float32_all_identical": not failed,
        "cases": len(results),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
    }
    print("SUMMARY " + json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
