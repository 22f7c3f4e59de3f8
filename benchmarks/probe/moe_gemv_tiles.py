"""Probe: one token's MoE layer as GEMVs (kernels.moe_gemv) against the grouped GEMM's one-token tiles.

Times ``fused_moe`` for one token (CUDA graph of 10 calls, each with other random experts so that L2 holds
none of them; the slot sum included) on DeepSeek-V2-Lite's experts with the two shared ones fused (E = 66,
H 2048, I 1408, 6 + 2 pairs), Qwen3-30B-A3B's (E = 128, I 768, 8 pairs) and V2-Lite's fp8 experts, per tile
set of the two GEMV kernels, beside ``ONE_TOKEN_GEMV = 0`` (the grouped GEMM's tiles), as a share of the copy
bandwidth for the bytes the layer must read (its pairs' expert weights, plus scales for fp8).

    PYTHONPATH=. python benchmarks/probe/moe_gemv_tiles.py --out benchmarks/results/moe-gemv-tiles-h200.json
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import bench_graph, measure_ceilings  # noqa: E402

import rayinfer.kernels.fused_moe as fm  # noqa: E402
import rayinfer.kernels.moe_gemv as mg  # noqa: E402
from rayinfer.kernels.block_fp8 import quantize_block_fp8  # noqa: E402

# (block_n, block_k, num_warps, num_stages)
GATE_UP = [(16, 512, 4, 3), (8, 512, 4, 3), (16, 1024, 4, 3), (32, 256, 4, 3), (16, 256, 4, 4), (8, 1024, 8, 3),
           (32, 512, 8, 3), (8, 2048, 8, 2)]
DOWN = [(8, 512, 4, 3), (16, 512, 4, 3), (4, 512, 4, 3), (8, 256, 4, 4), (16, 256, 4, 3), (8, 128, 4, 4),
        (32, 256, 8, 3), (16, 1024, 8, 2)]
SHAPES = {"v2-lite": (66, 2048, 1408, 6, 2), "qwen3-30b-a3b": (128, 2048, 768, 8, 0)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--git-rev", default=None)
    ap.add_argument("--calls", type=int, default=10, help="calls per graph, each with other experts")
    args = ap.parse_args()
    torch.manual_seed(0)
    ceil = measure_ceilings()
    rows = []
    for name, fp8 in (("v2-lite", False), ("qwen3-30b-a3b", False), ("v2-lite", True)):
        e, h, inter, k, shared = SHAPES[name]
        dt = torch.bfloat16
        w13 = torch.randn(e, 2 * inter, h, device="cuda", dtype=dt) / h**0.5
        w2 = torch.randn(e, h, inter, device="cuda", dtype=dt) / inter**0.5
        scales = {}
        if fp8:
            (w13, s13), (w2, s2) = fm.quantize_w13(w13), quantize_block_fp8(w2)
            scales = dict(w13_scale=s13, w2_scale=s2)
        routed = e - shared
        calls = []
        for _ in range(args.calls):
            ids = torch.randperm(routed, device="cuda")[:k]
            ids = torch.cat([ids, torch.arange(routed, e, device="cuda")])[None]
            weights = torch.rand(1, k + shared, device="cuda")
            calls.append((torch.randn(1, h, device="cuda", dtype=dt), ids, weights))
        pairs = k + shared
        nbytes = pairs * (w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size())
        if fp8:
            nbytes += pairs * (s13[0].numel() + s2[0].numel()) * 4

        def timed(label, **cfg):
            def layer(i):
                x, ids, weights = calls[i]
                return fm.fused_moe(x, w13, w2, ids, weights, **scales)
            us = bench_graph([lambda i=i: layer(i) for i in range(args.calls)])  # per call
            ref = fm.fused_moe_ref(calls[0][0], *(fm._dequant_experts(w13, w2, s13, s2, dt) if fp8 else (w13, w2)),
                                   calls[0][1], calls[0][2])
            err = (layer(0).float() - ref.float()).abs().max().item()
            pct = round(100 * nbytes / (us * 1e-6) / (ceil["copy_GBps"] * 1e9), 1)
            rows.append({"shape": name, "fp8": fp8, "what": label, **cfg, "us": us, "pct_of_copy": pct,
                         "max_abs_err_vs_w8a16_ref": err})
            print(rows[-1], flush=True)
            return us

        saved = (fm.ONE_TOKEN_GEMV, fm.ONE_TOKEN_GEMV_FP8, mg.GATE_UP_TILES, mg.DOWN_TILES)
        try:
            fm.ONE_TOKEN_GEMV = 0
            timed("grouped GEMM one-token tiles" + (" (W8A8)" if fp8 else ""))
            fm.ONE_TOKEN_GEMV, fm.ONE_TOKEN_GEMV_FP8 = 1, 1
            best = {}
            for gu in GATE_UP:
                mg.GATE_UP_TILES = gu
                best[gu] = timed("GEMVs", gate_up=gu, down=mg.DOWN_TILES)
            mg.GATE_UP_TILES = min(best, key=best.get)
            for dn in DOWN:
                mg.DOWN_TILES = dn
                timed("GEMVs", gate_up=mg.GATE_UP_TILES, down=dn)
        finally:
            fm.ONE_TOKEN_GEMV, fm.ONE_TOKEN_GEMV_FP8, mg.GATE_UP_TILES, mg.DOWN_TILES = saved
        del w13, w2
        torch.cuda.empty_cache()
    rev = args.git_rev or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True).stdout.strip()
    out = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "git_rev": rev,
           "torch": torch.__version__, "ceilings": ceil, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
