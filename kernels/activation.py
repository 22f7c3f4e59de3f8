"""SiLU-and-mul, the gated activation of Llama-style MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = cat([gate, up], -1)``.

    Args:
        x: [T, 2 * intermediate].
    Returns:
        [T, intermediate], x's dtype.
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`silu_and_mul_ref`; the GPU path may swap in a kernel."""
    return silu_and_mul_ref(x)
