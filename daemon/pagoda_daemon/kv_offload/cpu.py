"""The host-memory tier: whole blocks (every layer, K and V) in slots of one host tensor.

``CpuIndex`` (scheduler half) maps block hash -> slot in LRU order; ``CpuStore`` (worker half,
one per rank) holds ``[slots, layers, 2, block_size, heads, head_dim]``, pinned when CUDA is
available so that copies to and from the GPU run at full bandwidth.
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
    """One rank's host copy of the blocks."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.data = torch.zeros((num_slots, *block_shape), dtype=dtype)
        if torch.cuda.is_available():
            self.data = self.data.pin_memory()

    def save(self, slot: int, kv_cache: torch.Tensor, gpu_block: int) -> None:
        self.data[slot].copy_(kv_cache[:, :, gpu_block])

    def load(self, slot: int, kv_cache: torch.Tensor, gpu_block: int) -> None:
        kv_cache[:, :, gpu_block].copy_(self.data[slot])  # synchronous in this slice

    def block(self, slot: int) -> torch.Tensor:
        return self.data[slot]
