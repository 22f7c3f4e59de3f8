"""Single-row linear layers (GEMV) for batch-1 decode, with the layer's norms, activation and residual
adds fused in.

At batch 1 a linear layer only streams its weight, and what costs is the kernels around it: cuBLAS
splits some of Llama's shapes over K and adds a reduction kernel, and each RMSNorm, SiLU and residual
add is a launch of its own. These kernels keep one program per ``BLOCK_N`` output features over the
whole K (no second kernel) and multiply-add on the CUDA cores (a one-row tile on the tensor cores would
be 15/16 padding). :func:`fused_linear` adds, as TensorRT-LLM's and vLLM's decode paths fuse them:

- an RMSNorm prologue in one pass: the program accumulates ``sum(x^2)`` beside ``W @ (x * w_norm)`` and
  scales by ``1/rms(x)`` at the end (every program reads all of x anyway);
- a SiLU-and-mul prologue (``silu(gate) * up`` from the gate/up projection's output);
- a residual-add epilogue that writes ``residual + y`` into the residual stream in place;
- programmatic dependent launch (:func:`rayinfer.kernels._triton_utils.use_pdl`): the first weight tile
  is requested before waiting on the previous kernel, so the weight stream starts during its tail;
- fp8 block weights (``weight_scale``, DeepSeek-V3's 128 x 128 blocks of ``kernels.block_fp8``): each
  128-column run of a K tile is summed in float32 and scaled by its block's ``scale_inv``, so a one-row
  call streams one byte per weight (an H200's fp8 V2-Lite decodes a token in 1.91-1.96 ms with it, 2.27-2.36
  without: ``benchmarks/README.md``, thirteenth round).

:meth:`rayinfer.model.llama.LlamaDecoderLayer.forward_one_row` builds a whole layer from four of these
plus RoPE/KV write and attention. On an H200 a batch-1 Llama-3-8B decode step takes 4.08 ms with them
(PDL, ``benchmarks/kernels.py --only-sweeps decode_step``), 4.32 without PDL, 4.52 for the earlier
layer (norm kernels, QKV and gate/up on cuBLAS, this GEMV for o_proj and down_proj only). Every batch
above 1 stays on cuBLAS (a tensor-core variant for 2-16 rows lost to cuBLAS at every shape).

Each function has a plain-torch reference (``*_ref``) and a dispatcher that runs the Triton kernel
when :func:`gemv_applies` holds and the unfused kernels otherwise.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from rayinfer.kernels._triton_utils import pdl_launch, pdl_wait, tl, triton, use_pdl, use_triton
from rayinfer.kernels.activation import silu_and_mul, silu_and_mul_ref
from rayinfer.kernels.batch_invariant import is_batch_invariant
from rayinfer.kernels.block_fp8 import FP8_DTYPE, WEIGHT_BLOCK, block_fp8_linear
from rayinfer.kernels.fused_moe_config import gemv_tile_config
from rayinfer.kernels.matmul import dense_batched_linear, dense_linear
from rayinfer.kernels.norm import rms_norm, rms_norm_ref


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``. x: [M, K]; weight: [N, K]; bias: [N] or None. Returns [M, N], x's dtype."""
    return F.linear(x, weight, bias)


def silu_and_mul_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(silu(gate) * up)`` for ``x = cat([gate, up], -1)``: x [M, 2K], weight [N, K] -> [M, N]."""
    return F.linear(silu_and_mul_ref(x), weight, bias)


def fused_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_and_mul_input: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """A linear layer with its neighbours of a pre-norm decoder layer fused in (plain torch).

    ``y = linear(pre(x), weight, bias)`` where ``pre`` is ``rms_norm(x, norm_weight, eps)`` when
    ``norm_weight`` is given, ``silu(gate) * up`` of ``x = cat([gate, up], -1)`` when
    ``silu_and_mul_input``, else the identity; with ``residual``, returns ``residual + y``.

    Args:
        x: [M, K] ([M, 2K] with ``silu_and_mul_input``); weight: [N, K]; bias: [N] or None;
        norm_weight: [K] or None; residual: [M, N] or None.
    Returns:
        [M, N] in x's dtype (this reference does not write ``residual``; the kernel updates it in place).
    Raises:
        ValueError: with both ``norm_weight`` and ``silu_and_mul_input``.
    """
    x = _prologue(x, norm_weight, eps, silu_and_mul_input, rms_norm_ref, silu_and_mul_ref)
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def _check_prologue(norm_weight: torch.Tensor | None, silu_and_mul_input: bool) -> None:
    if norm_weight is not None and silu_and_mul_input:
        raise ValueError("fused_linear: a norm prologue and a SiLU-and-mul prologue are exclusive")


def _prologue(x, norm_weight, eps, silu_and_mul_input, norm_fn, act_fn) -> torch.Tensor:
    """``fused_linear``'s prologue applied on its own, through ``norm_fn`` / ``act_fn`` (the plain-torch
    references or the dispatching kernels)."""
    _check_prologue(norm_weight, silu_and_mul_input)
    if norm_weight is not None:
        return norm_fn(x, norm_weight, eps)
    return act_fn(x) if silu_and_mul_input else x


@triton.jit
def _gemv_input(x_ptr, norm_w_ptr, ks, k_ok, K, ss, SILU_AND_MUL: tl.constexpr, RMS_NORM: tl.constexpr):
    """One K tile of the GEMV's input row after its prologue, float32, and the running sum of squares."""
    if SILU_AND_MUL:  # silu(gate) * up, rounded twice as the reference's two ops
        g = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
        u = tl.load(x_ptr + K + ks, mask=k_ok, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        a = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)
    else:
        a = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        if RMS_NORM:  # x * norm_weight now, times 1/rms(x) after the loop: one pass over x
            ss += a * a
            a = a * tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    return a, ss


@triton.jit
def _gemv_tile(w, a, rn, n_ok, k0, K, scale_ptr, stride_sn, stride_sk, FP8_SCALES: tl.constexpr,
               SCALE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K tile's products summed per output row, float32 [BLOCK_N]. FP8_SCALES: w is an fp8 tile of a
    block-quantized weight; each SCALE_BLOCK-column run is summed, then scaled by its (row, column) block's
    ``scale_inv`` (BLOCK_K is a multiple of SCALE_BLOCK)."""
    prod = w.to(tl.float32) * a[None, :]
    if FP8_SCALES:
        runs = tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // SCALE_BLOCK, SCALE_BLOCK)), 2)
        kb = k0 // SCALE_BLOCK + tl.arange(0, BLOCK_K // SCALE_BLOCK)
        s = tl.load(scale_ptr + (rn // SCALE_BLOCK)[:, None] * stride_sn + kb[None, :] * stride_sk,
                    mask=n_ok[:, None] & (kb * SCALE_BLOCK < K)[None, :], other=0.0)
        return tl.sum(runs * s, 1)
    return tl.sum(prod, 1)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, norm_w_ptr, res_ptr, y_ptr, N, K, stride_wn, eps,
    SILU_AND_MUL: tl.constexpr, RMS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr = False, FP8_SCALES: tl.constexpr = False, scale_ptr=None, stride_sn=0, stride_sk=0,
    SCALE_BLOCK: tl.constexpr = 128,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    # The first weight tile is requested before waiting for the previous kernel: weights are constant,
    # so under PDL their stream starts while that kernel finishes.
    k_ok = rk < K
    if EVEN_N and EVEN_K:
        w = tl.load(w_rows + rk[None, :])
    else:
        w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    # Triggering the next kernel before our own wait cost down_proj 30.9 -> 37.2 us in the gemv sweep;
    # triggering it after the loop instead of here lost 0.1-0.27 ms per batch-1 step (decode_step sweep).
    pdl_wait(USE_PDL)
    ss = tl.zeros([BLOCK_K], tl.float32)
    a, ss = _gemv_input(x_ptr, norm_w_ptr, rk, k_ok, K, ss, SILU_AND_MUL, RMS_NORM)
    acc = _gemv_tile(w, a, rn, n_ok, 0, K, scale_ptr, stride_sn, stride_sk, FP8_SCALES, SCALE_BLOCK, BLOCK_N, BLOCK_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + rk
        k_ok = ks < K
        a, ss = _gemv_input(x_ptr, norm_w_ptr, ks, k_ok, K, ss, SILU_AND_MUL, RMS_NORM)
        if EVEN_N and EVEN_K:
            w = tl.load(w_rows + ks[None, :])
        else:
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += _gemv_tile(w, a, rn, n_ok, k0, K, scale_ptr, stride_sn, stride_sk, FP8_SCALES, SCALE_BLOCK, BLOCK_N,
                          BLOCK_K)
    if RMS_NORM:
        acc = acc * tl.rsqrt(tl.sum(ss, 0) / K + eps)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:  # the linear output is rounded to the model dtype first, as the reference's add
        r = tl.load(res_ptr + rn, mask=n_ok, other=0.0)
        acc = acc.to(r.dtype).to(tl.float32) + r.to(tl.float32)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def _choose_config(n: int, k: int, pdl: bool = True) -> dict:
    """Tiles for an [n, k] weight, from whole batch-1 Llama-3-8B decode steps on an H200
    (``benchmarks/kernels.py --only-sweeps decode_step``, results in
    ``benchmarks/results/decode-step-variants-h200.json``).

    Under PDL, 4 warps per program for QKV (n = 1.5 k), gate/up (n = 7 k, 16 rows, 1024-column K tiles)
    and down_proj (k = 3.5 n), 8 for o_proj (square), 2048-column K tiles: 4.08 ms per step, against
    4.21 with the tiles below. Without PDL those 4-warp tiles lose (5.20 ms against 4.32), so a GPU
    without it keeps 8 rows, 8 warps, 3 stages, K tiles of 1024 below K = 8192 and of 2048 above.
    """
    if not pdl:
        return dict(block_n=8, block_k=2048 if k >= 8192 else 1024, num_warps=8, num_stages=3)
    if n >= 4 * k:
        return dict(block_n=16, block_k=1024, num_warps=4, num_stages=3)
    return dict(block_n=8, block_k=2048, num_warps=8 if n == k else 4, num_stages=3)


# A/B switch (jobs/bench_moe.py variant "gemv-table-0"): 1 takes the tiles of the device's table
# (kernels/configs/<device>.json, "gemv") for a weight shape it lists, under PDL; 0 the rule above only.
DEVICE_TABLE = 1


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _table_config(x: torch.Tensor, weight: torch.Tensor) -> dict:
    """The device table's tiles for ``weight``'s shape and dtype ({} off CUDA, without an entry or with
    :data:`DEVICE_TABLE` 0). Raises: ValueError if the device's table file is malformed."""
    if not DEVICE_TABLE or not x.is_cuda:
        return {}
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    n, k = weight.shape
    return gemv_tile_config(_device_name(index), n, k, str(weight.dtype).removeprefix("torch.")) or {}


def fused_linear_triton(x, weight, bias=None, *, norm_weight=None, eps=1e-6, silu_and_mul_input=False,
                        residual=None, config=None, weight_scale=None):
    """Triton kernel of :func:`fused_linear_ref` for one row (x: [1, K] or [1, 2K]).

    With ``residual`` ([1, N], x's dtype) the sum is written into ``residual`` in place and returned.
    Tiles: the device table's entry for the weight's shape and dtype under PDL (:func:`_table_config`),
    else :func:`_choose_config`; ``config`` overrides them (block_n, block_k, num_warps, num_stages) and
    ``pdl`` (bool: launch with programmatic dependent launch; default :func:`use_pdl`). ``weight_scale``: ``weight`` is
    float8_e4m3fn in 128 x 128 blocks with this float32 ``scale_inv`` [ceil(N/128), ceil(K/128)]
    (``kernels.block_fp8``'s format), dequantized in the K loop (half the bytes of a 16-bit weight).
    """
    _check_prologue(norm_weight, silu_and_mul_input)
    n, k = weight.shape
    assert x.shape[0] == 1, "the GEMV kernel takes one row"
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None:
        assert residual.shape == (1, n) and residual.stride(-1) == 1 and residual.dtype == x.dtype
        y = residual
    else:
        y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    pdl = bool((config or {}).get("pdl", use_pdl(x)))
    cfg = {**_choose_config(n, k, pdl), **(_table_config(x, weight) if pdl else {}), **(config or {})}
    block_k = min(cfg["block_k"], max(16, triton.next_power_of_2(k)))
    fp8 = {}
    if weight_scale is not None:  # whole 128-column scale blocks per K tile
        block_k = max(block_k, WEIGHT_BLOCK[1])
        fp8 = dict(FP8_SCALES=True, scale_ptr=weight_scale, stride_sn=weight_scale.stride(0),
                   stride_sk=weight_scale.stride(1), SCALE_BLOCK=WEIGHT_BLOCK[1])
    _gemv_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        x, weight, bias if bias is not None else weight, norm_weight if norm_weight is not None else weight,
        y, y, n, k, weight.stride(0), float(eps),
        SILU_AND_MUL=silu_and_mul_input, RMS_NORM=norm_weight is not None, HAS_BIAS=bias is not None,
        ADD_RESIDUAL=residual is not None,
        BLOCK_N=cfg["block_n"], BLOCK_K=block_k, EVEN_N=n % cfg["block_n"] == 0, EVEN_K=k % block_k == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(pdl), **fp8,
    )
    return y


def linear_triton(x, weight, bias=None, config=None):
    """Triton kernel of :func:`linear_ref` for one row (x: [1, K]); ``config`` overrides the tiles."""
    return fused_linear_triton(x, weight, bias, config=config)


def silu_and_mul_linear_triton(x, weight, bias=None, config=None):
    """Triton kernel of :func:`silu_and_mul_linear_ref` for one row (x: [1, 2K])."""
    return fused_linear_triton(x, weight, bias, silu_and_mul_input=True, config=config)


# A/B switch (jobs/bench_moe.py variant "no-fp8-gemv"): 1 runs one-row calls of fp8 block weights through the
# GEMV (the scales applied in its K loop); 0 leaves them to kernels.block_fp8.block_fp8_linear.
FP8_WEIGHTS = 1


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> bool:
    """Whether the dispatchers take the Triton GEMV: one row of bf16/fp16 on CUDA, a row-major weight of
    the same dtype (or, with ``weight_scale``, float8_e4m3fn blocks and ``FP8_WEIGHTS``). float32 stays on
    cuBLAS (the GPU-vs-CPU equality tests run in float32). Never in batch-invariant mode: a row must be
    computed as it is in a batch (see ``kernels.matmul``)."""
    wanted = x.dtype if weight_scale is None else FP8_DTYPE
    return (
        not is_batch_invariant()
        and (weight_scale is None or bool(FP8_WEIGHTS))
        and x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == wanted
        and weight.dim() == 2
        and weight.stride(-1) == 1
        and x.is_cuda
        and use_triton(x, weight)
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`linear_ref`; the Triton GEMV when :func:`gemv_applies`, else cuBLAS."""
    return fused_linear(x, weight, bias)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`silu_and_mul_linear_ref`; one fused kernel when :func:`gemv_applies`,
    else the activation kernel and cuBLAS."""
    return fused_linear(x, weight, bias, silu_and_mul_input=True)


def fused_linear(x, weight, bias=None, *, norm_weight=None, eps=1e-6, silu_and_mul_input=False, residual=None,
                 weight_scale=None):
    """Same contract as :func:`fused_linear_ref`, except that ``residual``, when given, is updated in
    place (and returned); one Triton kernel when :func:`gemv_applies`, else the unfused kernels
    (RMSNorm, activation, cuBLAS or in batch-invariant mode the persistent matmul, add). ``weight_scale``:
    ``weight`` is fp8 blocks with this ``scale_inv`` (the reference is the dequantized weight's; the
    unfused path runs ``kernels.block_fp8.block_fp8_linear``)."""
    if gemv_applies(x, weight, weight_scale) and (
            residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1)):
        return fused_linear_triton(x, weight, bias, norm_weight=norm_weight, eps=eps,
                                   silu_and_mul_input=silu_and_mul_input, residual=residual, weight_scale=weight_scale)
    x = _prologue(x, norm_weight, eps, silu_and_mul_input, rms_norm, silu_and_mul)
    y = dense_linear(x, weight, bias) if weight_scale is None else block_fp8_linear(x, weight, weight_scale, bias)
    if residual is None:
        return y
    residual.add_(y)
    return residual


# ----------------------------------------------------------------------------------------------------
# Batched GEMV: B independent weights, a few rows each (MLA's absorbed W_UK / W_UV per head at decode)
# ----------------------------------------------------------------------------------------------------

BATCHED_GEMV_MAX_ROWS = 4


def batched_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(x, weight.mT)``: x [B, M, K], weight [B, N, K] (any strides) -> [B, M, N], x's dtype."""
    return torch.bmm(x, weight.transpose(1, 2))


@triton.jit
def _batched_gemv_kernel(
    x_ptr, w_ptr, y_ptr, N, K,
    stride_xb, stride_xm, stride_xk, stride_wb, stride_wn, stride_wk, stride_yb, stride_ym, stride_yn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Program (m, b, c): y[b, m, c * BLOCK_N ...] = weight[b, cols] @ x[b, m] in float32."""
    m = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    n_ok = ns < N
    w_rows = w_ptr + b * stride_wb + ns[:, None].to(tl.int64) * stride_wn
    w = tl.load(w_rows + ks[None, :] * stride_wk, mask=n_ok[:, None] & (ks[None, :] < K), other=0.0)  # before the wait
    pdl_wait(USE_PDL)
    x_row = x_ptr + b * stride_xb + m * stride_xm
    x = tl.load(x_row + ks * stride_xk, mask=ks < K, other=0.0)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + ks
        w = tl.load(w_rows + kk[None, :] * stride_wk, mask=n_ok[:, None] & (kk[None, :] < K), other=0.0)
        x = tl.load(x_row + kk * stride_xk, mask=kk < K, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    tl.store(y_ptr + b * stride_yb + m * stride_ym + ns * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def batched_linear_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Triton kernel of :func:`batched_linear_ref` for a few rows (one program per row, entry and slice
    of 16K weight elements; the weight tile is requested before the PDL wait). The result is stored as
    [M, B, N] and returned as its [B, M, N] view, so ``.transpose(0, 1)`` of it is contiguous."""
    nb, m, k = x.shape
    n = weight.shape[1]
    y = torch.empty((m, nb, n), dtype=x.dtype, device=x.device).transpose(0, 1)
    block_k = min(512, max(16, triton.next_power_of_2(k)))
    block_n = max(16, min(triton.next_power_of_2(n), 16384 // block_k))
    _batched_gemv_kernel[(m, nb, triton.cdiv(n, block_n))](
        x, weight, y, n, k, *x.stride(), *weight.stride(), *y.stride(),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **pdl_launch(use_pdl(x)),
    )
    return y


def batched_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`batched_linear_ref` (x [B, M, K], weight [B, N, K] -> [B, M, N]): the Triton
    batched GEMV for up to :data:`BATCHED_GEMV_MAX_ROWS` rows of bf16/fp16 on the GPU (a decode step's
    absorbed MLA projections: cuBLAS's batched GEMM took 3.3 us a layer for each at batch 1 and breaks the
    chain of PDL launches), else ``kernels.matmul.dense_batched_linear`` (cuBLAS; the persistent matmul
    in batch-invariant mode)."""
    if (not is_batch_invariant() and x.dim() == 3 and weight.dim() == 3 and x.shape[1] <= BATCHED_GEMV_MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.is_cuda
            and use_triton(x, weight)):
        return batched_linear_triton(x, weight)
    return dense_batched_linear(x, weight)
