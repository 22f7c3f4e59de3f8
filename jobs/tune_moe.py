"""Tune the fused-MoE grouped GEMM's tiles on this GPU and write its table (``rayinfer/kernels/configs/<device>.json``).

    python jobs/tune_moe.py                                   # DeepSeek-V2-Lite's expert shape, M = 1..4096
    python jobs/tune_moe.py --shapes deepseek-v2-lite,qwen3-30b-a3b --out $OUT/NVIDIA_H200.json
    python jobs/tune_moe.py --shapes 64x1408x2048x6x2 --m 1,16,256 --budget-s 60     # ExIxHxk[xS]
    python jobs/tune_moe.py --fp8                             # fp8 block weights (their own entries; W8A8
                                                              # where the GPU has fp8 tensor cores)
    python jobs/tune_moe.py --report tune.json                # also every timing, with the command and revision

For each expert shape (E routed experts, intermediate I, hidden H, top-k, S shared experts fused as
extra slots every token takes: the kernel then holds E + S experts) and token count M, times
``fused_moe_triton`` (alignment, both grouped GEMMs, activation, top-k sum; the way a layer runs it) under
a CUDA graph (``triton.testing.do_bench_cudagraph``) for every candidate tile config, on random bf16
weights and uniformly random routing, checks the winner against ``fused_moe_ref``, and merges the
winners into the device's table (entries of other shapes in the file are kept). The candidates: BLOCK_M
from 16 up to about twice the mean pairs per expert (at most 128), BLOCK_N and BLOCK_K in {64, 128},
4 or 8 warps, 3 or 4 stages (``--wide`` adds BLOCK_N 32 / BLOCK_K 32 / 2 stages). The default run (one
shape, 13 M values) takes about 3 minutes on an H200, most of it compiling; ``--budget-s`` stops early
(the table keeps what was tuned; lookups take the nearest tuned M). See ``kernels.fused_moe_config``.

Where torch's grouped GEMM runs (bf16 on compute capability 9.x / 10.x), each M >= 1024 is also timed on
``fused_moe_grouped_mm``, and the table's ``grouped_mm_from`` for the shape becomes the smallest tuned M
from which that path beats the tuned Triton kernel by ``--grouped-margin`` (default 8%) at every larger
tuned M (the key is dropped when it never does). Kernel time under a graph favours the grouped path a
little against the model's eager prefill; ``jobs/bench_moe.py --ab grouped-mm-0,grouped-mm-N`` checks a
threshold in the model.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

SHAPES = {  # name: (E, I, H, top_k, S) of one rank's routed experts; S shared experts fused as extra slots
    "deepseek-v2-lite": (64, 1408, 2048, 6, 2),  # the kernel sees E + S = 66 experts, k + S = 8 slots
    "deepseek-v2-lite-ep": (64, 1408, 2048, 6, 0),  # shared experts unfused (expert parallelism)
    "qwen3-30b-a3b": (128, 768, 2048, 8, 0),
    "deepseek-v3-ep8": (32, 2048, 7168, 8, 0),  # 256 experts over 8 ranks
}
M_VALUES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def candidates(num_tokens: int, num_experts: int, top_k: int, wide: bool = False) -> list:
    """Tile configs worth timing at M tokens: BLOCK_M up to ~2x the mean pairs per expert."""
    from rayinfer.kernels.fused_moe_config import MoETileConfig

    per_expert = num_tokens * top_k / num_experts
    block_ms = [b for b in (16, 32, 64, 128) if b == 16 or b <= 2 * per_expert]
    block_ns = (32, 64, 128) if wide else (64, 128)
    block_ks = (32, 64, 128) if wide else (64, 128)
    stages = (2, 3, 4) if wide else (3, 4)
    return [MoETileConfig(*c) for c in itertools.product(block_ms, block_ns, block_ks, (4, 8), stages)]


def parse_shape(text: str) -> tuple[str, tuple[int, int, int, int, int]]:
    """A name of :data:`SHAPES`, ``ExIxHxk`` or ``ExIxHxkxS`` -> (name, (E, I, H, k, S)). Raises: ValueError."""
    if text in SHAPES:
        return text, SHAPES[text]
    try:
        dims = [int(x) for x in text.split("x")]
        if len(dims) not in (4, 5):
            raise ValueError
    except ValueError:
        raise ValueError(f"shape {text!r} is neither one of {sorted(SHAPES)} nor ExIxHxk[xS]") from None
    e, i, h, k, shared = dims + [0] * (5 - len(dims))
    return text, (e, i, h, k, shared)


def random_routing(num_tokens: int, num_experts: int, top_k: int, num_shared: int, gen) -> tuple:
    """Uniformly random top-k over E routed experts, then S shared slots (experts E .. E+S-1, weight 1)."""
    from rayinfer.kernels.moe_routing import append_shared_experts

    weights, ids = torch.rand(num_tokens, num_experts, generator=gen, device="cuda").topk(top_k, dim=-1)
    return append_shared_experts(weights / weights.sum(-1, keepdim=True), ids, num_experts, num_shared)


def tune_shape(shape: tuple[int, int, int, int, int], m_values: list[int], dtype: torch.dtype, deadline: float,
               wide: bool, log=print, fp8: bool = False) -> dict[int, dict]:
    """{M: {"config": tile config JSON, "us": best time, "default_us": the heuristic's time}} of one shape."""
    from triton.testing import do_bench_cudagraph

    from rayinfer.kernels.block_fp8 import block_fp8_dequant_ref, quantize_block_fp8
    from rayinfer.kernels.fused_moe import (dequant_w13, fused_moe_grouped_mm, fused_moe_ref, fused_moe_triton,
                                            fused_moe_w8a8_ref, grouped_mm_applies, quantize_w13, w8a8_applies)
    from rayinfer.kernels.fused_moe_config import default_tile_config

    num_routed, inter, hidden_size, top_k, num_shared = shape
    num_experts = num_routed + num_shared
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden_size, generator=gen, device="cuda") * 0.02).to(dtype)
    w2 = (torch.randn(num_experts, hidden_size, inter, generator=gen, device="cuda") * 0.02).to(dtype)
    scales: dict = {}
    if fp8:  # fp8 block weights, checked against the W8A8 reference where the kernel quantizes activations
        # (w8a8_applies), else against the reference on the dequantized weights
        (w13, s13), (w2, s2) = quantize_w13(w13), quantize_block_fp8(w2)
        scales = dict(w13_scale=s13, w2_scale=s2)
        ref13, ref2 = dequant_w13(w13, s13, dtype), block_fp8_dequant_ref(w2, s2, dtype)
    else:
        ref13, ref2 = w13, w2
    results: dict[int, dict] = {}
    for m in m_values:
        if time.time() > deadline:
            log(f"  budget spent: M >= {m} not tuned")
            break
        x = torch.randn(m, hidden_size, generator=gen, device="cuda").to(dtype)
        weights, ids = random_routing(m, num_routed, top_k, num_shared, gen)

        def time_us(tiles) -> float:
            fn = lambda: fused_moe_triton(x, w13, w2, ids, weights, tiles=tiles, **scales)  # noqa: E731
            fn()
            ms = do_bench_cudagraph(fn, rep=10)  # return_mode "mean": one float
            return 1e3 * float(ms)  # type: ignore[arg-type]

        default = default_tile_config(m, top_k + num_shared)
        default_us = time_us(default)
        best, best_us = default, default_us
        for tiles in candidates(m, num_experts, top_k + num_shared, wide):
            if time.time() > deadline:
                break
            try:
                us = time_us(tiles)
            except Exception as exc:  # a config the device cannot hold (shared memory, registers)
                log(f"  M={m} {tiles.to_json()}: {type(exc).__name__}")
                continue
            if us < best_us:
                best, best_us = tiles, us
        # W8A8 re-quantizes the SiLU-and-mul output: a last-bit difference there on an e4m3 midpoint moves one
        # activation a whole fp8 step, so its bound is looser (it still catches a wrong tile config)
        w8a8 = fp8 and w8a8_applies(x)
        if w8a8:
            want = fused_moe_w8a8_ref(x, w13, w2, scales["w13_scale"], scales["w2_scale"], ids, weights).float()
        else:
            want = fused_moe_ref(x, ref13, ref2, ids, weights).float()
        err = float((fused_moe_triton(x, w13, w2, ids, weights, tiles=best, **scales).float() - want).abs().max())
        if err > (1e-1 if w8a8 else 3e-2) * max(1.0, float(want.abs().max())):
            raise RuntimeError(f"M={m}: tuned config {best.to_json()} is wrong (max abs err {err:.3g})")
        results[m] = {"config": best.to_json(), "us": best_us, "default_us": default_us}
        grouped = ""
        if m >= GROUPED_MM_MIN_M and not fp8 and grouped_mm_applies(x, w13, force=True):
            fn = lambda: fused_moe_grouped_mm(x, w13, w2, ids, weights)  # noqa: E731
            fn()
            results[m]["grouped_mm_us"] = 1e3 * float(do_bench_cudagraph(fn, rep=10))  # type: ignore[arg-type]
            grouped = f" | grouped GEMM {results[m]['grouped_mm_us']:8.1f} us"
        log(f"  M={m:<5} best {best_us:8.1f} us {best.to_json()} | default {default_us:8.1f} us "
            f"(x{default_us / best_us:.2f}){grouped}")
    return results


GROUPED_MM_MIN_M = 1024  # below this the grouped-GEMM path is not timed (decode-sized calls stay on Triton)


def grouped_mm_start(results: dict[int, dict], margin: float = 0.08) -> int | None | bool:
    """From :func:`tune_shape`'s results: the smallest timed M from which ``grouped_mm_us`` beats the tuned
    Triton time ``us`` by ``margin`` (a fraction) at that M and every larger timed M; None when the largest
    timed M does not; False when no M was timed on the grouped path (the table is left as it was)."""
    timed = sorted(m for m, r in results.items() if "grouped_mm_us" in r)
    if not timed:
        return False
    start = None
    for m in reversed(timed):
        if results[m]["grouped_mm_us"] * (1 + margin) > results[m]["us"]:
            break
        start = m
    return start


def merge_table(path: Path, device: str, dtype: str, tuned: dict[tuple[int, int, int, int, int], dict[int, dict]],
                grouped_margin: float = 0.08) -> dict:
    """Add the tuned entries to the table at ``path`` and return the table: a tuned (shape, M) replaces its
    entry; other shapes, and a shape's token counts that were not tuned this time, are kept (a run of
    ``--m 1,2,4`` leaves the shape's other M as they were). A shape timed on the grouped-GEMM path gets its
    ``grouped_mm_from`` (:func:`grouped_mm_start`), or loses it when that path never won."""
    from rayinfer.kernels.fused_moe_config import parse_table, shape_key

    table = json.loads(path.read_text()) if path.is_file() else {"device": device, "entries": {}}
    if table.get("device") != device:
        raise ValueError(f"{path} holds the table of {table.get('device')!r}, not of {device!r}")
    for (e, i, h, _, shared), by_m in tuned.items():
        key = shape_key(e + shared, 2 * i, h, dtype)
        merged = {**table["entries"].get(key, {}), **{str(m): r["config"] for m, r in by_m.items()}}
        table["entries"][key] = dict(sorted(merged.items(), key=lambda kv: int(kv[0])))
        start = grouped_mm_start(by_m, grouped_margin)
        if start is not False:
            starts = table.setdefault("grouped_mm_from", {})
            if start is None:
                starts.pop(key, None)
            else:
                starts[key] = start
    parse_table(table)  # validates what is written
    return table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shapes", default="deepseek-v2-lite",
                        help=f"comma-separated names ({', '.join(SHAPES)}) or ExIxHxk")
    parser.add_argument("--m", default=",".join(map(str, M_VALUES)), help="token counts to tune")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="activations' dtype")
    parser.add_argument("--fp8", action="store_true",
                        help="fp8 block-quantized expert weights (table entries of dtype float8_e4m3fn)")
    parser.add_argument("--budget-s", type=float, default=220.0, help="stop tuning after this many seconds")
    parser.add_argument("--wide", action="store_true", help="a wider candidate set (slower)")
    parser.add_argument("--out", default=None, help="table path (default: rayinfer/kernels/configs/<device>.json)")
    parser.add_argument("--grouped-margin", type=float, default=0.08,
                        help="how much faster (a fraction) the grouped-GEMM path must be to start at an M")
    parser.add_argument("--report", default=None,
                        help="also write every timing (tuned, heuristic and grouped-GEMM us per M) here (JSON)")
    parser.add_argument("--git-rev", default=None, help="revision recorded in the report (default: git's HEAD)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("tune_moe needs a CUDA device")
    from rayinfer.kernels.fused_moe_config import table_path

    shapes = [parse_shape(s) for s in args.shapes.split(",") if s]
    m_values = sorted({int(m) for m in args.m.split(",") if m})
    dtype = getattr(torch, args.dtype)
    device = torch.cuda.get_device_name()
    started = time.time()
    deadline = started + args.budget_s
    tuned, report = {}, {}
    with torch.inference_mode():
        for name, shape in shapes:
            print(f"{name}: E={shape[0]} I={shape[1]} H={shape[2]} k={shape[3]} shared={shape[4]} on {device}",
                  flush=True)
            tuned[shape] = tune_shape(shape, m_values, dtype, deadline, args.wide,
                                      log=lambda s: print(s, flush=True), fp8=args.fp8)
            report[name] = {str(m): r for m, r in tuned[shape].items()}
    out = Path(args.out) if args.out else table_path(device)
    table = merge_table(out, device, "float8_e4m3fn" if args.fp8 else args.dtype, tuned, args.grouped_margin)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {out} ({time.time() - started:.0f} s)")
    from rayinfer.jobs import benchlib

    result = {**benchlib.run_metadata(torch.device("cuda"), args.git_rev), "table": str(out), "results": report}
    if args.report:
        Path(args.report).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
