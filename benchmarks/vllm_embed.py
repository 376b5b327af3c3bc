"""vLLM's side of benchmarks/embed_bench.py: the same workloads on the same model shape (random
weights) through vLLM 0.26.0's offline ``LLM.embed`` (``runner="pooling"``: the model's default
pooling, unit length, as Pagoda's: the last token for a causal model, [CLS] for BERT), from the
anchor kit:

    PYTHONPATH=/tmp/vsite python3 -m benchmarks.vllm_embed MODEL_DIR --workloads short,long

(MODEL_DIR: config.json and a tokenizer, which vLLM's pooling runner loads.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.embed_bench import add_embed_args, prompts_of, time_rounds

for k, v in {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}.items():
    os.environ.setdefault(k, v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_embed_args(ap)
    args = ap.parse_args(argv)

    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=args.model, runner="pooling", load_format="dummy", dtype=args.dtype,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, seed=0, gpu_memory_utilization=0.90,
              attention_config={"backend": "FLASH_ATTN"})
    init_s = time.perf_counter() - started
    for name in args.workloads.split(","):
        time_rounds("vllm", name, prompts_of(name, args.rounds),
                    lambda prompts: sum(1 for o in llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                                             use_tqdm=False) if len(o.outputs.embedding)),
                    vllm=vllm.__version__, init_s=round(init_s, 1), model=os.path.basename(args.model), dtype=args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
