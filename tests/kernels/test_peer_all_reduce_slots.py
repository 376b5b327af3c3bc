"""The peer all-reduce (daemon/pagoda_daemon/distributed/peer_all_reduce.py) on CPU under Triton's
interpreter: two ranks in two processes, their buffers and signal pads in shared memory, so that
each sum's barrier really waits for the other rank's launch. Consecutive sums use the two slots
in turn and give both ranks the same sums, a partial product written into the slot by the caller
is not copied again, a capture that ends on slot 0 ends with a barrier, and every flag raised is
taken down. (On two GPUs, through NVLink: tests/gpu/test_peer_all_reduce.py.)"""

from __future__ import annotations

import multiprocessing
import os
import time

import torch

from pagoda_daemon.distributed.parallel_state import TensorParallel
from pagoda_daemon.distributed.peer_all_reduce import PeerAllReduce

NUMEL, ROWS, COLS, CALLS, MAX_PROGRAMS = 4096, 8, 96, 5, 4


def _inputs(seed: int, call: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s factors at ``call``: both processes can compute either rank's product."""
    gen = torch.Generator().manual_seed(seed + 10 * call + rank)
    return torch.randn(ROWS, 64, generator=gen), torch.randn(64, COLS, generator=gen)


def _rank(rank: int, seed: int, buffers: list[torch.Tensor], pads: list[torch.Tensor],
          results: torch.Tensor) -> None:
    import pagoda_kernels.peer_sum as kernel

    launches: list[int] = []
    summed = kernel.peer_sum

    def recorded(table, pad_table, r, out, *args, **kwargs):
        launches.append(out.numel())
        return summed(table, pad_table, r, out, *args, **kwargs)

    kernel.peer_sum = recorded
    tables = torch.tensor([[b.data_ptr() + s * NUMEL * 4 for b in buffers] for s in (0, 1)])
    peer = PeerAllReduce(buffers[rank], "0", None, tables, torch.tensor([p.data_ptr() for p in pads]), rank,
                         MAX_PROGRAMS)
    tp = TensorParallel(rank, 2, None, peer=peer)
    checks = [tp.all_reduce_input((ROWS, COLS), torch.float32) is None]  # not capturing: anywhere
    with tp.graph_capture():
        for call in range(CALLS):
            slot = call % 2
            target = tp.all_reduce_input((ROWS, COLS), torch.float32)
            checks.append(target is not None and target.data_ptr() == buffers[rank].data_ptr() + slot * NUMEL * 4)
            a, b = _inputs(seed, call, rank)
            mine = torch.mm(a, b, out=target) if call % 3 else torch.mm(a, b)  # in the slot, or copied there
            total = tp.all_reduce(mine)
            parts = [torch.mm(*_inputs(seed, call, r)) for r in range(2)]
            checks.append(torch.equal(total, parts[0] + parts[1]))  # float32, rank 0's part first
        checks.append(tp.all_reduce_input((NUMEL + 1,), torch.float32) is None)  # larger than a slot
        checks.append(tp.all_reduce_input((ROWS, COLS), torch.float16) is None)
    # one launch per sum (4 programs of 2,048 elements at most: 768 each), then, five having
    # ended on slot 0, an empty one: the closing barrier
    checks.append(launches == [ROWS * COLS] * CALLS + [0])
    with tp.graph_capture():  # every capture starts on slot 0
        checks.append(tp.all_reduce_input((4,), torch.float32).data_ptr() == buffers[rank].data_ptr())
    # The sum with the next RMSNorm's residual add and norm in one kernel takes its turn in the
    # slots as a plain sum does, and gives the sum's norm.
    from pagoda_kernels.rmsnorm import rmsnorm

    gen = torch.Generator().manual_seed(seed)
    residual, weight = torch.randn(ROWS, COLS, generator=gen), 1 + 0.3 * torch.randn(COLS, generator=gen)
    checks.append(tp.sum_add_norm(torch.mm(*_inputs(seed, 0, rank)), residual, weight, 1e-6) is None)  # eager: NCCL
    with tp.graph_capture():
        fused = tp.sum_add_norm(torch.mm(*_inputs(seed, CALLS, rank)), residual, weight, 1e-6)
        parts = [torch.mm(*_inputs(seed, CALLS, r)) for r in range(2)]
        expected = rmsnorm(parts[0] + parts[1], weight, 1e-6, residual=residual)
        checks.append(fused is not None and torch.equal(fused[0], expected[0]) and torch.equal(fused[1], expected[1]))
        target = tp.all_reduce_input((ROWS, COLS), torch.float32)
        checks.append(target is not None and target.data_ptr() == buffers[rank].data_ptr() + NUMEL * 4)  # slot 1 next
        checks.append(torch.equal(tp.all_reduce(torch.mm(*_inputs(seed, 0, rank), out=target)),
                                  torch.mm(*_inputs(seed, 0, 0)) + torch.mm(*_inputs(seed, 0, 1))))
    results[rank, :len(checks)] = torch.tensor(checks)
    results[rank, -1] = 1  # finished


def test_two_ranks_sum_in_alternate_slots_each_sum_behind_a_barrier():
    seed = int.from_bytes(os.urandom(4), "little")
    buffers = [torch.full((2 * NUMEL,), float("nan")).share_memory_() for _ in range(2)]
    pads = [torch.zeros(MAX_PROGRAMS * 2, dtype=torch.int32).share_memory_() for _ in range(2)]
    results = torch.zeros(2, 32, dtype=torch.bool).share_memory_()
    ctx = multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=_rank, args=(r, seed, buffers, pads, results)) for r in range(2)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + 120
    for p in ranks:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [p.pid for p in ranks if p.is_alive()]
    for p in ranks:
        p.kill()
    assert not hung, "a rank waited for the other's flag for two minutes"
    assert results[:, -1].all(), "a rank failed before its checks"
    checks = 1 + 2 * CALLS + 2 + 1 + 1 + 4
    assert results[:, :checks].all(), results[:, :checks]
    assert not any(p.any() for p in pads)  # every flag raised was taken down
