"""Rotary embedding: the reference against complex rotation in float64, the kernel against the reference."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.rotary import rope_inv_freq, rotary, rotary_ref, rotary_store_kv, rotary_store_kv_ref

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def make_case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, max_pos=8192, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((num_tokens, num_heads, head_dim), generator=gen)
    k = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen)
    pos = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    return q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype), pos.to(device)


def test_ref_matches_complex_rotation():
    q, k, pos = make_case(9, 4, 2, 32, torch.float32, "cpu", max_pos=2000)
    inv_freq = rope_inv_freq(32, 10000.0)
    angle = pos.double()[:, None] * inv_freq.double()[None, :]
    rot = torch.polar(torch.ones_like(angle), angle)[:, None, :]  # e^{i theta}, [T, 1, D/2]

    def rotate(x):
        z = torch.complex(x[..., :16].double(), x[..., 16:].double()) * rot
        return torch.cat([z.real, z.imag], dim=-1)

    got_q, got_k = rotary_ref(q, k, pos, inv_freq)
    torch.testing.assert_close(got_q.double(), rotate(q), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got_k.double(), rotate(k), atol=2e-4, rtol=1e-4)


def check_kernel(device, cases):
    worst = 0.0
    for i, (t, h, hkv, d, dtype, theta, scaling) in enumerate(cases):
        q, k, pos = make_case(t, h, hkv, d, dtype, device, max_pos=131072 if scaling else 8192, seed=i)
        inv_freq = rope_inv_freq(d, theta, scaling).to(device)
        got = rotary(q, k, pos, inv_freq)
        want = rotary_ref(q, k, pos, inv_freq)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            tol = TOL[dtype]
            torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol, msg=lambda m: f"case {i}: {m}")
            worst = max(worst, (g.float() - w.float()).abs().max().item())
    return worst


def check_fused(device, cases, cache_dtype=None, qk_norm=False):
    """rotary_store_kv against the reference: rotated queries, and the cache (padding slots untouched);
    ``cache_dtype`` float8_e4m3fn checks an fp8 cache; ``qk_norm`` the per-head RMSNorm folded in (Qwen3),
    with q, k and v column slices of one stacked projection, as the model passes them."""
    for i, (t, h, hkv, d, dtype, theta, scaling) in enumerate(cases):
        q, k, pos = make_case(t, h, hkv, d, dtype, device, seed=10 + i)
        gen = torch.Generator().manual_seed(i)
        v = torch.randn((t, hkv, d), generator=gen).to(device=device, dtype=dtype)
        norm = None
        if qk_norm:  # q, k, v as views of [T, (H + 2 Hkv) * D], q and k scaled off unit variance
            qkv = torch.cat([(q * 3).reshape(t, -1), (k * 0.5).reshape(t, -1), v.reshape(t, -1)], dim=1)
            q, k, v = (x.view(t, -1, d) for x in qkv.split([h * d, hkv * d, hkv * d], dim=1))
            weights = (1 + 0.3 * torch.randn((2, d), generator=gen)).to(device=device, dtype=dtype)
            norm = (weights[0], weights[1], 1e-6)
        num_blocks, block_size = -(-t // 4) + 2, 4
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
        slots[::3] = -1  # padding rows
        slots = slots.to(device)
        cache = torch.randn((num_blocks, 2, block_size, hkv, d), generator=gen).to(device=device,
                                                                                   dtype=cache_dtype or dtype)
        want_cache = cache.clone()
        inv_freq = rope_inv_freq(d, theta, scaling).to(device)
        got_q = rotary_store_kv(q, k, v, pos, inv_freq, cache, slots, qk_norm=norm)
        want_q = rotary_store_kv_ref(q, k, v, pos, inv_freq, want_cache, slots, qk_norm=norm)
        if qk_norm:  # the reference normalizes: unit RMS per head before the weight and the rotation
            plain = rotary_store_kv_ref(q, k, v, pos, inv_freq, want_cache.clone(), slots)
            assert not torch.allclose(plain.float(), want_q.float(), atol=0.1), f"case {i}: norm had no effect"
        tol = TOL[dtype]
        # normalized heads (|x| up to ~5) through the rounded rotation: a flipped last bit of the norm's
        # rounding (its sum order) moves an output by one unit of the larger term, 1/32 in bf16 at 4-8
        qtol = max(tol, 0.07) if qk_norm and dtype == torch.bfloat16 else tol
        torch.testing.assert_close(got_q.float(), want_q.float(), atol=qtol, rtol=tol, msg=lambda m: f"case {i}: {m}")
        ctol = qtol if cache_dtype is None else 0.13  # one fp8 step (3 mantissa bits) apart at most
        torch.testing.assert_close(cache.float(), want_cache.float(), atol=ctol, rtol=ctol,
                                   msg=lambda m: f"case {i} cache: {m}")
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
        untouched[slots[slots >= 0]] = False
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[cache.element_size()]
        flat = lambda c: c.view(bits).transpose(1, 2).reshape(num_blocks * block_size, -1)  # noqa: E731
        assert torch.equal(flat(cache)[untouched], flat(want_cache)[untouched]), f"case {i}: padding wrote"


GPU_CASES = [
    (1, 32, 8, 128, torch.bfloat16, 500000.0, LLAMA3_SCALING),
    (1000, 32, 8, 128, torch.bfloat16, 500000.0, LLAMA3_SCALING),
    (77, 9, 3, 64, torch.bfloat16, 100000.0, None),  # SmolLM2-135M shape
    (64, 12, 4, 80, torch.float16, 10000.0, None),
    (200, 8, 8, 128, torch.float32, 10000.0, None),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_matches_ref():
    print(f"rotary: max abs err {check_kernel('cuda', GPU_CASES):.2e}")
    check_fused("cuda", GPU_CASES)
    check_fused("cuda", GPU_CASES, torch.float8_e4m3fn)
    check_fused("cuda", [c for c in GPU_CASES if c[3] in (64, 128)], qk_norm=True)  # power-of-two halves


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        check_kernel("cpu", [(5, 4, 2, 32, torch.float32, 10000.0, None), (3, 3, 1, 48, torch.float32, 10000.0, None)])
        check_fused("cpu", [(7, 4, 2, 32, torch.float32, 10000.0, None), (3, 3, 1, 48, torch.float32, 10000.0, None)])
        check_fused("cpu", [(7, 4, 2, 32, torch.float32, 10000.0, None), (5, 3, 1, 64, torch.bfloat16, 1e6, None)],
                    qk_norm=True)
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
