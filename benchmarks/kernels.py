"""Kernel benchmarks for the GPU machine; prints one JSON document.

    python -m benchmarks.kernels                 # everything, on cuda:0
    python -m benchmarks.kernels --only decode   # decode | prefill | moe | moe-sweep | sampling | gemv (comma-separated)
    python -m benchmarks.kernels --smoke         # tiny shapes on CPU under TRITON_INTERPRET=1

Every figure comes with its floor, measured in the same run on the same device:

- decode attention: achieved bandwidth over the bytes that must move (K and V of every
  context, plus q, out and block tables) against a device-to-device copy;
- prefill attention: TFLOP/s (causal, 4 * S^2 / 2 * D * H) against a bf16 matmul;
- fused MoE at Qwen3-30B-A3B shapes (128 experts, top-8, hidden 2048, intermediate 768):
  TFLOP/s against a dense bf16 matmul of the same FLOPs ([T*k, H] x [H, 3I]);
- sampling (vocabulary 151936, bf16 logits, temperature 0.6): the fused kernel against the
  engine's torch sampler on the same batch, and its read of the logits against a copy;
- gemv (batch-1 projections of Llama-3-8B): the kernel against torch.matmul on the same
  operands, and its read of the weights against a copy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch


def make_timer(device: torch.device):
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3

    def cpu(fn):  # smoke mode: one warm-up, one timed call
        fn()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    return cpu


def graphed(fn, device: torch.device):
    """fn captured as a CUDA graph and replayed: the GPU time of its kernels without the
    Python launch overhead of the wrappers (which would otherwise show through at small
    shapes), as the engine runs decode steps."""
    if device.type != "cuda":
        return fn
    fn()  # compile outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth(device, timer, nbytes: int) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    return {"bytes": nbytes, "seconds": t, "GB_per_s": 2 * nbytes / t / 1e9}


def matmul_rate(device, timer, n: int, dtype) -> dict:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    # the best of three: it moved by 10% between calls on an H200 (707 and 780 TFLOP/s), and
    # the attention kernels are judged against what the tensor cores can do, not a slow moment
    t = min(timer(lambda: a @ b) for _ in range(3))
    return {"shape": [n, n, n], "seconds": t, "TFLOP_per_s": 2 * n**3 / t / 1e12}


def _paged_cache(batch, ctx, kv_heads, head_dim, page, dtype, device, gen):
    blocks_per_seq = -(-ctx // page)
    num_blocks = batch * blocks_per_seq
    cache = torch.randn((2, num_blocks, page, kv_heads, head_dim), dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, generator=gen).to(device=device, dtype=torch.int32)
    return cache, perm.view(batch, blocks_per_seq)


def decode_case(device, timer, batch, ctx, heads, kv_heads, head_dim=128, page=16, dtype=torch.bfloat16,
                lengths: list[int] | None = None, work_per_sm: int | None = None) -> dict:
    """Every sequence `ctx` long, or `lengths` (then ctx is their maximum). The plan is made
    once, as the engine makes it once per step for all layers; work_per_sm overrides its
    granularity (the sweep)."""
    from pagoda_kernels.decode_attention import (
        WORK_PER_SM,
        decode_block_n,
        paged_decode_attention,
        plan_decode,
    )

    gen = torch.Generator().manual_seed(0)
    cache, tables = _paged_cache(batch, ctx, kv_heads, head_dim, page, dtype, device, gen)
    lens = lengths or [ctx] * batch
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn((batch, heads, head_dim), dtype=dtype, device=device)
    out = torch.empty_like(q)
    block_n = decode_block_n(head_dim, dtype)
    plan = plan_decode(seq_lens, kv_heads, block_n, work_per_sm or WORK_PER_SM)
    t = timer(graphed(lambda: paged_decode_attention(q, cache, tables, seq_lens, head_dim**-0.5, plan=plan, out=out),
                      device))
    elem = cache.element_size()
    moved = (2 * sum(lens) * kv_heads * head_dim * elem + 2 * q.numel() * elem
             + tables.numel() * 4 + seq_lens.numel() * 4)
    return {"batch": batch, "context": ctx if lengths is None else f"{min(lens)}..{max(lens)}", "heads": heads,
            "kv_heads": kv_heads, "head_dim": head_dim, "block_size": page,
            "work_per_sm": work_per_sm or WORK_PER_SM, "chunks": int(plan.chunk_ends[-1]),
            "max_chunk_tiles": int(plan.chunk_tiles.max()), "seconds": t, "bytes": moved, "GB_per_s": moved / t / 1e9}


def causal_flops(tokens: int, heads: int, head_dim: int) -> float:
    """Causal attention over `tokens`: QK^T and PV (2 x 2 FLOPs a multiply-add), half the square."""
    return 4 * tokens * tokens / 2 * head_dim * heads


def prefill_case(device, timer, tokens, heads, kv_heads, head_dim=128, page=16, dtype=torch.bfloat16,
                 paged=True, tiles: dict | None = None) -> dict:
    """tiles: block_m / block_n / num_warps / num_stages overrides (the sweep)."""
    from pagoda_kernels.prefill_attention import paged_prefill_attention, varlen_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn((tokens, heads, head_dim), dtype=dtype, device=device)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    if paged:
        cache, tables = _paged_cache(1, tokens, kv_heads, head_dim, page, dtype, device, gen)
        seq_lens = torch.tensor([tokens], dtype=torch.int32, device=device)
        fn = lambda: paged_prefill_attention(q, cache, tables, qsl, seq_lens, head_dim**-0.5,  # noqa: E731
                                             max_query_len=tokens, out=out, **(tiles or {}))
    else:
        k = torch.randn((tokens, kv_heads, head_dim), dtype=dtype, device=device)
        v = torch.randn_like(k)
        fn = lambda: varlen_attention(q, k, v, qsl, head_dim**-0.5, max_query_len=tokens, out=out,  # noqa: E731
                                      **(tiles or {}))
    t = timer(fn)
    flops = causal_flops(tokens, heads, head_dim)
    return {"tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "paged": paged,
            "causal": True, "tiles": tiles or "default", "seconds": t, "flops": flops, "TFLOP_per_s": flops / t / 1e12}


def fa3_prefill_case(device, timer, tokens, heads, kv_heads, head_dim, mm) -> dict:
    """vLLM's FlashAttention 3 on the prefill sweep's paged case (the kit's vLLM on PYTHONPATH):
    the rate to reach. An error when it does not import or run is a result too."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        gen = torch.Generator().manual_seed(0)
        cache, tables = _paged_cache(1, tokens, kv_heads, head_dim, 16, torch.bfloat16, device, gen)
        q = torch.randn((tokens, heads, head_dim), dtype=torch.bfloat16, device=device)
        cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        used = torch.tensor([tokens], dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        t = timer(lambda: flash_attn_varlen_func(q, cache[0], cache[1], max_seqlen_q=tokens, cu_seqlens_q=cu,
                                                 max_seqlen_k=tokens, seqused_k=used, softmax_scale=head_dim**-0.5,
                                                 causal=True, block_table=tables, out=out, fa_version=3))
        flops = causal_flops(tokens, heads, head_dim)
        return {"tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "paged": True,
                "seconds": t, "TFLOP_per_s": flops / t / 1e12, "fraction_of_matmul": flops / t / 1e12 / mm["TFLOP_per_s"]}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def moe_case(device, timer, tokens, experts=128, top_k=8, hidden=2048, inter=768, dtype=torch.bfloat16,
             config: dict | None = None, vllm: bool = False) -> dict:
    """Pagoda's fused MoE (with `config`: those tiles for both GEMMs), or with `vllm` vLLM's
    `fused_experts` (the kit's, on PYTHONPATH) on the same inputs: the rate to reach."""
    from pagoda_kernels.fused_moe import fused_moe, route_topk

    x = torch.randn((tokens, hidden), dtype=dtype, device=device)
    w13 = torch.randn((experts, 2 * inter, hidden), dtype=dtype, device=device) * hidden**-0.5
    w2 = torch.randn((experts, hidden, inter), dtype=dtype, device=device) * inter**-0.5
    logits = torch.randn((tokens, experts), dtype=dtype, device=device)
    weights, ids = route_topk(logits, top_k, True)
    flops = 6 * tokens * top_k * hidden * inter
    if vllm:
        try:
            from vllm.model_executor.layers.fused_moe import fused_experts

            t = timer(lambda: fused_experts(x, w13, w2, weights, ids))
        except Exception as e:
            return {"tokens": tokens, "engine": "vllm", "error": f"{type(e).__name__}: {str(e)[:300]}"}
        return {"tokens": tokens, "engine": "vllm", "seconds": t, "TFLOP_per_s": flops / t / 1e12}
    t = timer(lambda: fused_moe(x, w13, w2, weights, ids, config=config))
    if config is not None:
        return {"tokens": tokens, "config": config, "seconds": t, "TFLOP_per_s": flops / t / 1e12}
    t_route = timer(lambda: route_topk(logits, top_k, True))
    a = torch.randn((tokens * top_k, hidden), dtype=dtype, device=device)
    b = torch.randn((hidden, 3 * inter), dtype=dtype, device=device)
    t_dense = timer(lambda: a @ b)
    return {"tokens": tokens, "experts": experts, "top_k": top_k, "hidden": hidden, "intermediate": inter,
            "seconds": t, "routing_seconds": t_route, "flops": flops, "TFLOP_per_s": flops / t / 1e12,
            "dense_same_flops_TFLOP_per_s": flops / t_dense / 1e12, "fraction_of_dense": t_dense / t}


def sampling_case(device, timer, batch, vocab, temperature=0.6, dtype=torch.bfloat16) -> dict:
    """The engine's torch sampler (`Sampler(fused=False)`) and the fused kernel on one batch of
    temperature-only rows; the kernel's GB/s counts the logits it reads."""
    from pagoda_daemon.worker.sampler import Sampler, SamplingBatch
    from pagoda_kernels.sampling import sample_tokens

    logits = torch.randn((batch, vocab), dtype=dtype, device=device) * 4
    temp = torch.full((batch,), temperature, dtype=torch.float32, device=device)
    sampler, sbatch = Sampler(fused=False), SamplingBatch(temperature=temp, all_greedy=False)
    t_torch = timer(lambda: sampler(logits, sbatch))
    t = timer(lambda: sample_tokens(logits, temp, 1234))
    zeros = torch.zeros_like(temp)
    t_greedy = timer(lambda: sample_tokens(logits, zeros, 0))

    def host(fn, n=50 if device.type == "cuda" else 1):  # CPU time to issue one call (the engine's share)
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = (time.perf_counter() - start) / n
        if device.type == "cuda":
            torch.cuda.synchronize()
        return elapsed

    nbytes = logits.numel() * logits.element_size()
    return {"batch": batch, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."), "temperature": temperature,
            "torch_seconds": t_torch, "seconds": t, "bytes": nbytes, "GB_per_s": nbytes / t / 1e9,
            "speedup": t_torch / t, "greedy_seconds": t_greedy, "greedy_GB_per_s": nbytes / t_greedy / 1e9,
            "torch_host_seconds": host(lambda: sampler(logits, sbatch)),
            "host_seconds": host(lambda: sample_tokens(logits, temp, 1234))}


GEMV_SHAPES = {  # (N, K) of Llama-3-8B's projections at batch 1; down with the activation fused
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096),
}
GEMV_SWEEP = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st)
              for bn in (4, 8, 16) for bk in (256, 512, 1024) for w in (4, 8) for st in (1, 3)]


def gemv_case(device, timer, rows, n, k, dtype, silu_mul=False, tiles: dict | None = None) -> dict:
    """The skinny kernel against torch's matmul (cuBLAS) on the same operands, both replayed
    from CUDA graphs; GB/s over the weight bytes (what batch-1 decode must read)."""
    import torch.nn.functional as F

    from pagoda_kernels.activation import silu_and_mul
    from pagoda_kernels.gemv import gemv

    w = torch.randn((n, k), dtype=dtype, device=device) * k**-0.5
    x = torch.randn((rows, 2 * k if silu_mul else k), dtype=dtype, device=device)
    out = torch.empty((rows, n), dtype=dtype, device=device)
    t = timer(graphed(lambda: gemv(x, w, out=out, silu_mul=silu_mul, **(tiles or {})), device))
    act = torch.empty((rows, k), dtype=dtype, device=device)
    if silu_mul:
        t_ref = timer(graphed(lambda: torch.matmul(silu_and_mul(x, out=act), w.t(), out=out), device))
    else:
        t_ref = timer(graphed(lambda: torch.matmul(x, w.t(), out=out), device))
    ref = F.linear(silu_and_mul(x) if silu_mul else x, w).float()
    err = ((gemv(x, w, silu_mul=silu_mul, **(tiles or {})).float() - ref).norm() / ref.norm()).item()
    nbytes = w.numel() * w.element_size()
    return {"rows": rows, "n": n, "k": k, "silu_mul": silu_mul, "tiles": tiles or "default", "seconds": t,
            "torch_seconds": t_ref, "GB_per_s": nbytes / t / 1e9, "torch_GB_per_s": nbytes / t_ref / 1e9,
            "speedup": t_ref / t, "rel_err": err}


def run(only: set[str], smoke: bool) -> dict:
    device = torch.device("cpu" if smoke else "cuda")
    timer = make_timer(device)
    dtype = torch.float16 if smoke else torch.bfloat16  # the interpreter's bf16 dot is wrong
    report: dict = {
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "smoke": smoke,
    }
    if "decode" in only or "decode-mixed" in only or "prefill" in only:
        report["copy"] = copy_bandwidth(device, timer, 1 << 16 if smoke else 2 << 30)
    if "decode" in only:
        copy = report["copy"]["GB_per_s"]
        if smoke:
            shapes, table = [(2, 48, 4, 2)], [(b, c) for b in (1, 2) for c in (16, 40)]
        else:
            shapes = [(64, 4096, 16, 8), (64, 4096, 32, 8)]
            table = [(b, c) for b in (8, 16, 32, 64, 128, 256) for c in (512, 1024, 2048, 4096)]
        head = 64 if smoke else 128
        headline = []
        for b, c, h, kvh in shapes:
            r = decode_case(device, timer, b, c, h, kvh, head, dtype=dtype)
            r["fraction_of_copy"] = r["GB_per_s"] / copy
            headline.append(r)
        rows = []
        for b, c in table:
            r = decode_case(device, timer, b, c, 4 if smoke else 16, 2 if smoke else 8, head, dtype=dtype)
            r["fraction_of_copy"] = r["GB_per_s"] / copy
            rows.append(r)
        report["decode"] = {"headline": headline, "table": rows, "goal": ">= 0.90 of copy bandwidth"}
    if "decode-mixed" in only:  # what a serving batch looks like: lengths spread out
        import random

        copy = report["copy"]["GB_per_s"]
        rng = random.Random(0)
        rows = []
        for b in ((2,) if smoke else (8, 16, 32, 64, 128, 256)):
            lens = [rng.randint(100, 1100) if not smoke else rng.randint(8, 40) for _ in range(b)]
            for work_per_sm in (None, 4, 8, 32):
                r = decode_case(device, timer, b, max(lens), 4 if smoke else 16, 2 if smoke else 8,
                                64 if smoke else 128, dtype=dtype, lengths=lens, work_per_sm=work_per_sm)
                r["fraction_of_copy"] = r["GB_per_s"] / copy
                rows.append(r)
        report["decode_mixed"] = rows
    if "prefill" in only:
        mm = matmul_rate(device, timer, 64 if smoke else 8192, dtype)
        report["matmul"] = mm
        tokens, head = (48, 64) if smoke else (4096, 128)
        cases = [(4 if smoke else 32, 2 if smoke else 8), (4 if smoke else 16, 2 if smoke else 8)]
        rows = []
        for h, kvh in cases:
            for paged in (True, False):
                r = prefill_case(device, timer, tokens, h, kvh, head, dtype=dtype, paged=paged)
                r["fraction_of_matmul"] = r["TFLOP_per_s"] / mm["TFLOP_per_s"]
                rows.append(r)
        report["prefill"] = {"cases": rows, "goal": ">= 0.45 of the bf16 matmul rate"}
    if "prefill-sweep" in only:  # tile sizes of the 16 / 8-head case (the harder one), paged and contiguous
        mm = report.get("matmul") or matmul_rate(device, timer, 64 if smoke else 8192, dtype)
        report["matmul"] = mm
        # block_m: rows of a tile (tokens times the 2 query heads of a KV head)
        sweep = [dict(block_m=16, block_n=16, num_warps=4, num_stages=1)] if smoke else [
            dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
            for bm, bn, w, st in ((64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3),
                                  (128, 128, 8, 2), (128, 32, 4, 3), (64, 128, 4, 2), (256, 64, 8, 2),
                                  (128, 64, 8, 4))]
        rows = []
        for paged in (True, False):
            for tiles in sweep:
                try:
                    r = prefill_case(device, timer, 48 if smoke else 4096, 4 if smoke else 16, 2 if smoke else 8,
                                     64 if smoke else 128, dtype=dtype, paged=paged, tiles=tiles)
                    r["fraction_of_matmul"] = r["TFLOP_per_s"] / mm["TFLOP_per_s"]
                except Exception as e:  # a config that does not compile (shared memory) is a result too
                    r = {"tiles": tiles, "paged": paged, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                rows.append(r)
        report["prefill_sweep"] = rows
        if not smoke:
            report["prefill_fa3"] = fa3_prefill_case(device, timer, 4096, 16, 8, 128, mm)
    if "moe" in only:
        if smoke:
            rows = [moe_case(device, timer, 4, experts=8, top_k=2, hidden=64, inter=32, dtype=dtype)]
        else:
            rows = [moe_case(device, timer, t) for t in (16, 64, 256, 1024, 4096, 8192)]
        report["moe"] = rows
    if "moe-sweep" in only:  # tiles of the grouped GEMMs at prompt-sized steps (Qwen3-30B-A3B shape), vLLM beside
        keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
        sweep = [dict(zip(keys, c)) for c in ((16, 16, 16, 1, 4, 1),)] if smoke else [dict(zip(keys, c)) for c in (
            (64, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3), (128, 256, 64, 1, 8, 4), (128, 256, 64, 16, 8, 4),
            (128, 128, 64, 8, 8, 3))]  # the 64- and 128-row defaults first (2026-11-30's sweep had ten)
        rows = []
        for tokens in (16,) if smoke else (1024, 4096, 8192):
            shape = dict(experts=8, top_k=2, hidden=64, inter=32, dtype=dtype) if smoke else {}
            rows.append(moe_case(device, timer, tokens, vllm=True, **shape))
            for cfg in sweep:
                try:
                    rows.append(moe_case(device, timer, tokens, config=cfg, **shape))
                except Exception as e:  # a config that does not compile (shared memory) is a result too
                    rows.append({"tokens": tokens, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        report["moe_sweep"] = rows
    if "sampling" in only:
        copy = report.get("copy") or copy_bandwidth(device, timer, 1 << 16 if smoke else 2 << 30)
        report["copy"] = copy
        rows = [sampling_case(device, timer, b, 3000 if smoke else 151936) for b in ((1, 2) if smoke else (1, 64, 256))]
        for r in rows:
            r["fraction_of_copy"] = r["GB_per_s"] / copy["GB_per_s"]
        report["sampling"] = rows
    if "gemv" in only or "gemv-sweep" in only:
        copy = report.get("copy") or copy_bandwidth(device, timer, 1 << 16 if smoke else 2 << 30)
        report["copy"] = copy
        shapes = {"small": (40, 96)} if smoke else GEMV_SHAPES
        rows = []
        for name, (n, k) in shapes.items():
            for m in (1, 2, 4):
                r = gemv_case(device, timer, m, n, k, dtype, silu_mul=name == "down")
                rows.append({"name": name, **r, "fraction_of_copy": r["GB_per_s"] / copy["GB_per_s"],
                             "torch_fraction_of_copy": r["torch_GB_per_s"] / copy["GB_per_s"]})
        report["gemv"] = rows
        if "gemv-sweep" in only:
            sweep = []
            for name, (n, k) in shapes.items():
                for tiles in GEMV_SWEEP[:1] if smoke else GEMV_SWEEP:
                    try:
                        r = gemv_case(device, timer, 1, n, k, dtype, silu_mul=name == "down", tiles=tiles)
                        sweep.append({"name": name, "tiles": tiles, "fraction_of_copy": r["GB_per_s"] / copy["GB_per_s"],
                                      "torch_fraction_of_copy": r["torch_GB_per_s"] / copy["GB_per_s"]})
                    except Exception as e:  # a tile that does not fit is a result too
                        sweep.append({"name": name, "tiles": tiles, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            report["gemv_sweep"] = sweep
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="decode,prefill,moe,sampling,gemv")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (needs TRITON_INTERPRET=1)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--smoke runs the kernels on CPU: set TRITON_INTERPRET=1")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA (or ROCm) device; --smoke runs tiny shapes on CPU")
    report = run(set(args.only.split(",")), args.smoke)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
