"""Probe: where the grouped-GEMM fused-MoE path (kernels.fused_moe.fused_moe_grouped_mm) spends its time at
prefill sizes, piece by piece (each replayed from a CUDA graph), next to one dense cuBLAS GEMM of the same FLOPs
and the Triton grouped GEMM path; both weight layouts of torch's grouped GEMM (B column-major, as the model
stores the experts, and row-major).

    PYTHONPATH=. python benchmarks/probe/grouped_mm_parts.py --out benchmarks/results/moe-grouped-mm-parts-h200.json
"""
import argparse
import json
import subprocess

import torch

from rayinfer.kernels import fused_moe as fm
from rayinfer.kernels.activation import silu_and_mul

SHAPES = {"v2lite+2shared": (66, 2048, 1408, 8), "qwen3-30b-a3b": (128, 2048, 768, 8)}


def graph_us(fn, reps=20, inner=5):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / inner)
    return sorted(ts)[len(ts) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--m", default="2048,4096,8192")
    p.add_argument("--git-rev", default=None)
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    a = torch.randn(8192, 8192, device=dev, dtype=dt)
    mm_us = graph_us(lambda: a @ a)
    rate = 2 * 8192**3 / mm_us / 1e6
    rows = []
    op = fm._grouped_mm_op()
    for name, (E, H, I, k) in SHAPES.items():
        w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * 0.02
        w2 = torch.randn(E, H, I, device=dev, dtype=dt) * 0.02
        w13_rm = w13.transpose(1, 2).contiguous()  # [E, H, 2I] row-major B
        w2_rm = w2.transpose(1, 2).contiguous()
        for M in [int(m) for m in args.m.split(",")]:
            x = torch.randn(M, H, device=dev, dtype=dt)
            ids = torch.rand(M, E, device=dev).topk(k, dim=-1)[1].to(torch.int32)
            wts = torch.rand(M, k, device=dev)
            P = M * k
            kept = torch.empty(P, dtype=torch.int8, device=dev)
            sp, be = fm.moe_align_triton(ids, E, 16, None, None, kept)
            tiles = torch.zeros(E, dtype=torch.int32, device=dev)
            tiles.index_add_(0, be.clamp(min=0), (be >= 0).to(torch.int32))
            offs = (torch.cumsum(tiles, 0, dtype=torch.int32) * 16).to(torch.int32)
            rws = torch.where(sp < P, sp // k, 0)
            g = x.index_select(0, rws)
            h = op(g, w13.transpose(1, 2), offs=offs)
            act = silu_and_mul(h)
            y = op(act, w2.transpose(1, 2), offs=offs)
            pos = torch.empty(P + 1, dtype=torch.int32, device=dev)
            big = torch.randn(P, H, device=dev, dtype=dt)
            wbig = torch.randn(2 * I, H, device=dev, dtype=dt)
            w2big = torch.randn(H, I, device=dev, dtype=dt)
            actbig = torch.randn(P, I, device=dev, dtype=dt)
            flops = 2 * P * 3 * H * I
            r = {"shape": name, "E": E, "H": H, "I": I, "top_k": k, "M": M, "pairs": P, "padded_rows": sp.numel(),
                 "align_us": graph_us(lambda: fm.moe_align_triton(ids, E, 16, None, None, kept)),
                 "offs_us": graph_us(lambda: (torch.cumsum(torch.zeros(E, dtype=torch.int32, device=dev).index_add_(
                     0, be.clamp(min=0), (be >= 0).to(torch.int32)), 0, dtype=torch.int32) * 16)),
                 "gather_us": graph_us(lambda: x.index_select(0, torch.where(sp < P, sp // k, 0))),
                 "position_us": graph_us(lambda: pos.scatter_(0, sp.long(), torch.arange(sp.numel(), dtype=torch.int32, device=dev))),
                 "gemm1_colmajor_us": graph_us(lambda: op(g, w13.transpose(1, 2), offs=offs)),
                 "gemm1_rowmajor_us": graph_us(lambda: op(g, w13_rm, offs=offs)),
                 "silu_us": graph_us(lambda: silu_and_mul(h)),
                 "gemm2_colmajor_us": graph_us(lambda: op(act, w2.transpose(1, 2), offs=offs)),
                 "gemm2_rowmajor_us": graph_us(lambda: op(act, w2_rm, offs=offs)),
                 "dense_gemm1_us": graph_us(lambda: torch.mm(big, wbig.t())),
                 "dense_gemm2_us": graph_us(lambda: torch.mm(actbig, w2big.t())),
                 "grouped_mm_path_us": graph_us(lambda: fm.fused_moe_grouped_mm(x, w13, w2, ids, wts)),
                 "triton_path_us": graph_us(lambda: fm.fused_moe_triton(x, w13, w2, ids, wts))}
            r["ideal_us"] = flops / (rate * 1e12) * 1e6
            for key in ("grouped_mm_path_us", "triton_path_us"):
                r["pct_" + key[:-3]] = 100 * r["ideal_us"] / r[key]
            r["pct_gemms_only_colmajor"] = 100 * r["ideal_us"] / (r["gemm1_colmajor_us"] + r["gemm2_colmajor_us"])
            r["pct_dense_gemms"] = 100 * r["ideal_us"] / (r["dense_gemm1_us"] + r["dense_gemm2_us"])
            rows.append(r)
            print({kk: (round(v, 1) if isinstance(v, float) else v) for kk, v in r.items()}, flush=True)
    rev = args.git_rev or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True).stdout.strip()
    out = {"command": "PYTHONPATH=. python benchmarks/probe/grouped_mm_parts.py --out " + args.out,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "git_rev": rev or None,
           "matmul_TFLOPs": rate, "rows": rows}
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
