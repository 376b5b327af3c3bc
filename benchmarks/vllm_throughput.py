"""vLLM's side of benchmarks/throughput.py at a given parallelism: the nano-vllm workload
(seed 0, 256 sequences, input ids < 10000 with lengths uniform in [100, 1024], output lengths
uniform in [100, 1024], temperature 0.6, ignore_eos) on random (dummy) weights from
config.json, run with vLLM's own site-packages (0.26.0 from the anchor kit):

    PYTHONPATH=/tmp/vsite python3 -m benchmarks.vllm_throughput MODEL_DIR \
        [--tensor-parallel-size N] [--enable-expert-parallel]

The anchor kit's bench_vllm.py runs one GPU; this adds vLLM's parallel layouts so that a
Pagoda layout is compared with vLLM's same layout on the same machine. vLLM's
`--enable-expert-parallel` with tensor size N spreads the experts over N ranks and keeps
attention tensor-parallel: Pagoda's `--expert-parallel-size N` (docs/parallelism.md).
Prints one line prefixed RESULT, in benchmarks/throughput.py's fields where they exist.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks.throughput import add_workload_args, token_workload

for k, v in {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}.items():
    os.environ.setdefault(k, v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    add_workload_args(ap)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--backend", default="FLASH_ATTN")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's for the GPU")
    ap.add_argument("--profile-dir", default=None,
                    help="profile the timed run's engine steps with torch's profiler (vLLM's profiler_config); "
                    "each rank's kernel table goes to DIR/profiler_out_<rank>.txt")
    ap.add_argument("--profile-delay", type=int, default=40, help="engine steps before profiling starts")
    ap.add_argument("--profile-steps", type=int, default=20, help="engine steps profiled")
    a = ap.parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=a.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=a.max_model_len,
              generation_config="vllm", seed=0, attention_config={"backend": a.backend},
              gpu_memory_utilization=0.90, tensor_parallel_size=a.tensor_parallel_size,
              enable_expert_parallel=a.enable_expert_parallel,
              **({"max_num_batched_tokens": a.max_num_batched_tokens} if a.max_num_batched_tokens else {}),
              **({"profiler_config": {"profiler": "torch", "torch_profiler_dir": os.path.abspath(a.profile_dir),
                                      "torch_profiler_with_stack": False, "delay_iterations": a.profile_delay,
                                      "max_iterations": a.profile_steps}} if a.profile_dir else {}))
    init_s = time.perf_counter() - t0

    # nano-vllm bench.py's random stream, as the anchor's bench_vllm.py and throughput.py
    ids, lengths = token_workload(a.num_seqs, a.min_input_len, a.max_input_len, a.min_output_len, a.max_output_len)
    params = [SamplingParams(temperature=a.temperature, ignore_eos=True, max_tokens=n, detokenize=False)
              for n in lengths]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], SamplingParams(max_tokens=16, detokenize=False),
                 use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    if a.profile_dir:
        llm.start_profile()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    t = time.perf_counter() - t
    if a.profile_dir:
        llm.stop_profile()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({
        "engine": "vllm", "vllm": vllm.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
        "model": os.path.basename(os.path.normpath(a.model)), "tensor_parallel_size": a.tensor_parallel_size,
        "enable_expert_parallel": a.enable_expert_parallel, "num_seqs": a.num_seqs,
        "prompt_tokens": sum(map(len, ids)), "output_tokens_requested": sum(p.max_tokens for p in params),
        "output_tokens_generated": generated, "time_s": round(t, 3), "output_tok_per_s": round(generated / t, 1),
        "init_s": round(init_s, 1), "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": llm.llm_engine.vllm_config.scheduler_config.max_num_seqs,
        **({"profiled_steps": a.profile_steps} if a.profile_dir else {})}), flush=True)


if __name__ == "__main__":
    main()
