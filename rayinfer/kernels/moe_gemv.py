"""One token's routed experts as GEMVs: the batch-1 decode step's MoE layer.

At one token a MoE layer only streams its k active experts' weights (DeepSeek-V2-Lite with its two fused
shared experts: 8 x 17.3 MB a layer). The grouped GEMM of ``kernels.fused_moe`` runs it as one tensor-core
tile per (pair, column block) with 15 of the tile's 16 rows padding. These kernels are ``kernels.gemv``'s GEMV
over each pair's expert instead: a few output rows per program over the whole K on the CUDA cores.

``fused_moe`` takes them for one token on fp8 experts (``ONE_TOKEN_GEMV_FP8``): there the tiles multiply fp8
by fp8 and quantize the token's row twice (two launches more), and on an H200 the fp8 V2-Lite batch-1 step
took 1.70-1.72 ms with the GEMVs against 1.74-1.82 ms. With 16-bit experts the tiles stay
(``ONE_TOKEN_GEMV``): the layer alone read at 80% of the copy bandwidth on the tiles and 79% as GEMVs, and the
bf16 step took 2.09-2.10 ms on the tiles against 2.20-2.21 ms (the GEMVs cannot start their weight stream
before the router's kernel ends: their rows depend on its ids). Measured in
``benchmarks/probe/moe_gemv_tiles.py`` and ``jobs/bench_moe.py --ab``; ``benchmarks/README.md``, "Fifteenth round".

- ``_moe_gemv_gate_up_kernel``: program (pair p, block of BLOCK_N intermediate rows) computes
  ``silu(x @ gate_e[rows].T) * (x @ up_e[rows].T)`` for p's expert e, rounded as the grouped GEMM's
  SiLU-and-mul epilogue (gate and up in the model dtype, silu rounded before the product);
- ``_moe_gemv_down_kernel``: program (pair p, block of hidden rows) computes ``w_p * (act_p @ down_e[rows].T)``,
  rounded to the model dtype, the pair's weighted output row;
- the k rows are then added in slot order by ``fused_moe``'s slot-sum launch (and into the residual stream).

A pair whose id is not an expert here (``-1``, or past this rank's experts) writes zero rows, as the grouped
GEMM's one-token path does. fp8 block weights (DeepSeek-V3's 128 x 128 ``weight_scale_inv``) are widened in
the kernel and each 128-column run scaled by its block's scale (``kernels.gemv._gemv_tile``); the token's row
stays in its 16-bit dtype (W8A16). Reference: :func:`rayinfer.kernels.fused_moe.fused_moe_ref`.
"""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import pdl_launch, pdl_wait, tl, triton, use_pdl
from rayinfer.kernels.block_fp8 import WEIGHT_BLOCK
from rayinfer.kernels.gemv import _gemv_tile

# (block_n, block_k, num_warps, num_stages) of the two kernels (benchmarks/probe/moe_gemv_tiles.py sweeps them)
GATE_UP_TILES = (16, 512, 4, 3)
DOWN_TILES = (8, 512, 4, 3)


@triton.jit
def _pair_expert(ids_ptr, pair, num_experts):
    """(expert, valid): pair's expert id, 0 where it is not one of the ``num_experts`` here."""
    expert = tl.load(ids_ptr + pair).to(tl.int32)
    valid = (expert >= 0) & (expert < num_experts)
    return tl.where(valid, expert, 0), valid


@triton.jit
def _moe_gemv_gate_up_kernel(
    x_ptr, w_ptr, ids_ptr, act_ptr, load_ptr, scale_ptr,
    N, K, num_experts, num_logical, stride_we, stride_wn, stride_se, stride_sn, stride_sk, up_scale_row,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COUNT_LOAD: tl.constexpr, FP8_SCALES: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pair = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    pdl_wait(USE_PDL)  # the expert comes from the router
    expert, valid = _pair_expert(ids_ptr, pair, num_experts)
    if COUNT_LOAD:
        if tl.program_id(1) == 0:
            tl.atomic_add(load_ptr + expert, tl.full((), 1, tl.int64), mask=valid & (expert < num_logical))
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    gate_rows = w_e + rn[:, None].to(tl.int64) * stride_wn
    up_rows = w_e + (N + rn)[:, None].to(tl.int64) * stride_wn
    s_e = scale_ptr + expert.to(tl.int64) * stride_se
    s_up = s_e + up_scale_row * stride_sn
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        k_ok = ks < K
        a = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        m = n_ok[:, None] & k_ok[None, :]
        g = tl.load(gate_rows + ks[None, :], mask=m, other=0.0)
        u = tl.load(up_rows + ks[None, :], mask=m, other=0.0)
        acc_g += _gemv_tile(g, a, rn, n_ok, k0, K, s_e, stride_sn, stride_sk, FP8_SCALES, SCALE_BLOCK, BLOCK_N, BLOCK_K)
        acc_u += _gemv_tile(u, a, rn, n_ok, k0, K, s_up, stride_sn, stride_sk, FP8_SCALES, SCALE_BLOCK, BLOCK_N,
                            BLOCK_K)
    # silu(gate) * up with the grouped GEMM epilogue's roundings (gate/up in the output dtype, silu rounded)
    dt = act_ptr.dtype.element_ty
    gf = acc_g.to(dt).to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32) * acc_u.to(dt).to(tl.float32)
    act = tl.where(valid, act, 0.0)
    tl.store(act_ptr + pair.to(tl.int64) * N + rn, act.to(dt), mask=n_ok)


@triton.jit
def _moe_gemv_down_kernel(
    act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, scale_ptr,
    N, K, num_experts, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_SCALES: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pair = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    pdl_wait(USE_PDL)
    expert, valid = _pair_expert(ids_ptr, pair, num_experts)
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + rn[:, None].to(tl.int64) * stride_wn
    s_e = scale_ptr + expert.to(tl.int64) * stride_se
    x_row = act_ptr + pair.to(tl.int64) * K
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        k_ok = ks < K
        a = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += _gemv_tile(w, a, rn, n_ok, k0, K, s_e, stride_sn, stride_sk, FP8_SCALES, SCALE_BLOCK, BLOCK_N, BLOCK_K)
    weight = tl.load(weights_ptr + pair).to(tl.float32)
    out = tl.where(valid, acc * weight, 0.0)
    tl.store(out_ptr + pair.to(tl.int64) * N + rn, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def moe_gemv_pairs(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    out: torch.Tensor, expert_load: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> None:
    """Each pair's weighted expert output for ONE token, written to ``out`` [k, H] (hidden's dtype or float32).

    Args:
        hidden: [1, H] 16-bit or float32; w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], hidden's
            dtype or float8_e4m3fn with ``w13_scale`` / ``w2_scale`` (``fused_moe_triton``'s layouts).
        topk_ids: [1, k] int (ids outside [0, E) give zero rows); topk_weights: [1, k] float.
        expert_load: [L] int64, += 1 for each pair's expert below L.
    Tiles: :data:`GATE_UP_TILES`, :data:`DOWN_TILES` (K tiles of at least 128 columns with fp8 blocks).
    Raises:
        ValueError: for more than one token.
    """
    if hidden.shape[0] != 1 or topk_ids.shape[0] != 1:
        raise ValueError(f"moe_gemv_pairs computes one token, got hidden {tuple(hidden.shape)}, ids {tuple(topk_ids.shape)}")
    num_experts, two_inter, hidden_size = w13.shape
    inter = two_inter // 2
    num_pairs = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1)
    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    fp8 = w13_scale is not None
    pdl = pdl_launch(use_pdl(hidden))
    bn, bk, warps, stages = GATE_UP_TILES
    if fp8:
        bk = max(bk, WEIGHT_BLOCK[1])
    s13 = w13_scale if fp8 else weights  # unread without fp8
    s13_strides = w13_scale.stride() if w13_scale is not None else (0, 0, 0)
    _moe_gemv_gate_up_kernel[(num_pairs, triton.cdiv(inter, bn))](
        hidden, w13, ids, act, expert_load if expert_load is not None else weights, s13,
        inter, hidden_size, num_experts, expert_load.numel() if expert_load is not None else 0,
        w13.stride(0), w13.stride(1), *s13_strides, triton.cdiv(inter, WEIGHT_BLOCK[0]),
        BLOCK_N=bn, BLOCK_K=bk, COUNT_LOAD=expert_load is not None, FP8_SCALES=fp8, SCALE_BLOCK=WEIGHT_BLOCK[1],
        num_warps=warps, num_stages=stages, **pdl,
    )
    bn, bk, warps, stages = DOWN_TILES
    if fp8:
        bk = max(bk, WEIGHT_BLOCK[1])
    s2 = w2_scale if w2_scale is not None else weights
    s2_strides = w2_scale.stride() if w2_scale is not None else (0, 0, 0)
    _moe_gemv_down_kernel[(num_pairs, triton.cdiv(hidden_size, bn))](
        act, w2, ids, weights, out, s2, hidden_size, inter, num_experts, w2.stride(0), w2.stride(1), *s2_strides,
        BLOCK_N=bn, BLOCK_K=bk, FP8_SCALES=fp8, SCALE_BLOCK=WEIGHT_BLOCK[1], num_warps=warps, num_stages=stages,
        **pdl,
    )
