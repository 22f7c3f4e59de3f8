"""MLA's fused latent norm + RoPE + store: the reference against Hugging Face's rotation and RMSNorm, the
Triton kernel against the reference (interpreter on CPU, ``-m gpu`` on CUDA)."""

from __future__ import annotations

import sys

import pytest
import torch

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.mla_rope import (
    mla_rope_store, mla_rope_store_absorb, mla_rope_store_absorb_ref, mla_rope_store_absorb_triton, mla_rope_store_ref,
)

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_case(t, heads, nope, rank, rope, bs, num_blocks, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    to = dict(dtype=dtype, device=device)
    q = torch.randn(t, heads, nope + rope, generator=gen).to(**to)
    kv_a = torch.randn(t, rank + rope, generator=gen).to(**to)
    w = (1 + 0.1 * torch.randn(rank, generator=gen)).to(**to)
    angles = torch.rand(t, rope // 2, generator=gen) * 6
    cos, sin = angles.cos().to(**to), angles.sin().to(**to)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t].to(device)
    slots[1::4] = -1  # skipped tokens
    cache = torch.randn(num_blocks, bs, rank + rope, generator=gen).to(**to)
    return q, kv_a, w, cos, sin, cache, slots


def test_ref_matches_hf_rotation_and_norm():
    """Interleaved: Hugging Face's ``apply_rotary_pos_emb_interleave`` (de-interleave, then rotate-half);
    the cache row is RMSNorm(latent) then the roped key; a slot of -1 writes nothing."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    q, kv_a, w, cos, sin, cache, slots = make_case(5, 3, 4, 12, 8, 4, 4, torch.float32, "cpu")
    before = cache.clone()
    q_pe = mla_rope_store_ref(q, kv_a, w, 1e-6, cos, sin, cache, slots, True)
    full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    want_q, want_k = apply_rotary_pos_emb_interleave(q[None, :, :, 4:].transpose(1, 2), kv_a[None, None, :, 12:],
                                                     full_cos[None], full_sin[None])
    torch.testing.assert_close(q_pe, want_q[0].transpose(0, 1))
    latent = kv_a[:, :12]
    normed = w * latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + 1e-6)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            row = cache[s // 4, s % 4]
            torch.testing.assert_close(row[:12], normed[i])
            torch.testing.assert_close(row[12:], want_k[0, 0, i])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(cache.view(16, -1)[untouched], before.view(16, -1)[untouched])


def check(device, cases):
    worst = 0.0
    for i, (t, heads, nope, rank, rope, bs, dtype, interleave) in enumerate(cases):
        q, kv_a, w, cos, sin, cache, slots = make_case(t, heads, nope, rank, rope, bs, -(-t // bs) + 2, dtype, device, i)
        a, b = cache.clone(), cache.clone()
        got = mla_rope_store(q, kv_a, w, 1e-6, cos, sin, a, slots, interleave)
        want = mla_rope_store_ref(q, kv_a, w, 1e-6, cos, sin, b, slots, interleave)
        tol = TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"case {i}: {m}")
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, msg=lambda m: f"cache case {i}: {m}")
        worst = max(worst, (got.float() - want.float()).abs().max().item(), (a.float() - b.float()).abs().max().item())
    return worst


def check_absorb(device, cases, fn=mla_rope_store_absorb_triton):
    """The RoPE/store kernel with the absorbed query's W_UK product in the same launch, against the
    reference: q_latent, q_pe and the cache. cases: (T, H, Dn, R, P, block size, Dv, dtype, interleave)."""
    worst = 0.0
    for i, (t, heads, nope, rank, rope, bs, v, dtype, interleave) in enumerate(cases):
        q, kv_a, w, cos, sin, cache, slots = make_case(t, heads, nope, rank, rope, bs, -(-t // bs) + 2, dtype, device, i)
        w_kv_b = (torch.randn(heads, nope + v, rank, generator=torch.Generator().manual_seed(i)) / nope**0.5).to(
            device=device, dtype=dtype)
        a, b = cache.clone(), cache.clone()
        got_l, got_pe = fn(q, kv_a, w, 1e-6, cos, sin, a, slots, interleave, w_kv_b)
        want_l, want_pe = mla_rope_store_absorb_ref(q, kv_a, w, 1e-6, cos, sin, b, slots, interleave, w_kv_b)
        tol = TOL[dtype]
        for name, x, y in (("q_latent", got_l, want_l), ("q_pe", got_pe, want_pe), ("cache", a, b)):
            torch.testing.assert_close(x.float(), y.float(), atol=tol, rtol=tol, msg=lambda m: f"{name} case {i}: {m}")
            worst = max(worst, (x.float() - y.float()).abs().max().item())
    return worst


def test_absorb_dispatcher_on_cpu():
    """On CPU (no interpreter) mla_rope_store_absorb is the unfused pair: mla_rope_store, then the W_UK product."""
    check_absorb("cpu", [(3, 2, 8, 24, 8, 4, 6, torch.float32, True)], fn=mla_rope_store_absorb)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_matches_ref_on_gpu():
    cases = [(300, 16, 128, 512, 64, 64, torch.bfloat16, True), (7, 128, 128, 512, 64, 16, torch.bfloat16, False),
             (33, 3, 16, 24, 16, 4, torch.float32, True)]
    print(f"mla_rope_store: max abs err {check('cuda', cases):.2e}")
    b16 = torch.bfloat16
    absorb = [(1, 16, 128, 512, 64, 16, 128, b16, True), (4, 128, 128, 512, 64, 64, 128, b16, False),
              (2, 3, 16, 24, 16, 4, 8, torch.float32, True)]
    print(f"mla_rope_store_absorb: max abs err {check_absorb('cuda', absorb):.2e}")
    # the dispatcher takes the fused launch for a decode batch of bf16
    check_absorb("cuda", absorb[:1], fn=mla_rope_store_absorb)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        f32 = torch.float32
        check("cpu", [(9, 3, 16, 24, 16, 4, f32, True), (6, 4, 8, 32, 8, 8, f32, False)])
        # two 128-column latent slices (the second partial), a slot of -1 (token 1), Dn not a power of two
        check_absorb("cpu", [(3, 2, 12, 160, 16, 4, 8, f32, True), (2, 3, 16, 24, 8, 8, 16, f32, False)])
        import rayinfer.kernels.mla_rope as mr

        mr.ROPE_APART = 0  # the RoPE / store after the first W_UK product's program instead of its own
        check_absorb("cpu", [(3, 2, 12, 160, 16, 4, 8, f32, True)])
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
