"""Block-table policy on top of :class:`KVBlockPool`: prefix hits, slot allocation, freeing.

Models with sliding-window layers (Gemma 3) keep two KV cache groups, after vLLM's hybrid KV cache
manager: the full-attention ("global") layers use ``req.block_ids`` from the main pool, prefix-cached,
offloaded to the host tier and exported as always; the sliding ("local") layers use
``req.local_block_ids`` from a pool of their own, never cached. A local table has one entry per block of
the request, but blocks wholly before the window of the next token to compute are returned to the
local pool and their entries replaced by :data:`NULL_BLOCK` (never read: the attention skips keys
outside the window), so a request holds about ``window / block_size + 1`` local blocks however long it
grows. A prefix hit restores only global KV; the local KV of the hit's last ``window - 1`` tokens is
recomputed (bounded replay, see ``Scheduler``).

Bounded replay is an approximation, not a bit-exact restore: the replayed tokens' own sliding layers
see only keys from the replay's start (the local KV before it is gone), so their hidden states, and the
local KV the later layers write for them, differ from a cold prefill's; exactness would need a replay
of ``num_sliding_layers * (W - 1)`` tokens. On Gemma-3-270M (float32, a 528-token hit) the greedy
tokens equal the cold run's while their log-probabilities move by up to ~0.3 nats.
"""

from __future__ import annotations

from typing import Sequence

from rayinfer.engine.block_pool import NONE_HASH, KVBlockPool, hash_block
from rayinfer.engine.host_kv_cache import HostBlockIndex
from rayinfer.engine.multimodal import block_extra_key
from rayinfer.engine.types import Request

NULL_BLOCK = 0  # local pool block reserved as the placeholder of freed local table entries


class KVCacheManager:
    """Owns every request's block table.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_caching: share full blocks between requests with equal prefixes.
        num_host_blocks: slots of the host-memory tier (0: none). Cached blocks the pool evicts are
            offloaded there, and a prefix that misses the pool but hits there is loaded back; the copies
            of one step are collected by :meth:`take_transfers` for the model runner.
        sliding_window: W (tokens) of the local group, or None for a model with full attention only.
        num_local_blocks: blocks of the local group's pool (block :data:`NULL_BLOCK` reserved).
    Raises:
        ValueError: for a non-positive block size, a host tier without prefix caching, or a sliding
            window without at least two local blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_host_blocks: int = 0,
                 sliding_window: int | None = None, num_local_blocks: int = 0):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = KVBlockPool(num_blocks, enable_caching)
        self.host: HostBlockIndex | None = None
        self._offloads: list[tuple[int, int]] = []  # (device block, host slot) of this step, in order
        self._loads: list[tuple[int, int]] = []  # (host slot, device block)
        if num_host_blocks:
            if not enable_caching:
                raise ValueError("the host KV tier (host_kv_cache_gib > 0) needs enable_prefix_caching")
            self.host = HostBlockIndex(num_host_blocks)
            self.pool.on_evict = self._on_evict
        self.sliding_window = sliding_window
        self.local_pool: KVBlockPool | None = None
        if sliding_window is not None:
            if num_local_blocks < 2:
                raise ValueError(f"a sliding window needs at least 2 local KV blocks, got {num_local_blocks}")
            self.local_pool = KVBlockPool(num_local_blocks, enable_caching=False)
            assert self.local_pool.allocate(1) == [NULL_BLOCK]

    def _on_evict(self, block_id: int, block_hash: int) -> None:
        assert self.host is not None
        slot = self.host.offload(block_hash)
        if slot is not None:
            self._offloads.append((block_id, slot))

    def match_host(self, req: Request, num_device_blocks: int) -> list[int]:
        """Host slots of the request's full prompt blocks after its ``num_device_blocks`` device hits (the
        leading run held by the host tier; at least one token is left to compute). Pins them."""
        if self.host is None:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        if num_device_blocks >= max_blocks:
            return []
        return self.host.match(req.block_hashes[num_device_blocks:max_blocks])

    def add_loads(self, slots: list[int], block_ids: list[int]) -> None:
        """Queue host -> device copies of a host hit (after the step's offloads)."""
        self._loads.extend(zip(slots, block_ids))
        if self.host is not None:
            self.host.num_loaded += len(slots)

    def take_transfers(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """This step's (offloads, loads), emptied; unpins the host slots the loads read."""
        out = tuple(self._offloads), tuple(self._loads)
        self._offloads, self._loads = [], []
        if self.host is not None:
            self.host.unpin_all()
        return out

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend ``req.block_hashes`` to cover the full blocks within its first ``num_tokens`` tokens."""
        num_full = num_tokens // self.block_size
        if len(req.block_hashes) >= num_full:
            return
        parent = req.block_hashes[-1] if req.block_hashes else NONE_HASH
        bs = self.block_size
        for b in range(len(req.block_hashes), num_full):
            # a block holding image placeholders also keys on the images' content hashes
            key = block_extra_key(req.cache_salt, req.mm_inputs, b * bs, (b + 1) * bs) if req.mm_inputs else req.cache_salt
            parent = hash_block(parent, req.known_token_ids(b * bs, (b + 1) * bs), key)
            req.block_hashes.append(parent)

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that has no blocks yet.

        At least one token is always left to compute (its logits give the next token), so only full
        blocks inside the first ``num_tokens - 1`` tokens can hit.

        Returns:
            (block ids, number of tokens they cover). No references are taken.
        """
        if not self.pool.enable_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._update_hashes(req, max_blocks * self.block_size)
        hit = self.pool.match_prefix(req.block_hashes[:max_blocks])
        return hit, len(hit) * self.block_size

    def num_replay_tokens(self, num_hit: int) -> int:
        """Tokens before a prefix hit of ``num_hit`` tokens whose local KV is recomputed: the window's
        ``W - 1`` (what the first uncached token's sliding layers read), 0 without a local group."""
        return 0 if self.sliding_window is None else min(num_hit, self.sliding_window - 1)

    def _local_free_before(self, first_pos: int) -> int:
        """Local blocks wholly before the window of a query at ``first_pos``: ``(first_pos - W + 1) // bs``."""
        assert self.sliding_window is not None
        return max(0, first_pos - self.sliding_window + 1) // self.block_size

    def _grow_local(self, req: Request, total: int, first_pos: int) -> bool:
        """Free the local blocks the step's first query (position ``first_pos``) no longer sees, then grow
        the local table to ``total`` tokens (entries before that window stay :data:`NULL_BLOCK`).
        Returns False, with nothing allocated, if the local pool is short."""
        pool, table = self.local_pool, req.local_block_ids
        assert pool is not None
        drop = self._local_free_before(first_pos)
        pool.free(reversed([b for b in table[:drop] if b != NULL_BLOCK]))
        table[:drop] = [NULL_BLOCK] * min(drop, len(table))
        num_entries = self.blocks_needed(total)
        new = [i for i in range(len(table), num_entries) if i >= drop]
        if len(new) > pool.num_free_blocks:
            return False
        table.extend([NULL_BLOCK] * (num_entries - len(table)))
        for i, b in zip(new, pool.allocate(len(new))):
            table[i] = b
        return True

    def num_local_blocks_held(self, req: Request) -> int:
        """Local-pool blocks a request holds (its table's entries other than :data:`NULL_BLOCK`)."""
        return sum(1 for b in req.local_block_ids if b != NULL_BLOCK)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int] = (),
                       first_pos: int | None = None) -> list[int] | None:
        """Grow a request's block table to hold ``num_new_tokens`` more tokens.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, first admission only) are referenced and
        put first; ``req.num_computed_tokens`` must already count them. Full blocks whose tokens are all
        known after this step are registered in the prefix cache.

        With a local group, the local table grows too and drops the blocks before the window of the
        step's first query, at ``first_pos`` (default ``req.num_computed_tokens``; earlier for a replay).

        Returns:
            the newly allocated block ids, or None (and no change to the global table) if a pool cannot
            hold them.
        """
        pool, block_ids = self.pool, req.block_ids
        total = req.num_computed_tokens + num_new_tokens
        num_needed = self.blocks_needed(total) - len(block_ids) - len(computed_blocks)
        if computed_blocks:
            num_evictable_hits = sum(1 for b in computed_blocks if pool.blocks[b].ref_cnt == 0)
            if num_needed > pool.num_free_blocks - num_evictable_hits:
                return None
        elif num_needed > pool.num_free_blocks:
            return None
        if self.local_pool is not None:
            first = req.num_computed_tokens if first_pos is None else first_pos
            if not self._grow_local(req, total, first):
                return None
        if computed_blocks:
            pool.touch(computed_blocks)
            block_ids.extend(computed_blocks)
        new_blocks = []
        if num_needed > 0:
            new_blocks = pool.allocate(num_needed)
            block_ids.extend(new_blocks)
        num_full = min(total, req.num_known_tokens) // self.block_size
        if pool.enable_caching and req.num_registered_blocks < num_full:
            self._update_hashes(req, num_full * self.block_size)
            for b in range(req.num_registered_blocks, num_full):
                pool.cache_block(block_ids[b], req.block_hashes[b])
            # a registered block keeps its hash while held; a duplicate is retried on the next call
            done = req.num_registered_blocks
            while done < num_full and pool.blocks[block_ids[done]].block_hash is not None:
                done += 1
            req.num_registered_blocks = done
        return new_blocks

    def free(self, req: Request) -> None:
        """Release a request's blocks, tail first (so its tail is evicted before shared prefixes)."""
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        if self.local_pool is not None:
            self.local_pool.free(reversed([b for b in req.local_block_ids if b != NULL_BLOCK]))
            req.local_block_ids = []
        req.num_registered_blocks = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of queried full prompt blocks that hit the prefix cache (0 before any query)."""
        return self.pool.num_hits / self.pool.num_queries if self.pool.num_queries else 0.0
