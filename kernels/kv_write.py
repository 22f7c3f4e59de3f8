"""Write new keys and values into the paged KV cache by slot mapping."""

from __future__ import annotations

import torch


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys and values into one layer's paged cache (in place).

    Args:
        k, v: [T, num_kv_heads, head_dim], the cache's dtype or castable to it.
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]; index 0 keys, 1 values.
        slot_mapping: [T] int64, ``block_id * block_size + offset``; a negative slot skips the token
            (padding rows of a CUDA-graph batch).
    """
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = k[keep].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = v[keep].to(kv_cache.dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as :func:`store_kv_ref`; the GPU path may swap in a Triton kernel."""
    store_kv_ref(k, v, kv_cache, slot_mapping)
