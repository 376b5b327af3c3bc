"""vLLM's side of benchmarks/lora_bench.py: the same workload on the same random-weight model and
the same random PEFT adapters, through vLLM 0.26.0's offline LLM (the anchor kit):

    PYTHONPATH=/tmp/vsite python3 -m benchmarks.vllm_lora benchmarks/configs/qwen3-0.6b --mode lora \
        --max-loras 4 --rank 16 --adapters 4

``base``: no LoRA; ``no-lora``: ``enable_lora`` and no request under an adapter; ``lora``: every
request under one of the adapters, round robin. The workload runs ``--rounds`` times on one
engine; one RESULT line reports the last, in lora_bench's fields.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.throughput import add_workload_args, token_workload

for k, v in {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}.items():
    os.environ.setdefault(k, v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    add_workload_args(ap)
    ap.add_argument("--mode", choices=("base", "no-lora", "lora"), required=True)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=4096)
    a = ap.parse_args(argv)

    import torch
    import vllm
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from benchmarks.lora_bench import write_random_adapter

    lora_options = {} if a.mode == "base" else {"enable_lora": True, "max_loras": a.max_loras,
                                                  "max_lora_rank": a.rank, "max_cpu_loras": max(a.adapters, 1)}
    started = time.perf_counter()
    llm = LLM(model=a.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=a.max_model_len,
              generation_config="vllm", seed=0, attention_config={"backend": "FLASH_ATTN"},
              gpu_memory_utilization=0.90, **lora_options)
    init_s = time.perf_counter() - started
    loras: list = []
    if a.mode == "lora":
        config = AutoConfig.from_pretrained(a.model)
        tmp = Path(tempfile.mkdtemp(prefix="vllm-lora-"))
        loras = [LoRARequest(f"a{i}", i + 1, str(write_random_adapter(config, tmp / f"a{i}", a.rank, seed=i)))
                 for i in range(a.adapters)]
    ids, lengths = token_workload(a.num_seqs, a.min_input_len, a.max_input_len, a.min_output_len, a.max_output_len)
    params = [SamplingParams(temperature=a.temperature, ignore_eos=True, max_tokens=n, detokenize=False)
              for n in lengths]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    result: dict = {}
    for round_index in range(a.rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        result = {"engine": "vllm", "vllm": vllm.__version__, "mode": a.mode, "round": round_index,
                  "seconds": round(seconds, 3), "output_tokens": generated,
                  "output_tok_s": round(generated / seconds, 1), "prompt_tokens": sum(map(len, ids)),
                  "max_loras": a.max_loras if lora_options else None, "rank": a.rank if lora_options else None,
                  "adapters": len(loras), "num_seqs": a.num_seqs, "init_s": round(init_s, 1)}
        print("ROUND", json.dumps(result), flush=True)
    print("RESULT", json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
