"""Routed-expert MLPs of a mixture-of-experts layer: ``sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))``.

Glossary: T tokens, H hidden size, I expert intermediate size, E experts held by this call, k experts
per token (top-k). ``w13`` stacks each expert's gate and up projections (gate rows first, as Hugging
Face's ``gate_up_proj``), ``w2`` its down projection. A ``topk_ids`` entry outside ``[0, E)`` (for
example -1) is skipped: expert parallelism marks the experts another rank computes that way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rayinfer import envs
from rayinfer.kernels._triton_utils import device_capability, is_interpreting, pdl_launch, pdl_wait, tl, triton, use_pdl, use_triton
from rayinfer.kernels.activation import silu_and_mul, silu_and_mul_ref
from rayinfer.kernels.batch_invariant import is_batch_invariant
from rayinfer.kernels.block_fp8 import (FP8_DTYPE, WEIGHT_BLOCK, block_fp8_dequant_ref, has_fp8_tensor_cores,
                                        qdq_act_fp8_ref, quantize_act_fp8, quantize_block_fp8)
from rayinfer.kernels.fused_moe_config import MoETileConfig, grouped_mm_from, tile_config
from rayinfer.kernels.moe_gemv import moe_gemv_pairs


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


def fused_moe_w8a8_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                       w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """:func:`fused_moe_ref` with W8A8 block fp8 as DeepSeek-V3 serves its checkpoints (plain torch): the
    fp8 weights dequantized (128 x 128 blocks, :func:`quantize_w13` / ``block_fp8.quantize_block_fp8``
    layouts) and each GEMM's activations quantized per token and 128 columns
    (``block_fp8.qdq_act_fp8_ref``) then dequantized, both GEMMs in float32; the gate/up products
    round to hidden's dtype before SiLU-and-mul, as the kernel's epilogue does.

    Args: as :func:`fused_moe_ref`, with w13 / w2 float8_e4m3fn and their float32 scales.
    Returns: [T, H], hidden's dtype.
    Source: DeepSeek-V3 technical report (arXiv:2412.19437) §3.3 (1 x 128 activation tiles, 128 x 128 weight
    blocks).
    """
    _check_shapes(hidden, w13, w2, topk_ids, topk_weights)
    w13d, w2d = dequant_w13(w13, w13_scale, torch.float32), block_fp8_dequant_ref(w2, w2_scale, torch.float32)
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    out = torch.zeros_like(hidden)
    flat_ids, flat_weights = topk_ids.reshape(-1), topk_weights.reshape(-1)
    h = qdq_act_fp8_ref(hidden)
    for e in torch.unique(flat_ids[(flat_ids >= 0) & (flat_ids < num_experts)]).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        tokens = pairs // top_k
        act = silu_and_mul_ref(F.linear(h[tokens], w13d[e]).to(hidden.dtype))
        y = F.linear(qdq_act_fp8_ref(act), w2d[e]) * flat_weights[pairs, None].float()
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


@dataclass(frozen=True)
class ExpertMap:
    """Where each logical expert is computed: this rank's physical slots (expert parallelism, EPLB).

    Attributes:
        log2phy: [L, max_replicas] int64, the physical slots of each logical expert (-1 padded).
        replica_counts: [L] int64, replicas of each logical expert.
        first_local: the first physical slot this rank holds.
        num_local: E, the slots this rank holds (``first_local .. first_local + E - 1``).

    Pair ``(token, slot)`` of logical expert ``e`` goes to replica ``token % replica_counts[e]`` of
    ``e``, the same on every rank (``model.moe.RoutedExperts``).
    """

    log2phy: torch.Tensor
    replica_counts: torch.Tensor
    first_local: int
    num_local: int

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, k] logical ids (-1 = none) -> [T, k] int64 ids of this rank's slots, -1 where another rank
        computes (plain torch)."""
        rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]
        valid = topk_ids >= 0
        logical = topk_ids.long().clamp(min=0)
        physical = self.log2phy[logical, rows % self.replica_counts[logical]]
        local = physical - self.first_local
        mine = valid & (local >= 0) & (local < self.num_local)
        return torch.where(mine, local, torch.full_like(local, -1))


# A/B switches of jobs/bench_moe.py. ONE_TOKEN_DIRECT: a one-token call skips the alignment
# (fused_moe_triton's "direct" tiles); 0 aligns as for any batch. SLOTS_IN_HIDDEN_DTYPE: the summed path
# keeps each pair's output in hidden's dtype; 0 keeps float32.
ONE_TOKEN_DIRECT = 1
SLOTS_IN_HIDDEN_DTYPE = 1
# ONE_TOKEN_GEMV_FP8: a one-token call on fp8 experts runs its pairs as GEMVs (``kernels.moe_gemv``; W8A16, the
# token's row stays 16-bit) instead of the direct grouped-GEMM tiles (W8A8 there: two activation-quantizing
# launches more); ONE_TOKEN_GEMV: 16-bit experts too. On an H200 (d5e1942, benchmarks/README.md "Fifteenth
# round") the fp8 V2-Lite batch-1 step took 1.70-1.72 ms with the GEMVs against 1.74-1.82 on the tiles, and the
# bf16 one 2.20-2.21 ms against 2.09-2.10 on the tiles, so 16-bit experts keep the tiles.
ONE_TOKEN_GEMV = 0
ONE_TOKEN_GEMV_FP8 = 1
# fp8 expert weights on a GPU with fp8 tensor cores: 1 quantizes the activations too (W8A8, DeepSeek-V3's
# dynamic per-token-group scheme; fused_moe_triton's act_fp8); 0 keeps them in 16 bits (W8A16).
FP8_ACTIVATIONS = 1


def _aligned_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    return triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert and pad each expert's run to a multiple of ``block_m``.

    Device-only torch ops with shapes fixed by ``T * k``, ``E`` and ``block_m``: no host sync, so a
    CUDA graph can capture it (after vLLM's ``moe_align_block_size``).

    Args:
        topk_ids: [T, k] int expert ids; ids outside ``[0, num_experts)`` are dropped.
        num_experts: E.
        block_m: rows per GEMM tile.
    Returns:
        sorted_pairs: [P] int64 flat pair index ``token * k + slot``, grouped by expert in ascending
            pair order, each group padded with the sentinel ``T * k``;
            ``P = ceil((T*k + E*(block_m-1)) / block_m) * block_m``.
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
    size = _aligned_size(num_pairs, num_experts, block_m)
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
# Triton alignment in two launches. The pairs are cut into C chunks (C <= 256). Kernel 1: program c
# maps chunk c's ids to this rank's expert slots (ExpertMap), optionally adds the logical ids to the
# expert-load counters (atomics), and writes the chunk's histogram over experts. Kernel 2: program c
# reads all histograms, so knows each expert's padded start (an exclusive scan over experts) and the
# pairs of its expert in earlier chunks, then scatters its chunk in ascending pair order (ranks within
# a sub-chunk from a one-hot cumsum) and writes the sentinel padding and tile experts of its share of
# the output. Same result as moe_align_ref, with fixed sizes and no host sync. Up to
# _ALIGN_ONE_LAUNCH pairs (small decode batches) kernel 2 counts its single chunk itself: one launch.
# ----------------------------------------------------------------------------------------------------
_ALIGN_MAX_CHUNKS = 256  # 64 left a 4K-token prefill's scatter at 46 us a layer (V2-Lite: 512 pairs a program)
_ALIGN_SUB = 32
_ALIGN_ONE_LAUNCH = 64


@triton.jit
def _slot_of_pairs(ids_ptr, offs, num_pairs, log2phy_ptr, replica_counts_ptr, stride_r, first_local,
                   num_experts, num_logical, TOP_K: tl.constexpr, MAP: tl.constexpr):
    """(expert slot of each pair, E where dropped; its logical id is valid)."""
    ok = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32)
    if MAP:
        valid = ok & (ids >= 0) & (ids < num_logical)
        logical = tl.where(valid, ids, 0)
        replicas = tl.load(replica_counts_ptr + logical, mask=valid, other=1).to(tl.int32)
        rows = offs // TOP_K
        physical = tl.load(log2phy_ptr + logical.to(tl.int64) * stride_r + rows % replicas, mask=valid, other=-1)
        local = physical.to(tl.int32) - first_local
        mine = valid & (local >= 0) & (local < num_experts)
        slot = tl.where(mine, local, num_experts)
    else:
        valid = ok & (ids >= 0) & (ids < num_experts)
        slot = tl.where(valid, ids, num_experts)
    return slot, valid


@triton.jit
def _count_load(ids_ptr, offs, valid, load_ptr, num_logical, BLOCK_L: tl.constexpr):
    # expert_load[e] += pairs of logical expert e among offs (EPLB's load); ids >= num_logical (fused
    # shared experts) are not counted
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    valid = valid & (ids < num_logical)
    load = tl.histogram(ids, BLOCK_L, mask=valid)
    experts = tl.arange(0, BLOCK_L)
    tl.atomic_add(load_ptr + experts, load.to(tl.int64), mask=(experts < num_logical) & (load > 0))


@triton.jit
def _moe_count_kernel(
    ids_ptr, log2phy_ptr, replica_counts_ptr, load_ptr, chunk_counts_ptr,
    num_pairs, stride_r, first_local, num_experts, num_logical,
    TOP_K: tl.constexpr, MAP: tl.constexpr, COUNT_LOAD: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_L: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    pdl_wait(USE_PDL)
    slot, valid = _slot_of_pairs(ids_ptr, offs, num_pairs, log2phy_ptr, replica_counts_ptr, stride_r, first_local,
                                 num_experts, num_logical, TOP_K, MAP)
    if COUNT_LOAD:
        _count_load(ids_ptr, offs, valid, load_ptr, num_logical, BLOCK_L)
    hist = tl.histogram(slot, BLOCK_E, mask=slot < num_experts)
    experts = tl.arange(0, BLOCK_E)
    tl.store(chunk_counts_ptr + chunk * num_experts + experts, hist, mask=experts < num_experts)


# num_chunks and num_tiles are not specialized on divisibility by 16: the start-up prefill's prompts all
# have 256 chunks, and a first 3000-token prompt (188 chunks) waited ~1 s for this kernel's compile on an H200
@triton.jit(do_not_specialize=["num_chunks", "num_tiles"])
def _moe_scatter_kernel(
    ids_ptr, log2phy_ptr, replica_counts_ptr, chunk_counts_ptr, sorted_pairs_ptr, block_experts_ptr, kept_ptr,
    load_ptr, num_pairs, stride_r, first_local, num_experts, num_logical, num_chunks, num_tiles,
    TOP_K: tl.constexpr, MAP: tl.constexpr, BLOCK_M: tl.constexpr, WRITE_KEPT: tl.constexpr,
    ONE_LAUNCH: tl.constexpr, COUNT_LOAD: tl.constexpr, BLOCK_L: tl.constexpr,
    CHUNK: tl.constexpr, SUB: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, TILES: tl.constexpr,
    USE_PDL: tl.constexpr = False, GROUPED: tl.constexpr = False, group_ends_ptr=None, rows_ptr=None,
    positions_ptr=None,
):
    # GROUPED (the grouped-GEMM path): also each expert's padded end (group_ends [E] int32), the token of every
    # sorted row (rows [P] int32, 0 in padding rows) and the sorted row of every kept pair (positions [T*k])
    chunk = tl.program_id(0)
    pdl_wait(USE_PDL)
    experts = tl.arange(0, BLOCK_E)
    expert_ok = experts < num_experts
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)  # pairs of each expert in chunks < this one
    if ONE_LAUNCH:  # one chunk (CHUNK == SUB), counted here by every program
        offs = tl.arange(0, SUB)
        slot, valid = _slot_of_pairs(ids_ptr, offs, num_pairs, log2phy_ptr, replica_counts_ptr, stride_r,
                                     first_local, num_experts, num_logical, TOP_K, MAP)
        counts = tl.histogram(slot, BLOCK_E, mask=slot < num_experts)
        if COUNT_LOAD:
            if chunk == 0:
                _count_load(ids_ptr, offs, valid, load_ptr, num_logical, BLOCK_L)
    else:
        for r0 in range(0, num_chunks, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            cc = tl.load(chunk_counts_ptr + rows[:, None] * num_experts + experts[None, :],
                         mask=(rows[:, None] < num_chunks) & expert_ok[None, :], other=0)
            counts += tl.sum(cc, 0)
            before += tl.sum(tl.where(rows[:, None] < chunk, cc, 0), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    if GROUPED:
        if chunk == 0:
            tl.store(group_ends_ptr + experts, pad_end, mask=expert_ok)
    # 1. this chunk's pairs, in ascending pair order within each expert
    if chunk < num_chunks:
        base = pad_start + before
        for s in range(0, CHUNK, SUB):
            offs = chunk * CHUNK + s + tl.arange(0, SUB)
            slot, _ = _slot_of_pairs(ids_ptr, offs, num_pairs, log2phy_ptr, replica_counts_ptr, stride_r,
                                     first_local, num_experts, num_logical, TOP_K, MAP)
            onehot = (slot[:, None] == experts[None, :]).to(tl.int32)  # [SUB, BLOCK_E]
            rank = tl.sum(onehot * tl.cumsum(onehot, 0), 1) - 1
            dest = tl.sum(onehot * base[None, :], 1) + rank
            tl.store(sorted_pairs_ptr + dest, offs, mask=slot < num_experts)
            if GROUPED:
                tl.store(rows_ptr + dest, offs // TOP_K, mask=slot < num_experts)
                tl.store(positions_ptr + offs, dest, mask=slot < num_experts)
            if WRITE_KEPT:
                tl.store(kept_ptr + offs, (slot < num_experts).to(tl.int8), mask=offs < num_pairs)
            base += tl.sum(onehot, 0)
    # 2. this program's share of the tiles: their expert, and the sentinel in their unused rows
    tiles_per_program = tl.cdiv(num_tiles, tl.num_programs(0))
    first_tile = chunk * tiles_per_program
    last_tile = tl.minimum(first_tile + tiles_per_program, num_tiles)
    rows_in_tile = tl.arange(0, BLOCK_M)
    for t0 in range(first_tile, last_tile, TILES):
        tiles = t0 + tl.arange(0, TILES)
        tile_ok = tiles < last_tile
        start = tiles * BLOCK_M
        expert = tl.sum((expert_ok[None, :] & (pad_end[None, :] <= start[:, None])).to(tl.int32), 1)
        tl.store(block_experts_ptr + tiles, tl.where(expert < num_experts, expert, -1), mask=tile_ok)
        mine = expert_ok[None, :] & (experts[None, :] == expert[:, None])  # [TILES, BLOCK_E]
        expert_start = tl.sum(tl.where(mine, pad_start[None, :], 0), 1)
        expert_count = tl.sum(tl.where(mine, counts[None, :], 0), 1)
        filled = expert_count - (start - expert_start)  # rows of the tile holding pairs (may be <= 0)
        pad = tile_ok[:, None] & (rows_in_tile[None, :] >= filled[:, None])
        sentinel = tl.zeros([TILES, BLOCK_M], dtype=tl.int32) + num_pairs
        tl.store(sorted_pairs_ptr + start[:, None] + rows_in_tile[None, :], sentinel, mask=pad)
        if GROUPED:
            tl.store(rows_ptr + start[:, None] + rows_in_tile[None, :], sentinel * 0, mask=pad)


def moe_align_triton(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    expert_map: ExpertMap | None = None,
    expert_load: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
    grouped: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_align_ref` in two Triton launches (one up to 64 pairs), with the expert-slot mapping and
    load counting folded in.

    Args:
        topk_ids: [T, k] int expert ids (logical ids when ``expert_map`` is given).
        num_experts: E, expert slots of this call.
        block_m: rows per GEMM tile, a power of two >= 16.
        expert_map: maps the logical ids to this rank's slots first (as ``expert_map.local_ids``).
        expert_load: [L] int64 counters; each valid logical id adds one to its expert (EPLB's load).
        kept: [T * k] int8, written when given: 1 where the pair has an expert slot here, else 0.
        grouped: (group_ends [E], rows [P], positions [T * k]) int32, written when given (the grouped-GEMM
            path's layout): each expert's padded end (exclusive of the tiles past the end), the token of each
            sorted row (0 in padding rows), and the sorted row of each pair with an expert slot here.
    Returns:
        (sorted_pairs [P] int32, block_experts [P // block_m] int32): :func:`moe_align_ref`'s values
        for ``expert_map.local_ids(topk_ids)`` (or topk_ids), exactly.
    """
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    device = topk_ids.device
    size = _aligned_size(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(size, dtype=torch.int32, device=device)
    block_experts = torch.empty(size // block_m, dtype=torch.int32, device=device)
    one_launch = num_pairs <= _ALIGN_ONE_LAUNCH
    if one_launch:
        chunk = sub = max(_ALIGN_SUB, triton.next_power_of_2(num_pairs))
    else:
        chunk = max(_ALIGN_SUB, triton.next_power_of_2(triton.cdiv(num_pairs, _ALIGN_MAX_CHUNKS)))
        sub = _ALIGN_SUB
    num_chunks = max(1, triton.cdiv(num_pairs, chunk))
    ids = topk_ids.reshape(-1)
    if expert_map is not None:
        log2phy, replica_counts = expert_map.log2phy, expert_map.replica_counts
        first_local, num_logical, stride_r = expert_map.first_local, log2phy.shape[0], log2phy.stride(0)
    else:
        log2phy = replica_counts = ids  # unread
        # slots past the load counters' experts (fused shared experts) are computed but not counted
        num_logical = expert_load.numel() if expert_load is not None else num_experts
        first_local, stride_r = 0, 0
    load = expert_load if expert_load is not None else ids
    common = dict(TOP_K=top_k, MAP=expert_map is not None, CHUNK=chunk, BLOCK_E=triton.next_power_of_2(num_experts),
                  COUNT_LOAD=expert_load is not None, BLOCK_L=triton.next_power_of_2(num_logical))
    pdl = pdl_launch(use_pdl(topk_ids))
    if one_launch:
        chunk_counts = ids  # unread
    else:
        chunk_counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=device)
        _moe_count_kernel[(num_chunks,)](
            ids, log2phy, replica_counts, load, chunk_counts,
            num_pairs, stride_r, first_local, num_experts, num_logical, **common, **pdl,
        )
    num_tiles = size // block_m
    tiles = 16
    num_programs = max(num_chunks, min(triton.cdiv(num_tiles, tiles), _ALIGN_MAX_CHUNKS))
    _moe_scatter_kernel[(num_programs,)](
        ids, log2phy, replica_counts, chunk_counts, sorted_pairs, block_experts, kept if kept is not None else ids,
        load, num_pairs, stride_r, first_local, num_experts, num_logical, num_chunks, num_tiles,
        BLOCK_M=block_m, WRITE_KEPT=kept is not None, ONE_LAUNCH=one_launch, SUB=sub,
        ROWS=min(64, max(16, triton.next_power_of_2(num_chunks))), TILES=tiles,
        **common, **pdl, GROUPED=grouped is not None,
        **(dict(zip(("group_ends_ptr", "rows_ptr", "positions_ptr"), grouped)) if grouped is not None else {}),
    )
    return sorted_pairs, block_experts


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    expert_map: ExpertMap | None = None,
    expert_load: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-sorted, tile-padded pairs (:func:`moe_align_ref`); the Triton kernels on CUDA tensors.

    Args: as :func:`moe_align_triton` (mapping and load counting in torch when Triton does not apply).
    Returns: as :func:`moe_align_ref` (int32 from the kernels, int64 from torch).
    """
    if use_triton(topk_ids) and topk_ids.dim() == 2:
        return moe_align_triton(topk_ids, num_experts, block_m, expert_map, expert_load)
    return moe_align_ref(_map_and_count(topk_ids, expert_map, expert_load), num_experts, block_m)


def _map_and_count(topk_ids: torch.Tensor, expert_map: ExpertMap | None, expert_load: torch.Tensor | None):
    """The torch path of the mapping and load counting that :func:`moe_align_triton` folds in."""
    if expert_load is not None:
        flat = topk_ids.reshape(-1).long()
        valid = (flat >= 0) & (flat < expert_load.numel())  # no boolean indexing: no host sync
        expert_load.index_add_(0, torch.where(valid, flat, 0), valid.long())
    return topk_ids if expert_map is None else expert_map.local_ids(topk_ids)


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
    a_ptr, w_ptr, c_ptr, sorted_pairs_ptr, block_experts_ptr, weights_ptr, scale_ptr,
    N, K, num_pairs,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
    stride_se, stride_sn, stride_sk, up_scale_row,
    A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, GATED: tl.constexpr, HAS_SCALE: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ROWWISE: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    DIRECT: tl.constexpr = False, num_experts=0, load_ptr=None, num_logical=0, COUNT_LOAD: tl.constexpr = False,
    ACT_SCALE: tl.constexpr = False, a_scale_ptr=None, stride_asm=0, WIDEN_FP8: tl.constexpr = False,
):
    # ACT_SCALE (W8A8): a is fp8 with one float32 scale per row and SCALE_BLOCK_K columns (a_scale [rows of a,
    # ceil(K / SCALE_BLOCK_K)]); each K step's fp8 x fp8 product is scaled by its rows' and columns' scales.
    # WIDEN_FP8: the interpreter, which has no fp8 tl.dot: both operands widened to float32.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pdl_wait(USE_PDL)  # the tile's expert comes from the alignment kernel (DIRECT: from the router)
    if DIRECT:
        # one pair per tile, pair pid_m, its expert read from topk_ids (block_experts_ptr); the tile's other
        # rows are padding. A pair without an expert here computes and writes a zero row (the slot sum
        # then reads every pair), reading expert 0's weights for nothing (routing never gives such ids).
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int32)
        valid = (expert >= 0) & (expert < num_experts)
        if COUNT_LOAD:
            if pid_n == 0:
                tl.atomic_add(load_ptr + expert, tl.full((), 1, tl.int64), mask=valid & (expert < num_logical))
        expert = tl.where(valid, expert, 0)
        first = tl.arange(0, BLOCK_M) == 0
        pairs = tl.where(first, pid_m, num_pairs)
        row_ok = first & ((tl.zeros([BLOCK_M], dtype=tl.int32) + valid.to(tl.int32)) != 0)  # rows read
        row_out = first  # rows written
    else:
        expert = tl.load(block_experts_ptr + pid_m)
        if expert < 0:
            return
        pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pairs < num_pairs
        row_out = row_ok
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = scale_ptr + expert.to(tl.int64) * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # GATED: the up rows N + cols of w13
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if WIDEN_FP8:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        part = _moe_tile_dot(a, b, ROWWISE, IEEE or WIDEN_FP8)
        if ACT_SCALE:
            a_s = tl.load(a_scale_ptr + a_rows * stride_asm + k0 // SCALE_BLOCK_K, mask=row_ok, other=0.0)[:, None]
            part = part * a_s
        if HAS_SCALE:  # fp8 block weights: one scale per (SCALE_BLOCK_N rows, SCALE_BLOCK_K columns) block
            s = tl.load(s_base + (cols // SCALE_BLOCK_N) * stride_sn + (k0 // SCALE_BLOCK_K) * stride_sk,
                        mask=col_ok, other=0.0)
            part = part * s[None, :]
        acc += part
        if GATED:
            b_up = tl.load(w_base + (N + cols)[None, :] * stride_wn + ks[:, None] * stride_wk,
                           mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if WIDEN_FP8:
                b_up = b_up.to(tl.float32)
            part_up = _moe_tile_dot(a, b_up, ROWWISE, IEEE or WIDEN_FP8)
            if ACT_SCALE:
                part_up = part_up * a_s
            if HAS_SCALE:
                # the up half's scales start at row up_scale_row = ceil(I / 128) (quantize_w13's layout)
                s_up = tl.load(s_base + (up_scale_row + cols // SCALE_BLOCK_N) * stride_sn
                               + (k0 // SCALE_BLOCK_K) * stride_sk, mask=col_ok, other=0.0)
                part_up = part_up * s_up[None, :]
            acc_up += part_up
    if GATED:
        # silu(gate) * up with the roundings of the unfused path (gate/up stored in c's dtype, silu
        # rounded before the product: silu_and_mul), so fusing changes no bits
        dt = c_ptr.dtype.element_ty
        g = acc.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        acc = act * acc_up.to(dt).to(tl.float32)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_out[:, None] & col_ok[None, :])


@triton.jit
def _moe_tile_dot(a, b, ROWWISE: tl.constexpr, IEEE: tl.constexpr):
    """[BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] -> float32; an fp8 weight tile is widened to a's dtype."""
    if b.dtype != a.dtype:
        b = b.to(a.dtype)
    if ROWWISE:  # batch-invariant mode under the interpreter (see ROWWISE in kernels._triton_utils)
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


def _active_tiles(num_pairs: int, num_experts: int, block_m: int, num_tiles: int) -> int:
    """An upper bound on the tiles holding pairs: sum_e ceil(c_e / BM) <= floor(P / BM) + min(E, P).

    The aligned layout puts those tiles first (experts' padded runs back to back), so the GEMMs'
    grids stop there: a decode step's 6 pairs over 64 experts launch 6 tile rows, not the 61 of the
    worst-case padded size (each extra program still costs a launch slot on its SM)."""
    return max(1, min(num_tiles, num_pairs // block_m + min(num_experts, num_pairs)))


def _moe_gemm(a, w, c, sorted_pairs, block_experts, weights, a_row_div: int, mul_weight: bool,
              tiles: MoETileConfig, rowwise: bool = False, gated: bool = False, scale: torch.Tensor | None = None,
              direct: bool = False, expert_load: torch.Tensor | None = None, a_scale: torch.Tensor | None = None):
    """One grouped GEMM. gated: w is w13 [E, 2N, K] and c gets ``silu(a @ gate.T) * (a @ up.T)`` [pairs, N].
    scale: fp8 block scales of w (``WEIGHT_BLOCK`` blocks), float32 (``weight_scale_inv``): [E, ceil(rows / bn),
    ceil(K / bk)], for w13 :func:`quantize_w13`'s [E, 2 * ceil(N / bn), ceil(K / bk)].
    direct: no alignment; tile m is pair m alone and ``block_experts`` is the flat topk_ids [pairs] (a
    one-token step, whose pairs have distinct experts); ``expert_load`` [L] int64 then counts the pairs'
    experts below L (in the first column tile's programs).
    a_scale: W8A8: a is float8_e4m3fn quantized per row and 128 columns (``block_fp8.quantize_act_fp8``), these
    its float32 scales [rows of a, ceil(K / 128)]; w must be fp8 with ``scale``."""
    bn, bk = WEIGHT_BLOCK
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    block_n = min(tiles.block_n, max(16, triton.next_power_of_2(n)))  # no wider than the weight
    block_k = min(tiles.block_k, max(16, triton.next_power_of_2(k)))
    if scale is not None:
        block_k = min(block_k, bk)  # a K step stays inside one scale block
    num_tiles = c.shape[0] if direct else _active_tiles(c.shape[0], w.shape[0], tiles.block_m, block_experts.numel())
    grid = (num_tiles, triton.cdiv(n, block_n))
    s = scale if scale is not None else weights  # unread without a scale
    s_strides = scale.stride() if scale is not None else (0, 0, 0)
    act8 = {} if a_scale is None else dict(ACT_SCALE=True, a_scale_ptr=a_scale, stride_asm=a_scale.stride(0),
                                           WIDEN_FP8=is_interpreting())
    _moe_gemm_kernel[grid](
        a, w, c, sorted_pairs, block_experts, weights, s,
        n, k, c.shape[0],
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1), *s_strides,
        triton.cdiv(n, bn),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=mul_weight, GATED=gated, HAS_SCALE=scale is not None,
        SCALE_BLOCK_N=bn, SCALE_BLOCK_K=bk, **act8,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=a.dtype == torch.float32, ROWWISE=rowwise,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch(use_pdl(a)),
        DIRECT=direct, num_experts=w.shape[0], load_ptr=expert_load if expert_load is not None else weights,
        num_logical=expert_load.numel() if expert_load is not None else 0, COUNT_LOAD=expert_load is not None,
    )


@triton.jit
def _moe_sum_kernel(out_ptr, kept_ptr, dst_ptr, hidden_size, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                    ADD_TO_DST: tl.constexpr = False, USE_PDL: tl.constexpr = False, ALL_KEPT: tl.constexpr = False,
                    BLOCK_K: tl.constexpr = 8, row_ptr=None, weight_ptr=None, GATHER: tl.constexpr = False):
    # dst[t] = out[t, 0] + out[t, 1] + ... in slot order in float32 (a slot not kept reads as 0), cast to dst;
    # ADD_TO_DST: dst[t] += that sum, rounded to dst's dtype first (a residual add of the layer's output);
    # ALL_KEPT: every slot's row was written (no kept flags);
    # GATHER: pair p's output is row row_ptr[p] of out, not yet weighted: the sum is of weight_ptr[p] * that row
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden_size
    zero = tl.zeros([BLOCK_H], dtype=tl.int32)
    pdl_wait(USE_PDL)
    slots = tl.arange(0, BLOCK_K)
    if not ALL_KEPT:  # the token's flags in one load, so that its slots' row loads do not wait on each other's
        flags = tl.load(kept_ptr + token * TOP_K + slots, mask=slots < TOP_K, other=0).to(tl.int32)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for slot in tl.static_range(0, TOP_K):
        mask = col_ok
        if not ALL_KEPT:
            mask = mask & ((tl.sum(tl.where(slots == slot, flags, 0), 0) + zero) != 0)  # broadcast: a vector mask
        if GATHER:
            row = tl.load(row_ptr + token * TOP_K + slot).to(tl.int64)
            w = tl.load(weight_ptr + token * TOP_K + slot).to(tl.float32)
            acc += w * tl.load(out_ptr + row * hidden_size + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            acc += tl.load(out_ptr + (token * TOP_K + slot) * hidden_size + cols, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * hidden_size + cols
    if ADD_TO_DST:
        acc = acc.to(dst_ptr.dtype.element_ty).to(tl.float32) + tl.load(dst, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(dst, acc.to(dst_ptr.dtype.element_ty), mask=col_ok)


def _launch_slot_sum(out, kept, result, top_k: int, add_to_dst: bool, pdl: bool, positions=None, weights=None):
    """``_moe_sum_kernel`` over ``result`` [T, H]: each token's k pair rows of ``out`` added in slot order
    (``kept`` [T * k] int8 masks the pairs computed here; None: all were). With ``positions`` [T * k], pair p's
    row is ``out[positions[p]]``, scaled by ``weights[p]`` first. add_to_dst: added into result's values."""
    num_tokens, hidden_size = result.shape
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    gather = {} if positions is None else dict(row_ptr=positions, weight_ptr=weights, GATHER=True)
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
        out, kept if kept is not None else out, result, hidden_size, TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_H=block_h, ADD_TO_DST=add_to_dst,
        ALL_KEPT=kept is None, num_warps=4, **gather, **pdl_launch(pdl))


def _check_residual(residual, hidden, reduce_slots: bool = True) -> None:
    if residual is not None and (not reduce_slots or residual.shape != hidden.shape
                                 or residual.dtype != hidden.dtype or not residual.is_contiguous()):
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must be a contiguous tensor like "
                         f"hidden {hidden.dtype} {tuple(hidden.shape)}, with reduce_slots")


def _check_scales(w13, w2, w13_scale, w2_scale) -> None:
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("fp8 experts need both w13_scale and w2_scale")
    if w13_scale is None:
        return
    bn, bk = WEIGHT_BLOCK
    for name, w, sc in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        rows = 2 * -(-w.shape[1] // 2 // bn) if name == "w13" else -(-w.shape[1] // bn)  # quantize_w13's layout
        want = (w.shape[0], rows, -(-w.shape[2] // bk))
        if w.dtype != FP8_DTYPE or tuple(sc.shape) != want or sc.dtype != torch.float32:
            raise ValueError(f"{name} {w.dtype} {tuple(w.shape)} with scale {sc.dtype} {tuple(sc.shape)}: fp8 "
                             f"experts are float8_e4m3fn with float32 scales of {want} ({bn}x{bk} blocks)")


def quantize_w13(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize stacked gate/up weights [E, 2I, H] (gate rows first) to fp8, the gate and the up half
    each in its own 128-row blocks: (float8_e4m3fn [E, 2I, H], scales [E, 2 * ceil(I/128), ceil(H/128)]).

    Per half this is ``kernels.block_fp8.quantize_block_fp8``, so a checkpoint's per-expert gate_proj and
    up_proj scales are the two halves of the scales as they are, whatever I (a block of the stacked rows
    would hold gate and up rows when I is not a multiple of 128)."""
    inter = w13.shape[1] // 2
    (qg, sg), (qu, su) = quantize_block_fp8(w13[:, :inter]), quantize_block_fp8(w13[:, inter:])
    return torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1)


def dequant_w13(w13: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`quantize_w13`: fp8 [E, 2I, H] and its scales -> [E, 2I, H] in ``dtype``."""
    inter, rows = w13.shape[1] // 2, scale.shape[1] // 2
    return torch.cat([block_fp8_dequant_ref(w13[:, :inter], scale[:, :rows], dtype),
                      block_fp8_dequant_ref(w13[:, inter:], scale[:, rows:], dtype)], dim=1)


def _dequant_experts(w13, w2, w13_scale, w2_scale, dtype):
    """The torch path's fp8 experts, dequantized: (w13 [E, 2I, H], w2 [E, H, I]) in ``dtype``."""
    return dequant_w13(w13, w13_scale, dtype), block_fp8_dequant_ref(w2, w2_scale, dtype)


def fused_moe_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tiles: MoETileConfig | None = None,
    reduce_slots: bool = True,
    expert_map: ExpertMap | None = None,
    expert_load: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    act_fp8: bool | None = None,
) -> torch.Tensor:
    """Triton grouped GEMM of :func:`fused_moe_ref` (same contract; no host sync).

    Args:
        tiles: the GEMM's tiles; None takes :func:`fused_moe_tiles`'s (the device's tuned table, else
            the heuristic: 16-row tiles for decode, 64 for large prefills).
        reduce_slots: False returns :func:`fused_moe_slots_ref`'s per-slot outputs ([T, k, H] float32).
        expert_map, expert_load: as :func:`moe_align_triton` (topk_ids are then logical ids).
        w13_scale, w2_scale: with float8_e4m3fn w13 / w2, their block scales (float32, DeepSeek-V3's
            ``weight_scale_inv``: w13's of :func:`quantize_w13`, [E, 2 * ceil(I/128), ceil(H/128)], w2's
            [E, ceil(H/128), ceil(I/128)]): the GEMMs widen each fp8 weight
            tile to hidden's dtype and scale each K step's partial products per output column, so the
            weights are dequantized in the kernel, never in memory.
        residual: [T, H] in hidden's dtype, contiguous: the result is added into it in place (rounded to
            the dtype first, as ``residual + fused_moe(...)``) and it is returned (with reduce_slots).
        act_fp8: with fp8 weights, W8A8 (:func:`fused_moe_w8a8_ref`'s result): hidden and the SiLU-and-mul
            output are quantized per token and 128 columns (``block_fp8.quantize_act_fp8``) and both GEMMs
            multiply fp8 by fp8 on the tensor cores, scaling each K step by its rows' and columns' scales.
            None: on CUDA devices with fp8 tensor cores (compute capability >= 8.9) unless ``FP8_ACTIVATIONS``
            is 0; else the W8A16 path above.

    A token's k routed outputs are added in slot order (:func:`sum_slots`'s order, one kernel that also
    casts), which batch-invariant mode (``kernels.batch_invariant``) needs; with fixed tiles (what
    :func:`fused_moe_tiles` gives then) a token's row is computed by the same tiles whatever else the
    batch holds.
    """
    invariant = is_batch_invariant()
    rowwise = invariant and is_interpreting()
    _check_shapes(hidden, w13, w2, topk_ids, topk_weights)
    _check_scales(w13, w2, w13_scale, w2_scale)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden_size = w13.shape
    _check_residual(residual, hidden, reduce_slots)
    if num_tokens == 0:
        if reduce_slots:
            return torch.zeros_like(hidden) if residual is None else residual
        return hidden.new_zeros((0, top_k, hidden_size), dtype=torch.float32)
    tiles = tiles or fused_moe_tiles(hidden, w13, top_k)
    num_pairs = num_tokens * top_k
    weights = topk_weights.reshape(-1).contiguous()
    # One token (a batch-1 decode step): its pairs have distinct experts, so tile m can be pair m with no
    # alignment launch (the GEMMs read the expert from topk_ids and count the load); every pair's row of
    # the output is written (zeros for a skipped id).
    direct = (num_tokens == 1 and expert_map is None and not invariant and ONE_TOKEN_DIRECT
              and topk_ids.is_contiguous())
    out_dtype = torch.float32 if (invariant or not reduce_slots or not SLOTS_IN_HIDDEN_DTYPE) else hidden.dtype
    if direct and (ONE_TOKEN_GEMV_FP8 if w13_scale is not None else ONE_TOKEN_GEMV) and act_fp8 is not True:
        # the pairs' experts as GEMVs over hundreds of programs (kernels.moe_gemv), then the slot sum
        out = torch.empty((num_pairs, hidden_size), dtype=out_dtype, device=hidden.device)
        moe_gemv_pairs(hidden, w13, w2, topk_ids, topk_weights, out, expert_load, w13_scale, w2_scale)
        return _pairs_result(out, None, hidden, residual, top_k, reduce_slots)
    kept = None
    if direct:
        sorted_pairs, block_experts, load = weights, topk_ids.reshape(-1), expert_load  # sorted_pairs unread
    else:
        # Rows of pairs no tile visits (skipped ids) are never read by the second GEMM; the sum over k skips
        # them (``kept``), and the unsummed output is zero there.
        kept = torch.empty(num_pairs, dtype=torch.int8, device=hidden.device) if reduce_slots else None
        sorted_pairs, block_experts = moe_align_triton(topk_ids, num_experts, tiles.block_m, expert_map,
                                                       expert_load, kept)
        load = None
    act_fp8 = (w8a8_applies(hidden) if act_fp8 is None else bool(act_fp8)) and w13_scale is not None
    a13, s13 = quantize_act_fp8(hidden) if act_fp8 else (hidden, None)
    # gate/up GEMM with SiLU-and-mul in its epilogue: [pairs, I], no gate_up tensor
    act = torch.empty((num_pairs, two_inter // 2), dtype=hidden.dtype, device=hidden.device)
    _moe_gemm(a13, w13, act, sorted_pairs, block_experts, weights, top_k, False, tiles, rowwise, gated=True,
              scale=w13_scale, direct=direct, expert_load=load, a_scale=s13)
    a2, s2 = quantize_act_fp8(act) if act_fp8 else (act, None)
    # Each pair's weighted output: float32 where the slots are returned or batch invariance asks for it, else
    # in hidden's dtype (half the bytes written and read again by the slot sum; a large prefill's sum was
    # 108 us a layer of V2-Lite at 4K tokens), as vLLM's fused MoE keeps it.
    alloc = torch.empty if reduce_slots else torch.zeros
    out = alloc((num_pairs, hidden_size), dtype=out_dtype, device=hidden.device)
    _moe_gemm(a2, w2, out, sorted_pairs, block_experts, weights, 1, True, tiles, rowwise,
              scale=w2_scale, direct=direct, a_scale=s2)
    return _pairs_result(out, kept, hidden, residual, top_k, reduce_slots)


def _pairs_result(out, kept, hidden, residual, top_k: int, reduce_slots: bool) -> torch.Tensor:
    """fused_moe_triton's result from the pairs' weighted rows ``out`` [T * k, H]: unsummed ([T, k, H]), or the
    k rows added in slot order in float32 (sum_slots' order, also outside batch-invariant mode), then cast,
    into a new tensor or added into ``residual``. kept: as :func:`_launch_slot_sum`'s."""
    num_tokens, hidden_size = hidden.shape
    if not reduce_slots:
        return out.view(num_tokens, top_k, hidden_size)
    result = torch.empty_like(hidden) if residual is None else residual
    _launch_slot_sum(out, kept, result, top_k, residual is not None, use_pdl(hidden))
    return result


# ----------------------------------------------------------------------------------------------------
# Large batches (prefill chunks): the expert-sorted pairs' rows gathered once into a contiguous copy, then
# both grouped GEMMs from torch's grouped GEMM (``torch.nn.functional.grouped_mm``: CUTLASS's warp-specialized,
# TMA-fed grouped kernel on Hopper), SiLU-and-mul between them, and the weighted slot sum reading each pair's
# row through its position in the sorted order. The Triton kernel above stays for small batches (decode), fp8
# weights, per-slot outputs and batch-invariant mode.
# ----------------------------------------------------------------------------------------------------
# Token count from which fused_moe takes the grouped-GEMM path on CUDA (bf16, SM90 or SM100): -1 = the device
# table's ``grouped_mm_from`` for the layer's shape (kernels.fused_moe_config; never where it has none),
# 0 = never, N > 0 = from N tokens whatever the table says (RAYINFER_MOE_GROUPED_MM_FROM; an A/B switch of
# jobs/bench_moe.py).
GROUPED_MM_FROM = envs.moe_grouped_mm_from()
# 1: the grouped-GEMM path's two GEMMs on TileLang programs (kernels.moe_tilelang: SwiGLU fused into the gate/up
# GEMM) where TileLang imports and the shapes suit them; 0: torch's grouped GEMM (jobs/bench_moe.py variant
# "moe-grouped-tilelang" sets 1). Off by default: slower than torch's on an H100 (V2-Lite's two GEMMs at 2048 tokens
# 717-824 us against 603; benchmarks/results/moe-tilelang-tiles-h100-d7722cd-partial.json)
GROUPED_TILELANG = 0
# A/B switch (jobs/bench_moe.py variant "moe-table-0"): 1 reads the device's table (kernels/configs/<device>.json)
# for the grouped GEMM's tiles ("entries") and the grouped-GEMM path's start ("grouped_mm_from"); 0 reads
# nothing of it: the heuristic tiles, and the grouped-GEMM path only where GROUPED_MM_FROM > 0 says so.
DEVICE_TABLE = 1
_GROUPED_MM_BLOCK_M = 16  # the alignment's padding: each expert's rows start 16-row aligned (32-byte offsets)


def _grouped_mm_op():
    """torch's grouped GEMM (``torch.nn.functional.grouped_mm``, ``torch._grouped_mm`` before 2.10), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def w8a8_applies(hidden: torch.Tensor) -> bool:
    """Whether fp8 experts multiply fp8 activations by default for ``hidden`` (:func:`fused_moe_triton`'s
    ``act_fp8=None``): a CUDA device with fp8 tensor cores (compute capability >= 8.9) and ``FP8_ACTIVATIONS``."""
    return bool(FP8_ACTIVATIONS) and has_fp8_tensor_cores(hidden)


def grouped_mm_applies(hidden: torch.Tensor, w13: torch.Tensor, fp8: bool = False, force: bool = False) -> bool:
    """Whether :func:`fused_moe` takes :func:`fused_moe_grouped_mm` for these tensors: bfloat16 weights and
    activations on a CUDA device of compute capability 9.x or 10.x (where torch runs its CUTLASS kernel; on
    others its fallback reads the group ends on the host, which CUDA graphs forbid), hidden and intermediate
    sizes multiples of 8, outside batch-invariant mode, with at least the tokens the device's table gives for
    the shape (``fused_moe_config.grouped_mm_from``, unless :data:`DEVICE_TABLE` is 0; or ``GROUPED_MM_FROM``
    when set). force: whether the path can run here at all, whatever the token count.

    Raises: ValueError if the device's table file is malformed."""
    if ((GROUPED_MM_FROM == 0 and not force) or fp8 or not hidden.is_cuda or is_batch_invariant()
            or not hidden.dtype == w13.dtype == torch.bfloat16 or _grouped_mm_op() is None
            or device_capability(hidden.device.index)[0] not in (9, 10)
            or w13.shape[1] % 16 or w13.shape[2] % 8):  # rows of 16-byte multiples (its TMA loads)
        return False
    if force:
        return True
    start = GROUPED_MM_FROM
    if start < 0 and not DEVICE_TABLE:
        return False
    if start < 0:
        start = grouped_mm_from(_device_name(hidden.device.index), w13.shape[0], w13.shape[1], w13.shape[2],
                                "bfloat16")
    return start is not None and hidden.shape[0] >= start


def fused_moe_grouped_mm(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: ExpertMap | None = None,
    expert_load: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    gemms: str | None = None,
) -> torch.Tensor:
    """:func:`fused_moe_ref`'s result through torch's grouped GEMM (no host sync; for large batches).

    The alignment (:func:`moe_align_triton`, 16-row padding) gives the expert-sorted pairs; their token rows
    are gathered into one [P, H] copy, whose expert e occupies rows ``offs[e-1] .. offs[e]`` (int32 group
    ends; the alignment writes them with each sorted row's token and each pair's sorted row).
    ``grouped_mm(rows, w13.mT, offs)`` -> [P, 2I], SiLU-and-mul -> [P, I], ``grouped_mm(act, w2.mT, offs)`` -> [P, H] in hidden's dtype; the slot sum then adds ``w * row`` of each of
    a token's kept pairs in slot order in float32 (each pair found through its position in the sorted order).
    Padding rows are computed and never read. Differs from :func:`fused_moe_triton` in where the routing
    weight is applied (after the down projection's rounding to hidden's dtype, not before it).

    ``gemms="tilelang"`` runs both GEMMs on :mod:`rayinfer.kernels.moe_tilelang`'s programs instead, SwiGLU fused
    into the first (no [P, 2I] intermediate); None takes them where :data:`GROUPED_TILELANG` is 1 and
    :func:`tilelang_gemms_apply`, else torch's.

    Args: as :func:`fused_moe_triton` (hidden and the weights floating point, not fp8; the Triton kernels
        run the alignment and the sum, so CPU tensors need the interpreter); gemms: "torch", "tilelang" or None.
    Returns:
        [T, H] in hidden's dtype (``residual``, updated in place, when given).
    Raises:
        ValueError: on inconsistent shapes or an unknown ``gemms``; RuntimeError when torch has no grouped GEMM.
    """
    _check_shapes(hidden, w13, w2, topk_ids, topk_weights)
    if gemms not in (None, "torch", "tilelang"):
        raise ValueError(f"gemms must be 'torch', 'tilelang' or None, not {gemms!r}")
    op = _grouped_mm_op()
    if op is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped GEMM (torch.nn.functional.grouped_mm)")
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    _check_residual(residual, hidden)
    result = torch.empty_like(hidden) if residual is None else residual
    if num_tokens == 0:
        return result.zero_() if residual is None else result
    num_pairs = num_tokens * top_k
    size = _aligned_size(num_pairs, num_experts, _GROUPED_MM_BLOCK_M)
    kept = torch.empty(num_pairs, dtype=torch.int8, device=hidden.device)
    # the alignment also writes the group ends, each sorted row's token (padding rows take token 0: computed,
    # never read) and each kept pair's sorted row
    offs = torch.empty(num_experts, dtype=torch.int32, device=hidden.device)
    rows = torch.empty(size, dtype=torch.int32, device=hidden.device)
    position = torch.empty(num_pairs, dtype=torch.int32, device=hidden.device)
    moe_align_triton(topk_ids, num_experts, _GROUPED_MM_BLOCK_M, expert_map, expert_load, kept,
                     grouped=(offs, rows, position))
    gathered = hidden.index_select(0, rows)
    if gemms == "tilelang" or (gemms is None and GROUPED_TILELANG and tilelang_gemms_apply(hidden, w13, w2)):
        from rayinfer.kernels.moe_tilelang import grouped_gemm_tilelang

        act = grouped_gemm_tilelang(gathered, w13, offs, silu_and_mul=True)
        out = grouped_gemm_tilelang(act, w2, offs, silu_and_mul=False)
    else:
        gate_up = op(gathered, w13.transpose(1, 2), offs=offs)
        act = silu_and_mul(gate_up)
        del gate_up
        out = op(act, w2.transpose(1, 2), offs=offs)
    _launch_slot_sum(out, kept, result, top_k, residual is not None, False,
                     positions=position, weights=topk_weights.reshape(-1).contiguous())
    return result


def tilelang_gemms_apply(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether :func:`fused_moe_grouped_mm` can run its GEMMs on TileLang here: TileLang importable with a CUDA
    device, a Hopper GPU (compute capability 9.x) and weight shapes its tiles divide."""
    from rayinfer.kernels.mla_tilelang import tilelang_available
    from rayinfer.kernels.moe_tilelang import grouped_gemm_applies

    return (hidden.is_cuda and tilelang_available() and device_capability(hidden.device.index)[0] == 9
            and grouped_gemm_applies(w13, True) and grouped_gemm_applies(w2, False))


def _triton_applies(hidden, w13, w2, topk_ids, topk_weights, fp8: bool = False) -> bool:
    weight_dtype = FP8_DTYPE if fp8 else hidden.dtype
    return (
        hidden.dim() == 2
        and w13.dtype == w2.dtype == weight_dtype
        and hidden.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and use_triton(hidden, w13, w2, topk_ids, topk_weights)
    )


@functools.lru_cache(maxsize=None)
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def fused_moe_tiles(hidden: torch.Tensor, w13: torch.Tensor, top_k: int) -> MoETileConfig:
    """The grouped GEMM's tiles for hidden [T, H] and w13 [E, 2I, H]: on CUDA the device's tuned table
    entry (``kernels.fused_moe_config``; fp8 weights have entries of their own, dtype
    ``float8_e4m3fn``), else (and in batch-invariant mode, or with :data:`DEVICE_TABLE` 0) the fixed heuristic."""
    device_name = _device_name(hidden.device.index) if hidden.is_cuda and DEVICE_TABLE else None
    num_experts, n, k = w13.shape
    dtype = str(w13.dtype if w13.dtype == FP8_DTYPE else hidden.dtype).removeprefix("torch.")
    return tile_config(device_name, num_experts, n, k, dtype, hidden.shape[0], top_k, is_batch_invariant())


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: ExpertMap | None = None,
    expert_load: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`fused_moe_ref`; the Triton grouped GEMM on CUDA tensors (64-row tiles
    whatever the batch in batch-invariant mode). In batch-invariant mode without Triton, the k outputs
    of :func:`fused_moe_slots_ref` are added in slot order, as expert parallelism adds them.

    expert_map: topk_ids are logical ids, computed by this rank's slots (:class:`ExpertMap`);
    expert_load: [L] int64 counters, += tokens routed to each logical expert (EPLB's load);
    w13_scale, w2_scale: fp8 experts (:func:`fused_moe_triton`; ``kernels.block_fp8`` quantizes them); the
    torch path dequantizes first;
    residual: [T, H] like hidden: the result is added into it in place and it is returned (the layer's
    residual add; one kernel less on the Triton path).
    Raises:
        ValueError: on inconsistent shapes, or scales that do not fit fp8 weights.
    """
    _check_scales(w13, w2, w13_scale, w2_scale)
    fp8 = w13_scale is not None
    if _triton_applies(hidden, w13, w2, topk_ids, topk_weights, fp8) and (residual is None or residual.is_contiguous()):
        if grouped_mm_applies(hidden, w13, fp8):
            return fused_moe_grouped_mm(hidden, w13, w2, topk_ids, topk_weights, expert_map, expert_load, residual)
        return fused_moe_triton(hidden, w13, w2, topk_ids, topk_weights, expert_map=expert_map,
                                expert_load=expert_load, w13_scale=w13_scale, w2_scale=w2_scale, residual=residual)
    if fp8:
        w13, w2 = _dequant_experts(w13, w2, w13_scale, w2_scale, hidden.dtype)
    topk_ids = _map_and_count(topk_ids, expert_map, expert_load)
    if is_batch_invariant():
        out = sum_slots(fused_moe_slots_ref(hidden, w13, w2, topk_ids, topk_weights)).to(hidden.dtype)
    else:
        out = fused_moe_ref(hidden, w13, w2, topk_ids, topk_weights)
    return out if residual is None else residual.add_(out)


def fused_moe_slots(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: ExpertMap | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`fused_moe_slots_ref` ([T, k, H] float32); the Triton grouped GEMM where
    :func:`fused_moe` takes it, with the same tiles, so that ``sum_slots(fused_moe_slots(...))`` cast to
    hidden's dtype is :func:`fused_moe`'s result bit for bit in batch-invariant mode (how expert
    parallelism combines the ranks' outputs then, ``model.moe.RoutedExperts``). expert_map, w13_scale,
    w2_scale: as :func:`fused_moe`."""
    _check_scales(w13, w2, w13_scale, w2_scale)
    fp8 = w13_scale is not None
    if _triton_applies(hidden, w13, w2, topk_ids, topk_weights, fp8):
        return fused_moe_triton(hidden, w13, w2, topk_ids, topk_weights, reduce_slots=False,
                                expert_map=expert_map, w13_scale=w13_scale, w2_scale=w2_scale)
    if fp8:
        w13, w2 = _dequant_experts(w13, w2, w13_scale, w2_scale, hidden.dtype)
    return fused_moe_slots_ref(hidden, w13, w2, _map_and_count(topk_ids, expert_map, None), topk_weights)
