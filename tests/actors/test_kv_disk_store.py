"""Disk backend of the KV store: restart survival, corrupt and missing files as misses, TTL, byte limit."""

import numpy as np
import pytest

from rayinfer.actors.kv_disk_store import DiskKVStore

LAYOUT = "v1:L,N,2,bs,H,D:float32:bs=4"


def _payload(n, seed=0):
    return np.random.default_rng(seed).integers(0, 2**31, size=(2, n, 2, 4, 1, 3), dtype=np.int32)


def test_put_get_and_restart(tmp_path):
    store = DiskKVStore(tmp_path, "m")
    p = _payload(3)
    assert store.put([1, 2, 3], 0, p, LAYOUT) == 3
    assert store.put([1, 2, 3], 0, p, LAYOUT) == 0  # already stored
    again = DiskKVStore(tmp_path, "m")  # a restarted actor reads the index back
    assert again.num_restored == 3 and again.layout == LAYOUT
    assert again.match([1, 2, 3, 4]) == 3
    got = again.get([1, 2, 3])
    assert np.array_equal(np.concatenate(got, axis=1), p)
    assert DiskKVStore(tmp_path, "other-model").match([1]) == 0  # another namespace: wiped, never served


@pytest.mark.parametrize("damage", ["missing", "corrupt", "truncated"])
def test_damaged_file_is_a_miss(tmp_path, damage):
    store = DiskKVStore(tmp_path, "m")
    p = _payload(3)
    store.put([1, 2, 3], 0, p, LAYOUT)
    f = store._path(2)
    if damage == "missing":
        f.unlink()
    elif damage == "corrupt":
        raw = bytearray(f.read_bytes())
        raw[5] ^= 0xFF
        f.write_bytes(bytes(raw))
    else:
        f.write_bytes(f.read_bytes()[:-4])
    restarted = DiskKVStore(tmp_path, "m")
    got = restarted.get([1, 2, 3])
    assert len(got) == 1 and np.array_equal(got[0], p[:, :1])  # block 1 fine; 2 and its child 3 dropped
    assert restarted.match([1, 2, 3]) == 1 and restarted.num_corrupt == 1
    assert not restarted._path(3).exists()


def test_ttl_and_byte_limit(tmp_path):
    now = [1000.0]
    per_block = _payload(1)[:, :1].nbytes
    store = DiskKVStore(tmp_path, "m", max_bytes=3 * per_block, ttl_s=60, clock=lambda: now[0])
    store.put([1, 2], 0, _payload(2), LAYOUT)
    store.put([7, 8], 0, _payload(2, 1), LAYOUT)  # 4 blocks > limit: the LRU chain's tail (2) goes
    assert store.match([1, 2]) == 1 and store.match([7, 8]) == 2
    assert not store._path(2).exists()
    now[0] += 61
    assert store.match([7]) == 0 and not list(store.blocks_dir.glob("*.kv"))  # expired, files deleted
    assert DiskKVStore(tmp_path, "m", clock=lambda: now[0]).match([7]) == 0


def test_get_from_a_later_block_reads_only_those_files_and_touches_the_chain(tmp_path):
    store = DiskKVStore(tmp_path, "m", max_blocks=5)
    p = _payload(3)
    store.put([1, 2, 3], 0, p, LAYOUT)
    store.put([7, 8], 0, p[:, :2], LAYOUT)
    got = store.get([1, 2, 3], start=1)
    assert np.array_equal(np.concatenate(got, axis=1), p[:, 1:])
    store.put([9], 0, p[:, :1], LAYOUT)  # one block over the limit
    assert store.match([1, 2, 3]) == 3 and store.match([7, 8]) == 1  # the LRU block: the other chain's tail
    assert store.get([5, 6, 7], start=2) == []  # blocks before start must be stored
