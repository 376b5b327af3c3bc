"""The host tier's copies: a step's blocks go in batches (one copy per run of consecutive host
slots), so the slot order a long-running LRU leaves behind must not mix blocks up."""

from __future__ import annotations

import pytest
import torch

from pagoda_daemon.kv_offload.cpu import STAGE_BLOCKS, CpuStore, _runs, layer_groups


def test_runs_group_consecutive_slots_in_list_order():
    assert _runs([4, 5, 6, 1, 2, 9, 9]) == [(0, 4, 3), (3, 1, 2), (5, 9, 1), (6, 9, 1)]
    assert _runs([]) == []


def test_layer_groups_cover_every_layer_once_in_near_equal_ranges():
    assert layer_groups(32, 8) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 24), (24, 28), (28, 32)]
    assert layer_groups(28, 8) == [(0, 3), (3, 7), (7, 10), (10, 14), (14, 17), (17, 21), (21, 24), (24, 28)]
    assert layer_groups(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert layer_groups(5, 1) == [(0, 5)]
    assert layer_groups(5, 0) == [(0, 5)]


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_saved_blocks_come_back_to_other_gpu_blocks_whatever_the_slot_order(groups):
    torch.manual_seed(0)
    layers, blocks, shape = 3, 2 * STAGE_BLOCKS + 9, (4, 2, 8)  # more than one staging buffer
    cache = torch.randn(layers, 2, blocks, *shape)
    store = CpuStore(blocks + 5, (layers, 2, *shape), cache.dtype, groups=groups)
    run = [10, 11, 12, 13]  # one run of consecutive slots among scattered ones
    slots = run + [s for s in torch.randperm(blocks + 5).tolist() if s not in run][: blocks - len(run)]
    gpu = torch.randperm(blocks).tolist()
    store.save(slots, cache, gpu)
    for slot, block in zip(slots, gpu, strict=True):
        assert torch.equal(store.block(slot), cache[:, :, block])
    # the same slot written twice in one batch keeps the later block, as the list order says
    store.save([slots[0], slots[0]], cache, [gpu[5], gpu[6]])
    assert torch.equal(store.block(slots[0]), cache[:, :, gpu[6]])
    restored = torch.randn_like(cache)
    targets = torch.randperm(blocks).tolist()
    store.load(slots[1:], restored, targets[1:])
    for slot, block in zip(slots[1:], targets[1:], strict=True):
        assert torch.equal(restored[:, :, block], store.block(slot))
    untouched = targets[0]
    assert not torch.equal(restored[:, :, untouched], store.block(slots[0]))


def test_a_load_by_layer_group_has_brought_in_exactly_the_groups_it_has_yielded():
    """What lets a step read its first layers while the rest still cross: when a group is
    yielded, its layers of every loaded block are in, and no later layer has been touched."""
    torch.manual_seed(1)
    layers, blocks, shape = 7, STAGE_BLOCKS + 5, (4, 2, 8)
    cache = torch.randn(layers, 2, blocks, *shape)
    store = CpuStore(blocks, (layers, 2, *shape), cache.dtype, groups=3)
    slots, gpu = torch.randperm(blocks).tolist(), torch.randperm(blocks).tolist()
    store.save(slots, cache, gpu)
    restored = torch.randn_like(cache)
    before = restored.clone()
    targets = torch.randperm(blocks).tolist()
    seen = []
    for first, end in store.load_by_layer_group(slots, restored, targets):
        seen.append((first, end))
        for slot, block in zip(slots, targets, strict=True):
            assert torch.equal(restored[:end, :, block], store.block(slot)[:end])
        assert torch.equal(restored[end:], before[end:])
    assert seen == [(0, 2), (2, 4), (4, 7)]
