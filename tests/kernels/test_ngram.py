"""The device n-gram lookup: the torch reference against the host lookup (``spec_decode.ngram_lookup``), the
Triton kernel against the reference."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from rayinfer.engine.spec_decode import ngram_lookup
from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.ngram import ngram_lookup_ref, ngram_lookup_triton

CUDA = torch.cuda.is_available()


def make_case(rng, batch: int, min_len: int, max_len: int, vocab: int):
    """A token buffer of more rows than contexts (contexts in a random subset of them), each context's row
    longer than the context (stale tokens past it), and the rows and lengths."""
    lengths = rng.integers(min_len, max_len, size=batch)
    width = int(lengths.max()) + int(rng.integers(0, 5))
    num_rows = batch + 3
    ctx = torch.from_numpy(rng.integers(0, vocab, size=(num_rows, width)).astype(np.int32))
    rows = torch.from_numpy(rng.permutation(num_rows)[:batch].astype(np.int64))
    return ctx, rows, torch.from_numpy(lengths.astype(np.int64))


def cases(seed: int = 0, num_short: int = 40, num_long: int = 3):
    """Short contexts from small vocabularies (matches of every length, none, continuations cut short by the
    context's end) and a few long ones that span several of the kernel's blocks."""
    rng = np.random.default_rng(seed)
    for trial in range(num_short):
        k = int(rng.integers(1, 6))
        lo, hi = (1, 4) if trial % 2 else (2, 3)
        yield (*make_case(rng, 6, 1, 40, int(rng.integers(2, 9))), k, lo, hi)
    for trial in range(num_long):
        yield (*make_case(rng, 3, 1000, 2600, 40 + 30 * trial), 4, 1, 4)


def test_ref_equals_the_host_lookup():
    for i, (ctx, rows, lengths, k, lo, hi) in enumerate(cases()):
        got = ngram_lookup_ref(ctx, rows, lengths, k, lo, hi)
        assert got.dtype == torch.int64 and got.shape == (len(rows), k)
        for b in range(len(rows)):
            want = ngram_lookup(ctx[rows[b], : lengths[b]].numpy(), k, lo, hi)
            assert got[b].tolist() == want + [0] * (k - len(want)), (i, b)


def check_kernel(device: str, num_short: int = 40) -> None:
    for i, (ctx, rows, lengths, k, lo, hi) in enumerate(cases(seed=1, num_short=num_short)):
        ctx, rows, lengths = ctx.to(device), rows.to(device), lengths.to(device)
        got = ngram_lookup_triton(ctx, rows, lengths, k, lo, hi)
        want = ngram_lookup_ref(ctx, rows, lengths, k, lo, hi)
        assert torch.equal(got, want), (i, got.tolist(), want.tolist())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_matches_ref():
    check_kernel("cuda", num_short=200)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        check_kernel("cpu")
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
