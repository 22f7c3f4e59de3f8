"""Multi-head latent attention (MLA) over a compressed paged KV cache.

Glossary: R ``kv_lora_rank`` (width of the latent ``c_kv``), P ``qk_rope_head_dim`` (width of the
shared roped key ``k_pe``), Dn ``qk_nope_head_dim``, Dv ``v_head_dim``, H query heads. One layer's
cache is ``[num_blocks, block_size, R + P]``: per token the normalized latent, then the roped key,
written by slot mapping. Two ways to attend over it (DeepSeek-V2 paper, section 2.1):

- expanded (:func:`mla_prefill_ref`): ``kv_b_proj`` turns the context's latents into per-head keys
  and values, then ordinary attention; cheap when many queries share the context (prefill);
- absorbed (:func:`mla_decode`): the key up-projection is folded into the query
  (``q_latent = q_nope @ W_UK``) and the value up-projection applied after, so attention runs as
  multi-query attention straight over the latents (one shared "head" of width R + P, values of width
  R); cheap when few queries read a long context (decode).

In batch-invariant mode (``kernels.batch_invariant``) the model takes the absorbed form for every step
(``model.deepseek_v3``): its kernel computes each query token in a program of its own, reading the
token's keys in the same ``BLOCK_N`` tiles from position 0, masked alike, without split-KV, so a token's
row is the same bits in a prefill, an extend after a prefix hit or chunk, and a decode.

Kernels and grids. ``_mla_decode_kernel`` (absorbed form): grid (tokens, head tiles of ``BLOCK_H``,
KV splits); with one split a program writes its token's output, with several (split-KV, "flash
decoding": a batch-1 decode is otherwise one program on a 132-multiprocessor GPU) each writes a partial
output and log-sum-exp over its share of the keys and ``_mla_merge_splits_kernel`` (grid (tokens,
heads)) combines them; when the caller passes W_UV (``mla_decode(..., w_uv=)``) and the step has at most
``BATCHED_GEMV_MAX_ROWS`` tokens, ``_mla_merge_uv_kernel`` merges them inside that up-projection's GEMV. The split count comes from the launch shape and the longest context a CUDA
graph may replay (:func:`choose_num_splits`), never from the device's lengths, so the launch has no host
sync and captures; each token sizes its splits from its own length in the kernel. The model takes this
form for every step of short queries (:func:`use_absorbed`: decode, speculative verification), so
those steps are captured in CUDA graphs. ``_mla_prefill_kernel`` (expanded form, :func:`mla_prefill`):
grid (query tiles of ``BLOCK_M`` tokens of one request, heads), a varlen causal flash-attention over the
context latents gathered in one indexed read and up-projected in one GEMM; it needs the step's total
context length on the host, so it runs eagerly. The latent's norm, RoPE and store before attention are
one kernel of their own (``kernels.mla_rope``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayinfer import envs
from rayinfer.kernels._triton_utils import (device_sms, is_interpreting, pdl_launch, pdl_wait, tl, triton, use_pdl,
                                           use_triton)
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.batch_invariant import is_batch_invariant
from rayinfer.kernels.gemv import BATCHED_GEMV_MAX_ROWS, batched_linear
from rayinfer.kernels.paged_attention import _find_request


def store_mla_kv_ref(
    c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's latents and roped keys into one layer's compressed cache (in place).

    Args:
        c_kv: [T, R]; k_pe: [T, P]; cast to the cache's dtype.
        kv_cache: [num_blocks, block_size, R + P].
        slot_mapping: [T] int64, ``block_id * block_size + offset``; a negative slot skips the token.
    """
    block_size, rank = kv_cache.shape[1], c_kv.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, offsets, :rank] = c_kv[keep].to(kv_cache.dtype)
    kv_cache[blocks, offsets, rank:] = k_pe[keep].to(kv_cache.dtype)


@triton.jit
def _store_mla_kv_kernel(
    c_ptr, pe_ptr, cache_ptr, slot_ptr, stride_ct, stride_pt, stride_cb, stride_cs,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    c = tl.load(c_ptr + token * stride_ct + r, mask=r < RANK)
    pe = tl.load(pe_ptr + token * stride_pt + p, mask=p < ROPE)
    tl.store(dst + r, c.to(cache_ptr.dtype.element_ty), mask=r < RANK)
    tl.store(dst + RANK + p, pe.to(cache_ptr.dtype.element_ty), mask=p < ROPE)


def store_mla_kv(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as :func:`store_mla_kv_ref`; a Triton kernel on CUDA tensors (no host sync)."""
    if (
        c_kv.dim() == 2
        and k_pe.dim() == 2
        and kv_cache.stride(-1) == 1
        and use_triton(c_kv, k_pe, kv_cache, slot_mapping)
    ):
        if c_kv.shape[0] == 0:
            return
        c_kv = c_kv if c_kv.stride(-1) == 1 else c_kv.contiguous()
        k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
        rank, rope = c_kv.shape[1], k_pe.shape[1]
        _store_mla_kv_kernel[(c_kv.shape[0],)](
            c_kv, k_pe, kv_cache, slot_mapping, c_kv.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
            RANK=rank, ROPE=rope, BLOCK_R=triton.next_power_of_2(rank), BLOCK_P=triton.next_power_of_2(rope),
            BLOCK_SIZE=kv_cache.shape[1], num_warps=4,
        )
    else:
        store_mla_kv_ref(c_kv, k_pe, kv_cache, slot_mapping)


def _context(kv_cache: torch.Tensor, meta: AttentionMetadata, i: int) -> torch.Tensor:
    """Request i's cached rows in position order: [seq_len, R + P]."""
    block_size, seq_len = kv_cache.shape[1], meta.seq_lens_cpu[i]
    blocks = meta.block_tables[i, : (seq_len + block_size - 1) // block_size].long()
    return kv_cache[blocks].reshape(-1, kv_cache.shape[-1])[:seq_len]


def _causal_mask(q_len: int, seq_len: int, device) -> torch.Tensor:
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    return q_pos[:, None] >= torch.arange(seq_len, device=device)[None, :]


def mla_prefill_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_b_weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Expanded MLA: up-project each request's cached latents to keys and values, then causal attention.

    The new tokens' latents must already be in the cache. Same causal rule as ``paged_attention_ref``:
    query row j of request i sits at position ``seq_lens[i] - query_len_i + j``.

    Args:
        q_nope: [T, H, Dn]; q_pe: [T, H, P], roped.
        kv_cache: [num_blocks, block_size, R + P] (one layer).
        meta: the step's :class:`AttentionMetadata`.
        kv_b_weight: [H * (Dn + Dv), R], the ``kv_b_proj`` weight (per head: Dn key rows, then Dv value rows).
        scale: softmax scale.
    Returns:
        [T, H, Dv], q_nope's dtype.
    Source: DeepSeek-V2 (2024), eq. 9-19; Hugging Face ``DeepseekV3Attention`` (``expand_kv``).
    """
    num_tokens, num_heads, nope_dim = q_nope.shape
    rope_dim = q_pe.shape[-1]
    rank = kv_cache.shape[-1] - rope_dim
    v_dim = kv_b_weight.shape[0] // num_heads - nope_dim
    out = q_nope.new_empty((num_tokens, num_heads, v_dim))
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        ctx = _context(kv_cache, meta, i).to(q_nope.dtype)
        kv = F.linear(ctx[:, :rank], kv_b_weight).view(seq_len, num_heads, nope_dim + v_dim)
        k_nope, v = kv.split([nope_dim, v_dim], dim=-1)
        k = torch.cat([k_nope, ctx[:, None, rank:].expand(seq_len, num_heads, rope_dim)], dim=-1)
        q = torch.cat([q_nope[start : start + q_len], q_pe[start : start + q_len]], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=_causal_mask(q_len, seq_len, q.device), scale=scale,
        )
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def mla_decode_ref(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA: multi-query attention of every head straight over the cached latents (plain torch).

    Scores are ``scale * (q_latent . c_kv + q_pe . k_pe)``; the output is the softmax-weighted sum of
    latents (apply ``W_UV`` after). Causal as :func:`mla_prefill_ref`, so it serves any query length,
    though it pays off for decode.

    Args:
        q_latent: [T, H, R], ``q_nope`` times each head's key up-projection.
        q_pe: [T, H, P], roped.
        kv_cache: [num_blocks, block_size, R + P] (one layer).
        meta: the step's :class:`AttentionMetadata`.
        scale: softmax scale.
    Returns:
        [T, H, R], q_latent's dtype; accumulation in float32.
    Source: DeepSeek-V2 (2024), section 2.1.3 (absorbing W_UK and W_UV); FlashMLA's decode layout.
    """
    num_heads, rank = q_latent.shape[1], q_latent.shape[2]
    out = torch.empty_like(q_latent)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        ctx = _context(kv_cache, meta, i).float()
        q = torch.cat([q_latent[start : start + q_len], q_pe[start : start + q_len]], dim=-1).float().transpose(0, 1)
        k = ctx[None].expand(num_heads, seq_len, ctx.shape[-1])
        v = ctx[None, :, :rank].expand(num_heads, seq_len, rank)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_mask(q_len, seq_len, q.device), scale=scale)
        out[start : start + q_len] = o.transpose(0, 1).to(q_latent.dtype)
        start += q_len
    return out


# ----------------------------------------------------------------------------------------------------
# Triton kernel of the absorbed form. Program (t, g, s) computes query token t (its request found by a
# binary search of query_start_loc: no per-step index tensor) for a tile of BLOCK_H heads over split s of
# the token's keys; every head of the tile shares each latent tile read from the cache
# (MQA), streamed in BLOCK_N tokens through the block table with an online base-2 softmax
# (FlashAttention-2). With one split the program writes the output; with several (split-KV, "flash
# decoding") each writes its partial output and log-sum-exp and a second kernel merges them. The split
# count is a launch constant (from the batch shape and the longest context a graph may replay); each
# token sizes its splits in the kernel from its own length: it uses at most one split per
# MIN_SPLIT_TOKENS keys, and a split past those is empty (it writes log-sum-exp -inf and no partial
# output, and the merge skips it), so a short context in a graph sized for long ones does not pay for
# writing and merging partial outputs it does not need.
# In batch-invariant mode there is one split, so every tile takes the same path whatever the batch.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _request_of_token(query_start_loc_ptr, token, num_reqs):
    """The request owning batch row ``token``: the last i with ``query_start_loc[i] <= token`` (binary search)."""
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.zeros([], dtype=tl.int32) + num_reqs  # a tensor even when num_reqs is specialized to 1
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _mla_decode_kernel(
    ql_ptr, qp_ptr, cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    num_reqs, num_heads, num_splits, qk_scale,
    stride_lt, stride_lh, stride_pt, stride_ph, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr,
    ROWWISE: tl.constexpr = False, USE_SPLITS: tl.constexpr = False, MIN_SPLIT_TOKENS: tl.constexpr = 128,
    USE_PDL: tl.constexpr = False, SWAP_AB: tl.constexpr = False, SWAP_BLOCK_N: tl.constexpr = 64,
    SWAP_MIN_KEYS: tl.constexpr = 0, PREFETCH_INDEX: tl.constexpr = False, EARLY: tl.constexpr = False,
):
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    # EARLY: the program reads, before the PDL wait, what no kernel of this step writes: the step's metadata
    # and the block numbers of its first tile (a chain of dependent loads: the token's request, its length,
    # the split bounds, the block table), so that after the wait only the query and the cache rows are left.
    if not EARLY:
        pdl_wait(USE_PDL)
    req = _request_of_token(query_start_loc_ptr, token, num_reqs)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    kv_hi = tl.load(seq_lens_ptr + req) - (q_end - token) + 1  # own position + 1
    kv_lo = 0
    n_keys = kv_hi  # the token's keys over all its splits (SWAP_MIN_KEYS compares these)
    split = tl.program_id(2)
    h_ok = heads < num_heads
    t64 = token.to(tl.int64)
    if USE_SPLITS:
        # The launch's split count is sized for the longest context a graph may replay; a shorter one
        # uses only as many splits as give each MIN_SPLIT_TOKENS keys (whole BLOCK_N tiles), and the
        # splits past those write an empty log-sum-exp and nothing else (their partial output is never read).
        used = tl.minimum(num_splits, tl.maximum(tl.cdiv(kv_hi, MIN_SPLIT_TOKENS), 1))
        split_size = tl.cdiv(tl.cdiv(kv_hi, used), BLOCK_N) * BLOCK_N
        kv_lo = split * split_size
        kv_hi = tl.minimum(kv_hi, kv_lo + split_size)
        if kv_lo >= kv_hi:
            if EARLY:
                pdl_wait(USE_PDL)
            part = (t64 * num_heads + heads) * num_splits + split
            tl.store(part_lse_ptr + part, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=h_ok)
            return
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    # PREFETCH_INDEX: each tile's block numbers come from a load of the iteration before (see _mla_decode_keys);
    # the first tile's here
    n_first = kv_lo + tl.arange(0, BLOCK_N)
    blk_first = tl.load(table + n_first // KV_BLOCK_SIZE, mask=(n_first < kv_hi) & PREFETCH_INDEX, other=0)
    if EARLY:
        pdl_wait(USE_PDL)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    r_ok = r < RANK
    p_ok = p < ROPE
    ql = tl.load(ql_ptr + t64 * stride_lt + heads[:, None] * stride_lh + r[None, :],
                 mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    qp = tl.load(qp_ptr + t64 * stride_pt + heads[:, None] * stride_ph + p[None, :],
                 mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    use_swap = False
    if SWAP_AB:
        use_swap = n_keys >= SWAP_MIN_KEYS  # per token: all its splits take the same path
    if use_swap:
        # keys as the products' M dimension (S^T = K Q^T, O^T += V^T P^T): a 64-key tile fills Hopper's 64-row
        # warpgroup MMA, which a 16-head tile as M cannot (mma.sync's 16 rows)
        acc_t, m_i, l_i = _mla_decode_swap_ab(tl.trans(ql), tl.trans(qp), cache_ptr, table, kv_lo, kv_hi, qk_scale,
                                              stride_cb, stride_cs, m_i, l_i, RANK, ROPE, BLOCK_R, BLOCK_P, BLOCK_H,
                                              SWAP_BLOCK_N, KV_BLOCK_SIZE, IEEE)
        acc = tl.trans(acc_t)
    else:
        acc, m_i, l_i = _mla_decode_keys(ql, qp, cache_ptr, table, kv_lo, kv_hi, blk_first, qk_scale, stride_cb,
                                         stride_cs, m_i, l_i, RANK, ROPE, BLOCK_R, BLOCK_P, BLOCK_H, BLOCK_N,
                                         KV_BLOCK_SIZE, IEEE, ROWWISE, PREFETCH_INDEX)
    if USE_SPLITS:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split: weight 0 in the merge
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        part = (t64 * num_heads + heads) * num_splits + split  # [T, H, num_splits] row-major
        tl.store(part_lse_ptr + part, lse, mask=h_ok)
        tl.store(part_out_ptr + part[:, None] * BLOCK_R + r[None, :], acc / l_safe[:, None],
                 mask=h_ok[:, None] & r_ok[None, :])
    else:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + r[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])


@triton.jit
def _mla_decode_keys(ql, qp, cache_ptr, table, kv_lo, kv_hi, blk_first, qk_scale, stride_cb, stride_cs, m_i, l_i,
                     RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr,
                     ROWWISE: tl.constexpr, PREFETCH_INDEX: tl.constexpr):
    """The key loop of ``_mla_decode_kernel`` with heads as rows: ql [BLOCK_H, BLOCK_R], qp [BLOCK_H, BLOCK_P];
    returns (acc [BLOCK_H, BLOCK_R] float32, m_i, l_i) of the online base-2 softmax over keys [kv_lo, kv_hi).
    blk_first: with PREFETCH_INDEX, the block numbers of the first tile's keys (loaded by the caller)."""
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    r_ok = r < RANK
    p_ok = p < ROPE
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    # PREFETCH_INDEX: a tile's block numbers come from a load of the iteration before (loop-carried), so its
    # cache loads never wait on its own block-table load and the compiler's pipeline keeps them in flight
    blk_next = blk_first
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_hi
        if PREFETCH_INDEX:
            blk = blk_next
            blk_next = tl.load(table + (n + BLOCK_N) // KV_BLOCK_SIZE, mask=n + BLOCK_N < kv_hi, other=0)
        else:
            blk = tl.load(table + n // KV_BLOCK_SIZE, mask=n_ok, other=0)
        rows = blk.to(tl.int64) * stride_cb + (n % KV_BLOCK_SIZE) * stride_cs
        kl = tl.load(cache_ptr + rows[:, None] + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        kp = tl.load(cache_ptr + rows[:, None] + RANK + p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0.0)
        if ROWWISE:  # batch-invariant mode under the interpreter (see ROWWISE in kernels._triton_utils)
            s = (tl.sum(ql.to(tl.float32)[:, :, None] * tl.trans(kl).to(tl.float32)[None, :, :], 1)
                 + tl.sum(qp.to(tl.float32)[:, :, None] * tl.trans(kp).to(tl.float32)[None, :, :], 1))
        elif IEEE:
            s = tl.dot(ql, tl.trans(kl), input_precision="ieee") + tl.dot(qp, tl.trans(kp), input_precision="ieee")
        else:
            s = tl.dot(ql, tl.trans(kl)) + tl.dot(qp, tl.trans(kp))
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the tile's first key (start < kv_hi) is visible
        prob = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(prob, 1)
        if ROWWISE:
            acc = acc * alpha[:, None] + tl.sum(prob[:, :, None] * kl.to(tl.float32)[None, :, :], 1)
        elif IEEE:
            acc = acc * alpha[:, None] + tl.dot(prob, kl, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(prob.to(kl.dtype), kl)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _mla_decode_swap_ab(ql_t, qp_t, cache_ptr, table, kv_lo, kv_hi, qk_scale, stride_cb, stride_cs, m_i, l_i,
                        RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr):
    """The key loop of ``_mla_decode_kernel`` with keys as rows: ql_t [BLOCK_R, BLOCK_H], qp_t [BLOCK_P, BLOCK_H];
    returns (acc^T [BLOCK_R, BLOCK_H] float32, m_i, l_i), the same online softmax along axis 0."""
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    acc_t = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_hi
        blk = tl.load(table + n // KV_BLOCK_SIZE, mask=n_ok, other=0)
        rows = blk.to(tl.int64) * stride_cb + (n % KV_BLOCK_SIZE) * stride_cs
        kl = tl.load(cache_ptr + rows[:, None] + r[None, :], mask=n_ok[:, None] & (r < RANK)[None, :], other=0.0)
        kp = tl.load(cache_ptr + rows[:, None] + RANK + p[None, :], mask=n_ok[:, None] & (p < ROPE)[None, :], other=0.0)
        if IEEE:
            s_t = tl.dot(kl, ql_t, input_precision="ieee") + tl.dot(kp, qp_t, input_precision="ieee")
        else:
            s_t = tl.dot(kl, ql_t) + tl.dot(kp, qp_t)
        s_t = tl.where(n_ok[:, None], s_t * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        prob_t = tl.exp2(s_t - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(prob_t, 0)
        if IEEE:
            acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(kl), prob_t, input_precision="ieee")
        else:
            acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(kl), prob_t.to(kl.dtype))
        m_i = m_new
    return acc_t, m_i, l_i


@triton.jit
def _mla_merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_heads, num_splits, stride_ot, stride_oh,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Program (t, h, c): out[t, h, c * BLOCK_C ...] = sum_s w_s * part_out_s / sum_s w_s with
    w_s = 2^(lse_s - max lse), all splits' [BLOCK_C] slices in one [BLOCK_S, BLOCK_C] tile (one round of
    loads; a loop over the splits was one dependent load per split, 4.8 us a layer at batch 1)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    pdl_wait(USE_PDL)
    acc = _merged_splits(part_out_ptr, part_lse_ptr, (token * num_heads + head) * num_splits, num_splits, cols,
                         cols < RANK, BLOCK_R, BLOCK_S)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + cols, acc.to(out_ptr.dtype.element_ty),
             mask=cols < RANK)


@triton.jit
def _merged_splits(part_out_ptr, part_lse_ptr, base, num_splits, cols, col_ok, BLOCK_R: tl.constexpr,
                   BLOCK_S: tl.constexpr):
    """The split-KV merge of one (token, head) at columns ``cols``, float32: sum_s w_s * part_out_s / sum_s w_s
    with w_s = 2^(lse_s - max lse) over the rows ``base .. base + num_splits`` of the partials. The partials
    load beside the log-sum-exps, not after them: an unused or empty split's row (never written) is dropped
    after the load."""
    splits = tl.arange(0, BLOCK_S)
    lse = tl.load(part_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    part = tl.load(part_out_ptr + (base + splits)[:, None] * BLOCK_R + cols[None, :],
                   mask=(splits < num_splits)[:, None] & col_ok[None, :], other=0.0)
    part = tl.where((lse > float("-inf"))[:, None], part, 0.0)
    m = tl.max(lse, 0)  # finite: the split holding the token's own position is never empty
    w = tl.exp2(lse - m)  # 0 for an unused or empty split
    return tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)


@triton.jit
def _mla_merge_uv_kernel(
    part_out_ptr, part_lse_ptr, w_ptr, y_ptr, num_heads, num_splits, V,
    stride_wh, stride_wn, stride_yt, stride_yh,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Program (t, h, c): the split merge of ``_mla_merge_splits_kernel`` for token t and head h (all R
    columns, rounded to the output dtype as that kernel stores them), then
    y[t, h, c * BLOCK_N ...] = w[h, those rows] @ merged, in float32. The [BLOCK_N, R] weight tile is
    requested before the PDL wait (no kernel writes weights during a step), so it streams while the
    decode kernel runs; every column program of a head merges the head's partials again (from L2)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    n_ok = ns < V
    r_ok = r < RANK
    w = tl.load(w_ptr + head.to(tl.int64) * stride_wh + ns[:, None].to(tl.int64) * stride_wn + r[None, :],
                mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    pdl_wait(USE_PDL)
    x = _merged_splits(part_out_ptr, part_lse_ptr, (token * num_heads + head) * num_splits, num_splits, r, r_ok,
                       BLOCK_R, BLOCK_S)
    x = x.to(y_ptr.dtype.element_ty).to(tl.float32)  # rounded as the merge kernel stores it
    acc = tl.sum(w.to(tl.float32) * x[None, :], 1)
    tl.store(y_ptr + token * stride_yt + head * stride_yh + ns, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


_MAX_SPLITS = 32
# Up to BATCHED_GEMV_MAX_ROWS tokens, 16-bit: the split-KV merge runs in the prologue of the absorbed W_UV
# GEMV (``_mla_merge_uv_kernel``, one launch instead of the merge and the batched GEMV); 0: apart (an A/B
# variant of jobs/bench_moe.py). MERGE_UV_BLOCK_N: W_UV rows a program.
MERGE_IN_UV = 1
MERGE_UV_BLOCK_N = 32
# Every step (not in batch-invariant mode): each program reads the step's metadata and its first tile's block
# numbers before the PDL wait (``EARLY`` of ``_mla_decode_kernel``); 0: after it (an A/B variant of jobs/bench_moe.py)
EARLY_META = 1
# 0: the decode tiles before 9950a61 (each tile's block numbers loaded in its own iteration, 2 stages, 16-key
# tiles up to 4 tokens); an A/B variant of jobs/bench_moe.py
PREFETCH_INDEX = 1
_MIN_SPLIT_TOKENS = 64
# Up to 4 tokens a step: the tokens with at least this many keys take the swapped 64-key tiles (``swap_ab`` of
# mla_decode_triton's config), the others the 16-key ones; 0: none do. Off: on the H200 (742e567) the kernel
# with both paths gains at batch 1 from 4K keys (20.2 -> 16.4 us at 4K, 35.1 -> 25.7 at 8K) but costs 0.7-2 us
# at shorter contexts, and the V2-Lite decode step at 4096 went 2.457 -> 2.381 ms at batch 1 and at 1K
# 2.214 -> 2.270 ms (benchmarks/results/moe-v2lite-h200-742e567-swap-ab-*.json).
FEW_TOKEN_SWAP_FROM = 0


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Split-KV factor of :func:`mla_decode_triton`: at most two programs per multiprocessor (one full
    wave), at least ``_MIN_SPLIT_TOKENS`` keys per split, at most ``_MAX_SPLITS``.

    The decode kernel's deep tiles fit two programs on an H200 multiprocessor, so a launch of ``P * s``
    programs runs in ``ceil(P * s / (2 * SMs))`` waves: rounding the split factor up past one wave leaves the
    second wave nearly empty. Measured (``benchmarks/kernels.py --only-sweeps mla_splits``, V2-Lite's
    16 heads, 4K context): batch 32 takes 68.8 us with 8 splits against 80.8 with 9, batch 64 126.5 us with 4
    against 174.0 with 5, batch 128 226.6 us with 2 against 292.9 with 3; 256 programs is the best launch
    at each.

    Args:
        num_programs: programs without splitting (tokens x head tiles).
        max_seq_len: bound on every context length (a CUDA graph passes the longest it will replay).
        num_sms: multiprocessors of the device.
    Returns:
        the split count, >= 1; it depends on the arguments only (never on the device's lengths).
    Source: split-KV decoding ("Flash-Decoding", Dao et al. 2023); the tile rule of ``paged_attention``.
    """
    if num_programs >= 2 * num_sms or max_seq_len < 2 * _MIN_SPLIT_TOKENS:
        return 1
    want = (2 * num_sms) // num_programs  # whole programs per wave slot: never a second, near-empty wave
    return max(1, min(want, max_seq_len // _MIN_SPLIT_TOKENS, _MAX_SPLITS))


def mla_decode_triton(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    num_splits: int | None = None, max_seq_len: int | None = None, config: dict | None = None,
    w_uv: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton kernel of :func:`mla_decode_ref` (same contract; no host sync; ``config`` overrides the
    tiles: block_h, block_n, num_warps, num_stages, min_split_tokens; prefetch_index: each tile's block
    numbers loaded an iteration ahead; early: each program's metadata and first block numbers read before the
    PDL wait (``EARLY_META``); swap_ab: keys as the products' rows in
    swap_block_n tiles, for Hopper's 64-row warpgroup MMA, for the tokens with at least swap_min_keys keys
    (the others take the block_n tiles); ignored in batch-invariant mode).

    Args:
        num_splits: split-KV factor; by default :func:`choose_num_splits` of the batch shape. Always 1 in
            batch-invariant mode (``kernels.batch_invariant``): a split count that depends on the batch
            would change a token's result with its companions.
        max_seq_len: bound on every ``seq_lens`` entry (default ``meta.max_seq_len``, which a captured
            graph's metadata sets to ``max_model_len``); it picks the split count baked into the launch.
        w_uv: the value up-projection [H, Dv, R] (any strides but R's stride 1): then the result is
            ``out[t, h] @ w_uv[h].T``, [T, H, Dv] (:func:`mla_decode`'s ``w_uv``); a split step of at most
            ``BATCHED_GEMV_MAX_ROWS`` 16-bit tokens merges its splits in that GEMV's launch
            (``_mla_merge_uv_kernel``, ``MERGE_IN_UV``).
    Raises:
        ValueError: for ``num_splits`` < 1.
    """
    num_tokens, num_heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    out = torch.empty((num_tokens, num_heads, rank), dtype=q_latent.dtype, device=q_latent.device)
    if num_tokens == 0 or meta.num_reqs == 0:
        return out
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    block_r = max(16, triton.next_power_of_2(rank))
    # Tiles from the H200 sweeps (benchmarks/kernels.py --only-sweeps mla_tiles / mla_splits; V2-Lite's 16 heads x
    # 576, cache blocks of 16, a graph sized for 8K keys; benchmarks/README.md, seventh and fourteenth rounds).
    # Splits: up to 4 tokens of at least 32 keys (a batch-1 step at 1K context takes 32 splits of 32 keys; splits
    # of 128 keys were latency-bound by each split's serial tiles), more tokens of at least 64 (one wave:
    # choose_num_splits). Tiles: 32 keys, 4 warps, 3 stages, each tile's block numbers loaded an iteration
    # ahead (prefetch_index; PREFETCH_INDEX = 0 gives the set before 9950a61: 16-key tiles up to 4 tokens, 2
    # stages, the table loaded in the tile's own iteration). The latent reads at 4K context went from 52 / 57 /
    # 66% of the copy bandwidth to 61 / 68 / 79% at batch 32 / 64 / 128, batch 8 29 -> 37%, batch 1 20.2 -> 13.1
    # us a layer (1K: 8.6 -> 8.0), batch 4 23.1 -> 16.6 us, where a kernel doing only the old set's loads (no
    # math) reached 55-61% (benchmarks/probe/mla_decode_loads.py, results/mla-decode-*-h200-*.json).
    # Batch-invariant mode always takes the second split rule: a token's tiles must not depend on its companions.
    invariant = is_batch_invariant()
    few = num_tokens <= 4 and not invariant
    wide = block_r >= 512
    ahead = bool(PREFETCH_INDEX)
    cfg = {"block_h": 16 if block_r >= 256 else max(16, min(32, triton.next_power_of_2(num_heads))),  # acc [H, R] fp32
           "block_n": 16 if wide and few and not ahead else 32, "num_warps": 4, "num_stages": 3 if ahead else 2,
           "prefetch_index": ahead, "min_split_tokens": 64 if wide and not few else 32,
           "swap_ab": few and FEW_TOKEN_SWAP_FROM > 0, "swap_block_n": 64, "swap_min_keys": FEW_TOKEN_SWAP_FROM,
           "early": bool(EARLY_META), **(config or {})}
    block_h, block_n = cfg["block_h"], cfg["block_n"]
    head_tiles = triton.cdiv(num_heads, block_h)
    max_seq_len = max(max_seq_len or meta.max_seq_len, 1)
    if invariant:
        num_splits = 1
    elif num_splits is None:
        num_splits = choose_num_splits(num_tokens * head_tiles, max_seq_len, device_sms(q_latent))
    num_splits = max(1, min(num_splits, triton.cdiv(max_seq_len, block_n)))
    use_splits = num_splits > 1
    if use_splits:
        part_out = torch.empty((num_tokens, num_heads, num_splits, block_r), dtype=torch.float32,
                               device=q_latent.device)
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q_latent.device)
    else:
        part_out = part_lse = out  # unused
    pdl = pdl_launch(use_pdl(q_latent))
    _mla_decode_kernel[(num_tokens, head_tiles, num_splits)](
        q_latent, q_pe, kv_cache, out, part_out, part_lse,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        meta.num_reqs, num_heads, num_splits, scale * 1.4426950408889634,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), meta.block_tables.stride(0),
        RANK=rank, ROPE=rope, BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=block_h, BLOCK_N=block_n, KV_BLOCK_SIZE=kv_cache.shape[1], IEEE=q_latent.dtype == torch.float32,
        ROWWISE=invariant and is_interpreting(), USE_SPLITS=use_splits, MIN_SPLIT_TOKENS=cfg["min_split_tokens"],
        SWAP_AB=bool(cfg["swap_ab"]) and not invariant, SWAP_BLOCK_N=cfg["swap_block_n"],
        SWAP_MIN_KEYS=cfg["swap_min_keys"], PREFETCH_INDEX=bool(cfg["prefetch_index"]),
        EARLY=bool(cfg["early"]) and not invariant,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl,
    )
    if use_splits and w_uv is not None and merge_in_uv(q_latent, w_uv):
        v_dim = w_uv.shape[1]
        y = torch.empty((num_tokens, num_heads, v_dim), dtype=q_latent.dtype, device=q_latent.device)
        block_n = min(MERGE_UV_BLOCK_N, max(16, triton.next_power_of_2(v_dim)))
        _mla_merge_uv_kernel[(num_tokens, num_heads, triton.cdiv(v_dim, block_n))](
            part_out, part_lse, w_uv, y, num_heads, num_splits, v_dim, w_uv.stride(0), w_uv.stride(1),
            y.stride(0), y.stride(1), RANK=rank, BLOCK_R=block_r, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_N=block_n, num_warps=8, **pdl,
        )
        return y
    if use_splits:
        block_c = min(block_r, 128)
        _mla_merge_splits_kernel[(num_tokens, num_heads, triton.cdiv(rank, block_c))](
            part_out, part_lse, out, num_heads, num_splits, out.stride(0), out.stride(1),
            RANK=rank, BLOCK_R=block_r, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_C=block_c, num_warps=4,
            **pdl,
        )
    return out if w_uv is None else _times_uv(out, w_uv)


def merge_in_uv(q_latent: torch.Tensor, w_uv: torch.Tensor) -> bool:
    """Whether a split step's merge may run in the W_UV GEMV's launch (``MERGE_IN_UV``): at most
    ``BATCHED_GEMV_MAX_ROWS`` tokens of 16-bit queries and weights, R contiguous in ``w_uv``."""
    return (bool(MERGE_IN_UV) and q_latent.shape[0] <= BATCHED_GEMV_MAX_ROWS and w_uv.stride(-1) == 1
            and q_latent.dtype in (torch.float16, torch.bfloat16) and w_uv.dtype == q_latent.dtype)


def _times_uv(out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """out [T, H, R], w_uv [H, Dv, R] -> [T, H, Dv]: per head ``out[:, h] @ w_uv[h].T`` (``batched_linear``)."""
    return batched_linear(out.transpose(0, 1), w_uv).transpose(0, 1)


ABSORBED_MAX_QUERY_LEN = 16


def use_absorbed(meta: AttentionMetadata) -> bool:
    """Whether a step attends in the absorbed form (:func:`mla_decode`) rather than the expanded one.

    True when every request computes at most ``ABSORBED_MAX_QUERY_LEN`` new tokens (decode,
    speculative verification of the last token plus its drafts, short extends), or in batch-invariant
    mode (every step). Decided from the host list of query lengths, which a captured CUDA graph's
    metadata fixes to the graph's query length, so a captured step always takes the same branch. The
    absorbed kernel reads every length on the device, so such steps can be captured; the expanded
    reference slices the context by host-side lengths and cannot.
    """
    return meta.max_query_len <= ABSORBED_MAX_QUERY_LEN or is_batch_invariant()


# RAYINFER_MLA_BACKEND=auto: steps of at least this many tokens take TileLang's keys-as-rows tiles where they
# apply. On an H100 (benchmarks/results/kernels-mla-rows-h100-d8fb51d.json, V2-Lite's 16 heads, 4K context) they
# read 74.1 / 87.7 / 97.9% of the copy bandwidth at batch 32 / 64 / 128 against the Triton kernel's 71.3 / 78.6 /
# 89.5%, and lose below (batch 1 at 1K: 13.6 us against 7.1). In the V2-Lite decode step (CUDA graph, 4K;
# moe-v2lite-h100-0f5221c-mla-auto-ab-4k.json) batch 32 was 1.4% slower with them, batch 64 0.3% and batch
# 128 2.2% faster.
TILELANG_FROM_TOKENS = 64


def _tilelang_applies(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    backend = envs.mla_backend()
    if backend == "triton" or is_batch_invariant() or not q_latent.is_cuda:
        return False
    from rayinfer.kernels.mla_tilelang import keys_as_rows_applies, tilelang_available

    if backend == "auto" and not (tilelang_available() and q_latent.shape[0] >= TILELANG_FROM_TOKENS
                                  and keys_as_rows_applies(q_latent.shape[1], kv_cache.shape[1])):
        return False
    if not tilelang_available():
        raise RuntimeError("RAYINFER_MLA_BACKEND=tilelang needs the tilelang package and a CUDA device")
    return (q_latent.dtype in (torch.float16, torch.bfloat16) and q_latent.dtype == q_pe.dtype == kv_cache.dtype
            and q_latent.shape[-1] % 16 == 0 and q_pe.shape[-1] % 16 == 0 and kv_cache.stride(-1) == 1)


def mla_decode(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    w_uv: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`mla_decode_ref`; the Triton kernel on CUDA tensors, or the TileLang one
    (``kernels.mla_tilelang``) when ``RAYINFER_MLA_BACKEND=tilelang`` and the shapes suit it (16-bit,
    R and P multiples of 16, not batch-invariant mode), or with ``RAYINFER_MLA_BACKEND=auto`` for steps of
    at least :data:`TILELANG_FROM_TOKENS` tokens that its keys-as-rows tiles take.

    ``w_uv`` (the absorbed form's value up-projection, [H, Dv, R]): when given, the result is each head's
    output through it, [T, H, Dv] (``out[t, h] @ w_uv[h].T``, as :func:`~rayinfer.kernels.gemv.batched_linear`
    computes it); the Triton path merges a batch-1-sized step's splits inside that product's launch.

    Raises:
        RuntimeError: when the TileLang backend is asked for but tilelang or CUDA is missing.
    """
    if _tilelang_applies(q_latent, q_pe, kv_cache):
        from rayinfer.kernels.mla_tilelang import mla_decode_tilelang

        out = mla_decode_tilelang(q_latent, q_pe, kv_cache, meta, scale)
        return out if w_uv is None else _times_uv(out, w_uv)
    if (
        q_latent.dim() == 3
        and kv_cache.dim() == 3
        and q_latent.dtype == q_pe.dtype == kv_cache.dtype
        and q_latent.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and kv_cache.stride(-1) == 1
        and q_latent.shape[-1] + q_pe.shape[-1] == kv_cache.shape[-1]
        and use_triton(q_latent, q_pe, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    ):
        return mla_decode_triton(q_latent, q_pe, kv_cache, meta, scale, w_uv=w_uv)
    out = mla_decode_ref(q_latent, q_pe, kv_cache, meta, scale)
    return out if w_uv is None else _times_uv(out, w_uv)


# ----------------------------------------------------------------------------------------------------
# Triton path of the expanded form, without a loop over requests: every request's context latents in one
# indexed read (the index built on the device from the block tables and lengths), one ``kv_b_proj``
# up-projection of all of them, then a varlen causal flash-attention kernel. Program (i, h) computes a tile
# of BLOCK_M query tokens of one request (``paged_attention._find_request``) for head h: keys are the
# request's rows of the up-projected context (per-head k_nope and v) with the shared roped key k_pe
# read straight from the gathered latents (never expanded per head), streamed in BLOCK_N tiles with an
# online base-2 softmax (FlashAttention-2). A query at position p sees its request's keys 0..p, so
# chunks after a cached prefix and prefix-cache hits need nothing special.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _mla_prefill_kernel(
    qn_ptr, qp_ptr, kv_ptr, lat_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, kv_start_loc_ptr,
    num_reqs, qk_scale,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_kvs, stride_kvh, stride_ls, stride_ot, stride_oh,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V_DIM: tl.constexpr, RANK: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, REVERSE: tl.constexpr = False,
):
    head = tl.program_id(0)  # heads vary fastest: the heads of one query tile run side by side
    program = tl.program_id(1)
    if REVERSE:  # the last (longest, under the causal mask) query tiles first: no long tail at the end
        program = tl.num_programs(1) - 1 - program
    req = _find_request(query_start_loc_ptr, program, num_reqs, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    tile_first = (program - (q_start // BLOCK_M + req)) * BLOCK_M
    if tile_first >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + req) - q_len
    kv_row0 = tl.load(kv_start_loc_ptr + req).to(tl.int64)
    tok = tile_first + tl.arange(0, BLOCK_M)
    row_ok = tok < q_len
    q_rows = (q_start + tok).to(tl.int64)
    q_pos = ctx_len + tok
    dn = tl.arange(0, BLOCK_DN)
    dp = tl.arange(0, BLOCK_P)
    dv = tl.arange(0, BLOCK_DV)
    dn_ok, dp_ok, dv_ok = dn < NOPE, dp < ROPE, dv < V_DIM
    qn = tl.load(qn_ptr + q_rows[:, None] * stride_qnt + head * stride_qnh + dn[None, :],
                 mask=row_ok[:, None] & dn_ok[None, :], other=0.0)
    qp = tl.load(qp_ptr + q_rows[:, None] * stride_qpt + head * stride_qph + dp[None, :],
                 mask=row_ok[:, None] & dp_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    kv_hi = ctx_len + tl.minimum(q_len, tile_first + BLOCK_M)  # the tile's last position + 1
    kv_head = kv_ptr + head.to(tl.int64) * stride_kvh
    # keys before the tile's first position are visible to all its rows: whole tiles of them run unmasked
    full_hi = (ctx_len + tile_first + 1) // BLOCK_N * BLOCK_N
    for start in range(0, full_hi, BLOCK_N):
        rows = kv_row0 + start + tl.arange(0, BLOCK_N)
        kn = tl.load(kv_head + rows[:, None] * stride_kvs + dn[None, :], mask=dn_ok[None, :], other=0.0)
        kp = tl.load(lat_ptr + rows[:, None] * stride_ls + RANK + dp[None, :], mask=dp_ok[None, :], other=0.0)
        v = tl.load(kv_head + rows[:, None] * stride_kvs + NOPE + dv[None, :], mask=dv_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(qn, tl.trans(kn), input_precision="ieee") + tl.dot(qp, tl.trans(kp), input_precision="ieee")
        else:
            s = tl.dot(qn, tl.trans(kn)) + tl.dot(qp, tl.trans(kp))
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        prob = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(prob, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(prob, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v)
        m_i = m_new
    for start in range(full_hi, kv_hi, BLOCK_N):  # the diagonal tiles, masked
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_hi
        rows = kv_row0 + n
        kn = tl.load(kv_head + rows[:, None] * stride_kvs + dn[None, :], mask=n_ok[:, None] & dn_ok[None, :],
                     other=0.0)
        kp = tl.load(lat_ptr + rows[:, None] * stride_ls + RANK + dp[None, :], mask=n_ok[:, None] & dp_ok[None, :],
                     other=0.0)
        v = tl.load(kv_head + rows[:, None] * stride_kvs + NOPE + dv[None, :], mask=n_ok[:, None] & dv_ok[None, :],
                    other=0.0)
        if IEEE:
            s = tl.dot(qn, tl.trans(kn), input_precision="ieee") + tl.dot(qp, tl.trans(kp), input_precision="ieee")
        else:
            s = tl.dot(qn, tl.trans(kn)) + tl.dot(qp, tl.trans(kp))
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row sees no key: no inf - inf
        prob = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(prob, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(prob, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dv_ok[None, :])


def gather_mla_context(kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's cached rows in position order, requests one after another, in one indexed read.

    Args:
        kv_cache: [num_blocks, block_size, R + P] (one layer).
        meta: the step's metadata; the total ``sum(seq_lens)`` comes from its host list (no host sync).
    Returns:
        (latents [sum(seq_lens), R + P] in the cache's dtype, kv_start_loc [B + 1] int32: request i's rows
        are ``kv_start_loc[i]:kv_start_loc[i + 1]``).
    """
    dev, block_size = kv_cache.device, kv_cache.shape[1]
    key = ("mla_context", block_size, dev)
    if key not in meta.derived:  # the rows to read are the same in every layer: computed once a step
        total = sum(meta.seq_lens_cpu)
        seq_lens = meta.seq_lens.long()
        kv_start_loc = torch.zeros(meta.num_reqs + 1, dtype=torch.long, device=dev)
        torch.cumsum(seq_lens, 0, out=kv_start_loc[1:])
        req = torch.repeat_interleave(torch.arange(meta.num_reqs, device=dev), seq_lens, output_size=total)
        pos = torch.arange(total, device=dev) - kv_start_loc[req]
        slots = meta.block_tables.long()[req, pos // block_size] * block_size + pos % block_size
        meta.derived[key] = (slots, kv_start_loc.to(torch.int32))
    slots, kv_start_loc = meta.derived[key]
    return kv_cache.view(-1, kv_cache.shape[-1])[slots], kv_start_loc


_MAX_GATHER_ROWS = 65536  # context rows up-projected at once: [rows, H * (Dn + Dv)] (512 MiB at V2-Lite, bf16)


def _request_groups(seq_lens: list[int], max_rows: int) -> list[tuple[int, int]]:
    """Consecutive request ranges [i, j) whose contexts sum to at most ``max_rows`` (a longer one alone)."""
    groups, first, rows = [], 0, 0
    for i, s in enumerate(seq_lens):
        if i > first and rows + s > max_rows:
            groups.append((first, i))
            first, rows = i, 0
        rows += s
    groups.append((first, len(seq_lens)))
    return groups


def mla_prefill_triton(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
    kv_b_weight: torch.Tensor, scale: float, config: dict | None = None,
) -> torch.Tensor:
    """Triton path of :func:`mla_prefill_ref` (same contract; no host sync, no loop over requests;
    ``config`` overrides the kernel's tiles: block_m, block_n, num_warps, num_stages, reverse).

    Reads the context's latents with :func:`gather_mla_context`, up-projects them in one GEMM
    (``kv_b_proj``: [S, R] -> [S, H, Dn + Dv]) and runs ``_mla_prefill_kernel``, a varlen causal
    flash-attention over q [T, H, Dn + P], k [S, H, Dn + P] (k_pe shared by the heads), v [S, H, Dv].
    The up-projected context is transient memory: steps whose contexts sum to more than
    ``_MAX_GATHER_ROWS`` tokens run in groups of consecutive requests (one pass each).
    Source: DeepSeek-V2 (2024) eq. 9-19; FlashAttention-2 (Dao 2023) for the kernel.
    """
    num_tokens, num_heads, nope_dim = q_nope.shape
    rope_dim = q_pe.shape[-1]
    v_dim = kv_b_weight.shape[0] // num_heads - nope_dim
    out = torch.empty((num_tokens, num_heads, v_dim), dtype=q_nope.dtype, device=q_nope.device)
    if num_tokens == 0 or meta.num_reqs == 0:
        return out
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    groups = _request_groups(meta.seq_lens_cpu, _MAX_GATHER_ROWS)
    if len(groups) == 1:
        _mla_prefill_pass(q_nope, q_pe, kv_cache, meta, kv_b_weight, scale, out, config)
        return out
    q_starts = [0]
    for q in meta.query_lens_cpu:
        q_starts.append(q_starts[-1] + q)
    for i, j in groups:
        t0, t1 = q_starts[i], q_starts[j]
        sub = AttentionMetadata(meta.query_start_loc[i: j + 1] - t0, meta.seq_lens[i:j], meta.block_tables[i:j],
                                meta.slot_mapping[t0:t1], meta.block_size, meta.query_lens_cpu[i:j],
                                meta.seq_lens_cpu[i:j])
        _mla_prefill_pass(q_nope[t0:t1], q_pe[t0:t1], kv_cache, sub, kv_b_weight, scale, out[t0:t1], config)
    return out


# Prefill tiles (bf16/fp16); float32 takes 32 x 32, 4 warps. From the H200 sweep (benchmarks/kernels.py
# --only-sweeps mla_prefill, V2-Lite heads; results/kernels-mla-prefill-h200-cda613a.json): 128 x 64 tiles in 3
# stages, launched last query tile first, took one 4K prompt's layer from 592 us (64 x 64, 8 warps, 2 stages,
# first-first) to 295 us, 8 x 2048 from 1119 to 631 us, 8 x 512 chunks over 1536 cached tokens from 620 to 368.
_PREFILL_TILES = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "reverse": True}


def _mla_prefill_pass(q_nope, q_pe, kv_cache, meta: AttentionMetadata, kv_b_weight, scale, out,
                      config: dict | None = None) -> None:
    """One gather + up-projection + kernel over all of ``meta``'s requests, into ``out`` [T, H, Dv]
    (``config`` overrides :data:`_PREFILL_TILES`)."""
    num_tokens, num_heads, nope_dim = q_nope.shape
    rope_dim = q_pe.shape[-1]
    rank = kv_cache.shape[-1] - rope_dim
    v_dim = out.shape[-1]
    latents, kv_start_loc = gather_mla_context(kv_cache, meta)
    kv = F.linear(latents[:, :rank].to(q_nope.dtype), kv_b_weight).view(-1, num_heads, nope_dim + v_dim)
    latents = latents.to(q_nope.dtype)
    is_fp32 = q_nope.dtype == torch.float32
    cfg = {**_PREFILL_TILES, **({"block_m": 32, "block_n": 32, "num_warps": 4} if is_fp32 else {}), **(config or {})}
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    grid = (num_heads, num_tokens // block_m + meta.num_reqs)
    _mla_prefill_kernel[grid](
        q_nope, q_pe, kv, latents, out, meta.query_start_loc, meta.seq_lens, kv_start_loc,
        meta.num_reqs, scale * 1.4426950408889634,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), kv.stride(1),
        latents.stride(0), out.stride(0), out.stride(1),
        NOPE=nope_dim, ROPE=rope_dim, V_DIM=v_dim, RANK=rank,
        BLOCK_DN=max(16, triton.next_power_of_2(nope_dim)), BLOCK_P=max(16, triton.next_power_of_2(rope_dim)),
        BLOCK_DV=max(16, triton.next_power_of_2(v_dim)), BLOCK_M=block_m, BLOCK_N=block_n, IEEE=is_fp32,
        REVERSE=cfg["reverse"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def mla_prefill(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
    kv_b_weight: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Same contract as :func:`mla_prefill_ref`; the Triton path on CUDA tensors (outside batch-invariant
    mode, whose model never takes the expanded form)."""
    if (
        q_nope.dim() == 3
        and kv_cache.dim() == 3
        and q_nope.dtype == q_pe.dtype == kv_cache.dtype == kv_b_weight.dtype
        and q_nope.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and kv_cache.is_contiguous()
        and use_triton(q_nope, q_pe, kv_cache, kv_b_weight, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    ):
        return mla_prefill_triton(q_nope, q_pe, kv_cache, meta, kv_b_weight, scale)
    return mla_prefill_ref(q_nope, q_pe, kv_cache, meta, kv_b_weight, scale)
