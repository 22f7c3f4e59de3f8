"""Single-row GEMV kernels (plain; SiLU-and-mul or RMSNorm prologue; residual-add epilogue) against
their references."""

from __future__ import annotations

import sys

import pytest
import torch

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.activation import silu_and_mul_ref
from rayinfer.kernels.gemv import (
    fused_linear,
    fused_linear_ref,
    fused_linear_triton,
    gemv_applies,
    linear,
    linear_triton,
    silu_and_mul_linear,
    silu_and_mul_linear_ref,
    silu_and_mul_linear_triton,
)

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def make_case(n, k, dtype, device, seed, bias=False, gated=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((1, 2 * k if gated else k), generator=gen)
    w = torch.randn((n, k), generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return to(x), to(w), to(b)


def close(got, want, what):
    tol = TOL[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape, what
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")
    return (got.float() - want.float()).abs().max().item()


def check_kernels(device, cases, plain, gated, config=None):
    """Each case through both kernels against the references; returns the largest abs error."""
    worst = 0.0
    for i, (n, k, dtype, bias) in enumerate(cases):
        x, w, b = make_case(n, k, dtype, device, i, bias)
        worst = max(worst, close(plain(x, w, b, **config or {}), torch.nn.functional.linear(x, w, b), f"case {i} linear"))
        xg, w, b = make_case(n, k, dtype, device, 100 + i, bias, gated=True)
        got = gated(xg, w, b, **config or {})
        worst = max(worst, close(got, silu_and_mul_linear_ref(xg, w, b), f"case {i} silu_and_mul_linear"))
    return max(worst, check_fused(device, cases, config))


def check_fused(device, cases, config=None):
    """The RMSNorm prologue and the in-place residual epilogue (alone and with each prologue)."""
    worst = 0.0
    for i, (n, k, dtype, bias) in enumerate(cases):
        gen = torch.Generator().manual_seed(200 + i)
        norm_w = (torch.rand(k, generator=gen) + 0.5).to(device=device, dtype=dtype)
        residual = torch.randn((1, n), generator=gen).to(device=device, dtype=dtype)
        for prologue in ("norm", "silu", None):
            x, w, b = make_case(n, k, dtype, device, 300 + i, bias, gated=prologue == "silu")
            x = x * 3.0  # an RMS far from 1, so a missing normalization shows
            kw = dict(norm_weight=norm_w if prologue == "norm" else None, eps=1e-5, silu_and_mul_input=prologue == "silu")
            worst = max(worst, close(fused_linear_triton(x, w, b, **kw, config=config), fused_linear_ref(x, w, b, **kw),
                                     f"case {i} {prologue} prologue"))
            res = residual.clone()
            got = fused_linear_triton(x, w, b, **kw, residual=res, config=config)
            assert got.data_ptr() == res.data_ptr(), "the residual is updated in place"
            worst = max(worst, close(got, fused_linear_ref(x, w, b, **kw, residual=residual),
                                     f"case {i} {prologue} prologue + residual"))
    return worst


def test_fused_ref_composes_the_unfused_ops():
    """The reference equals RMSNorm/SiLU, then linear, then the add, each from its own reference."""
    from rayinfer.kernels.norm import rms_norm_ref

    x, w, b = make_case(24, 32, torch.float32, "cpu", 5, bias=True)
    nw, r = torch.rand(32) + 0.5, torch.randn(1, 24)
    want = torch.nn.functional.linear(rms_norm_ref(x, nw, 1e-6), w, b) + r
    torch.testing.assert_close(fused_linear_ref(x, w, b, norm_weight=nw, residual=r), want)
    with pytest.raises(ValueError, match="exclusive"):
        fused_linear_ref(x, w, norm_weight=nw, silu_and_mul_input=True)
    # the dispatcher's fallback (CPU) updates the residual in place, like the kernel
    res = r.clone()
    out = fused_linear(x, w, b, norm_weight=nw, residual=res)
    assert out is res
    torch.testing.assert_close(res, want)


def test_ref_is_silu_then_linear():
    x, w, b = make_case(40, 64, torch.float32, "cpu", 0, bias=True, gated=True)
    gate, up = x[:, :64].double(), x[:, 64:].double()
    want = (gate * torch.sigmoid(gate) * up) @ w.double().T + b.double()
    torch.testing.assert_close(silu_and_mul_linear_ref(x, w, b).double(), want, atol=1e-4, rtol=1e-4)


def check_fp8(device, cases, config=None) -> float:
    """The GEMV on fp8 blocks (``weight_scale``) against the reference on the dequantized weight, with each
    prologue and the residual epilogue: (N, K, dtype, bias) with N and K off the 128 grid among them."""
    from rayinfer.kernels.block_fp8 import block_fp8_dequant_ref, quantize_block_fp8

    worst = 0.0
    for i, (n, k, dtype, bias) in enumerate(cases):
        gen = torch.Generator().manual_seed(400 + i)
        norm_w = (torch.rand(k, generator=gen) + 0.5).to(device=device, dtype=dtype)
        residual = torch.randn((1, n), generator=gen).to(device=device, dtype=dtype)
        for prologue in ("norm", "silu", None):
            x, w, b = make_case(n, k, torch.float32, device, 500 + i, bias, gated=prologue == "silu")
            q, s = quantize_block_fp8(w)
            wd = block_fp8_dequant_ref(q, s, torch.float32)  # what the kernel multiplies, in float32
            x, b = x.to(dtype) * 3.0, None if b is None else b.to(dtype)
            kw = dict(norm_weight=norm_w if prologue == "norm" else None, eps=1e-5, silu_and_mul_input=prologue == "silu")
            # the float32 product rounded to x's dtype, then the residual added (the kernel's and the
            # 16-bit reference's order: near-cancelling sums show a rounding of the product otherwise); the
            # SiLU prologue rounds silu(gate) and its product with up to x's dtype, as the kernel does
            ref_kw = {**kw, "norm_weight": None if kw["norm_weight"] is None else norm_w.float()}
            x_ref = x.float()
            if prologue == "silu":
                x_ref, ref_kw["silu_and_mul_input"] = silu_and_mul_ref(x).float(), False
            y = fused_linear_ref(x_ref, wd, None if b is None else b.float(), **ref_kw)
            want = (y.to(dtype).float() + residual.float()).to(dtype)
            got = fused_linear_triton(x, q, b, **kw, residual=residual.clone(), config=config, weight_scale=s)
            worst = max(worst, close(got, want, f"fp8 case {i} {prologue} prologue + residual"))
    return worst


def test_fp8_dispatch_falls_back_off_the_gpu():
    """fp8 blocks on a CPU (no interpreter) take block_fp8_linear after the unfused prologue; the GEMV's
    rule wants an fp8 weight with a scale and one 16-bit row."""
    from rayinfer.kernels.block_fp8 import block_fp8_linear_ref, quantize_block_fp8

    x, w, _ = make_case(200, 300, torch.float32, "cpu", 7)
    q, s = quantize_block_fp8(w)
    assert not gemv_applies(x.bfloat16(), q, s) and not gemv_applies(x.bfloat16(), w.bfloat16(), s)
    assert torch.equal(fused_linear(x, q, weight_scale=s), block_fp8_linear_ref(x, q, s))
    if CUDA:
        xc, qc, sc = x.cuda().bfloat16(), q.cuda(), s.cuda()
        assert gemv_applies(xc, qc, sc) and not gemv_applies(xc, qc)


def test_dispatch_rules():
    """CPU tensors (no interpreter) take the references; more than one row or float32 stays on cuBLAS."""
    x, w, _ = make_case(32, 64, torch.bfloat16, "cpu", 1)
    assert not gemv_applies(x, w)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    xg, w, _ = make_case(32, 64, torch.bfloat16, "cpu", 2, gated=True)
    assert torch.equal(silu_and_mul_linear(xg, w), silu_and_mul_linear_ref(xg, w))
    if CUDA:
        x, w, _ = make_case(32, 64, torch.bfloat16, "cuda", 3)
        assert gemv_applies(x, w)
        assert not gemv_applies(torch.cat([x, x]), w)
        assert not gemv_applies(x.float(), w.float())


def test_pdl_switch(monkeypatch):
    """PDL is off on CPU tensors, under the interpreter, and wherever RAYINFER_PDL=0; the GEMV tiles
    depend on it (4 warps for the tall shapes only under PDL)."""
    from rayinfer import envs
    from rayinfer.kernels import _triton_utils as tu
    from rayinfer.kernels.gemv import _choose_config

    assert not tu.use_pdl(torch.zeros(1))
    monkeypatch.setenv("RAYINFER_PDL", "0")
    tu._pdl_supported.cache_clear()
    assert not envs.pdl_enabled() and not tu._pdl_supported(0)
    monkeypatch.setenv("RAYINFER_PDL", "1")
    assert envs.pdl_enabled()
    tu._pdl_supported.cache_clear()
    if CUDA:
        major = torch.cuda.get_device_capability()[0]
        assert tu.use_pdl(torch.zeros(1, device="cuda")) == (major >= 9 and tu.gdc_wait is not None)
    assert _choose_config(6144, 4096, pdl=True)["num_warps"] == 4
    assert _choose_config(6144, 4096, pdl=False)["num_warps"] == 8
    assert _choose_config(28672, 4096, pdl=True)["block_n"] == 16
    tu._pdl_supported.cache_clear()


GPU_CASES = [  # (N, K, dtype, bias): Llama-3-8B's o_proj and down_proj, SmolLM2 widths, odd shapes
    (4096, 4096, torch.bfloat16, False),
    (4096, 14336, torch.bfloat16, False),
    (576, 1536, torch.float16, True),
    (1000, 300, torch.bfloat16, False),  # neither N nor K a tile multiple
    (6144, 4096, torch.bfloat16, False),  # QKV
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernels_match_refs_on_gpu():
    from rayinfer.engine.sync_guard import no_host_sync

    x, w, _ = make_case(4096, 4096, torch.bfloat16, "cuda", 0)
    with no_host_sync():
        linear(x, w), silu_and_mul_linear(torch.cat([x, x], 1), w)
        fused_linear(x, w, norm_weight=x[0], residual=torch.zeros_like(x))
    print(f"gemv: max abs err {check_kernels('cuda', GPU_CASES, linear_triton, silu_and_mul_linear_triton):.2e}")


def check_batched(device, dtype, heads=4, rows=(1, 3), nope=24, rank=40, v=20) -> float:
    """batched_linear_triton against the reference on MLA's two absorbed products: W_UK through its
    transposed view ([H, R, Dn], strides (., 1, R)) and W_UV as a slice of rows ([H, Dv, R]); x as the
    transposed [H, T, .] views the model passes."""
    from rayinfer.kernels.gemv import batched_linear_ref, batched_linear_triton

    gen = torch.Generator().manual_seed(0)
    w_kv_b = torch.randn(heads, nope + v, rank, generator=gen).to(device=device, dtype=dtype)
    worst = 0.0
    for t in rows:
        q = torch.randn(t, heads, nope + 8, generator=gen).to(device=device, dtype=dtype)[..., :nope]
        lat = torch.randn(t, heads, rank, generator=gen).to(device=device, dtype=dtype)
        for x, w in ((q.transpose(0, 1), w_kv_b[:, :nope].transpose(1, 2)), (lat.transpose(0, 1), w_kv_b[:, nope:])):
            got, want = batched_linear_triton(x, w), batched_linear_ref(x.float(), w.float())
            assert got.shape == want.shape and got.transpose(0, 1).is_contiguous()
            torch.testing.assert_close(got.float(), want, atol=2e-2 * nope**0.5, rtol=2e-2)
            worst = max(worst, (got.float() - want).abs().max().item())
    return worst


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fp8_gemv_on_gpu():
    """fp8 blocks at DeepSeek-V2-Lite's one-row shapes (qkv_a 3648 x 2048 with the norm, o_proj with the
    residual) and odd ones, through the dispatcher too."""
    from rayinfer.kernels.block_fp8 import block_fp8_linear, quantize_block_fp8

    cases = [(3648, 2048, torch.bfloat16, False), (2048, 2048, torch.bfloat16, False), (1000, 300, torch.float16, True),
             (4096, 7168, torch.bfloat16, False)]
    print(f"fp8 gemv: max abs err {check_fp8('cuda', cases):.2e}")
    x, w, _ = make_case(3072, 2048, torch.bfloat16, "cuda", 9)
    q, s = quantize_block_fp8(w.float())
    torch.testing.assert_close(fused_linear(x, q, weight_scale=s).float(), block_fp8_linear(x, q, s).float(),
                               atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_batched_gemv_on_gpu():
    from rayinfer.kernels.gemv import batched_linear

    print(f"batched gemv: max abs err {check_batched('cuda', torch.bfloat16, heads=16, nope=128, rank=512, v=128):.2e}")
    x = torch.randn(16, 1, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16, 512, 128, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(batched_linear(x, w).float(), torch.bmm(x.float(), w.float().mT), atol=0.5, rtol=2e-2)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        cases = [(48, 64, torch.float32, False), (40, 100, torch.float32, True), (37, 2048, torch.float32, True)]
        small = {"config": dict(block_n=16, block_k=64, num_warps=4, num_stages=2)}
        err = max(check_kernels("cpu", cases, linear_triton, silu_and_mul_linear_triton),
                  check_kernels("cpu", cases, linear_triton, silu_and_mul_linear_triton, small))
        # rank 520: W_UV's K loop takes a second (partial) 512-column step
        err_b = max(check_batched("cpu", torch.float32),
                    check_batched("cpu", torch.float32, heads=1, rows=(1,), rank=520))
        # fp8 blocks: N and K off the 128 grid (partial scale blocks), K tiles of one and of several blocks
        fp8_cases = [(200, 300, torch.float32, True), (130, 640, torch.float32, False)]
        err_f = max(check_fp8("cpu", fp8_cases), check_fp8("cpu", fp8_cases, dict(block_n=16, block_k=256,
                                                                                   num_warps=4, num_stages=2)))
        print(f"max abs err {err:.2e}, batched {err_b:.2e}, fp8 {err_f:.2e}")
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
