"""Probe: the W8A16 block-fp8 GEMM (rayinfer/kernels/block_fp8.py) against cuBLAS bf16 at DeepSeek-V3's dense shapes,
per row count and tile configuration; and whether a row's bits depend on the batch. ``--w8a8``: the W8A8 scheme
(activation quantization included) per tile set at DeepSeek-V2-Lite's and V3's dense shapes, prefill row counts.

    python benchmarks/probe/block_fp8_tiles.py --out benchmarks/results/block-fp8-tiles-h200.json
    python benchmarks/probe/block_fp8_tiles.py --w8a8 --out benchmarks/results/block-fp8-w8a8-tiles-h200.json

Times: triton's do_bench median (L2 flushed between calls, launch included), microseconds. ``bf16_us`` is
``F.linear`` over the same weight in bf16 (two bytes a weight), ``dequant_us`` dequantize-then-cuBLAS.
"""
import argparse
import json
import subprocess

import torch
import torch.nn.functional as F
import triton

from rayinfer.kernels.block_fp8 import _choose_config, block_fp8_dequant_ref, block_fp8_linear, quantize_block_fp8

# (N, K): q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj, dense gate (and up), dense down, shared-expert down
SHAPES = [(1536, 7168), (24576, 1536), (576, 7168), (7168, 16384), (18432, 7168), (7168, 18432), (7168, 2048)]
ROWS = (1, 16, 64, 128, 512, 2048)
CANDIDATES = {
    "small": [dict(block_m=16, block_n=bn, block_k=128, num_warps=4, num_stages=s)
              for bn in (16, 32, 64, 128) for s in (3, 4)],
    "mid": [dict(block_m=bm, block_n=bn, block_k=128, num_warps=4, num_stages=4)
            for bm in (32, 64) for bn in (32, 64, 128)],
    "large": [dict(block_m=128, block_n=bn, block_k=bk, num_warps=w, num_stages=3)
              for bn in (64, 128, 256) for bk in (64, 128) for w in (4, 8) if not (bn == 256 and bk == 128)],
}

QUICK = {
    "small": [dict(block_m=16, block_n=bn, block_k=128, num_warps=4, num_stages=4) for bn in (16, 64, 128)],
    "mid": [dict(block_m=bm, block_n=bn, block_k=128, num_warps=4, num_stages=4) for bm, bn in ((32, 64), (64, 128))],
    "large": [dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
              dict(block_m=128, block_n=64, block_k=128, num_warps=4, num_stages=3),
              dict(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4)],
}


# (N, K) of DeepSeek-V2-Lite: q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, layer 0's gate+up and down; V3's q_a_proj
W8A8_SHAPES = [(3072, 2048), (576, 2048), (4096, 512), (2048, 2048), (21888, 2048), (2048, 10944), (1536, 7168)]
W8A8_ROWS = (512, 2048, 4096)
W8A8_CANDIDATES = [dict(block_m=bm, block_n=bn, block_k=128, num_warps=w, num_stages=st)
                   for bm, bn, w, st in ((128, 128, 8, 4), (128, 128, 8, 3), (128, 128, 4, 4), (128, 256, 8, 3),
                                         (64, 128, 4, 4), (128, 64, 4, 4), (64, 256, 8, 4))]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def time_configs(x, q, s, configs: list[dict], act_fp8: bool) -> tuple[list[dict], dict]:
    """Each tile config of ``block_fp8_linear`` timed (us, or the error of one that does not launch), and the
    fastest."""
    timed = []
    for cfg in configs:
        try:
            us = bench(lambda: block_fp8_linear(x, q, s, config={**cfg, "group_m": 8}, act_fp8=act_fp8))
        except Exception as e:  # out of shared memory, say
            us = repr(e)[:120]
        timed.append(dict(cfg, us=us))
    return timed, min((c for c in timed if isinstance(c["us"], float)), key=lambda c: c["us"])


def shape_case(n: int, k: int, rows: int, gen: torch.Generator) -> tuple:
    """An [n, k] weight in fp8 blocks (q, s), the same dequantized to bf16 (cuBLAS's operand), and ``rows``
    rows of bf16 input, on the GPU."""
    w = (torch.randn(n, k, generator=gen) / k**0.5).cuda()
    q, s = quantize_block_fp8(w)
    x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
    return q, s, block_fp8_dequant_ref(q, s, torch.bfloat16), x


def main_w8a8(out: str | None) -> None:
    from rayinfer.kernels.block_fp8 import W8A8_TILES, block_fp8_linear_w8a8_ref

    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, k in W8A8_SHAPES:
        q, s, w16, x = shape_case(n, k, max(W8A8_ROWS), gen)
        for m in W8A8_ROWS:
            xm = x[:m]
            err = (block_fp8_linear(xm, q, s, act_fp8=True).float() - block_fp8_linear_w8a8_ref(xm, q, s).float()).abs().max().item()
            row = dict(shape=[n, k], m=m, bf16_us=bench(lambda: F.linear(xm, w16)),
                       w8a16_us=bench(lambda: block_fp8_linear(xm, q, s, act_fp8=False)),
                       w8a8_default=W8A8_TILES, w8a8_us=bench(lambda: block_fp8_linear(xm, q, s, act_fp8=True)),
                       max_abs_err_vs_w8a8_ref=err, configs=[])
            row["configs"], row["best"] = time_configs(xm, q, s, W8A8_CANDIDATES, act_fp8=True)
            row["bf16_TFLOPs"] = 2 * m * n * k / row["bf16_us"] / 1e6
            row["w8a8_TFLOPs"] = 2 * m * n * k / row["w8a8_us"] / 1e6
            print(f"{n}x{k} m={m}: bf16 {row['bf16_us']:.1f} w8a16 {row['w8a16_us']:.1f} w8a8 {row['w8a8_us']:.1f} "
                  f"({row['w8a8_TFLOPs']:.0f} TFLOP/s) best {row['best']['us']:.1f} "
                  f"{({k: v for k, v in row['best'].items() if k != 'us'})} err={err:.1e}", flush=True)
            rows.append(row)
        if out:
            rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
            with open(out, "w") as f:
                json.dump(dict(command="python benchmarks/probe/block_fp8_tiles.py --w8a8",
                               device=torch.cuda.get_device_name(), torch=torch.__version__,
                               triton=triton.__version__, git_rev=rev, rows=rows), f, indent=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="three candidate tiles per row-count bucket")
    p.add_argument("--w8a8", action="store_true", help="W8A8 tiles at prefill row counts")
    args = p.parse_args()
    if args.w8a8:
        return main_w8a8(args.out)
    candidates = QUICK if args.quick else CANDIDATES
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, k in SHAPES:
        q, s, w16, x = shape_case(n, k, max(ROWS), gen)
        full = block_fp8_linear(x, q, s, act_fp8=False)
        invariant = all(torch.equal(block_fp8_linear(x[:m], q, s, act_fp8=False), full[:m]) for m in ROWS)
        for m in ROWS:
            xm = x[:m]
            row = dict(shape=[n, k], m=m, default=_choose_config(m, n), batch_invariant=invariant,
                       bf16_us=bench(lambda: F.linear(xm, w16)),
                       dequant_us=bench(lambda: F.linear(xm, block_fp8_dequant_ref(q, s, torch.bfloat16))),
                       default_us=bench(lambda: block_fp8_linear(xm, q, s, act_fp8=False)), configs=[])
            err = (block_fp8_linear(xm, q, s, act_fp8=False).float() - F.linear(xm, w16).float()).abs().max().item()
            row["max_abs_err_vs_bf16"] = err
            bucket = "small" if m <= 16 else "mid" if m <= 128 else "large"
            row["configs"], best = time_configs(xm, q, s, candidates[bucket], act_fp8=False)
            row["best"] = best
            # the fewest bytes: the fp8 weight, its scales, x and y in bf16
            row["weight_GBps_default"] = (n * k + 2 * m * (n + k)) / row["default_us"] / 1e3
            print(f"{n}x{k} m={m}: bf16 {row['bf16_us']:.1f} dequant+bf16 {row['dequant_us']:.1f} fp8 default "
                  f"{row['default_us']:.1f} best {best['us']:.1f} {({k: v for k, v in best.items() if k != 'us'})} "
                  f"({row['weight_GBps_default']:.0f} GB/s) invariant={invariant} err={err:.1e}", flush=True)
            rows.append(row)
        if args.out:
            rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
            with open(args.out, "w") as f:
                json.dump(dict(command="python benchmarks/probe/block_fp8_tiles.py",
                               device=torch.cuda.get_device_name(), torch=torch.__version__,
                               triton=triton.__version__, git_rev=rev, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
