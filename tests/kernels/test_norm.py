"""RMSNorm: the reference against the formula in float64, the Triton kernel against the reference."""

from __future__ import annotations

import sys

import pytest
import torch

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.norm import rms_norm, rms_norm_ref

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def make_case(num_tokens, hidden, dtype, w_dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((num_tokens, hidden), generator=gen) * 3
    res = torch.randn((num_tokens, hidden), generator=gen)
    w = 1 + 0.1 * torch.randn(hidden, generator=gen)
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=w_dtype), res.to(device=device, dtype=dtype)


@pytest.mark.parametrize("with_residual", [False, True])
def test_ref_matches_formula(with_residual):
    x, w, res = make_case(7, 96, torch.float32, torch.float32, "cpu")
    eps = 1e-5
    h = (x + res).double() if with_residual else x.double()
    want = w.double() * h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
    got = rms_norm_ref(x, w, eps, res if with_residual else None)
    if with_residual:
        got, new_res = got
        assert torch.equal(new_res, x + res)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def check_kernel(device, cases):
    """Compare outputs (and the new residual exactly); return the largest abs error of the outputs."""
    worst = 0.0
    for i, (t, hidden, dtype, w_dtype, with_res) in enumerate(cases):
        x, w, res = make_case(t, hidden, dtype, w_dtype, device, seed=i)
        got = rms_norm(x, w, 1e-6, res if with_res else None)
        want = rms_norm_ref(x, w, 1e-6, res if with_res else None)
        if with_res:
            assert torch.equal(got[1], want[1]), f"case {i}: residual"
            got, want = got[0], want[0]
        assert got.dtype == want.dtype
        tol = TOL[got.dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"case {i}: {m}")
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    return worst


GPU_CASES = [
    (1, 4096, torch.bfloat16, torch.bfloat16, False),
    (333, 4096, torch.bfloat16, torch.bfloat16, True),
    (64, 8192, torch.bfloat16, torch.bfloat16, True),
    (17, 576, torch.bfloat16, torch.float32, True),  # SmolLM2 width, fp32 weight promotes the output
    (50, 5120, torch.float16, torch.float16, True),
    (31, 4096, torch.float32, torch.float32, False),
    (31, 3000, torch.float32, torch.float32, True),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_matches_ref():
    print(f"rms_norm: max abs err {check_kernel('cuda', GPU_CASES):.2e}")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        check_kernel("cpu", [(3, 100, torch.float32, torch.float32, True), (2, 64, torch.float32, torch.float32, False)])
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
