"""Host-memory KV tier: blocks the device pool evicts are copied to a host pool with its own LRU, and a
prefix miss on the device pool that hits here is loaded back instead of recomputed.

Two halves: :class:`HostBlockIndex` is the bookkeeping (hash -> host slot, LRU, pins; pure Python, driven
by the scheduler through ``KVCacheManager``), and :class:`HostKVCache` holds the host tensor and moves
blocks (``ModelRunner`` runs a step's offloads, then its loads, before the step's forward). After
SGLang's HiCache (device pool + host pool) and DeepSeek's tiered KV cache.

Glossary: offload = device block -> host slot (on device eviction); load = host slot -> device block
(on a host hit); slot = a block's index in the host pool; pin = a slot a pending load reads, never
reused until the step's transfers are handed to the runner.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

__all__ = ["HostBlockIndex", "HostKVCache"]


class HostBlockIndex:
    """Which block hashes the host pool holds, in LRU order (front: evicted first).

    Args:
        num_blocks: host slots.
    Raises:
        ValueError: if ``num_blocks`` is not positive.
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"host KV pool must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.hash_to_slot: OrderedDict[int, int] = OrderedDict()
        self.free_slots = list(range(num_blocks - 1, -1, -1))  # pop() gives slot 0 first
        self.pinned: set[int] = set()
        self.num_queries = 0  # blocks looked up here (device-pool misses)
        self.num_hits = 0  # of those, found here
        self.num_offloaded = 0  # blocks copied device -> host
        self.num_loaded = 0  # blocks copied host -> device

    def __len__(self) -> int:
        return len(self.hash_to_slot)

    def match(self, block_hashes: Sequence[int]) -> list[int]:
        """Slots of the leading run of ``block_hashes`` held here; they become the most recent and are
        pinned until :meth:`unpin_all`. Counts the query."""
        slots = []
        for h in block_hashes:
            slot = self.hash_to_slot.get(h)
            if slot is None:
                break
            slots.append(slot)
        for h in reversed(block_hashes[: len(slots)]):  # tail first: the head ends up newest
            self.hash_to_slot.move_to_end(h)
        self.pinned.update(slots)
        self.num_queries += len(block_hashes)
        self.num_hits += len(slots)
        return slots

    def offload(self, block_hash: int) -> int | None:
        """A slot to copy an evicted device block with ``block_hash`` into, or None (already held here:
        refreshed; or every slot pinned). Evicts the least recently used unpinned hash if full."""
        if block_hash in self.hash_to_slot:
            self.hash_to_slot.move_to_end(block_hash)
            return None
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((h for h, s in self.hash_to_slot.items() if s not in self.pinned), None)
            if victim is None:
                return None
            slot = self.hash_to_slot.pop(victim)
        self.hash_to_slot[block_hash] = slot
        self.num_offloaded += 1
        return slot

    def unpin_all(self) -> None:
        self.pinned.clear()

    def stats(self) -> dict:
        return {"host_kv_blocks": len(self.hash_to_slot), "host_kv_num_blocks": self.num_blocks,
                "host_kv_queries": self.num_queries, "host_kv_hits": self.num_hits,
                "host_kv_offloaded_blocks": self.num_offloaded, "host_kv_loaded_blocks": self.num_loaded}


class HostKVCache:
    """The host pool's tensor and the copies between it and the device cache.

    The pool is block-major (``[num_blocks, L, ...]``): a block's KV for every layer is one contiguous
    run of host memory, so a load copies each block straight from the pool to the device, with no gather
    on the host. On CUDA the pool is pinned and both directions run on a side stream: an offload gathers
    the evicted blocks on the device into block-major order (the compute stream waits only for that
    gather before the step may overwrite them), then copies them to pinned staging asynchronously; the
    host-side copy into the pool is finished lazily (at the next step, or before a load reads those
    slots). A load copies its blocks (runs of adjacent slots at a time) into a device staging buffer and
    scatters them into the cache on the device. On CPU both are plain copies.

    Args:
        kv_cache: the device cache ``[L, num_blocks, ...]`` (block axis 1).
        num_blocks: host slots.
    """

    def __init__(self, kv_cache: torch.Tensor, num_blocks: int):
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        on_cuda = self.device.type == "cuda"
        shape = (num_blocks, kv_cache.shape[0], *kv_cache.shape[2:])
        self.host = torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=on_cuda)
        self.stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._pending: list[tuple[object, torch.Tensor, list[int]]] = []  # (event, pinned staging, slots)
        self._loading: list[tuple[object, set[int]]] = []  # (event, slots) of loads the device may still read
        self.num_bytes_moved = 0

    @property
    def block_bytes(self) -> int:
        return self.host[0].numel() * self.host.element_size()

    def offload(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy device blocks ``block_ids`` to host ``slots`` (before the step that reuses the blocks)."""
        if not block_ids:
            return
        self.num_bytes_moved += len(block_ids) * self.block_bytes
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        if self.stream is None:
            self.host[list(slots)] = self.kv_cache[:, idx].transpose(0, 1)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the blocks' last writes come first
        with torch.cuda.stream(self.stream):
            gathered = torch.index_select(self.kv_cache, 1, idx.to(self.device, non_blocking=True))
            gathered = gathered.transpose(0, 1).contiguous()  # block-major, as the pool
            staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            staging.copy_(gathered, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        gathered.record_stream(self.stream)
        compute.wait_stream(self.stream)  # only the gather matters, but the copy is queued behind it anyway
        self._pending.append((event, staging, list(slots)))

    def finish_offloads(self, wait: bool = False) -> None:
        """Copy finished offloads into the pool (all of them, waiting, if ``wait``)."""
        keep = []
        for event, staging, slots in self._pending:
            if wait or event.query():  # type: ignore[attr-defined]
                event.synchronize()  # type: ignore[attr-defined]
                self._wait_for_loads(slots)
                self.host[slots] = staging
            else:
                keep.append((event, staging, slots))
        self._pending = keep

    def load(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy host ``slots`` into device blocks ``block_ids`` (before the step that reads them)."""
        if not slots:
            return
        if self._pending:
            wanted = set(slots)
            self.finish_offloads(wait=any(wanted.intersection(p[2]) for p in self._pending))
        self.num_bytes_moved += len(slots) * self.block_bytes
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        if self.stream is None:
            self.kv_cache[:, idx] = self.host[list(slots)].transpose(0, 1)
            return
        # each run of adjacent slots is one contiguous pinned range: copied as is, no host-side gather
        staging = torch.empty((len(slots), *self.host.shape[1:]), dtype=self.host.dtype, device=self.device)
        start = 0
        for end in range(1, len(slots) + 1):
            if end == len(slots) or slots[end] != slots[end - 1] + 1:
                staging[start:end].copy_(self.host[slots[start] : slots[end - 1] + 1], non_blocking=True)
                start = end
        self.kv_cache[:, idx] = staging.transpose(0, 1)
        event = torch.cuda.Event()
        event.record()
        self._loading = [(e, ss) for e, ss in self._loading if not e.query()]  # type: ignore[attr-defined]
        self._loading.append((event, set(slots)))

    def _wait_for_loads(self, slots: Sequence[int]) -> None:
        """Before the pool's ``slots`` are overwritten: wait for any load still reading them (the copies
        read the pinned pool directly, after the step that scheduled them released its pins)."""
        wanted = set(slots)
        for event, loading in self._loading:
            if wanted & loading:
                event.synchronize()  # type: ignore[attr-defined]
