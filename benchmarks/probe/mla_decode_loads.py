"""Probe: how fast can a Triton kernel with MLA decode's memory access read the latent cache, without its math?

The MLA decode kernel (kernels.mla_attention) reads V2-Lite's latent cache at 52-65% of the copy bandwidth at
batch 32-128 / 4K context. This probe times, on the same inputs (benchmarks/kernels.py ``mla_decode_inputs``),
kernels that load exactly the tiles the decode kernel loads (the block-table gather of [BLOCK_N, 512] + [BLOCK_N, 64]
rows per step, the same split-KV layout) and only sum them: with the paged gather and with contiguous rows, per
tile size and pipeline depth; beside them the decode kernel itself (with its split merge) and a copy of the same
bytes. If the loads alone reach ~80%, the math and its pipelining are what the decode kernel loses; if not, the
access pattern is.

    PYTHONPATH=. python benchmarks/probe/mla_decode_loads.py --out benchmarks/results/mla-decode-loads-h200.json
"""
import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import bench_graph, measure_ceilings, mla_decode_inputs  # noqa: E402

from rayinfer.kernels.mla_attention import choose_num_splits, mla_decode_triton  # noqa: E402


# the decode kernel's tile sets timed (block_h, block_n, num_warps, num_stages, min_split_tokens): its default
# for more than 4 tokens first
_KEYS = ("block_h", "block_n", "num_warps", "num_stages", "min_split_tokens")
DECODE_TILES = [dict(zip(_KEYS, t)) for t in [(16, 32, 4, 2, 64), (16, 32, 4, 3, 64), (16, 32, 4, 4, 64),
                                              (16, 64, 4, 2, 64), (16, 64, 4, 3, 64)]]
DECODE_TILES += [dict(d, prefetch_index=True) for d in DECODE_TILES]
# warps, stages and split sizes around the default (all with the block numbers an iteration ahead)
WIDE_TILES = [dict(zip(_KEYS, t), prefetch_index=True) for t in [
    (16, 32, 4, 3, 64), (16, 32, 8, 3, 64), (16, 32, 8, 4, 64), (16, 32, 4, 3, 128), (16, 64, 4, 2, 64),
    (16, 64, 8, 2, 64), (16, 64, 8, 3, 64), (16, 64, 4, 2, 128)]]
# up to 4 tokens (the kernel's first set: 16-key tiles, splits of at least 32 keys)
FEW_TILES = [dict(zip(_KEYS, t)) for t in [(16, 16, 4, 2, 32), (16, 16, 4, 3, 32), (16, 32, 4, 3, 32)]]
FEW_TILES += [dict(d, prefetch_index=True) for d in FEW_TILES]
# the load-only kernel's (block_n, num_stages, num_warps)
LOAD_TILES = [(32, 2, 4), (32, 3, 4), (32, 4, 4), (64, 2, 4), (64, 3, 4)]


@triton.jit
def _loads_kernel(cache_ptr, out_ptr, seq_lens_ptr, block_tables_ptr, num_splits, stride_cb, stride_cs, stride_bt,
                  RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
                  PAGED: tl.constexpr, NUM_STAGES: tl.constexpr):
    req = tl.program_id(0)
    split = tl.program_id(1)
    n_keys = tl.load(seq_lens_ptr + req)
    split_size = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = split * split_size
    kv_hi = tl.minimum(n_keys, kv_lo + split_size)
    r = tl.arange(0, RANK)
    p = tl.arange(0, ROPE)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    acc = tl.zeros([RANK], tl.float32)
    acc_p = tl.zeros([ROPE], tl.float32)
    n0 = kv_lo + tl.arange(0, BLOCK_N)
    blk_next = tl.load(table + n0 // KV_BLOCK_SIZE, mask=n0 < kv_hi, other=0)
    for start in tl.range(kv_lo, kv_hi, BLOCK_N, num_stages=NUM_STAGES):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_hi
        if PAGED == 1:
            blk = tl.load(table + n // KV_BLOCK_SIZE, mask=n_ok, other=0)
            rows = blk.to(tl.int64) * stride_cb + (n % KV_BLOCK_SIZE) * stride_cs
        elif PAGED == 2:  # the block numbers loaded a tile ahead (loop-carried)
            blk = blk_next
            blk_next = tl.load(table + (n + BLOCK_N) // KV_BLOCK_SIZE, mask=n + BLOCK_N < kv_hi, other=0)
            rows = blk.to(tl.int64) * stride_cb + (n % KV_BLOCK_SIZE) * stride_cs
        else:  # the request's keys as one contiguous run (its first block's place, no table)
            rows = (req.to(tl.int64) * n_keys + n) * stride_cs
        kl = tl.load(cache_ptr + rows[:, None] + r[None, :], mask=n_ok[:, None], other=0.0)
        kp = tl.load(cache_ptr + rows[:, None] + RANK + p[None, :], mask=n_ok[:, None], other=0.0)
        acc += tl.sum(kl.to(tl.float32), 0)
        acc_p += tl.sum(kp.to(tl.float32), 0)
    base = (req * num_splits + split).to(tl.int64) * (RANK + ROPE)
    tl.store(out_ptr + base + r, acc)
    tl.store(out_ptr + base + RANK + p, acc_p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--git-rev", default=None)
    ap.add_argument("--block-sizes", default="16", help="KV cache block sizes, comma-separated")
    ap.add_argument("--cases", default="8x4096,32x1024,32x4096,64x4096,128x4096", help="BATCHxCONTEXT, comma-separated")
    ap.add_argument("--loads-batches", default="32,64,128", help="batches whose load-only kernels are timed")
    ap.add_argument("--wide-sweep", action="store_true",
                    help="for more than 4 tokens, the tile sets of WIDE_TILES instead of DECODE_TILES")
    args = ap.parse_args()
    args.block_sizes = [int(x) for x in args.block_sizes.split(",")]
    args.loads_batches = [int(x) for x in args.loads_batches.split(",") if x]
    ceil = measure_ceilings()
    rows = []
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    for (batch, ctx), bs in itertools.product(cases, args.block_sizes):
        cache, meta, ql, qp, want, nbytes, layers = mla_decode_inputs(batch, ctx, bs)
        splits = choose_num_splits(batch, 8192, torch.cuda.get_device_properties(0).multi_processor_count)
        if batch <= 4:  # the first set's splits of 32 keys
            splits = max(1, min(264 // batch, 8192 // 32, 32))

        def pct(us):
            return None if us is None else round(100 * nbytes / (us * 1e-6) / (ceil["copy_GBps"] * 1e9), 1)

        for cfg in FEW_TILES if batch <= 4 else WIDE_TILES if args.wide_sweep else DECODE_TILES:
            run = lambda i=0, c=cfg: mla_decode_triton(ql, qp, cache[i], meta, 0.1, max_seq_len=8192, config=c)  # noqa: E731
            err = (run().float() - want).abs().max().item()
            us = bench_graph([lambda i=i, f=run: f(i) for i in range(layers)])
            rows.append({"batch": batch, "ctx": ctx, "kv_block_size": bs, "what": "mla_decode_triton (with merge)",
                         "config": cfg, "splits": splits, "max_abs_err": err, "us": us, "pct_of_copy": pct(us)})
            print(rows[-1], flush=True)
        if bs == args.block_sizes[0]:
            flat = cache.view(layers, -1, cache.shape[-1])
            us = bench_graph([lambda i=i: flat[i, : batch * ctx].clone() for i in range(layers)])
            rows.append({"batch": batch, "ctx": ctx, "what": "torch clone of the same bytes", "us": us,
                         "pct_of_copy": pct(us), "note": "reads and writes: a copy moves twice the bytes"})
        for paged in ((1, 2, 0) if bs == args.block_sizes[0] else (1, 2)) if batch in args.loads_batches else ():
            for block_n, stages, warps in LOAD_TILES:
                out = torch.empty(batch * splits * 576, device="cuda", dtype=torch.float32)

                def run(i=0, out=out, block_n=block_n, stages=stages, warps=warps, paged=paged):
                    _loads_kernel[(batch, splits)](
                        cache[i], out, meta.seq_lens, meta.block_tables, splits, cache.stride(1),
                        cache.stride(2), meta.block_tables.stride(0), RANK=512, ROPE=64,
                        BLOCK_N=block_n, KV_BLOCK_SIZE=cache.shape[2], PAGED=paged, NUM_STAGES=stages,
                        num_warps=warps)
                try:
                    us = bench_graph([lambda i=i, f=run: f(i) for i in range(layers)])
                except Exception as exc:  # a tile set that does not fit
                    us = None
                    print(f"  failed: {exc!r}"[:200], file=sys.stderr)
                rows.append({"batch": batch, "ctx": ctx, "kv_block_size": bs, "what": "loads only", "paged": paged,
                             "block_n": block_n, "num_stages": stages, "num_warps": warps, "splits": splits,
                             "us": us, "pct_of_copy": pct(us)})
                print(rows[-1], flush=True)
        del cache
        torch.cuda.empty_cache()
    rev = args.git_rev or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True).stdout.strip()
    out = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "git_rev": rev,
           "torch": torch.__version__, "triton": triton.__version__, "ceilings": ceil, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for r in rows:
        if r["what"] != "loads only":
            print({k: v for k, v in r.items() if k not in ("ctx", "note")})
    best = {}
    for r in rows:
        if r["what"] == "loads only" and r["us"] is not None:
            key = (r["batch"], r["kv_block_size"], r["paged"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    for r in best.values():
        print("best loads-only:", r)


if __name__ == "__main__":
    main()
