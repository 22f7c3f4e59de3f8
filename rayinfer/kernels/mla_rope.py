"""MLA's per-token work before attention in one kernel: RMSNorm of the latent, RoPE of the queries' and
the shared key's rope parts (DeepSeek's interleaved layout or rotate-half), and the latent store.

In plain torch this is a dozen small kernels per layer (the norm, strided slices, the interleaved
de-interleave and concatenations, the query copy, the store); on a decode step of DeepSeek-V2-Lite
(27 layers) they are a large part of the ~116 kernels per layer. Glossary of R, P, Dn: see
``rayinfer.kernels.mla_attention``.
"""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import pdl_launch, pdl_wait, tl, triton, use_pdl, use_triton
from rayinfer.kernels.mla_attention import store_mla_kv_ref
from rayinfer.kernels.norm import rms_norm_ref


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool):
    """Rotate the rope part of queries [T, H, P] and keys [T, 1, P] by cos/sin [T, P // 2] (new tensors).

    ``interleave`` (``config.rope_interleave``, DeepSeek's checkpoint layout): pairs are (2i, 2i+1) and
    the result is de-interleaved, evens' rotations then odds', exactly as Hugging Face's
    ``apply_rotary_pos_emb_interleave``; otherwise rotate-half pairs (i, i + P/2). Queries and keys
    get the same permutation, so their dot products are those of the interleaved rotation.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x):
        if interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        c, s = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return x * c + torch.cat([-x2, x1], dim=-1) * s

    return rotate(q), rotate(k)


def mla_rope_store_ref(
    q: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
    sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, interleave: bool,
) -> torch.Tensor:
    """Normalize and store this step's latents with their roped keys; return the roped query parts.

    Args:
        q: [T, H, Dn + P], the query projection per head (its last P dims are the rope part).
        kv_a: [T, R + P], ``kv_a_proj_with_mqa``'s output: the latent, then the key's rope part.
        norm_weight: [R], ``kv_a_layernorm``'s weight; eps: its epsilon.
        cos, sin: [T, P // 2] in the model dtype (YaRN's magnitude factor applied).
        kv_cache: [num_blocks, block_size, R + P] (one layer), written in place at ``slot_mapping``
            ([T] int64; a negative slot skips the token).
        interleave: DeepSeek's interleaved rope layout (see :func:`apply_rope`).
    Returns:
        q_pe [T, H, P] roped, contiguous, in q's dtype.
    Source: DeepSeek-V2 (2024) eq. 9-19 (decoupled RoPE); Hugging Face ``DeepseekV3Attention``.
    """
    rope = kv_a.shape[-1] - norm_weight.shape[0]
    c_kv, k_pe = kv_a.split([kv_a.shape[-1] - rope, rope], dim=-1)
    c_kv = rms_norm_ref(c_kv, norm_weight, eps)
    assert isinstance(c_kv, torch.Tensor)  # no residual: one tensor
    q_pe, k_pe = apply_rope(q[..., q.shape[-1] - rope:], k_pe[:, None, :], cos, sin, interleave)
    store_mla_kv_ref(c_kv, k_pe[:, 0], kv_cache, slot_mapping)
    return q_pe.contiguous()


@triton.jit
def _rope_store_token(
    token, q_ptr, kv_a_ptr, w_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, q_out_ptr,
    num_heads, eps,
    stride_qt, stride_qh, stride_at, stride_cst, stride_cb, stride_cs, stride_ot, stride_oh,
    NOPE: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr,
):
    """Token ``token``'s queries roped (every head) and its latent normalized and stored with its roped key."""
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cos = tl.load(cos_ptr + token * stride_cst + i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cst + i, mask=i_ok, other=0.0).to(tl.float32)
    if INTERLEAVE:  # pairs (2i, 2i + 1), written de-interleaved
        a_off = 2 * i
        b_off = 2 * i + 1
    else:  # rotate-half pairs (i, i + P/2)
        a_off = i
        b_off = i + HALF
    # queries: every head of the token in one tile
    heads = tl.arange(0, BLOCK_H)
    hm = (heads[:, None] < num_heads) & i_ok[None, :]
    q_row = q_ptr + token * stride_qt + heads[:, None] * stride_qh + NOPE
    qa = tl.load(q_row + a_off[None, :], mask=hm, other=0.0).to(tl.float32)
    qb = tl.load(q_row + b_off[None, :], mask=hm, other=0.0).to(tl.float32)
    o_row = q_out_ptr + token * stride_ot + heads[:, None] * stride_oh
    out_ty = q_out_ptr.dtype.element_ty
    tl.store(o_row + i[None, :], (qa * cos[None, :] - qb * sin[None, :]).to(out_ty), mask=hm)
    tl.store(o_row + HALF + i[None, :], (qb * cos[None, :] + qa * sin[None, :]).to(out_ty), mask=hm)
    # the latent (RMSNorm as kernels.norm: float32 statistics, rounded to the input dtype, then the
    # weight) and the roped key, into the cache
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        r_ok = r < RANK
        a_row = kv_a_ptr + token * stride_at
        c = tl.load(a_row + r, mask=r_ok, other=0.0)
        h = c.to(tl.float32)
        var = tl.sum(h * h, axis=0) / RANK
        h = (h * tl.rsqrt(var + eps)).to(c.dtype)
        w = tl.load(w_ptr + r, mask=r_ok, other=0.0)
        dst = cache_ptr + (slot // KV_BLOCK_SIZE) * stride_cb + (slot % KV_BLOCK_SIZE) * stride_cs
        cache_ty = cache_ptr.dtype.element_ty
        tl.store(dst + r, (w.to(tl.float32) * h.to(tl.float32)).to(c.dtype).to(cache_ty), mask=r_ok)
        ka = tl.load(a_row + RANK + a_off, mask=i_ok, other=0.0).to(tl.float32)
        kb = tl.load(a_row + RANK + b_off, mask=i_ok, other=0.0).to(tl.float32)
        tl.store(dst + RANK + i, (ka * cos - kb * sin).to(kv_a_ptr.dtype.element_ty).to(cache_ty), mask=i_ok)
        tl.store(dst + RANK + HALF + i, (kb * cos + ka * sin).to(kv_a_ptr.dtype.element_ty).to(cache_ty), mask=i_ok)


@triton.jit
def _mla_rope_store_kernel(
    q_ptr, kv_a_ptr, w_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, q_out_ptr,
    num_heads, eps,
    stride_qt, stride_qh, stride_at, stride_cst, stride_cb, stride_cs, stride_ot, stride_oh,
    NOPE: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    _rope_store_token(
        tl.program_id(0).to(tl.int64), q_ptr, kv_a_ptr, w_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, q_out_ptr,
        num_heads, eps, stride_qt, stride_qh, stride_at, stride_cst, stride_cb, stride_cs, stride_ot, stride_oh,
        NOPE, RANK, HALF, BLOCK_R, BLOCK_H, BLOCK_HALF, KV_BLOCK_SIZE, INTERLEAVE,
    )


@triton.jit
def _mla_rope_store_absorb_kernel(
    q_ptr, kv_a_ptr, w_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, q_out_ptr,
    num_heads, eps,
    stride_qt, stride_qh, stride_at, stride_cst, stride_cb, stride_cs, stride_ot, stride_oh,
    w_uk_ptr, ql_ptr, stride_wh, stride_wd, stride_lt, stride_lh,
    NOPE: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, INTERLEAVE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr = False, ROPE_APART: tl.constexpr = False,
):
    """Program (t, h, c): q_latent[t, h, c * BLOCK_C ...] = q_nope[t, h] @ W_UK[h][:, those columns]
    (W_UK [Dn, R] rows of ``kv_b_proj`` per head, float32 sums); program (t, 0, 0) also does
    :func:`_rope_store_token` for t, or with ROPE_APART program (t, 0, C) of an extra column past the latent's
    C tiles does it alone (in parallel with the products instead of after one of them)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    c = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    r = c * BLOCK_C + tl.arange(0, BLOCK_C)
    rope_here = (head == 0) & (c == 0)
    if ROPE_APART:
        rope_here = (head == 0) & (c * BLOCK_C >= RANK)
    if c * BLOCK_C < RANK:
        w = tl.load(w_uk_ptr + head * stride_wh + d[:, None] * stride_wd + r[None, :],  # a weight: before the wait
                    mask=(d[:, None] < NOPE) & (r[None, :] < RANK), other=0.0)
        pdl_wait(USE_PDL)
        qn = tl.load(q_ptr + token * stride_qt + head * stride_qh + d, mask=d < NOPE, other=0.0)
        ql = tl.sum(w.to(tl.float32) * qn.to(tl.float32)[:, None], 0)
        tl.store(ql_ptr + token * stride_lt + head * stride_lh + r, ql.to(ql_ptr.dtype.element_ty), mask=r < RANK)
    else:
        pdl_wait(USE_PDL)
    if rope_here:
        _rope_store_token(
            token, q_ptr, kv_a_ptr, w_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, q_out_ptr,
            num_heads, eps, stride_qt, stride_qh, stride_at, stride_cst, stride_cb, stride_cs, stride_ot, stride_oh,
            NOPE, RANK, HALF, BLOCK_R, BLOCK_H, BLOCK_HALF, KV_BLOCK_SIZE, INTERLEAVE,
        )


def mla_rope_store_triton(
    q: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
    sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, interleave: bool,
) -> torch.Tensor:
    """Triton kernel of :func:`mla_rope_store_ref` (same contract; one program per token, no host sync).

    The rotations are computed in float32 and rounded once (the reference rounds each product in the
    model dtype), so 16-bit results may differ from it in the last bit.
    """
    num_tokens, num_heads, _ = q.shape
    q_pe = torch.empty((num_tokens, num_heads, kv_a.shape[-1] - norm_weight.shape[0]), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_pe
    args, consts = _rope_store_args(q, kv_a, norm_weight, eps, cos, sin, kv_cache, slot_mapping, interleave, q_pe)
    _mla_rope_store_kernel[(num_tokens,)](*args, **consts, num_warps=4, **pdl_launch(use_pdl(q)))
    return q_pe


def _rope_store_args(q, kv_a, norm_weight, eps, cos, sin, kv_cache, slot_mapping, interleave, q_pe):
    """(positional arguments, constexprs) of :func:`_rope_store_token` for a launch."""
    num_heads, qk_dim = q.shape[1:]
    rank = norm_weight.shape[0]
    rope = kv_a.shape[-1] - rank
    args = (q, kv_a, norm_weight, cos, sin, kv_cache, slot_mapping, q_pe, num_heads, float(eps),
            q.stride(0), q.stride(1), kv_a.stride(0), cos.stride(0), kv_cache.stride(0), kv_cache.stride(1),
            q_pe.stride(0), q_pe.stride(1))
    consts = dict(NOPE=qk_dim - rope, RANK=rank, HALF=rope // 2, BLOCK_R=triton.next_power_of_2(rank),
                  BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(rope // 2),
                  KV_BLOCK_SIZE=kv_cache.shape[1], INTERLEAVE=interleave)
    return args, consts


# A/B switch of jobs/bench_moe.py: 1 gives the absorbed launch's RoPE / latent store a program of its own (an extra
# grid column), 0 runs it after the first W_UK product's program.
ROPE_APART = 1


def mla_rope_store_absorb_triton(q, kv_a, norm_weight, eps, cos, sin, kv_cache, slot_mapping, interleave, w_kv_b):
    """Triton kernel of :func:`mla_rope_store_absorb_ref` (one launch: the absorbed query's programs, one
    per (token, head, 128 latent columns), and each token's RoPE / latent store in its first program)."""
    num_tokens, num_heads, _ = q.shape
    rank = norm_weight.shape[0]
    nope = q.shape[-1] - (kv_a.shape[-1] - rank)
    q_pe = torch.empty((num_tokens, num_heads, kv_a.shape[-1] - rank), dtype=q.dtype, device=q.device)
    q_latent = torch.empty((num_tokens, num_heads, rank), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_latent, q_pe
    args, consts = _rope_store_args(q, kv_a, norm_weight, eps, cos, sin, kv_cache, slot_mapping, interleave, q_pe)
    block_c = min(128, triton.next_power_of_2(rank))
    apart = bool(ROPE_APART)
    _mla_rope_store_absorb_kernel[(num_tokens, num_heads, triton.cdiv(rank, block_c) + apart)](
        *args, w_kv_b, q_latent, w_kv_b.stride(0), w_kv_b.stride(1), q_latent.stride(0), q_latent.stride(1),
        **consts, BLOCK_D=triton.next_power_of_2(nope), BLOCK_C=block_c, num_warps=4, ROPE_APART=apart,
        **pdl_launch(use_pdl(q)),
    )
    return q_latent, q_pe


def mla_rope_store(
    q: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
    sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, interleave: bool,
) -> torch.Tensor:
    """Same contract as :func:`mla_rope_store_ref`; the fused Triton kernel on CUDA tensors."""
    if _rope_store_applies(q, kv_a, norm_weight, cos, sin, kv_cache, slot_mapping):
        return mla_rope_store_triton(q, kv_a, norm_weight, eps, cos, sin, kv_cache, slot_mapping, interleave)
    return mla_rope_store_ref(q, kv_a, norm_weight, eps, cos, sin, kv_cache, slot_mapping, interleave)


def _rope_store_applies(q, kv_a, norm_weight, cos, sin, kv_cache, slot_mapping) -> bool:
    rope = kv_a.shape[-1] - norm_weight.shape[0] if kv_a.dim() == 2 else 0
    return (
        q.dim() == 3
        and kv_a.dim() == 2
        and rope > 0
        and rope % 2 == 0
        and q.shape[-1] > rope
        and cos.shape[-1] == sin.shape[-1] == rope // 2
        and q.stride(-1) == kv_a.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
        and cos.stride(0) == sin.stride(0)
        and norm_weight.is_contiguous()
        and kv_cache.dim() == 3
        and kv_cache.stride(-1) == 1
        and use_triton(q, kv_a, norm_weight, cos, sin, kv_cache, slot_mapping)
    )


def mla_rope_store_absorb_ref(
    q: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
    sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, interleave: bool, w_kv_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mla_rope_store_ref`, and the absorbed query of MLA's decode form.

    Args: as :func:`mla_rope_store_ref`, and w_kv_b: [H, Dn + Dv, R], ``kv_b_proj.weight`` per head (its
        first Dn rows are W_UK).
    Returns:
        (q_latent [T, H, R] = q_nope @ W_UK per head, in q's dtype; q_pe [T, H, P] roped).
    """
    nope = q.shape[-1] - (kv_a.shape[-1] - norm_weight.shape[0])
    q_pe = mla_rope_store_ref(q, kv_a, norm_weight, eps, cos, sin, kv_cache, slot_mapping, interleave)
    q_latent = torch.einsum("thd,hdr->thr", q[..., :nope].float(), w_kv_b[:, :nope].float()).to(q.dtype)
    return q_latent, q_pe


def mla_rope_store_absorb(
    q: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
    sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, interleave: bool, w_kv_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`mla_rope_store_absorb_ref`. Up to ``kernels.gemv.BATCHED_GEMV_MAX_ROWS`` tokens of
    bf16/fp16 on the GPU, one Triton launch (:func:`mla_rope_store_absorb_triton`; a decode step's RoPE /
    store kernel and its W_UK batched GEMV were two); otherwise :func:`mla_rope_store` and
    ``kernels.gemv.batched_linear`` (in batch-invariant mode the persistent matmul)."""
    from rayinfer.kernels.batch_invariant import is_batch_invariant
    from rayinfer.kernels.gemv import BATCHED_GEMV_MAX_ROWS, batched_linear

    nope = q.shape[-1] - (kv_a.shape[-1] - norm_weight.shape[0])
    if (q.dim() == 3 and q.shape[0] <= BATCHED_GEMV_MAX_ROWS and not is_batch_invariant()
            and q.dtype in (torch.bfloat16, torch.float16) and w_kv_b.dtype == q.dtype and q.is_cuda
            and w_kv_b.dim() == 3 and w_kv_b.stride(-1) == 1 and nope <= 256
            and _rope_store_applies(q, kv_a, norm_weight, cos, sin, kv_cache, slot_mapping)):
        return mla_rope_store_absorb_triton(q, kv_a, norm_weight, eps, cos, sin, kv_cache, slot_mapping, interleave,
                                            w_kv_b)
    q_pe = mla_rope_store(q, kv_a, norm_weight, eps, cos, sin, kv_cache, slot_mapping, interleave)
    w_uk_t = w_kv_b[:, :nope].transpose(1, 2)  # [H, R, Dn]
    return batched_linear(q[..., :nope].transpose(0, 1), w_uk_t).transpose(0, 1), q_pe
