"""copy_blocks: the reference against a per-block loop, the Triton kernel against the reference."""

from __future__ import annotations

import sys

import pytest
import torch

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.block_copy import copy_blocks, copy_blocks_ref

CUDA = torch.cuda.is_available()


def make_case(num_layers, num_blocks, num_pairs, block_shape, dtype, device, seed=0):
    """A random cache and ``num_pairs`` copies whose destinations are distinct and never sources."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=gen)
    src = ids[:num_pairs]
    dst = ids[num_pairs : 2 * num_pairs]
    src = src[torch.randint(0, num_pairs, (num_pairs,), generator=gen)]  # a source may be copied twice
    cache = torch.randn((num_layers, num_blocks, *block_shape), generator=gen)
    return cache.to(device=device, dtype=dtype), src.to(device), dst.to(device)


def test_ref_matches_loop():
    cache, src, dst = make_case(3, 12, 4, (2, 4, 2, 8), torch.float32, "cpu")
    want = cache.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        for layer in range(3):
            want[layer, d] = cache[layer, s]
    copy_blocks_ref(cache, src, dst)
    assert torch.equal(cache, want)


def test_ref_empty_is_noop():
    cache, _, _ = make_case(2, 4, 1, (2, 4, 1, 8), torch.float32, "cpu")
    before = cache.clone()
    copy_blocks_ref(cache, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert torch.equal(cache, before)


def check_kernel(device, cases):
    for i, (layers, blocks, pairs, shape, dtype) in enumerate(cases):
        cache, src, dst = make_case(layers, blocks, pairs, shape, dtype, device, seed=i)
        got, want = cache.clone(), cache.clone()
        copy_blocks(got, src, dst)
        copy_blocks_ref(want, src, dst)
        assert torch.equal(got, want), f"case {i}"


GPU_CASES = [
    (32, 256, 1, (2, 16, 8, 128), torch.bfloat16),
    (4, 512, 100, (2, 16, 8, 128), torch.bfloat16),
    (2, 64, 7, (2, 32, 3, 80), torch.float32),
    (3, 40, 5, (2, 16, 1, 64), torch.float16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_matches_ref():
    check_kernel("cuda", GPU_CASES)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        check_kernel("cpu", [(2, 10, 3, (2, 4, 2, 8), torch.float32)])
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
