"""Write new keys and values into the paged KV cache by slot mapping."""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import tl, triton, use_triton


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys and values into one layer's paged cache (in place).

    Args:
        k, v: [T, num_kv_heads, head_dim], the cache's dtype or castable to it.
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]; index 0 keys, 1 values; any
            float dtype, float8_e4m3fn included (values rounded to it).
        slot_mapping: [T] int64, ``block_id * block_size + offset``; a negative slot skips the token
            (padding rows of a CUDA-graph batch).
    """
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = k[keep].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = v[keep].to(kv_cache.dtype)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    VIA_FP32: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:  # padding row of a CUDA-graph batch
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
    dst = cache_ptr + block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if VIA_FP32:  # an fp8 cache: convert down from float32
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton kernel of :func:`store_kv_ref`: one program per token writes all its heads' K and V."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert kv_cache.stride(-1) == 1, "kv_cache's head_dim must be contiguous"
    _store_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        VIA_FP32=kv_cache.dtype == torch.float8_e4m3fn,
        num_warps=4,
    )


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as :func:`store_kv_ref`; the Triton kernel on CUDA tensors (no host sync)."""
    if kv_cache.dim() == 5 and kv_cache.stride(-1) == 1 and use_triton(k, v, kv_cache, slot_mapping):
        store_kv_triton(k, v, kv_cache, slot_mapping)
    else:
        store_kv_ref(k, v, kv_cache, slot_mapping)
