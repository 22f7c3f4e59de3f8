"""MLA over the compressed cache: expanded and absorbed references against a per-token float64 loop,
the store by hand, the Triton kernels against the references (interpreter on CPU, ``-m gpu`` on CUDA)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.batch_invariant import batch_invariant_mode
from rayinfer.kernels.mla_attention import (
    choose_num_splits, gather_mla_context, mla_decode, mla_decode_ref, mla_decode_triton, mla_prefill, mla_prefill_ref,
    store_mla_kv, store_mla_kv_ref,
)

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_batch(query_lens, seq_lens, block_size, num_blocks, seed=0, device="cpu"):
    """Metadata with disjoint, shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(free[:n])
        free = free[n:]
    return AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device)


def loop_absorbed(q_latent, q_pe, cache, meta, scale):
    """Per token and head, float64: softmax(scale * [q_latent, q_pe] . ctx) @ c_kv."""
    rank = q_latent.shape[-1]
    out = torch.zeros(q_latent.shape, dtype=torch.float64)
    t = 0
    for i, (q_len, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        bs = cache.shape[1]
        ctx = torch.stack([cache[meta.block_tables[i, p // bs], p % bs] for p in range(s)]).double()
        for j in range(q_len):
            pos = s - q_len + j
            for h in range(q_latent.shape[1]):
                q = torch.cat([q_latent[t, h], q_pe[t, h]]).double()
                p = torch.softmax(scale * (ctx[: pos + 1] @ q), dim=0)
                out[t, h] = p @ ctx[: pos + 1, :rank]
            t += 1
    return out


def test_decode_ref_matches_loop():
    rank, rope, heads, bs = 24, 8, 3, 4
    meta = make_batch([1, 4, 1], [5, 9, 1], bs, 12)
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(12, bs, rank + rope, generator=gen)
    ql, qp = torch.randn(6, heads, rank, generator=gen), torch.randn(6, heads, rope, generator=gen)
    got = mla_decode_ref(ql, qp, cache, meta, 0.2)
    torch.testing.assert_close(got.double(), loop_absorbed(ql, qp, cache, meta, 0.2), atol=1e-5, rtol=1e-5)


def test_absorbed_equals_expanded():
    """Folding W_UK into the query and W_UV after the attention gives the expanded result."""
    rank, rope, nope, v_dim, heads, bs = 32, 16, 12, 20, 4, 4
    meta = make_batch([6, 1, 3], [6, 10, 7], bs, 16, seed=2)
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(16, bs, rank + rope, generator=gen)
    w = torch.randn(heads * (nope + v_dim), rank, generator=gen) / rank**0.5
    q_nope, q_pe = torch.randn(10, heads, nope, generator=gen), torch.randn(10, heads, rope, generator=gen)
    expanded = mla_prefill_ref(q_nope, q_pe, cache, meta, w, 0.15)
    wv = w.view(heads, nope + v_dim, rank)
    q_latent = torch.einsum("thd,hdr->thr", q_nope, wv[:, :nope])
    absorbed = torch.einsum("thr,hvr->thv", mla_decode_ref(q_latent, q_pe, cache, meta, 0.15), wv[:, nope:])
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)


def test_store_ref_by_hand():
    cache = torch.zeros(3, 2, 5)
    c, pe = torch.arange(6.0).view(2, 3), -torch.arange(4.0).view(2, 2) - 1
    store_mla_kv_ref(c, pe, cache, torch.tensor([5, -1]))
    assert cache[2, 1].tolist() == [0.0, 1.0, 2.0, -1.0, -2.0]
    assert cache.count_nonzero() == 4


def check_kernels(device, cases, num_splits=None, config=None):
    """Each case against the references; ``num_splits``: force that split-KV factor (else the default);
    ``config``: the Triton kernel's tiles (``mla_decode_triton``'s ``config``)."""
    worst = 0.0
    for i, (query_lens, seq_lens, heads, rank, rope, bs, dtype) in enumerate(cases):
        nb = sum(-(-s // bs) for s in seq_lens) + 3
        meta = make_batch(query_lens, seq_lens, bs, nb, seed=i, device=device)
        gen = torch.Generator().manual_seed(i)
        to = dict(device=device, dtype=dtype)
        cache = torch.randn(nb, bs, rank + rope, generator=gen).to(**to)
        t = sum(query_lens)
        ql = torch.randn(t, heads, rank, generator=gen).to(**to)
        qp = torch.randn(t, heads, rope, generator=gen).to(**to)
        if num_splits is None and config is None:
            got = mla_decode(ql, qp, cache, meta, rank**-0.5)
        else:
            got = mla_decode_triton(ql, qp, cache, meta, rank**-0.5, num_splits=num_splits, config=config)
        want = mla_decode_ref(ql, qp, cache, meta, rank**-0.5)
        tol = TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"case {i}: {m}")
        worst = max(worst, (got.float() - want.float()).abs().max().item())
        c, pe = torch.randn(t, rank, generator=gen).to(**to), torch.randn(t, rope, generator=gen).to(**to)
        slots = meta.slot_mapping.clone()
        slots[::3] = -1
        a, b = cache.clone(), cache.clone()
        store_mla_kv(c, pe, a, slots)
        store_mla_kv_ref(c, pe, b, slots)
        assert torch.equal(a, b), f"store case {i}"
    return worst


def check_uv(device, cases, num_splits=None, fused=True):
    """``mla_decode(..., w_uv=)`` (each head's output through W_UV, the split merge inside that GEMV's launch
    where ``merge_in_uv`` holds) against the reference's output times W_UV in float64. ``w_uv`` is a slice of
    a [H, Dn + Dv, R] ``kv_b_proj`` view, as the model passes it. ``fused``: assert the launch merged in the GEMV."""
    import rayinfer.kernels.mla_attention as mla

    worst = 0.0
    for i, (query_lens, seq_lens, heads, rank, rope, v_dim, bs, dtype) in enumerate(cases):
        nb = sum(-(-s // bs) for s in seq_lens) + 3
        meta = make_batch(query_lens, seq_lens, bs, nb, seed=i, device=device)
        gen = torch.Generator().manual_seed(50 + i)
        to = dict(device=device, dtype=dtype)
        cache = torch.randn(nb, bs, rank + rope, generator=gen).to(**to)
        t = sum(query_lens)
        ql = torch.randn(t, heads, rank, generator=gen).to(**to)
        qp = torch.randn(t, heads, rope, generator=gen).to(**to)
        w_kv_b = (torch.randn(heads, 8 + v_dim, rank, generator=gen) / rank**0.5).to(**to)
        w_uv = w_kv_b[:, 8:]
        assert mla.merge_in_uv(ql, w_uv) == fused, f"case {i}: merge_in_uv"
        if num_splits is None:
            got = mla_decode(ql, qp, cache, meta, rank**-0.5, w_uv=w_uv)
        else:
            got = mla_decode_triton(ql, qp, cache, meta, rank**-0.5, num_splits=num_splits, w_uv=w_uv)
        ref = mla_decode_ref(ql.double().cpu(), qp.double().cpu(), cache.double().cpu(), make_batch(
            query_lens, seq_lens, bs, nb, seed=i), rank**-0.5)
        want = torch.einsum("thr,hvr->thv", ref, w_uv.double().cpu())
        assert got.shape == (t, heads, v_dim) and got.dtype == dtype
        tol = 4 * TOL[dtype]
        torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol, msg=lambda m: f"uv case {i}: {m}")
        worst = max(worst, (got.double().cpu() - want).abs().max().item())
    return worst


def check_prefill(device, cases):
    """mla_prefill against mla_prefill_ref; each case: (query_lens, seq_lens, heads, rank, rope, nope, v_dim,
    block_size, dtype). A query length below its sequence length is a chunk after a cached prefix."""
    worst = 0.0
    for i, (query_lens, seq_lens, heads, rank, rope, nope, v_dim, bs, dtype) in enumerate(cases):
        nb = sum(-(-s // bs) for s in seq_lens) + 3
        meta = make_batch(query_lens, seq_lens, bs, nb, seed=i, device=device)
        gen = torch.Generator().manual_seed(100 + i)
        to = dict(device=device, dtype=dtype)
        cache = torch.randn(nb, bs, rank + rope, generator=gen).to(**to)
        w = (torch.randn(heads * (nope + v_dim), rank, generator=gen) / rank**0.5).to(**to)
        t = sum(query_lens)
        q_nope = torch.randn(t, heads, nope, generator=gen).to(**to)
        q_pe = torch.randn(t, heads, rope, generator=gen).to(**to)
        scale = (nope + rope) ** -0.5
        got, want = mla_prefill(q_nope, q_pe, cache, meta, w, scale), mla_prefill_ref(q_nope, q_pe, cache, meta, w, scale)
        tol = TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"prefill case {i}: {m}")
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    return worst


def test_gather_context_by_hand():
    """Two requests' rows in position order through scattered blocks, one after the other."""
    cache = torch.arange(6 * 2 * 1.0).view(6, 2, 1)  # row value = block * 2 + offset
    meta = AttentionMetadata.build([1, 2], [3, 2], [[4, 1], [0]], 2)
    latents, starts = gather_mla_context(cache, meta)
    assert latents[:, 0].tolist() == [8.0, 9.0, 2.0, 0.0, 1.0] and starts.tolist() == [0, 3, 5]
    # the rows to read are derived once a step (every layer reads the same rows of its own cache)
    assert len(meta.derived) == 1
    latents2, _ = gather_mla_context(cache * 10, meta)
    assert len(meta.derived) == 1 and latents2[:, 0].tolist() == [80.0, 90.0, 20.0, 0.0, 10.0]
    other = dataclasses.replace(meta, block_tables=torch.tensor([[1, 4], [2, 0]], dtype=torch.int32))
    assert not other.derived  # a copy with other tables derives its own rows
    assert gather_mla_context(cache, other)[0][:, 0].tolist() == [2.0, 3.0, 8.0, 4.0, 5.0]


GPU_CASES = [
    ([1] * 8, [100, 1, 517, 64, 3, 1000, 17, 256], 16, 512, 64, 64, torch.bfloat16),
    ([1] * 4, [300, 20, 7, 64], 128, 512, 64, 16, torch.bfloat16),
    ([5, 1, 12], [40, 9, 12], 16, 512, 64, 16, torch.float16),
    ([1, 3], [33, 18], 4, 64, 32, 16, torch.float32),
]


# DeepSeek-V2-Lite's attention shape (16 heads, R 512, P 64) at 1K and 4K context: several KV splits at
# batch 1 and 4 on an H200 (choose_num_splits), one split at batch 64
SPLIT_GPU_CASES = [
    ([1], [1024], 16, 512, 64, 64, torch.bfloat16),
    ([1], [4096], 16, 512, 64, 16, torch.bfloat16),
    ([1] * 4, [4096, 1000, 1, 3000], 16, 512, 64, 64, torch.bfloat16),
    ([4, 1, 8], [1024, 4096, 2000], 16, 512, 64, 64, torch.bfloat16),  # verification-like short queries
    ([1] * 64, [1024] * 64, 16, 512, 64, 64, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernels_match_ref():
    print(f"mla_decode: max abs err {check_kernels('cuda', GPU_CASES):.2e}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_tilelang_backend_matches_ref(monkeypatch):
    """RAYINFER_MLA_BACKEND=tilelang: the TileLang kernel (16-bit cases; fp32 stays on Triton) against the
    reference, unsplit and split-KV; the dispatcher must take it (the kernel is compiled for these shapes)."""
    from rayinfer.kernels import mla_tilelang

    assert mla_tilelang.tilelang_available(), "the GPU machine's environment must provide tilelang"
    monkeypatch.setenv("RAYINFER_MLA_BACKEND", "tilelang")
    before = mla_tilelang._compiled.cache_info().misses
    print(f"tilelang mla_decode: max abs err {check_kernels('cuda', GPU_CASES + SPLIT_GPU_CASES):.2e}")
    assert mla_tilelang._compiled.cache_info().misses > before


# keys-as-rows tiles (cache blocks of 64, 16 or 32 heads): short and long contexts, verification-like queries,
# fp16 and bf16
ROWS_GPU_CASES = [
    ([1] * 8, [100, 1, 517, 64, 3, 1000, 17, 4096], 16, 512, 64, 64, torch.bfloat16),
    ([4, 1, 8], [1024, 4096, 2000], 16, 512, 64, 64, torch.bfloat16),
    ([1] * 70, [777 + 61 * i for i in range(70)], 32, 512, 64, 128, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_tilelang_keys_as_rows_matches_ref(monkeypatch):
    """TileLang's keys-as-rows program against the reference at every split count it compiles (powers of two;
    others round down), on a strided q_latent, and through RAYINFER_MLA_BACKEND=auto for a 70-token step."""
    from rayinfer.kernels import mla_tilelang

    assert mla_tilelang.tilelang_available(), "the GPU machine's environment must provide tilelang"
    for i, (query_lens, seq_lens, heads, rank, rope, bs, dtype) in enumerate(ROWS_GPU_CASES):
        nb = sum(-(-s // bs) for s in seq_lens) + 3
        meta = make_batch(query_lens, seq_lens, bs, nb, seed=i, device="cuda")
        gen = torch.Generator().manual_seed(i)
        cache = torch.randn(nb, bs, rank + rope, generator=gen).to("cuda", dtype)
        t = sum(query_lens)
        # q_latent as a transposed view of [H, T, R] storage, as the model's batched W_UK product leaves it
        ql = torch.randn(heads, t, rank, generator=gen).to("cuda", dtype).transpose(0, 1)
        qp = torch.randn(t, heads, rope, generator=gen).to("cuda", dtype)
        want = mla_decode_ref(ql, qp, cache, meta, rank**-0.5).float()
        # the default split merge at each split count; on the first case every merge at the counts it takes
        runs = [(None, None), (1, None), (2, None), (3, None), (8, None), (32, None)]
        if i == 0:
            runs += [(2, "launch"), (2, "last_program"), (4, "cluster"), (8, "cluster"), (4, "launch"),
                     (16, "launch"), (16, "cluster"), (2, "spread"), (4, "spread"), (8, "spread"), (32, "spread")]
        if i == 2:  # 70 tokens x 4 splits: 280 programs, more than one wave (waits given up, the last merges)
            runs += [(4, "spread"), (4, "last_program")]
        for splits, merge in runs:
            got = mla_tilelang.mla_decode_tilelang(ql, qp, cache, meta, rank**-0.5, num_splits=splits,
                                                   config={"layout": "keys_as_rows", "merge": merge})
            torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype],
                                       msg=lambda m: f"case {i}, splits {splits}, merge {merge}: {m}")
        counters = mla_tilelang._arrival_counters(ql.device)
        assert not (counters[:, 0] % 32).any(), "a merge left an arrival count off a multiple of 32"
        assert not counters[:, 1].any(), "a spread merge left a slice given up"
    calls = lambda: sum(mla_tilelang._compiled.cache_info()[:2])  # noqa: E731
    before = calls()
    monkeypatch.setenv("RAYINFER_MLA_BACKEND", "auto")
    got = mla_decode(ql, qp, cache, meta, rank**-0.5)  # the last case: 70 tokens, blocks of 128
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert calls() > before, "RAYINFER_MLA_BACKEND=auto did not take the TileLang kernel for 70 tokens"


def test_keys_as_rows_rules():
    """Which shapes the keys-as-rows tiles take, their split rule (powers of two that fill one wave) and the
    split merge each count takes."""
    from rayinfer.kernels.mla_tilelang import default_config, keys_as_rows_applies, merge_kind, one_wave_splits

    assert keys_as_rows_applies(16, 64) and keys_as_rows_applies(32, 128)
    assert not keys_as_rows_applies(16, 16) and not keys_as_rows_applies(128, 64) and not keys_as_rows_applies(8, 64)
    assert default_config(16, 64)["layout"] == "keys_as_rows" and "block_h" in default_config(16, 16)
    assert "block_h" in default_config(16, 64, "heads_as_rows")
    with pytest.raises(ValueError, match="layout"):
        default_config(16, 64, "rows")
    assert [one_wave_splits(b, 4096, 132) for b in (1, 4, 32, 64, 128, 200)] == [32, 32, 4, 2, 1, 1]
    assert one_wave_splits(1, 300, 132) == 2  # at least 128 keys a split
    assert one_wave_splits(8, 8192, 132) == 16 and one_wave_splits(3, 8192, 78) == 16
    # the split merge: a cluster of 2, the last program at 4, the merge kernel at more (and at one split)
    assert [merge_kind(64, s) for s in (1, 2, 4, 8, 16, 32)] == ["launch", "cluster", "last_program"] + ["launch"] * 3
    assert merge_kind(1 << 17, 4) == "launch"  # more tokens than arrival counters


def test_mla_backend_setting(monkeypatch):
    """RAYINFER_MLA_BACKEND: triton by default, tilelang or auto when asked, anything else a clear error."""
    from rayinfer import envs

    monkeypatch.delenv("RAYINFER_MLA_BACKEND", raising=False)
    assert envs.mla_backend() == "triton"
    monkeypatch.setenv("RAYINFER_MLA_BACKEND", "TileLang")
    assert envs.mla_backend() == "tilelang"
    monkeypatch.setenv("RAYINFER_MLA_BACKEND", " AUTO")
    assert envs.mla_backend() == "auto"
    monkeypatch.setenv("RAYINFER_MLA_BACKEND", "cuda")
    with pytest.raises(ValueError, match="RAYINFER_MLA_BACKEND"):
        envs.mla_backend()


# DeepSeek-V2-Lite's shape (16 heads, R 512, P 64, Dn 128, Dv 128): whole prompts, chunks after cached
# prefixes (prefix hits), one-token rows in the same batch
PREFILL_GPU_CASES = [
    ([1000, 37, 1, 300], [1000, 2085, 50, 300], 16, 512, 64, 128, 128, 64, torch.bfloat16),
    ([512] * 4, [512, 1024, 4096, 777], 16, 512, 64, 128, 128, 16, torch.bfloat16),
    ([129, 64], [129, 200], 4, 64, 32, 48, 40, 16, torch.float16),
    ([70, 5], [100, 5], 3, 32, 16, 16, 24, 16, torch.float32),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_prefill_kernel_matches_ref():
    print(f"mla_prefill: max abs err {check_prefill('cuda', PREFILL_GPU_CASES):.2e}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_split_kv_matches_ref_at_long_context():
    assert choose_num_splits(1, 1024, torch.cuda.get_device_properties(0).multi_processor_count) > 1
    print(f"mla_decode split-KV (default splits): max abs err {check_kernels('cuda', SPLIT_GPU_CASES):.2e}")
    print(f"mla_decode split-KV (7 splits): max abs err {check_kernels('cuda', SPLIT_GPU_CASES[:2], 7):.2e}")
    # through W_UV (Dv 128): batch-1-sized steps merge in the GEMV's launch, V3's 128 heads too; larger ones apart
    uv = [([1], [1024], 16, 512, 64, 128, 64, torch.bfloat16), ([1], [4096], 16, 512, 64, 128, 16, torch.bfloat16),
          ([1] * 4, [4096, 1000, 1, 3000], 16, 512, 64, 128, 64, torch.bfloat16),
          ([1], [3000], 128, 512, 64, 128, 64, torch.bfloat16)]
    err = max(check_uv("cuda", uv), check_uv("cuda", [([4, 1, 8], [1024, 4096, 2000], 16, 512, 64, 128, 64,
                                                        torch.bfloat16)], fused=False))
    print(f"mla_decode through W_UV: max abs err {err:.2e}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_swap_ab_tiles_match_ref():
    """Keys as the products' rows (64-key tiles for the warpgroup MMA, 4 and 8 warps), unsplit and split-KV."""
    for block_n, warps, stages in ((64, 4, 2), (64, 8, 3)):
        cfg = {"swap_ab": True, "swap_block_n": block_n, "num_warps": warps, "num_stages": stages,
               "min_split_tokens": block_n}
        err = max(check_kernels("cuda", GPU_CASES + SPLIT_GPU_CASES, config=cfg),
                  check_kernels("cuda", SPLIT_GPU_CASES[:2], 5, config=cfg))
        print(f"mla_decode swap_ab block_n={block_n}: max abs err {err:.2e}")
    for ahead in (False, True):  # the default set takes it where rank >= 512 and more than 4 tokens
        err = check_kernels("cuda", GPU_CASES + SPLIT_GPU_CASES, config={"prefetch_index": ahead, "num_stages": 3})
        print(f"mla_decode with the block numbers a tile ahead {ahead}: max abs err {err:.2e}")
    # per token: contexts of at least 1024 keys swapped, shorter ones on the default tiles, in one launch
    err = check_kernels("cuda", GPU_CASES + SPLIT_GPU_CASES, config={"swap_ab": True, "swap_min_keys": 1024})
    print(f"mla_decode swap_ab from 1024 keys: max abs err {err:.2e}")


def test_choose_num_splits():
    """At most two programs per multiprocessor (one wave), >= 64 keys per split, at most 32 splits."""
    assert choose_num_splits(1, 1024, 132) == 16  # 1024 // 64
    assert choose_num_splits(1, 8192, 132) == 32
    assert choose_num_splits(64, 4096, 132) == 4  # 264 // 64: 256 programs, not 320 (a second wave of 56)
    assert choose_num_splits(32, 4096, 132) == 8
    assert choose_num_splits(128, 8192, 132) == 2
    assert choose_num_splits(200, 4096, 132) == 1
    assert choose_num_splits(264, 4096, 132) == 1
    assert choose_num_splits(1, 100, 132) == 1  # too short to split


def test_batch_invariant_mode_never_splits(monkeypatch):
    """In batch-invariant mode the kernel runs unsplit whatever the caller asks (checked on the launch)."""
    import rayinfer.kernels.mla_attention as mla

    grids = []

    class Launch:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *a, **k: None

    monkeypatch.setattr(mla, "_mla_decode_kernel", Launch())
    monkeypatch.setattr(mla, "_mla_merge_splits_kernel", Launch())
    meta = make_batch([1], [1024], 16, 64)
    args = (torch.zeros(1, 4, 32), torch.zeros(1, 4, 16), torch.zeros(64, 16, 48), meta, 0.1)
    mla_decode_triton(*args, num_splits=8)
    assert grids == [(1, 1, 8), (1, 4, 1)]  # merge: (token, head, 128-column slice of the rank)
    with batch_invariant_mode(True):
        mla_decode_triton(*args, num_splits=8)
    assert grids[2:] == [(1, 1, 1)]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernels_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        f32 = torch.float32
        check_kernels("cpu", [([1, 3, 1], [5, 9, 40], 4, 32, 16, 4, f32), ([2], [2], 20, 24, 8, 8, f32)])
        # split-KV: 4 splits of whole 32-key tiles; the 5-token context leaves 3 splits empty, the 150-token one 1
        check_kernels("cpu", [([1, 1, 2], [5, 150, 70], 4, 32, 16, 4, f32)], num_splits=4)
        check_kernels("cpu", [([3, 1], [97, 1], 20, 24, 8, 8, f32)], num_splits=3)
        # each tile's block numbers in its own iteration (prefetch_index False; the default loads them an
        # iteration ahead): unsplit and split, partial last tiles
        own = {"prefetch_index": False, "num_stages": 2}
        check_kernels("cpu", [([1, 3, 1], [5, 9, 40], 4, 32, 16, 4, f32)], config=own)
        check_kernels("cpu", [([1, 1, 2], [5, 150, 70], 4, 32, 16, 4, f32)], num_splits=4, config=own)
        # the metadata and first block numbers read before the PDL wait (early, the default) and after it:
        # unsplit and split (empty splits, a key loop after the first tile)
        for early in (True, False):
            check_kernels("cpu", [([1, 3, 1], [5, 9, 40], 4, 32, 16, 4, f32), ([2], [2], 20, 24, 8, 8, f32)],
                          config={"early": early})
            check_kernels("cpu", [([1, 1, 2], [5, 150, 70], 4, 32, 16, 4, f32)], num_splits=4,
                          config={"early": early, "block_n": 16})
        # a rank of 160: the merge's two 128-column slices, the second partial
        check_kernels("cpu", [([1, 2], [70, 40], 2, 160, 16, 4, f32)], num_splits=3)
        # keys as the products' rows (swap_ab): unsplit, split, a partial last tile, a rope width below 16
        swap = {"swap_ab": True, "swap_block_n": 16, "min_split_tokens": 16}
        check_kernels("cpu", [([1, 3, 1], [5, 9, 40], 4, 32, 16, 4, f32), ([2], [2], 20, 24, 8, 8, f32)], config=swap)
        check_kernels("cpu", [([1, 1, 2], [5, 150, 70], 4, 32, 16, 4, f32)], num_splits=4, config=swap)
        # per token: those with at least 40 keys take the swapped tiles, the others the default ones
        check_kernels("cpu", [([1, 1, 2], [5, 150, 40], 4, 32, 16, 4, f32)], num_splits=4,
                      config={**swap, "swap_min_keys": 40})
        # through W_UV: 16-bit steps of up to 4 tokens merge their splits in the GEMV's launch (partial last
        # column tile: Dv 20 in 16-row tiles; an empty split), others merge apart then multiply (float32; 5 tokens)
        import rayinfer.kernels.mla_attention as mla

        mla.MERGE_UV_BLOCK_N = 16
        f16 = torch.float16
        check_uv("cpu", [([1, 1, 2], [5, 150, 70], 4, 32, 16, 20, 4, f16)], num_splits=4)
        check_uv("cpu", [([1], [9], 3, 24, 8, 16, 4, f16)], num_splits=3)
        check_uv("cpu", [([1, 1, 2], [5, 150, 70], 4, 32, 16, 20, 4, f32)], num_splits=4, fused=False)
        check_uv("cpu", [([3, 2], [40, 70], 2, 32, 16, 16, 4, f16)], num_splits=2, fused=False)
        check_uv("cpu", [([1, 2], [70, 40], 2, 32, 16, 16, 4, f16)], num_splits=1)  # unsplit: no merge at all
        mla.MERGE_UV_BLOCK_N = 32
        # expanded: whole prompts, chunks after cached prefixes, a tile boundary (32 rows), a one-token row
        check_prefill("cpu", [([40, 7, 1, 3], [40, 30, 9, 3], 2, 32, 16, 16, 24, 4, f32),
                              ([33], [70], 3, 24, 8, 12, 20, 8, f32)])
        import rayinfer.kernels.mla_attention as mla

        mla._MAX_GATHER_ROWS = 40  # contexts 40 + 30 + 9 + 3 in three passes: [40], [30, 9], [3]
        assert mla._request_groups([40, 30, 9, 3], 40) == [(0, 1), (1, 3), (3, 4)]
        check_prefill("cpu", [([40, 7, 1, 3], [40, 30, 9, 3], 2, 32, 16, 16, 24, 4, f32)])
        mla._PREFILL_TILES = {**mla._PREFILL_TILES, "reverse": True}  # query tiles launched last-first
        check_prefill("cpu", [([40, 7, 1, 3], [40, 30, 9, 3], 2, 32, 16, 16, 24, 4, f32),
                              ([33], [70], 3, 24, 8, 12, 20, 8, f32)])
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
