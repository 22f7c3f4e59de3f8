"""Paged attention: the reference against a dense causal softmax written out by hand, and the Triton
kernel against the reference (on CUDA; on CPU through the Triton interpreter for small shapes).

Run as a script (``python tests/kernels/test_paged_attention.py``) it runs its GPU tests through pytest;
with ``--interpret`` (and ``TRITON_INTERPRET=1``) it runs the small interpreter checks.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from rayinfer.engine.sync_guard import no_host_sync
from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.paged_attention import paged_attention, paged_attention_ref, paged_attention_triton

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """Random q and cache, with each request's blocks scattered over a shuffled pool (+3 spare blocks)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil(s / block_size) for s in seq_lens]
    perm = torch.randperm(sum(counts) + 3, generator=gen).tolist()
    tables, at = [], 0
    for c in counts:
        tables.append(perm[at : at + c])
        at += c
    kv = torch.randn((len(perm), 2, block_size, num_kv_heads, head_dim), generator=gen)
    q = torch.randn((sum(query_lens), num_heads, head_dim), generator=gen)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device)
    return q.to(device=device, dtype=dtype), kv.to(device=device, dtype=dtype), meta, tables


def dense_causal_attention(q, kv, query_lens, seq_lens, tables, scale, window=None, kv_start=None):
    """Float64 attention written out: gather each key by position, mask the future (and, with a
    ``window``, keys at or before ``pos - window``), softmax by hand."""
    block_size, num_kv_heads = kv.shape[2], kv.shape[3]
    group = q.shape[1] // num_kv_heads
    q, kv = q.double().cpu(), kv.double().cpu()
    out = torch.zeros_like(q)
    row = 0
    kv_start = kv_start or [0] * len(seq_lens)
    for q_len, seq_len, table, first in zip(query_lens, seq_lens, tables, kv_start):
        keys = torch.stack([kv[table[p // block_size], 0, p % block_size] for p in range(seq_len)])
        values = torch.stack([kv[table[p // block_size], 1, p % block_size] for p in range(seq_len)])
        for j in range(q_len):
            pos = seq_len - q_len + j
            lo = 0 if window is None else max(0, pos - window + 1, first)
            for h in range(q.shape[1]):
                k = keys[lo : pos + 1, h // group]
                v = values[lo : pos + 1, h // group]
                scores = (k @ q[row + j, h]) * scale
                w = torch.exp(scores - scores.max())
                out[row + j, h] = (w[:, None] * v).sum(0) / w.sum()
        row += q_len
    return out


# (query_lens, seq_lens): decode, prefill from scratch, chunked prefill over a cached prefix, mixed.
REF_CASES = [
    ([1, 1, 1, 1], [1, 17, 33, 64]),
    ([20], [20]),
    ([5, 9], [40, 9]),
    ([1, 7, 1, 3], [50, 30, 16, 3]),
]


@pytest.mark.parametrize("query_lens,seq_lens", REF_CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_ref_matches_dense_causal_softmax(query_lens, seq_lens, num_heads, num_kv_heads):
    q, kv, meta, tables = make_case(query_lens, seq_lens, num_heads, num_kv_heads, 16, 8, torch.float32, "cpu")
    scale = 16**-0.5
    got = paged_attention_ref(q, kv, meta, scale)
    want = dense_causal_attention(q, kv, query_lens, seq_lens, tables, scale)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def hide_out_of_window_blocks(kv, meta, tables, window, kv_start=None):
    """Point each request's blocks wholly before its first query's window at a NaN block (as a local
    layer's table holds placeholders for freed blocks): reading one would poison the output."""
    kv = torch.cat([kv, torch.full_like(kv[:1], float("nan"))])
    nan_block = kv.shape[0] - 1
    block_size = kv.shape[2]
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        first = max(seq_len - q_len - window + 1, kv_start[i] if kv_start else 0, 0)
        for b in range(first // block_size):
            meta.block_tables[i, b] = nan_block
            tables[i][b] = nan_block
    return kv


SLIDING_CASES = [  # (query_lens, seq_lens, window)
    ([1, 1, 1], [1, 40, 64], 16),
    ([20], [20], 7),
    ([5, 9, 1], [40, 9, 33], 8),
    ([30, 1], [70, 50], 12),
]


def with_kv_start(meta, kv_start):
    """``meta`` with a bounded replay's first key position per request (None: unchanged)."""
    if kv_start is not None:
        meta.kv_start = torch.tensor(kv_start, dtype=torch.int32, device=meta.seq_lens.device)
        meta.kv_start_cpu = list(kv_start)
    return meta


@pytest.mark.parametrize("query_lens,seq_lens,window", SLIDING_CASES)
@pytest.mark.parametrize("replay", [False, True])
def test_ref_sliding_window_matches_dense(query_lens, seq_lens, window, replay):
    """With ``replay``, each request's keys start at ``kv_start`` (a bounded replay): none before it is read."""
    q, kv, meta, tables = make_case(query_lens, seq_lens, 6, 2, 16, 8, torch.float32, "cpu")
    kv_start = [max(0, s - q_len - 3) for q_len, s in zip(query_lens, seq_lens)] if replay else None
    meta = with_kv_start(meta, kv_start)
    want = dense_causal_attention(q, kv, query_lens, seq_lens, tables, 0.25, window, kv_start)
    kv = hide_out_of_window_blocks(kv, meta, tables, window, kv_start)
    got = paged_attention_ref(q, kv, meta, 0.25, sliding_window=window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def check_kernel_sliding(device, dtype, head_dim, block_size, cases):
    """The kernel with a sliding window (out-of-window blocks are NaN placeholders) against the ref."""
    for i, (qls, sls, h, hkv, splits, window, *kv_start) in enumerate(cases):
        q, kv, meta, tables = make_case(qls, sls, h, hkv, head_dim, block_size, dtype, device, seed=i)
        meta = with_kv_start(meta, kv_start[0] if kv_start else None)
        kv = hide_out_of_window_blocks(kv, meta, tables, window, kv_start[0] if kv_start else None)
        scale = head_dim**-0.5
        got = paged_attention_triton(q, kv, meta, scale, num_splits=splits, sliding_window=window)
        want = paged_attention_ref(q, kv, meta, scale, sliding_window=window)
        assert not torch.isnan(want).any() and not torch.isnan(got).any(), f"sliding case {i}: NaN"
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype],
                                   msg=lambda m: f"sliding case {i}: {m}")


def test_dispatcher_uses_ref_on_cpu():
    q, kv, meta, _ = make_case([3, 1], [3, 10], 4, 2, 16, 4, torch.float32, "cpu")
    if os.environ.get("TRITON_INTERPRET", "0") == "0":
        assert torch.equal(paged_attention(q, kv, meta, 0.25), paged_attention_ref(q, kv, meta, 0.25))


def test_split_count_rule():
    """About two programs per multiprocessor, >= 128 keys per split, capped at 64, or at 8 under PDL (a
    batch-1 step lost 0.55 ms with 33 splits there); no split once the programs fill the device."""
    from rayinfer.kernels.paged_attention import _choose_num_splits

    assert _choose_num_splits(8, 8192, 132) == 33  # batch 1, Llama-3-8B heads, H200
    assert _choose_num_splits(8, 8192, 132, pdl=True) == 8
    assert _choose_num_splits(8, 640, 132, pdl=True) == 5  # 128 keys per split at least
    assert _choose_num_splits(64, 8192, 132, pdl=True) == _choose_num_splits(64, 8192, 132) == 5  # batch 8
    assert _choose_num_splits(256, 8192, 132) == 2
    assert _choose_num_splits(2048, 8192, 132, pdl=True) == 1
    assert _choose_num_splits(8, 200, 132) == 1  # too short to split


def test_long_prefill_tile_rule():
    """256-row tiles only for long prefills (>= 1024 query tokens over >= 16K keys) of 16-bit caches on
    Hopper, never in batch-invariant mode (whose tiles must not depend on the step)."""
    from rayinfer.kernels.paged_attention import _choose_config

    long = _choose_config(8192, 4, 128, False, 2, False, max_seq_len=32768, hopper=True)
    assert (long["block_q"], long["block_n"], long["num_warps"], long["num_stages"]) == (64, 64, 8, 2)
    default = _choose_config(4096, 4, 128, False, 2, False, max_seq_len=4096, hopper=True)
    assert (default["block_q"], default["num_warps"]) == (16, 4)
    assert _choose_config(8192, 4, 128, False, 2, False, max_seq_len=32768, hopper=False) == default
    assert _choose_config(8192, 4, 128, False, 2, True, max_seq_len=32768, hopper=True) == default
    assert _choose_config(512, 4, 128, False, 2, False, max_seq_len=32768, hopper=True) == default
    assert _choose_config(8192, 4, 128, False, 1, False, max_seq_len=32768, hopper=True) == default  # fp8


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_long_prefill_tiles_match_ref():
    """A chunk of 1,100 queries over 17,000 keys beside two decodes: the long-prefill tiles on Hopper."""
    check_kernel("cuda", torch.bfloat16, 128, 16, cases=[([1100, 1, 1], [17000, 300, 17000], 32, 8, None)])


# ---------------------------------------------------------------------------------------------------
# Kernel against reference. Each case: (query_lens, seq_lens, num_heads, num_kv_heads, num_splits).
# ---------------------------------------------------------------------------------------------------


def kernel_cases(long: bool):
    n = 3000 if long else 300
    return [
        ([1] * 6, [1, 2, 15, 16, 17, n], 8, 2, None),  # decode, ragged lengths around block edges
        ([1] * 3, [n, n // 2 + 3, 5], 8, 2, 5),  # decode, forced split-KV with empty splits
        ([1] * 2, [n, 77], 12, 4, None),  # group of 3 (padded to 4)
        ([2, 1, 3], [n, 40, 60], 8, 8, None),  # MHA, short extends (speculative-style)
        ([n // 2], [n // 2], 8, 2, None),  # prefill from scratch
        ([n // 3, 1, 19, 1], [n, 200, 19, 1], 8, 2, None),  # chunked prefill over a prefix + decodes
        ([33, 5], [97, 5], 16, 2, None),  # group of 8
    ]


def check_kernel(device, dtype, head_dim, block_size, long=True, cases=None):
    """Run the kernel (through the public dispatcher unless a split count is forced) against the ref."""
    worst = 0.0
    for i, (qls, sls, h, hkv, splits) in enumerate(cases or kernel_cases(long)):
        q, kv, meta, _ = make_case(qls, sls, h, hkv, head_dim, block_size, dtype, device, seed=i)
        scale = head_dim**-0.5
        if splits is None:
            got = paged_attention(q, kv, meta, scale)
        else:
            got = paged_attention_triton(q, kv, meta, scale, num_splits=splits)
        want = paged_attention_ref(q, kv, meta, scale)
        assert not torch.isnan(got).any(), f"case {i}: NaN"
        tol = TOL[dtype]
        msg = f"case {i} ({qls}, {sls}, {h}/{hkv}, {dtype}, d={head_dim}, bs={block_size})"
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"{msg}: {m}")
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    return worst


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_matches_ref(dtype, head_dim, block_size):
    worst = check_kernel("cuda", dtype, head_dim, block_size)
    print(f"paged_attention {dtype} d={head_dim} bs={block_size}: max abs err {worst:.2e}")


def check_graph_splits(device, dtype, head_dim=32):
    """A CUDA graph bakes the split count for its longest context; shorter ones spread over every split."""
    q, kv, meta, _ = make_case([1] * 4, [5, 300, 17, 64], 4, 2, head_dim, 16, dtype, device, seed=7)
    want = paged_attention_ref(q, kv, meta, head_dim**-0.5)
    for splits in (3, 16):
        got = paged_attention_triton(q, kv, meta, head_dim**-0.5, num_splits=splits, max_seq_len=4096)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype],
                                   msg=lambda m: f"{splits} splits: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_fp8_cache(dtype):
    """An fp8 KV cache (float8_e4m3fn) is widened on load: the kernel equals the reference over it."""
    for i, (qls, sls, h, hkv, splits) in enumerate(kernel_cases(long=True)):
        q, kv, meta, _ = make_case(qls, sls, h, hkv, 128, 16, dtype, "cuda", seed=i)
        kv = kv.to(torch.float8_e4m3fn)
        got = paged_attention_triton(q, kv, meta, 128**-0.5, num_splits=splits)
        want = paged_attention_ref(q, kv, meta, 128**-0.5)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16],
                                   msg=lambda m: f"case {i}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_graph_split_count():
    check_graph_splits("cuda", torch.bfloat16, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_head_dim_not_power_of_two():
    cases = [([1] * 3, [100, 7, 300], 8, 2, None), ([40, 1], [90, 33], 8, 2, None)]
    check_kernel("cuda", torch.bfloat16, 80, 16, cases=cases)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_sliding_window():
    cases = [([1] * 4, [900, 3, 64, 1000], 8, 2, None, 256), ([1] * 2, [900, 700], 8, 2, 4, 100),
             ([300, 1, 50], [1000, 90, 50], 8, 2, None, 128), ([200], [200], 8, 1, None, 17),
             ([300, 1, 50], [1000, 90, 50], 8, 2, None, 256, [650, 40, 0]), ([1] * 2, [900, 700], 8, 2, 4, 300, [850, 0])]
    check_kernel_sliding("cuda", torch.bfloat16, 128, 16, cases)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_fp16_and_no_host_sync():
    q, kv, meta, _ = make_case([1] * 4 + [50], [900, 3, 64, 1000, 300], 32, 8, 128, 16, torch.float16, "cuda")
    torch.cuda.synchronize()
    with no_host_sync():
        got = paged_attention(q, kv, meta, 128**-0.5)
    want = paged_attention_ref(q, kv, meta, 128**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[torch.float16], rtol=TOL[torch.float16])


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


def _interpreter_checks():
    small = [
        ([1, 1, 1], [5, 40, 17], 4, 2, None),
        ([1, 1], [300, 17], 4, 2, 3),
        ([7, 1, 20], [7, 33, 50], 6, 2, None),
        ([40], [40], 8, 2, None),
    ]
    worst = check_kernel("cpu", torch.float32, 32, 16, cases=small)
    check_graph_splits("cpu", torch.float32)
    sliding = [([1, 1], [100, 17], 4, 2, None, 20), ([1, 1], [300, 40], 4, 2, 3, 50),
               ([30, 1], [90, 33], 4, 1, None, 24), ([30, 1, 1], [90, 33, 80], 4, 2, None, 40, [55, 0, 70])]
    check_kernel_sliding("cpu", torch.float32, 32, 16, sliding)
    print(f"interpreter: max abs err {worst:.2e}")


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        _interpreter_checks()
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
