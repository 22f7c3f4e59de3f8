"""Disk backend of the KV store: one raw file per block under a directory, a msgpack index that survives
a restart of the store actor, TTL and byte/block limits with LRU eviction (``KVStoreIndex``).

Layout of ``directory``::

    index.msgpack        {"version", "namespace", "layout", "block_shape", "wire_dtype",
                          "blocks": [[hash, parent, nbytes, crc32, last_access_unix_s], ...] (LRU first)}
    blocks/<hash:016x>.kv  the block's bytes: a ``[L, 1, ...]`` wire array (``kv_transport.to_wire``) of the
                          index's ``block_shape`` and ``wire_dtype``

A block whose file is missing, of the wrong size or with another CRC-32 is a miss: it and its descendants
leave the index (their files are deleted), so a damaged store never serves wrong KV. The index is
rewritten (to a temporary file, then renamed) after every change, so a killed store loses at most the
last put. TTL and access times use the wall clock (they must survive a restart). After DeepSeek 3FS KVCache
(block KV kept on a file store for days; default TTL 3 days). Plain Python and numpy: no Ray here.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from pathlib import Path
from typing import Sequence

import msgpack
import numpy as np

from rayinfer.engine.block_pool import NONE_HASH
from rayinfer.policy.kv_store_index import KVStoreIndex, StoredBlock

logger = logging.getLogger(__name__)

INDEX_VERSION = 1
DEFAULT_TTL_S = 3 * 24 * 3600.0  # DeepSeek's block-KV TTL


class DiskKVStore:
    """Hash-chain prefix store of KV blocks in files.

    Args:
        directory: where the files live (created if missing).
        namespace: what the block hashes are hashes of (the model); an index written under another
            namespace is discarded with its files, since equal token hashes of two models are not equal KV.
        max_blocks, max_bytes: limits (None: none); LRU blocks are evicted (files deleted) to make room.
        ttl_s: blocks not read or written for this long expire (None: never).
        clock: wall-clock seconds (tests pass a fake).
    Raises:
        ValueError: for non-positive limits (from ``KVStoreIndex``).
    """

    def __init__(self, directory: str | os.PathLike, namespace: str = "", max_blocks: int | None = None,
                 max_bytes: int | None = None, ttl_s: float | None = DEFAULT_TTL_S, clock=time.time):
        self.dir = Path(directory)
        self.blocks_dir = self.dir / "blocks"
        self.blocks_dir.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.index = KVStoreIndex(max_blocks=max_blocks, max_bytes=max_bytes, ttl_s=ttl_s, clock=clock)
        self.layout: str | None = None
        self.block_shape: tuple[int, ...] | None = None
        self.wire_dtype: str | None = None
        self.num_corrupt = 0  # blocks dropped because their file was missing or damaged
        self.num_restored = 0  # blocks found in the index at start
        self._load_index()

    # -- paths and the index ---------------------------------------------------------------------
    def _path(self, block_hash: int) -> Path:
        return self.blocks_dir / f"{block_hash:016x}.kv"

    def _load_index(self) -> None:
        path = self.dir / "index.msgpack"
        if not path.exists():
            return
        try:
            data = msgpack.unpackb(path.read_bytes(), strict_map_key=False)
            if data.get("version") != INDEX_VERSION or data.get("namespace") != self.namespace:
                logger.warning("KV store index in %s is for %r (version %s); starting empty", self.dir,
                               data.get("namespace"), data.get("version"))
                self._wipe()
                return
            self.layout, self.wire_dtype = data["layout"], data["wire_dtype"]
            self.block_shape = tuple(data["block_shape"]) if data["block_shape"] is not None else None
            entries = data["blocks"]
        except Exception as e:  # noqa: BLE001 - an unreadable index is an empty store, never a crash
            logger.warning("KV store index in %s unreadable (%s); starting empty", self.dir, e)
            self._wipe()
            return
        blocks = self.index.blocks
        for h, parent, nbytes, crc, last in entries:
            blocks[h] = StoredBlock(crc, nbytes, parent, last)
            self.index.num_bytes += nbytes
        for h, block in list(blocks.items()):  # link children; a block whose parent is gone is unreachable
            if h not in blocks:
                continue
            if block.parent != NONE_HASH:
                if block.parent in blocks:
                    blocks[block.parent].children.add(h)
        orphans = [h for h, b in blocks.items() if b.parent != NONE_HASH and b.parent not in blocks]
        for h in orphans:
            self._delete_files(self.index.remove(h))
        self._delete_files(self.index.expire())
        self.num_restored = len(blocks)
        self._save_index()

    def _save_index(self) -> None:
        data = {"version": INDEX_VERSION, "namespace": self.namespace, "layout": self.layout,
                "block_shape": list(self.block_shape) if self.block_shape else None, "wire_dtype": self.wire_dtype,
                "blocks": [[h, b.parent, b.nbytes, b.value, b.last_access] for h, b in self.index.blocks.items()]}
        tmp = self.dir / "index.msgpack.tmp"
        tmp.write_bytes(msgpack.packb(data) or b"")
        os.replace(tmp, self.dir / "index.msgpack")

    def _wipe(self) -> None:
        for f in self.blocks_dir.glob("*.kv"):
            f.unlink(missing_ok=True)
        (self.dir / "index.msgpack").unlink(missing_ok=True)

    def _delete_files(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._path(h).unlink(missing_ok=True)

    # -- the store's operations ------------------------------------------------------------------
    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.index

    def match(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks of a chain in the index (counts toward the hit rate; files are checked
        only by :meth:`get`)."""
        self._expire()
        return self.index.match(block_hashes)

    def get(self, block_hashes: Sequence[int], start: int = 0) -> list[np.ndarray]:
        """The leading stored blocks of a chain, read from their files: one ``[L, 1, ...]`` wire array each,
        from block ``start`` on (the caller holds the ones before it; they must be stored, else nothing is
        read).

        A missing or damaged file ends the run there and drops that block and its descendants.
        Side effect: the blocks before ``start`` and those read become the most recent, the chain's head newest.
        """
        self._expire()
        out = []
        if any(h not in self.index.blocks for h in block_hashes[:start]):
            return out
        for h in block_hashes[start:]:
            block = self.index.blocks.get(h)
            if block is None:
                break
            arr = self._read(h, block)
            if arr is None:
                self.num_corrupt += 1
                self._delete_files(self.index.remove(h))
                break
            out.append(arr)
        if out:
            self.index.get(block_hashes[: start + len(out)])
        self._save_index()
        return out

    def _read(self, block_hash: int, block: StoredBlock) -> np.ndarray | None:
        try:
            raw = self._path(block_hash).read_bytes()
        except OSError:
            logger.warning("KV store block %016x: file missing; a miss", block_hash)
            return None
        if len(raw) != block.nbytes or zlib.crc32(raw) != block.value or self.block_shape is None:
            logger.warning("KV store block %016x: file damaged (size or CRC-32); a miss", block_hash)
            return None
        return np.frombuffer(raw, dtype=np.dtype(self.wire_dtype)).reshape(self.block_shape)

    def put(self, block_hashes: Sequence[int], start: int, payload: np.ndarray, layout: str) -> int:
        """Store blocks ``start .. start + payload.shape[1]`` of a chain (one file each).

        Args:
            block_hashes: the chain from block 0, at least ``start + payload.shape[1]`` hashes.
            start: chain index of the payload's first block.
            payload: ``[L, n, ...]`` wire array (``kv_transport.to_wire``) of layout ``layout``.
            layout: the payload's layout tag; a store refuses other layouts than its first.
        Returns:
            blocks newly stored.
        """
        if self.layout is None:
            self.layout, self.wire_dtype = layout, payload.dtype.str
            self.block_shape = (payload.shape[0], 1, *payload.shape[2:])
        if layout != self.layout or payload.dtype.str != self.wire_dtype \
                or (payload.shape[0], 1, *payload.shape[2:]) != self.block_shape:
            logger.warning("KV store holds layout %s; refusing a put of %s", self.layout, layout)
            return 0
        self._expire()
        n = payload.shape[1]
        datas = [np.ascontiguousarray(payload[:, i : i + 1]).tobytes() for i in range(n)]
        crcs = [zlib.crc32(d) for d in datas]
        result = self.index.put(block_hashes, crcs, [len(d) for d in datas], start=start)
        self._delete_files(result.evicted)
        added = set(result.added)
        for i, d in enumerate(datas):
            h = block_hashes[start + i]
            if h in added:
                tmp = self._path(h).with_suffix(".tmp")
                tmp.write_bytes(d)
                os.replace(tmp, self._path(h))
        self._save_index()
        return len(result.added)

    def _expire(self) -> None:
        """Drop expired blocks and their files (the index would drop them silently otherwise)."""
        expired = self.index.expire()
        if expired:
            self._delete_files(expired)
            self._save_index()

    def clear(self) -> None:
        """Drop every stored block and its file."""
        self.index.clear()
        self._wipe()

    def stats(self) -> dict:
        return {**self.index.stats(), "kv_store_corrupt": self.num_corrupt, "kv_store_restored": self.num_restored}
