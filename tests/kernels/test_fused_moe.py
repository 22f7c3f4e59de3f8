"""fused_moe: the reference against a per-token float64 loop, the alignment by hand, the Triton kernel
against the reference (interpreter on CPU, ``-m gpu`` on CUDA)."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.nn.functional as F

from rayinfer.kernels._triton_utils import HAS_TRITON, use_triton
from rayinfer.kernels.fused_moe import (
    ExpertMap, dequant_w13, fused_moe, fused_moe_grouped_mm, fused_moe_ref, fused_moe_slots, fused_moe_slots_ref,
    fused_moe_triton, fused_moe_w8a8_ref, grouped_mm_applies, moe_align, moe_align_ref, moe_align_triton,
    quantize_w13, sum_slots,
)
from rayinfer.kernels.block_fp8 import block_fp8_dequant_ref, quantize_block_fp8
import rayinfer.kernels.fused_moe as fm
from rayinfer.kernels.fused_moe import _aligned_size as fm_aligned_size
from rayinfer.model.moe import log2phy_table

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def make_case(num_tokens, num_experts, hidden, inter, top_k, dtype, device, seed=0, skip_every=0):
    """Random experts and distinct top-k ids per token; every ``skip_every``-th (token, slot) is -1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1)[1]
    if skip_every:
        ids.view(-1)[::skip_every] = -1
    weights = torch.rand(num_tokens, top_k, generator=gen)
    to = dict(device=device, dtype=dtype)
    return x.to(**to), w13.to(**to), w2.to(**to), ids.to(device), weights.to(device)


def loop_moe(x, w13, w2, ids, weights):
    """Per token and slot, in float64."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    inter = w2.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            if 0 <= e < w13.shape[0]:
                gate_up = w13[e] @ x[t]
                out[t] += weights[t, j] * (w2[e] @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
    return out


@pytest.mark.parametrize("case", [(1, 4, 16, 8, 1, 0), (7, 8, 32, 24, 2, 0), (13, 6, 24, 16, 3, 4),
                                  (0, 4, 16, 8, 2, 0)])
def test_ref_matches_loop(case):
    x, w13, w2, ids, w = make_case(*case[:5], torch.float32, "cpu", skip_every=case[5])
    got = fused_moe_ref(x, w13, w2, ids, w).double()
    torch.testing.assert_close(got, loop_moe(x, w13, w2, ids, w), atol=1e-5, rtol=1e-5)


def test_slots_ref_sum_to_ref():
    """Per-slot outputs (expert parallelism's batch-invariant combine): zeros at skipped slots, and their
    sum is the routed output."""
    x, w13, w2, ids, w = make_case(13, 6, 24, 16, 3, torch.float32, "cpu", skip_every=4)
    slots = fused_moe_slots_ref(x, w13, w2, ids, w)
    assert slots.shape == (13, 3, 24) and slots.dtype == torch.float32
    assert (slots.view(-1, 24)[::4] == 0).all()
    torch.testing.assert_close(sum_slots(slots), fused_moe_ref(x, w13, w2, ids, w), atol=1e-5, rtol=1e-5)


def test_ref_rejects_bad_shapes():
    x, w13, w2, ids, w = make_case(3, 4, 16, 8, 2, torch.float32, "cpu")
    with pytest.raises(ValueError):
        fused_moe_ref(x[:, :8], w13, w2, ids, w)
    with pytest.raises(ValueError):
        fused_moe_ref(x, w13, w2[:, :, :4], ids, w)
    with pytest.raises(ValueError):
        fused_moe_ref(x, w13, w2, ids, w[:, :1])


def test_moe_align_by_hand():
    ids = torch.tensor([[2, 0], [2, -1], [0, 2]])  # pairs 0..5: experts 2,0,2,-,0,2
    sorted_pairs, block_experts = moe_align_ref(ids, num_experts=3, block_m=2)
    # expert 0 -> pairs 1,4; expert 1 -> none; expert 2 -> pairs 0,2,5 (+ one pad); sentinel is 6
    assert sorted_pairs.tolist()[:6] == [1, 4, 0, 2, 5, 6]
    assert set(sorted_pairs.tolist()[6:]) == {6}
    assert block_experts.tolist()[:2] == [0, 2] and block_experts.tolist()[2] == 2
    assert all(e == -1 for e in block_experts.tolist()[3:])


def check_alignment(sorted_pairs, block_experts, ids, num_experts, block_m) -> None:
    """A valid alignment of ids (no reference): each kept pair exactly once, in a tile of its expert;
    every other row the sentinel; tiles past the last used one marked -1; tiles in ascending expert."""
    flat = ids.reshape(-1).cpu().long()
    num_pairs = flat.numel()
    pairs, tiles = sorted_pairs.cpu().long(), block_experts.cpu().long()
    assert pairs.numel() == tiles.numel() * block_m
    kept = ((flat >= 0) & (flat < num_experts)).nonzero().squeeze(1)
    real = pairs[pairs != num_pairs]
    assert sorted(real.tolist()) == kept.tolist(), "each kept pair exactly once"
    tile_of_row = tiles.repeat_interleave(block_m)
    rows = (pairs != num_pairs).nonzero().squeeze(1)
    assert torch.equal(tile_of_row[rows], flat[pairs[rows]]), "pairs in their expert's tiles"
    used = tiles[tiles >= 0]
    assert (used[1:] >= used[:-1]).all(), "tiles in ascending expert"
    assert (tiles[used.numel():] == -1).all() and (tiles[: used.numel()] >= 0).all()
    counts = torch.bincount(flat[kept], minlength=num_experts)
    assert torch.equal(torch.bincount(used, minlength=num_experts), (counts + block_m - 1) // block_m)


def random_ids(num_tokens, top_k, num_ids, seed, drop=0.1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_ids, (num_tokens, top_k), generator=gen)
    return torch.where(torch.rand(num_tokens, top_k, generator=gen) < drop, -1, ids)


ALIGN_CASES = [(1, 1, 4, 16), (3, 2, 5, 16), (40, 6, 64, 16), (700, 6, 64, 64)]  # T, k, E, block_m


def test_moe_align_ref_is_valid():
    for i, (t, k, e, bm) in enumerate(ALIGN_CASES + [(129, 8, 33, 32)]):
        ids = random_ids(t, k, e + 2, seed=i)  # ids >= e are dropped too
        check_alignment(*moe_align_ref(ids, e, bm), ids, e, bm)


def check_align_kernel(device, cases) -> None:
    """moe_align_triton equals the reference exactly (plain ids; mapped through an ExpertMap with
    replicas; logical load counting), and is valid."""
    for i, (t, k, e, bm) in enumerate(cases):
        ids = random_ids(t, k, e + 2, seed=i).to(device)
        got = moe_align_triton(ids, e, bm)
        want = moe_align_ref(ids, e, bm)
        assert torch.equal(got[0].long(), want[0]) and torch.equal(got[1].long(), want[1]), f"case {i}"
        check_alignment(*got, ids, e, bm)
        # 2 ranks of e slots each over `logical` experts with replicas, this rank the second
        logical = max(1, e * 2 - 3)
        phy2log = torch.arange(2 * e) % logical
        log2phy, replica_counts = log2phy_table(phy2log, logical)
        emap = ExpertMap(log2phy.to(device), replica_counts.to(device), first_local=e, num_local=e)
        logical_ids = random_ids(t, k, logical, seed=50 + i).to(device)
        load = torch.zeros(logical, dtype=torch.int64, device=device)
        got = moe_align_triton(logical_ids, e, bm, emap, load)
        local = emap.local_ids(logical_ids)
        want = moe_align_ref(local, e, bm)
        assert torch.equal(got[0].long(), want[0]) and torch.equal(got[1].long(), want[1]), f"mapped case {i}"
        kept = logical_ids[logical_ids >= 0]
        assert torch.equal(load, torch.bincount(kept, minlength=logical)), f"load case {i}"


def check_kernel(device, cases):
    worst = 0.0
    for i, (t, e, h, inter, k, dtype) in enumerate(cases):
        x, w13, w2, ids, w = make_case(t, e, h, inter, k, dtype, device, seed=i, skip_every=7)
        got, want = fused_moe(x, w13, w2, ids, w), fused_moe_ref(x, w13, w2, ids, w)
        tol = TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"case {i}: {m}")
        worst = max(worst, (got.float() - want.float()).abs().max().item())
        if i == 0:  # the unsummed outputs take the same kernels
            torch.testing.assert_close(fused_moe_slots(x, w13, w2, ids, w), fused_moe_slots_ref(x, w13, w2, ids, w),
                                       atol=tol, rtol=tol, msg=lambda m: f"slots: {m}")
            # a residual stream takes the sum in place (the last launch adds it), rounded as residual + out
            residual = torch.randn_like(x)
            expected = residual + got
            back = fused_moe(x, w13, w2, ids, w, residual=residual)
            assert back is residual
            torch.testing.assert_close(residual, expected, atol=tol, rtol=tol, msg=lambda m: f"residual: {m}")
        if t == 1:
            check_one_token_direct(x, w13, w2, ids, w, got)
    return worst


def check_grouped_layout(ids, num_experts, top_k, block_m=16):
    """The alignment's extra outputs for the grouped-GEMM path, against what the sorted pairs imply: each
    expert's padded end, every sorted row's token (0 in padding rows), every kept pair's sorted row."""
    num_pairs = ids.numel()
    size = fm_aligned_size(num_pairs, num_experts, block_m)
    ends = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    rows = torch.empty(size, dtype=torch.int32, device=ids.device)
    positions = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
    kept = torch.empty(num_pairs, dtype=torch.int8, device=ids.device)
    sorted_pairs, block_experts = moe_align_triton(ids, num_experts, block_m, kept=kept,
                                                   grouped=(ends, rows, positions))
    tiles = torch.bincount(block_experts[block_experts >= 0].long(), minlength=num_experts)
    assert torch.equal(ends.long().cpu(), (torch.cumsum(tiles, 0) * block_m).cpu())
    real = sorted_pairs < num_pairs
    want_rows = torch.where(real, sorted_pairs // top_k, 0)
    assert torch.equal(rows[: int(ends[-1])].cpu(), want_rows[: int(ends[-1])].int().cpu())
    where = real.nonzero().squeeze(1)
    assert torch.equal(positions[sorted_pairs[where].long()].long().cpu(), where.cpu())
    assert int(kept.sum()) == int(real.sum())


def check_grouped_mm(device, cases):
    """The grouped-GEMM path (torch's grouped GEMM between the Triton alignment and slot sum) against the
    reference: skipped ids, expert-load counting, an ExpertMap with a redundant slot, the residual add, and
    on CUDA the dispatch from fused_moe once GROUPED_MM_FROM is reached (replayed from a CUDA graph)."""
    import rayinfer.kernels.fused_moe as fm

    worst = 0.0
    for i, (t, e, h, inter, k, dtype) in enumerate(cases):
        x, w13, w2, ids, w = make_case(t, e, h, inter, k, dtype, device, seed=10 + i, skip_every=5)
        tol = TOL[dtype]
        load = torch.zeros(e, dtype=torch.int64, device=device)
        got = fused_moe_grouped_mm(x, w13, w2, ids, w, expert_load=load)
        want = fused_moe_ref(x, w13, w2, ids, w)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"case {i}: {m}")
        valid = ids[ids >= 0]
        assert torch.equal(load, torch.bincount(valid.reshape(-1), minlength=e)), f"case {i}: expert load"
        worst = max(worst, (got.float() - want.float()).abs().max().item())
        check_grouped_layout(ids, e, k)
        residual = torch.randn_like(x)
        expected = residual + got
        assert fused_moe_grouped_mm(x, w13, w2, ids, w, residual=residual) is residual
        torch.testing.assert_close(residual, expected, atol=tol, rtol=tol, msg=lambda m: f"case {i} residual: {m}")
        # logical expert 0 also has a replica in slot e: tokens alternate between the two (same weights)
        phy2log = torch.cat([torch.arange(e), torch.zeros(1, dtype=torch.long)])
        log2phy, replica_counts = log2phy_table(phy2log, e)
        emap = ExpertMap(log2phy.to(device), replica_counts.to(device), first_local=0, num_local=e + 1)
        mapped = fused_moe_grouped_mm(x, w13[phy2log.to(device)], w2[phy2log.to(device)], ids, w, emap)
        torch.testing.assert_close(mapped.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"case {i} map: {m}")
        if device == "cuda":
            saved = fm.GROUPED_MM_FROM
            fm.GROUPED_MM_FROM = t
            try:
                assert grouped_mm_applies(x, w13) == (dtype == torch.bfloat16)
                fused_moe(x, w13, w2, ids, w)  # compiles outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    replayed = fused_moe(x, w13, w2, ids, w)
                graph.replay()
                torch.testing.assert_close(replayed, fused_moe(x, w13, w2, ids, w), atol=0, rtol=0)
            finally:
                fm.GROUPED_MM_FROM = saved
    return worst


def check_one_token_direct(x, w13, w2, ids, w, got):
    """A one-token call skips the alignment: its 16-bit experts run on direct grouped-GEMM tiles that read the
    experts from topk_ids, or with ``ONE_TOKEN_GEMV = 1`` as GEMVs (``kernels.moe_gemv``). The tiles give the
    aligned path's bits, the GEMVs its values up to summation order (and zero rows for skipped ids in the
    unsummed outputs); every form counts the same expert load (skipped ids not counted)."""
    import rayinfer.kernels.fused_moe as fm

    num_logical = w13.shape[0] - 1  # the last expert stands for a fused shared one: computed, not counted
    loads = {}

    def run(**switches):
        saved = {k: getattr(fm, k) for k in switches}
        for k, v in switches.items():
            setattr(fm, k, v)
        try:
            loads[tuple(switches.items())] = load = torch.zeros(num_logical, dtype=torch.int64, device=x.device)
            return fused_moe(x, w13, w2, ids, w, expert_load=load)
        finally:
            for k, v in saved.items():
                setattr(fm, k, v)

    gemv, tiles, aligned = run(ONE_TOKEN_GEMV=1), run(ONE_TOKEN_GEMV=0), run(ONE_TOKEN_GEMV=0, ONE_TOKEN_DIRECT=0)
    assert torch.equal(tiles, aligned) and torch.equal(tiles, got)
    tol = TOL[x.dtype]
    torch.testing.assert_close(gemv.float(), aligned.float(), atol=tol, rtol=tol, msg=lambda m: f"GEMVs: {m}")
    saved, fm.ONE_TOKEN_GEMV = fm.ONE_TOKEN_GEMV, 1
    try:
        torch.testing.assert_close(fused_moe_slots(x, w13, w2, ids, w), fused_moe_slots_ref(x, w13, w2, ids, w),
                                   atol=tol, rtol=tol, msg=lambda m: f"GEMV slots: {m}")
        residual = torch.randn_like(x)
        expected = residual + gemv
        assert fused_moe(x, w13, w2, ids, w, residual=residual) is residual
        torch.testing.assert_close(residual, expected, atol=tol, rtol=tol, msg=lambda m: f"GEMV residual: {m}")
    finally:
        fm.ONE_TOKEN_GEMV = saved
    flat = ids.reshape(-1)
    kept = flat[(flat >= 0) & (flat < num_logical)]
    want_load = torch.bincount(kept, minlength=num_logical)
    assert all(torch.equal(load, want_load) for load in loads.values())


def close_w8a8(got, want, tol, case):
    """W8A8 against its reference: the SiLU-and-mul output is quantized again, so a last-bit difference of
    that bf16 product (the GEMM's summation order) on an e4m3 midpoint moves one activation a whole fp8
    step; a few outputs may then differ by a few tolerances, never many of them, never by much. That step
    is an 8-bit activation's, whatever the output dtype, so float32 outputs get float16's tolerance (float32's
    1e-5 is below one such step: case (7, 8, 200, 72, 2, float32) differed by 4.7e-5 on an H200)."""
    tol = max(tol, TOL[torch.float16])
    err = (got.float() - want.float()).abs()
    bound = tol + tol * want.float().abs()
    assert bool((err <= 3 * bound).all()), f"fp8 case {case} W8A8: max error {err.max().item():.3g}"
    assert (err > bound).float().mean().item() <= 1e-3, f"fp8 case {case} W8A8: {(err > bound).sum().item()} outside"


def check_fp8_kernel(device, cases) -> float:
    """fused_moe on fp8 block-quantized experts against the reference on the dequantized weights (which is
    what the torch path computes); the unsummed outputs too. cases: (T, E, H, I, k, dtype)."""
    worst = 0.0
    for i, (t, e, h, inter, k, dtype) in enumerate(cases):
        x, w13, w2, ids, w = make_case(t, e, h, inter, k, torch.float32, device, seed=i, skip_every=5)
        (q13, s13), (q2, s2) = quantize_w13(w13), quantize_block_fp8(w2)
        x = x.to(dtype)
        d13, d2 = dequant_w13(q13, s13, dtype), block_fp8_dequant_ref(q2, s2, dtype)
        assert (d13.float() - w13).abs().max() <= 0.07 * w13.abs().max()  # e4m3: 3 mantissa bits
        got = fused_moe(x, q13, q2, ids, w, w13_scale=s13, w2_scale=s2)
        want = fused_moe_ref(x, d13, d2, ids, w)
        want8 = fused_moe_w8a8_ref(x, q13, q2, s13, s2, ids, w)
        # one token takes the GEMVs (kernels.moe_gemv; W8A16) where Triton runs, else W8A8 where it applies
        w8a8 = fm.w8a8_applies(x) and not (t == 1 and use_triton(x, q13) and fm.ONE_TOKEN_GEMV_FP8)
        tol = TOL[dtype]
        check_w8a8 = functools.partial(close_w8a8, tol=tol, case=i)
        if w8a8:
            check_w8a8(got, want8)
        else:
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"fp8 case {i}: {m}")
        worst = max(worst, (got.float() - want.float()).abs().max().item())
        if use_triton(x, q13):  # both schemes of the Triton kernel, each against its own reference
            both = fused_moe_triton(x, q13, q2, ids, w, w13_scale=s13, w2_scale=s2, act_fp8=False)
            torch.testing.assert_close(both.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"fp8 case {i}: {m}")
            check_w8a8(fused_moe_triton(x, q13, q2, ids, w, w13_scale=s13, w2_scale=s2, act_fp8=True), want8)
            # the activations' quantization is seen: W8A8 differs from the W8A16 reference by more than rounding
            assert (want8.float() - want.float()).abs().max() > 1e-4
        if t == 1 and use_triton(x, q13):
            calls = []  # one token's fp8 experts take the GEMVs by default (whatever the 16-bit switch says)
            real = fm.moe_gemv_pairs
            fm.moe_gemv_pairs = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
            try:
                fused_moe(x, q13, q2, ids, w, w13_scale=s13, w2_scale=s2)
            finally:
                fm.moe_gemv_pairs = real
            assert calls == [1], f"fp8 case {i}: the one-token GEMVs did not run"
            # with the GEMVs off, one token's fp8 experts take the direct tiles
            saved, fm.ONE_TOKEN_GEMV_FP8 = fm.ONE_TOKEN_GEMV_FP8, 0
            try:
                tiles = fused_moe(x, q13, q2, ids, w, w13_scale=s13, w2_scale=s2)
            finally:
                fm.ONE_TOKEN_GEMV_FP8 = saved
            if fm.w8a8_applies(x):
                check_w8a8(tiles, want8)
            else:
                torch.testing.assert_close(tiles.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"tiles {i}: {m}")
        if i == 0:
            slots = fused_moe_slots(x, q13, q2, ids, w, w13_scale=s13, w2_scale=s2)
            if w8a8:  # no per-slot W8A8 reference: the slots' sum against the W8A8 one
                close_w8a8(sum_slots(slots).to(dtype), want8, tol, i)
            else:
                torch.testing.assert_close(slots, fused_moe_slots_ref(x, d13, d2, ids, w), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="both w13_scale and w2_scale"):
        fused_moe(x, q13, q2, ids, w, w13_scale=s13)
    with pytest.raises(ValueError, match="fp8 experts are float8_e4m3fn"):
        fused_moe(x, q13, q2, ids, w, w13_scale=s13[:, :1], w2_scale=s2)
    return worst


def test_fp8_experts_torch_path():
    check_fp8_kernel("cpu", [(6, 4, 160, 72, 2, torch.float32)])


GPU_CASES = [
    (1, 64, 2048, 768, 8, torch.bfloat16),
    (300, 64, 2048, 768, 8, torch.bfloat16),
    (2048, 128, 1024, 512, 8, torch.bfloat16),
    (5, 8, 100, 36, 2, torch.float16),
    (1, 8, 256, 40, 3, torch.float16),  # one token, gate/up and down column tiles of 32 and 64
    (37, 8, 64, 48, 2, torch.float32),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_matches_ref():
    print(f"fused_moe: max abs err {check_kernel('cuda', GPU_CASES):.2e}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fp8_kernel_matches_ref():
    b16 = torch.bfloat16
    print(f"fused_moe fp8: max abs err {check_fp8_kernel('cuda', [(1, 66, 2048, 1408, 8, b16), (300, 64, 2048, 1408, 6, b16), (2048, 128, 2048, 768, 8, b16), (7, 8, 200, 72, 2, torch.float32)]):.2e}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_grouped_mm_path_matches_ref():
    b16 = torch.bfloat16
    print(f"fused_moe grouped_mm: max abs err {check_grouped_mm('cuda', [(2048, 66, 2048, 1408, 8, b16), (4096, 128, 2048, 768, 8, b16), (300, 8, 256, 96, 2, torch.float32)]):.2e}")
    # skewed routing: 4096 tokens over 10 of 66 experts (56 empty groups), a third of the pairs on another rank
    x, w13, w2, _, w = make_case(4096, 66, 2048, 1408, 8, b16, "cuda", seed=3)
    ids = torch.rand(4096, 10, device="cuda").topk(8, dim=-1)[1] * 3
    ids[torch.rand(ids.shape, device="cuda") < 0.33] = -1
    got, want = fused_moe_grouped_mm(x, w13, w2, ids, w), fused_moe_ref(x, w13, w2, ids, w)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[b16], rtol=TOL[b16])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_align_kernel_matches_ref_on_gpu():
    check_align_kernel("cuda", ALIGN_CASES + [(129, 8, 33, 32), (4096, 8, 256, 64), (8192, 6, 64, 64),
                                              (1, 8, 288, 16), (10, 6, 64, 16)])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_routing_and_moe_replay_from_a_cuda_graph():
    """Router kernel + alignment + grouped GEMMs (with an EP-style ExpertMap and load counting) captured in
    one CUDA graph (no host sync) and replayed on new logits: the reference's output and expert load."""
    from rayinfer.kernels.moe_routing import grouped_topk

    num_tokens, num_experts, hidden_size, inter, top_k = 48, 64, 256, 128, 6
    x, w13, w2, _, _ = make_case(num_tokens, num_experts, hidden_size, inter, top_k, torch.bfloat16, "cuda")
    phy2log = torch.arange(num_experts + 8) % num_experts  # 8 redundant slots on one rank
    log2phy, replica_counts = log2phy_table(phy2log, num_experts)
    emap = ExpertMap(log2phy.cuda(), replica_counts.cuda(), first_local=0, num_local=num_experts + 8)
    w13_phy, w2_phy = w13[phy2log.cuda()], w2[phy2log.cuda()]
    bias = torch.randn(num_experts, device="cuda") * 0.1
    logits = torch.randn(num_tokens, num_experts, device="cuda")
    load = torch.zeros(num_experts, dtype=torch.int64, device="cuda")

    def layer():
        weights, ids = grouped_topk(logits, bias, top_k, 8, 4, True, 2.5)
        return fused_moe(x, w13_phy, w2_phy, ids, weights, emap, load), ids, weights

    layer()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, ids, weights = layer()
    logits.copy_(torch.randn(num_tokens, num_experts, device="cuda"))
    load.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want_w, want_ids = grouped_topk_ref_sorted(logits, bias, top_k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w)
    want = fused_moe_ref(x, w13, w2, ids, weights)  # logical experts: replicas hold the same weights
    torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(load, torch.bincount(ids.reshape(-1), minlength=num_experts))


def grouped_topk_ref_sorted(logits, bias, top_k):
    from rayinfer.kernels.batch_invariant import batch_invariant_mode
    from rayinfer.kernels.moe_routing import grouped_topk_ref

    with batch_invariant_mode():  # ids by descending choice, as the kernel's
        return grouped_topk_ref(logits, bias, top_k, 8, 4, True, 2.5)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        f32 = torch.float32
        check_kernel("cpu", [(5, 4, 32, 16, 2, f32), (1, 8, 48, 24, 3, f32), (40, 6, 40, 20, 2, f32)])
        check_align_kernel("cpu", ALIGN_CASES)
        check_fp8_kernel("cpu", [(5, 4, 160, 72, 2, f32), (3, 6, 144, 136, 3, f32), (1, 6, 144, 136, 3, f32)])
        check_grouped_mm("cpu", [(40, 6, 40, 24, 3, f32), (1, 8, 48, 32, 3, f32), (17, 4, 64, 32, 2, torch.bfloat16)])
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
