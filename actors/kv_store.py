"""KVStoreActor: a KV-cache store shared by replicas, outliving any of them (thin over KVStoreIndex).

Two backends. In memory (no ``directory``): each stored full block is one object in the Ray object store,
put by this actor, so this actor owns it: a replica may die and the cached blocks stay readable; if this
actor itself dies and restarts (``max_restarts``), it comes back empty and callers treat that as a cache
miss. On disk (``directory`` set, :class:`~rayinfer.actors.kv_disk_store.DiskKVStore`): one file per block
and a msgpack index, so a restarted actor (or a new one on the same directory) serves what was stored
before; a missing or damaged file is a miss.
"""

from __future__ import annotations

import logging

import numpy as np
import ray
import torch

from rayinfer.actors.cluster import configure_worker_logging
from rayinfer.actors.kv_disk_store import DEFAULT_TTL_S, DiskKVStore
from rayinfer.actors.kv_transport import to_wire
from rayinfer.policy.kv_store_index import KVStoreIndex

logger = logging.getLogger(__name__)


class KVStoreActorImpl:
    """Hash-chain prefix store of KV blocks.

    Args:
        max_blocks: blocks held at most (None: no block limit).
        max_bytes: payload bytes held at most (None: no byte limit).
        ttl_s: blocks idle this long expire (None: never; on disk the default is 3 days).
        directory: keep blocks in files there (:class:`DiskKVStore`) instead of the object store.
        namespace: what the hashes are hashes of (the model name); a disk index of another namespace is
            discarded.
    """

    def __init__(self, max_blocks: int | None = None, max_bytes: int | None = None, ttl_s: float | None = None,
                 directory: str | None = None, namespace: str = ""):
        configure_worker_logging()
        self.disk = (DiskKVStore(directory, namespace, max_blocks, max_bytes, ttl_s or DEFAULT_TTL_S)
                     if directory else None)
        self.index = KVStoreIndex(max_blocks=max_blocks, max_bytes=max_bytes, ttl_s=ttl_s)
        self.layout: str | None = None  # the payload layout tag of the first put; others are refused
        self.num_put_blocks = 0

    def match(self, block_hashes: list[int]) -> int:
        """Number of leading blocks of a chain that are stored (counts toward the hit rate)."""
        if self.disk is not None:
            return self.disk.match(block_hashes)
        return self.index.match(block_hashes)

    def get_blocks(self, block_hashes: list[int], start: int = 0) -> tuple[str | None, list[np.ndarray]]:
        """The leading stored blocks of a chain as wire arrays ``[L, 1, ...]`` (fewer than :meth:`match`
        said when a file turned out missing or damaged), from block ``start`` on: a replica that holds the
        first ones fetches the rest. The whole run read counts as used (LRU), the head newest, so the blocks
        the caller skipped are not evicted before the ones after them."""
        if self.disk is not None:
            return self.disk.layout, self.disk.get(block_hashes, start)
        return self.layout, ray.get(self.index.get(block_hashes)[start:])  # ray.get([]) is []

    def get(self, block_hashes: list[int]) -> tuple[str | None, list[ray.ObjectRef]]:
        """The leading stored blocks of a chain.

        Returns:
            (layout tag, one ObjectRef per block, each to the wire form (``kv_transport.to_wire``: a numpy
            array of the bytes) of a ``[L, 1, 2, bs, H, D]`` block of that layout; ``from_wire`` with the
            layout's dtype restores it); the refs are borrowed by the caller, so a later eviction does not
            pull them away.
        """
        if self.disk is not None:
            return self.disk.layout, [ray.put(a) for a in self.disk.get(block_hashes)]
        return self.layout, self.index.get(block_hashes)

    def put(self, block_hashes: list[int], start: int, payload: "np.ndarray | torch.Tensor", layout: str) -> int:
        """Store blocks ``start .. start + payload.shape[1]`` of a chain (write-through after a prefill).

        Args:
            block_hashes: the chain from block 0, at least ``start + payload.shape[1]`` hashes.
            start: chain index of the payload's first block.
            payload: ``[L, n, 2, bs, H, D]`` (the layout named by ``layout``), on CPU, in wire form
                (``kv_transport.to_wire``; a tensor is converted).
            layout: the payload's layout tag (``engine.model_runner.kv_layout_tag``).
        Returns:
            blocks newly stored (blocks already stored, past the capacity, or of another layout are not).
        """
        if self.disk is not None:
            added = self.disk.put(block_hashes, start, to_wire(payload) if isinstance(payload, torch.Tensor)
                                  else payload, layout)
            self.num_put_blocks += added
            return added
        if self.layout is None:
            self.layout = layout
        if layout != self.layout:
            logger.warning("KV store holds layout %s; refusing a put of %s", self.layout, layout)
            return 0
        n = payload.shape[1]
        skip = 0
        while skip < n and block_hashes[start + skip] in self.index:
            skip += 1  # no object for blocks already stored
        if skip == n:
            self.index.get(block_hashes[: start + n])  # still a use: refresh the chain
            return 0
        wire = to_wire(payload) if isinstance(payload, torch.Tensor) else payload
        per_block = wire[:, :1].nbytes
        refs = [ray.put(np.ascontiguousarray(wire[:, i : i + 1])) for i in range(skip, n)]
        result = self.index.put(block_hashes, refs, per_block, start=start + skip)
        self.num_put_blocks += len(result.added)
        return len(result.added)

    def stats(self) -> dict:
        """The index's gauges and counters (``kv_store_*``), plus the role for per-replica metrics."""
        backend = self.disk.stats() if self.disk is not None else self.index.stats()
        return {"replica_id": "kv_store", "role": "kv_store", "kv_store_put_blocks": self.num_put_blocks, **backend}

    def clear(self) -> None:
        """Drop every stored block."""
        self.index.clear()
        if self.disk is not None:
            self.disk.clear()


KVStoreActor = ray.remote(KVStoreActorImpl)
