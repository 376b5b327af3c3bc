"""What serving LoRA adapters costs: the same workload on the same random-weight model, as

    base      the engine without --enable-lora
    no-lora   --enable-lora with max_loras slots, every request on the base model
    lora      every request under one of ``--adapters`` adapters (round robin)

one configuration per process (each takes the GPU's memory), printing one RESULT line:

    python -m benchmarks.lora_bench benchmarks/configs/qwen3-0.6b --mode lora --max-loras 4 --rank 16

Adapters are written here in PEFT's file layout with random weights on every projection.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.throughput import add_engine_args, start_core, sync, workload


def write_random_adapter(model_config, out_dir: Path, rank: int, seed: int) -> Path:
    """A rank-``rank`` LoRA on every projection of every layer, as PEFT saves one."""
    from safetensors.torch import save_file

    from pagoda_daemon.lora.adapter import projection_shapes

    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for projection, (in_features, out_features) in projection_shapes(model_config).items():
            key = f"base_model.model.model.layers.{layer}.{projection}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) / rank**0.5
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    targets = sorted({p.rsplit(".", 1)[-1] for p in projection_shapes(model_config)})
    (out_dir / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    from pagoda_daemon.engine.request import Request
    from pagoda_daemon.lora.adapter import read_adapter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--mode", choices=("base", "no-lora", "lora"), required=True)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4, help="distinct adapters the requests use (lora mode)")
    ap.add_argument("--rounds", type=int, default=2, help="the workload this many times; the last is reported")
    args = ap.parse_args(argv)
    options = {} if args.mode == "base" else {"enable_lora": True, "max_loras": args.max_loras,
                                              "max_lora_rank": args.rank}
    core = start_core(args, **options)
    loras = []
    if args.mode == "lora":
        tmp = Path(tempfile.mkdtemp(prefix="pagoda-lora-"))
        for i in range(args.adapters):
            path = write_random_adapter(core.model_config, tmp / f"a{i}", args.rank, seed=i)
            loras.append(read_adapter(f"a{i}", str(path), core.model_config, args.rank).request())
    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len, args.temperature,
                               core.model_config.vocab_size, args.min_input_len, args.min_output_len)
    result: dict = {}
    for round_index in range(args.rounds):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            lora = loras[i % len(loras)] if loras else None
            core.add_request(Request(f"r{round_index}-{i}", p, sp, None, core.config.block_size, lora=lora))
        sync()
        start = time.perf_counter()
        generated = 0
        while core.has_unfinished_requests():
            generated += sum(len(o.new_token_ids) for o in core.step())
        sync()
        seconds = time.perf_counter() - start
        result = {"mode": args.mode, "round": round_index, "seconds": round(seconds, 3),
                  "output_tokens": generated, "output_tok_s": round(generated / seconds, 1),
                  "prompt_tokens": sum(map(len, prompts)), "max_loras": args.max_loras if options else None,
                  "rank": args.rank if options else None, "adapters": len(loras), "num_seqs": args.num_seqs}
        print("ROUND", json.dumps(result), flush=True)
    print("RESULT", json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
