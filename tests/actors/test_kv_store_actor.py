"""KVStoreActor on Ray without a model: round trip, blocks outlive their writer, a restart loses only cache."""

import time

import numpy as np
import pytest
import ray
import torch

from rayinfer.actors.kv_store import KVStoreActor
from rayinfer.actors.kv_transport import from_wire, to_wire
from rayinfer.engine.block_pool import hash_block_chain

LAYOUT = "v1:L,N,2,bs,H,D:float32:bs=4"


def payload(n, seed=0, head_dim=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, n, 2, 4, 1, head_dim, generator=g)  # [L, n, 2, bs, H, D]


def stored(refs) -> torch.Tensor:
    """The blocks behind the store's refs as one float32 payload (what a prefill replica loads)."""
    return from_wire(np.concatenate(ray.get(refs), axis=1), torch.float32)


@ray.remote(num_cpus=0)
class Writer:
    """Stands in for a prefill replica that writes its blocks through and then dies."""

    def write(self, store, hashes, start, data):
        return ray.get(store.put.remote(hashes, start, data, LAYOUT))


@pytest.fixture
def store(ray_cluster):
    s = KVStoreActor.options(num_cpus=0, max_restarts=1).remote(max_blocks=8)
    yield s
    ray.kill(s, no_restart=True)


def test_round_trip_and_prefix_match(store):
    hashes = hash_block_chain(list(range(16)), 4)
    data = payload(3)
    assert ray.get(store.put.remote(hashes, 0, data[:, :3], LAYOUT)) == 3
    assert ray.get(store.put.remote(hashes, 1, data[:, 1:3], LAYOUT)) == 0  # already stored
    assert ray.get(store.match.remote(hashes)) == 3
    layout, refs = ray.get(store.get.remote(hashes))
    assert layout == LAYOUT and len(refs) == 3
    assert torch.equal(stored(refs), data)
    assert ray.get(store.put.remote(hashes, 3, payload(1), "v1:other")) == 0  # another layout is refused
    stats = ray.get(store.stats.remote())
    assert stats["kv_store_blocks"] == 3 and stats["kv_store_hit_rate"] == 3 / 4
    assert stats["kv_store_bytes"] == 3 * data[:, :1].numel() * 4


def test_blocks_outlive_their_writer(store):
    hashes = hash_block_chain(list(range(8)), 4)
    data = payload(2, seed=1)
    writer = Writer.remote()
    assert ray.get(writer.write.remote(store, hashes, 0, to_wire(data))) == 2  # as replicas write: wire form
    ray.kill(writer, no_restart=True)
    _, refs = ray.get(store.get.remote(hashes))
    assert torch.equal(stored(refs), data)


def test_a_restarted_store_comes_back_empty(store):
    hashes = hash_block_chain(list(range(8)), 4)
    ray.get(store.put.remote(hashes, 0, payload(2, head_dim=8192), LAYOUT))  # 512 KiB blocks: in plasma
    _, refs = ray.get(store.get.remote(hashes))
    ray.kill(store, no_restart=False)  # asynchronous: calls may still reach the old process for a moment
    deadline = time.monotonic() + 60
    while True:
        try:
            if ray.get(store.match.remote(hashes), timeout=60) == 0:
                break  # the restarted store: only cached data is gone
        except ray.exceptions.RayActorError:
            pass  # restarting
        assert time.monotonic() < deadline, "the store did not come back empty"
        time.sleep(0.2)
    try:  # old refs: their owner died; a reader gets the data if a copy is still local, or a RayError
        ray.get(refs, timeout=30)
    except ray.exceptions.RayError:
        pass


def test_wire_form_round_trip_keeps_bytes():
    """bfloat16 and float8 (no numpy dtype) and float32 payloads cross as integer views, bit for bit."""
    data = torch.randn(2, 3, 2, 4, 1, 8)
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        x = data.to(dtype)
        wire = to_wire(x)
        assert isinstance(wire, np.ndarray) and wire.nbytes == x.numel() * x.element_size()
        back = from_wire(wire, dtype)
        assert back.dtype == dtype and torch.equal(back.view(torch.uint8), x.view(torch.uint8))


def test_a_fetch_from_a_later_block_keeps_the_chain_in_lru_order(store):
    """A replica that holds a chain's first blocks fetches the rest (``get_blocks(..., start)``); the blocks it
    skipped count as used too, so the next eviction takes an older chain, not this one's head (which would drop
    the whole conversation with it). The store holds 8 blocks."""
    chain, other, newer = (hash_block_chain(list(range(s, s + 20)), 4) for s in (0, 1000, 2000))
    data = payload(5)
    assert ray.get(store.put.remote(chain, 0, data, LAYOUT)) == 5
    assert ray.get(store.put.remote(other[:2], 0, data[:, :2], LAYOUT)) == 2
    layout, blocks = ray.get(store.get_blocks.remote(chain, 2))
    assert layout == LAYOUT and len(blocks) == 3
    assert torch.equal(from_wire(np.concatenate(blocks, axis=1), torch.float32), data[:, 2:])
    assert ray.get(store.put.remote(newer[:2], 0, data[:, :2], LAYOUT)) == 2  # 9 blocks: the LRU one is evicted
    # the other chain's tail; had the skipped blocks not counted as used, the chain's block 1 (and after it 2..4)
    assert ray.get(store.match.remote(chain)) == 5 and ray.get(store.match.remote(other[:2])) == 1
    assert ray.get(store.get_blocks.remote(chain, 5)) == (LAYOUT, [])  # nothing after the held blocks
