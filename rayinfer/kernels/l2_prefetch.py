"""Prefetch of weights into the GPU's L2 cache ahead of the kernel that reads them.

A batch-1 decode step runs kernels of two kinds back to back: ones that stream weights at the memory
system's rate (the GEMVs, the expert GEMMs) and latency-bound ones that read almost nothing (RoPE and the
cache store, MLA decode over a short latent cache, the split merge, routing). During the latter the
memory system idles. :func:`l2_prefetch`, launched before them, asks for the weights a later kernel of
the same layer will read, so that kernel finds (part of) them in L2 instead of HBM: on DeepSeek-V2-Lite's
shape the fused shared experts' weights (a quarter of the bytes of a layer's expert GEMMs at batch 1)
stream in while the attention runs (``rayinfer.model.deepseek_v3.L2_PREFETCH``).

The kernel issues Hopper's bulk prefetch, ``cp.async.bulk.prefetch.L2.global [addr], size`` (PTX ISA 8.0,
sm_90; NVIDIA's "Parallel Thread Execution ISA", ``cp.async.bulk.prefetch``): one instruction per chunk,
no registers or shared memory for the data, completion not awaited, no effect on any result. It is a
hint: the data may be evicted again before its use.
"""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import HAS_TRITON, device_capability, is_interpreting, pdl_launch, pdl_wait, tl
from rayinfer.kernels._triton_utils import triton, use_pdl

CHUNK_BYTES = 1 << 16  # bytes per prefetch instruction (a multiple of 16, as the instruction requires)
# chunks per program: a program's prefetches go through its multiprocessor's copy engine, whose rate is
# a fraction of the memory system's, so the chunks are spread over many programs
CHUNKS_PER_PROGRAM = 1
MAX_TENSORS = 3  # tensors per launch
# 1: prefetch with an evict-last L2 policy (``createpolicy.fractional.L2::evict_last``), so the streaming
# reads between the prefetch and its use evict other lines first; 0: the default policy
EVICT_LAST = 0
# 1: launch on a side stream (forked from the current one, joined back by :func:`l2_prefetch_join`), so
# the kernels after it never wait for the prefetches to land; 0: in the current stream (with PDL)
SIDE_STREAM = 1
_side_streams: dict[int, object] = {}  # device index -> the side stream
_pending: set[int] = set()  # devices with a side-stream launch not yet joined


def prefetch_supported(t: torch.Tensor) -> bool:
    """Whether :func:`l2_prefetch` runs on ``t``'s device: CUDA, compute capability >= 9.0 (the bulk
    prefetch instruction), Triton importable and not its interpreter."""
    return (HAS_TRITON and not is_interpreting() and t.is_cuda and torch.version.cuda is not None
            and device_capability(t.device.index)[0] >= 9)


def l2_prefetch(tensors: list[torch.Tensor]) -> int:
    """Ask the GPU to bring the bytes of ``tensors`` into L2, in one launch that returns at once (it does
    not wait for the data). Under programmatic dependent launch the prefetches start after the previous
    kernel has finished.

    Args:
        tensors: up to :data:`MAX_TENSORS` contiguous tensors of any dtype on one CUDA device. Tensors
            whose storage does not start at a 16-byte boundary are left out (the instruction needs it).
    Returns:
        the bytes asked for (0 where :func:`prefetch_supported` is False: CPU, the interpreter, before
        Hopper; nothing is launched then).
    Raises:
        ValueError: more than :data:`MAX_TENSORS` tensors, or a non-contiguous one.
    """
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"l2_prefetch takes at most {MAX_TENSORS} tensors, got {len(tensors)}")
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"prefetch of a non-contiguous tensor of shape {tuple(t.shape)}")
    parts = [t.view(-1).view(torch.uint8) for t in tensors if t.numel() and t.data_ptr() % 16 == 0]
    if not parts or not prefetch_supported(parts[0]):
        return 0
    sizes = [p.numel() for p in parts]
    chunks = [triton.cdiv(n, CHUNK_BYTES) for n in sizes]
    parts += [parts[0]] * (MAX_TENSORS - len(parts))
    sizes += [0] * (MAX_TENSORS - len(sizes))
    chunks += [0] * (MAX_TENSORS - len(chunks))
    grid = (triton.cdiv(sum(chunks), CHUNKS_PER_PROGRAM),)
    args = (parts[0], sizes[0], chunks[0], parts[1], sizes[1], chunks[1], parts[2], sizes[2])
    meta = dict(CHUNK=CHUNK_BYTES, BLOCK=CHUNKS_PER_PROGRAM, EVICT_LAST=bool(EVICT_LAST), num_warps=1)
    if SIDE_STREAM:
        index = parts[0].device.index if parts[0].device.index is not None else torch.cuda.current_device()
        side = _side_streams.get(index)
        if side is None:
            side = _side_streams[index] = torch.cuda.Stream(device=index)
        side.wait_stream(torch.cuda.current_stream(index))  # after the kernels launched so far
        with torch.cuda.stream(side):
            _l2_prefetch_kernel[grid](*args, **meta)
        _pending.add(index)
    else:
        _l2_prefetch_kernel[grid](*args, **meta, **pdl_launch(use_pdl(parts[0])))
    return sum(sizes)


def l2_prefetch_join(t: torch.Tensor) -> None:
    """Make the current stream of ``t``'s device wait for the side-stream prefetches launched since the last
    join (CUDA-graph capture needs every forked stream joined back before it ends); a no-op when none."""
    if not t.is_cuda:
        return
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index in _pending:
        _pending.discard(index)
        torch.cuda.current_stream(index).wait_stream(_side_streams[index])


@triton.jit
def _l2_prefetch_kernel(a_ptr, a_bytes, a_chunks, b_ptr, b_bytes, b_chunks, c_ptr, c_bytes,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    # after the wait: the prefetches should not compete with the kernel before (a weight-streaming GEMV)
    pdl_wait(USE_PDL)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # chunk index over the three tensors, in order
    in_a = j < a_chunks
    in_b = (j >= a_chunks) & (j < a_chunks + b_chunks)
    local = tl.where(in_a, j, tl.where(in_b, j - a_chunks, j - a_chunks - b_chunks)).to(tl.int64) * CHUNK
    total = tl.where(in_a, a_bytes, tl.where(in_b, b_bytes, c_bytes)).to(tl.int64)
    ptr = tl.where(in_a, a_ptr + local, tl.where(in_b, b_ptr + local, c_ptr + local))
    # whole 16-byte units (the end may round up past the tensor by < 16 bytes: still inside its allocation)
    size = ((tl.minimum(total - local, CHUNK) + 15) // 16 * 16).to(tl.int32)
    size = tl.where(local < total, size, 0)
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1)
