"""Paged KV block pool with hash-chain prefix caching.

Blocks are fixed-size pages of the KV cache. A full block gets a chained hash (parent block's hash +
its token ids + an extra key such as a LoRA id or cache salt), so equal prefixes map to equal hash
chains and can share blocks. Freed blocks keep their hash and contents until they are reused: they sit
in an eviction-ordered free queue (least recently freed first), and a prefix hit takes a block back
out of it. After vLLM v1's BlockPool.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

NONE_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int], extra_key: int | None = None) -> int:
    """Chained hash of one full block, stable across processes and machines.

    Args:
        parent_hash: hash of the previous block (``NONE_HASH`` for the first block).
        token_ids: the block's token ids (block_size of them).
        extra_key: optional int mixed in (LoRA id, cache salt); None for none.
    Returns:
        a non-zero unsigned 64-bit int (blake2b of the packed inputs).
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Qq", parent_hash, -1 if extra_key is None else extra_key))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little") or 1


def hash_block_chain(token_ids: Sequence[int], block_size: int, extra_key: int | None = None,
                     start: int = 0, parent_hash: int = NONE_HASH) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on (partial tail ignored)."""
    hashes = []
    for b in range(start, len(token_ids) // block_size):
        parent_hash = hash_block(parent_hash, token_ids[b * block_size : (b + 1) * block_size], extra_key)
        hashes.append(parent_hash)
    return hashes


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the prefix cache


class KVBlockPool:
    """Fixed pool of KV blocks with reference counts, a prefix cache and LRU eviction.

    Args:
        num_blocks: blocks in the pool.
        enable_caching: keep hashes of full blocks for prefix hits.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> None, in eviction order (front is evicted first)
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_hits = 0
        self.num_queries = 0
        # called as on_evict(block_id, block_hash) when a cached block is taken for reuse, before its
        # contents are overwritten (the host KV tier copies it out; see KVCacheManager)
        self.on_evict: Callable[[int, int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int) -> int | None:
        """Block id that holds ``block_hash``, or None. Does not take a reference."""
        return self.hash_to_block.get(block_hash)

    def match_prefix(self, block_hashes: Sequence[int], count: bool = True) -> list[int]:
        """Longest run of leading hashes already cached; returns their block ids (no references taken).
        ``count``: add the lookup to the prefix-cache hit statistics (False for internal lookups)."""
        hit: list[int] = []
        if self.enable_caching:
            for h in block_hashes:
                block_id = self.hash_to_block.get(h)
                if block_id is None:
                    break
                hit.append(block_id)
            if count:
                self.num_queries += len(block_hashes)
                self.num_hits += len(hit)
        return hit

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on each block (a prefix hit); a free block leaves the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue (evicting their cached hashes).

        Raises:
            RuntimeError: if fewer than ``n`` blocks are free (callers check ``num_free_blocks``).
        """
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.hash_to_block.get(block.block_hash) == block_id:
                    del self.hash_to_block[block.block_hash]
                    if self.on_evict is not None:
                        self.on_evict(block_id, block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the back of the free queue in
        the given order (so callers pass a request's blocks tail first: tails are evicted first)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Register a full block under its hash (first writer wins; a duplicate stays uncached)."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        if block_hash not in self.hash_to_block:
            self.hash_to_block[block_hash] = block_id
            block.block_hash = block_hash
