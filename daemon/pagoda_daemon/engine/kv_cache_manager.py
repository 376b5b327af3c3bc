"""Which blocks each request holds, and the prefix-cache lookups that decide where it starts."""

from __future__ import annotations

from pagoda_daemon.engine.block_hash import BlockHash
from pagoda_daemon.engine.block_pool import BlockPool, KVCacheBlock
from pagoda_daemon.engine.messages import PrefixCacheStats
from pagoda_daemon.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, record_events: bool = False):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, record_events)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_hashed_blocks: dict[str, int] = {}  # per request: blocks already registered
        self.stats = PrefixCacheStats()

    def make_stats(self) -> PrefixCacheStats:
        """The prefix-cache counts since the previous call (get and reset: a consumer adds them
        to its counters; warm-up drops them)."""
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    def take_events(self) -> list:
        """The KV events (stored, removed, cleared) since the previous call."""
        return self.pool.drain_events()

    def record_evictions(self) -> None:
        """From now on, remember the cached blocks handed out again (``take_evicted``)."""
        self.pool.evicted = []

    def take_evicted(self) -> list[tuple[BlockHash, int]]:
        """(hash, block id) of the cached blocks handed out again since the last call."""
        return self.pool.take_evicted()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute, since the last position's
        logits are needed to sample (or its hidden state, to pool).
        """
        if not self.enable_caching or request.computes_every_position:
            return [], 0  # prompt logprobs (or mean pooling) need every prompt position: compute them all
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens; returns the newly added blocks, or None if full."""
        if not new_computed_blocks and self._fits_in_held_blocks(request, num_new_tokens):
            return []  # most decode steps: room in the last block, and no block filled to register
        new_computed_blocks = new_computed_blocks or []
        held = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_needed = cdiv(total_tokens, self.block_size) - len(held) - len(new_computed_blocks)
        # Cache hits sitting in the free queue stop being free once we take them.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_evictable_hits:
            if not held:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        held.extend(new_computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        held.extend(new_blocks)
        self._cache_full_blocks(request, held, total_tokens)
        return new_computed_blocks + new_blocks

    def _fits_in_held_blocks(self, request: Request, num_new_tokens: int) -> bool:
        held = self.req_blocks.get(request.request_id)
        if held is None:
            return False
        total_tokens = request.num_computed_tokens + num_new_tokens
        if total_tokens > len(held) * self.block_size:
            return False
        if not self.enable_caching:
            return True
        return self._num_full_blocks(request, total_tokens) <= self.num_hashed_blocks.get(request.request_id, 0)

    def _num_full_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks full (and hashable) once num_tokens of the request are written."""
        return min(num_tokens // self.block_size, len(request.block_hashes))

    def _cache_full_blocks(self, request: Request, held: list[KVCacheBlock], num_tokens: int) -> None:
        """Register blocks that will be full once this step's tokens are written."""
        if not self.enable_caching:
            return
        start = self.num_hashed_blocks.get(request.request_id, 0)
        num_full = self._num_full_blocks(request, num_tokens)
        bs = self.block_size
        for i in range(start, num_full):
            if self.pool.record_events:
                parent = request.block_hashes[i - 1] if i else None
                tokens = request.all_token_ids[i * bs : (i + 1) * bs]
                self.pool.cache_full_block(held[i], request.block_hashes[i], parent, tokens, request.extra_keys)
            else:
                self.pool.cache_full_block(held[i], request.block_hashes[i])
        self.num_hashed_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_hashed_blocks.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))

    def forget_blocks(self, block_ids: set[int]) -> None:
        """Take blocks whose KV is wrong out of the prefix cache (a failed KV offload load)."""
        self.pool.forget([self.pool.blocks[i] for i in sorted(block_ids)])

    def block_ids_with_content(self) -> list[int]:
        return self.pool.ids_with_content()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
