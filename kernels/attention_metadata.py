"""Per-step attention metadata: the one object the model runner hands every attention layer.

It is passed explicitly through ``forward`` (never kept in a global context) and holds only tensors
and host-side lists, so kernels and the plain-torch references read the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

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
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Build the metadata of one step from host lists.

        Args:
            query_lens: new tokens per request.
            seq_lens: context length per request after the step (>= its query length).
            block_tables: physical block ids per request, covering at least ``seq_lens[i]`` tokens.
            block_size: tokens per block.
        Raises:
            ValueError: if the lists disagree in length or a block table is too short.
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per request")
        slots: list[int] = []
        for q, s, table in zip(query_lens, seq_lens, block_tables):
            if q > s or len(table) * block_size < s:
                raise ValueError(f"request with query_len={q}, seq_len={s} has {len(table)} blocks")
            for pos in range(s - q, s):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        dev = torch.device(device)
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_size=block_size,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )
