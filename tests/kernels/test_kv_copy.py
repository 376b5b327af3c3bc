"""The host tier's load kernel (pinned slots into the paged cache) against its twin, byte for byte."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interp import poisoned, randint, randn

from pagoda_kernels.kv_copy import load_blocks  # isort: skip
from pagoda_kernels.reference import load_blocks_ref  # isort: skip

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize(
    ("dtype", "layers", "block_size", "heads", "head_dim", "max_programs"),
    [
        (torch.float16, 3, 16, 2, 64, 0),  # pieces of 4 KiB: one chunk each
        (torch.float32, 2, 16, 8, 128, 0),  # pieces of 64 KiB: eight chunks each
        (torch.float32, 2, 16, 8, 128, 5),  # a few programs looping over every chunk
        (torch.float16, 1, 3, 1, 40, 2),  # a piece of 240 B: a masked chunk
        (FP8, 2, 16, 2, 96, 0),  # bytes: fp8 copies as it is
    ],
)
def test_load_blocks_matches_twin(gen, dtype, layers, block_size, heads, head_dim, max_programs):
    shape = (layers, 2, block_size, heads, head_dim)
    host = randn(gen, 12, *shape, scale=3.0).to(dtype)
    cache = poisoned((layers, 2, 9, block_size, heads, head_dim), dtype)
    slots = torch.randperm(12, generator=gen)[:5].tolist()
    blocks = torch.randperm(9, generator=gen)[:5].tolist()
    expected = cache.clone()
    load_blocks(host, torch.tensor(slots), cache, torch.tensor(blocks), max_programs=max_programs)
    load_blocks_ref(host, slots, expected, blocks)
    # byte for byte: the blocks nobody loaded must still hold the poison
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    for slot, block in zip(slots, blocks, strict=True):
        assert torch.equal(cache[:, :, block].view(torch.uint8), host[slot].view(torch.uint8))


def test_load_blocks_into_a_slice_of_layers(gen):
    """The host tier keeps layers in groups: a group's slots load into its layers of the cache."""
    host = randn(gen, 6, 2, 2, 4, 2, 16)  # a group of 2 layers
    cache = poisoned((5, 2, 7, 4, 2, 16), torch.float32)
    expected = cache.clone()
    slots, blocks = [*randint(gen, 0, 5, 1), 5], [6, 0]
    load_blocks(host, torch.tensor(slots), cache[2:4], torch.tensor(blocks))
    load_blocks_ref(host, slots, expected[2:4], blocks)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert cache[:2].isnan().all() and cache[4:].isnan().all()


def test_no_blocks_is_a_no_op(gen):
    cache = poisoned((2, 2, 3, 4, 1, 8), torch.float32)
    none = torch.tensor([], dtype=torch.long)
    load_blocks(randn(gen, 2, 2, 2, 4, 1, 8), none, cache, none)
    assert cache.isnan().all()
