"""Index of a KV-cache store: full blocks by chained hash, with block/byte capacity, TTL and LRU eviction.

A stored block is keyed by its chained hash (``block_pool.hash_block``: parent hash + token ids + extra
key), so a prompt's leading blocks can be looked up without its tokens, and equal hashes mean equal
prefixes. The index holds opaque values (in the KVStoreActor: Ray ObjectRefs of per-block payloads) and
never touches them; it is plain Python, so tests drive it with a fake clock.

Eviction order (hand-checkable, after the block pool's "free the tail first"): every access to a chain
(``put`` or ``get``) makes its blocks the most recent, tail first, so a chain's head is always newer than
its tail and LRU eviction removes leaves before their parents. Evicting a block also evicts its stored
descendants: without their parent they can never be matched again.

Glossary: chain = the hashes of one sequence's full blocks from block 0; head = block 0; tail = the
last block; descendant = a block whose chain passes through the given block.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rayinfer.engine.block_pool import NONE_HASH, hash_block_chain

__all__ = ["KVStoreIndex", "PutResult", "StoredBlock", "block_hashes"]


def block_hashes(token_ids: Sequence[int], block_size: int, extra_key: int | None = None,
                 mm_inputs: Sequence[Any] = ()) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` that a store lookup may use.

    At least one token is left to compute (its logits give the next token), so only full blocks inside
    the first ``len(token_ids) - 1`` tokens count, as in the engine's own prefix cache.

    Args:
        token_ids: the sequence (prompt plus any outputs so far).
        block_size: tokens per block.
        extra_key: the hash chain's extra key (LoRA id, cache salt), or None.
        mm_inputs: the prompt's images (``MultiModalInput``): blocks holding their placeholders also key on
            their content hashes, as the engine keys them (``engine.multimodal.mm_hash_block_chain``).
    Returns:
        ``(len(token_ids) - 1) // block_size`` hashes, each a non-zero unsigned 64-bit int.
    """
    n = max(len(token_ids) - 1, 0) // block_size
    if mm_inputs:
        from rayinfer.engine.multimodal import mm_hash_block_chain

        return mm_hash_block_chain(token_ids[: n * block_size], block_size, extra_key, mm_inputs)
    return hash_block_chain(token_ids[: n * block_size], block_size, extra_key)


@dataclass
class StoredBlock:
    """One stored block: its payload value, size, parent link and last access time (seconds)."""

    value: Any
    nbytes: int
    parent: int
    last_access: float
    children: set[int] = field(default_factory=set)


@dataclass
class PutResult:
    """What a ``put`` did.

    Attributes:
        added: hashes newly stored, in chain order.
        rejected: indices into the put's ``values`` that were not stored (already present, parent
            missing, or no room); the caller may release those values.
        evicted: hashes evicted to make room, in eviction order.
    """

    added: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)


class KVStoreIndex:
    """Hash-chain prefix index with capacity limits, TTL and LRU eviction (no Ray, no tensors).

    Args:
        max_blocks: blocks held at most; None for no block limit.
        max_bytes: payload bytes held at most; None for no byte limit.
        ttl_s: a block not accessed for this many seconds expires; None for never.
        clock: seconds, monotonic (tests pass a fake).
    Raises:
        ValueError: for a non-positive limit or TTL.
    """

    def __init__(self, max_blocks: int | None = None, max_bytes: int | None = None, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        for name, v in (("max_blocks", max_blocks), ("max_bytes", max_bytes), ("ttl_s", ttl_s)):
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive or None, got {v}")
        self.max_blocks, self.max_bytes, self.ttl_s = max_blocks, max_bytes, ttl_s
        self.clock = clock
        self.blocks: OrderedDict[int, StoredBlock] = OrderedDict()  # front: least recently used
        self.num_bytes = 0
        self.num_queries = 0  # blocks asked for by match
        self.num_hits = 0  # of those, blocks found
        self.num_evicted = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.blocks

    # -- lookups -------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks of a chain that are stored (expired ones first drop out).

        Counts the query for the hit rate; does not change the LRU order.
        """
        self.expire()
        n = 0
        for h in block_hashes:
            if h not in self.blocks:
                break
            n += 1
        self.num_queries += len(block_hashes)
        self.num_hits += n
        return n

    def get(self, block_hashes: Sequence[int]) -> list[Any]:
        """Values of the leading stored blocks of a chain (stops at the first missing one).

        Side effect: those blocks become the most recent, tail first (see the module docstring).
        """
        self.expire()
        out = []
        for h in block_hashes:
            block = self.blocks.get(h)
            if block is None:
                break
            out.append(block.value)
        self._touch(block_hashes[: len(out)])
        return out

    # -- writes --------------------------------------------------------------------------------
    def put(self, block_hashes: Sequence[int], values: Sequence[Any], nbytes: int | Sequence[int],
            start: int = 0) -> PutResult:
        """Store blocks ``start .. start + len(values)`` of a chain.

        Args:
            block_hashes: the chain from block 0 (parents of the new blocks are read from it); at least
                ``start + len(values)`` hashes.
            values: the payload of each new block, in chain order.
            nbytes: bytes of each value (one int for all, or one per value).
            start: chain index of ``values[0]``.
        Returns:
            a :class:`PutResult`. A block already stored keeps its old value; a block whose parent is not
            stored, or that cannot fit even after evicting every block outside this chain, is rejected
            (with every later block: a chain is stored as a prefix).
        Raises:
            ValueError: if ``block_hashes`` is shorter than ``start + len(values)`` or ``nbytes`` has the
                wrong length.
        """
        if start < 0 or len(block_hashes) < start + len(values):
            raise ValueError(f"put of {len(values)} blocks from index {start} needs that many chain hashes, "
                             f"got {len(block_hashes)}")
        sizes = [nbytes] * len(values) if isinstance(nbytes, int) else list(nbytes)
        if len(sizes) != len(values):
            raise ValueError(f"nbytes has {len(sizes)} entries for {len(values)} values")
        self.expire()
        result = PutResult()
        chain = list(block_hashes[: start + len(values)])
        protected = set(chain)
        self._touch([h for h in chain[:start] if h in self.blocks])
        for i, (value, size) in enumerate(zip(values, sizes)):
            j = start + i
            h, parent = chain[j], chain[j - 1] if j else NONE_HASH
            if h in self.blocks:
                result.rejected.append(i)
                continue
            if parent != NONE_HASH and parent not in self.blocks:
                result.rejected.extend(range(i, len(values)))
                break
            if not self._make_room(size, protected, result.evicted):
                result.rejected.extend(range(i, len(values)))
                break
            self.blocks[h] = StoredBlock(value, size, parent, self.clock())
            self.num_bytes += size
            if parent != NONE_HASH:
                self.blocks[parent].children.add(h)
            result.added.append(h)
        self._touch([h for h in chain if h in self.blocks])
        return result

    def remove(self, block_hash: int) -> list[int]:
        """Drop a block and its stored descendants; returns the dropped hashes (parent before child)."""
        return self._evict(block_hash) if block_hash in self.blocks else []

    def expire(self) -> list[int]:
        """Drop blocks not accessed for ``ttl_s`` seconds (with their descendants); returns their hashes."""
        if self.ttl_s is None:
            return []
        deadline = self.clock() - self.ttl_s
        dropped: list[int] = []
        while self.blocks:
            h, block = next(iter(self.blocks.items()))
            if block.last_access > deadline:
                break
            dropped += self._evict(h)
        self.num_expired += len(dropped)
        return dropped

    def clear(self) -> None:
        """Forget every block (counters stay)."""
        self.blocks.clear()
        self.num_bytes = 0

    # -- internals -----------------------------------------------------------------------------
    def _touch(self, chain: Sequence[int]) -> None:
        """Make a chain's blocks the most recent, tail first, so the head ends up newest."""
        now = self.clock()
        for h in reversed(chain):
            self.blocks[h].last_access = now
            self.blocks.move_to_end(h)

    def _evict(self, block_hash: int) -> list[int]:
        """Drop a block and its descendants, unlinking it from its parent."""
        parent = self.blocks[block_hash].parent
        dropped, stack = [], [block_hash]
        while stack:
            h = stack.pop()
            block = self.blocks.pop(h)
            self.num_bytes -= block.nbytes
            dropped.append(h)
            stack.extend(sorted(block.children, reverse=True))
        if parent in self.blocks:
            self.blocks[parent].children.discard(block_hash)
        return dropped

    def _fits(self, size: int) -> bool:
        return ((self.max_blocks is None or len(self.blocks) + 1 <= self.max_blocks)
                and (self.max_bytes is None or self.num_bytes + size <= self.max_bytes))

    def _make_room(self, size: int, protected: set[int], evicted: list[int]) -> bool:
        """Evict least recently used blocks outside ``protected`` until one block of ``size`` fits."""
        if self.max_bytes is not None and size > self.max_bytes:
            return False
        while not self._fits(size):
            victim = next((h for h in self.blocks if h not in protected), None)
            if victim is None:
                return False
            dropped = self._evict(victim)
            self.num_evicted += len(dropped)
            evicted += dropped
        return True

    # -- stats ---------------------------------------------------------------------------------
    @property
    def hit_rate(self) -> float:
        """Fraction of blocks asked for by ``match`` that were stored (0 before any query)."""
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    def stats(self) -> dict:
        """Gauges and counters (keys prefixed ``kv_store_`` so they sit beside engine stats)."""
        return {
            "kv_store_blocks": len(self.blocks),
            "kv_store_bytes": self.num_bytes,
            "kv_store_queries": self.num_queries,
            "kv_store_hits": self.num_hits,
            "kv_store_hit_rate": self.hit_rate,
            "kv_store_evicted": self.num_evicted,
            "kv_store_expired": self.num_expired,
        }
