"""Sampling: the filters against a per-row Python computation, seed determinism across batches, the
drawn frequencies against the filtered softmax (chi-square), and the Triton race against the reference
token for token."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from rayinfer.engine.sync_guard import no_host_sync
from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.sampling import allowed_token_mask, request_keys, sample, sample_ref, uniform_noise

CUDA = torch.cuda.is_available()


def _py_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _py_uniform(seed: int, step: int, i: int) -> float:
    seed &= (1 << 64) - 1
    step &= (1 << 64) - 1
    k = _py_mix32(seed & 0xFFFFFFFF)
    k = _py_mix32(k ^ (seed >> 32))
    k = _py_mix32(k ^ (step & 0xFFFFFFFF))
    k = _py_mix32(k ^ (step >> 32))
    return ((_py_mix32(_py_mix32(i) ^ k) >> 9) + 0.5) / 2**23


def test_uniforms_match_python_integer_hash():
    seeds = torch.tensor([0, 1, -1, 2**40 + 3, -(2**62)], dtype=torch.int64)
    steps = torch.tensor([0, 5, 2**33, 7, 1], dtype=torch.int64)
    u = uniform_noise(request_keys(seeds, steps), 300)
    for b in range(5):
        for i in (0, 1, 2, 177, 299):
            assert u[b, i].item() == _py_uniform(seeds[b].item(), steps[b].item(), i)
    assert 0 < u.min() and u.max() < 1


def _params(rows):
    """rows: list of (temperature, top_k, top_p, min_p) -> the four [B] tensors."""
    t, k, p, m = zip(*rows)
    return (
        torch.tensor(t, dtype=torch.float32),
        torch.tensor(k, dtype=torch.int32),
        torch.tensor(p, dtype=torch.float32),
        torch.tensor(m, dtype=torch.float32),
    )


def _naive_allowed(logits_row: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Top-k, then top-p on the renormalized survivors, then min-p; float64 Python, one row."""
    s = [x / temperature for x in logits_row]
    order = sorted(range(len(s)), key=lambda i: -s[i])
    if 0 < top_k < len(s):
        order = order[:top_k]
    z = sum(math.exp(s[i] - s[order[0]]) for i in order)
    probs = {i: math.exp(s[i] - s[order[0]]) / z for i in order}
    if top_p < 1:
        kept, mass = [], 0.0
        for i in order:
            if mass >= top_p:
                break
            kept.append(i)
            mass += probs[i]
        order = kept
    if min_p > 0:
        order = [i for i in order if probs[i] >= min_p * probs[order[0]]]
    return set(order)


FILTER_ROWS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.0, 0, 0.5, 0.0),
    (1.3, 20, 0.8, 0.0),
    (1.0, 0, 1.0, 0.2),
    (0.5, 30, 0.9, 0.05),
    (2.0, 64, 0.3, 0.0),  # top_k >= V is off
    (1.0, 1, 1.0, 0.0),
]


def test_allowed_mask_matches_naive_filters():
    gen = torch.Generator().manual_seed(0)
    vocab = 64
    # Distinct, well separated logits, so no float rounding sits near a filter boundary.
    logits = torch.stack([torch.randperm(vocab, generator=gen).float() * 0.11 for _ in FILTER_ROWS])
    temperature, top_k, top_p, min_p = _params(FILTER_ROWS)
    mask = allowed_token_mask(logits, temperature, top_k, top_p, min_p)
    for b, row in enumerate(FILTER_ROWS):
        want = _naive_allowed(logits[b].tolist(), *row)
        assert set(torch.nonzero(mask[b]).flatten().tolist()) == want, f"row {b} {row}"


def test_drawn_tokens_are_allowed_and_greedy_is_argmax():
    gen = torch.Generator().manual_seed(1)
    batch, vocab = 64, 500
    logits = torch.randn((batch, vocab), generator=gen) * 2
    rows = [FILTER_ROWS[i % len(FILTER_ROWS)] for i in range(batch)]
    rows[3] = rows[10] = (0.0, 5, 0.5, 0.1)  # greedy ignores the filters
    temperature, top_k, top_p, min_p = _params(rows)
    mask = allowed_token_mask(logits, temperature, top_k, top_p, min_p)
    for step in range(5):
        ids = sample_ref(logits, temperature, top_k, top_p, min_p, torch.arange(batch), torch.full((batch,), step))
        assert ids.dtype == torch.int64
        for b in range(batch):
            if temperature[b] == 0:
                assert ids[b] == logits[b].argmax()
            else:
                assert mask[b, ids[b]]


def test_same_seed_same_token_whatever_the_batch():
    gen = torch.Generator().manual_seed(2)
    vocab = 1000
    logits = torch.randn((6, vocab), generator=gen)
    rows = [(1.0, 0, 1.0, 0.0), (0.8, 50, 0.9, 0.0), (1.2, 0, 1.0, 0.05)] * 2
    temperature, top_k, top_p, min_p = _params(rows)
    seeds = torch.tensor([11, 12, 13, 14, 15, 16])
    steps = torch.tensor([0, 3, 9, 1, 2, 4])
    full = sample_ref(logits, temperature, top_k, top_p, min_p, seeds, steps)
    for order in ([5, 4, 3, 2, 1, 0], [2, 0], [4]):
        o = torch.tensor(order)
        part = sample_ref(logits[o], temperature[o], top_k[o], top_p[o], min_p[o], seeds[o], steps[o])
        assert torch.equal(part, full[o])
    # A different step or seed draws fresh randomness: over many steps, not one constant token.
    many = [sample_ref(logits[:1], *_params(rows[:1]), seeds[:1], torch.tensor([s])).item() for s in range(40)]
    assert len(set(many)) > 5


def test_frequencies_match_filtered_softmax_chi_square():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 20000
    rows = [(0.9, 6, 1.0, 0.0)] * n  # top-6 of 8 at temperature 0.9
    temperature, top_k, top_p, min_p = _params(rows)
    ids = sample_ref(logits.expand(n, -1), temperature, top_k, top_p, min_p, torch.full((n,), 1234), torch.arange(n))
    counts = torch.bincount(ids, minlength=8).double()
    assert counts[6:].sum() == 0
    probs = torch.softmax(logits[:6].double() / 0.9, dim=0)
    chi2 = (((counts[:6] - n * probs) ** 2) / (n * probs)).sum().item()
    assert chi2 < 20.5, chi2  # 5 degrees of freedom, p = 0.001


def check_kernel(device, batch, vocab, steps=3, seed=0):
    """Token-exact comparison of the dispatcher with the reference on one device."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn((batch, vocab), generator=gen) * 3).to(device)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie for greedy: the first index wins
    rows = [(0.0, 0, 1.0, 0.0)] + [FILTER_ROWS[i % len(FILTER_ROWS)] for i in range(batch - 1)]
    temperature, top_k, top_p, min_p = (t.to(device) for t in _params(rows))
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen).to(device)
    mismatches = 0
    for step in range(steps):
        st = torch.full((batch,), step, dtype=torch.int64, device=device) + torch.arange(batch, device=device)
        got = sample(logits, temperature, top_k, top_p, min_p, seeds, st)
        want = sample_ref(logits, temperature, top_k, top_p, min_p, seeds, st)
        assert got[0].item() == 7
        mismatches += (got != want).sum().item()
        for flags in ((False, True), (True, False), (False, False)):
            got = sample(logits, temperature, top_k, top_p, min_p, seeds, st, *flags)
            want = sample_ref(logits, temperature, top_k, top_p, min_p, seeds, st, *flags)
            mismatches += (got != want).sum().item()
    assert mismatches == 0, f"{mismatches} of {4 * steps * batch} draws differ"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("batch,vocab", [(1, 32000), (64, 128256), (200, 49152), (5, 1000)])
def test_kernel_matches_ref_token_for_token(batch, vocab):
    check_kernel("cuda", batch, vocab)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_no_host_sync():
    batch, vocab = 32, 32000
    logits = torch.randn((batch, vocab), device="cuda")
    temperature, top_k, top_p, min_p = (t.cuda() for t in _params([FILTER_ROWS[i % 8] for i in range(batch)]))
    seeds = torch.arange(batch, device="cuda")
    torch.cuda.synchronize()
    with no_host_sync():
        sample(logits, temperature, top_k, top_p, min_p, seeds, seeds)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        check_kernel("cpu", 9, 5000, steps=2)
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
