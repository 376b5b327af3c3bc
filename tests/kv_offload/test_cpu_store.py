"""The host tier's copies: a step's blocks go in batches (one copy per run of consecutive host
slots), so the slot order a long-running LRU leaves behind must not mix blocks up."""

from __future__ import annotations

import torch

from pagoda_daemon.kv_offload.cpu import STAGE_BLOCKS, CpuStore, _runs


def test_runs_group_consecutive_slots_in_list_order():
    assert _runs([4, 5, 6, 1, 2, 9, 9]) == [(0, 4, 3), (3, 1, 2), (5, 9, 1), (6, 9, 1)]
    assert _runs([]) == []


def test_saved_blocks_come_back_to_other_gpu_blocks_whatever_the_slot_order():
    torch.manual_seed(0)
    layers, blocks, shape = 3, 2 * STAGE_BLOCKS + 9, (4, 2, 8)  # more than one staging buffer
    cache = torch.randn(layers, 2, blocks, *shape)
    store = CpuStore(blocks + 5, (layers, 2, *shape), cache.dtype)
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
