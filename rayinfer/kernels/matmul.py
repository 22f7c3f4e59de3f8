"""A persistent Triton matmul whose rows do not depend on the batch (the batch-invariant linear layer).

``y = x @ weight.T + bias`` without split-K: every output element is the float32 sum of its K products
taken in order, 16 at a time by the tensor cores, whatever the number of rows M or the row's place among
them. The tile shape follows M (:func:`_choose_config`): it changes the speed, not the bits. ``NUM_SMS``
programs walk the output tiles in grouped order (persistent kernel, after Triton's tutorial 09 and Thinking Machines' ``batch_invariant_ops``).

cuBLAS picks its algorithm (tile, split-K) per M, so a row's result there changes with the batch; this
kernel trades some speed for that invariance, and runs only in batch-invariant mode
(:func:`dense_linear`; see ``kernels.batch_invariant``). A batched call (``[B, M, K] x [B, N, K]``,
:func:`dense_batched_linear`) runs the same programs once per batch entry (grid axis 1), for cuBLAS's
batched GEMM (``torch.bmm``, ``einsum``), whose algorithm also follows M.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayinfer.kernels._triton_utils import device_sms, is_interpreting, tl, triton, use_triton
from rayinfer.kernels.batch_invariant import is_batch_invariant


def persistent_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``. x: [M, K]; weight: [N, K]; bias: [N] or None. Returns [M, N], x's dtype."""
    return F.linear(x, weight, bias)


@triton.jit
def _persistent_linear_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K,
    stride_xb, stride_xm, stride_xk, stride_wb, stride_wn, stride_wk, stride_yb, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, ROWWISE: tl.constexpr,
):
    # grid axis 1: the batch entry of a batched call (one per head of MLA's absorbed projections), else 0
    batch = tl.program_id(1).to(tl.int64)
    x_ptr = x_ptr + batch * stride_xb
    w_ptr = w_ptr + batch * stride_wb
    y_ptr = y_ptr + batch * stride_yb
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    tiles_per_group = GROUP_M * num_pid_n
    rk0 = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), num_tiles, NUM_SMS):
        # grouped order: GROUP_M row tiles share each weight tile while it is in L2
        group = tile // tiles_per_group
        first_m = group * GROUP_M
        group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % tiles_per_group) % group_m
        pid_n = (tile % tiles_per_group) // group_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + rk0
            k_ok = rk < K
            a = tl.load(x_rows + rk[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_cols + rk[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if ROWWISE:  # the interpreter: see ROWWISE in kernels._triton_utils
                acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
            elif IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _choose_config(m: int, n: int, k: int, dtype: torch.dtype) -> dict:
    """Tiles for ``m`` rows times an [n, k] weight.

    A row's result does not depend on the tiles: the kernel never splits K, and every ``tl.dot`` adds its
    products into the float32 accumulator in the same 16-wide K steps from 0, so BLOCK_M, BLOCK_N and
    BLOCK_K may follow the row count. Checked bit for bit on an H200 (bf16, Llama-3-8B's four projection
    shapes, 55 tile shapes with BLOCK_M 16-128, BLOCK_N 32-256, BLOCK_K 64 and 128: every one gave the
    same bits as 128 x 128 x 64; ``benchmarks/results/batch-invariant-tiles-h200.json``), and by
    ``tests/kernels/test_batch_invariant_kernels.py`` on every run over row counts that cross the buckets.

    16-bit, fastest measured per row-count bucket (H200, Llama-3-8B shapes, against cuBLAS):
    - m <= 16: 16-row tiles, BLOCK_K 128, 4 stages; 32 columns for narrow outputs (n <= 4096) so that
      the K loop spreads over every multiprocessor, 256 for wide ones (gate/up): 1.0-1.2x cuBLAS;
    - m <= 128: 64-row tiles, BLOCK_K 128;
    - m <= 1024: 128-row tiles, 64 columns (n <= 4096 or k >= 8192), 128 (qkv), 256 x 64-K (gate/up):
      1.05-1.4x cuBLAS at m = 256;
    - larger (prefill): 128 x 256 x 64, 8 warps: 1.2x cuBLAS at m = 2048.
    float32 (exact products, ``input_precision="ieee"``): 64 x 64 x 32, 4 warps, for every m.
    Under the Triton interpreter (tests), 64 x 256 x 64 tiles (the broadcast product at its 2**20-element
    limit): it runs programs one at a time, at a cost per operation, so the fewest programs and K steps
    are fastest. ``persistent_linear(config=...)`` overrides them for benchmarks.
    """
    if is_interpreting():
        return dict(block_m=64, block_n=256, block_k=64, group_m=8, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3)
    wide = n >= 16384
    if m <= 16:
        block_n = 256 if wide else 32 if n <= 4096 else 64
        return dict(block_m=16, block_n=block_n, block_k=128, group_m=8, num_warps=4, num_stages=3 if wide else 4)
    if m <= 128:
        block_n = 128 if wide else 32 if k >= 8192 else 64
        return dict(block_m=64, block_n=block_n, block_k=128, group_m=8, num_warps=4, num_stages=3 if wide else 4)
    if m <= 1024 and not wide:
        if n <= 4096 or k >= 8192:
            return dict(block_m=128, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=4)
        return dict(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=3)
    return dict(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)


def persistent_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      config: dict | None = None) -> torch.Tensor:
    """Triton kernel of :func:`persistent_linear_ref`, batch-invariant (see the module docstring).

    Args:
        x: [M, K], or [B, M, K] for B independent products (any strides); weight: [N, K], or [B, N, K]
            with a batched x, x's dtype; bias: [N] or None (2-D only).
        config: tile override (block_m, block_n, block_k, group_m, num_warps, num_stages); on 16-bit
            tensor cores any tiles give a row the same bits (see :func:`_choose_config`).
    Returns:
        [M, N] (or [B, M, N]) in x's dtype, float32 accumulation; a batch entry's rows are those of a 2-D
        call on that entry alone.
    Raises:
        ValueError: when the shapes or dtypes do not match.
    """
    batched = x.dim() == 3
    if x.dim() not in (2, 3) or weight.dim() != x.dim() or x.shape[-1] != weight.shape[-1] or (
            batched and (x.shape[0] != weight.shape[0] or bias is not None)):
        raise ValueError(f"persistent_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if weight.dtype != x.dtype or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError("persistent_linear: weight must have x's dtype and bias shape [N]")
    if batched:
        return _persistent_linear(x, weight, None, config)
    return _persistent_linear(x[None], weight[None], bias, config)[0]


def _persistent_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       config: dict | None) -> torch.Tensor:
    """x [B, M, K], weight [B, N, K], bias [N] or None -> [B, M, N]: one launch, grid (programs, B)."""
    b, m, k = x.shape
    n = weight.shape[1]
    y = torch.empty((b, m, n), dtype=x.dtype, device=x.device)
    if b == 0 or m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(b, m, n))
    cfg = {**_choose_config(m, n, k, x.dtype), **(config or {})}
    num_tiles = triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"])
    # the interpreter runs programs one after another: one program per tile costs nothing more there
    num_sms = num_tiles if is_interpreting() else min(max(1, device_sms(x) // b), num_tiles)
    _persistent_linear_kernel[(num_sms, b)](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1), weight.stride(2),
        y.stride(0), y.stride(1), y.stride(2),
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], GROUP_M=cfg["group_m"],
        NUM_SMS=num_sms, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, ROWWISE=is_interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y


def persistent_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`dense_linear` (2-D operands) or :func:`dense_batched_linear` (3-D) can take the
    Triton kernel: float16/bfloat16/float32 operands of one dtype on CUDA (or under the Triton interpreter)."""
    return (
        x.dim() in (2, 3)
        and weight.dim() == x.dim()
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and weight.dtype == x.dtype
        and use_triton(x, weight)
    )


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` (any leading dims), or in batch-invariant mode the persistent matmul where it applies.

    x: [..., K]; weight: [N, K]; bias: [N] or None. Returns [..., N] in x's dtype.
    """
    if is_batch_invariant():
        x2 = x.reshape(-1, x.shape[-1])
        if persistent_linear_applies(x2, weight):
            return persistent_linear(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def dense_batched_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """B independent linear layers, ``torch.bmm(x, weight.mT)``, or in batch-invariant mode the persistent
    matmul where it applies (MLA's absorbed key and value up-projections, one entry per head).

    x: [B, M, K]; weight: [B, N, K] (any strides). Returns [B, M, N] in x's dtype.
    """
    if is_batch_invariant() and persistent_linear_applies(x, weight):
        return persistent_linear(x, weight)
    return torch.bmm(x, weight.transpose(1, 2))
