"""Rotary position embedding (RoPE), rotate-half (GPT-NeoX) convention as in Hugging Face Llama."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies of RoPE, [head_dim // 2] float32.

    ``scaling`` follows the Hugging Face ``rope_scaling`` dict; ``rope_type`` "default" (or None) and
    "llama3" (Llama 3.1 frequency smoothing) are supported.

    Raises:
        ValueError: for another rope_type.
    Source: Su et al., "RoFormer" (2021); Llama 3.1 scaling after Meta's reference implementation.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, llama3)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE to queries and keys (returns new tensors).

    Args:
        q: [T, num_heads, head_dim]; k: [T, num_kv_heads, head_dim].
        positions: [T] int64 token positions.
        inv_freq: [head_dim // 2] float32 from :func:`rope_inv_freq`.
    Returns:
        (q, k) rotated, in their input dtypes; angles computed in float32 as Hugging Face does.
    """
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rotary(q, k, positions, inv_freq):
    """Same contract as :func:`rotary_ref`; the GPU path may swap in a kernel."""
    return rotary_ref(q, k, positions, inv_freq)
