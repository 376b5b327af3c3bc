"""Does pinning pay? Host-to-device copy bandwidth from pinned host memory
allocated before vs after applying this node's pinning plan.

    python -m pagoda_daemon.topology.bench_pinning --gpu 0 --sizes-mib 1,16,64,256 --repeats 30

Buffers are allocated in three states of the same process: `unpinned` (as the
process started, before the plan is applied: wherever the scheduler ran the
thread), `pinned` (after `apply_pinning`: on the GPU's NUMA node) and, on
multi-node machines, `remote` (the thread deliberately pinned to another node:
the worst case pinning protects against). Copies are timed with CUDA events,
the variants interleaved in every round so drift hits them alike, and the
median GB/s is reported with the NUMA node each buffer actually landed on
(from /proc/self/numa_maps). Prints one JSON object. Needs torch with CUDA;
importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any


def parse_maps(text: str) -> list[tuple[int, int]]:
    """/proc/self/maps address ranges."""
    ranges = []
    for line in text.splitlines():
        span = line.split(" ", 1)[0]
        lo, _, hi = span.partition("-")
        ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def parse_numa_maps(text: str) -> dict[int, dict[int, int]]:
    """/proc/self/numa_maps: VMA start address -> {NUMA node: pages}."""
    placement: dict[int, dict[int, int]] = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        nodes = {}
        for item in fields[1:]:
            key, _, value = item.partition("=")
            if key[:1] == "N" and key[1:].isdigit() and value.isdigit():
                nodes[int(key[1:])] = int(value)
        placement[int(fields[0], 16)] = nodes
    return placement


def pages_by_node(address: int) -> dict[int, int]:
    """NUMA placement of the mapping that holds `address` ({} when the kernel does not say)."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/self/numa_maps") as numa:
            ranges, placement = parse_maps(maps.read()), parse_numa_maps(numa.read())
    except OSError:
        return {}
    for lo, hi in ranges:
        if lo <= address < hi:
            return placement.get(lo, {})
    return {}


def gbps(size_bytes: int, milliseconds: float) -> float:
    return size_bytes / 1e9 / (milliseconds / 1e3)


def _allocate(torch: Any, sizes: Sequence[int]) -> dict[int, Any]:
    buffers = {}
    for size in sizes:
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        buf.fill_(1)  # touch every page from this thread
        buffers[size] = buf
    return buffers


def _time_copy(torch: Any, dst: Any, src: Any) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def run(gpu: int, sizes_mib: Sequence[int], repeats: int, policy: str) -> dict[str, Any]:
    import torch

    from pagoda_daemon.topology import apply_pinning, discover, plan_pinning

    if not torch.cuda.is_available():
        raise SystemExit("bench_pinning needs a CUDA device")
    topology = discover("/")
    plan = plan_pinning(topology, topology.visibility.visible_gpus, topology.allowed_cpus, policy)
    pin = plan.for_rank(gpu)
    start_affinity = frozenset(os.sched_getaffinity(0))
    sizes = [mib * 2**20 for mib in sizes_mib]
    torch.cuda.set_device(gpu)
    device_buffers = {size: torch.empty(size, dtype=torch.uint8, device="cuda") for size in sizes}

    variants: dict[str, dict[int, Any]] = {}
    remote = [
        n.cpus & start_affinity
        for n in topology.numa_nodes
        if pin.numa_node is not None and n.id != pin.numa_node and n.cpus & start_affinity
    ]
    if remote:  # the worst case: buffers first touched from another node
        os.sched_setaffinity(0, remote[0])
        variants["remote"] = _allocate(torch, sizes)
        os.sched_setaffinity(0, start_affinity)
    variants["unpinned"] = _allocate(torch, sizes)
    applied = apply_pinning(pin)
    variants["pinned"] = _allocate(torch, sizes)

    for size in sizes:  # warm-up
        for buffers in variants.values():
            _time_copy(torch, device_buffers[size], buffers[size])
    samples: dict[str, dict[int, list[float]]] = {v: {s: [] for s in sizes} for v in variants}
    for _ in range(repeats):
        for size in sizes:
            for name, buffers in variants.items():
                samples[name][size].append(_time_copy(torch, device_buffers[size], buffers[size]))

    results = []
    for name, buffers in variants.items():
        for size in sizes:
            ms = statistics.median(samples[name][size])
            results.append(
                {
                    "variant": name,
                    "sizeMiB": size // 2**20,
                    "medianMs": round(ms, 4),
                    "medianGBps": round(gbps(size, ms), 2),
                    "minGBps": round(gbps(size, max(samples[name][size])), 2),
                    "maxGBps": round(gbps(size, min(samples[name][size])), 2),
                    "pagesByNumaNode": {
                        str(k): v for k, v in pages_by_node(buffers[size].data_ptr()).items()
                    },
                }
            )
    median = {(r["variant"], r["sizeMiB"]): r["medianGBps"] for r in results}
    ratios = {  # median GB/s relative to the buffers allocated before pinning
        f"{name}/unpinned@{mib}MiB": round(median[(name, mib)] / median[("unpinned", mib)], 3)
        for name in variants
        if name != "unpinned"
        for mib in sizes_mib
    }
    props = torch.cuda.get_device_properties(gpu)
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": props.name,
        "cudaOrdinal": gpu,
        "gpu": pin.gpu,
        "gpuNumaNode": pin.numa_node,
        "numaNodes": len(topology.numa_nodes),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "repeats": repeats,
        "startAffinity": sorted(start_affinity),
        "appliedAffinity": sorted(applied) if applied else None,
        "plan": plan.to_dict(),
        "results": results,
        "ratios": ratios,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", type=int, default=0, help="CUDA device ordinal (= local rank)")
    parser.add_argument("--sizes-mib", default="1,16,64,256", help="comma-separated copy sizes in MiB")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--policy", default="auto")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sizes_mib.split(",") if x.strip()]
    if not sizes or min(sizes) <= 0 or args.repeats <= 0:
        parser.error("sizes and repeats must be positive")
    print(json.dumps(run(args.gpu, sizes, args.repeats, args.policy), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
