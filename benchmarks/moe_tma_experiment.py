"""Experiment (reverted after one run): TMA-fed grouped GEMMs over a pre-gathered expert-sorted copy of the
activations, against the pointer-gather fused MoE at large M (V2-Lite with its 2 shared experts fused, Qwen3-30B-A3B).

    PYTHONPATH=. python3 benchmarks/moe_tma_experiment.py   # one H200; writes $OUT/tma.json
"""
import json, sys, time, os
import torch
from rayinfer.kernels.fused_moe import fused_moe_triton, moe_align_triton, fused_moe_tiles, _active_tiles, _moe_sum_kernel
from rayinfer.kernels.fused_moe_config import MoETileConfig
from rayinfer.kernels.fused_moe_tma import moe_gemms_tma
import triton

dev = torch.device("cuda")
def timeit(fn, reps=20):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps * 1e3  # us

a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
mm_us = timeit(lambda: a @ b, 10); rate = 2 * 8192**3 / mm_us / 1e6
print(f"matmul rate {rate:.0f} TFLOP/s", flush=True)
del a, b

def tma_moe(hidden, w13, w2, ids, weights, cfg):
    T, k = ids.shape
    E = w13.shape[0]
    bm, bn, bk, nw, ns = cfg
    kept = torch.empty(T * k, dtype=torch.int8, device=dev)
    sp, be = moe_align_triton(ids, E, bm, None, None, kept)
    out = torch.empty((T * k, hidden.shape[1]), dtype=torch.float32, device=dev)
    nt = _active_tiles(T * k, E, bm, be.numel())
    moe_gemms_tma(hidden, w13, w2, sp, be, weights.reshape(-1), k, out, bm, bn, bk, nw, ns, nt)
    res = torch.empty_like(hidden)
    H = hidden.shape[1]
    _moe_sum_kernel[(T, triton.cdiv(H, 1024))](out, kept, res, H, TOP_K=k, BLOCK_H=1024, num_warps=4)
    return res

shapes = {"v2lite+shared": (64, 2, 6, 1408, 2048), "qwen3-30b-a3b": (128, 0, 8, 768, 2048)}
cfgs = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3)]
results = {"matmul_tflops": rate, "rows": []}
for name, (E, S, k, I, H) in shapes.items():
    torch.manual_seed(0)
    w13 = (torch.randn(E + S, 2 * I, H, device=dev) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E + S, H, I, device=dev) * 0.02).to(torch.bfloat16)
    for M in (1024, 2048, 4096, 8192):
        x = torch.randn(M, H, device=dev).to(torch.bfloat16)
        logits = torch.randn(M, E, device=dev)
        tw, ti = torch.topk(logits.softmax(-1), k, dim=-1)
        if S:
            ti = torch.cat([ti, torch.arange(E, E + S, device=dev).expand(M, S)], 1)
            tw = torch.cat([tw, torch.ones(M, S, device=dev)], 1)
        ti = ti.to(torch.int32).contiguous(); tw = tw.float().contiguous()
        flops = 2 * M * ti.shape[1] * (H * 2 * I + I * H)
        base = fused_moe_triton(x, w13, w2, ti, tw)
        t_base = timeit(lambda: fused_moe_triton(x, w13, w2, ti, tw))
        row = {"shape": name, "M": M, "base_us": t_base, "base_tflops": flops / t_base / 1e6, "tma": {}}
        print(f"{name} M={M} base {t_base:8.1f} us {flops/t_base/1e6:6.0f} TF ({flops/t_base/1e6/rate:.0%})", flush=True)
        for cfg in cfgs:
            try:
                out = tma_moe(x, w13, w2, ti, tw, cfg)
                err = float((out.float() - base.float()).abs().max())
                t = timeit(lambda: tma_moe(x, w13, w2, ti, tw, cfg))
                row["tma"][str(cfg)] = {"us": t, "tflops": flops / t / 1e6, "err": err}
                print(f"   tma {cfg} {t:8.1f} us {flops/t/1e6:6.0f} TF ({flops/t/1e6/rate:.0%}) err {err:.3g}", flush=True)
            except Exception as ex:
                print("   tma", cfg, "FAILED", type(ex).__name__, str(ex)[:300], flush=True)
                row["tma"][str(cfg)] = {"error": str(ex)[:300]}
        results["rows"].append(row)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "tma.json"), "w"), indent=1)
