"""How fast host-memory KV blocks reach the GPU cache: the PCIe peak (one contiguous copy) beside
the host tier's load as the tree has it (``CpuStore.load``) and the kernel that reads the pinned
slots itself and writes each block where it goes (``pagoda_kernels.kv_copy``) at several program
counts, for scattered and consecutive slots.

    python3 -m benchmarks.kv_load_bandwidth --layers 28 --blocks 64,256,1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from pagoda_daemon.kv_offload.cpu import CpuStore, _on_device
from pagoda_kernels.kv_copy import load_blocks


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` on the current stream, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-blocks", type=int, default=4096)
    parser.add_argument("--slots", type=int, default=2048)
    parser.add_argument("--blocks", default="64,256,1024")
    parser.add_argument("--programs", default="0,32,132", help="kernel program counts to try (0: one per chunk)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--label", default="")
    args = parser.parse_args()

    device = torch.device("cuda")
    shape = (args.layers, 2, args.block_size, args.kv_heads, args.head_dim)
    kv_cache = torch.empty((args.layers, 2, args.gpu_blocks, *shape[2:]), dtype=torch.bfloat16, device=device)
    started = time.perf_counter()
    store = CpuStore(args.slots, shape, torch.bfloat16, device)
    store.data[0].view(torch.int16).random_(-(2**15), 2**15 - 1)  # fresh bits in every slot
    print(f"host tier: {args.slots} slots of {store.slot_bytes / 2**20:.2f} MiB in {time.perf_counter() - started:.1f} s")
    rng = torch.Generator().manual_seed(0)
    for n in map(int, args.blocks.split(",")):
        results = _measure(store, kv_cache, n, rng, [int(c) for c in args.programs.split(",")], args.repeats)
        for name, seconds in results.items():
            nbytes = n * store.slot_bytes
            line = {"label": args.label, "layers": args.layers, "blocks": n, "MiB": round(nbytes / 2**20, 1),
                    "method": name, "ms": round(seconds * 1e3, 3), "GB_per_s": round(nbytes / seconds / 1e9, 2)}
            print("RESULT " + json.dumps(line))


def _measure(store: CpuStore, kv_cache: torch.Tensor, n: int, rng: torch.Generator, programs: list[int],
             repeats: int) -> dict[str, float]:
    """Seconds to load ``n`` blocks each way, every kernel load checked bit for bit against the store's."""
    host = store.data[0]
    gpu_blocks = torch.randperm(kv_cache.shape[2], generator=rng)[:n].tolist()
    layouts = {"scattered": torch.randperm(store.num_slots, generator=rng)[:n].tolist(), "consecutive": list(range(n))}
    staging = torch.empty((n, *host.shape[1:]), dtype=host.dtype, device=kv_cache.device)
    results = {"memcpy": _time(lambda: staging.copy_(host[:n], non_blocking=True), repeats)}
    for layout, slots in layouts.items():
        results[f"store-{layout}"] = _time(lambda s=slots: store.load(s, kv_cache, gpu_blocks), repeats)
        expected = kv_cache[:, :, gpu_blocks].view(torch.int16).clone()  # bits: random ones hold NaNs
        for count in programs:
            kv_cache[:, :, gpu_blocks] = 0
            results[f"kernel-{layout}-programs{count}"] = _time(
                lambda s=slots, c=count: load_blocks(host, _on_device(s, kv_cache.device), kv_cache,
                                                     _on_device(gpu_blocks, kv_cache.device), max_programs=c), repeats)
            assert torch.equal(kv_cache[:, :, gpu_blocks].view(torch.int16), expected), f"{layout}, {count} programs"
    return results


if __name__ == "__main__":
    main()
