"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import pdl_launch, pdl_wait, tl, triton, use_pdl, use_triton

_MAX_FUSED_HIDDEN = 65536  # one row per program, held in registers


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


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # The sum is rounded to x's dtype before the statistics, as the reference's ``x + residual``.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    h = (h * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * h.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x, weight, eps, residual=None):
    """Triton kernel of :func:`rms_norm_ref` (one row per program, residual add fused)."""
    num_tokens, hidden = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty((num_tokens, hidden), dtype=torch.result_type(weight, x), device=x.device)
    new_residual = None
    if residual is not None:
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        new_residual = torch.empty_like(x)
    if num_tokens > 0:
        block = triton.next_power_of_2(hidden)
        num_warps = min(16, max(1, block // 512))
        _rms_norm_kernel[(num_tokens,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            new_residual if new_residual is not None else out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            new_residual.stride(0) if new_residual is not None else 0,
            hidden,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=num_warps,
            **pdl_launch(use_pdl(x)),
        )
    return out if residual is None else (out, new_residual)


def rms_norm(x, weight, eps, residual=None):
    """Same contract as :func:`rms_norm_ref`; the fused Triton kernel on CUDA tensors."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if (
        x.dim() == 2
        and x.shape[-1] <= _MAX_FUSED_HIDDEN
        and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))
        and use_triton(*tensors)
    ):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
