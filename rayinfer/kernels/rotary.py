"""Rotary position embedding (RoPE), rotate-half (GPT-NeoX) convention as in Hugging Face Llama."""

from __future__ import annotations

import math

import torch

from rayinfer.kernels._triton_utils import (
    libdevice,
    pdl_launch,
    pdl_wait,
    tl,
    triton,
    use_libdevice,
    use_pdl,
    use_triton,
)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies of RoPE, [head_dim // 2] float32.

    ``scaling`` follows the Hugging Face ``rope_scaling`` dict; ``rope_type`` "default" (or None) and
    "llama3" (Llama 3.1 frequency smoothing) are supported.

    Raises:
        ValueError: for another rope_type.
    Source: Su et al., "RoFormer" (2021); Llama 3.1 scaling after Meta's reference implementation.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, llama3)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE to queries and keys (returns new tensors).

    Args:
        q: [T, num_heads, head_dim]; k: [T, num_kv_heads, head_dim].
        positions: [T] int64 token positions.
        inv_freq: [head_dim // 2] float32 from :func:`rope_inv_freq`.
    Returns:
        (q, k) rotated, in their input dtypes; angles computed in float32 as Hugging Face does.
    """
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, token, stride_xt, stride_xh, stride_ot, stride_oh, num_heads, cos, sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, CAST_OUT: tl.constexpr = False,
    NORM: tl.constexpr = False, norm_w_ptr=None, eps=0.0,
):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if NORM:  # RMSNorm over each head's row first, rounded as rms_norm_ref: (x * rsqrt).to(dt), then w * that
        var = (tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF)
        inv = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(norm_w_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_w_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        a = (w1 * (a * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        b = (w2 * (b * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # Each product and the sum are rounded to x's dtype, as the reference's ``q * cos + rot(q) * sin``.
    o1 = (a * cos).to(dt).to(tl.float32) + (-b * sin).to(dt).to(tl.float32)
    o2 = (b * cos).to(dt).to(tl.float32) + (a * sin).to(dt).to(tl.float32)
    if CAST_OUT:  # into an fp8 cache: round to x's dtype first (as the reference), then down from fp32
        elt = out_ptr.dtype.element_ty
        tl.store(dst, o1.to(dt).to(tl.float32).to(elt), mask=mask)
        tl.store(dst + HALF, o2.to(dt).to(tl.float32).to(elt), mask=mask)
    else:
        tl.store(dst, o1.to(dt), mask=mask)
        tl.store(dst + HALF, o2.to(dt), mask=mask)


@triton.jit
def _cos_sin(pos_ptr, inv_freq_ptr, q_ptr, token, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
             USE_LIBDEVICE: tl.constexpr):
    """cos and sin of one token's angles, [1, BLOCK_HALF] float32, rounded to q's dtype first as the
    reference casts them."""
    dims = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + dims, mask=dims < HALF, other=0.0)
    angle = tl.load(pos_ptr + token).to(tl.float32) * inv_freq
    if USE_LIBDEVICE:  # correctly rounded like torch's cos/sin, also for large angles
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    else:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    dt = q_ptr.dtype.element_ty
    return cos.to(dt).to(tl.float32)[None, :], sin.to(dt).to(tl.float32)[None, :]


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, inv_freq_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    num_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, inv_freq_ptr, q_ptr, token, HALF, BLOCK_HALF, USE_LIBDEVICE)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, num_heads,
                  cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, num_kv_heads,
                  cos, sin, HALF, BLOCK_HK, BLOCK_HALF)


def rotary_triton(q, k, positions, inv_freq):
    """Triton kernel of :func:`rotary_ref`: one program per token rotates all its query and key heads."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format
    )
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions.contiguous(), inv_freq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        num_heads, num_kv_heads,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        USE_LIBDEVICE=use_libdevice(),
        num_warps=4,
    )
    return q_out, k_out


def rotary(q, k, positions, inv_freq):
    """Same contract as :func:`rotary_ref`; the Triton kernel on CUDA tensors."""
    if (
        q.dim() == 3
        and k.dim() == 3
        and q.shape[-1] % 2 == 0
        and q.dtype == k.dtype
        and q.shape[-1] == k.shape[-1]
        and use_triton(q, k, positions)
    ):
        return rotary_triton(q, k, positions, inv_freq)
    return rotary_ref(q, k, positions, inv_freq)


# -- RoPE fused with the KV-cache write -------------------------------------------------------------
def _head_norms(q, k, qk_norm, norm):
    """``norm(rows, weight, eps)`` (an RMSNorm) over each head's row of q and of k: (q, k), shapes kept."""
    d = q.shape[-1]
    return (norm(q.reshape(-1, d), qk_norm[0], qk_norm[2]).view(q.shape),
            norm(k.reshape(-1, d), qk_norm[1], qk_norm[2]).view(k.shape))


def rotary_store_kv_ref(q, k, v, positions, inv_freq, kv_cache, slot_mapping, qk_norm=None) -> torch.Tensor:
    """RoPE on ``q`` and ``k``, then ``k`` and ``v`` written into the paged cache (plain torch).

    Args:
        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (rows may be strided: column slices
            of a stacked qkv projection).
        qk_norm: (q_weight [head_dim], k_weight [head_dim], eps) or None: RMSNorm over each head's row of q
            and k before RoPE (:func:`~rayinfer.kernels.norm.rms_norm_ref`; Qwen3's q_norm / k_norm).
        positions: [T] int64; inv_freq: [head_dim // 2] float32 (:func:`rope_inv_freq`).
        kv_cache: one layer, [num_blocks, 2, block_size, num_kv_heads, head_dim] (written in place);
            q's dtype, or float8_e4m3fn (keys and values rounded to q's dtype, then to fp8).
        slot_mapping: [T] int64 cache slots; negative skips the token (CUDA-graph padding).
    Returns:
        the rotated queries, [T, num_heads, head_dim], q's dtype.
    """
    from rayinfer.kernels.kv_write import store_kv_ref
    from rayinfer.kernels.norm import rms_norm_ref

    if qk_norm is not None:
        q, k = _head_norms(q, k, qk_norm, rms_norm_ref)
    q, k = rotary_ref(q, k, positions, inv_freq)
    store_kv_ref(k, v, kv_cache, slot_mapping)
    return q


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, cache_ptr, pos_ptr, slot_ptr, inv_freq_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    num_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, USE_LIBDEVICE: tl.constexpr, KV_CAST: tl.constexpr, USE_PDL: tl.constexpr = False,
    NORM: tl.constexpr = False, q_norm_ptr=None, k_norm_ptr=None, eps=0.0,
):
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, inv_freq_ptr, q_ptr, token, HALF, BLOCK_HALF, USE_LIBDEVICE)
    if tl.program_id(1) == 0:  # program (t, 0) rotates the queries, (t, 1) writes keys and values
        _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, num_heads,
                      cos, sin, HALF, BLOCK_HQ, BLOCK_HALF, NORM=NORM, norm_w_ptr=q_norm_ptr, eps=eps)
        return
    slot = tl.load(slot_ptr + token)
    if slot >= 0:  # negative: a padding row of a CUDA-graph batch, nothing to cache
        dst = cache_ptr + (slot // KV_BLOCK_SIZE) * stride_cb + (slot % KV_BLOCK_SIZE) * stride_cs
        # keys: rotated straight into the cache (the "token" stride of the destination is 0)
        _rotate_heads(k_ptr, dst, token, stride_kt, stride_kh, 0, stride_ch, num_kv_heads,
                      cos, sin, HALF, BLOCK_HK, BLOCK_HALF, KV_CAST, NORM=NORM, norm_w_ptr=k_norm_ptr, eps=eps)
        heads = tl.arange(0, BLOCK_HK)
        full = tl.arange(0, 2 * BLOCK_HALF)
        mask = (heads[:, None] < num_kv_heads) & (full[None, :] < 2 * HALF)
        v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + full[None, :], mask=mask)
        if KV_CAST:
            v = v.to(tl.float32)
        tl.store(dst + stride_ckv + heads[:, None] * stride_ch + full[None, :], v.to(cache_ptr.dtype.element_ty),
                 mask=mask)


def rotary_store_kv_triton(q, k, v, positions, inv_freq, kv_cache, slot_mapping, qk_norm=None) -> torch.Tensor:
    """Triton kernel of :func:`rotary_store_kv_ref`: one launch instead of two (four with per-head norms);
    per token one program normalizes and rotates the queries and another the keys into the cache, and
    copies the values."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    _rotary_store_kv_kernel[(num_tokens, 2)](
        q, k, v, q_out, kv_cache, positions.contiguous(), slot_mapping, inv_freq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_heads, num_kv_heads,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        KV_BLOCK_SIZE=kv_cache.shape[2], USE_LIBDEVICE=use_libdevice(), KV_CAST=kv_cache.dtype != q.dtype,
        num_warps=4, **pdl_launch(use_pdl(q)),
        **(dict(NORM=True, q_norm_ptr=qk_norm[0], k_norm_ptr=qk_norm[1], eps=float(qk_norm[2]))
           if qk_norm is not None else {}),
    )
    return q_out


def rotary_store_kv(q, k, v, positions, inv_freq, kv_cache, slot_mapping, qk_norm=None) -> torch.Tensor:
    """Same contract as :func:`rotary_store_kv_ref`; the fused Triton kernel on CUDA tensors whose
    ``head_dim // 2`` is a power of two (with ``qk_norm``, norm weights contiguous in q's dtype), else
    ``rms_norm`` per head, :func:`rotary` then ``store_kv`` (each dispatched)."""
    norm_ok = qk_norm is None or all(w.dtype == q.dtype and w.is_contiguous() and w.numel() == q.shape[-1]
                                     for w in qk_norm[:2])
    if (
        q.dim() == 3 and k.dim() == 3 and kv_cache.dim() == 5
        and q.dtype == k.dtype == v.dtype and kv_cache.dtype in (q.dtype, torch.float8_e4m3fn)
        and q.shape[-1] % 2 == 0 and q.shape[-1] == k.shape[-1] == kv_cache.shape[-1]
        and triton.next_power_of_2(q.shape[-1] // 2) == q.shape[-1] // 2
        and kv_cache.stride(-1) == 1 and norm_ok
        and use_triton(q, k, v, positions, kv_cache, slot_mapping, *(qk_norm[:2] if qk_norm is not None else ()))
    ):
        return rotary_store_kv_triton(q, k, v, positions, inv_freq, kv_cache, slot_mapping, qk_norm)
    from rayinfer.kernels.kv_write import store_kv
    from rayinfer.kernels.norm import rms_norm

    if qk_norm is not None:
        q, k = _head_norms(q, k, qk_norm, rms_norm)
    q, k = rotary(q, k, positions, inv_freq)  # each step's own kernel (or reference) dispatch
    store_kv(k, v, kv_cache, slot_mapping)
    return q
