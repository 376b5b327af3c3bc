"""LoRA parity with transformers + PEFT: the same prompts under several adapters (and none) in one
batch, through the engine and through PEFT's own model on the same weights, greedy.

Helpers for tests/lora/test_lora_parity.py (CPU) and tests/gpu/test_lora_gpu.py (CUDA); the
adapters are real PEFT adapters with random weights, saved by PEFT and read through the same
path as a downloaded one.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_adapter(model_path: str, out_dir: str | Path, seed: int, rank: int, alpha: float,
                 targets: tuple[str, ...] = ALL_TARGETS, rslora: bool = False, std: float = 0.3) -> str:
    """A PEFT LoRA adapter of ``model_path`` with random A and B (B is zero in a fresh adapter,
    which would test nothing), saved by PEFT as a trained one is."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std / rank**0.5)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


@functools.lru_cache(maxsize=8)
def _peft_model(model_path: str, adapter_path: str | None, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # generate as the engine's ignore_eos does (else it may stop at 1)
    if adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_path)
    return model.to(device).eval()


def peft_greedy(model_path: str, adapter_path: str | None, prompt: list[int], max_new_tokens: int,
                device: str = "cpu") -> list[int]:
    """PEFT's greedy generate under the adapter (None: the base model), never stopping early."""
    from transformers import GenerationConfig

    model = _peft_model(model_path, adapter_path, device)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=2)
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return out[0, len(prompt):].tolist()


def engine_greedy(model_path: str, adapters: dict[str, str], jobs: list[tuple[list[int], str | None]],
                  max_tokens: int, **engine_args) -> tuple[list[list[int]], object]:
    """The engine's greedy tokens for every (prompt, adapter name or None), all in one batch;
    and the LLM, for what the caller checks next."""
    from pagoda_daemon.llm import LLM
    from pagoda_daemon.sampling_params import SamplingParams

    llm = LLM(model_path, enable_lora=True, **engine_args)
    loras = {name: llm.lora(name, path) for name, path in adapters.items()}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([p for p, _ in jobs], params, lora_request=[loras.get(a) if a else None for _, a in jobs])
    return [list(o.outputs[0].token_ids) for o in outs], llm


# Two logits closer than this are a tie in float32: the engine adds an adapter's product in another
# order than PEFT (every slot's rows, masked; the ranks' partial sums), so greedy may part there.
NEAR_TIE = 1e-4


def divergences(model_path: str, adapters: dict[str, str], jobs: list[tuple[list[int], str | None]],
                got: list[list[int]], max_tokens: int, device: str = "cpu") -> list[int | None]:
    """Per job, the first position where the engine and PEFT differ (None: identical, or parted
    at a near tie of PEFT's own top two logits, after which nothing is compared)."""
    out: list[int | None] = []
    for (prompt, name), tokens in zip(jobs, got, strict=True):
        adapter = adapters[name] if name else None
        want = peft_greedy(model_path, adapter, prompt, max_tokens, device)
        first = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b),
                     None if len(tokens) == len(want) else min(len(tokens), len(want)))
        if first is not None and first < min(len(tokens), len(want)):
            with torch.no_grad():
                logits = _peft_model(model_path, adapter, device)(
                    torch.tensor([prompt + want[:first]], device=device)).logits[0, -1].float()
            if (logits[want[first]] - logits[tokens[first]]).item() < NEAR_TIE:
                first = None
        out.append(first)
    return out
