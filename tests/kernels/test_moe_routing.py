"""MoE routers: the Triton kernels against the torch references (interpreter on CPU, ``-m gpu`` on CUDA),
and the references against Hugging Face's routers."""

from __future__ import annotations

import sys

import pytest
import torch

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.batch_invariant import batch_invariant_mode
from rayinfer.kernels.moe_routing import (
    append_shared_experts, grouped_topk, grouped_topk_ref, grouped_topk_triton, norm_router_logits,
    norm_router_logits_triton, router_gemm_triton, router_grouped_topk, router_logits_triton, softmax_topk,
    softmax_topk_ref, softmax_topk_triton,
)
from rayinfer.kernels.norm import rms_norm_ref

CUDA = torch.cuda.is_available()


def distinct_logits(num_tokens: int, num_experts: int, device, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Random logits whose values (and so scores and group scores) have no ties: a permutation of a grid."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.linspace(-4.0, 4.0, num_experts)
    rows = torch.stack([grid[torch.randperm(num_experts, generator=gen)] for _ in range(num_tokens)])
    rows = rows + 1e-3 * torch.rand(num_tokens, num_experts, generator=gen)
    return rows.to(device=device, dtype=dtype)


def check_grouped(device, cases) -> None:
    """cases: (T, L, k, G, topk_groups, renormalize, scale)."""
    for i, (t, e, k, g, tg, renorm, scale) in enumerate(cases):
        logits = distinct_logits(t, e, device, seed=i)
        bias = (torch.randn(e, generator=torch.Generator().manual_seed(100 + i)) * 0.1).to(device)
        with batch_invariant_mode():  # the reference's ids then come by descending choice, as the kernel's
            want_w, want_ids = grouped_topk_ref(logits, bias, k, g, tg, renorm, scale)
        got_w, got_ids = grouped_topk_triton(logits, bias, k, g, tg, renorm, scale)
        assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32, f"case {i}"
        assert torch.equal(got_ids, want_ids), f"case {i}: {got_ids.tolist()} != {want_ids.tolist()}"
        torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5, msg=lambda m: f"case {i}: {m}")


def check_fused_router(device, cases) -> None:
    """The router-logits kernel (float32 from bf16/fp32 hidden states and gate) and the routing kernel
    appending S shared experts, against the reference on ``linear(hidden.float(), gate.float())``.
    cases: (T, L, H, k, G, topk_groups, renormalize, scale, S, dtype)."""
    for i, (t, e, h, k, g, tg, renorm, scale, shared, dtype) in enumerate(cases):
        gen = torch.Generator().manual_seed(i)
        hidden = torch.randn(t, h, generator=gen).to(device=device, dtype=dtype)
        gate = (torch.randn(e, h, generator=gen) / h**0.5).to(device=device, dtype=dtype)
        bias = (torch.randn(e, generator=gen) * 0.1).to(device)
        logits = torch.nn.functional.linear(hidden.float(), gate.float())
        with batch_invariant_mode():
            want_w, want_ids = grouped_topk_ref(logits, bias, k, g, tg, renorm, scale)
        want_w, want_ids = append_shared_experts(want_w, want_ids, e, shared)
        got_logits = router_logits_triton(hidden, gate)
        torch.testing.assert_close(got_logits, logits, atol=1e-5, rtol=1e-5)
        # the prefill-sized GEMM: 16-bit products are exact in float32, so only the summation order differs
        torch.testing.assert_close(router_gemm_triton(hidden, gate), logits, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"router GEMM {i}: {m}")
        got_w, got_ids = grouped_topk_triton(got_logits, bias, k, g, tg, renorm, scale, shared)
        assert got_ids.shape == (t, k + shared), f"case {i}"
        assert torch.equal(got_ids, want_ids), f"case {i}: {got_ids.tolist()} != {want_ids.tolist()}"
        torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=1e-4, msg=lambda m: f"case {i}: {m}")
        if device == "cuda":  # the dispatcher takes the fused kernel here; the same routes
            got_w2, got_ids2 = router_grouped_topk(hidden, gate, bias, k, g, tg, renorm, scale, shared)
            assert torch.equal(got_ids2, got_ids), f"case {i}"
        if h <= 2048:  # the post-attention norm in the kernel's prologue: its normed rows and their logits
            norm_w = (0.5 + torch.rand(h, generator=gen)).to(device=device, dtype=dtype)
            x = rms_norm_ref(hidden, norm_w, 1e-6)
            got_logits, got_x = norm_router_logits_triton(hidden, gate, norm_w, 1e-6)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got_x.float(), x.float(), atol=tol, rtol=tol, msg=lambda m: f"normed {i}: {m}")
            torch.testing.assert_close(got_logits, torch.nn.functional.linear(got_x.float(), gate.float()),
                                       atol=1e-5, rtol=1e-5, msg=lambda m: f"normed logits {i}: {m}")
            if device == "cuda":
                logits3, x3 = norm_router_logits(hidden, norm_w, 1e-6, gate)
                w3, ids3 = grouped_topk(logits3, bias, k, g, tg, renorm, scale, shared)
                assert torch.equal(x3, got_x) and ids3.shape == (t, k + shared), f"case {i}"


def test_router_from_hidden_and_shared_slots_on_cpu():
    """router_grouped_topk's torch path (the GEMM then the reference) appends the shared experts as slots
    k .. k+S-1 with weight 1 and routes as grouped_topk on the float32 logits."""
    gen = torch.Generator().manual_seed(0)
    hidden, gate, bias = torch.randn(5, 32, generator=gen), torch.randn(16, 32, generator=gen), torch.zeros(16)
    w, ids = router_grouped_topk(hidden, gate, bias, 3, 4, 2, True, 2.5, num_shared=2)
    want_w, want_ids = grouped_topk(torch.nn.functional.linear(hidden, gate), bias, 3, 4, 2, True, 2.5)
    assert ids.shape == (5, 5) and torch.equal(ids[:, :3], want_ids)
    assert ids[:, 3:].tolist() == [[16, 17]] * 5 and w[:, 3:].tolist() == [[1.0, 1.0]] * 5
    torch.testing.assert_close(w[:, :3], want_w)
    with pytest.raises(ValueError, match="does not match gate weight"):
        router_grouped_topk(hidden, gate[:, :8], bias, 3, 4, 2, True, 2.5)
    # with the norm first (CPU: rms_norm, then the same router)
    norm_w = torch.rand(32, generator=gen) + 0.5
    logits2, x = norm_router_logits(hidden, norm_w, 1e-6, gate)
    w2, ids2 = grouped_topk(logits2, bias, 3, 4, 2, True, 2.5, 2)
    torch.testing.assert_close(x, rms_norm_ref(hidden, norm_w, 1e-6))
    want_w2, want_ids2 = router_grouped_topk(x, gate, bias, 3, 4, 2, True, 2.5, num_shared=2)
    assert torch.equal(ids2, want_ids2)
    torch.testing.assert_close(w2, want_w2)


def check_softmax(device, cases) -> None:
    """cases: (T, L, k, renormalize, dtype)."""
    for i, (t, e, k, renorm, dtype) in enumerate(cases):
        logits = distinct_logits(t, e, device, dtype, seed=i)
        want_w, want_ids = softmax_topk_ref(logits, k, renorm)
        got_w, got_ids = softmax_topk_triton(logits, k, renorm)
        assert got_ids.dtype == torch.int64 and got_w.dtype == dtype, f"case {i}"
        assert torch.equal(got_ids, want_ids), f"case {i}: {got_ids.tolist()} != {want_ids.tolist()}"
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got_w, want_w, atol=tol, rtol=tol, msg=lambda m: f"case {i}: {m}")


def test_refs_match_hugging_face():
    """The references equal Hugging Face's routers (DeepSeek-V3's and Qwen3-MoE's) on random weights."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                           norm_topk_prob=True, routed_scaling_factor=2.5, moe_intermediate_size=8)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.1)
    x = torch.randn(9, 16)
    logits, hf_w, hf_ids = router(x)
    w, ids = grouped_topk_ref(logits, router.e_score_correction_bias, 3, 4, 2, True, 2.5)
    hf_order, order = hf_ids.sort(1).indices, ids.sort(1).indices  # HF's topk(sorted=False): compare as sets
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    torch.testing.assert_close(hf_w.gather(1, hf_order), w.gather(1, order))

    qcfg = Qwen3MoeConfig(hidden_size=16, num_experts=12, num_experts_per_tok=4, norm_topk_prob=True,
                          moe_intermediate_size=8)
    block = Qwen3MoeSparseMoeBlock(qcfg)
    with torch.no_grad():
        block.gate.weight.normal_()
    _, hf_w, hf_ids = block.gate(x)
    w, ids = softmax_topk_ref(torch.nn.functional.linear(x, block.gate.weight), 4, True)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w)


def test_dispatchers_reject_bad_settings():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk(logits, 9, True)
    with pytest.raises(ValueError, match="num_groups=3"):
        grouped_topk(logits, torch.zeros(8), 2, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="cannot hold top_k=3"):
        grouped_topk(logits, torch.zeros(8), 3, 4, 1, True, 1.0)


GROUPED_GPU = [(1, 256, 8, 8, 4, True, 2.5), (333, 256, 8, 8, 4, True, 2.5), (64, 64, 6, 1, 1, False, 1.0),
               (17, 160, 6, 8, 3, True, 16.0)]
SOFTMAX_GPU = [(1, 128, 8, True, torch.bfloat16), (1000, 128, 8, True, torch.bfloat16),
               (7, 60, 4, False, torch.float32), (33, 8, 2, True, torch.float16)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernels_match_refs_on_gpu():
    check_grouped("cuda", GROUPED_GPU)
    check_softmax("cuda", SOFTMAX_GPU)
    b16 = torch.bfloat16
    check_fused_router("cuda", [(1, 64, 2048, 6, 1, 1, False, 1.0, 2, b16), (128, 64, 2048, 6, 1, 1, False, 1.0, 2, b16),
                                (7, 128, 2048, 8, 1, 1, True, 1.0, 0, b16), (33, 160, 1536, 6, 8, 3, True, 16.0, 2, b16),
                                (3, 64, 100, 6, 1, 1, False, 1.0, 1, torch.float32),
                                (300, 64, 2048, 6, 1, 1, False, 1.0, 2, b16)])


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernels_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        check_grouped("cpu", [(3, 16, 3, 4, 2, True, 2.5), (2, 12, 2, 1, 1, False, 1.0), (2, 24, 4, 3, 3, True, 1.5)])
        f32 = torch.float32
        check_fused_router("cpu", [(3, 16, 40, 3, 4, 2, True, 2.5, 2, f32), (2, 12, 24, 2, 1, 1, False, 1.0, 0, f32),
                                   (2, 64, 300, 6, 1, 1, False, 1.0, 2, f32)])
        check_softmax("cpu", [(3, 12, 4, True, torch.float32), (2, 8, 2, False, torch.float32),
                              (2, 20, 3, True, torch.bfloat16)])
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
