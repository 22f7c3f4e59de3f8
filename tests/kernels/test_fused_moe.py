"""fused_moe: the reference against a per-token float64 loop, the alignment by hand, the Triton kernel
against the reference (interpreter on CPU, ``-m gpu`` on CUDA)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.fused_moe import (
    fused_moe, fused_moe_ref, fused_moe_slots, fused_moe_slots_ref, moe_align, sum_slots,
)

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def make_case(num_tokens, num_experts, hidden, inter, top_k, dtype, device, seed=0, skip_every=0):
    """Random experts and distinct top-k ids per token; every ``skip_every``-th (token, slot) is -1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1)[1]
    if skip_every:
        ids.view(-1)[::skip_every] = -1
    weights = torch.rand(num_tokens, top_k, generator=gen)
    to = dict(device=device, dtype=dtype)
    return x.to(**to), w13.to(**to), w2.to(**to), ids.to(device), weights.to(device)


def loop_moe(x, w13, w2, ids, weights):
    """Per token and slot, in float64."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    inter = w2.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            if 0 <= e < w13.shape[0]:
                gate_up = w13[e] @ x[t]
                out[t] += weights[t, j] * (w2[e] @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
    return out


@pytest.mark.parametrize("case", [(1, 4, 16, 8, 1, 0), (7, 8, 32, 24, 2, 0), (13, 6, 24, 16, 3, 4),
                                  (0, 4, 16, 8, 2, 0)])
def test_ref_matches_loop(case):
    x, w13, w2, ids, w = make_case(*case[:5], torch.float32, "cpu", skip_every=case[5])
    got = fused_moe_ref(x, w13, w2, ids, w).double()
    torch.testing.assert_close(got, loop_moe(x, w13, w2, ids, w), atol=1e-5, rtol=1e-5)


def test_slots_ref_sum_to_ref():
    """Per-slot outputs (expert parallelism's batch-invariant combine): zeros at skipped slots, and their
    sum is the routed output."""
    x, w13, w2, ids, w = make_case(13, 6, 24, 16, 3, torch.float32, "cpu", skip_every=4)
    slots = fused_moe_slots_ref(x, w13, w2, ids, w)
    assert slots.shape == (13, 3, 24) and slots.dtype == torch.float32
    assert (slots.view(-1, 24)[::4] == 0).all()
    torch.testing.assert_close(sum_slots(slots), fused_moe_ref(x, w13, w2, ids, w), atol=1e-5, rtol=1e-5)


def test_ref_rejects_bad_shapes():
    x, w13, w2, ids, w = make_case(3, 4, 16, 8, 2, torch.float32, "cpu")
    with pytest.raises(ValueError):
        fused_moe_ref(x[:, :8], w13, w2, ids, w)
    with pytest.raises(ValueError):
        fused_moe_ref(x, w13, w2[:, :, :4], ids, w)
    with pytest.raises(ValueError):
        fused_moe_ref(x, w13, w2, ids, w[:, :1])


def test_moe_align_by_hand():
    ids = torch.tensor([[2, 0], [2, -1], [0, 2]])  # pairs 0..5: experts 2,0,2,-,0,2
    sorted_pairs, block_experts = moe_align(ids, num_experts=3, block_m=2)
    # expert 0 -> pairs 1,4; expert 1 -> none; expert 2 -> pairs 0,2,5 (+ one pad); sentinel is 6
    assert sorted_pairs.tolist()[:6] == [1, 4, 0, 2, 5, 6]
    assert set(sorted_pairs.tolist()[6:]) == {6}
    assert block_experts.tolist()[:2] == [0, 2] and block_experts.tolist()[2] == 2
    assert all(e == -1 for e in block_experts.tolist()[3:])


def check_kernel(device, cases):
    worst = 0.0
    for i, (t, e, h, inter, k, dtype) in enumerate(cases):
        x, w13, w2, ids, w = make_case(t, e, h, inter, k, dtype, device, seed=i, skip_every=7)
        got, want = fused_moe(x, w13, w2, ids, w), fused_moe_ref(x, w13, w2, ids, w)
        tol = TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"case {i}: {m}")
        worst = max(worst, (got.float() - want.float()).abs().max().item())
        if i == 0:  # the unsummed outputs take the same kernels
            torch.testing.assert_close(fused_moe_slots(x, w13, w2, ids, w), fused_moe_slots_ref(x, w13, w2, ids, w),
                                       atol=tol, rtol=tol, msg=lambda m: f"slots: {m}")
    return worst


GPU_CASES = [
    (1, 64, 2048, 768, 8, torch.bfloat16),
    (300, 64, 2048, 768, 8, torch.bfloat16),
    (2048, 128, 1024, 512, 8, torch.bfloat16),
    (5, 8, 100, 36, 2, torch.float16),
    (37, 8, 64, 48, 2, torch.float32),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_matches_ref():
    print(f"fused_moe: max abs err {check_kernel('cuda', GPU_CASES):.2e}")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        f32 = torch.float32
        check_kernel("cpu", [(5, 4, 32, 16, 2, f32), (1, 8, 48, 24, 3, f32), (40, 6, 40, 20, 2, f32)])
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
