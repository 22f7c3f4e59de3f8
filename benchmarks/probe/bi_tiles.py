"""Probe: are per-row results bitwise equal across tile shapes (BLOCK_M / BLOCK_N / BLOCK_Q) with BLOCK_K fixed?"""
import json, sys, torch, triton
from rayinfer.kernels.matmul import persistent_linear, _choose_config
from rayinfer.kernels.paged_attention import paged_attention_triton
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.batch_invariant import batch_invariant_mode
res = {"matmul": [], "attn": []}
dev = "cuda"
gen = torch.Generator().manual_seed(0)
def bench(f):
    return triton.testing.do_bench(f, warmup=10, rep=50)
for dtype in (torch.bfloat16,):
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dev, dtype)
        x = torch.randn(300, k, generator=gen).to(dev, dtype)
        base = persistent_linear(x, w)
        for bm, bn, nw in [(128, 128, 8), (128, 64, 4), (64, 128, 4), (64, 64, 4), (32, 64, 4), (16, 64, 4), (16, 128, 4), (32, 128, 4), (64, 256, 8), (128, 256, 8)]:
            cfg = dict(block_m=bm, block_n=bn, block_k=64, group_m=8, num_warps=nw, num_stages=3 if bm*bn < 128*256 else 2)
            try:
                y = persistent_linear(x, w, config=cfg)
                eq = torch.equal(y, base)
                ndiff = int((y != base).sum())
                t = {m: bench(lambda: persistent_linear(x[:m], w, config=cfg)) * 1e3 for m in (1, 16, 64, 256)}
            except Exception as e:
                eq, ndiff, t = None, None, str(e)[:200]
            r = dict(shape=[n, k], cfg=cfg, equal=eq, ndiff=ndiff, us=t)
            print(r, flush=True); res["matmul"].append(r)
        t = {m: bench(lambda: torch.nn.functional.linear(x[:m], w)) * 1e3 for m in (1, 16, 64, 256)}
        r = dict(shape=[n, k], cfg="cublas", us=t, default_cfg=_choose_config(n, k, dtype)); print(r, flush=True); res["matmul"].append(r)
# attention: Llama-3-8B heads
heads, kvh, d, bs = 32, 8, 128, 16
L = 1500
nb = -(-L // bs)
kv = torch.randn(nb + 400 * 70, 2, bs, kvh, d, generator=gen).to(dev, torch.bfloat16)
q = torch.randn(L, heads, d, generator=gen).to(dev, torch.bfloat16)
table = list(range(nb))
with batch_invariant_mode():
    whole = paged_attention_triton(q, kv, AttentionMetadata.build([L], [L], [table], bs, dev), d**-0.5)
    for cfg in [None, dict(block_q=4), dict(block_q=4, num_stages=2), dict(block_q=8), dict(block_q=2), dict(block_q=4, block_n=128)]:
        ok = True
        for pos in (0, 1, 16, 700, 1499):
            meta = AttentionMetadata.build([1, 1], [pos + 1, 5], [table, table], bs, dev)
            got = paged_attention_triton(torch.stack([q[pos], q[0]]), kv, meta, d**-0.5, config=cfg)[0]
            ok = ok and torch.equal(got, whole[pos])
        # timings: decode B=1 1K, B=256 1K
        times = {}
        for B, ctx in ((1, 1024), (64, 1024), (256, 1024)):
            tabs = [list(range(nb + i * 64, nb + i * 64 + 64)) for i in range(B)]
            meta = AttentionMetadata.build([1] * B, [ctx] * B, tabs, bs, dev)
            qq = torch.randn(B, heads, d, device=dev, dtype=torch.bfloat16)
            times[f"B{B}"] = bench(lambda: paged_attention_triton(qq, kv, meta, d**-0.5, config=cfg)) * 1e3
        r = dict(cfg=cfg, equal=ok, us=times); print(r, flush=True); res["attn"].append(r)
times = {}
for B, ctx in ((1, 1024), (64, 1024), (256, 1024)):
    tabs = [list(range(nb + i * 64, nb + i * 64 + 64)) for i in range(B)]
    meta = AttentionMetadata.build([1] * B, [ctx] * B, tabs, bs, dev)
    qq = torch.randn(B, heads, d, device=dev, dtype=torch.bfloat16)
    times[f"B{B}"] = bench(lambda: paged_attention_triton(qq, kv, meta, d**-0.5)) * 1e3
r = dict(cfg="default mode", us=times); print(r, flush=True); res["attn"].append(r)
json.dump(res, open(sys.argv[1], "w"), indent=1)
