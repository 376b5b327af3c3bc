"""Compile every kernel for a GPU target on a machine without a GPU, and report resources.

    python -m pagoda_kernels.compile_check cuda:90      # H100 (sm_90)
    python -m pagoda_kernels.compile_check hip:gfx942   # MI300

The interpreter tests check what the kernels compute; this checks that the compiled path
(what the interpreter never sees: constexpr folding, tensor-core dot shapes, loop-carried
types, the AMD backend) builds, for every head size, cache dtype, window and split mode
the wrappers can launch. On CUDA it also reports registers and stack (spills) per kernel
from the cubin. Launches are replaced by warm-up compiles through a stand-in driver, so it
leans on Triton internals (written against 3.9); a cold run takes minutes, a warm cache
seconds.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    spec = args[0] if args else "cuda:90"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this compiles the kernels", file=sys.stderr)
        return 2
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    kind, arch = spec.split(":")
    target = GPUTarget("cuda", int(arch), 32) if kind == "cuda" else GPUTarget("hip", arch, 64)

    class StandInDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return target

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(StandInDriver())
    compiled = []
    run = JITFunction.run

    def warmup_only(self, *a, grid, warmup, **kw):
        kernel = run(self, *a, grid=grid, warmup=True, **kw)
        keys = ("HEAD_DIM", "IS_FP8", "IEEE", "SLIDING_WINDOW", "PAGED", "BLOCK_M", "BLOCK_N", "RANKS", "BLOCK")
        compiled.append((self.fn.__name__, {k: kw[k] for k in keys if k in kw}, kernel))
        return kernel

    JITFunction.run = warmup_only
    try:
        _launch_everything(torch)
    finally:
        JITFunction.run = run  # the stand-in driver stays: this process has no GPU to go back to
    print(f"{len(compiled)} launches compiled for {spec}")
    if kind == "cuda":
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        worst: dict = collections.defaultdict(lambda: (0, 0, 0, None))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.cubin")
            for name, params, kernel in compiled:
                with open(path, "wb") as f:
                    f.write(kernel.asm["cubin"])
                out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
                regs = max(map(int, re.findall(r"REG:(\d+)", out)), default=-1)
                stack = max(map(int, re.findall(r"STACK:(\d+)", out)), default=-1)
                w = worst[name]
                worst[name] = (max(w[0], regs), max(w[1], stack), max(w[2], kernel.metadata.shared),
                               params if stack > w[1] else w[3])
        for name, (regs, stack, shared, params) in worst.items():
            print(f"{name:24s} max regs {regs:4d}  max stack {stack:5d} B  max shared {shared:6d} B"
                  + (f"  (most stack: {params})" if stack > 0 else ""))
    return 0


def _launch_everything(torch) -> None:
    from pagoda_kernels import (
        activation,
        cache_write,
        decode_attention,
        fused_moe,
        gemv,
        peer_sum,
        prefill_attention,
        rmsnorm,
        rope,
        sampling,
    )
    from pagoda_kernels.reference import rope_cos_sin_ref

    bf16 = torch.bfloat16
    for d in (64, 80, 96, 128, 256):
        for cache_dtype in (bf16, torch.float16, torch.float8_e4m3fn, torch.float32):
            q_dtype = cache_dtype if cache_dtype in (torch.float16, torch.float32) else bf16
            cache = torch.zeros(2, 8, 16, 8, d, dtype=cache_dtype)
            tables = torch.zeros(2, 4, dtype=torch.int32)
            seq_lens = torch.tensor([20, 30], dtype=torch.int32)
            qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
            q = torch.zeros(2, 32, d, dtype=q_dtype)
            kv = torch.zeros(2, 8, d, dtype=q_dtype)
            for window in (None, 100):
                decode_attention.paged_decode_attention(q, cache, tables, seq_lens, 0.1, window, 0.5, 0.5)
                prefill_attention.paged_prefill_attention(q, cache, tables, qsl, seq_lens, 0.1, window, 0.5, 0.5,
                                                          max_query_len=1)
                prefill_attention.varlen_attention(q, kv, kv, qsl, 0.1, window, max_query_len=1)
            cache_write.write_kv_cache(kv, kv, cache, torch.zeros(2, dtype=torch.int64), 0.5, 0.5)
        cos, sin = rope_cos_sin_ref(d, 16)
        for norm in ([], [torch.zeros(d, dtype=bf16)] * 2):  # plain, and with Qwen3's q/k norm
            rope.rope_neox(torch.zeros(2, dtype=torch.int64), torch.zeros(2, 32, d, dtype=bf16),
                           torch.zeros(2, 8, d, dtype=bf16), cos, sin, None, None, *norm)
    for hidden in (2048, 4096, 8192):
        x = torch.zeros(2, hidden, dtype=bf16)
        rmsnorm.rmsnorm(x, torch.zeros(hidden, dtype=bf16), 1e-6, x)
        rmsnorm.rmsnorm(x, torch.zeros(hidden, dtype=bf16), 1e-6)
    activation.silu_and_mul(torch.zeros(2, 1536, dtype=bf16))
    for rows in (1, 2, 4):
        w = torch.zeros(4096, 2048, dtype=bf16)
        gemv.gemv(torch.zeros(rows, 2048, dtype=bf16), w, torch.zeros(4096, dtype=bf16))
        gemv.gemv(torch.zeros(rows, 4096, dtype=bf16), w, silu_mul=True)
    for logits_dtype in (bf16, torch.float16, torch.float32):
        for rows in (1, 256):  # one chunk per row (direct) and several (two stages)
            sampling.sample_tokens(torch.zeros(rows, 151936 if rows > 1 else 2000, dtype=logits_dtype),
                                   torch.zeros(rows), seed=1)
    for tokens in (4, 512, 1024, 4096):  # moe_align: one program up to 512 tokens at top-8, three kernels past
        # it; from 4,096 tokens (256 rows an expert) the grouped GEMMs take their large tiles
        x = torch.zeros(tokens, 2048, dtype=bf16)
        ids = torch.zeros(tokens, 8, dtype=torch.int32)
        fused_moe.fused_moe(x, torch.zeros(128, 1536, 2048, dtype=bf16), torch.zeros(128, 2048, 768, dtype=bf16),
                            torch.zeros(tokens, 8), ids)
    fused_moe.route_topk(torch.zeros(4, 128, dtype=bf16), 8, True)
    for dtype in (bf16, torch.float32):
        for ranks in (2, 4, 8):
            addresses = torch.zeros(ranks, dtype=torch.int64)
            peer_sum.peer_sum(addresses, addresses, 0, torch.zeros(256 * 4096, dtype=dtype))
            for hidden in (2048, 4096, 8192):
                x, w = torch.zeros(256, hidden, dtype=dtype), torch.zeros(hidden, dtype=dtype)
                peer_sum.peer_sum_add_norm(addresses, addresses, 0, x, w, 1e-6, x, x)


if __name__ == "__main__":
    raise SystemExit(main())
