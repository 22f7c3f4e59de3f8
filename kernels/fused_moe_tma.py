"""Large-batch grouped GEMMs of the fused MoE fed by the Tensor Memory Accelerator (Hopper and later).

At prefill sizes (thousands of tokens) the grouped GEMMs of :mod:`rayinfer.kernels.fused_moe` are bound
inside their tiles: each program gathers its activation rows through the pair index with per-element
address arithmetic. Here the activations are first gathered once into expert-sorted order (the aligned
layout of ``moe_align``: each expert's pairs contiguous, padded to whole tiles, padding rows zero), so
both GEMM operands are plain 2-D tiles that TMA descriptors load into shared memory:

1. gather: ``a_sorted[i] = hidden[sorted_pairs[i] // k]`` (zero for padding rows);
2. gate/up GEMM with SiLU-and-mul in the epilogue, written in sorted order: ``act_sorted`` [P, I];
3. down GEMM over ``act_sorted`` (TMA again), each row scaled by its routing weight and stored at its
   pair row of the float32 output, summed over the k slots by the caller's slot-order sum.

Same results as the pointer-gather kernels up to float summation order inside a tile (the same roundings
of the gate/up outputs and of SiLU). This is the contiguous grouped layout of DeepSeek's DeepGEMM
("m-grouped contiguous"); the descriptors are Triton's (``triton.tools.tensor_descriptor``).
"""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import tl, triton

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # no Triton, or one without host-side tensor descriptors
    TensorDescriptor = None


def tma_supported(x: torch.Tensor) -> bool:
    """Whether the TMA path can run on ``x``'s device: CUDA compute capability >= 9.0 and a Triton with
    host tensor descriptors."""
    return TensorDescriptor is not None and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9


@triton.jit
def _gather_sorted_kernel(hidden_ptr, sorted_pairs_ptr, block_experts_ptr, out_ptr, num_pairs, hidden_size,
                          TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    ok = pairs < num_pairs
    src = (pairs // TOP_K).to(tl.int64)
    for h0 in range(0, hidden_size, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        col_ok = cols < hidden_size
        x = tl.load(hidden_ptr + src[:, None] * hidden_size + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                    other=0.0)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * hidden_size + cols[None, :], x, mask=col_ok[None, :])


@triton.jit
def _gate_up_tma_kernel(a_desc, w_desc, c_ptr, block_experts_ptr, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    off_m = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    w_row = expert * 2 * N + n0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([off_m, k0])
        b = w_desc.load([w_row, k0])
        b_up = w_desc.load([w_row + N, k0])
        acc = tl.dot(a, b.T, acc)
        acc_up = tl.dot(a, b_up.T, acc_up)
    dt = c_ptr.dtype.element_ty
    g = acc.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    out = (act * acc_up.to(dt).to(tl.float32)).to(dt)
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], out, mask=cols[None, :] < N)


@triton.jit
def _down_tma_kernel(a_desc, w_desc, c_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr, N, K, num_pairs,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    off_m = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    w_row = expert * N + n0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([off_m, k0])
        b = w_desc.load([w_row, k0])
        acc = tl.dot(a, b.T, acc)
    pairs = tl.load(sorted_pairs_ptr + off_m + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    w = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * w[:, None]
    cols = n0 + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * N + cols[None, :], acc, mask=row_ok[:, None] & (cols[None, :] < N))


def moe_gemms_tma(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, sorted_pairs: torch.Tensor,
                  block_experts: torch.Tensor, weights: torch.Tensor, top_k: int, out: torch.Tensor,
                  block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
                  num_tiles: int) -> None:
    """Both grouped GEMMs over the aligned layout, TMA-fed (module docstring).

    Args:
        hidden: [T, H] bf16/fp16, contiguous.
        w13: [E, 2I, H]; w2: [E, H, I] (same dtype, contiguous).
        sorted_pairs: [P] int32 expert-sorted pair ids (``moe_align``, tiles of ``block_m``), sentinel T*k.
        block_experts: [P // block_m] int32, -1 past the end.
        weights: [T * k] routing weights.
        out: [T * k, H] float32, written at the pairs' rows (rows of pairs no tile holds are untouched).
        num_tiles: tile rows to launch (an upper bound on those holding pairs).
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    size = sorted_pairs.numel()
    num_pairs = num_tokens * top_k
    a_sorted = torch.empty((size, hidden_size), dtype=hidden.dtype, device=hidden.device)
    _gather_sorted_kernel[(num_tiles,)](hidden, sorted_pairs, block_experts, a_sorted, num_pairs, hidden_size,
                                        TOP_K=top_k, BLOCK_M=block_m, BLOCK_H=256, num_warps=4)
    act = torch.empty((size, inter), dtype=hidden.dtype, device=hidden.device)
    a_desc = TensorDescriptor.from_tensor(a_sorted, [block_m, block_k])
    w13_desc = TensorDescriptor.from_tensor(w13.view(num_experts * two_inter, hidden_size), [block_n, block_k])
    _gate_up_tma_kernel[(num_tiles, triton.cdiv(inter, block_n))](
        a_desc, w13_desc, act, block_experts, inter, hidden_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    act_desc = TensorDescriptor.from_tensor(act, [block_m, block_k])
    w2_desc = TensorDescriptor.from_tensor(w2.view(num_experts * hidden_size, inter), [block_n, block_k])
    _down_tma_kernel[(num_tiles, triton.cdiv(hidden_size, block_n))](
        act_desc, w2_desc, out, sorted_pairs, block_experts, weights, hidden_size, inter, num_pairs,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
