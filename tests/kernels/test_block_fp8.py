"""FP8 block quantization (DeepSeek-V3's 128 x 128 format): quantize -> dequantize round trip within
e4m3's rounding bound, the references against plain formulas, and the W8A16 Triton GEMM against the
reference (through the interpreter on CPU; on CUDA with ``-m gpu``).

Run directly: ``python tests/kernels/test_block_fp8.py`` runs the GPU tests, ``--interpret`` (with
``TRITON_INTERPRET=1``) the small interpreter checks.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.batch_invariant import batch_invariant_mode
from rayinfer.kernels.block_fp8 import (
    FP8_MAX,
    block_fp8_dequant_ref,
    block_fp8_linear,
    block_fp8_linear_ref,
    block_fp8_linear_w8a8_ref,
    linear_w8a8_applies,
    quantize_act_fp8,
    quantize_act_fp8_ref,
    quantize_block_fp8,
)

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
W8A8_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("shape", [(128, 256), (200, 300), (1, 5), (3, 130, 257)])
def test_round_trip_within_e4m3_rounding(shape):
    """|w - dequant(quant(w))| <= max(|w| / 16, scale / 1024) elementwise: e4m3 keeps 3 mantissa bits
    (half a step is at most 1/16 of a normal value) and its subnormal step is 2^-9 of the block scale."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, shape[-1])
    q, s = quantize_block_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    dq = block_fp8_dequant_ref(q, s)
    scale = s.repeat_interleave(128, -2)[..., : shape[-2], :].repeat_interleave(128, -1)[..., : shape[-1]]
    bound = torch.maximum(w.abs() / 16, scale / 1024) * (1 + 1e-5)
    assert ((w - dq).abs() <= bound).all()
    # each block's largest magnitude lands on +-448 exactly, so it comes back to within float32 rounding
    blocks = F.pad(q.float(), (0, -shape[-1] % 128, 0, -shape[-2] % 128))
    blocks = blocks.unflatten(-1, (-1, 128)).unflatten(-3, (-1, 128))
    assert (blocks.abs().amax(dim=(-3, -1)) == FP8_MAX).all()


def test_zero_block_gets_scale_one_and_dequant_orders_blocks():
    w = torch.zeros(256, 384)
    w[128:, 256:] = torch.arange(128 * 128, dtype=torch.float32).view(128, 128) / 1000
    q, s = quantize_block_fp8(w)
    assert s.shape == (2, 3) and (s.flatten()[:5] == 1).all() and s[1, 2] == w.max() / FP8_MAX
    assert (q.float()[:128] == 0).all() and (q.float()[:, :256] == 0).all()
    # a hand-made scale table: block (i, j) of ones times i * 10 + j
    s = torch.tensor([[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]])
    dq = block_fp8_dequant_ref(torch.ones(200, 300).to(torch.float8_e4m3fn), s, torch.float64)
    assert dq.dtype == torch.float64 and dq[0, 0] == 0 and dq[127, 128] == 1
    assert dq[128, 299] == 12 and dq[199, 255] == 11


def test_references_and_errors():
    gen = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(70, 200, generator=gen), torch.randn(2, 3, 200, generator=gen), torch.randn(70, generator=gen)
    q, s = quantize_block_fp8(w)
    torch.testing.assert_close(block_fp8_linear_ref(x, q, s, b), F.linear(x, block_fp8_dequant_ref(q, s), b))
    y = block_fp8_linear(x[0], q, s, b)  # CPU without the interpreter: the reference
    assert torch.equal(y, block_fp8_linear_ref(x[0], q, s, b))
    with pytest.raises(ValueError, match="scale_inv"):
        block_fp8_dequant_ref(q, s[:, :1])
    with pytest.raises(ValueError, match="scale_inv"):
        block_fp8_linear(x[0], q, s.double())
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        block_fp8_linear(x[0], w, s)
    with pytest.raises(ValueError, match="do not multiply"):
        block_fp8_linear(x[0, :, :100], q, s)
    with pytest.raises(ValueError, match="bias"):
        block_fp8_linear(x[0], q, s, b[:5])


def make_case(seed, m, n, k, dtype, bias, device):
    """x [m, k] of ``dtype``, an [n, k] weight quantized to fp8 blocks (q, s), and a bias [n] or None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    q, s = quantize_block_fp8((torch.randn(n, k, generator=gen) / k**0.5).to(device))
    b = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if bias else None
    return x, q, s, b


def check_kernel(device, cases) -> float:
    """Each (M, N, K, dtype, bias, tile config) through the kernel against the reference; the largest
    abs error. The reference takes the product in float64 over the dequantized weight (what the kernel
    computes in float32), so only x's dtype's output rounding separates them."""
    worst = 0.0
    for i, (m, n, k, dtype, bias, config) in enumerate(cases):
        x, q, s, b = make_case(100 + i, m, n, k, dtype, bias, device)
        got = block_fp8_linear(x, q, s, b, config, act_fp8=False)
        want = F.linear(x.double(), block_fp8_dequant_ref(q, s, torch.float64), None if b is None else b.double())
        assert got.dtype == dtype and got.shape == (m, n), f"case {i}"
        tol = TOL[dtype]
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, msg=lambda msg: f"case {i}: {msg}")
        ref = block_fp8_linear_ref(x, q, s, b)  # the weight rounded to x's dtype first: close, not equal
        torch.testing.assert_close(got.float(), ref.float(), atol=2 * tol, rtol=2 * tol,
                                   msg=lambda msg: f"case {i}: {msg}")
        worst = max(worst, (got.double() - want).abs().max().item() if got.numel() else 0.0)
    return worst


def check_w8a8_kernel(device, cases) -> float:
    """Each (M, N, K, dtype, bias, tile config) through the W8A8 kernel against
    :func:`block_fp8_linear_w8a8_ref` (the same quantized activations and weights, one float32 GEMM), which
    differs from the W8A16 reference by more than rounding; the largest abs error."""
    worst = 0.0
    for i, (m, n, k, dtype, bias, config) in enumerate(cases):
        x, q, s, b = make_case(200 + i, m, n, k, dtype, bias, device)
        got = block_fp8_linear(x, q, s, b, config, act_fp8=True)
        want = block_fp8_linear_w8a8_ref(x, q, s, b)
        assert got.dtype == dtype and got.shape == (m, n), f"case {i}"
        # the same quantized products in float32 on both sides: summation order and the output's rounding
        tol = W8A8_TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda msg: f"W8A8 case {i}: {msg}")
        if m and dtype != torch.float32:  # the activations' quantization shows against the 16-bit reference
            assert (want.float() - block_fp8_linear_ref(x, q, s, b).float()).abs().max() > 2 * tol, f"case {i}"
        worst = max(worst, (got.float() - want.float()).abs().max().item() if got.numel() else 0.0)
    return worst


def test_w8a8_reference_and_default():
    """The W8A8 reference quantizes x per row and 128 columns; without Triton ``act_fp8=True`` runs it; the
    default scheme is W8A16 on a CPU and in batch-invariant mode."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 300, generator=gen), torch.randn(70, 300, generator=gen) / 300**0.5
    q, s = quantize_block_fp8(w)
    qa, sa = quantize_act_fp8_ref(x)
    xa = qa.float() * sa.repeat_interleave(128, dim=1)[:, :300]
    torch.testing.assert_close(block_fp8_linear_w8a8_ref(x, q, s), F.linear(xa, block_fp8_dequant_ref(q, s)))
    assert torch.equal(block_fp8_linear(x, q, s, act_fp8=True), block_fp8_linear_w8a8_ref(x, q, s))
    assert not linear_w8a8_applies(x[:1].expand(4096, 300))
    if CUDA:
        xc = x[:1].cuda().bfloat16().expand(4096, 300)
        with batch_invariant_mode():
            assert not linear_w8a8_applies(xc)


# (M, N, K, dtype, bias, tile override): N and K off the 128 grid; a BLOCK_N of 256 spans two scale
# blocks, a BLOCK_K of 32 or 64 takes several K steps per scale block
INTERPRET_CASES = [
    (1, 200, 300, torch.float32, True, None),
    (5, 130, 257, torch.bfloat16, False, dict(block_n=256, block_k=64)),
    (20, 64, 256, torch.float16, True, dict(block_m=16, block_n=32, block_k=32)),
    (33, 300, 140, torch.bfloat16, True, None),
    (0, 64, 64, torch.bfloat16, False, None),
]
# W8A8: K off the 128 grid (a partial last activation group), BLOCK_K 64 (two K steps per scale group)
INTERPRET_W8A8_CASES = [
    (9, 200, 300, torch.bfloat16, True, None),
    (20, 64, 256, torch.float16, False, dict(block_m=16, block_n=32, block_k=64)),
]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


# DeepSeek-V3's dense shapes (N, K): q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj, dense gate/up and
# down, a shared expert's down; plus one off the 128 grid
GPU_SHAPES = [(1536, 7168), (24576, 1536), (576, 7168), (7168, 16384), (18432, 7168), (7168, 18432), (7168, 2048),
              (1000, 300)]


def test_act_quant_ref_groups():
    """Per-token-group activation quantization: a scale per row and 128 columns (the last group partial),
    scale 1 for an all-zero group, values within e4m3 rounding of the input."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 300, generator=gen) * torch.tensor([0.01, 1.0, 100.0, 3.0, 0.5])[:, None]
    x[3, 128:256] = 0
    q, scale = quantize_act_fp8_ref(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (5, 3)
    assert scale[3, 1] == 1 and torch.all(q[3, 128:256].float() == 0)
    back = q.float() * scale.repeat_interleave(128, dim=1)[:, :300]
    assert torch.all((back - x).abs() <= 0.07 * x.abs() + 1e-12)  # 3 mantissa bits: half a step is 1/16
    amax = x.abs().view(5, -1)[:, :256].reshape(5, 2, 128).amax(-1)
    torch.testing.assert_close(scale[:, :2], torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_act_quant_kernel_matches_ref_on_gpu():
    gen = torch.Generator().manual_seed(4)
    for m, k, dtype in ((1, 2048, torch.bfloat16), (4096, 1408, torch.bfloat16), (33, 300, torch.float16),
                        (17, 7168, torch.float32)):
        x = (torch.randn(m, k, generator=gen) * 4).to("cuda", dtype)
        x[0, :128] = 0
        q, s = quantize_act_fp8(x)
        qr, sr = quantize_act_fp8_ref(x)
        assert torch.equal(s, sr), (m, k, dtype)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)), (m, k, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_matches_ref_on_gpu():
    cases = [(m, n, k, torch.bfloat16, m == 5, None) for m in (1, 5, 64, 300) for n, k in GPU_SHAPES]
    cases += [(33, 1000, 300, torch.float16, True, None), (33, 1000, 300, torch.float32, True, None),
              (300, 1000, 300, torch.float32, False, None), (7, 1000, 300, torch.float32, False, None)]
    print(f"block_fp8_linear: max abs err {check_kernel('cuda', cases):.2e}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_w8a8_kernel_matches_ref_on_gpu():
    """W8A8 on DeepSeek-V2-Lite's and V3's dense shapes at prefill sizes (the default from
    ``W8A8_FROM_ROWS`` rows) and on small and odd shapes with explicit ``act_fp8``."""
    cases = [(m, n, k, torch.bfloat16, m == 300, None) for m in (300, 2048)
             for n, k in ((3072, 2048), (576, 2048), (2048, 2048), (4096, 512), (1536, 7168), (7168, 2048))]
    cases += [(1, 1000, 300, torch.bfloat16, True, None), (33, 1000, 300, torch.float16, False, None),
              (200, 1000, 300, torch.float16, True, None)]
    print(f"block_fp8_linear W8A8: max abs err {check_w8a8_kernel('cuda', cases):.2e}")
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4096, 2048, generator=gen).to("cuda", torch.bfloat16)
    q, s = quantize_block_fp8((torch.randn(3072, 2048, generator=gen) / 2048**0.5).cuda())
    assert linear_w8a8_applies(x) and torch.equal(block_fp8_linear(x, q, s), block_fp8_linear(x, q, s, act_fp8=True))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_rows_do_not_depend_on_the_batch_on_gpu():
    """In batch-invariant mode a row's bits are the same alone or among 300 rows: every row count takes one
    tile set. Outside the mode the tiles follow the row count (16-row tiles run mma.sync on Hopper, larger
    ones the warpgroup MMA, and an H200 rounds a few sums differently between them), so there only rows
    of the same tile bucket (up to 16) must agree."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(300, 7168, generator=gen).to("cuda", torch.bfloat16)
    q, s = quantize_block_fp8((torch.randn(2048, 7168, generator=gen) / 7168**0.5).cuda())
    with batch_invariant_mode():
        full = block_fp8_linear(x, q, s)
        for m in (1, 5, 16, 64, 128):
            assert torch.equal(block_fp8_linear(x[:m], q, s), full[:m]), m
    sixteen = block_fp8_linear(x[:16], q, s)
    for m in (1, 5):
        assert torch.equal(block_fp8_linear(x[:m], q, s), sixteen[:m]), m


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        print(f"max abs err {check_kernel('cpu', INTERPRET_CASES):.2e}")
        print(f"W8A8 max abs err {check_w8a8_kernel('cpu', INTERPRET_W8A8_CASES):.2e}")
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
