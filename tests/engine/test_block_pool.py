"""The block pool and KV cache manager: reference counts, LRU eviction, prefix hits."""

from __future__ import annotations

from pagoda_daemon.engine.block_hash import hash_block_tokens
from pagoda_daemon.engine.block_pool import BlockPool, RemovedBlock, StoredBlock
from pagoda_daemon.engine.kv_cache_manager import KVCacheManager
from pagoda_daemon.engine.request import Request
from pagoda_daemon.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], salt: tuple = ()) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), eos_token_id=None, block_size=BS, extra_keys=salt)


def test_hash_chains_parent_tokens_and_extra_keys():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert a != hash_block_tokens(None, [1, 2, 3, 4], (("salt", "x"),))


def test_request_hashes_only_full_blocks_and_extends_on_append():
    req = make_request("r", list(range(10)))
    assert len(req.block_hashes) == 2
    req.append_output_token(10)
    assert len(req.block_hashes) == 2
    req.append_output_token(11)
    assert len(req.block_hashes) == 3
    assert req.block_hashes[1] == hash_block_tokens(req.block_hashes[0], [4, 5, 6, 7])


def test_free_queue_evicts_least_recently_freed_first():
    pool = BlockPool(4, enable_caching=True, record_events=True)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, bytes([i]))
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    assert pool.num_free_blocks == 2
    assert pool.get_cached_block(bytes([2])) is blocks[2]  # freed but still cached
    (first,) = pool.allocate(1)
    assert first is blocks[2]  # freed earliest, evicted first
    assert pool.get_cached_block(bytes([2])) is None
    events = pool.drain_events()
    assert [e.block_hash for e in events if isinstance(e, StoredBlock)] == [bytes([i]) for i in range(4)]
    assert [e.block_hash for e in events if isinstance(e, RemovedBlock)] == [bytes([2])]
    assert pool.drain_events() == []


def test_touch_takes_cached_free_block_out_of_queue():
    pool = BlockPool(2, enable_caching=True)
    (b,) = pool.allocate(1)
    pool.cache_full_block(b, b"h")
    pool.free([b])
    assert pool.num_free_blocks == 2
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free([b])
    pool.free([b])
    assert pool.num_free_blocks == 2


def test_usage_counts_only_blocks_held_by_requests():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(2)
    assert pool.usage() == 0.5
    pool.cache_full_block(blocks[0], b"x")
    pool.free(blocks)
    assert pool.usage() == 0.0


def test_prefix_hit_reuses_every_full_block_but_leaves_one_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    first = make_request("a", list(range(12)))
    assert kv.allocate_slots(first, 12) is not None
    kv.free(first)  # cached blocks stay in the free queue

    again = make_request("b", list(range(12)))
    hits, n = kv.get_computed_blocks(again)
    assert n == 8 and len(hits) == 2  # 3 full blocks cached, the last is recomputed
    longer = make_request("c", list(range(14)))
    hits, n = kv.get_computed_blocks(longer)
    assert n == 12 and len(hits) == 3
    assert kv.stats.queries == 26 and kv.stats.hits == 20

    free_before = kv.num_free_blocks
    added = kv.allocate_slots(longer, 2, hits)
    assert added is not None and len(added) == 4  # 3 hits + 1 new block
    assert kv.num_free_blocks == free_before - 4
    salted = make_request("d", list(range(14)), salt=(("salt", "s"),))
    assert kv.get_computed_blocks(salted)[1] == 0


def test_allocation_fails_cleanly_when_full():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None
    b = make_request("b", list(range(8)))
    assert kv.allocate_slots(b, 8) is None
    assert kv.num_free_blocks == 1
    assert kv.block_ids("b") == []
    kv.free(a)
    assert kv.num_free_blocks == 4


def test_kv_events_carry_parent_tokens_and_extra_keys():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=True, record_events=True)
    req = make_request("a", list(range(10)), salt=(("salt", "s"),))
    kv.allocate_slots(req, 10)
    stored = kv.pool.drain_events()
    assert [e.token_ids for e in stored] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert stored[0].parent_hash is None and stored[1].parent_hash == stored[0].block_hash
    assert stored[1].block_hash == req.block_hashes[1] and stored[0].extra_keys == (("salt", "s"),)
    kv.free(req)
    assert kv.reset_prefix_cache()
    assert kv.pool.drain_events() == ["cleared"]


def test_blocks_with_content_are_the_held_and_the_cached_prefixes():
    """What a rank joining an elastic replica copies: a block freed with its hash may still be
    a prefix hit; a block freed without one, or evicted for reuse, holds nothing to read."""
    pool = BlockPool(6, enable_caching=True)
    held, cached, plain = pool.allocate(2), pool.allocate(1)[0], pool.allocate(1)[0]
    pool.cache_full_block(cached, b"prefix")
    pool.free([cached, plain])
    assert pool.ids_with_content() == sorted(b.block_id for b in [*held, cached])
    reused = pool.allocate(4)  # every free block, the cached one evicted on the way
    assert pool.ids_with_content() == sorted(b.block_id for b in [*held, *reused])
