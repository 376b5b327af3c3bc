"""The KV connector's interface: a scheduler half and a worker half.

Scheduler half (in the engine core, beside the scheduler): ``lookup`` says how many leading
full blocks of a request, named by the same chained block hashes as the GPU prefix cache
(cache_salt and other extra keys included), the offload tiers can supply; ``plan_loads``
turns the ones the scheduler takes into copies into freshly allocated GPU blocks; ``plan_save``
asks for a block computed on the GPU to be kept. Each step's copies travel in the
SchedulerOutput (``kv_loads``, ``kv_saves``: typed ``KVTransfer`` lists, carried to every rank
by the multiproc executor's step plan). A write-back connector is offered blocks as the GPU
cache evicts them instead (``plan_evicted``, the step's ``kv_evicted``): while every prefix
fits the GPU, nothing is copied.

Worker half (on every rank): ``run`` performs a list of copies between the rank's KV cache
tensor and its tiers. The worker runs ``kv_evicted`` and then ``kv_loads`` before the step's
forward pass and ``kv_saves`` after it. Loads may still be crossing when ``run`` returns: the
forward pass calls ``wait_for_layer`` before each layer's attention (host memory comes back a
layer group at a time beside the first layers' compute). ``prefetch`` starts a step's
``kv_prefetch`` (host-memory loads for requests that compute from the next step) beside its
forward pass, and the next step waits for them (``await_prefetches``); how each copy runs
(host-memory copies batched and asynchronous, disk I/O in threads) is the worker half's affair
(cpu.py, tiered.py): the scheduler half plans every copy and eviction.

All of a tier's bookkeeping (which hash sits where, LRU order, capacity) lives in the
scheduler half; the worker half only stores bytes where it is told. So the ranks of a
tensor-parallel engine, each holding its own slice of the heads, can never disagree.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from concurrent.futures import Future

from pagoda_daemon.engine.block_hash import BlockHash
from pagoda_daemon.engine.block_pool import RemovedBlock, StoredBlock
from pagoda_daemon.engine.messages import KVOffloadStats
from pagoda_daemon.engine.scheduler_output import KVTransfer

GIB = 1 << 30


def capacity_blocks(gib: float, block_bytes: int, world_size: int) -> int:
    """Blocks a tier of ``gib`` GiB holds: the budget covers every rank's slice of a block
    (``block_bytes`` is one rank's), as a pod's host memory or disk serves all its ranks."""
    if gib <= 0 or block_bytes <= 0:
        return 0
    return math.floor(gib * GIB) // (block_bytes * world_size)


class OffloadConnector(ABC):
    """The scheduler half. ``stats`` counts lookups and hits in tokens, and bytes per tier
    (summed over the ranks); the engine core drains it with ``take_stats``."""

    def __init__(self, record_events: bool = False) -> None:
        self.stats = KVOffloadStats()
        # write-back: blocks are offered as the GPU cache evicts them (plan_evicted), not as
        # they are computed (plan_save)
        self.write_back = False
        self.record_events = record_events  # KV events (--enable-kv-events): stores and removals per tier
        # Host-memory blocks (``can_prefetch`` hits) a step loads for its own requests, beside
        # its forward pass layer by layer; a request whose hits would pass it is prefetched for
        # the next step instead (the scheduler's choice, docs/kv-offload.md)
        self.step_load_blocks = 0
        self.events: list[StoredBlock | RemovedBlock] = []

    @abstractmethod
    def lookup(self, block_hashes: list[BlockHash]) -> int:
        """How many of these blocks, from the first, a tier holds (no side effect)."""

    def arriving(self, block_hashes: list[BlockHash], source: str | None = None, request_id: str = "") -> bool:
        """Whether these blocks (a request's, after those ``lookup`` found) are on their way from
        another instance (``source``: the one the request names, if any): the request then waits,
        keeping its place, while the batch runs on, and is looked up again next step. Tiers that
        fetch nothing say no."""
        return False

    def staging(self, block_hashes: list[BlockHash], request_id: str = "") -> bool:
        """Whether these blocks (a ``lookup`` hit) are first being brought into host memory from
        disk, in the background: the request then waits, keeping its place, while the batch runs
        on, and is looked up again next step (its blocks then host-memory hits, loaded beside a
        step). Tiers without host memory and disk say no, and a request whose blocks cannot be
        staged is loaded before its step as before."""
        return False

    def take_stages(self) -> list[KVTransfer]:
        """The reads into host memory planned by this step's ``staging`` calls."""
        return []

    def staged(self, results: list[tuple[BlockHash, bool]]) -> None:  # noqa: B027 (as staging)
        """Reads started by ``take_stages`` that every rank has finished: (hash, whether it was
        read whole), in any order."""

    def can_prefetch(self, block_hashes: list[BlockHash]) -> bool:
        """Whether these blocks (a ``lookup`` hit) can come back beside a step, for the next step
        to read: loads that cannot fail (host memory: copies between tensors the engine owns). A
        load that can fail (a file) runs before the forward pass that reads it, so that its step
        can be undone (docs/kv-offload.md, "A load that fails")."""
        return False

    @abstractmethod
    def plan_loads(self, block_hashes: list[BlockHash], gpu_block_ids: list[int]) -> list[KVTransfer]:
        """The copies that bring ``block_hashes`` (a ``lookup`` hit) into these GPU blocks,
        before the step's forward pass. May add saves (a disk hit promoted to host memory)."""

    @abstractmethod
    def plan_save(self, block_hash: BlockHash, gpu_block_id: int) -> None:
        """Keep this GPU block (full, computed by this step) unless a tier has it already.
        Called once every lookup of the step is done: a save and the evictions it causes change
        what the tiers hold, and the step's loads must find what their lookups found."""

    def plan_evicted(self, evicted: list[tuple[BlockHash, int]]) -> list[KVTransfer]:
        """Write-back: the copies that keep these (hash, GPU block) pairs, which the GPU cache
        handed out again for this step, unless a tier has them; run before the step's loads and
        forward pass overwrite them. Called once every lookup of the step is done."""
        raise NotImplementedError(f"{type(self).__name__} does not write back")

    @abstractmethod
    def take_saves(self) -> list[KVTransfer]:
        """The copies (and evictions) to run after this step's forward pass."""

    @abstractmethod
    def forget(self, transfers: list[KVTransfer]) -> None:
        """A step's loads failed: forget the tier copies these transfers name, the failed loads'
        sources (unusable) and the step's saves of blocks computed on top of them (wrong), so
        that no later lookup finds them."""

    def stored(self, block_hash: BlockHash, medium: str) -> None:
        if self.record_events:
            self.events.append(StoredBlock(block_hash, None, [], (), medium))

    def removed(self, block_hash: BlockHash, medium: str) -> None:
        if self.record_events:
            self.events.append(RemovedBlock(block_hash, medium))

    def take_events(self) -> list[StoredBlock | RemovedBlock]:
        events, self.events = self.events, []
        return events

    def take_stats(self) -> KVOffloadStats:
        stats, self.stats = self.stats, KVOffloadStats()
        return stats

    @abstractmethod
    def check(self) -> None:
        """Raise if the accounting is inconsistent (tests)."""

    def close(self) -> None:  # noqa: B027 (most connectors run nothing beside the engine)
        """Stop what the connector runs beside the engine (a transfer server, fetches)."""


class OffloadWorker(ABC):
    """The worker half of one rank: performs copies between its KV cache and its tiers."""

    def __init__(self) -> None:
        self.transfer_seconds = 0.0

    @abstractmethod
    def run(self, transfers: list[KVTransfer], kv_cache) -> list[bool]:
        """Perform ``transfers`` in order; returns which failed. Only a fallible load
        (scheduler_output.FALLIBLE_LOADS) may: its GPU block is zeroed and the scheduler recomputes
        the requests that read it. ``kv_cache``: the worker's
        ``[layers, 2, blocks, block_size, heads, head_dim]`` tensor."""

    def prefetch(self, transfers: list[KVTransfer], kv_cache) -> None:
        """Start host-memory loads (``can_prefetch``) beside the step about to be launched: they
        may overlap its forward pass, which reads none of their blocks."""
        raise NotImplementedError(f"{type(self).__name__} does not prefetch")

    def await_prefetches(self) -> None:  # noqa: B027 (a worker whose loads are synchronous waits for nothing)
        """Make what runs next on the step's stream wait for the prefetches started so far."""

    def wait_for_layer(self, layer: int) -> None:  # noqa: B027 (as await_prefetches)
        """Make what runs next on the step's stream (the layer's attention) wait until this
        step's loads have brought the layer's KV in."""

    def await_layer_loads(self) -> None:  # noqa: B027 (as await_prefetches)
        """``wait_for_layer`` for every layer not waited for yet (a step that replays one CUDA
        graph for all its layers)."""

    def stage(self, transfers: list[KVTransfer], kv_cache) -> None:
        """Start reading these blocks (``stage_disk``) from disk into host memory in the
        background, after every copy issued so far; ``take_staged`` reports them once done."""
        raise NotImplementedError(f"{type(self).__name__} does not stage")

    def take_staged(self) -> list[tuple[bytes, bool]]:
        """The reads started by ``stage`` that are done on every rank since the last call: (hash,
        whether it was read whole). Rank 0's answer is the replica's."""
        return []

    def take_step_writes(self) -> list[Future[None]]:
        """The writes of the saves run since the last call, still under way beside the steps: the
        step's outputs wait for them (its files are then whole when its answer goes out)."""
        return []

    def take_transfer_seconds(self) -> float:
        seconds, self.transfer_seconds = self.transfer_seconds, 0.0
        return seconds

    def flush(self) -> None:  # noqa: B027 (a worker whose copies are all waited for holds nothing)
        """Wait for the writes still under way beside the steps (at shutdown, or before the
        files are read from outside the engine)."""
