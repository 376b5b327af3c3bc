"""End-to-end engine benchmarks on random-weight models (no download: config.json alone).

    # nano-vllm's workload: seed 0, 256 sequences, input/output lengths uniform in [100, 1024]
    python -m benchmarks.throughput MODEL_DIR
    # batch-1 decode latency (time per output token) for a 127-token prompt, 146 tokens out
    python -m benchmarks.throughput MODEL_DIR --latency
    # process start to ready (a child process builds the engine, captures graphs, warms up)
    python -m benchmarks.throughput MODEL_DIR --startup
    # torch-profiler trace of decode steps: host syncs per step, CPU vs GPU time per step
    python -m benchmarks.throughput MODEL_DIR --profile-steps 20 --trace-dir OUT

The workload and its random stream are those of the vLLM anchor (`bench_vllm.py` in the
shared anchors kit), token ids in and token ids out (vLLM runs with skip_tokenizer_init),
so the two figures compare one for one. Prints one JSON line prefixed RESULT.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from random import randint, seed

import torch

# Runtime API calls that block the host until the GPU catches up (a synchronous cudaMemcpy too).
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "hipStreamSynchronize", "hipDeviceSynchronize", "hipEventSynchronize", "hipMemcpy"}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The model, the engine's limits and the workload: what every end-to-end benchmark here takes."""
    ap.add_argument("model", help="a directory with config.json (weights are random)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    add_workload_args(ap)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The anchor's workload (:func:`token_workload`): sequences, prompt and output lengths, temperature."""
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-input-len", type=int, default=100)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--min-output-len", type=int, default=100)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.6)


def start_core(args, **options):
    """An engine core on random weights from :func:`add_engine_args`' arguments and `options`,
    warmed up, its start-up heap frozen as the server's engine core does."""
    from pagoda_daemon.config import EngineConfig
    from pagoda_daemon.engine.engine_core import EngineCore
    from pagoda_daemon.heap import freeze_startup_heap

    config = EngineConfig(
        model=args.model, load_format="dummy", dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
        gpu_memory_utilization=0.9, **options,
    )
    core = EngineCore(config)
    core.warm_up()
    freeze_startup_heap()
    return core


def build_core(args):
    return start_core(args, enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
                      async_scheduling=args.async_scheduling, tensor_parallel_size=args.tensor_parallel_size,
                      expert_parallel_size=args.expert_parallel_size, kv_offload_cpu_gib=args.kv_offload_cpu_gib,
                      # Only when asked, so that trees from before the option (run_gpu.sh's A/B bases) still run.
                      **({} if args.max_piecewise_graph_tokens is None
                         else {"max_piecewise_graph_tokens": args.max_piecewise_graph_tokens}),
                      **({} if args.num_kv_blocks is None else {"num_kv_blocks": args.num_kv_blocks}),
                      **({} if args.kv_offload_write_policy is None
                         else {"kv_offload_write_policy": args.kv_offload_write_policy}),
                      **({} if not args.eplb_step_interval else {
                          "enable_eplb": True, "eplb_step_interval": args.eplb_step_interval,
                          "num_redundant_experts": args.num_redundant_experts,
                          "eplb_async_steps": args.eplb_async_steps}))


def token_workload(num_seqs: int, min_input: int, max_input: int, min_output: int, max_output: int,
                   vocab_size: int = 10001) -> tuple[list[list[int]], list[int]]:
    """The anchor's random stream, the same for Pagoda and vLLM (vllm_throughput.py): all prompts'
    token ids first, then all output lengths (uniform from 100, or the given minimum: a
    prefill-heavy set). (Ids wrap around a vocabulary smaller than 10001, which only tiny
    smoke-test models have.)"""
    seed(0)
    prompts = [[randint(0, 10000) % vocab_size for _ in range(randint(min_input, max_input))] for _ in range(num_seqs)]
    return prompts, [randint(min_output, max_output) for _ in range(num_seqs)]


def workload(num_seqs: int, max_input: int, max_output: int, temperature: float, vocab_size: int,
             min_input: int = 100, min_output: int = 100):
    """:func:`token_workload` as Pagoda requests: prompts and their sampling parameters."""
    from pagoda_daemon.sampling_params import SamplingParams

    prompts, lengths = token_workload(num_seqs, min_input, max_input, min_output, max_output, vocab_size)
    return prompts, [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n) for n in lengths]


CLOCK_SAMPLE_STEPS = (0, 2, 5, 10, 20, 50, 200)


def sm_clock_mhz() -> int | None:
    """The GPU's SM clock now (NVML, through torch), or None where NVML is missing."""
    try:
        return torch.cuda.clock_rate()
    except Exception:  # pynvml absent, or not an NVIDIA GPU: a diagnostic, not a result
        return None


def run_requests(core, prompts, params, tag: str, clocks: dict | None = None,
                 step_log: list | None = None) -> tuple[int, list[float]]:
    """Add all requests, step until done; returns generated tokens and per-step wall times.
    With `clocks`, records the SM clock before some steps (a GPU idle before the run starts slow).
    With `step_log`, appends what each step scheduled (see :func:`step_record`)."""
    from pagoda_daemon.engine.request import Request

    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(Request(f"{tag}-{i}", p, sp, None, core.config.block_size))
    generated = 0
    step_times = []
    schedule = core.scheduler.schedule
    start = time.perf_counter()
    if step_log is not None:
        def logged_schedule():
            sched = schedule()
            step_log.append(step_record(core, sched, time.perf_counter() - start))
            return sched
        core.scheduler.schedule = logged_schedule
    try:
        while core.has_unfinished_requests():
            if clocks is not None and len(step_times) in CLOCK_SAMPLE_STEPS:
                clocks[len(step_times)] = sm_clock_mhz()
            t = time.perf_counter()
            for out in core.step():
                generated += len(out.new_token_ids)
            step_times.append(time.perf_counter() - t)
    finally:
        core.scheduler.schedule = schedule
    return generated, step_times


def step_record(core, sched, t: float) -> dict:
    """One scheduled step: when (s since the run's start; with async scheduling, a step is
    scheduled once the one before the previous has finished, so the gaps are GPU step times in
    steady state), its prompt rows (a prompt's chunk, or a recompute after preemption) and their
    tokens, its decode rows, and the queues and cache after."""
    prefill = [s.num_new_tokens for s in sched.scheduled
               if s.start < s.request.num_prompt_tokens or s.num_new_tokens > 1]  # > 1: a recompute
    return {"t": round(t, 5), "tokens": sched.num_scheduled_tokens, "prefill_rows": len(prefill),
            "prefill_tokens": sum(prefill), "decode_rows": len(sched.scheduled) - len(prefill),
            "preempted": len(sched.preempted_request_ids), "running": len(core.scheduler.running),
            "waiting": len(core.scheduler.waiting), "kv_usage": round(core.kv_cache.usage(), 4)}


def throughput(args) -> dict:
    """The workload, timed; with --rounds N, N times on the same engine (later rounds show what
    the first paid for kernels compiled during its run: `triton_compiles` per round)."""
    from pagoda_kernels.jit_watch import watch_compiles

    t0 = time.perf_counter()
    core = build_core(args)
    init_s = time.perf_counter() - t0
    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len, args.temperature,
                               core.model_config.vocab_size, args.min_input_len, args.min_output_len)
    rounds, step_times = [], []
    vocab = core.model_config.vocab_size
    for r in range(args.rounds):
        # fresh ids (same lengths): no offload tier can hand a later round what an earlier saved
        round_prompts = [[(t + r) % vocab for t in p] for p in prompts] if args.fresh_prompts_per_round else prompts
        sync()
        with watch_compiles() as compiles, gpu_kernel_profile(args.profile_run) as kernels, \
                host_stalls() as stalls:
            clocks: dict = {}
            t = time.perf_counter()
            step_log: list | None = [] if args.step_log and r == 0 else None
            generated, steps = run_requests(core, round_prompts, params, f"tput{r}",
                                            clocks if torch.cuda.is_available() else None, step_log)
            sync()
            elapsed = time.perf_counter() - t
        core.kv_cache.reset_prefix_cache()  # every round prefills from scratch
        if step_log is not None:
            with open(args.step_log, "w") as f:
                f.writelines(json.dumps(rec) + "\n" for rec in step_log)
        offload = core.connector.take_stats() if core.connector is not None else None
        balancer = core.make_stats().balancer if args.eplb_step_interval else None
        rounds.append({"time_s": round(elapsed, 3), "output_tok_per_s": round(generated / elapsed, 1),
                       **({"kv_offload_saved_bytes": offload.saved_bytes, "kv_offload_hits": offload.hits}
                          if offload is not None else {}),
                       **({"eplb_rebalances": balancer.rebalances, "eplb_slots_moved": balancer.slots_moved,
                           "eplb_imbalance_after": balancer.imbalance_after} if balancer is not None else {}),
                       "output_tokens_generated": generated, "steps": len(steps),
                       "triton_compiles": compiles.summary(), **stalls, **kernels,
                       **({"sm_clock_mhz_before_step": clocks} if clocks else {})})
        step_times.append(steps)
    if len(step_times) > 1 and len(step_times[0]) == len(step_times[1]):
        rounds[0]["excess_over_round_2_ms"] = excess_by_phase(step_times[0], step_times[1])
    first = rounds[0]
    return {
        "bench": "throughput", "num_seqs": args.num_seqs, "prompt_tokens": sum(map(len, prompts)),
        "output_tokens_requested": sum(p.max_tokens for p in params), **first,
        "init_s": round(init_s, 1), "cuda_graphs": core.worker_info.uses_cuda_graphs, "async_scheduling": core.async_scheduling,
        "preemptions": core.scheduler.stats.num_preemptions, "kv_blocks": core.kv_cache.num_blocks,
        **({"later_rounds": rounds[1:]} if len(rounds) > 1 else {}),
    }


def save_word_level_tokenizer(vocab_size: int, path: str) -> None:
    """A tokenizer that decodes every id of the model's vocabulary (one word per id): what the
    offline `LLM` needs beside random weights, which come with no tokenizer."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # single_word: as a plain special token, "w1" would be cut out of "w150" ("w1" + unknown), and
    # decoded prompts would not tokenize back to their ids
    eos = AddedToken("w1", single_word=True, special=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos).save_pretrained(path)


def offline(args) -> dict:
    """The workload through the offline `LLM`, as a user runs it: `--rounds` batches on one LLM,
    each timed (its first batch against its second is what the LLM's warm-up is for). With
    --skip-llm-warm-up, the LLM is built without it (the behaviour before it warmed up), for a
    baseline in the same run."""
    import tempfile

    from pagoda_daemon import LLM
    from pagoda_daemon.engine.engine_core import EngineCore
    from pagoda_daemon.models.loader import load_config
    from pagoda_kernels.jit_watch import watch_compiles

    if args.skip_llm_warm_up:
        EngineCore.warm_up = lambda self: None  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory(prefix="pagoda-tok-") as tokenizer:  # read while the LLM is built
        save_word_level_tokenizer(load_config(args.model).vocab_size, tokenizer)
        t0 = time.perf_counter()
        llm = LLM(args.model, tokenizer=tokenizer, load_format="dummy", dtype=args.dtype, device=args.device,
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager, seed=0)
        init_s = time.perf_counter() - t0
    core = llm.engine.core
    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len, args.temperature,
                               core.model_config.vocab_size)
    rounds = []
    for _ in range(args.rounds):
        sync()
        with watch_compiles() as compiles:
            t = time.perf_counter()
            outputs = llm.generate(prompts, params)
            sync()
            elapsed = time.perf_counter() - t
        core.kv_cache.reset_prefix_cache()
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        rounds.append({"time_s": round(elapsed, 3), "output_tok_per_s": round(generated / elapsed, 1),
                       "output_tokens_generated": generated, "triton_compiles": compiles.summary()["compiles"]})
    out = {"bench": "offline-llm", "llm_warm_up": not args.skip_llm_warm_up, "num_seqs": args.num_seqs,
           "init_s": round(init_s, 1), "rounds": rounds}
    if len(rounds) > 1:
        out["first_over_second"] = round(rounds[0]["output_tok_per_s"] / rounds[1]["output_tok_per_s"], 4)
    return out


def excess_by_phase(first: list[float], second: list[float]) -> dict:
    """Where the first round lost time to the second, step by step (both rounds schedule the
    same steps): the early steps are the prefill-heavy ones."""
    diff = [(a - b) * 1e3 for a, b in zip(first, second)]
    bounds = [(0, 50), (50, 200), (200, len(diff))]
    out = {f"steps {lo}-{hi - 1}": round(sum(diff[lo:hi]), 1) for lo, hi in bounds if lo < len(diff)}
    worst = sorted(range(len(diff)), key=lambda i: -diff[i])[:8]
    out["worst_steps"] = [[i, round(first[i] * 1e3, 2), round(second[i] * 1e3, 2)] for i in worst]
    return out


@contextmanager
def host_stalls():
    """What else can stall a step on the host: Python's garbage collector (time, full
    collections) and the CUDA caching allocator going to the driver (cudaMalloc calls, and
    retries after freeing its cache, which synchronise the device)."""
    result: dict = {}
    gc_ms, started, full = 0.0, 0.0, 0

    def on_gc(phase: str, info: dict) -> None:
        nonlocal gc_ms, started, full
        if phase == "start":
            started = time.perf_counter()
        else:
            gc_ms += (time.perf_counter() - started) * 1e3
            full += info.get("generation") == 2

    cuda = torch.cuda.is_available()
    before = torch.cuda.memory_stats() if cuda else {}
    gc.callbacks.append(on_gc)
    try:
        yield result
    finally:
        gc.callbacks.remove(on_gc)
    result["gc_ms"], result["gc_full_collections"] = round(gc_ms, 1), full
    if cuda:
        after = torch.cuda.memory_stats()
        for key, name in (("num_device_alloc", "cuda_mallocs"), ("num_alloc_retries", "allocator_retries")):
            result[name] = after.get(key, 0) - before.get(key, 0)


@contextmanager
def gpu_kernel_profile(enabled: bool):
    """GPU time per kernel over a whole run (torch profiler, device activity only), so that
    prefill and mixed steps count as well as the decode steps `--profile-steps` looks at."""
    result: dict = {}
    if not enabled or not torch.cuda.is_available():
        yield result
        return
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield result
    totals: Counter = Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            totals[e.name[:80]] += e.time_range.end - e.time_range.start
    gpu_ms = sum(totals.values()) / 1e3
    result["gpu_kernel_ms"] = {"total": round(gpu_ms, 1),
                               **{name: round(us / 1e3, 1) for name, us in totals.most_common(20)}}


def latency(args) -> dict:
    """One sequence: time per output token after the first (the decode steps alone)."""
    from pagoda_daemon.engine.request import Request
    from pagoda_daemon.sampling_params import SamplingParams

    core = build_core(args)
    seed(1)
    prompt = [randint(0, 10000) % core.model_config.vocab_size for _ in range(args.latency_prompt_len)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.latency_output_len)
    results = []
    for rep in range(args.repeats):
        core.add_request(Request(f"lat-{rep}", prompt, params, None, core.config.block_size))
        stamps = []
        sync()
        start = time.perf_counter()
        while core.has_unfinished_requests():
            if core.step():
                stamps.append(time.perf_counter())
        decode = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
        results.append({"ttft_ms": round((stamps[0] - start) * 1e3, 2), "tpot_ms": round(decode * 1e3, 3)})
        core.kv_cache.reset_prefix_cache()  # every repeat prefills from scratch
    from benchmarks.kernels import copy_bandwidth, make_timer

    # The floor: every weight byte read once per token at the copy rate measured now.
    # (A copy moves each byte twice, read and write; its GB/s counts both.)
    copy = copy_bandwidth(core.executor.worker.device, make_timer(core.executor.worker.device), 2 << 30)
    weights = sum(p.numel() * p.element_size() for p in core.executor.worker.runner.model.parameters())
    floor_ms = weights / (copy["GB_per_s"] * 1e9) * 1e3
    tpot = sorted(r["tpot_ms"] for r in results)[len(results) // 2]
    return {"bench": "latency", "prompt_len": len(prompt), "output_len": args.latency_output_len,
            "weight_bytes": weights, "copy_GB_per_s": round(copy["GB_per_s"], 1), "floor_ms": round(floor_ms, 3),
            "tpot_ms_median": tpot, "tpot_over_floor": round(tpot / floor_ms, 3), "runs": results,
            "cuda_graphs": core.worker_info.uses_cuda_graphs}


def startup(args) -> dict:
    """Wall time from launching a fresh Python process to an engine that has warmed up."""
    cmd = [sys.executable, "-m", "benchmarks.throughput", args.model, "--ready-only",
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--device", args.device]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    total = time.perf_counter() - t0
    child = {}
    for line in proc.stdout.splitlines():
        if line.startswith("READY "):
            child = json.loads(line[6:])
    if proc.returncode != 0 or not child:
        raise RuntimeError(f"startup child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return {"bench": "startup", "process_start_to_ready_s": round(total, 1), **child}


def ready_only(args) -> None:
    t_import = time.perf_counter()
    core = build_core(args)
    graphs = core.executor.worker.runner.cuda_graphs
    print("READY " + json.dumps({
        "engine_init_and_warmup_s": round(time.perf_counter() - t_import, 1),
        "graph_capture_s": round(graphs.capture_seconds, 1) if graphs else 0.0,
        "graphs": len(graphs.graphs) if graphs else 0,
    }), flush=True)


def profile(args) -> dict:
    """Profile steady decode steps: host syncs per step, and how much of a step the GPU is busy."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from pagoda_daemon.engine.request import Request
    from pagoda_daemon.sampling_params import SamplingParams

    core = build_core(args)
    prompts, _ = workload(args.num_seqs, args.max_input_len, args.max_output_len, args.temperature,
                          core.model_config.vocab_size)
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=10_000)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"prof-{i}", p, params, None, core.config.block_size))
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()  # all prefills done: what follows are decode-only steps
    for _ in range(5):
        core.step()
    sync()
    arrivals = prefill_arrivals(core, args)
    engine_ttft_ms = [arrivals() for _ in range(args.profile_steps)] if arrivals else []
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(args.profile_steps):
            if arrivals:  # a prompt arrives, and the steps until its first token are profiled
                arrivals()
            else:
                core.step()
        sync()
        wall = (time.perf_counter() - t) / args.profile_steps
    events = prof.events()
    syncs = Counter(e.name for e in events if e.name in SYNC_CALLS)
    copies = Counter(e.name for e in events if e.name in ("cudaMemcpyAsync", "hipMemcpyAsync"))
    # GPU busy time: the union of device activity intervals (kernels and copies), so that
    # "busy / wall" says how much of a step the GPU waits for the CPU.
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    gpu_us, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            gpu_us += hi - max(lo, end)
            end = hi
    kernels: Counter = Counter()
    labels = {}
    for e in events:
        if e.device_type.name == "CUDA":
            kernels[e.name[:60]] += (e.time_range.end - e.time_range.start) / 1e3 / args.profile_steps
        if e.name.startswith("pagoda."):
            labels[e.name] = labels.get(e.name, 0.0) + e.cpu_time_total / 1e3 / args.profile_steps
    top_ops = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:int(os.environ.get("PROFILE_TOP_OPS", "0"))]
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace_dir, "decode-steps.trace.json"))
    return {
        "bench": "profile", "batch": len(core.scheduler.running), "steps": args.profile_steps,
        "step_wall_ms": round(wall * 1e3, 3),
        "gpu_busy_ms_per_step": round(gpu_us / 1e3 / args.profile_steps, 3),
        "gpu_busy_fraction": round(gpu_us / 1e3 / args.profile_steps / (wall * 1e3), 3),
        "host_syncs_per_step": {k: v / args.profile_steps for k, v in syncs.items()},
        "async_copies_per_step": {k: v / args.profile_steps for k, v in copies.items()},
        "cpu_ms_per_step_by_phase": {k: round(v, 3) for k, v in sorted(labels.items())},
        "gpu_ms_per_step_by_kernel": {k: round(v, 3) for k, v in kernels.most_common(int(os.environ.get("PROFILE_TOP_KERNELS", "10")))},
        # where the host's time goes (self CPU time per op: Python-side launches show as their ops)
        "cpu_self_ms_per_step_by_op": {a.key[:60]: round(a.self_cpu_time_total / 1e3 / args.profile_steps, 3)
                                       for a in top_ops},
        "cpu_calls_per_step_by_op": {a.key[:60]: round(a.count / args.profile_steps, 1) for a in top_ops},
        "cuda_graphs": core.worker_info.uses_cuda_graphs, "async_scheduling": core.async_scheduling,
        **({"prefill_len": args.profile_prefill_len, "engine_ttft_ms": sorted(engine_ttft_ms),
            "step_wall_ms_is_per": "arrival (every step until the new prompt's first token)"} if arrivals else {}),
    }


MAX_STEPS_TO_FIRST_TOKEN = 10_000  # a prompt longer than the token budget takes several chunks, never this many


def prefill_arrivals(core, args):
    """With --profile-prefill-len: a function that adds one prompt of that many fresh tokens to
    the running batch and steps the engine until its first token comes out, returning how long
    that took (ms): the engine's TTFT at this load, without an HTTP server. None otherwise."""
    if not args.profile_prefill_len:
        return None
    from pagoda_daemon.engine.request import Request
    from pagoda_daemon.sampling_params import SamplingParams

    vocab = core.model_config.vocab_size
    g = torch.Generator().manual_seed(1)
    count = [0]

    def arrive() -> float:
        count[0] += 1
        rid = f"arrival-{count[0]}"
        prompt = torch.randint(0, vocab, (args.profile_prefill_len,), generator=g).tolist()
        t = time.perf_counter()
        core.add_request(Request(rid, prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1), None,
                                 core.config.block_size))
        for _ in range(MAX_STEPS_TO_FIRST_TOKEN):
            if any(o.request_id == rid for o in core.step()):
                return round((time.perf_counter() - t) * 1e3, 3)
        raise RuntimeError(f"no first token for {rid} in {MAX_STEPS_TO_FIRST_TOKEN} steps")

    return arrive


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks 1..N-1 start in processes of their own")
    ap.add_argument("--expert-parallel-size", type=int, default=1, help="MoE experts spread over this many ranks")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-piecewise-graph-tokens", type=int, default=None, help="the engine's default unless given")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--rounds", type=int, default=1, help="run the workload this many times on one engine")
    ap.add_argument("--fresh-prompts-per-round", action="store_true",
                    help="round r's prompt ids shifted by r (same lengths): nothing cached serves a later round")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="an exact KV cache size (e.g. the one vLLM reports beside it), not the memory budget's")
    ap.add_argument("--kv-offload-cpu-gib", type=float, default=0.0, help="KV offload to this much host memory")
    ap.add_argument("--kv-offload-write-policy", choices=("write-through", "write-back"), default=None,
                    help="when the host tier gets a copy of a block (the engine's default otherwise)")
    ap.add_argument("--eplb-step-interval", type=int, default=0, help="EPLB on, rebalancing every this many steps")
    ap.add_argument("--num-redundant-experts", type=int, default=0, help="with EPLB: extra expert slots")
    ap.add_argument("--eplb-async-steps", type=int, default=0, help="with EPLB: move the experts in the background")
    ap.add_argument("--profile-run", action="store_true", help="GPU time per kernel over each round")
    ap.add_argument("--step-log", default=None, metavar="FILE",
                    help="what each step of the first round scheduled, one JSON line a step")
    ap.add_argument("--offline-llm", action="store_true", help="the workload through the offline LLM, per round")
    ap.add_argument("--skip-llm-warm-up", action="store_true", help="with --offline-llm: build it without warm-up")
    ap.add_argument("--latency", action="store_true")
    ap.add_argument("--latency-prompt-len", type=int, default=127)
    ap.add_argument("--latency-output-len", type=int, default=146)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--startup", action="store_true")
    ap.add_argument("--ready-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile-steps", type=int, default=0)
    ap.add_argument("--profile-prefill-len", type=int, default=0,
                    help="with --profile-steps: each profiled unit is a prompt of this length arriving at the "
                         "running batch and the steps until its first token (engine TTFT reported)")
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--label", default="", help="copied into the RESULT line")
    args = ap.parse_args(argv)
    if args.profile_prefill_len < 0 or (args.profile_prefill_len and not args.profile_steps):
        ap.error("--profile-prefill-len takes a length >= 1, with --profile-steps")
    if args.ready_only:
        ready_only(args)
        return 0
    if args.offline_llm:
        result = offline(args)
    elif args.latency:
        result = latency(args)
    elif args.startup:
        result = startup(args)
    elif args.profile_steps:
        result = profile(args)
    else:
        result = throughput(args)
    result.update(model=os.path.basename(os.path.normpath(args.model)), dtype=args.dtype,
                  tensor_parallel_size=args.tensor_parallel_size, expert_parallel_size=args.expert_parallel_size,
                  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__,
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **({"label": args.label} if args.label else {}))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
