"""Routed-expert MLPs of a mixture-of-experts layer: ``sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))``.

Glossary: T tokens, H hidden size, I expert intermediate size, E experts held by this call, k experts
per token (top-k). ``w13`` stacks each expert's gate and up projections (gate rows first, as Hugging
Face's ``gate_up_proj``), ``w2`` its down projection. A ``topk_ids`` entry outside ``[0, E)`` (for
example -1) is skipped: expert parallelism marks the experts another rank computes that way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayinfer.kernels._triton_utils import is_interpreting, tl, triton, use_triton
from rayinfer.kernels.activation import silu_and_mul, silu_and_mul_ref
from rayinfer.kernels.batch_invariant import is_batch_invariant


def _check_shapes(hidden, w13, w2, topk_ids, topk_weights) -> None:
    num_experts, two_inter, hidden_size = w13.shape
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match w13 {tuple(w13.shape)}")
    if two_inter % 2 or tuple(w2.shape) != (num_experts, hidden_size, two_inter // 2):
        raise ValueError(f"w2 {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} must be [T, k]")


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Routed-expert output of each token, one expert at a time (plain torch).

    Experts are visited in ascending id and their weighted outputs added with ``index_add_``, the order
    of Hugging Face's ``*Experts.forward`` (DeepseekV3, Qwen3-MoE), so float32 results match it closely.

    Args:
        hidden: [T, H].
        w13: [E, 2 * I, H], hidden's dtype.
        w2: [E, H, I].
        topk_ids: [T, k] int, expert of each (token, slot); ids outside ``[0, E)`` are skipped.
        topk_weights: [T, k] float (float32 or hidden's dtype), routing weight of each (token, slot).
    Returns:
        [T, H], hidden's dtype; a token whose ids are all skipped gets zeros.
    Raises:
        ValueError: on inconsistent shapes.
    """
    _check_shapes(hidden, w13, w2, topk_ids, topk_weights)
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    out = torch.zeros_like(hidden)
    flat_ids = topk_ids.reshape(-1)
    flat_weights = topk_weights.reshape(-1)
    present = torch.unique(flat_ids[(flat_ids >= 0) & (flat_ids < num_experts)]).tolist()
    for e in present:
        pairs = (flat_ids == e).nonzero().squeeze(1)  # flat (token, slot) indices
        tokens = pairs // top_k
        h = silu_and_mul_ref(F.linear(hidden[tokens], w13[e]))
        y = F.linear(h, w2[e]) * flat_weights[pairs, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def sum_slots(x: torch.Tensor) -> torch.Tensor:
    """``x[:, 0] + x[:, 1] + ... + x[:, k-1]``, added in slot order by elementwise adds.

    x: [T, k, ...]. Returns [T, ...] in x's dtype. The batch-invariant sum over a token's k routed
    outputs (or routing weights): ``x.sum(1)`` leaves the order to the reduction kernel, which on a GPU
    may follow the tensor's shape.
    """
    total = x[:, 0].clone()
    for slot in range(1, x.shape[1]):
        total += x[:, slot]
    return total


def fused_moe_slots_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Each (token, slot)'s weighted expert output, not yet summed over the k slots (plain torch).

    Args: as :func:`fused_moe_ref`.
    Returns:
        [T, k, H] float32; zeros where the slot's id is skipped (outside ``[0, E)``).
    """
    _check_shapes(hidden, w13, w2, topk_ids, topk_weights)
    num_experts = w13.shape[0]
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros((num_tokens * top_k, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    flat_weights = topk_weights.reshape(-1)
    for e in torch.unique(flat_ids[(flat_ids >= 0) & (flat_ids < num_experts)]).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        h = silu_and_mul_ref(F.linear(hidden[pairs // top_k], w13[e]))
        out[pairs] = F.linear(h, w2[e]).float() * flat_weights[pairs, None].float()
    return out.view(num_tokens, top_k, -1)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert and pad each expert's run to a multiple of ``block_m``.

    Device-only torch ops with shapes fixed by ``T * k``, ``E`` and ``block_m``: no host sync, so a
    CUDA graph can capture it (after vLLM's ``moe_align_block_size``).

    Args:
        topk_ids: [T, k] int expert ids; ids outside ``[0, num_experts)`` are dropped.
        num_experts: E.
        block_m: rows per GEMM tile.
    Returns:
        sorted_pairs: [P] int64 flat pair index ``token * k + slot``, grouped by expert, each group
            padded with the sentinel ``T * k``; ``P = ceil((T*k + E*(block_m-1)) / block_m) * block_m``.
        block_experts: [P // block_m] int64, the expert of each tile, -1 for tiles past the end.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))  # E collects the dropped pairs
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_key]
    size = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    dest = torch.where(
        sorted_key < num_experts,
        pad_start[sorted_key.clamp(max=num_experts - 1)] + rank_in_expert,
        torch.full_like(sorted_key, size),  # one spare slot past the end takes every dropped pair
    )
    sorted_pairs = torch.full((size + 1,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, dest, order)
    tile_start = torch.arange(0, size, block_m, device=device)
    block_experts = torch.searchsorted(pad_end, tile_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, torch.full_like(block_experts, -1))
    return sorted_pairs[:size], block_experts


# ----------------------------------------------------------------------------------------------------
# Triton grouped GEMM. Program (m, n) multiplies tile m of the expert-sorted pairs (all of one expert,
# ``block_experts[m]``) by an N-tile of that expert's weight; rows gather their input through the pair
# index, so no permuted copy of the activations is made (after vLLM's fused_moe kernel). The first
# GEMM reads token rows (pair // k) of ``hidden`` and writes pair rows of the gate/up activations; the
# second reads pair rows, scales them by the routing weight and writes pair rows of the output, summed
# over the k slots afterwards.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr,
    N, K, num_pairs,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ROWWISE: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if ROWWISE:  # batch-invariant mode under the interpreter (see ROWWISE in kernels._triton_utils)
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        elif IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _moe_gemm(a, w, c, sorted_pairs, block_experts, weights, a_row_div: int, mul_weight: bool, block_m: int,
              rowwise: bool = False):
    n, k = w.shape[1], w.shape[2]
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, w, c, sorted_pairs, block_experts, weights,
        n, k, c.shape[0],
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=mul_weight,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=a.dtype == torch.float32, ROWWISE=rowwise,
        num_warps=4, num_stages=2,
    )


def fused_moe_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    block_m: int = 16,
    reduce_slots: bool = True,
) -> torch.Tensor:
    """Triton grouped GEMM of :func:`fused_moe_ref` (same contract; no host sync).

    Args:
        block_m: rows per tile (>= 16); 16 suits decode, 64 large prefills.
        reduce_slots: False returns :func:`fused_moe_slots_ref`'s per-slot outputs ([T, k, H] float32).

    In batch-invariant mode (``kernels.batch_invariant``) the k routed outputs of a token are added in
    slot order (:func:`sum_slots`); with a fixed ``block_m`` (as :func:`fused_moe` passes then) a
    token's row is computed by the same tiles whatever else the batch holds.
    """
    invariant = is_batch_invariant()
    rowwise = invariant and is_interpreting()
    _check_shapes(hidden, w13, w2, topk_ids, topk_weights)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden_size = w13.shape
    if num_tokens == 0:
        if reduce_slots:
            return torch.zeros_like(hidden)
        return hidden.new_zeros((0, top_k, hidden_size), dtype=torch.float32)
    sorted_pairs, block_experts = moe_align(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).contiguous()
    num_pairs = num_tokens * top_k
    # Pairs no tile visits (skipped ids) must read as zeros in the activation and the sum over k.
    gate_up = torch.zeros((num_pairs, two_inter), dtype=hidden.dtype, device=hidden.device)
    _moe_gemm(hidden, w13, gate_up, sorted_pairs, block_experts, weights, top_k, False, block_m, rowwise)
    act = silu_and_mul(gate_up)
    out = torch.zeros((num_pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    _moe_gemm(act, w2, out, sorted_pairs, block_experts, weights, 1, True, block_m, rowwise)
    out = out.view(num_tokens, top_k, hidden_size)
    if not reduce_slots:
        return out
    if invariant:
        return sum_slots(out).to(hidden.dtype)
    return out.sum(1).to(hidden.dtype)


def _triton_applies(hidden, w13, w2, topk_ids, topk_weights) -> bool:
    return (
        hidden.dim() == 2
        and hidden.dtype == w13.dtype == w2.dtype
        and hidden.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and use_triton(hidden, w13, w2, topk_ids, topk_weights)
    )


def _block_m(topk_ids: torch.Tensor) -> int:
    return 64 if is_batch_invariant() or topk_ids.numel() > 1024 else 16


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Same contract as :func:`fused_moe_ref`; the Triton grouped GEMM on CUDA tensors (64-row tiles
    whatever the batch in batch-invariant mode). In batch-invariant mode without Triton, the k outputs
    of :func:`fused_moe_slots_ref` are added in slot order, as expert parallelism adds them."""
    if _triton_applies(hidden, w13, w2, topk_ids, topk_weights):
        return fused_moe_triton(hidden, w13, w2, topk_ids, topk_weights, block_m=_block_m(topk_ids))
    if is_batch_invariant():
        return sum_slots(fused_moe_slots_ref(hidden, w13, w2, topk_ids, topk_weights)).to(hidden.dtype)
    return fused_moe_ref(hidden, w13, w2, topk_ids, topk_weights)


def fused_moe_slots(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Same contract as :func:`fused_moe_slots_ref` ([T, k, H] float32); the Triton grouped GEMM where
    :func:`fused_moe` takes it, with the same tiles, so that ``sum_slots(fused_moe_slots(...))`` cast to
    hidden's dtype is :func:`fused_moe`'s result bit for bit in batch-invariant mode (how expert
    parallelism combines the ranks' outputs then, ``model.moe.RoutedExperts``)."""
    if _triton_applies(hidden, w13, w2, topk_ids, topk_weights):
        return fused_moe_triton(hidden, w13, w2, topk_ids, topk_weights, block_m=_block_m(topk_ids),
                                reduce_slots=False)
    return fused_moe_slots_ref(hidden, w13, w2, topk_ids, topk_weights)
