"""KVStoreIndex by hand: prefix match, LRU order (tail first), capacity by blocks and bytes, TTL, chains."""

import pytest

from rayinfer.engine.block_pool import hash_block_chain
from rayinfer.policy.kv_store_index import KVStoreIndex, block_hashes


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def chain(n, base=0, bs=2):
    """Hashes of n full blocks of tokens base, base+1, ... (block size 2)."""
    return hash_block_chain(list(range(base, base + n * bs)), bs)


def test_block_hashes_leave_one_token_to_compute():
    assert block_hashes(list(range(8)), 4) == hash_block_chain(list(range(4)), 4)  # 7 tokens usable: 1 block
    assert len(block_hashes(list(range(9)), 4)) == 2
    assert block_hashes([1], 4) == [] and block_hashes([], 4) == []
    assert block_hashes(list(range(9)), 4, extra_key=3) != block_hashes(list(range(9)), 4)


def test_match_counts_leading_blocks_and_hit_rate():
    idx = KVStoreIndex()
    a = chain(3)
    res = idx.put(a[:2], ["a0", "a1"], 10)
    assert res.added == a[:2] and not res.rejected and not res.evicted
    assert idx.match(a) == 2 and idx.match(chain(3, base=100)) == 0
    assert idx.hit_rate == pytest.approx(2 / 6)
    assert idx.get(a) == ["a0", "a1"]
    assert idx.stats()["kv_store_bytes"] == 20


def test_put_from_middle_needs_parent_and_keeps_old_values():
    idx = KVStoreIndex()
    a = chain(4)
    assert idx.put(a, ["x2", "x3"], 1, start=2).rejected == [0, 1]  # parent a[1] missing
    idx.put(a, ["a0", "a1"], 1)
    res = idx.put(a, ["b1", "a2", "a3"], 1, start=1)  # a[1] already stored: old value kept
    assert res.added == a[2:] and res.rejected == [0]
    assert idx.get(a) == ["a0", "a1", "a2", "a3"]


def test_lru_evicts_tails_first_by_block_count():
    t = Clock()
    idx = KVStoreIndex(max_blocks=4, clock=t)
    a, b = chain(2, base=0), chain(2, base=100)
    idx.put(a, ["a0", "a1"], 1)
    t.t = 1
    idx.put(b, ["b0", "b1"], 1)
    assert list(idx.blocks) == [a[1], a[0], b[1], b[0]]  # oldest first; each head newer than its tail
    t.t = 2
    c = chain(1, base=200)
    res = idx.put(c, ["c0"], 1)
    assert res.evicted == [a[1]]  # the least recent tail, not a's head
    t.t = 3
    idx.get(a)  # touching a's head keeps it
    res = idx.put(chain(2, base=300), ["d0", "d1"], 1)
    assert res.evicted == [b[1], b[0]]
    assert idx.match(a) == 1 and idx.match(b) == 0


def test_evicting_a_parent_drops_its_descendants():
    idx = KVStoreIndex(max_blocks=3)
    a = chain(3)
    idx.put(a, ["a0", "a1", "a2"], 1)
    idx.blocks.move_to_end(a[0], last=False)  # force the head to be least recent
    res = idx.put(chain(1, base=50), ["z"], 1)
    assert res.evicted == [a[0], a[1], a[2]]  # a0's children are unreachable without it
    assert len(idx) == 1 and idx.num_evicted == 3


def test_capacity_in_bytes_and_oversized_chain():
    idx = KVStoreIndex(max_bytes=25)
    a, b = chain(2), chain(2, base=100)
    idx.put(a, ["a0", "a1"], 10)
    res = idx.put(b, ["b0", "b1"], [10, 10])
    assert res.evicted == [a[1], a[0]] and res.added == b and idx.num_bytes == 20
    long = chain(3, base=500)
    res = idx.put(long, ["l0", "l1", "l2"], 10)  # 30 bytes > 25: the chain's own head is never evicted
    assert res.added == long[:2] and res.rejected == [2]
    assert idx.put(chain(1, base=900), ["huge"], 26).rejected == [0]


def test_ttl_expires_idle_blocks_and_access_refreshes():
    t = Clock()
    idx = KVStoreIndex(ttl_s=10, clock=t)
    a, b = chain(2), chain(1, base=100)
    idx.put(a, ["a0", "a1"], 1)
    t.t = 5
    idx.put(b, ["b0"], 1)
    t.t = 9
    assert idx.get(a[:1]) == ["a0"]  # refreshes a0 only
    t.t = 12
    assert idx.match(a) == 1  # a1 (idle since 0) expired, a0 (touched at 9) stays
    t.t = 15
    assert idx.match(b) == 0 and idx.num_expired == 2
    t.t = 19.5
    assert idx.match(a) == 0 and len(idx) == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_blocks"):
        KVStoreIndex(max_blocks=0)
    idx = KVStoreIndex()
    with pytest.raises(ValueError, match="chain hashes"):
        idx.put(chain(1), ["a", "b"], 1)
    with pytest.raises(ValueError, match="nbytes"):
        idx.put(chain(2), ["a", "b"], [1])
