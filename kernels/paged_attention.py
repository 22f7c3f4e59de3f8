"""Attention of new tokens over a paged KV cache (prefill, chunked prefill, extend and decode)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayinfer.kernels.attention_metadata import AttentionMetadata


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole cached context (plain torch).

    The new tokens' keys and values must already be in ``kv_cache`` (see ``kernels.kv_write``). Query
    row ``j`` of request ``i`` sits at position ``seq_lens[i] - query_len_i + j`` and attends to
    positions ``0..`` that position inclusive. Grouped-query attention: query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.

    Args:
        q: [T, num_heads, head_dim].
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim] (one layer).
        meta: the step's :class:`AttentionMetadata`.
        scale: softmax scale, usually ``head_dim ** -0.5``.
    Returns:
        [T, num_heads, head_dim], q's dtype; accumulation in float32.
    """
    num_heads = q.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    block_size = kv_cache.shape[2]
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_tables[i, :num_blocks].long()
        kv = kv_cache[blocks]  # [n, 2, bs, Hkv, D]
        k = kv[:, 0].reshape(-1, num_kv_heads, kv.shape[-1])[:seq_len]
        v = kv[:, 1].reshape(-1, num_kv_heads, kv.shape[-1])[:seq_len]
        qi = q[start : start + q_len].float().transpose(0, 1)  # [H, q, D]
        k = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, s, D]
        v = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = q_pos[:, None] >= torch.arange(seq_len, device=q.device)[None, :]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
        out[start : start + q_len] = o.transpose(0, 1).to(q.dtype)
        start += q_len
    return out


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Same contract as :func:`paged_attention_ref`; dispatches to a GPU kernel when one applies."""
    return paged_attention_ref(q, kv_cache, meta, scale)
