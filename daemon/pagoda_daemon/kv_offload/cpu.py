"""The host-memory tier: whole blocks (every layer, K and V) in slots of host tensors.

``CpuIndex`` (scheduler half) maps block hash -> slot in LRU order; ``CpuStore`` (worker half,
one per rank) holds a slot's layers in a few groups, one host tensor ``[slots, layers_in_group,
2, block_size, heads, head_dim]`` per group, pinned when the KV cache is on a GPU so that copies
to and from it are asynchronous and run at full bandwidth. A load crosses PCIe group by group, one
kernel each that reads the pinned slots and writes every block where it goes
(``pagoda_kernels.kv_copy``), and the step's forward pass reads a layer as soon as its group has
arrived (``load_by_layer_group``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator

import torch

from pagoda_daemon.engine.block_hash import BlockHash


class CpuIndex:
    """Which hash sits in which slot, least recently used first. A slot may also be reserved:
    taken for a block on its way from disk (``reserve``), neither free nor found by lookups
    until the read is done (``fill``) or failed (``release``)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slots: OrderedDict[BlockHash, int] = OrderedDict()
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.reserved: set[int] = set()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def next_evicted(self) -> BlockHash | None:
        """The hash the next insert evicts (the least recently used, once every slot is taken)."""
        return None if self.free or not self.slots else next(iter(self.slots))

    def touch(self, block_hash: BlockHash) -> int:
        """The hash's slot, now the most recently used."""
        self.slots.move_to_end(block_hash)
        return self.slots[block_hash]

    def insert(self, block_hash: BlockHash) -> tuple[int, tuple[BlockHash, int] | None]:
        """A slot for a new hash, and the (hash, slot) evicted to make room, if any."""
        slot, evicted = self.reserve()
        self.fill(block_hash, slot)
        return slot, evicted

    def next_evicted_n(self, n: int) -> list[BlockHash]:
        """The hashes the next ``n`` inserts or reservations evict, in order."""
        return list(itertools.islice(self.slots, max(0, n - len(self.free))))

    def reserve(self) -> tuple[int, tuple[BlockHash, int] | None]:
        """A slot for a block still to be written (``fill`` once it is), and the (hash, slot)
        evicted to make room, if any."""
        evicted = None
        if self.free:
            slot = self.free.pop()
        else:
            old, slot = self.slots.popitem(last=False)
            evicted = (old, slot)
        self.reserved.add(slot)
        return slot, evicted

    def fill(self, block_hash: BlockHash, slot: int) -> None:
        """A reserved slot now holds this hash (the most recently used)."""
        self.reserved.remove(slot)
        self.slots[block_hash] = slot

    def release(self, slot: int) -> None:
        """A reserved slot free again (what was to be written into it never was)."""
        self.reserved.remove(slot)
        self.free.append(slot)

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
        assert not self.reserved & (set(used) | set(self.free)), "a reserved host slot is also used or free"
        assert len(used) + len(self.free) + len(self.reserved) == self.num_slots, "host slots leaked"


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first index, first slot, length) of each run of consecutive slots, in list order: one
    copy per run instead of one per block."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, n = runs[-1]
            runs[-1] = (first, start, n + 1)
        else:
            runs.append((i, slot, 1))
    return runs


# A copy stages at most this many blocks on the device at a time (64 Llama-3-8B blocks: 128 MiB).
STAGE_BLOCKS = 64
# A load's kernel runs this many programs, each looping over its share of the blocks, so that a
# load beside a forward pass leaves it most of the SMs. On an H200 (2026-11-30,
# docs/benchmarks/2026-11-30-kv-load-bandwidth-h200.md) 1,024 scattered Qwen3-0.6B blocks (1.75 GiB)
# loaded at 50.6 GB/s with 32 programs (50.1 with 132, 46.9 with 16) against 53.5 GB/s for one
# contiguous copy of the same bytes; a copy per run of slots into a staging buffer, then one
# scatter, reached 42.6 GB/s.
LOAD_PROGRAMS = 32
# Saves still crossing to host memory hold their staging buffers: beyond this many bytes, the
# engine's thread waits for the oldest (PCIe is then the limit). The KV cache is sized without it
# (Worker._profile_gpu_blocks).
SAVE_STAGING_BYTES = 512 * 2**20


def _on_device(ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids as a device tensor without waiting for the stream: from pinned memory (a copy
    from pageable memory first waits for the stream to drain, which stalled the engine's thread
    behind every step that copied)."""
    if device.type != "cuda":
        return torch.tensor(ids, dtype=torch.long)
    return torch.tensor(ids, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


def _blocks(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache ``[layers, 2, blocks, ...]`` viewed block-first, as the slots are laid out."""
    return kv_cache.movedim(2, 0)


def gather(kv_cache: torch.Tensor, gpu_blocks: list[int]) -> torch.Tensor:
    """The blocks, contiguous ``[n, layers, 2, ...]`` on the cache's device: one kernel."""
    return _blocks(kv_cache)[_on_device(gpu_blocks, kv_cache.device)]


def layer_groups(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` (at most one a layer) ranges ``(first, end)`` of near-equal layer counts."""
    groups = max(1, min(groups, num_layers))
    bounds = [num_layers * g // groups for g in range(groups + 1)]
    return list(itertools.pairwise(bounds))


class CpuStore:
    """One rank's host copy of the blocks.

    On a GPU, copies are asynchronous and batched. A load is one kernel per layer group reading
    the pinned slots (``LOAD_PROGRAMS``); a save gathers the step's blocks into contiguous buffers
    on the device (one kernel per layer group and ``STAGE_BLOCKS``), which cross PCIe as one copy
    per group and run of consecutive host slots. Loads run on the current stream: a load
    stream of the worker's (TieredWorker), beside the step that reads them layer group by layer
    group or beside the one before it (a prefetch), or the step's (the disk loads' staging slots).
    Saves are gathered on the step's stream before anything can overwrite the blocks (written
    back: before the step that reuses them; written through: right after the forward pass that
    wrote them), then copied to host memory on a stream of their own, beside the next steps: on
    the step's stream, one copy per block, write-through saves cost the nano-vllm workload 16%
    (Llama-3-8B) to 31% (Qwen3-0.6B) of its throughput on an H100 with every prefix fitting the
    GPU, 2.5-5% on a stream of their own (docs/benchmarks/2026-11-26-kv-offload-fit-h100.md). A
    load from a slot whose save is still under way waits for it on the GPU; ``block`` (the host
    reading a slot, to demote it to disk) waits for it on the host."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | None = None, groups: int = 1, touch: bool = True) -> None:
        """``block_shape``: one block's ``(layers, 2, block_size, heads, head_dim)``; its layers
        are kept in ``groups`` host tensors. ``touch``: without a GPU, write every page at start
        (the memory is the process's from then on, as pinned memory is), else as slots are used
        (the disk tier's read-ahead slots, most of which an engine on the CPU never fills)."""
        self.on_gpu = device is not None and device.type == "cuda"
        self.num_slots = num_slots
        self.groups = layer_groups(block_shape[0], groups)
        # pinned on a GPU (copies from and to pageable memory are synchronous), allocated so at
        # once: pinning a pageable tensor would hold the tier twice over while it copies. A slot is
        # only read once a save or a read has written it.
        allocate = torch.zeros if touch else torch.empty
        self.data = [torch.empty((num_slots, end - first, *block_shape[1:]), dtype=dtype, pin_memory=True)
                     if self.on_gpu else allocate((num_slots, end - first, *block_shape[1:]), dtype=dtype)
                     for first, end in self.groups]
        self.slot_bytes = sum(d[0].nbytes for d in self.data)
        self.saves = torch.cuda.Stream(device) if self.on_gpu else None
        self._written: dict[int, torch.cuda.Event] = {}  # slot -> recorded after the save that last wrote it
        self._in_flight: deque[tuple[torch.cuda.Event, int]] = deque()  # saves' (done, staged bytes), oldest first

    def save(self, slots: list[int], kv_cache: torch.Tensor, gpu_blocks: list[int]) -> None:
        """Copy the GPU blocks into the host slots (pairwise)."""
        for first in range(0, len(slots), STAGE_BLOCKS):
            chunk = slots[first : first + STAGE_BLOCKS]
            blocks = gpu_blocks[first : first + STAGE_BLOCKS]
            done = None  # on a GPU: recorded once every group's copies of the chunk are issued
            if self.saves is not None:
                self._make_room(len(chunk) * self.slot_bytes)
                done = torch.cuda.Event()
            for (start, end), data in zip(self.groups, self.data, strict=True):
                staged = gather(kv_cache[start:end], blocks)
                if self.saves is None:
                    for i, slot, n in _runs(chunk):
                        data[slot : slot + n].copy_(staged[i : i + n])
                    continue
                self.saves.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.saves):
                    for i, slot, n in _runs(chunk):
                        data[slot : slot + n].copy_(staged[i : i + n], non_blocking=True)
                staged.record_stream(self.saves)  # the allocator keeps it until the copies have run
            if done is not None:
                with torch.cuda.stream(self.saves):
                    done.record()
                self._in_flight.append((done, len(chunk) * self.slot_bytes))
                for slot in chunk:
                    self._written[slot] = done

    def _make_room(self, nbytes: int) -> None:
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()
        while self._in_flight and sum(n for _, n in self._in_flight) + nbytes > SAVE_STAGING_BYTES:
            self._in_flight.popleft()[0].synchronize()

    def load(self, slots: list[int], kv_cache: torch.Tensor, gpu_blocks: list[int]) -> None:
        """Copy the host slots into the GPU blocks (pairwise), on the current stream."""
        for _ in self.load_by_layer_group(slots, kv_cache, gpu_blocks):
            pass

    def load_by_layer_group(self, slots: list[int], kv_cache: torch.Tensor,
                            gpu_blocks: list[int]) -> Iterator[tuple[int, int]]:
        """``load``, one layer group at a time: yields each group's ``(first, end)`` layers once
        its copies are issued on the current stream (a caller records an event there for the
        forward pass's layers to wait on)."""
        if self.saves is not None:
            for event in {id(e): e for e in map(self._written.get, slots) if e is not None}.values():
                torch.cuda.current_stream().wait_event(event)  # a save of the slot still under way
            from pagoda_kernels.kv_copy import load_blocks

            slot_ids, block_ids = _on_device(slots, kv_cache.device), _on_device(gpu_blocks, kv_cache.device)
            for (start, end), data in zip(self.groups, self.data, strict=True):
                load_blocks(data, slot_ids, kv_cache[start:end], block_ids, max_programs=LOAD_PROGRAMS)
                yield start, end
            return
        ids = _on_device(gpu_blocks, kv_cache.device)
        for (start, end), data in zip(self.groups, self.data, strict=True):
            _blocks(kv_cache[start:end])[ids] = data[torch.tensor(slots, dtype=torch.long)]  # on a CPU: one gather
            yield start, end

    def block(self, slot: int) -> torch.Tensor:
        """A copy of the slot's bytes on the host ``(layers, 2, ...)``, once the save that wrote
        them has run."""
        event = self._written.pop(slot, None)
        if event is not None:
            event.synchronize()
        return torch.cat([data[slot] for data in self.data])

    def slot(self, k: int) -> torch.Tensor:
        """Slot ``k`` itself, to be written in place (a store of one group only: disk staging)."""
        assert len(self.data) == 1, "a slot of a store split into layer groups is not one tensor"
        return self.data[0][k]

    def write(self, k: int, block: torch.Tensor) -> None:
        """Slot ``k`` from a host copy of a whole block ``(layers, 2, ...)`` (a store in layer groups)."""
        for (start, end), data in zip(self.groups, self.data, strict=True):
            data[k].copy_(block[start:end])

    def take_save_event(self, slot: int) -> torch.cuda.Event | None:
        """The event after the save still writing this slot, if any, now the caller's to wait
        for: a slot about to be written by the host (a block read from disk) must not be written
        again by a copy from the GPU still under way."""
        return self._written.pop(slot, None)
