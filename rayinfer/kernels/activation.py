"""SiLU-and-mul, the gated activation of Llama-style MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayinfer.kernels._triton_utils import tl, triton, use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = cat([gate, up], -1)``.

    Args:
        x: [T, 2 * intermediate].
    Returns:
        [T, intermediate], x's dtype.
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # Round silu to x's dtype before the product, as torch does (two ops, two roundings).
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton kernel of :func:`silu_and_mul_ref`: one program per (row, 1024 columns)."""
    num_tokens, width = x.shape
    n = width // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((num_tokens, n), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or n == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    grid = (num_tokens, triton.cdiv(n, block))
    _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`silu_and_mul_ref`; the Triton kernel on CUDA tensors."""
    if x.dim() == 2 and x.shape[-1] % 2 == 0 and use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
