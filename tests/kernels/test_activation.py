"""silu_and_mul: the reference against the formula in float64, the kernel against the reference."""

from __future__ import annotations

import sys

import pytest
import torch

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.activation import silu_and_mul, silu_and_mul_ref

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def test_ref_matches_formula():
    x = torch.randn(5, 2 * 48, dtype=torch.float64)
    gate, up = x[:, :48], x[:, 48:]
    torch.testing.assert_close(silu_and_mul_ref(x), gate / (1 + torch.exp(-gate)) * up)


def check_kernel(device, cases):
    worst = 0.0
    for i, (t, inter, dtype) in enumerate(cases):
        x = (torch.randn((t, 2 * inter), generator=torch.Generator().manual_seed(i)) * 4).to(device=device, dtype=dtype)
        got, want = silu_and_mul(x), silu_and_mul_ref(x)
        tol = TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"case {i}: {m}")
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    return worst


GPU_CASES = [(1, 14336, torch.bfloat16), (300, 14336, torch.bfloat16), (7, 1536, torch.float16), (33, 1000, torch.float32)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_matches_ref():
    print(f"silu_and_mul: max abs err {check_kernel('cuda', GPU_CASES):.2e}")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        check_kernel("cpu", [(3, 100, torch.float32), (2, 1500, torch.float32)])
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
