"""Copy whole KV blocks in every layer (copy-on-write of a shared prefix block, block moves)."""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import tl, triton, use_triton


def copy_blocks_ref(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy block ``src[i]`` onto block ``dst[i]`` in every layer of the cache (in place).

    Args:
        kv_cache: [num_layers, num_blocks, ...] (e.g. ``[L, num_blocks, 2, block_size, num_kv_heads,
            head_dim]``), any dtype.
        src, dst: [n] int64 block ids. ``dst`` ids must be distinct and must not appear in ``src``
            (each copy reads a block no copy of the same call writes); the scheduler's copy-on-write
            copies from a shared block onto a freshly allocated one, which satisfies this.
    """
    if src.numel() == 0:
        return
    kv_cache[:, dst] = kv_cache[:, src]


@triton.jit
def _copy_blocks_kernel(cache_ptr, src_ptr, dst_ptr, stride_layer, stride_block, block_numel, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + pair)
    dst = tl.load(dst_ptr + pair)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    base = cache_ptr + layer * stride_layer
    x = tl.load(base + src * stride_block + offs, mask=mask)
    tl.store(base + dst * stride_block + offs, x, mask=mask)


def copy_blocks_triton(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Triton kernel of :func:`copy_blocks_ref`: programs over (pair, layer, 4096-element chunk)."""
    n = src.numel()
    if n == 0:
        return
    num_layers = kv_cache.shape[0]
    block_numel = kv_cache[0, 0].numel()
    block = min(4096, triton.next_power_of_2(block_numel))
    grid = (n, num_layers, triton.cdiv(block_numel, block))
    _copy_blocks_kernel[grid](
        kv_cache, src.to(torch.int64), dst.to(torch.int64), kv_cache.stride(0), kv_cache.stride(1), block_numel,
        BLOCK=block, num_warps=4,
    )


def _blocks_are_dense(kv_cache: torch.Tensor) -> bool:
    """True when each block of each layer is one contiguous run of memory (the kernel's assumption)."""
    inner = kv_cache[0, 0] if kv_cache.shape[0] and kv_cache.shape[1] else None
    return inner is None or inner.is_contiguous()


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Same contract as :func:`copy_blocks_ref`; the Triton kernel on CUDA tensors (no host sync)."""
    if kv_cache.dim() >= 2 and _blocks_are_dense(kv_cache) and use_triton(kv_cache, src, dst):
        copy_blocks_triton(kv_cache, src, dst)
    else:
        copy_blocks_ref(kv_cache, src, dst)
