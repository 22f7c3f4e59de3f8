"""kernels.moe_tilelang: the fused MoE's grouped GEMMs as TileLang programs, against per-group torch products and,
inside the grouped-GEMM path, against fused_moe_ref (GPU only: TileLang compiles for CUDA; CPU runs take the
torch path, tested in test_fused_moe.py). Shape rules are checked on CPU."""

from __future__ import annotations

import pytest
import torch

from rayinfer.kernels.moe_tilelang import grouped_gemm_applies

CUDA = torch.cuda.is_available()


def test_grouped_gemm_shape_rules():
    b16 = torch.bfloat16
    assert grouped_gemm_applies(torch.empty(66, 2816, 2048, dtype=b16), True)  # V2-Lite gate/up: 1408 = 22 x 64
    assert grouped_gemm_applies(torch.empty(66, 2048, 1408, dtype=b16), False)  # its down: K 1408 = 22 x 64
    assert grouped_gemm_applies(torch.empty(128, 1536, 2048, dtype=b16), True)  # Qwen3-30B-A3B: 768 = 12 x 64
    assert not grouped_gemm_applies(torch.empty(8, 200, 256, dtype=b16), True)  # 100 channels: no 64-column tile
    assert not grouped_gemm_applies(torch.empty(8, 256, 100, dtype=b16), False)  # K not a multiple of 64
    assert not grouped_gemm_applies(torch.empty(8, 256, 256, dtype=torch.float32), False)  # fp32: no such MMA
    # only 128-row tiles on 256 threads ran on a GPU (64 rows on 128 threads did not finish)
    assert not grouped_gemm_applies(torch.empty(66, 2816, 2048, dtype=b16), True, dict(block_m=64, threads=128))
    assert grouped_gemm_applies(torch.empty(66, 2816, 2048, dtype=b16), True, dict(block_n=256, num_stages=3))
    assert grouped_gemm_applies(torch.empty(66, 2816, 2048, dtype=b16), True, dict(block_n=128, gate_up_mma="split"))
    assert not grouped_gemm_applies(torch.empty(66, 2816, 2048, dtype=b16), True, dict(gate_up_mma="fused"))
    assert not grouped_gemm_applies(torch.empty(66, 2048, 1408, dtype=b16), False, dict(store="tma"))
    # the default 256-column tile: 128 gate and 128 up channels, so I must be a multiple of 128
    assert not grouped_gemm_applies(torch.empty(8, 192, 256, dtype=b16), True)
    assert grouped_gemm_applies(torch.empty(8, 192, 256, dtype=b16), True, dict(block_n=64))


def test_grouped_path_names_an_unknown_gemm_backend():
    from rayinfer.kernels.fused_moe import fused_moe_grouped_mm

    x, w13, w2 = torch.zeros(4, 64), torch.zeros(2, 64, 64), torch.zeros(2, 64, 32)
    ids, w = torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1)
    with pytest.raises(ValueError, match="'cutlass'"):
        fused_moe_grouped_mm(x, w13, w2, ids, w, gemms="cutlass")


def grouped_ref(a: torch.Tensor, w: torch.Tensor, ends: list[int], silu_and_mul: bool) -> torch.Tensor:
    """Per group e: a[rows] @ w[e].T in float32 (silu(gate) * up of its halves)."""
    out = torch.zeros(a.shape[0], w.shape[1] // (2 if silu_and_mul else 1), device=a.device)
    start = 0
    for e, end in enumerate(ends):
        y = a[start:end].float() @ w[e].float().T
        if silu_and_mul:
            gate, up = y.chunk(2, dim=-1)
            y = torch.nn.functional.silu(gate) * up
        out[start:end] = y
        start = end
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_tilelang_grouped_gemms_match_torch():
    """Both programs on uneven groups (empty ones, one shorter than a tile, one of several tiles, the last ending
    before the rows do: rows past it stay untouched), at V2-Lite's expert shape on the default tiles (gate and up in
    one product) and a small shape on the other epilogues (two products, through shared memory or not)."""
    from rayinfer.kernels.mla_tilelang import tilelang_available
    from rayinfer.kernels.moe_tilelang import grouped_gemm_tilelang

    assert tilelang_available(), "the GPU machine's environment must provide tilelang"
    gen = torch.Generator(device="cuda").manual_seed(0)
    for sizes, inter, hidden, tiles in [
            ([0, 16, 400, 0, 1040, 32], 1408, 2048, None),
            ([128, 0, 48, 272], 256, 512, dict(block_n=256, num_stages=3, gate_up_mma="split")),
            ([128, 0, 48, 272], 256, 512, dict(block_n=128, gate_up_mma="split", store="shared"))]:
        e = len(sizes)
        ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        rows = int(ends[-1]) + 40  # 40 rows past the last group
        a = torch.randn(rows, hidden, generator=gen, device="cuda").to(torch.bfloat16)
        w13 = (torch.randn(e, 2 * inter, hidden, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
        w2 = (torch.randn(e, hidden, inter, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
        act = torch.full((rows, inter), 7.0, dtype=torch.bfloat16, device="cuda")
        grouped_gemm_tilelang(a, w13, ends, silu_and_mul=True, out=act, tiles=tiles)
        last = int(ends[-1])
        want = grouped_ref(a, w13, ends.tolist(), True)
        torch.testing.assert_close(act[:last].float(), want[:last], atol=3e-2, rtol=2e-2)
        assert bool((act[last:] == 7.0).all()), "rows past the last group were written"
        down = grouped_gemm_tilelang(act, w2, ends, silu_and_mul=False, tiles=tiles)
        torch.testing.assert_close(down[:last].float(), grouped_ref(act, w2, ends.tolist(), False)[:last],
                                   atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_grouped_path_on_tilelang_matches_ref(monkeypatch):
    """fused_moe_grouped_mm(gemms="tilelang") against fused_moe_ref at V2-Lite's (with its 2 shared experts as
    slots) and Qwen3-30B-A3B's expert shapes, skipped ids included, and through fused_moe with GROUPED_TILELANG;
    also at 64 tokens (groups of a few rows each, as bench_moe's M = 64 row times this path)."""
    import rayinfer.kernels.fused_moe as fm
    from rayinfer.kernels.fused_moe import fused_moe_grouped_mm, fused_moe_ref, tilelang_gemms_apply

    b16, tol = torch.bfloat16, 3e-2  # the bf16 tolerance of test_fused_moe.py
    gen = torch.Generator(device="cuda").manual_seed(1)
    for i, (t, e, h, inter, k) in enumerate([(2048, 66, 2048, 1408, 8), (1500, 128, 2048, 768, 8),
                                             (64, 66, 2048, 1408, 8)]):
        x = torch.randn(t, h, generator=gen, device="cuda").to(b16)
        w13 = (torch.randn(e, 2 * inter, h, generator=gen, device="cuda") * 0.02).to(b16)
        w2 = (torch.randn(e, h, inter, generator=gen, device="cuda") * 0.02).to(b16)
        w, ids = torch.rand(t, e, generator=gen, device="cuda").topk(k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        ids.view(-1)[::5] = -1  # skipped pairs (another rank's experts)
        assert tilelang_gemms_apply(x, w13, w2)
        want = fused_moe_ref(x, w13, w2, ids, w).float()
        got = fused_moe_grouped_mm(x, w13, w2, ids, w, gemms="tilelang")
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=lambda m: f"case {i}: {m}")
        with monkeypatch.context() as m:  # fused_moe dispatches to the same programs (bit for bit; torch's path
            m.setattr(fm, "GROUPED_TILELANG", 1)  # rounds gate/up first)
            m.setattr(fm, "GROUPED_MM_FROM", 1)
            assert torch.equal(fm.fused_moe(x, w13, w2, ids, w), got), f"case {i}: fused_moe took another path"
