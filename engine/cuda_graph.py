"""CUDA graphs for decode steps: the model's forward captured once per padded batch size.

A decode step of a small model is a few hundred tiny kernel launches whose CPU cost exceeds their GPU
time; replaying a captured graph launches them all at once. Inputs live in static buffers that each
step overwrites; padding rows get slot -1 (their KV is never written) and context length 1.
"""

from __future__ import annotations

import logging

import torch

from rayinfer.kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """Captured decode forwards for a set of batch sizes.

    Args:
        model: the model (``forward(input_ids, positions, kv_cache, meta)``).
        kv_cache: the paged cache tensor.
        block_size: tokens per block.
        max_model_len: longest context a replay may see (attention's split-KV size is baked in for it).
        max_num_seqs: largest batch captured.
    """

    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, max_model_len: int, max_num_seqs: int):
        dev = kv_cache.device
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(self.query_start_loc[: bs + 1], self.seq_lens[:bs], self.block_tables[:bs],
                                 self.slot_mapping[:bs], self.block_size, [1] * bs, [self.max_model_len] * bs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool."""
        pool = None
        for bs in reversed(self.sizes):
            args = (self.input_ids[:bs], self.positions[:bs], self.kv_cache, self._meta(bs))
            self.model(*args)  # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(*args)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def padded_size(self, num_reqs: int) -> int | None:
        """Smallest captured size holding ``num_reqs`` requests, or None."""
        for bs in self.sizes:
            if bs >= num_reqs:
                return bs
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Replay the graph for a decode batch of ``n`` requests (all inputs already on the device).

        Args:
            input_ids, positions, slot_mapping: [n]. seq_lens: [n] int32. block_tables: [n, w] int32.
        Returns:
            hidden states [n, hidden_size] (a view of the graph's output buffer, valid until the next replay).
        """
        n = input_ids.shape[0]
        bs = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:bs].fill_(1)
        self.block_tables[:n, : block_tables.shape[1]].copy_(block_tables)
        self.block_tables[n:bs].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
