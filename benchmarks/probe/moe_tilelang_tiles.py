"""Probe: the fused MoE's grouped-GEMM path at prefill sizes with its GEMMs on torch's grouped GEMM (CUTLASS) or on
kernels.moe_tilelang's programs (SwiGLU fused into the first), per tile set, as a share of the matmul rate.

For each expert shape (V2-Lite with its 2 shared experts as slots, Qwen3-30B-A3B) and token count, times under a
CUDA graph (a few layers of distinct weights, so L2 holds little of them) the whole layer (alignment, gather, both
GEMMs, slot sum) on each backend, and the two GEMMs alone on each, and checks each against fused_moe_ref.

    PYTHONPATH=. python benchmarks/probe/moe_tilelang_tiles.py --out tiles.json [--m 2048,4096] [--git-rev REV] \
        [--tiles '[{"block_n": 256, "num_stages": 3, "store": "shared"}]'] [--dump-source DIR]

``--dump-source`` writes each compiled program's CUDA source (one file per expert shape, GEMM and tile set).
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import bench_graph, measure_ceilings, write_probe  # noqa: E402

from rayinfer.kernels.activation import silu_and_mul  # noqa: E402
from rayinfer.kernels.fused_moe import _grouped_mm_op, fused_moe_grouped_mm, fused_moe_ref  # noqa: E402
from rayinfer.kernels.moe_routing import append_shared_experts  # noqa: E402
from rayinfer.kernels.moe_tilelang import grouped_gemm_tilelang  # noqa: E402

SHAPES = {"deepseek-v2-lite": (64, 1408, 2048, 6, 2), "qwen3-30b-a3b": (128, 768, 2048, 8, 0)}
TILES = [dict(), dict(block_n=256, num_stages=3), dict(block_n=256, num_stages=4)]


def case(name, shape, m, ceil, tile_sets, dump_dir=None, layers=4) -> list[dict]:
    import rayinfer.kernels.moe_tilelang as mt

    routed, inter, hidden, top_k, shared = shape
    e = routed + shared
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    w13s = [(torch.randn(e, 2 * inter, hidden, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
            for _ in range(layers)]
    w2s = [(torch.randn(e, hidden, inter, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
           for _ in range(layers)]
    w, ids = torch.rand(m, routed, generator=gen, device="cuda").topk(top_k, dim=-1)
    w, ids = append_shared_experts(w / w.sum(-1, keepdim=True), ids, routed, shared)
    flops = 2 * m * (top_k + shared) * 3 * hidden * inter
    want = fused_moe_ref(x, w13s[0], w2s[0], ids, w).float()
    rows = []

    def add(backend, tiles, us, err, what):
        row = {"shape": name, "m": m, "backend": backend, "tiles": tiles, "what": what, "us": us,
               "pct_of_matmul_rate": None if us is None else 100 * flops / (us * 1e-6) / (ceil["matmul_bf16_TFLOPs"] * 1e12),
               "max_abs_err_vs_ref": err}
        print(json.dumps(row), flush=True)
        rows.append(row)

    err = float((fused_moe_grouped_mm(x, w13s[0], w2s[0], ids, w, gemms="torch").float() - want).abs().max())
    add("torch", None, bench_graph([lambda i=i: fused_moe_grouped_mm(x, w13s[i], w2s[i], ids, w, gemms="torch")
                                    for i in range(layers)]), err, "layer")
    # the GEMMs alone on a balanced layout of the same pairs (16-row aligned groups)
    pairs = m * (top_k + shared)
    counts = torch.full((e,), pairs // e, device="cuda")
    counts[: pairs % e] += 1
    counts = (counts + 15) // 16 * 16
    ends = counts.cumsum(0).to(torch.int32)
    rows_in = torch.randn(int(ends[-1]), hidden, generator=gen, device="cuda").to(torch.bfloat16)
    op = _grouped_mm_op()

    def torch_gemms(i):
        gate_up = op(rows_in, w13s[i].transpose(1, 2), offs=ends)
        return op(silu_and_mul(gate_up), w2s[i].transpose(1, 2), offs=ends)

    add("torch", None, bench_graph([lambda i=i: torch_gemms(i) for i in range(layers)]), None, "gemms")
    base = dict(mt.DEFAULT_TILES)
    try:
        for tiles in tile_sets:
            mt.DEFAULT_TILES = {**base, **tiles}  # what grouped_gemm_tilelang fills in

            def tl_gemms(i):
                act = grouped_gemm_tilelang(rows_in, w13s[i], ends, True)
                return grouped_gemm_tilelang(act, w2s[i], ends, False)

            try:
                got = fused_moe_grouped_mm(x, w13s[0], w2s[0], ids, w, gemms="tilelang")
                add("tilelang", tiles, bench_graph([lambda i=i: fused_moe_grouped_mm(
                    x, w13s[i], w2s[i], ids, w, gemms="tilelang") for i in range(layers)]),
                    float((got.float() - want).abs().max()), "layer")
                add("tilelang", tiles, bench_graph([lambda i=i: tl_gemms(i) for i in range(layers)]), None, "gemms")
                if dump_dir:
                    dump_sources(dump_dir, name, e, inter, hidden, mt.DEFAULT_TILES)
            except Exception as exc:  # a tile set the device cannot hold
                print(f"{name} M={m} {tiles}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    finally:
        mt.DEFAULT_TILES = base
    return rows


def dump_sources(dump_dir: str, name: str, e: int, inter: int, hidden: int, tiles: dict) -> None:
    """Both programs' CUDA source for one tile set, as TileLang generated it."""
    import rayinfer.kernels.moe_tilelang as mt

    Path(dump_dir).mkdir(parents=True, exist_ok=True)
    key = tuple(sorted(tiles.items()))
    tag = "-".join(f"{k}{v}" for k, v in key)
    for gemm, (n, k, swiglu) in {"gate-up": (2 * inter, hidden, True), "down": (hidden, inter, False)}.items():
        src = mt._compiled(e, n, k, "bfloat16", swiglu, key).get_kernel_source()
        (Path(dump_dir) / f"{name}-{gemm}-{tag}.cu").write_text(src)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--m", default="2048,4096")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tiles", default=None, help="JSON list of tile sets (overrides of DEFAULT_TILES); default: TILES")
    p.add_argument("--dump-source", default=None, help="directory for the compiled programs' CUDA source")
    p.add_argument("--git-rev", default=None, help="revision of the code (default: git rev-parse --short HEAD)")
    args = p.parse_args()
    tile_sets = json.loads(args.tiles) if args.tiles else TILES
    ceil = measure_ceilings()
    print(ceil, flush=True)
    rows = []
    with torch.inference_mode():
        for name in args.shapes.split(","):
            for m in (int(v) for v in args.m.split(",")):
                rows += case(name, SHAPES[name], m, ceil, tile_sets, args.dump_source)
    if args.out:
        write_probe(args.out, args.git_rev, ceil, rows)


if __name__ == "__main__":
    main()
