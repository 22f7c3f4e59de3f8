"""FP8 block-quantized linear layers as DeepSeek-V3 ships them, dequantized inside the GEMM (W8A16 or W8A8).

Format (DeepSeek-V3 technical report, arXiv:2412.19437 §3.3 "fine-grained quantization"; the released
checkpoints' ``quantization_config``: ``quant_method "fp8"``, ``fmt "e4m3"``, ``weight_block_size [128,
128]``): a linear weight [N, K] is stored as ``float8_e4m3fn`` [N, K] plus ``weight_scale_inv`` float32
[ceil(N/128), ceil(K/128)], one scale per 128 x 128 block (the last row and column of blocks may be
partial). The real weight is ``w_fp8[n, k] * scale_inv[n // 128, k // 128]`` (DeepSeek's inference
``weight_dequant``). Glossary: ``scale_inv`` is that multiplier, amax of the block / 448 (the largest
e4m3 value): the inverse of the quantizer's scale 448 / amax.

:func:`block_fp8_linear` has two schemes. W8A16 (decode-sized calls, CPU, batch-invariant mode) keeps
activations in 16 bits: each K step of the Triton GEMM loads an fp8 weight tile, widens it to x's dtype
(exact: every e4m3 value is a bf16 and an fp16), multiplies in float32 and scales that partial product by
its (k-block, n-block) scales before adding it up, so the weight stays one byte per element in memory.
W8A8 (calls of at least ``W8A8_FROM_ROWS`` rows on GPUs with fp8 tensor cores) is the checkpoints'
``activation_scheme "dynamic"``: x is quantized per row and 128 columns (:func:`quantize_act_fp8`, which
the fused MoE's W8A8 path uses too) and each K step multiplies fp8 by fp8, scaled by both scales.
Each function has a plain-torch reference (``*_ref``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayinfer.kernels._triton_utils import device_capability, is_interpreting, tl, triton, use_triton
from rayinfer.kernels.batch_invariant import is_batch_invariant

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
WEIGHT_BLOCK = (128, 128)  # (rows N, columns K) per scale: the only block size the GEMM takes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(weight_shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = WEIGHT_BLOCK) -> tuple[int, ...]:
    """Shape of the ``scale_inv`` of a weight [..., N, K]: [..., ceil(N / bn), ceil(K / bk)]."""
    *lead, n, k = weight_shape
    return (*lead, _cdiv(n, block[0]), _cdiv(k, block[1]))


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to float8_e4m3fn with one float32 scale per ``block`` (DeepSeek-V3's format).

    Per block: ``scale_inv = amax(|w_block|) / 448`` (1 for an all-zero block) and
    ``w_fp8 = round(w_block / scale_inv)`` to the nearest e4m3 value, clamped to +-448.

    Args:
        w: [..., N, K] any float dtype (leading dims: stacked experts); N and K need not be block
            multiples (the last blocks are partial).
        block: (rows, columns) per scale.
    Returns:
        (w_fp8 [..., N, K] float8_e4m3fn, scale_inv [..., ceil(N/bn), ceil(K/bk)] float32), on w's device.
    Raises:
        ValueError: for w with fewer than 2 dims or a non-positive block.
    Source: DeepSeek-V3 technical report (arXiv:2412.19437) §3.3, 128 x 128 weight blocks.
    """
    if w.dim() < 2 or min(block) <= 0:
        raise ValueError(f"quantize_block_fp8: w must be [..., N, K] and block positive; got {tuple(w.shape)}, {block}")
    *lead, n, k = w.shape
    bn, bk = block
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    # zero padding to whole blocks leaves every block's amax unchanged
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).view(*lead, nb, bn, kb, bk)
    amax = padded.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    # divided by a tensor: CUDA torch divides by a Python number as a product with its reciprocal, one
    # rounding off the quotient, which moves values that sit on an e4m3 midpoint (152 -> 144 instead of 160)
    scale_inv = torch.where(amax > 0, amax / amax.new_tensor(FP8_MAX), torch.ones_like(amax))
    q = (padded / scale_inv[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous(), scale_inv


def block_fp8_dequant_ref(w_fp8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                          block: tuple[int, int] = WEIGHT_BLOCK) -> torch.Tensor:
    """The real weight ``w_fp8 * scale_inv`` of its block (DeepSeek's ``weight_dequant``), plain torch.

    Args:
        w_fp8: [..., N, K] float8_e4m3fn (N, K any; leading dims allowed).
        scale_inv: [..., ceil(N/bn), ceil(K/bk)] float32.
        dtype: of the result (the product is taken in float32, then rounded once).
    Returns:
        [..., N, K] in ``dtype``.
    Raises:
        ValueError: when scale_inv's shape does not fit w_fp8's.
    """
    if w_fp8.dim() < 2 or tuple(scale_inv.shape) != scale_shape(w_fp8.shape, block):
        raise ValueError(f"block_fp8_dequant: scale_inv {tuple(scale_inv.shape)} does not fit weight "
                         f"{tuple(w_fp8.shape)} in {block} blocks (expected {scale_shape(w_fp8.shape, block)})")
    n, k = w_fp8.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :n, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :k]
    return (w_fp8.float() * scale).to(dtype)


ACT_GROUP = 128  # activation columns per scale (DeepSeek-V3's 1 x 128 tiles)


def quantize_act_fp8_ref(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group fp8 quantization of activations (DeepSeek-V3's "dynamic" activation scheme):
    :func:`quantize_block_fp8` in blocks of one row by ``group`` columns.

    Args:
        x: [M, K] float (any float dtype).
    Returns:
        (x_fp8 [M, K] float8_e4m3fn, scale [M, ceil(K / group)] float32), on x's device.
    Source: DeepSeek-V3 technical report (arXiv:2412.19437) §3.3, 1 x 128 activation tiles.
    """
    return quantize_block_fp8(x, (1, group))


def qdq_act_fp8_ref(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] through :func:`quantize_act_fp8_ref` and back: float32 [M, K], the activations a W8A8 GEMM
    multiplies (its references' A operand)."""
    return block_fp8_dequant_ref(*quantize_act_fp8_ref(x), torch.float32, (1, ACT_GROUP))


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                      GROUPS: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS)
    c = tl.arange(0, GROUP)
    cols = g[:, None] * GROUP + c[None, :]  # [GROUPS, GROUP]
    ok = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
    # correctly rounded divisions (the reference's): an approximate quotient can round to the other fp8 value
    q = tl.clamp(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape)), -448.0, 448.0)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + g, scale, mask=g * GROUP < K)


def quantize_act_fp8(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_act_fp8_ref` (same contract); one Triton program per row on CUDA tensors. The
    reference runs under the Triton interpreter, whose float32 -> e4m3 conversion rounds wrongly where the
    mantissa carries into the exponent (1.95 -> 1.0); the kernel is checked against it on the GPU."""
    if not use_triton(x) or is_interpreting() or x.dim() != 2 or x.stride(-1) != 1:
        return quantize_act_fp8_ref(x, group)
    m, k = x.shape
    groups = _cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _act_quant_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0),
                                GROUPS=triton.next_power_of_2(groups), GROUP=group, num_warps=4)
    return q, scale


def block_fp8_linear_ref(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequant(w_fp8, scale_inv), bias)`` in x's dtype (the weight dequantized to x's dtype).

    x: [..., K]; w_fp8: [N, K] float8_e4m3fn; scale_inv: [ceil(N/128), ceil(K/128)] float32; bias: [N]
    or None. Returns [..., N] in x's dtype. Raises ValueError as :func:`block_fp8_dequant_ref`.
    """
    return F.linear(x, block_fp8_dequant_ref(w_fp8, scale_inv, x.dtype), bias)


def block_fp8_linear_w8a8_ref(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 reference of :func:`block_fp8_linear`: x quantized per row and 128 columns
    (:func:`quantize_act_fp8_ref`) and dequantized, the weight dequantized, one float32 GEMM, rounded once
    to x's dtype (DeepSeek-V3's inference ``act_quant`` + ``fp8_gemm``).

    x: [M, K]; w_fp8: [N, K] float8_e4m3fn; scale_inv: [ceil(N/128), ceil(K/128)] float32; bias: [N] or None.
    Returns [M, N] in x's dtype."""
    y = F.linear(qdq_act_fp8_ref(x), block_fp8_dequant_ref(w_fp8, scale_inv, torch.float32), None if bias is None else bias.float())
    return y.to(x.dtype)


# A/B switch (jobs/bench_moe.py variant "dense-w8a16"): calls of at least this many rows quantize their
# activations (W8A8) on GPUs with fp8 tensor cores; 0 keeps every call W8A16. Fewer rows only stream the
# weight, where W8A8's extra quantization launch costs more than its products save.
W8A8_FROM_ROWS = 128


def has_fp8_tensor_cores(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a CUDA device whose tensor cores multiply fp8 (compute capability >= 8.9)."""
    return t.is_cuda and device_capability(t.device.index) >= (8, 9)


def linear_w8a8_applies(x: torch.Tensor) -> bool:
    """Whether :func:`block_fp8_linear` quantizes ``x`` [M, K] by default (``act_fp8=None``): 16-bit x of at
    least ``W8A8_FROM_ROWS`` rows on a GPU with fp8 tensor cores, outside batch-invariant mode (whose rows
    must not change scheme with the batch)."""
    return (0 < W8A8_FROM_ROWS <= x.shape[0] and x.dtype != torch.float32 and has_fp8_tensor_cores(x)
            and not is_batch_invariant())


@triton.jit
def _block_fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    ACT_SCALE: tl.constexpr = False, a_scale_ptr=None, stride_asm=0, stride_ask=0,
):
    # ACT_SCALE (W8A8): x is fp8 with one float32 scale per row and SCALE_K columns (a_scale [M, K / SCALE_K]):
    # each K step multiplies fp8 by fp8 and scales the partial product by its rows' and columns' scales
    # (DeepSeek-V3's fp8_gemm); DOT_F32 then widens both operands (the interpreter has no fp8 tl.dot)
    # grouped order: GROUP_M row tiles run next to each other and share each weight tile while it is in L2
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (pid // tiles_per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % group_m
    pid_n = (pid % tiles_per_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk0 = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    # BLOCK_N may span several scale blocks: each column reads the scale of its own n-block
    s_cols = s_ptr + (rn // SCALE_N) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + rk0
        k_ok = rk < K
        a = tl.load(x_rows + rk[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + rk[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        # BLOCK_K divides SCALE_K: the whole K step lies in one k-block
        s = tl.load(s_cols + (k0 // SCALE_K) * stride_sk, mask=n_ok, other=0.0)
        if DOT_F32:  # float32 activations, or the interpreter (no 16-bit tl.dot there)
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif ACT_SCALE:
            part = tl.dot(a, b)
        else:
            part = tl.dot(a, b.to(a.dtype))
        if ACT_SCALE:
            a_s = tl.load(a_scale_ptr + rm.to(tl.int64) * stride_asm + (k0 // SCALE_K) * stride_ask, mask=m_ok,
                          other=0.0)
            acc += part * a_s[:, None] * s[None, :]
        else:
            acc += part * s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# the W8A8 tiles of prefill-sized calls: the fastest set in sum over DeepSeek-V2-Lite's and V3's larger dense
# shapes at 2048 and 4096 rows (``benchmarks/probe/block_fp8_tiles.py --w8a8``,
# results/block-fp8-w8a8-tiles-h200-8f10e44.json: 2078 us against 2134 for 128 x 128 in 8 warps)
W8A8_TILES = dict(block_m=64, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=4)


def _choose_config(m: int, n: int, dtype: torch.dtype = torch.bfloat16, act_fp8: bool = False) -> dict:
    """Tiles for ``m`` rows of ``dtype`` (fp8 under ``act_fp8``, W8A8) times an [n, K] fp8 weight.

    BLOCK_K is 128 (one K step per scale block) at every m, so a row's sum runs over the same K steps
    in the same order whatever the batch; the products' instruction still follows the row tile (on Hopper
    16-row tiles run mma.sync and 64- or 128-row tiles the warpgroup MMA, which round a few sums
    differently: measured on an H200), so batch-invariant mode (``kernels.batch_invariant``) takes the
    64 x 64 tiles at every m. Few rows (decode) only stream the weight: 16-row tiles and
    narrow column tiles (32 up to n = 4096) spread it over more programs; many rows reuse each weight
    tile over 64- and 128-row tiles. float32 activations (exact products, rare on a GPU) take 64 x 64 x
    64 tiles, whose 4-byte x tiles fit shared memory in 3 stages. Under the interpreter (tests) one
    32 x 128 tile per program: it runs programs one at a time, so fewer and larger tiles are faster there.
    These GPU tiles are a starting point after :mod:`rayinfer.kernels.matmul`'s measured buckets, not yet
    timed for this kernel: ``benchmarks/probe/block_fp8_tiles.py`` sweeps them at DeepSeek-V3's shapes.
    """
    if is_interpreting():
        return dict(block_m=32, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=1)
    if is_batch_invariant() and dtype != torch.float32:
        return dict(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=4)
    if dtype == torch.float32:
        return dict(block_m=16 if m <= 16 else 64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=3)
    if m <= 16:
        return dict(block_m=16, block_n=32 if n <= 4096 else 64, block_k=128, group_m=8, num_warps=4, num_stages=4)
    if m <= 128:
        return dict(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=4)
    if act_fp8:  # one-byte tiles of both operands: a deeper pipeline fits
        return dict(W8A8_TILES)
    return dict(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3)


def block_fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                     config: dict | None = None, act_fp8: bool | None = None) -> torch.Tensor:
    """``x @ dequant(w_fp8, scale_inv).T + bias``: the Triton W8A16 GEMM on CUDA (or under the Triton
    interpreter), :func:`block_fp8_linear_ref` elsewhere (CPU); W8A8 for prefill-sized calls on GPUs with
    fp8 tensor cores.

    The kernel dequantizes in the GEMM, never the whole weight: per K step of ``BLOCK_K`` (a divisor of
    128) it dots x's tile with the widened fp8 tile in float32 and adds that partial product times the
    per-column scales ``scale_inv[cols // 128, k0 // 128]`` (see the module docstring). No split-K.
    W8A8 (``act_fp8``) first quantizes x per row and 128 columns (:func:`quantize_act_fp8`, DeepSeek-V3's
    dynamic activation scheme) and multiplies fp8 by fp8, scaling each K step by both scales; its
    reference is :func:`block_fp8_linear_w8a8_ref`.

    Args:
        x: [M, K] float16, bfloat16 or float32 (any strides).
        w_fp8: [N, K] float8_e4m3fn; scale_inv: [ceil(N/128), ceil(K/128)] float32 (128 x 128 blocks);
            bias: [N] or None.
        config: tile override (block_m, block_n, block_k, group_m, num_warps, num_stages) for tests and
            benchmarks; block_k must divide 128.
        act_fp8: W8A8 (True) or W8A16 (False); None: :func:`linear_w8a8_applies`. Without Triton, True
            runs :func:`block_fp8_linear_w8a8_ref`.
    Returns:
        [M, N] in x's dtype (float32 accumulation).
    Raises:
        ValueError: when shapes or dtypes do not fit, or block_k does not divide 128.
    Source: DeepSeek-V3 technical report (arXiv:2412.19437) §3.3; DeepSeek-V3 inference ``weight_dequant``
    (the dequantization this fuses into the GEMM's K loop).
    """
    if x.dim() != 2 or w_fp8.dim() != 2 or x.shape[1] != w_fp8.shape[1]:
        raise ValueError(f"block_fp8_linear: x {tuple(x.shape)} and weight {tuple(w_fp8.shape)} do not multiply")
    if w_fp8.dtype != FP8_DTYPE or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"block_fp8_linear: needs a float8_e4m3fn weight and a 16/32-bit float x, got {w_fp8.dtype} "
                         f"and {x.dtype}")
    if tuple(scale_inv.shape) != scale_shape(w_fp8.shape) or scale_inv.dtype != torch.float32:
        raise ValueError(f"block_fp8_linear: scale_inv must be float32 {scale_shape(w_fp8.shape)} for weight "
                         f"{tuple(w_fp8.shape)} (128 x 128 blocks), got {scale_inv.dtype} {tuple(scale_inv.shape)}")
    if bias is not None and tuple(bias.shape) != (w_fp8.shape[0],):
        raise ValueError(f"block_fp8_linear: bias must be [{w_fp8.shape[0]}], got {tuple(bias.shape)}")
    if act_fp8 is None:
        act_fp8 = linear_w8a8_applies(x)
    if not use_triton(x, w_fp8):
        return (block_fp8_linear_w8a8_ref if act_fp8 else block_fp8_linear_ref)(x, w_fp8, scale_inv, bias)
    return _block_fp8_linear_triton(x, w_fp8, scale_inv, bias, config, act_fp8)


def _block_fp8_linear_triton(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor,
                             bias: torch.Tensor | None, config: dict | None, act_fp8: bool = False) -> torch.Tensor:
    m, k = x.shape
    n = w_fp8.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:  # an expert-parallel rank without tokens still runs its attention
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    cfg = {**_choose_config(m, n, x.dtype, act_fp8), **(config or {})}
    act8 = {}
    if act_fp8:
        x, a_scale = quantize_act_fp8(x if x.stride(-1) == 1 else x.contiguous())
        act8 = dict(ACT_SCALE=True, a_scale_ptr=a_scale, stride_asm=a_scale.stride(0), stride_ask=a_scale.stride(1))
    if WEIGHT_BLOCK[1] % cfg["block_k"]:
        raise ValueError(f"block_fp8_linear: block_k {cfg['block_k']} must divide {WEIGHT_BLOCK[1]}")
    grid = (triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"]),)
    _block_fp8_linear_kernel[grid](
        x, w_fp8, scale_inv, bias if bias is not None else scale_inv, y, m, n, k,
        x.stride(0), x.stride(1), w_fp8.stride(0), w_fp8.stride(1), scale_inv.stride(0), scale_inv.stride(1),
        y.stride(0), y.stride(1),
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], GROUP_M=cfg["group_m"],
        SCALE_N=WEIGHT_BLOCK[0], SCALE_K=WEIGHT_BLOCK[1], HAS_BIAS=bias is not None,
        DOT_F32=x.dtype == torch.float32 or is_interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **act8,
    )
    return y
