"""Single-row linear layers (GEMV) for batch-1 decode, with SiLU-and-mul fused into the down projection.

At batch 1 a linear layer only streams its weight, and cuBLAS splits some of Llama's shapes over K and
adds a reduction kernel (o_proj and down_proj of Llama-3-8B). These kernels keep one program per
``BLOCK_N`` output features over the whole K (no second kernel), multiply-add on the CUDA cores (a
one-row tile on the tensor cores would be 15/16 padding) and, for the down projection, compute
``silu(gate) * up`` in the prologue from the gate/up projection's output, saving the activation kernel
(as TensorRT-LLM's and vLLM's decode paths fuse it).

Measured on an H200 at Llama-3-8B shapes (``benchmarks/kernels.py --only-sweeps gemv``, graph time per
call): o_proj 10.4-10.8 us against cuBLAS's 12.6-12.8, down_proj with SiLU 30.8 us against 32.3-32.9
for the SiLU kernel plus cuBLAS; a batch-1 Llama-3-8B decode step went from 4.76 to 4.52 ms together
with the split-decode attention tiles. The QKV and gate/up projections stay on cuBLAS, which streams those at 86-95% of
the copy bandwidth (a fused-RMSNorm variant of this kernel ran 7-10% slower there), and so does every
batch above 1 (a tensor-core variant for 2-16 rows lost to cuBLAS at every shape).

Each function has a plain-torch reference (``*_ref``) and a dispatcher that runs the Triton kernel
when :func:`gemv_applies` holds and cuBLAS (plus the activation kernel) otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayinfer.kernels._triton_utils import tl, triton, use_triton
from rayinfer.kernels.activation import silu_and_mul, silu_and_mul_ref


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``. x: [M, K]; weight: [N, K]; bias: [N] or None. Returns [M, N], x's dtype."""
    return F.linear(x, weight, bias)


def silu_and_mul_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(silu(gate) * up)`` for ``x = cat([gate, up], -1)``: x [M, 2K], weight [N, K] -> [M, N]."""
    return F.linear(silu_and_mul_ref(x), weight, bias)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, N, K, stride_wn,
    SILU_AND_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        k_ok = ks < K
        if SILU_AND_MUL:  # silu(gate) * up, rounded twice as the reference's two ops
            g = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
            u = tl.load(x_ptr + K + ks, mask=k_ok, other=0.0)
            gf = g.to(tl.float32)
            act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
            a = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
        else:
            a = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
        if EVEN_N and EVEN_K:
            w = tl.load(w_rows + ks[None, :])
        else:
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], 1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


# H200 sweep winners: 8 rows per program, 8 warps, 3 stages; K tiles of 1024 columns for o_proj
# (K = 4096: 10.4-10.8 us, 11.2 with 2048) and of 2048 for down_proj (K = 14336: 30.8 us, 33.0 with 1024).
DEFAULT_CONFIG = dict(block_n=8, num_warps=8, num_stages=3)


def _block_k(k: int) -> int:
    return 2048 if k >= 8192 else 1024


def _launch(x, weight, bias, silu_and_mul_prologue, config=None):
    n, k = weight.shape
    assert x.shape[0] == 1, "the GEMV kernel takes one row"
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    block_k = min(cfg.get("block_k") or _block_k(k), max(16, triton.next_power_of_2(k)))
    _gemv_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        SILU_AND_MUL=silu_and_mul_prologue, HAS_BIAS=bias is not None,
        BLOCK_N=cfg["block_n"], BLOCK_K=block_k, EVEN_N=n % cfg["block_n"] == 0, EVEN_K=k % block_k == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y


def linear_triton(x, weight, bias=None, config=None):
    """Triton kernel of :func:`linear_ref` for one row (x: [1, K]); ``config`` overrides the tiles."""
    return _launch(x, weight, bias, False, config)


def silu_and_mul_linear_triton(x, weight, bias=None, config=None):
    """Triton kernel of :func:`silu_and_mul_linear_ref` for one row (x: [1, 2K])."""
    return _launch(x, weight, bias, True, config)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the dispatchers take the Triton GEMV: one row of bf16/fp16 on CUDA, a row-major weight of
    the same dtype. float32 stays on cuBLAS (the GPU-vs-CPU equality tests run in float32)."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.stride(-1) == 1
        and x.is_cuda
        and use_triton(x, weight)
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`linear_ref`; the Triton GEMV when :func:`gemv_applies`, else cuBLAS."""
    if gemv_applies(x, weight):
        return linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`silu_and_mul_linear_ref`; one fused kernel when :func:`gemv_applies`,
    else the activation kernel and cuBLAS."""
    if gemv_applies(x, weight):
        return silu_and_mul_linear_triton(x, weight, bias)
    return F.linear(silu_and_mul(x), weight, bias)
