"""On two or more GPUs: the all-reduce through the peers' memory (peer_all_reduce.py) gives
NCCL's sums on random inputs, eagerly and replayed from a CUDA graph on new inputs (three in a
row, one of them a matmul written straight into the buffer, the graph replayed back to back), in
bf16 and float32; the sum fused with the next RMSNorm gives NCCL's sum normed by the norm kernel; tensors it does not take (too large, another dtype), and those of eager steps,
are summed by NCCL.

Skipped where fewer than two GPUs are visible (CI; a one-GPU machine); run on the GPU machine
by `benchmarks/run_gpu.sh all-reduce`.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def _rank(rank: int, store: str, out: str, dtype: torch.dtype) -> None:
    from pagoda_daemon.distributed import peer_all_reduce
    from pagoda_daemon.distributed.parallel_state import TensorParallel

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2, device_id=device)
    group = dist.group.WORLD
    gen = torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(4), "little") + rank)
    checks: dict[str, bool] = {}
    # One buffer per process: a process sets up symmetric memory for a group's name once (the
    # second create() declines, see peer_all_reduce.create), so each dtype has its own world.
    peer = peer_all_reduce.create(group, 2, device, dtype)
    assert peer is not None
    tp = TensorParallel(rank, 2, group, peer=peer)
    for rows in (1, 7, 256):
        x = torch.randn(rows, 4096, generator=gen, device=device, dtype=dtype)
        expected = x.clone()
        dist.all_reduce(expected, group=group)
        checks[f"{dtype} {rows} eager"] = peer.takes(x) and torch.equal(peer(x.clone()), expected)
        checks[f"{dtype} {rows} eager steps by NCCL"] = torch.equal(tp.all_reduce(x.clone()), expected)
        # A graph of three all-reduces in a row (an odd count: it ends on slot 0), the second
        # of a matmul written straight into the buffer, replayed three times back to back
        # on new inputs: every sum must be NCCL's, none may read a slot being rewritten.
        w = torch.randn(4096, 4096, generator=gen, device=device, dtype=dtype) / 64
        graph, static, target = torch.cuda.CUDAGraph(), [], None
        tp.all_reduce(x)
        torch.mm(x, w)  # cuBLAS sets itself up outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph), tp.graph_capture():
            first = tp.all_reduce(x)
            target = tp.all_reduce_input((rows, 4096), dtype)
            second = tp.all_reduce(torch.mm(first, w, out=target))
            static = [first, second, tp.all_reduce(second * 0.5)]
        checks[f"{dtype} {rows} matmul written into the buffer"] = target is not None
        for replay in range(3):
            x.copy_(torch.randn(x.shape, generator=gen, device=device, dtype=dtype))
            graph.replay()
            expected = [x.clone()]
            dist.all_reduce(expected[0], group=group)
            expected.append(expected[0] @ w)
            dist.all_reduce(expected[1], group=group)
            expected.append(static[1] * 0.5)
            dist.all_reduce(expected[2], group=group)
            checks[f"{dtype} {rows} replay {replay}"] = all(map(torch.equal, static, expected))
    # The sum with the next RMSNorm's residual add and norm in one kernel (one program per row;
    # Qwen3-30B-A3B's rows of 2,048 and Llama-3-8B's of 4,096): NCCL's sum, then the norm kernel.
    from pagoda_kernels.rmsnorm import rmsnorm

    for rows, hidden in ((1, 2048), (256, 2048), (300, 4096)):
        x = torch.randn(rows, hidden, generator=gen, device=device, dtype=dtype)
        residual = torch.randn(rows, hidden, generator=gen, device=device, dtype=dtype)
        weight = 1 + 0.3 * torch.randn(hidden, generator=gen, device=device, dtype=dtype)
        checks[f"{dtype} {rows}x{hidden} eager: not fused"] = tp.sum_add_norm(x, residual, weight, 1e-6) is None
        graph = torch.cuda.CUDAGraph()
        peer.capturing = True  # both kernels compiled outside the capture, the ranks in step
        peer(x.clone())
        tp.sum_add_norm(x, residual, weight, 1e-6)
        peer.capturing, peer.calls = False, 0
        torch.cuda.synchronize()
        with torch.cuda.graph(graph), tp.graph_capture():
            fused = tp.sum_add_norm(x, residual, weight, 1e-6)
        for replay in range(2):
            x.copy_(torch.randn(x.shape, generator=gen, device=device, dtype=dtype))
            residual.copy_(torch.randn(x.shape, generator=gen, device=device, dtype=dtype))
            graph.replay()
            total = x.clone()
            dist.all_reduce(total, group=group)
            expected = rmsnorm(total, weight, 1e-6, residual=residual)
            checks[f"{dtype} {rows}x{hidden} sum, add and norm, replay {replay}"] = (
                fused is not None and torch.equal(fused[0], expected[0]) and torch.equal(fused[1], expected[1]))
    big = torch.randn(peer.max_numel + 4096, generator=gen, device=device, dtype=dtype)
    half = big.to(torch.float16)
    for name, t in (("too large", big), ("other dtype", half)):
        expected = t.clone()
        dist.all_reduce(expected, group=group)
        checks[f"{dtype} {name} by NCCL"] = not peer.takes(t) and torch.equal(tp.all_reduce(t.clone()), expected)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(checks, f)
    dist.barrier(group=group)
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_peer_all_reduce_equals_nccl(tmp_path, dtype):
    out = tmp_path / "checks.json"
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(out), dtype), nprocs=2, start_method="spawn")
    checks = json.loads(out.read_text())
    assert checks and all(checks.values()), {k: v for k, v in checks.items() if not v}
