"""Time each Triton kernel against its torch reference at Llama-3-8B shapes, against the roofline.

Usage (on a CUDA machine)::

    python benchmarks/kernels.py [--out benchmarks/results/kernels-h200.json] [--git-rev REV] [--quick]

``--only-sweeps gemv decode_tiles`` skips the table and sweeps tile configurations instead (the
one-row GEMV against cuBLAS; decode attention per batch shape and KV dtype), writing JSON after each;
``--only-sweeps mla`` times DeepSeek-V2-Lite's MLA kernels (split-KV decode, varlen prefill, fused
norm + RoPE + store).

The ceilings are measured in the same run: HBM bandwidth as a large device-to-device copy (bytes read
plus written) and bf16 matrix throughput as an 8192^3 matmul on random data. For each case it reports
the reference's and the kernel's median time (eager, L2 flushed between calls, launch included), the
kernel's time per call inside a CUDA graph that walks several layers' worth of distinct buffers (no
launch gaps, little L2 reuse), the fewest bytes the op must move (each input read once, each output
written once) and the achieved share of the copy bandwidth; for prefill attention also FLOP/s against
the matmul rate. Shapes: hidden 4096, 32 query / 8 KV heads of 128, intermediate 14336, vocab 128256,
KV block 16, bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch

from rayinfer.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.block_copy import copy_blocks_ref, copy_blocks_triton
from rayinfer.kernels.gemv import fused_linear_triton, linear_triton, silu_and_mul_linear_triton
from rayinfer.kernels.kv_write import store_kv_ref, store_kv_triton
from rayinfer.kernels.norm import rms_norm_ref, rms_norm_triton
from rayinfer.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from rayinfer.kernels.rotary import rope_inv_freq, rotary_ref, rotary_triton
from rayinfer.kernels.sampling import sample_ref, sample_triton

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, BLOCK = 4096, 32, 8, 128, 14336, 128256, 16
DT = torch.bfloat16
ROTATE_BYTES = 256 << 20  # distinct buffers per graph so the 50 MB L2 holds little of them
MAX_LAYERS = 32


def bench_eager(fn, rep_ms: int = 60) -> float:
    """Median milliseconds per call (triton's do_bench flushes L2 before each call)."""
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")


def bench_graph(fns, replays: int = 20) -> float | None:
    """Microseconds per call of ``fns`` (one per layer) captured once in a CUDA graph and replayed
    (``jobs.benchlib.graph_time_us``, median of 3); None when capture fails."""
    from rayinfer.jobs.benchlib import graph_time_us

    try:
        return graph_time_us(fns, replays=replays, samples=3)
    except Exception as exc:  # capture can fail for an op; eager numbers still stand
        print(f"  graph capture failed: {exc!r}", file=sys.stderr)
        return None


def measure_ceilings() -> dict:
    n = 1 << 30  # 2 GiB of bf16 each way
    src = torch.randn(n // 2, device="cuda", dtype=torch.float32).view(DT)[:n]
    dst = torch.empty_like(src)
    ms = bench_eager(lambda: dst.copy_(src), rep_ms=200)
    copy_gbps = 2 * src.numel() * src.element_size() / ms / 1e6
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=DT)
    b = torch.randn(8192, 8192, device="cuda", dtype=DT)
    ms = bench_eager(lambda: a @ b, rep_ms=200)
    tflops = 2 * 8192**3 / ms / 1e9
    del a, b
    torch.cuda.empty_cache()
    return {"copy_GBps": copy_gbps, "matmul_bf16_TFLOPs": tflops}


def write_probe(path: str, git_rev: str | None, ceil: dict, rows: list[dict]) -> None:
    """A probe's result file: ``benchlib.run_metadata`` (command, device, versions, revision: ``git_rev``, else
    git's HEAD), then its ceilings and rows."""
    from rayinfer.jobs.benchlib import run_metadata

    with open(path, "w") as f:
        json.dump({**run_metadata(torch.device("cuda"), git_rev), "ceilings": ceil, "rows": rows}, f, indent=1)


def layers_for(bytes_per_layer: int) -> int:
    return max(1, min(MAX_LAYERS, math.ceil(ROTATE_BYTES / max(bytes_per_layer, 1))))


def record(results, ceil, name, shape, ref_ms, kernel_ms, graph_us, bytes_moved, flops=None, err=None):
    t_us = graph_us if graph_us is not None else kernel_ms * 1e3
    row = {
        "name": name,
        "shape": shape,
        "ref_ms": ref_ms,
        "kernel_ms": kernel_ms,
        "kernel_graph_us": graph_us,
        "speedup_vs_ref": ref_ms / kernel_ms if ref_ms else None,
        "bytes": bytes_moved,
        "GBps": bytes_moved / t_us / 1e3,
        "pct_of_copy_bw": 100 * bytes_moved / t_us / 1e3 / ceil["copy_GBps"],
        "roofline_us": max(bytes_moved / ceil["copy_GBps"] / 1e3, (flops or 0) / ceil["matmul_bf16_TFLOPs"] / 1e6),
        "max_abs_err_vs_ref": err,
    }
    if flops:
        row["flops"] = flops
        row["TFLOPs"] = flops / t_us / 1e6
        row["pct_of_matmul_peak"] = 100 * row["TFLOPs"] / ceil["matmul_bf16_TFLOPs"]
    results.append(row)
    print(
        f"{name:<34} ref {ref_ms:9.3f} ms | kernel {kernel_ms * 1e3:9.1f} us eager, "
        f"{t_us:9.1f} us graph | x{row['speedup_vs_ref'] or 0:7.1f} | {row['GBps']:7.0f} GB/s "
        f"{row['pct_of_copy_bw']:5.1f}% bw" + (f" | {row['TFLOPs']:6.1f} TFLOP/s" if flops else "")
        + (f" | err {err:.1e}" if err is not None else ""),
        flush=True,
    )


def _attention_setup(batch, query_len, ctx_len, heads=HEADS, kv_heads=KV_HEADS):
    blocks_per_req = math.ceil(ctx_len / BLOCK)
    num_blocks = batch * blocks_per_req
    layers = layers_for(num_blocks * 2 * BLOCK * kv_heads * HEAD_DIM * 2)
    cache = torch.randn((layers, num_blocks, 2, BLOCK, kv_heads, HEAD_DIM), device="cuda", dtype=DT)
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[i * blocks_per_req : (i + 1) * blocks_per_req] for i in range(batch)]
    meta = AttentionMetadata.build([query_len] * batch, [ctx_len] * batch, tables, BLOCK, "cuda")
    q = torch.randn((batch * query_len, heads, HEAD_DIM), device="cuda", dtype=DT)
    return cache, meta, q


def attention_case(results, ceil, batch, query_len, ctx_len, num_splits=None, label=None):
    """``batch`` requests each computing ``query_len`` new tokens at context ``ctx_len``."""
    cache, meta, q = _attention_setup(batch, query_len, ctx_len)
    layers = cache.shape[0]
    scale = HEAD_DIM**-0.5
    kern = lambda i=0: paged_attention_triton(q, cache[i], meta, scale, num_splits=num_splits)  # noqa: E731
    ref = lambda: paged_attention_ref(q, cache[0], meta, scale)  # noqa: E731
    err = (kern().float() - ref().float()).abs().max().item()
    ref_ms = bench_eager(ref)
    kernel_ms = bench_eager(kern)
    graph_us = bench_graph([lambda i=i: kern(i) for i in range(layers)])
    kv_bytes = batch * ctx_len * KV_HEADS * HEAD_DIM * 2 * 2
    qo_bytes = 2 * q.numel() * 2
    visible = batch * sum(ctx_len - query_len + j + 1 for j in range(query_len))
    flops = 4 * visible * HEADS * HEAD_DIM if query_len > 1 else None
    name = label or (f"attn decode B={batch} ctx={ctx_len}" if query_len == 1 else f"attn prefill {query_len}")
    shape = {"batch": batch, "query_len": query_len, "ctx_len": ctx_len, "num_splits": num_splits}
    record(results, ceil, name, shape, ref_ms, kernel_ms, graph_us, kv_bytes + qo_bytes, flops, err)
    del cache


def _time_config(q, cache, meta, want, **kwargs):
    """(max abs error against ``want``, graph us per layer) of the attention kernel over every layer of
    ``cache`` with ``kwargs`` (``config=...`` or ``num_splits=...``)."""
    run = lambda i=0: paged_attention_triton(q, cache[i], meta, HEAD_DIM**-0.5, **kwargs)  # noqa: E731
    err = (run().float() - want).abs().max().item() if want is not None else None
    return err, bench_graph([lambda i=i: run(i) for i in range(cache.shape[0])])


def sweep_prefill(ceil, query_len=4096) -> list[dict]:
    """Graph time of prefill attention for several tile configurations."""
    cache, meta, q = _attention_setup(1, query_len, query_len)
    want = paged_attention_ref(q, cache[0], meta, HEAD_DIM**-0.5).float()
    flops = 4 * (query_len * (query_len + 1) // 2) * HEADS * HEAD_DIM
    rows = []
    for bm, bn, warps, stages in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)]:
        for reverse in (True, False):
            cfg = dict(block_q=bm // 4, block_n=bn, num_warps=warps, num_stages=stages, reverse=reverse)
            try:
                err, us = _time_config(q, cache, meta, want, config=cfg)
            except Exception as exc:
                print(f"  prefill config {cfg} failed: {exc!r}", file=sys.stderr)
                continue
            rows.append({"config": {"block_m": bm, **cfg}, "graph_us": us, "TFLOPs": flops / us / 1e6, "err": err})
            print(f"  prefill {bm}x{bn} w{warps} s{stages} rev={reverse}: {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s err {err:.1e}", flush=True)
    del cache
    return rows


def sweep_prefill_gqa8(ceil, query_lens=(2048, 4096)) -> list[dict]:
    """Prefill attention tiles at Qwen3-30B-A3B's heads (32 query heads over 4 KV heads, d = 128; a tile's
    rows are query tokens x the 8 heads of a group), one causal prompt: graph time, TFLOP/s, error against
    the torch reference. ``block_m`` counts rows (block_q = block_m / 8 tokens); None is the default tiles."""
    rows = []
    configs = [None, (64, 64, 4, 2), (64, 64, 4, 4), (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 8, 3),
               (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 32, 4, 3), (256, 64, 8, 2)]
    for query_len in query_lens:
        cache, meta, q = _attention_setup(1, query_len, query_len, heads=32, kv_heads=4)
        want = paged_attention_ref(q, cache[0], meta, HEAD_DIM**-0.5).float()
        flops = 4 * (query_len * (query_len + 1) // 2) * 32 * HEAD_DIM
        for conf in configs:
            kwargs = {}
            if conf is not None:
                bm, bn, warps, stages = conf
                kwargs = {"config": dict(block_q=bm // 8, block_n=bn, num_warps=warps, num_stages=stages)}
            try:
                err, us = _time_config(q, cache, meta, want, **kwargs)
            except Exception as exc:
                print(f"  prefill gqa8 {query_len} {conf} failed: {exc!r}"[:300], file=sys.stderr, flush=True)
                continue
            if not us:
                continue
            rows.append({"query_len": query_len, "config": "default" if conf is None else
                         dict(block_m=conf[0], **kwargs["config"]), "graph_us": us, "TFLOPs": flops / us / 1e6,
                         "pct_of_matmul": 100 * flops / us / 1e6 / ceil["matmul_bf16_TFLOPs"], "err": err})
            print(f"  prefill gqa8 {query_len} {conf or 'default'}: {us:9.1f} us {flops / us / 1e6:6.1f} TFLOP/s "
                  f"err {err:.1e}", flush=True)
        del cache, q
        torch.cuda.empty_cache()
    return rows


def sweep_prefill_long(ceil, query_lens=(16384, 32768)) -> list[dict]:
    """Prefill attention tiles for one long prompt (Llama-3-8B heads, causal, no prefix): graph time and
    TFLOP/s per configuration. No torch reference at these lengths (its score matrix would not fit):
    each configuration's error is against the default configuration's output."""
    rows = []
    configs = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 2), (64, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2),
               (128, 128, 8, 2), (128, 32, 4, 3), (128, 64, 4, 3), (256, 64, 8, 2)]
    for query_len in query_lens:
        cache, meta, q = _attention_setup(1, query_len, query_len)
        cache = cache[:2]  # two layers: one long call is many milliseconds already
        want = paged_attention_triton(q, cache[0], meta, HEAD_DIM**-0.5).float()
        flops = 4 * (query_len * (query_len + 1) // 2) * HEADS * HEAD_DIM
        for bm, bn, warps, stages in configs:
            for reverse in (True, False):
                cfg = dict(block_q=bm // 4, block_n=bn, num_warps=warps, num_stages=stages, reverse=reverse)
                try:
                    err, us = _time_config(q, cache, meta, want, config=cfg)
                except Exception as exc:
                    print(f"  prefill {query_len} config {cfg} failed: {exc!r}"[:300], file=sys.stderr, flush=True)
                    continue
                if not us:
                    continue
                rows.append({"query_len": query_len, "config": {"block_m": bm, **cfg}, "graph_us": us,
                             "TFLOPs": flops / us / 1e6, "pct_of_matmul": 100 * flops / us / 1e6 / ceil["matmul_bf16_TFLOPs"],
                             "err_vs_default": err})
                print(f"  prefill {query_len} {bm}x{bn} w{warps} s{stages} rev={reverse}: {us:9.1f} us "
                      f"{flops / us / 1e6:6.1f} TFLOP/s err {err:.1e}", flush=True)
        del cache, q
        torch.cuda.empty_cache()
    return rows


def sweep_decode_splits(ceil) -> list[dict]:
    """Graph time of decode attention against the split-KV factor (None: the default heuristic)."""
    rows = []
    for batch in (4, 8, 16, 32):
        for ctx in (1024, 4096):
            cache, meta, q = _attention_setup(batch, 1, ctx)
            nbytes = batch * ctx * KV_HEADS * HEAD_DIM * 4
            for splits in (None, 1, 2, 4, 8):
                _, us = _time_config(q, cache, meta, None, num_splits=splits)
                pct = 100 * nbytes / us / 1e3 / ceil["copy_GBps"]
                rows.append({"batch": batch, "ctx_len": ctx, "num_splits": splits, "graph_us": us, "pct_of_copy_bw": pct})
                print(f"  decode B={batch} ctx={ctx} splits={splits}: {us:7.1f} us {pct:5.1f}% bw", flush=True)
            del cache
    return rows


def sweep_mla(ceil) -> list[dict]:
    """DeepSeek-V2-Lite's MLA (16 heads, latent 512, rope 64, nope 128, v 128, block 64): graph time per
    layer of the absorbed decode kernel per split-KV factor (None: the default), of the expanded prefill
    (the varlen Triton path against the per-request reference, eager) and of the fused norm + RoPE + store."""
    from rayinfer.kernels.mla_attention import mla_decode_ref, mla_decode_triton, mla_prefill_ref, mla_prefill_triton
    from rayinfer.kernels.mla_rope import mla_rope_store_ref, mla_rope_store_triton

    heads, rank, rope, nope, v_dim, bs = 16, 512, 64, 128, 128, 64
    rows = []
    for batch, query_len in ((1, 1), (8, 1), (32, 1), (64, 1), (32, 4)):
        for ctx in (1024, 4096):
            nb = batch * math.ceil(ctx / bs)
            layers = layers_for(nb * bs * (rank + rope) * 2)
            cache = torch.randn((layers, nb, bs, rank + rope), device="cuda", dtype=DT)
            perm = torch.randperm(nb).tolist()
            per = nb // batch
            meta = AttentionMetadata.build([query_len] * batch, [ctx] * batch,
                                           [perm[i * per:(i + 1) * per] for i in range(batch)], bs, "cuda")
            ql = torch.randn((batch * query_len, heads, rank), device="cuda", dtype=DT)
            qp = torch.randn((batch * query_len, heads, rope), device="cuda", dtype=DT)
            want = mla_decode_ref(ql, qp, cache[0], meta, 0.1).float()
            nbytes = batch * ctx * (rank + rope) * 2
            for backend, splits in [("triton", s) for s in (None, 1, 4, 16)] + [("tilelang", s) for s in (None, 1)]:
                if backend == "tilelang":
                    from rayinfer.kernels.mla_tilelang import mla_decode_tilelang, tilelang_available

                    if not tilelang_available():
                        continue
                    fn = mla_decode_tilelang
                else:
                    fn = mla_decode_triton
                # a graph's metadata bounds contexts by max_model_len (8192 here), which sets the split count
                run = lambda i=0, s=splits, f=fn: f(ql, qp, cache[i], meta, 0.1, num_splits=s, max_seq_len=8192)  # noqa: E731
                err = (run().float() - want).abs().max().item()
                us = bench_graph([lambda i=i: run(i) for i in range(layers)])
                pct = 100 * nbytes / us / 1e3 / ceil["copy_GBps"] if us else None
                rows.append({"op": "mla_decode", "backend": backend, "batch": batch, "query_len": query_len,
                             "ctx_len": ctx, "num_splits": splits, "max_seq_len": 8192, "graph_us": us,
                             "pct_of_copy_bw": pct, "max_abs_err": err})
                print(f"  mla decode {backend} B={batch} q={query_len} ctx={ctx} splits={splits}: "
                      f"{us or float('nan'):7.1f} us {pct or float('nan'):5.1f}% bw err {err:.1e}", flush=True)
            del cache
    for num_prompts, prompt_len, prefix in ((64, 512, 0), (8, 2048, 0), (8, 512, 1536)):
        seq = prompt_len + prefix
        nb = num_prompts * math.ceil(seq / bs)
        cache = torch.randn((nb, bs, rank + rope), device="cuda", dtype=DT)
        per = nb // num_prompts
        perm = torch.randperm(nb).tolist()
        meta = AttentionMetadata.build([prompt_len] * num_prompts, [seq] * num_prompts,
                                       [perm[i * per:(i + 1) * per] for i in range(num_prompts)], bs, "cuda")
        t = num_prompts * prompt_len
        q_nope = torch.randn((t, heads, nope), device="cuda", dtype=DT)
        q_pe = torch.randn((t, heads, rope), device="cuda", dtype=DT)
        w = torch.randn((heads * (nope + v_dim), rank), device="cuda", dtype=DT) / rank**0.5
        scale = (nope + rope) ** -0.5
        ref = lambda: mla_prefill_ref(q_nope, q_pe, cache, meta, w, scale)  # noqa: E731
        kern = lambda: mla_prefill_triton(q_nope, q_pe, cache, meta, w, scale)  # noqa: E731
        err = (kern().float() - ref().float()).abs().max().item()
        ref_ms, kernel_ms = bench_eager(ref), bench_eager(kern)
        visible = num_prompts * sum(prefix + j + 1 for j in range(prompt_len))
        tflops = 2 * visible * heads * (nope + rope + v_dim) / kernel_ms / 1e9
        rows.append({"op": "mla_prefill", "num_prompts": num_prompts, "prompt_len": prompt_len, "prefix": prefix,
                     "ref_ms": ref_ms, "kernel_ms": kernel_ms, "attention_TFLOPs": tflops, "max_abs_err": err})
        print(f"  mla prefill {num_prompts} x {prompt_len} (prefix {prefix}): ref {ref_ms:8.3f} ms, "
              f"kernel {kernel_ms:8.3f} ms ({tflops:5.1f} attention TFLOP/s incl. gather + kv_b_proj) err {err:.1e}",
              flush=True)
        del cache
    for t in (1, 64, 4096):
        q = torch.randn((t, heads, nope + rope), device="cuda", dtype=DT)
        kv_a = torch.randn((t, rank + rope), device="cuda", dtype=DT)
        wn = torch.ones(rank, device="cuda", dtype=DT)
        ang = torch.rand((t, rope // 2), device="cuda") * 6
        cos, sin = ang.cos().to(DT), ang.sin().to(DT)
        cache = torch.zeros((t // bs + 2, bs, rank + rope), device="cuda", dtype=DT)
        slots = torch.arange(t, device="cuda")
        # the torch ops (their store's boolean mask syncs, so no graph): eager, launches included
        ref_ms = bench_eager(lambda: mla_rope_store_ref(q, kv_a, wn, 1e-6, cos, sin, cache, slots, True))
        kernel_ms = bench_eager(lambda: mla_rope_store_triton(q, kv_a, wn, 1e-6, cos, sin, cache, slots, True))
        us = bench_graph([lambda: mla_rope_store_triton(q, kv_a, wn, 1e-6, cos, sin, cache, slots, True)])
        rows.append({"op": "mla_rope_store", "num_tokens": t, "ref_ms": ref_ms, "kernel_ms": kernel_ms, "graph_us": us})
        print(f"  mla rope+norm+store T={t}: torch ops {ref_ms * 1e3:7.1f} us eager, kernel {kernel_ms * 1e3:7.1f} us "
              f"eager, {us or float('nan'):7.1f} us graph", flush=True)
    return rows


_TRITON_KEYS = ("block_h", "block_n", "num_warps", "num_stages", "min_split_tokens")
# (block_h, block_n, num_warps, num_stages, min_split_tokens): the kernel's two default sets first (up to 4
# tokens; more). The c087fa1 round also timed a register double-buffered key loop (the next tile's loads
# issued before this tile's products): 20-45% slower than the compiler's pipelined loads at batch >= 32, so
# it was dropped (results/kernels-mla-tiles-h200-c087fa1.json)
MLA_TRITON_TILES = [
    (16, 16, 4, 2, 32), (16, 32, 4, 4, 64), (16, 16, 4, 2, 128), (16, 32, 4, 3, 128), (16, 32, 8, 3, 128),
    (16, 64, 8, 3, 128), (16, 64, 8, 2, 256),
]
MLA_TILELANG_TILES = [  # (block_n, threads, num_stages, min_split_tokens, gather)
    (64, 256, 2, 128, "blocks"), (64, 128, 2, 128, "blocks"), (32, 128, 2, 64, "blocks"), (64, 256, 3, 256, "blocks"),
    (64, 256, 2, 128, "rows"),
]


def mla_decode_inputs(batch: int, ctx: int, bs: int = 16) -> tuple:
    """DeepSeek-V2-Lite's absorbed MLA decode inputs (16 heads, R 512, P 64, cache blocks of ``bs``): a stack of
    per-layer latent caches (enough layers to leave L2), the batch's metadata over randomly placed blocks, one
    query token per request, the reference output on layer 0, and the latent bytes a layer reads.
    Returns (cache [layers, blocks, bs, 576], meta, q_latent, q_pe, want float32, nbytes, layers)."""
    from rayinfer.kernels.mla_attention import mla_decode_ref

    heads, rank, rope = 16, 512, 64
    nb = batch * math.ceil(ctx / bs)
    layers = layers_for(nb * bs * (rank + rope) * 2)
    cache = torch.randn((layers, nb, bs, rank + rope), device="cuda", dtype=DT)
    perm = torch.randperm(nb).tolist()
    per = nb // batch
    meta = AttentionMetadata.build([1] * batch, [ctx] * batch, [perm[i * per:(i + 1) * per] for i in range(batch)],
                                   bs, "cuda")
    ql = torch.randn((batch, heads, rank), device="cuda", dtype=DT)
    qp = torch.randn((batch, heads, rope), device="cuda", dtype=DT)
    want = mla_decode_ref(ql, qp, cache[0], meta, 0.1).float()
    return cache, meta, ql, qp, want, batch * ctx * (rank + rope) * 2, layers


def sweep_mla_tiles(ceil) -> list[dict]:
    """DeepSeek-V2-Lite's absorbed MLA decode (16 heads, R 512, P 64, cache blocks of 16 as the engine's
    default) per tile set of each backend, at the split count a graph bounded by max_model_len 8192 gets:
    graph time per layer and the share of the measured copy bandwidth the latent cache reads reach."""
    from rayinfer.kernels.mla_attention import _mla_decode_kernel, mla_decode_triton
    from rayinfer.kernels.mla_tilelang import mla_decode_tilelang, tilelang_available

    rows = []
    for batch, ctx in ((1, 1024), (1, 4096), (32, 1024), (32, 4096), (64, 4096), (128, 4096)):
        cache, meta, ql, qp, want, nbytes, layers = mla_decode_inputs(batch, ctx)
        cases = [("triton", dict(zip(_TRITON_KEYS, t))) for t in MLA_TRITON_TILES]
        if tilelang_available():
            cases += [("tilelang", dict(zip(("block_n", "threads", "num_stages", "min_split_tokens", "gather"), t)))
                      for t in MLA_TILELANG_TILES]
        for backend, cfg in cases:
            fn = mla_decode_triton if backend == "triton" else mla_decode_tilelang
            run = lambda i=0, f=fn, c=cfg: f(ql, qp, cache[i], meta, 0.1, max_seq_len=8192, config=c)  # noqa: E731
            try:
                err = (run().float() - want).abs().max().item()
                us = bench_graph([lambda i=i: run(i) for i in range(layers)])
            except Exception as exc:  # a tile set that does not compile or fit is a row with its error
                rows.append({"op": "mla_decode_tiles", "backend": backend, "config": cfg, "batch": batch,
                             "ctx_len": ctx, "error": repr(exc)[:300]})
                print(f"  {backend} {cfg} B={batch} ctx={ctx}: failed {exc!r}"[:300], flush=True)
                continue
            pct = 100 * nbytes / us / 1e3 / ceil["copy_GBps"] if us else None
            rows.append({"op": "mla_decode_tiles", "backend": backend, "config": cfg, "batch": batch, "ctx_len": ctx,
                         "graph_us": us, "pct_of_copy_bw": pct, "max_abs_err": err})
            print(f"  {backend} {cfg} B={batch} ctx={ctx}: {us or float('nan'):7.1f} us "
                  f"{pct or float('nan'):5.1f}% bw err {err:.1e}", flush=True)
        del cache
    rows += _compiled_kernel_stats(_mla_decode_kernel, "mla_decode_kernel")
    return rows


# (block_h, block_n, threads, num_stages, policy, swizzle) of the TileLang kernel: FlashMLA's layout (16 heads
# padded to the 64 rows of Hopper's warpgroup MMA, two warpgroups splitting the columns) first, then the
# module's default (16 rows, FullRow)
MLA_TILELANG_HOPPER = [(64, 64, 256, 2, "col", True), (64, 32, 256, 3, "col", True), (16, 64, 256, 2, "row", False)]


def _mla_decode_case(ceil, inputs, row: dict, cfg: dict | None, splits: int | None) -> dict:
    """One MLA decode case of the sweeps: ``row["backend"]``'s kernel (``mla_decode_triton`` or
    ``mla_decode_tilelang``) with tiles ``cfg`` and ``splits`` on ``inputs`` (:func:`mla_decode_inputs`), checked
    against the reference, then its graph time per layer and share of the copy bandwidth; ``row`` plus those
    fields, or plus ``error`` for a tile set that does not compile or fit. Prints a line."""
    from rayinfer.kernels.mla_attention import mla_decode_triton
    from rayinfer.kernels.mla_tilelang import mla_decode_tilelang

    fn = mla_decode_triton if row["backend"] == "triton" else mla_decode_tilelang
    cache, meta, ql, qp, want, nbytes, layers = inputs
    run = lambda i=0: fn(ql, qp, cache[i], meta, 0.1, num_splits=splits, max_seq_len=8192, config=cfg)  # noqa: E731
    label = f"  {row['backend']} {cfg} bs={cache.shape[2]} splits={splits} B={row['batch']} ctx={row['ctx_len']}"
    t0 = time.time()
    try:
        err = (run().float() - want).abs().max().item()
        us = bench_graph([lambda i=i: run(i) for i in range(layers)])
    except Exception as exc:
        print(f"{label}: failed {exc!r}"[:300], flush=True)
        return {**row, "config": cfg, "num_splits": splits, "error": repr(exc)[:300]}
    pct = 100 * nbytes / us / 1e3 / ceil["copy_GBps"] if us else None
    print(f"{label}: {us or float('nan'):7.1f} us {pct or float('nan'):5.1f}% bw err {err:.1e} "
          f"({time.time() - t0:.0f} s)", flush=True)
    return {**row, "config": cfg, "num_splits": splits, "graph_us": us, "pct_of_copy_bw": pct, "max_abs_err": err,
            "first_call_s": time.time() - t0}


def _mla_decode_cases(ceil, inputs, cases, row: dict, deadline: float) -> list[dict]:
    """:func:`_mla_decode_case` for each (backend, tiles, splits) of ``cases`` with ``row``'s fields; TileLang cases
    are skipped (with a line) once ``time.time()`` passes ``deadline`` (their compiles are the slow part)."""
    out = []
    for backend, cfg, splits in cases:
        if backend == "tilelang" and time.time() > deadline:
            print(f"  budget spent: tilelang {cfg} splits={splits} B={row['batch']} ctx={row['ctx_len']} not run",
                  flush=True)
            continue
        out.append(_mla_decode_case(ceil, inputs, {**row, "backend": backend}, cfg, splits))
    return out


def sweep_mla_tilelang(ceil, budget_s: float = 330.0) -> list[dict]:
    """DeepSeek-V2-Lite's absorbed MLA decode (16 heads, R 512, P 64, cache blocks of 16) at batch 32 / 64 /
    128 and 4K context: the TileLang kernel per tile set of :data:`MLA_TILELANG_HOPPER` and split count (one
    program per multiprocessor for the 64-row tiles: splits of about SMs / batch, and twice that) beside the
    Triton kernel's default, graph time per layer and the share of the copy bandwidth. Stops starting new
    TileLang compiles after ``budget_s`` seconds."""
    from rayinfer.kernels._triton_utils import device_sms
    from rayinfer.kernels.mla_tilelang import tilelang_available

    rows, start = [], time.time()
    keys = ("block_h", "block_n", "threads", "num_stages", "policy", "swizzle")
    for batch, ctx in ((32, 4096), (64, 4096), (128, 4096)):
        inputs = mla_decode_inputs(batch, ctx)
        one_wave = max(1, device_sms(inputs[2]) // batch)
        cases = [("triton", None, None)]
        if tilelang_available():
            for t in MLA_TILELANG_HOPPER:
                splits = (one_wave, 2 * one_wave) if t[0] == 64 else (None,)
                cases += [("tilelang", dict(zip(keys, t)), s) for s in splits]
        for backend, cfg, splits in cases:
            if backend == "tilelang" and time.time() - start > budget_s:
                print(f"  budget spent: {cfg} splits={splits} B={batch} not run", flush=True)
                continue
            rows.append(_mla_decode_case(ceil, inputs, {"op": "mla_decode_tilelang", "backend": backend,
                                                        "batch": batch, "ctx_len": ctx}, cfg, splits))
        del inputs
    return rows


def sweep_mla_rows(ceil, budget_s: float = 300.0) -> list[dict]:
    """DeepSeek-V2-Lite's absorbed MLA decode (16 heads, R 512, P 64) with TileLang's keys-as-rows tiles (64-key
    TMA-fed tiles of one cache block each, cache blocks of 64) beside the Triton kernel's default on cache blocks
    of 16 (the engine's default) and of 64, graph time per layer and the share of the copy bandwidth; the
    TileLang rows at the one-wave split count with its default split merge (``mla_tilelang.merge_kind``) and with
    the merge kernel after it, and at half and twice that count. Stops starting new TileLang compiles after
    ``budget_s`` seconds."""
    from rayinfer.kernels._triton_utils import device_sms
    from rayinfer.kernels.mla_tilelang import one_wave_splits, tilelang_available

    rows, start = [], time.time()
    for batch, ctx in ((32, 4096), (64, 4096), (128, 4096), (16, 4096), (8, 4096), (1, 4096), (4, 4096), (32, 1024),
                       (64, 1024), (1, 1024)):
        for bs in (16, 64):
            inputs = mla_decode_inputs(batch, ctx, bs)
            cases = [("triton", None, None)]
            if bs == 64 and tilelang_available():
                wave = one_wave_splits(batch, 8192, device_sms(inputs[2]))
                rows_cfg = {"layout": "keys_as_rows"}
                cases += [("tilelang", rows_cfg, s) for s in sorted({wave, max(1, wave // 2), min(32, 2 * wave)})]
                if wave > 1:
                    cases += [("tilelang", {**rows_cfg, "merge": "launch"}, wave)]
            rows += _mla_decode_cases(ceil, inputs, cases, {"op": "mla_decode_rows", "block_size": bs,
                                                            "batch": batch, "ctx_len": ctx}, start + budget_s)
            del inputs
    return rows


def sweep_mla_rows_stages(ceil, budget_s: float = 240.0) -> list[dict]:
    """The keys-as-rows TileLang MLA decode (V2-Lite's 16 heads, cache blocks of 64) at batch 16 / 32 / 64 / 128,
    4K: its default two-stage pipeline (about 160 KB of shared memory, one program per multiprocessor) against
    one stage (about 95 KB by our count: two programs per multiprocessor then hide each other's loads), at the
    one-wave split count and twice it, each with its default split merge and the other one (the merge kernel,
    or at 3-8 splits the last program's); the Triton kernel beside them. Stops starting new TileLang compiles
    after ``budget_s`` seconds."""
    from rayinfer.kernels._triton_utils import device_sms
    from rayinfer.kernels.mla_tilelang import merge_kind, one_wave_splits, tilelang_available

    rows, start = [], time.time()
    for batch in (32, 16, 64, 128):
        inputs = mla_decode_inputs(batch, 4096, 64)
        wave = one_wave_splits(batch, 8192, device_sms(inputs[2]))
        cases: list[tuple[str, dict | None, int | None]] = [("triton", None, None)]
        if tilelang_available():
            base = {"layout": "keys_as_rows"}
            cases += [("tilelang", base, wave)]
            for splits in sorted({wave, min(32, 2 * wave)}):
                one = {**base, "num_stages": 1}
                cases += [("tilelang", one, splits)]  # the default merge (merge_kind), then the other one
                if splits > 1 and merge_kind(batch, splits) != "launch":
                    cases += [("tilelang", {**one, "merge": "launch"}, splits)]
                elif 2 < splits <= 8:
                    cases += [("tilelang", {**one, "merge": "last_program"}, splits)]
        rows += _mla_decode_cases(ceil, inputs, cases, {"op": "mla_decode_rows_stages", "block_size": 64,
                                                        "batch": batch, "ctx_len": 4096}, start + budget_s)
        del inputs
    return rows


def sweep_mla_splits(ceil) -> list[dict]:
    """DeepSeek-V2-Lite's absorbed MLA decode (16 heads, R 512, P 64, cache blocks of 16) at batch >= 32 per
    split-KV factor (None: the default heuristic), warp count and pipeline depth: graph time per layer and the share of the
    measured copy bandwidth that the latent cache reads reach. A launch of P programs on S multiprocessors
    that hold one program each runs in ceil(P / S) waves, so the split factor sets the last wave's fill."""
    from rayinfer.kernels.mla_attention import mla_decode_triton

    rows = []
    for batch, ctx in ((32, 4096), (64, 4096), (128, 4096), (32, 1024)):
        cache, meta, ql, qp, want, nbytes, layers = mla_decode_inputs(batch, ctx)
        for warps, stages in ((4, 4), (4, 3), (4, 2), (8, 4)):
            for splits in (None, 1, 2, 3, 4, 5, 6, 8, 9, 12, 16):
                cfg = {"num_warps": warps, "num_stages": stages}
                run = lambda i=0, s=splits, c=cfg: mla_decode_triton(ql, qp, cache[i], meta, 0.1, num_splits=s,  # noqa: E731
                                                                      max_seq_len=8192, config=c)
                try:
                    err = (run().float() - want).abs().max().item()
                    us = bench_graph([lambda i=i: run(i) for i in range(layers)])
                except Exception as exc:
                    print(f"  B={batch} ctx={ctx} warps={warps} stages={stages} splits={splits}: failed {exc!r}"[:300],
                          flush=True)
                    continue
                pct = 100 * nbytes / us / 1e3 / ceil["copy_GBps"] if us else None
                rows.append({"op": "mla_decode_splits", "batch": batch, "ctx_len": ctx, "num_warps": warps,
                             "num_stages": stages,
                             "num_splits": splits, "graph_us": us, "pct_of_copy_bw": pct, "max_abs_err": err})
                print(f"  B={batch} ctx={ctx} warps={warps} stages={stages} splits={splits}: {us or float('nan'):7.1f} us "
                      f"{pct or float('nan'):5.1f}% bw err {err:.1e}", flush=True)
        del cache
    return rows


MLA_SWAP_TILES = [  # (block_n, num_warps, num_stages): keys as the products' rows (swap_ab)
    (64, 4, 2), (64, 4, 3), (64, 8, 2),
]  # 128-key tiles (one stage) and 32-key ones hit illegal addresses in Triton 3.6's code at B = 1 (7da4aa3 call)


def sweep_mla_swap(ceil) -> list[dict]:
    """DeepSeek-V2-Lite's absorbed MLA decode (16 heads, R 512, P 64, cache blocks of 16) with keys as the
    products' M dimension (``swap_ab``: S^T = K Q^T and O^T += V^T P^T, so a 64-key tile fills a warpgroup
    MMA) against the default tiles, per tile set and split-KV factor (None: the default heuristic; the others
    fill one or two waves of one program a multiprocessor): graph time per layer and the share of the
    measured copy bandwidth that the latent cache reads reach."""
    from rayinfer.kernels.mla_attention import mla_decode_triton

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, ctx in ((32, 4096), (64, 4096), (128, 4096), (32, 1024), (1, 4096), (1, 1024)):
        cache, meta, ql, qp, want, nbytes, layers = mla_decode_inputs(batch, ctx)
        one_wave = max(1, sms // batch)
        cases = [({}, None)]
        for block_n, warps, stages in MLA_SWAP_TILES:
            cfg = {"swap_ab": True, "block_n": block_n, "num_warps": warps, "num_stages": stages,
                   "min_split_tokens": block_n}
            for splits in sorted({None, one_wave, 2 * one_wave, min(32, ctx // block_n)} - {0}, key=lambda x: x or 0):
                if splits is None or splits * block_n <= ctx:
                    cases.append((cfg, splits))
        for cfg, splits in cases:
            run = lambda i=0, s=splits, c=cfg: mla_decode_triton(ql, qp, cache[i], meta, 0.1, num_splits=s,  # noqa: E731
                                                                  max_seq_len=8192, config=c)
            try:
                err = (run().float() - want).abs().max().item()
                us = bench_graph([lambda i=i: run(i) for i in range(layers)])
            except Exception as exc:  # a tile set that does not compile or fit is a row with its error
                rows.append({"op": "mla_decode_swap", "config": cfg, "num_splits": splits, "batch": batch,
                             "ctx_len": ctx, "error": repr(exc)[:300]})
                print(f"  {cfg} splits={splits} B={batch} ctx={ctx}: failed {exc!r}"[:300], flush=True)
                continue
            pct = 100 * nbytes / us / 1e3 / ceil["copy_GBps"] if us else None
            rows.append({"op": "mla_decode_swap", "config": cfg, "num_splits": splits, "batch": batch, "ctx_len": ctx,
                         "graph_us": us, "pct_of_copy_bw": pct, "max_abs_err": err})
            print(f"  {cfg or 'default'} splits={splits} B={batch} ctx={ctx}: {us or float('nan'):7.1f} us "
                  f"{pct or float('nan'):5.1f}% bw err {err:.1e}", flush=True)
        del cache
    return rows


def sweep_mla_swap_few(ceil) -> list[dict]:
    """Batch 1 and 4 of DeepSeek-V2-Lite's absorbed MLA decode at 1K-8K keys: the default tiles against the
    kernel that sends each token with at least ``swap_min_keys`` keys to the swapped 64-key tiles (0: all of
    them), in graphs bounded by max_model_len 8192 as the engine's: graph time per layer and the share of the
    copy bandwidth."""
    from rayinfer.kernels.mla_attention import mla_decode_triton

    rows = []
    for batch in (1, 4):
        for ctx in (1024, 2048, 3072, 4096, 8192):
            cache, meta, ql, qp, want, nbytes, layers = mla_decode_inputs(batch, ctx)
            for cfg in ({}, {"swap_ab": True, "swap_min_keys": 0}, {"swap_ab": True, "swap_min_keys": 2048},
                        {"swap_ab": True, "swap_min_keys": 0, "num_stages": 3}):
                run = lambda i=0, c=cfg: mla_decode_triton(ql, qp, cache[i], meta, 0.1, max_seq_len=8192,  # noqa: E731
                                                           config=c)
                err = (run().float() - want).abs().max().item()
                us = bench_graph([lambda i=i: run(i) for i in range(layers)])
                pct = 100 * nbytes / us / 1e3 / ceil["copy_GBps"] if us else None
                rows.append({"op": "mla_decode_swap_few", "config": cfg, "batch": batch, "ctx_len": ctx,
                             "graph_us": us, "pct_of_copy_bw": pct, "max_abs_err": err})
                print(f"  {cfg or 'default'} B={batch} ctx={ctx}: {us or float('nan'):7.1f} us "
                      f"{pct or float('nan'):5.1f}% bw err {err:.1e}", flush=True)
            del cache
    return rows


MLA_PREFILL_TILES = [  # (block_m, block_n, num_warps, num_stages)
    (64, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 128, 8, 2),
    (128, 128, 8, 2), (64, 32, 4, 3),
]


def sweep_mla_prefill(ceil) -> list[dict]:
    """DeepSeek-V2-Lite's expanded MLA prefill (16 heads, nope 128 + rope 64, v 128; the context's latents
    up-projected first) per kernel tile set and launch order: eager time of one layer's
    ``mla_prefill_triton`` (gather, up-projection GEMM and the kernel) and the causal attention FLOPs' rate."""
    from rayinfer.kernels.mla_attention import mla_prefill_ref, mla_prefill_triton

    heads, rank, rope, nope, v_dim, bs = 16, 512, 64, 128, 128, 64
    rows = []
    for num_prompts, prompt_len, prefix in ((1, 4096, 0), (8, 2048, 0), (8, 512, 1536)):
        seq = prompt_len + prefix
        nb = num_prompts * math.ceil(seq / bs)
        cache = torch.randn((nb, bs, rank + rope), device="cuda", dtype=DT)
        per = nb // num_prompts
        perm = torch.randperm(nb).tolist()
        meta = AttentionMetadata.build([prompt_len] * num_prompts, [seq] * num_prompts,
                                       [perm[i * per:(i + 1) * per] for i in range(num_prompts)], bs, "cuda")
        t = num_prompts * prompt_len
        q_nope = torch.randn((t, heads, nope), device="cuda", dtype=DT)
        q_pe = torch.randn((t, heads, rope), device="cuda", dtype=DT)
        w = torch.randn((heads * (nope + v_dim), rank), device="cuda", dtype=DT) / rank**0.5
        scale = (nope + rope) ** -0.5
        want = mla_prefill_ref(q_nope, q_pe, cache, meta, w, scale).float()
        pairs = num_prompts * (prompt_len * prefix + prompt_len * (prompt_len + 1) // 2)
        flops = 2 * pairs * heads * (nope + rope + v_dim)
        for tiles in MLA_PREFILL_TILES:
            for reverse in (False, True):
                cfg = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), tiles), reverse=reverse)
                run = lambda c=cfg: mla_prefill_triton(q_nope, q_pe, cache, meta, w, scale, config=c)  # noqa: E731
                try:
                    err = (run().float() - want).abs().max().item()
                    us = bench_eager(run) * 1e3
                except Exception as exc:
                    print(f"  {num_prompts}x{prompt_len} (prefix {prefix}) {cfg}: failed {exc!r}"[:300], flush=True)
                    continue
                tf = flops / us / 1e6 if us else None
                rows.append({"op": "mla_prefill_tiles", "num_prompts": num_prompts, "prompt_len": prompt_len,
                             "prefix": prefix, "config": cfg, "eager_us": us, "attention_TFLOPs": tf,
                             "pct_of_matmul": 100 * tf / ceil["matmul_bf16_TFLOPs"] if tf else None,
                             "max_abs_err": err})
                print(f"  {num_prompts}x{prompt_len} (prefix {prefix}) {tiles} rev={reverse}: "
                      f"{us or float('nan'):8.1f} us {tf or float('nan'):6.1f} TFLOP/s err {err:.1e}", flush=True)
        del cache
    return rows


def _compiled_kernel_stats(fn, name: str) -> list[dict]:
    """Registers and spills of every variant of the Triton kernel ``fn`` (called ``name`` in the rows)
    compiled so far (the cache's key names the constexprs), as rows ``{"op": "compiled", ...}``; one error
    row where this Triton's cache differs."""
    rows = []
    try:
        for cache in fn.device_caches.values():
            for key, kernel in cache[0].items():
                rows.append({"op": "compiled", "kernel": name, "key": str(key)[-400:], "n_regs": kernel.n_regs,
                             "n_spills": kernel.n_spills, "num_warps": kernel.metadata.num_warps,
                             "num_stages": kernel.metadata.num_stages, "shared_bytes": kernel.metadata.shared})
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        rows.append({"op": "compiled", "kernel": name, "error": repr(exc)[:300]})
    for r in rows:
        print(f"  compiled {name}: {r}"[:600], flush=True)
    return rows


def store_kv_case(results, ceil, num_tokens):
    num_blocks = max(64, math.ceil(num_tokens / BLOCK) * 2)
    cache = torch.randn((num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM), device="cuda", dtype=DT)
    layers = layers_for(num_tokens * KV_HEADS * HEAD_DIM * 2 * 2 * 2)
    k = torch.randn((layers, num_tokens, KV_HEADS, HEAD_DIM), device="cuda", dtype=DT)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:num_tokens]
    ref_ms = bench_eager(lambda: store_kv_ref(k[0], v[0], cache, slots))
    kernel_ms = bench_eager(lambda: store_kv_triton(k[0], v[0], cache, slots))
    graph_us = bench_graph([lambda i=i: store_kv_triton(k[i], v[i], cache, slots) for i in range(layers)])
    record(results, ceil, f"store_kv T={num_tokens}", {"tokens": num_tokens}, ref_ms, kernel_ms, graph_us,
           2 * 2 * k[0].numel() * 2)


def rms_norm_case(results, ceil, num_tokens):
    layers = layers_for(num_tokens * HIDDEN * 2 * 4)
    x = torch.randn((layers, num_tokens, HIDDEN), device="cuda", dtype=DT)
    res = torch.randn_like(x)
    w = torch.randn(HIDDEN, device="cuda", dtype=DT)
    err = (rms_norm_triton(x[0], w, 1e-5, res[0])[0].float() - rms_norm_ref(x[0], w, 1e-5, res[0])[0].float())
    ref_ms = bench_eager(lambda: rms_norm_ref(x[0], w, 1e-5, res[0]))
    kernel_ms = bench_eager(lambda: rms_norm_triton(x[0], w, 1e-5, res[0]))
    graph_us = bench_graph([lambda i=i: rms_norm_triton(x[i], w, 1e-5, res[i]) for i in range(layers)])
    record(results, ceil, f"rms_norm+residual T={num_tokens}", {"tokens": num_tokens}, ref_ms, kernel_ms,
           graph_us, 4 * num_tokens * HIDDEN * 2, err=err.abs().max().item())


def rotary_case(results, ceil, num_tokens):
    layers = layers_for(num_tokens * (HEADS + KV_HEADS) * HEAD_DIM * 2 * 2)
    q = torch.randn((layers, num_tokens, HEADS, HEAD_DIM), device="cuda", dtype=DT)
    k = torch.randn((layers, num_tokens, KV_HEADS, HEAD_DIM), device="cuda", dtype=DT)
    pos = torch.randint(0, 8192, (num_tokens,), device="cuda")
    inv = rope_inv_freq(HEAD_DIM, 500000.0).cuda()
    err = (rotary_triton(q[0], k[0], pos, inv)[0].float() - rotary_ref(q[0], k[0], pos, inv)[0].float()).abs().max()
    ref_ms = bench_eager(lambda: rotary_ref(q[0], k[0], pos, inv))
    kernel_ms = bench_eager(lambda: rotary_triton(q[0], k[0], pos, inv))
    graph_us = bench_graph([lambda i=i: rotary_triton(q[i], k[i], pos, inv) for i in range(layers)])
    record(results, ceil, f"rotary T={num_tokens}", {"tokens": num_tokens}, ref_ms, kernel_ms, graph_us,
           2 * (q[0].numel() + k[0].numel()) * 2, err=err.item())


def silu_case(results, ceil, num_tokens):
    layers = layers_for(num_tokens * INTER * 3 * 2)
    x = torch.randn((layers, num_tokens, 2 * INTER), device="cuda", dtype=DT)
    err = (silu_and_mul_triton(x[0]).float() - silu_and_mul_ref(x[0]).float()).abs().max().item()
    ref_ms = bench_eager(lambda: silu_and_mul_ref(x[0]))
    kernel_ms = bench_eager(lambda: silu_and_mul_triton(x[0]))
    graph_us = bench_graph([lambda i=i: silu_and_mul_triton(x[i]) for i in range(layers)])
    record(results, ceil, f"silu_and_mul T={num_tokens}", {"tokens": num_tokens}, ref_ms, kernel_ms, graph_us,
           3 * num_tokens * INTER * 2, err=err)


def copy_blocks_case(results, ceil, num_pairs):
    num_blocks = 4 * num_pairs
    cache = torch.randn((32, num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM), device="cuda", dtype=DT)
    ids = torch.randperm(num_blocks, device="cuda")
    src, dst = ids[:num_pairs].clone(), ids[num_pairs : 2 * num_pairs].clone()
    ref_ms = bench_eager(lambda: copy_blocks_ref(cache, src, dst))
    kernel_ms = bench_eager(lambda: copy_blocks_triton(cache, src, dst))
    graph_us = bench_graph([lambda: copy_blocks_triton(cache, src, dst)])
    nbytes = 2 * 32 * num_pairs * cache[0, 0].numel() * 2
    record(results, ceil, f"copy_blocks L=32 n={num_pairs}", {"layers": 32, "pairs": num_pairs}, ref_ms,
           kernel_ms, graph_us, nbytes)


def sampling_case(results, ceil, batch, full_filters):
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn((batch, VOCAB), device="cuda", generator=gen) * 3
    temperature = torch.full((batch,), 0.8, device="cuda")
    top_k = torch.full((batch,), 50 if full_filters else 0, device="cuda", dtype=torch.int32)
    top_p = torch.full((batch,), 0.9 if full_filters else 1.0, device="cuda")
    min_p = torch.full((batch,), 0.05, device="cuda")
    seeds = torch.arange(batch, device="cuda")
    steps = torch.zeros(batch, dtype=torch.int64, device="cuda")
    args = (logits, temperature, top_k, top_p, min_p, seeds, steps, full_filters, True)
    same = torch.equal(sample_triton(*args), sample_ref(*args))
    ref_ms = bench_eager(lambda: sample_ref(*args))
    kernel_ms = bench_eager(lambda: sample_triton(*args))
    graph_us = bench_graph([lambda: sample_triton(*args)])
    label = "top-k/top-p/min-p (sort)" if full_filters else "min-p only"
    record(results, ceil, f"sample B={batch} {label}", {"batch": batch, "vocab": VOCAB, "sort": full_filters},
           ref_ms, kernel_ms, graph_us, batch * VOCAB * 4, err=0.0 if same else float("nan"))


GEMV_SHAPES = {"o": (HIDDEN, HIDDEN), "down": (HIDDEN, INTER), "qkv": (HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN),
               "gate_up": (2 * INTER, HIDDEN),
               # DeepSeek-V2-Lite's one-row layer: qkv_a_proj (16 heads x 192 + 512 + 64 rows), o_proj
               "mla_qkv_a": (16 * 192 + 576, 2048), "mla_o": (2048, 2048),
               # its dense first layer's MLP (GatedMLP.fuse_gate_up): gate and up stacked, then down
               "v2lite_gate_up": (2 * 10944, 2048), "v2lite_down": (2048, 10944)}
GEMV_PROLOGUE = {"o": None, "down": "silu_and_mul", "qkv": "rms_norm", "gate_up": "rms_norm",
                 "mla_qkv_a": "rms_norm", "mla_o": None, "v2lite_gate_up": "rms_norm", "v2lite_down": "silu_and_mul"}
LLAMA_GEMVS = ("o", "down", "qkv", "gate_up")


def _gemv_fns(name, config):
    """Per-layer callables of (the unfused kernels: RMSNorm or SiLU kernel where the shape has one, then
    cuBLAS; the one-row Triton GEMV with that prologue) for one shape, over distinct weights, and the
    weight bytes."""
    n, k = GEMV_SHAPES[name]
    ws = [torch.randn((n, k), device="cuda", dtype=DT) / k**0.5 for _ in range(layers_for(n * k * 2))]
    F = torch.nn.functional
    if GEMV_PROLOGUE[name] == "silu_and_mul":
        x = torch.randn((1, 2 * k), device="cuda", dtype=DT)
        base = [lambda w=w: F.linear(silu_and_mul_triton(x), w) for w in ws]
        fused = [lambda w=w: silu_and_mul_linear_triton(x, w, config=config) for w in ws]
    elif GEMV_PROLOGUE[name] == "rms_norm":
        x = torch.randn((1, k), device="cuda", dtype=DT)
        nw = torch.rand(k, device="cuda", dtype=DT) + 0.5
        base = [lambda w=w: F.linear(rms_norm_triton(x, nw, 1e-5), w) for w in ws]
        fused = [lambda w=w: fused_linear_triton(x, w, norm_weight=nw, eps=1e-5, config=config) for w in ws]
    else:
        x = torch.randn((1, k), device="cuda", dtype=DT)
        base = [lambda w=w: F.linear(x, w) for w in ws]
        fused = [lambda w=w: linear_triton(x, w, config=config) for w in ws]
    return base, fused, n * k * 2


def sweep_gemv(ceil, shapes=LLAMA_GEMVS, block_ks=(1024, 2048)) -> list[dict]:
    """Graph time per call of the one-row GEMVs (tile configurations; None: the default) against the
    unfused kernels at ``shapes`` (keys of GEMV_SHAPES; by default Llama-3-8B's four projections).
    Consecutive calls in the graph are independent, so with PDL (``pdl`` True, the default on Hopper) one
    call's weight stream overlaps the previous call's tail as it does between a decode layer's kernels."""
    configs = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st)
               for bn in (4, 8, 16) for bk in block_ks for w, st in ((8, 3), (8, 4), (4, 3))]
    configs += [dict(pdl=False)]
    rows = []
    for name in shapes:
        base, _, nbytes = _gemv_fns(name, None)
        base_us = bench_graph(base)
        for cfg in [None, *configs]:
            try:
                us = bench_graph(_gemv_fns(name, cfg)[1])
            except Exception as exc:
                print(f"  gemv {name} {cfg} failed: {exc!r}", file=sys.stderr)
                continue
            if us is None:
                continue
            pct = 100 * nbytes / us / 1e3 / ceil["copy_GBps"]
            rows.append({"shape": name, "m": 1, "config": cfg, "graph_us": us, "unfused_us": base_us,
                         "pct_of_copy_bw": pct})
            print(f"  gemv {name} {cfg}: {us:7.1f} us ({pct:5.1f}% bw) unfused {base_us:7.1f} us", flush=True)
        torch.cuda.empty_cache()
    return rows


GEMV_CONFIG_SETS = {  # per weight shape (n, k) -> tiles; None: the module's _choose_config
    "default": None,
    "w4_k2048": {"*": dict(block_n=8, block_k=2048, num_warps=4, num_stages=3)},
    "per_shape": {(HIDDEN, HIDDEN): dict(block_n=8, block_k=2048, num_warps=8, num_stages=3),
                  (HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN): dict(block_n=8, block_k=2048, num_warps=4, num_stages=3),
                  (2 * INTER, HIDDEN): dict(block_n=16, block_k=1024, num_warps=4, num_stages=3),
                  (HIDDEN, INTER): dict(block_n=8, block_k=2048, num_warps=4, num_stages=3)},
}


def sweep_decode_step(ceil) -> list[dict]:
    """Whole Llama-3-8B decode steps (dummy bf16 weights, context 1K) in a CUDA graph, for each way of
    launching: PDL off / on, and GEMV tile sets (GEMV_CONFIG_SETS; "default" is the set without PDL).
    Batch 1 takes the fused one-row layers; batch 128 shows PDL's effect on the other Triton kernels."""
    import rayinfer.kernels._triton_utils as tu
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.engine.llm_engine import LLMEngine
    from rayinfer.jobs import benchlib as bl
    from rayinfer.kernels import gemv

    engine = LLMEngine(ModelConfig("llama-3-8b", "bfloat16", "dummy", max_model_len=4096),
                       EngineConfig(device="cuda", max_num_seqs=128, gpu_memory_utilization=0.6))
    model, kv = engine.model, engine.kv_cache
    block_size = kv.shape[3]
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed" not in n)
    choose = gemv._choose_config
    rows = []
    variants = [(pdl, name) for pdl in ("0", "1") for name in GEMV_CONFIG_SETS]
    for batch in (1, 128):
        tables, _ = bl.decode_block_tables(batch, 1024, block_size, kv.shape[1])
        ids, pos, meta = bl._step_inputs([1] * batch, [1024] * batch, tables, block_size, model.config.vocab_size,
                                         kv.device, torch.Generator().manual_seed(0))
        for pdl, name in variants if batch == 1 else [("0", "default"), ("1", "default")]:
            os.environ["RAYINFER_PDL"] = pdl
            tu._pdl_supported.cache_clear()
            table = GEMV_CONFIG_SETS[name]

            def pick(n, k, pdl=True, table=table):
                cfg = choose(n, k, False)
                if table is not None:
                    cfg.update(table.get((n, k), table.get("*", {})))
                return cfg

            gemv._choose_config, gemv.DEVICE_TABLE = pick, 0  # these sets, not the device table's tiles
            try:
                with torch.inference_mode():
                    us = bench_graph([lambda: model.compute_logits(model(ids, pos, kv, meta))], replays=30)
            finally:
                gemv._choose_config, gemv.DEVICE_TABLE = choose, 1
            if us is None:
                continue
            ms = us / 1e3
            roof_ms = (weight_bytes + batch * 1024 * 2 * KV_HEADS * HEAD_DIM * 2 * 32) / ceil["copy_GBps"] / 1e6
            rows.append({"batch": batch, "ctx_len": 1024, "pdl": pdl == "1", "gemv_configs": name,
                         "step_ms": ms, "roofline_ms": roof_ms, "pct_of_roofline": 100 * roof_ms / ms})
            print(f"  decode step B={batch} pdl={pdl} gemv={name}: {ms:.3f} ms "
                  f"({100 * roof_ms / ms:.1f}% of {roof_ms:.3f} ms)", flush=True)
    os.environ.pop("RAYINFER_PDL", None)
    tu._pdl_supported.cache_clear()
    return rows


def sweep_decode_tiles(ceil) -> list[dict]:
    """Graph time of decode attention for key-tile sizes, warps and stages, bf16 and fp8 caches."""
    rows = []
    for batch, ctx in ((1, 1024), (32, 1024), (256, 1536)):
        cache, meta, q = _attention_setup(batch, 1, ctx)
        for kv_dtype in (DT, torch.float8_e4m3fn):
            c = cache if kv_dtype == DT else cache.to(kv_dtype)
            nbytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * c.element_size()
            want = paged_attention_ref(q, c[0], meta, HEAD_DIM**-0.5).float()
            tiles = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3), (256, 4, 2)]
            variants = [(*t, True) for t in tiles] + ([(128, 4, 3, False)] if kv_dtype != DT else [])
            for bn, warps, stages, f16 in variants:  # f16=False: an fp8 cache widened to bf16 instead of fp16
                cfg = dict(block_q=4, block_n=bn, num_warps=warps, num_stages=stages, kv_f16=f16)
                try:
                    err, us = _time_config(q, c, meta, want, config=cfg)
                except Exception as exc:
                    print(f"  decode config {cfg} failed: {exc!r}", file=sys.stderr)
                    continue
                pct = 100 * nbytes / us / 1e3 / ceil["copy_GBps"]
                rows.append({"batch": batch, "ctx_len": ctx, "kv_dtype": str(kv_dtype), "config": cfg,
                             "graph_us": us, "pct_of_copy_bw": pct, "err": err})
                print(f"  decode B={batch} ctx={ctx} {kv_dtype} {bn} w{warps} s{stages} f16={f16}: {us:7.1f} us "
                      f"{pct:5.1f}% bw err {err:.1e}", flush=True)
            del c
        del cache
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/kernels-h200.json")
    parser.add_argument("--git-rev", default=None, help="revision of the code (default: git rev-parse HEAD)")
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--sweep", action="store_true", help="also sweep prefill tiles and decode split factors")
    parser.add_argument("--only-sweeps", nargs="*", default=None,
                        help="skip the kernel table; run these sweeps (gemv, gemv_mla, gemv_v2lite_mlp, decode_tiles, prefill, prefill_gqa8, prefill_long, "
                        "decode_splits, decode_step, mla, mla_tiles, mla_tilelang, mla_rows, mla_rows_stages, mla_splits, mla_swap, mla_swap_few, mla_prefill)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA device")
    rev = args.git_rev
    if rev is None:
        try:
            rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
        except OSError:
            rev = None
    import triton

    torch.manual_seed(0)
    t0 = time.time()
    ceil = measure_ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['matmul_bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    results: list[dict] = []
    sweeps = {}
    if args.only_sweeps is not None:
        funcs = {"gemv": sweep_gemv, "decode_tiles": sweep_decode_tiles, "prefill": sweep_prefill, "prefill_gqa8": sweep_prefill_gqa8,
                 "decode_splits": sweep_decode_splits, "decode_step": sweep_decode_step, "mla": sweep_mla,
                 "prefill_long": sweep_prefill_long,
                 "mla_tiles": sweep_mla_tiles, "mla_tilelang": sweep_mla_tilelang, "mla_rows": sweep_mla_rows, "mla_rows_stages": sweep_mla_rows_stages, "mla_splits": sweep_mla_splits, "mla_swap": sweep_mla_swap, "mla_swap_few": sweep_mla_swap_few,
                 "mla_prefill": sweep_mla_prefill,
                 "gemv_mla": lambda c: sweep_gemv(c, ("mla_qkv_a", "mla_o"), block_ks=(512, 1024, 2048)),
                 "gemv_v2lite_mlp": lambda c: sweep_gemv(c, ("v2lite_gate_up", "v2lite_down"),
                                                         block_ks=(512, 1024, 2048))}
        for name in args.only_sweeps:
            sweeps[name] = funcs[name](ceil)
            with open(args.out, "w") as f:  # after each sweep, so a cut-off run keeps what it measured
                json.dump({"command": " ".join(sys.argv), "git_rev": rev, "device": torch.cuda.get_device_name(),
                           "ceilings": ceil, "sweeps": sweeps}, f, indent=1)
        return
    for batch in (1, 32, 128):
        for ctx in (1024, 4096):
            attention_case(results, ceil, batch, 1, ctx)
    attention_case(results, ceil, 1, 1, 4096, num_splits=1, label="attn decode B=1 ctx=4096 no-split")
    attention_case(results, ceil, 8, 1, 4096)
    attention_case(results, ceil, 1, 4096, 4096)
    if not args.quick:
        attention_case(results, ceil, 1, 2048, 4096, label="attn extend 2048 over 2048 prefix")
    for t in (128, 4096):
        store_kv_case(results, ceil, t)
        rms_norm_case(results, ceil, t)
        rotary_case(results, ceil, t)
        silu_case(results, ceil, t)
    copy_blocks_case(results, ceil, 64)
    for batch in (1, 128):
        sampling_case(results, ceil, batch, False)
        sampling_case(results, ceil, batch, True)
    if args.sweep:
        sweeps["prefill_4096"] = sweep_prefill(ceil)
        sweeps["decode_splits"] = sweep_decode_splits(ceil)
    report = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "git_rev": rev,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": str(DT),
        "ceilings": ceil,
        "seconds": time.time() - t0,
        "notes": "ref_ms/kernel_ms: eager median with L2 flushed, launch included; kernel_graph_us: per call in a "
        "CUDA graph over distinct buffers; GBps and pct_of_copy_bw from the graph time and the fewest bytes.",
        "results": results,
        "sweeps": sweeps,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
