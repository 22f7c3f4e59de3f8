"""store_kv: the reference against a per-token loop, the Triton kernel against the reference."""

from __future__ import annotations

import sys

import pytest
import torch

from rayinfer.engine.sync_guard import no_host_sync
from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.kv_write import store_kv, store_kv_ref

CUDA = torch.cuda.is_available()


def make_case(num_tokens, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, seed=0, skip_every=5):
    """Distinct random slots, every ``skip_every``-th one negative (a padding row), and a random cache."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::skip_every] = -1
    k = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen)
    v = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen)
    cache = torch.randn((num_blocks, 2, block_size, num_kv_heads, head_dim), generator=gen)
    to = dict(device=device, dtype=dtype)
    return k.to(**to), v.to(**to), cache.to(**to), slots.to(device)


def test_ref_matches_loop():
    k, v, cache, slots = make_case(23, 6, 8, 2, 16, torch.float32, "cpu")
    want = cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[slot // 8, 0, slot % 8] = k[t]
            want[slot // 8, 1, slot % 8] = v[t]
    store_kv_ref(k, v, cache, slots)
    assert torch.equal(cache, want)


def test_ref_casts_to_cache_dtype():
    k, v, cache, slots = make_case(4, 2, 4, 1, 8, torch.float32, "cpu")
    cache = cache.bfloat16()
    store_kv_ref(k, v, cache, slots)
    assert torch.equal(cache[slots[1] // 4, 0, slots[1] % 4], k[1].bfloat16())


def check_kernel(device, cases):
    for i, (t, nb, bs, hkv, d, dtype, k_dtype) in enumerate(cases):
        k, v, cache, slots = make_case(t, nb, bs, hkv, d, dtype, device, seed=i)
        k, v = k.to(k_dtype), v.to(k_dtype)
        got, want = cache.clone(), cache.clone()
        store_kv(k, v, got, slots)
        store_kv_ref(k, v, want, slots)
        assert torch.equal(got, want), f"case {i}"


GPU_CASES = [
    (1, 4, 16, 8, 128, torch.bfloat16, torch.bfloat16),
    (300, 64, 16, 8, 128, torch.bfloat16, torch.bfloat16),
    (513, 80, 32, 8, 64, torch.bfloat16, torch.bfloat16),
    (100, 16, 16, 3, 80, torch.float32, torch.float32),
    (100, 16, 16, 4, 128, torch.float16, torch.float32),  # cast on store
    (257, 40, 16, 2, 64, torch.float32, torch.float32),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_matches_ref():
    check_kernel("cuda", GPU_CASES)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_no_host_sync():
    k, v, cache, slots = make_case(64, 16, 16, 8, 128, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    with no_host_sync():
        store_kv(k, v, cache, slots)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        check_kernel("cpu", [(9, 4, 4, 3, 16, torch.float32, torch.float32), (5, 2, 8, 2, 8, torch.float32, torch.float32)])
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
