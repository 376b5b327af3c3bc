"""The tensor-parallel all-reduce by size: NCCL against the reads of the peers' memory
(daemon/pagoda_daemon/distributed/peer_all_reduce.py) and torch's one-shot kernel, each captured
in a CUDA graph of back-to-back sums as the decode steps run them. Every size is first checked: the peers' sum
equals NCCL's on random inputs, eagerly and replayed from a graph on new inputs.

    python -m benchmarks.all_reduce [--ranks 2] [--dtype bfloat16]

Prints one RESULT line per size (rank 0's view; each figure is the mean over the replays).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_KIB = (64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
OPS_PER_GRAPH = 20
REPLAYS = 20


def _graphed(fn, x: torch.Tensor, around=contextlib.nullcontext) -> torch.cuda.CUDAGraph:
    for _ in range(2):  # warm-up outside the graph (NCCL and the kernels set themselves up)
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), around():
        for _ in range(OPS_PER_GRAPH):
            fn(x)
    return graph


def _one_shot(peer, x: torch.Tensor) -> torch.Tensor:
    """torch's one-kernel version over the same buffer (symm_mem.one_shot_all_reduce_copy_out)."""
    out = torch.empty_like(x)
    staged = peer.buffer[: x.numel()].view(x.shape)
    return torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", peer.group_name, out)


def _time_us(graph: torch.cuda.CUDAGraph, group) -> float:
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * OPS_PER_GRAPH)


def _rank(rank: int, ranks: int, store: str, dtype_name: str) -> None:
    from pagoda_daemon.distributed import peer_all_reduce

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=ranks,
                            device_id=device)
    group = dist.group.WORLD
    dtype = getattr(torch, dtype_name)
    peer = peer_all_reduce.create(group, ranks, device, dtype, max_bytes=SIZES_KIB[-1] * 1024)
    assert peer is not None, "the peers' memory could not be mapped"
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    for kib in SIZES_KIB:
        numel = kib * 1024 // torch.empty((), dtype=dtype).element_size()
        result: dict = {"bench": "all_reduce", "ranks": ranks, "dtype": dtype_name, "kib": kib,
                        "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}
        x = torch.randn(numel // 4096, 4096, generator=gen, device=device, dtype=dtype)
        expected = x.clone()
        dist.all_reduce(expected, group=group)
        if peer.takes(x):
            one_shot = functools.partial(_one_shot, peer)
            for method, fn in (("peer", peer), ("one_shot", one_shot)):
                result[f"{method}_equal_eager"] = bool(torch.equal(fn(x), expected))
                static_out: list[torch.Tensor] = []
                graph = torch.cuda.CUDAGraph()
                fn(x)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph), peer.graph_capture():
                    static_out.append(fn(x))
                fresh = torch.randn(x.shape, generator=gen, device=device, dtype=dtype)
                fresh_sum = fresh.clone()
                dist.all_reduce(fresh_sum, group=group)
                x_saved = x.clone()
                x.copy_(fresh)
                graph.replay()
                result[f"{method}_equal_replayed"] = bool(torch.equal(static_out[0], fresh_sum))
                x.copy_(x_saved)
                del graph
                result[f"{method}_us"] = round(_time_us(_graphed(fn, x, peer.graph_capture), group), 2)
        result["nccl_us"] = round(_time_us(_graphed(lambda t: dist.all_reduce(t, group=group), x.clone()), group), 2)
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
    dist.barrier(group=group)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = ap.parse_args()
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(args.ranks, os.path.join(tmp, "store"), args.dtype), nprocs=args.ranks,
                           start_method="spawn")


if __name__ == "__main__":
    main()
