"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm as Hugging Face Llama computes it (float32 statistics, weight applied in x's dtype).

    Args:
        x: [T, hidden].
        weight: [hidden].
        eps: variance epsilon.
        residual: optional [T, hidden]; when given, ``x + residual`` is normalized and also returned
            as the new residual.
    Returns:
        normalized [T, hidden] in x's dtype, or ``(normalized, x + residual)`` when ``residual`` is given.
    Source: Zhang and Sennrich, "Root Mean Square Layer Normalization" (2019).
    """
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rms_norm(x, weight, eps, residual=None):
    """Same contract as :func:`rms_norm_ref`; the GPU path may swap in a fused kernel."""
    return rms_norm_ref(x, weight, eps, residual)
