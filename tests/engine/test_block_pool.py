"""Block pool and prefix cache: exact block ids, reference counts, eviction order."""

import pytest

from rayinfer.engine.block_pool import NONE_HASH, KVBlockPool, hash_block, hash_block_chain
from rayinfer.engine.kv_cache_manager import KVCacheManager
from rayinfer.engine.types import Request, SamplingParams


def make_req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def test_hash_chain_depends_on_parent_and_extra_key():
    a = hash_block(NONE_HASH, [1, 2, 3, 4])
    assert a == hash_block(NONE_HASH, [1, 2, 3, 4])  # stable
    assert a != hash_block(NONE_HASH, [1, 2, 3, 5])
    assert a != hash_block(NONE_HASH, [1, 2, 3, 4], extra_key=7)
    chain = hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    assert len(chain) == 2 and chain[0] == a
    assert chain[1] == hash_block(a, [5, 6, 7, 8])
    assert chain[1] != hash_block(NONE_HASH, [5, 6, 7, 8])  # same tokens, different prefix


def test_allocate_free_order_and_refcounts():
    pool = KVBlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 0, 0, 0]
    pool.free([2, 1])  # tail first
    assert list(pool.free_queue) == [3, 4, 5, 2, 1]
    assert pool.allocate(4) == [3, 4, 5, 2]
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.free([1, 1])


def test_eviction_drops_oldest_freed_cached_block_first():
    pool = KVBlockPool(3)
    ids = pool.allocate(3)
    for block_id, h in zip(ids, [11, 22, 33]):
        pool.cache_block(block_id, h)
    pool.free([0])
    pool.free([2])
    pool.free([1])
    assert list(pool.free_queue) == [0, 2, 1]
    assert pool.allocate(1) == [0]  # evicts hash 11
    assert pool.get_cached_block(11) is None
    assert pool.get_cached_block(22) == 1 and pool.get_cached_block(33) == 2
    pool.touch([2])  # a prefix hit revives block 2 out of the free queue
    assert pool.blocks[2].ref_cnt == 1 and list(pool.free_queue) == [1]


def test_manager_prefix_hit_shares_blocks_and_leaves_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_req("a", range(10))  # 2 full blocks + 2 tokens
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    b = make_req("b", list(range(8)) + [99, 98, 97])
    hit, n = kv.get_computed_blocks(b)
    assert hit == [0, 1] and n == 8
    b.num_computed_tokens = n
    assert kv.allocate_slots(b, 3, hit) == [3]
    assert b.block_ids == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    # an exact repeat of a's 8-token prefix can hit only 1 block: one token must stay to compute
    c = make_req("c", range(8))
    assert kv.get_computed_blocks(c) == ([0], 4)
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    kv.free(b)
    # freed tail first: a's [2,1,0] then b's [3,1,0] -> 2, 3, 1, 0 join the queue after 4..9
    assert list(kv.pool.free_queue)[-4:] == [2, 3, 1, 0]
    assert kv.get_computed_blocks(make_req("d", range(12)))[0] == [0, 1]


def test_manager_refuses_when_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = make_req("r", range(12))
    assert kv.allocate_slots(r, 12) is None
    assert r.block_ids == [] and kv.pool.num_free_blocks == 2



def test_manager_registers_a_duplicate_block_once_the_original_is_evicted():
    kv = KVCacheManager(num_blocks=7, block_size=4)
    a, b = make_req("a", range(8)), make_req("b", range(8))
    h0, h1 = hash_block_chain(list(range(8)), 4)
    kv.allocate_slots(a, 8)
    kv.allocate_slots(b, 8)  # computed again (no prefix lookup): its equal blocks stay unregistered
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    assert (kv.pool.get_cached_block(h0), kv.pool.get_cached_block(h1)) == (0, 1)
    kv.free(a)  # free queue: 4, 5, 6, 1, 0
    kv.allocate_slots(make_req("c", range(100, 116)), 16)  # takes 4, 5, 6, 1: h1 is evicted
    assert (kv.pool.get_cached_block(h0), kv.pool.get_cached_block(h1)) == (0, None)
    b.num_computed_tokens = 8
    b.output_token_ids.append(5)
    assert kv.allocate_slots(b, 1) == [0]  # evicts h0; both of b's blocks are registered now
    assert (kv.pool.get_cached_block(h0), kv.pool.get_cached_block(h1)) == (2, 3)
    assert b.num_registered_blocks == 2
