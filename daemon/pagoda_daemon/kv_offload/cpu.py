"""The host-memory tier: whole blocks (every layer, K and V) in slots of one host tensor.

``CpuIndex`` (scheduler half) maps block hash -> slot in LRU order; ``CpuStore`` (worker half,
one per rank) holds ``[slots, layers, 2, block_size, heads, head_dim]``, pinned when the KV
cache is on a GPU so that copies to and from it are asynchronous and run at full bandwidth.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from pagoda_daemon.engine.block_hash import BlockHash


class CpuIndex:
    """Which hash sits in which slot, least recently used first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slots: OrderedDict[BlockHash, int] = OrderedDict()
        self.free: list[int] = list(range(num_slots - 1, -1, -1))

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def touch(self, block_hash: BlockHash) -> int:
        """The hash's slot, now the most recently used."""
        self.slots.move_to_end(block_hash)
        return self.slots[block_hash]

    def insert(self, block_hash: BlockHash) -> tuple[int, tuple[BlockHash, int] | None]:
        """A slot for a new hash, and the (hash, slot) evicted to make room, if any."""
        evicted = None
        if self.free:
            slot = self.free.pop()
        else:
            old, slot = self.slots.popitem(last=False)
            evicted = (old, slot)
        self.slots[block_hash] = slot
        return slot, evicted

    def remove(self, block_hash: BlockHash) -> bool:
        """Forget a hash, its slot free again; False if it was not here."""
        slot = self.slots.pop(block_hash, None)
        if slot is None:
            return False
        self.free.append(slot)
        return True

    def check(self) -> None:
        used = list(self.slots.values())
        assert len(used) == len(set(used)), "two hashes share a host slot"
        assert not set(used) & set(self.free), "a host slot is both used and free"
        assert len(used) + len(self.free) == self.num_slots, "host slots leaked"


class CpuStore:
    """One rank's host copy of the blocks.

    On a GPU, copies are asynchronous: enqueued on the stream that runs the steps, so they are
    ordered with the forward passes (a load lands before the step that reads it, a save copies
    what the step just wrote, and a later step cannot overwrite the block first) and the host
    thread never waits for the GPU. A save writes its host slot only when the stream gets
    there: ``block`` (the host reading a slot, to demote it to disk) waits for the copy that
    last wrote the slot. Synchronous copies made every step that saved wait for its own forward
    pass (docs/benchmarks/2026-11-26-kv-offload-h100.md)."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        self.on_gpu = device is not None and device.type == "cuda"
        # pinned on a GPU (copies from and to pageable memory are synchronous), allocated so at
        # once: pinning a pageable tensor would hold the tier twice over while it copies. A slot is
        # only read once a save has written it.
        self.data = (torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=True) if self.on_gpu
                     else torch.zeros((num_slots, *block_shape), dtype=dtype))
        self._unfenced: list[int] = []  # slots saved since the last fence
        self._written: dict[int, torch.cuda.Event] = {}  # slot -> the fence after the save that last wrote it

    def save(self, slot: int, kv_cache: torch.Tensor, gpu_block: int) -> None:
        self.data[slot].copy_(kv_cache[:, :, gpu_block], non_blocking=self.on_gpu)
        if self.on_gpu:
            self._unfenced.append(slot)

    def load(self, slot: int, kv_cache: torch.Tensor, gpu_block: int) -> None:
        kv_cache[:, :, gpu_block].copy_(self.data[slot], non_blocking=self.on_gpu)

    def fence(self) -> None:
        """Mark the saves enqueued so far: one event for a batch of copies."""
        if self._unfenced:
            event = torch.cuda.Event()
            event.record()
            for slot in self._unfenced:
                self._written[slot] = event
            self._unfenced = []

    def block(self, slot: int) -> torch.Tensor:
        """The slot's bytes on the host, once the save that wrote them has run."""
        self.fence()
        event = self._written.pop(slot, None)
        if event is not None:
            event.synchronize()
        return self.data[slot]
