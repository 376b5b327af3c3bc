"""The all-reduce through the peers' memory stays out of the way where it cannot run: on CPU it
is never set up (gloo sums everything), and it takes only contiguous tensors of its dtype and
device that fit its buffer (the rest go to NCCL). On GPUs: tests/gpu/test_peer_all_reduce.py."""

from __future__ import annotations

import torch

from pagoda_daemon.distributed import peer_all_reduce
from pagoda_daemon.distributed.peer_all_reduce import PeerAllReduce


def test_not_set_up_off_the_gpu_or_alone():
    assert peer_all_reduce.create(None, 2, torch.device("cpu"), torch.float32) is None
    assert peer_all_reduce.create(None, 1, torch.device("cuda", 0), torch.bfloat16) is None
    assert peer_all_reduce.create(None, 2, torch.device("cuda", 0), torch.int64) is None


def test_takes_only_what_fits_its_buffer():
    peer = PeerAllReduce(torch.empty(2048, dtype=torch.bfloat16), "0", None, torch.zeros(2, 2, dtype=torch.int64),
                         torch.zeros(2, dtype=torch.int64), 0, 1)
    fits = torch.randn(4, 256).to(torch.bfloat16)
    assert peer.takes(fits)
    assert not peer.takes(torch.randn(5, 256).to(torch.bfloat16))  # larger than the buffer
    assert not peer.takes(torch.randn(4, 256))  # another dtype
    assert not peer.takes(torch.randn(256, 4).to(torch.bfloat16).t())  # not contiguous
    assert not peer.takes(torch.empty(0, dtype=torch.bfloat16))


def test_buffer_size_by_ranks():
    assert peer_all_reduce.max_bytes_for(2) > peer_all_reduce.max_bytes_for(8) > 0
