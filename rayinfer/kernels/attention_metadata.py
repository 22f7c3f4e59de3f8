"""Per-step attention metadata: the one object the model runner hands every attention layer.

It is passed explicitly through ``forward`` (never kept in a global context) and holds only tensors
and host-side lists, so kernels and the plain-torch references read the same fields.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where each request's new tokens sit in the batch and in the paged KV cache.

    A step computes ``T = query_start_loc[-1]`` new tokens for ``B`` requests. Request ``i`` owns batch
    rows ``query_start_loc[i]:query_start_loc[i+1]``; its context after this step is ``seq_lens[i]``
    tokens, the first ``seq_lens[i] - query_len_i`` of which are already in the cache (prefix hits,
    earlier chunks, earlier decode steps). The new tokens are causal among themselves.

    Attributes:
        query_start_loc: [B + 1] int32, cumulative new-token counts, starting at 0.
        seq_lens: [B] int32, context length of each request after this step (tokens).
        block_tables: [B, max_num_blocks] int32, physical block ids of each request; padding is 0
            and is never read past ``seq_lens``.
        slot_mapping: [T] int64, cache slot (``block_id * block_size + offset``) of each new token.
        block_size: tokens per KV block.
        query_lens_cpu: host copy of the B query lengths (no device sync to read them).
        seq_lens_cpu: host copy of ``seq_lens``.
        local: the sliding-window layers' own metadata when they keep a separate KV cache group (same
            query and sequence lengths; their block tables and slot mapping); None: one group.
        kv_start: [B] int32, first key position each request may read (keys before it were never
            computed: a bounded replay's start, see ``engine.kv_cache_manager``); None: 0 for all.
            Read by the sliding-window attention only.
        kv_start_cpu: host copy of ``kv_start``.
        derived: index tensors that kernels derive from these fields, computed by the step's first layer
            and reused by the others (e.g. ``mla_attention.gather_mla_context``'s cache rows); not an
            argument (a copy made with ``dataclasses.replace`` starts empty).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    local: "AttentionMetadata | None" = None
    kv_start: torch.Tensor | None = None
    kv_start_cpu: list[int] | None = None
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        """True when every request computes exactly one new token (a pure decode batch)."""
        return all(q == 1 for q in self.query_lens_cpu)

    @staticmethod
    def build(
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Build the metadata of one step from host lists (see :func:`host_arrays`).

        Args:
            query_lens: new tokens per request.
            seq_lens: context length per request after the step (>= its query length).
            block_tables: physical block ids per request (lists or tuples), covering at least
                ``seq_lens[i]`` tokens.
            block_size: tokens per block.
        Raises:
            ValueError: if the lists disagree in length or a block table is too short.
        """
        arrays = host_arrays(query_lens, seq_lens, block_tables, block_size)
        dev = torch.device(device)
        return AttentionMetadata(*(torch.from_numpy(a).to(dev) for a in arrays[:4]), block_size, list(query_lens),
                                 list(seq_lens))


def host_arrays(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    padded_tables: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The tensors of :meth:`AttentionMetadata.build` as numpy arrays (vectorized; new ones, except
    ``padded_tables`` itself when given), and the positions.

    Args:
        query_lens, seq_lens, block_tables, block_size: as for :meth:`AttentionMetadata.build`.
        padded_tables: ``block_tables`` already zero-padded, [B, longest table or 1] int32 (see
            :class:`PaddedBlockTables`); None pads them here.
    Returns:
        query_start_loc [B + 1] int32, seq_lens [B] int32, block_tables [B, longest table or 1] int32,
        slot_mapping [T] int64, and positions [T] int64 (of each new token in its request).
    Raises:
        ValueError: if the lists disagree in length or a block table is too short.
    """
    num_reqs = len(seq_lens)
    if not (len(query_lens) == num_reqs == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per request")
    q = np.fromiter(query_lens, np.int64, num_reqs)
    s = np.fromiter(seq_lens, np.int64, num_reqs)
    num_blocks = np.fromiter(map(len, block_tables), np.int64, num_reqs)
    bad = ((q > s) | (num_blocks * block_size < s)).nonzero()[0]
    if bad.size:
        i = bad[0]
        raise ValueError(f"request with query_len={q[i]}, seq_len={s[i]} has {num_blocks[i]} blocks")
    tables = pad_block_tables(block_tables, num_blocks) if padded_tables is None else padded_tables
    starts = np.zeros(num_reqs + 1, np.int64)
    np.cumsum(q, out=starts[1:])
    offsets = np.repeat(s - q - starts[:-1], q)  # per token: its position minus its row (constant per request)
    positions = offsets + np.arange(starts[-1])
    req_of_token = np.repeat(np.arange(num_reqs), q)
    slots = tables[req_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return starts.astype(np.int32), s.astype(np.int32), tables, slots, positions


def pad_block_tables(block_tables: Sequence[Sequence[int]], num_blocks: np.ndarray) -> np.ndarray:
    """[B, max(num_blocks) or 1] int32 block tables, each row zero-padded; ``num_blocks``: [B] int64 lengths."""
    width = int(num_blocks.max(initial=0)) or 1
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), np.int32, int(num_blocks.sum()))
    if flat.size == num_blocks.size * width:  # every table has the same length
        return flat.reshape(num_blocks.size, width)
    out = np.zeros((num_blocks.size, width), np.int32)
    out[np.arange(width) < num_blocks[:, None]] = flat
    return out


class PaddedBlockTables:
    """Pads the block tables of consecutive steps, copying the rows of tables unchanged since the last
    call instead of converting them again (a decode step changes few: one block per ``block_size``
    tokens). Rows are looked up by key (the request id) and reused only if the table is equal."""

    def __init__(self):
        self._rows: dict = {}  # key -> row of the last result
        self._tables: list = []  # the last call's tables
        self._last = np.zeros((0, 1), np.int32)

    def pad(self, keys: Sequence, block_tables: Sequence[Sequence[int]]) -> np.ndarray:
        """[B, longest table or 1] int32, each row a table zero-padded (a fresh array each call)."""
        num_blocks = np.fromiter(map(len, block_tables), np.int64, len(block_tables))
        width = int(num_blocks.max(initial=0)) or 1
        rows, last_tables = self._rows, self._tables
        src, stale = [], []
        for i, (key, table) in enumerate(zip(keys, block_tables)):
            j = rows.get(key)
            if j is None or last_tables[j] != table:
                stale.append(i)
                j = 0
            src.append(j)
        if len(stale) == len(src):
            out = pad_block_tables(block_tables, num_blocks)
        else:
            last = self._last
            if last.shape[1] < width:
                last = np.pad(last, ((0, 0), (0, width - last.shape[1])))
            out = last[src, :width]
            for i in stale:
                out[i] = 0
                out[i, : num_blocks[i]] = block_tables[i]
        self._rows = {key: i for i, key in enumerate(keys)}
        self._tables, self._last = list(block_tables), out
        return out
