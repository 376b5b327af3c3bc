"""Issue #20 probe: can a mixed step's decode rows run beside its prompt rows on the GPU?

One mixed step of the prefill-heavy workload at the Qwen3-0.6B shape (28 layers, hidden 1,024,
16 query / 8 KV heads of 128, MLP 3,072): a prompt micro-batch of P tokens (two fresh prompts)
and a decode micro-batch of D sequences of C context tokens. Times, per step (28 layers):
serial (what a mixed step does now), attention only on two streams, the two micro-batches on two
streams through all layers (eager, and with the decode micro-batch as a CUDA graph). With
--green-sms, the micro-batches also on shares of the SMs: each alone in a green context, and both
at once on two disjoint partitions.

    python -m benchmarks.overlap_probe --prompt-tokens 8092 --decodes 100 --context 4240 --green-sms 32,40
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.kernels import graphed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=8092)
    ap.add_argument("--decodes", type=int, default=100)
    ap.add_argument("--context", type=int, default=4240)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--green-sms", default="",
                    help="comma-separated SM counts: time the decode micro-batch confined to that many SMs and "
                    "the prompt micro-batch to the rest (CUDA green contexts), each alone and both at once")
    args = ap.parse_args()

    from pagoda_kernels.decode_attention import decode_block_n, paged_decode_attention, plan_decode
    from pagoda_kernels.prefill_attention import paged_prefill_attention

    dev = torch.device("cuda")
    dt = torch.bfloat16
    torch.manual_seed(0)
    H, KVH, HD, HID, INTER, PAGE = 16, 8, 128, 1024, 3072, 16
    P, D, C, L = args.prompt_tokens, args.decodes, args.context, args.layers
    halves = [P // 2, P - P // 2]
    # one cache for both micro-batches: D contexts, then the two prompts
    d_blocks = -(-C // PAGE)
    p_blocks = [-(-n // PAGE) for n in halves]
    num_blocks = D * d_blocks + sum(p_blocks)
    cache = torch.randn((2, num_blocks, PAGE, KVH, HD), dtype=dt, device=dev)
    perm = torch.randperm(num_blocks, device=dev).to(torch.int32)
    d_tables = perm[: D * d_blocks].view(D, d_blocks).contiguous()
    width = max(p_blocks)
    p_tables = torch.zeros((2, width), dtype=torch.int32, device=dev)
    start = D * d_blocks
    for i, nb in enumerate(p_blocks):
        p_tables[i, :nb] = perm[start:start + nb]
        start += nb
    d_lens = torch.full((D,), C, dtype=torch.int32, device=dev)
    p_lens = torch.tensor(halves, dtype=torch.int32, device=dev)
    p_qsl = torch.tensor([0, halves[0], P], dtype=torch.int32, device=dev)
    block_n = decode_block_n(HD, dt)
    plan = plan_decode(d_lens, KVH, block_n)
    scale = HD ** -0.5

    w = {name: torch.randn(shape, dtype=dt, device=dev) * 0.02 for name, shape in
         {"qkv": ((H + 2 * KVH) * HD, HID), "o": (HID, H * HD), "gu": (2 * INTER, HID), "d": (HID, INTER)}.items()}

    def buffers(rows: int) -> dict:
        return {"x": torch.randn((rows, HID), dtype=dt, device=dev), "q": torch.randn((rows, H, HD), dtype=dt, device=dev),
                "attn": torch.empty((rows, H, HD), dtype=dt, device=dev)}

    pb, db = buffers(P), buffers(D)

    def gemms_before(b):
        return F.linear(b["x"], w["qkv"])

    def gemms_after(b):
        h = F.linear(b["attn"].view(-1, H * HD), w["o"])
        gu = F.linear(h, w["gu"])
        g, u = gu.chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, w["d"])

    def prompt_attn():
        paged_prefill_attention(pb["q"], cache, p_tables, p_qsl, p_lens, scale, max_query_len=max(halves), out=pb["attn"])

    def decode_attn():
        paged_decode_attention(db["q"], cache, d_tables, d_lens, scale, plan=plan, out=db["attn"], block_n=block_n)

    def prompt_layer():
        gemms_before(pb); prompt_attn(); gemms_after(pb)  # noqa: E702

    def decode_layer():
        gemms_before(db); decode_attn(); gemms_after(db)  # noqa: E702

    side = torch.cuda.Stream(dev)
    main_stream = torch.cuda.current_stream(dev)

    def serial():
        for _ in range(L):
            # a mixed step's work one kernel after another (the engine runs one GEMM over all rows;
            # here each micro-batch has its own, as in the overlapped cases, to compare like with like)
            gemms_before(pb); gemms_before(db)  # noqa: E702
            decode_attn(); prompt_attn()  # noqa: E702
            gemms_after(pb); gemms_after(db)  # noqa: E702

    def attention_overlap(decode_first: bool):
        """The GEMMs over both micro-batches, then the two attentions on two streams."""
        def run():
            for _ in range(L):
                gemms_before(pb); gemms_before(db)  # noqa: E702
                side.wait_stream(main_stream)
                if decode_first:
                    with torch.cuda.stream(side):
                        decode_attn()
                    prompt_attn()
                else:
                    prompt_attn()
                    with torch.cuda.stream(side):
                        decode_attn()
                main_stream.wait_stream(side)
                gemms_after(pb); gemms_after(db)  # noqa: E702
        return run

    def microbatches(decode_first: bool):
        def run():
            side.wait_stream(main_stream)
            if decode_first:
                with torch.cuda.stream(side):
                    for _ in range(L):
                        decode_layer()
                for _ in range(L):
                    prompt_layer()
            else:
                for _ in range(L):
                    prompt_layer()
                    with torch.cuda.stream(side):
                        decode_layer()
            main_stream.wait_stream(side)
        return run

    def decode_only():
        for _ in range(L):
            decode_layer()

    def prompt_only():
        for _ in range(L):
            prompt_layer()

    replay_decode = graphed(decode_only, dev)  # the decode micro-batch as a CUDA graph

    def graphed_microbatches():
        side.wait_stream(main_stream)
        with torch.cuda.stream(side):
            replay_decode()
        prompt_only()
        main_stream.wait_stream(side)

    cases = {"serial": serial, "attention_overlap_prompt_first": attention_overlap(False),
             "attention_overlap_decode_first": attention_overlap(True),
             "microbatches_decode_first": microbatches(True), "microbatches_interleaved": microbatches(False),
             "microbatches_graphed_decode": graphed_microbatches, "prompt_only": prompt_only,
             "decode_only_eager": decode_only, "decode_only_graph": replay_decode,
             "decode_attention_only": lambda: [decode_attn() for _ in range(L)],
             "prompt_attention_only": lambda: [prompt_attn() for _ in range(L)]}
    result = {"prompt_tokens": P, "decodes": D, "context": C, "layers": L, "device": torch.cuda.get_device_name()}
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        result[name + "_ms"] = round(statistics.median(times), 3)
    print("RESULT", json.dumps(result), flush=True)
    if args.green_sms:
        sm_counts = [int(n) for n in args.green_sms.split(",")]
        confined({"decode_attention_only": cases["decode_attention_only"], "decode_only_eager": decode_only,
                  "prompt_only": prompt_only}, sm_counts, args.reps, result)
        split(decode_layer, prompt_layer, L, sm_counts, args.reps)


def _sm_partitions(decode_sms: int) -> tuple[int, int, int, int]:
    """Two disjoint SM partitions (decode_sms, and the rest) as green contexts; their streams.

    Through the CUDA driver API by ctypes: torch's GreenContext.create splits from the whole
    device each time, so two of them can share SMs. Returns (decode stream, decode SMs, prompt
    stream, prompt SMs); the streams are raw CUstream handles.
    """
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned CUresult {rc}")

    resource_bytes = 512  # CUdevResource is 144 bytes in CUDA 12 headers, more in later ones
    device = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    whole, part, rest = (ctypes.create_string_buffer(resource_bytes) for _ in range(3))
    check(cuda.cuDeviceGetDevResource(device, whole, 1), "cuDeviceGetDevResource")  # 1: SM
    groups = ctypes.c_uint(1)
    check(cuda.cuDevSmResourceSplitByCount(part, ctypes.byref(groups), whole, rest, 0, decode_sms),
          "cuDevSmResourceSplitByCount")
    out = []
    for resource in (part, rest):
        desc, green, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check(cuda.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1), "cuDevResourceGenerateDesc")
        check(cuda.cuGreenCtxCreate(ctypes.byref(green), desc, device, 1), "cuGreenCtxCreate")  # default stream
        check(cuda.cuGreenCtxStreamCreate(ctypes.byref(stream), green, 1, 0), "cuGreenCtxStreamCreate")  # non-blocking
        sms = ctypes.c_uint.from_buffer(resource, 96).value  # CUdevSmResource.smCount after type + padding
        out += [stream.value, sms]
    return out[0], out[1], out[2], out[3]


def split(decode_layer, prompt_layer, layers: int, sm_counts: list[int], reps: int) -> None:
    """The decode micro-batch on n SMs and the prompt micro-batch on the others, at the same time
    (a layer of each in turn, on the two partitions' streams)."""
    for n in sm_counts:
        row: dict = {"sms": n}
        try:
            d_handle, d_sms, p_handle, p_sms = _sm_partitions(n)
            row.update(decode_sms=d_sms, prompt_sms=p_sms)
            d_stream = torch.cuda.ExternalStream(d_handle)
            p_stream = torch.cuda.ExternalStream(p_handle)

            def layers_on(pairs):
                def run():
                    for _ in range(layers):
                        for stream, layer in pairs:
                            with torch.cuda.stream(stream):
                                layer()
                return run

            cases = {"decode_alone": layers_on([(d_stream, decode_layer)]),
                     "prompt_alone": layers_on([(p_stream, prompt_layer)]),
                     "both_at_once": layers_on([(d_stream, decode_layer), (p_stream, prompt_layer)])}

            def sync(streams=(d_stream, p_stream)) -> None:
                for stream in streams:
                    stream.synchronize()

            for name, fn in cases.items():
                row[name + "_ms"] = _host_timed_ms(fn, reps, sync)
        except Exception as e:  # a probe: report what the driver or a library refused
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        print("SPLIT", json.dumps(row), flush=True)


def confined(cases: dict, sm_counts: list[int], reps: int, base: dict) -> None:
    """Each case alone on n SMs (decode) or all SMs but n (prompt), through a CUDA green context.

    Each green context made this way is split from the whole device, so two of them can share
    SMs and the parts are not run at once here (split() does that); timed alone,
    max(decode on n, prompt on the rest) is what a disjoint split could reach at best.
    """
    from torch.cuda.green_contexts import GreenContext

    total = torch.cuda.get_device_properties(0).multi_processor_count
    for n in sm_counts:
        row: dict = {"sms": n, "total_sms": total}
        for name, fn in cases.items():
            count = total - n if name == "prompt_only" else n
            try:
                ctx = GreenContext.create(num_sms=count, device_id=0)
                enter = getattr(ctx, "set_context", None) or ctx.make_current
                leave = getattr(ctx, "pop_context", None) or ctx.pop_current
                enter()
                try:
                    row[f"{name}_on_{count}_sms_ms"] = _host_timed_ms(fn, reps, torch.cuda.synchronize)
                finally:
                    leave()
                row[f"{name}_all_sms_ms"] = base.get(name + "_ms")
            except Exception as e:  # a probe: report what the driver or a library refused
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
        print("GREEN", json.dumps(row), flush=True)


def _host_timed_ms(fn, reps: int, sync) -> float:
    """Median wall time of fn() in ms, synchronized by sync(): CUDA events belong to one context,
    and these cases run in green contexts."""
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


if __name__ == "__main__":
    main()
