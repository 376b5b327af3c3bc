"""The pool of KV-cache blocks: reference counts, an LRU free queue, and the prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagoda_daemon.engine.block_hash import BlockHash

# Where a block event happened: the device's cache, or a KV offload tier (vLLM's `medium`).
GPU, CPU, DISK = "GPU", "CPU", "DISK"


@dataclass(frozen=True)
class StoredBlock:
    """A full block entered the prefix cache or an offload tier (the facts a KV-aware router
    needs; an offload tier knows a block by its hash only: no parent, no tokens)."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: list[int]
    extra_keys: tuple
    medium: str = GPU


@dataclass(frozen=True)
class RemovedBlock:
    block_hash: BlockHash
    medium: str = GPU


CLEARED = "cleared"


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered in the cache


class BlockPool:
    """Blocks with ref_cnt == 0 sit in the free queue in eviction order (oldest first).

    A free block may still hold a cached prefix: it is only evicted (its hash dropped)
    when it is handed out again, so freed prefixes stay reusable as long as possible.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, record_events: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # KV events (BlockStored/BlockRemoved) are only collected when someone drains them.
        self.record_events = record_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        # KV events since the last drain, in order: StoredBlock | RemovedBlock | "cleared"
        self.events: list = []
        # Cached blocks handed out again since the last take_evicted, as (hash, block id), while a
        # KV offload tier copies blocks as they leave (write-back); None: not recorded.
        self.evicted: list[tuple[BlockHash, int]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks held by live requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ids_with_content(self) -> list[int]:
        """Blocks whose KV a request may still read: held by a request, or free but holding a
        cached prefix. The rest hold nothing anyone will look at."""
        return [b.block_id for b in self.blocks if b.ref_cnt > 0 or b.block_hash is not None]

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            left_cache = self._evict(block)
            if left_cache is not None and self.evicted is not None:
                self.evicted.append((left_cache, block.block_id))
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference each; pass blocks tail-first so a sequence's tail is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"KV block {block.block_id} freed more often than taken")
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash, parent_hash: BlockHash | None = None,
                         token_ids: list[int] | None = None, extra_keys: tuple = ()) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is already indexed; this one stays anonymous
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.record_events:
            self.events.append(StoredBlock(block_hash, parent_hash, list(token_ids or ()), extra_keys))

    def forget(self, blocks: list[KVCacheBlock]) -> None:
        """Take these blocks out of the prefix cache (their KV is wrong): no lookup finds them."""
        for block in blocks:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no request holds a block."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.record_events:
            self.events.append(CLEARED)
        return True

    def take_evicted(self) -> list[tuple[BlockHash, int]]:
        """The cached blocks handed out again since the last call, oldest first: their KV is
        still in place until the step they were handed to runs."""
        if self.evicted is None:
            return []
        evicted, self.evicted = self.evicted, []
        return evicted

    def drain_events(self) -> list:
        events, self.events = self.events, []
        return events

    def _evict(self, block: KVCacheBlock) -> BlockHash | None:
        """Drop the block's hash; returns it if the block was the prefix cache's entry for it."""
        removed = None
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                removed = block.block_hash
                if self.record_events:
                    self.events.append(RemovedBlock(block.block_hash))
            block.block_hash = None
        return removed
