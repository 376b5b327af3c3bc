"""The peer all-reduce's two slots (daemon/pagoda_daemon/distributed/peer_all_reduce.py), on CPU
under Triton's interpreter: two ranks' buffers in one process, rank 0's view. Consecutive sums
use the two slots in turn, a partial product written into the slot by the caller is not copied
again, and a capture that ends on slot 0 ends with a barrier. (The barrier is a cross-GPU kernel;
here a recorder stands in for it, one process having no one to wait for. The real thing runs in
tests/gpu/test_peer_all_reduce.py on two GPUs.)"""

from __future__ import annotations

import torch

from pagoda_daemon.distributed.parallel_state import TensorParallel
from pagoda_daemon.distributed.peer_all_reduce import PeerAllReduce


class BarrierRecorder:
    def __init__(self) -> None:
        self.channels: list[int] = []

    def barrier(self, channel: int) -> None:
        self.channels.append(channel)


def _two_ranks(numel: int) -> tuple[TensorParallel, torch.Tensor, BarrierRecorder]:
    mine, theirs = torch.empty(2 * numel), torch.empty(2 * numel)
    tables = torch.tensor([[b.data_ptr() + s * numel * 4 for b in (mine, theirs)] for s in (0, 1)])
    barriers = BarrierRecorder()
    peer = PeerAllReduce(mine, "0", barriers, tables)
    return TensorParallel(0, 2, None, peer=peer), theirs, barriers


def test_sums_alternate_slots_and_skip_the_copy_of_what_was_written_there(gen):
    numel, rows, cols = 4096, 8, 96
    tp, theirs, barriers = _two_ranks(numel)
    assert tp.all_reduce_input((rows, cols), torch.float32) is None  # not capturing: anywhere
    with tp.graph_capture():
        for call in range(5):
            slot = call % 2
            partner = torch.randn(rows * cols, generator=gen)
            theirs[slot * numel: slot * numel + rows * cols] = partner  # the other rank's part
            target = tp.all_reduce_input((rows, cols), torch.float32)
            assert target is not None and target.data_ptr() == tp.peer.buffer.data_ptr() + slot * numel * 4
            a, b = torch.randn(rows, 64, generator=gen), torch.randn(64, cols, generator=gen)
            mine = torch.mm(a, b, out=target) if call % 3 else torch.mm(a, b)  # in the slot, or copied there
            total = tp.all_reduce(mine)
            assert torch.equal(total, (mine.flatten().float() + partner).view(rows, cols))
        assert tp.all_reduce_input((numel + 1,), torch.float32) is None  # larger than a slot
        assert tp.all_reduce_input((rows, cols), torch.float16) is None
    assert barriers.channels == [0] * 5 + [1]  # one per sum; five ended on slot 0: one more


def test_a_capture_that_ends_on_slot_one_needs_no_closing_barrier(gen):
    tp, theirs, barriers = _two_ranks(1024)
    theirs.zero_()
    with tp.graph_capture():
        for _ in range(2):
            x = torch.randn(16, 32, generator=gen)
            assert torch.equal(tp.all_reduce(x), x)
    assert barriers.channels == [0, 0]
    with tp.graph_capture():  # every capture starts on slot 0
        assert tp.all_reduce_input((4,), torch.float32).data_ptr() == tp.peer.buffer.data_ptr()
