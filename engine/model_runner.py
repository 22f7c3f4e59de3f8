"""Executes a SchedulerOutput: builds the batch, runs the model over the paged cache, samples."""

from __future__ import annotations

import torch

from rayinfer.engine.sampler import Sampler
from rayinfer.engine.types import KVHandle, Request, SchedulerOutput, StepOutput
from rayinfer.kernels.attention_metadata import AttentionMetadata

KV_LAYOUT_VERSION = "v1"


def kv_layout_tag(kv_cache: torch.Tensor) -> str:
    """Payload layout tag of a cache: version, axis names of one request's export, dtype."""
    axes = "L,N,2,bs,H,D" if kv_cache.dim() == 6 else "L,N,bs,C"
    return f"{KV_LAYOUT_VERSION}:{axes}:{str(kv_cache.dtype).removeprefix('torch.')}:bs={kv_cache.shape[2 if kv_cache.dim() == 6 else 2]}"


class ModelRunner:
    """Runs one step of the model for the scheduled requests.

    Args:
        model: a rayinfer model (``forward(input_ids, positions, kv_cache, meta)``, ``compute_logits``).
        kv_cache: the whole paged cache, shape ``model.kv_cache_shape(num_blocks, block_size)``.
        block_size: tokens per block.
        sampler: the :class:`Sampler`.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int, sampler: Sampler):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = kv_cache.device

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, requests: dict[str, Request]) -> StepOutput:
        """Run the step; returns a sampled token for each scheduled request with ``needs_sample``."""
        for _, block_ids, handle in sched.kv_imports:
            self.import_kv(block_ids, handle)
        input_ids, positions, sample_rows, sample_reqs = [], [], [], []
        for s in sched.scheduled:
            input_ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.start_pos + s.num_new_tokens))
            if s.needs_sample:
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(requests[s.request_id])
        meta = AttentionMetadata.build(
            [s.num_new_tokens for s in sched.scheduled],
            [s.start_pos + s.num_new_tokens for s in sched.scheduled],
            [list(s.block_ids) for s in sched.scheduled],
            self.block_size,
            self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.kv_cache, meta)
        if not sample_rows:
            return StepOutput({})
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        sampled = self.sampler(logits, sample_reqs)
        return StepOutput({r.request_id: t for r, t in zip(sample_reqs, sampled)})

    def export_kv(self, req: Request, num_tokens: int) -> KVHandle:
        """Copy the KV of a request's first ``num_tokens`` tokens out of the cache (to CPU).

        Returns:
            a KVHandle whose payload is [L, n_blocks, ...] (the cache's per-block layout), on CPU.
        """
        num_blocks = -(-num_tokens // self.block_size)
        blocks = torch.tensor(req.block_ids[:num_blocks], dtype=torch.long, device=self.device)
        payload = self.kv_cache[:, blocks].to("cpu", copy=True)
        full = num_tokens // self.block_size
        return KVHandle(req.request_id, list(req.block_hashes[:full]), num_tokens, kv_layout_tag(self.kv_cache), payload)

    def import_kv(self, block_ids, handle: KVHandle) -> None:
        """Write a handle's payload into the given blocks of the cache.

        Raises:
            ValueError: if the payload's layout tag or block count does not match this cache.
        """
        if handle.layout != kv_layout_tag(self.kv_cache):
            raise ValueError(f"KV layout {handle.layout!r} does not match this engine's {kv_layout_tag(self.kv_cache)!r}")
        payload = handle.payload
        if payload.shape[1] != len(block_ids):
            raise ValueError(f"KV payload has {payload.shape[1]} blocks, expected {len(block_ids)}")
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        self.kv_cache[:, idx] = payload.to(self.device, self.kv_cache.dtype)
