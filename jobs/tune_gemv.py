"""Tune the one-row GEMV's tiles (``kernels.gemv``, batch-1 decode) on this GPU and write them into its table
(``rayinfer/kernels/configs/<device>.json``, the ``gemv`` object).

    python jobs/tune_gemv.py                                  # DeepSeek-V2-Lite's one-row projections
    python jobs/tune_gemv.py --shapes deepseek-v2-lite,llama-3-8b --out $OUT/NVIDIA_H200.json
    python jobs/tune_gemv.py --shapes 4096x4096:rms_norm      # NxK[:prologue]
    python jobs/tune_gemv.py --fp8                            # fp8 block weights (entries of that dtype)

For each weight shape [N, K] (with the prologue the model runs it with: an RMSNorm, SiLU-and-mul of a [1, 2K]
input, or none), times ``fused_linear_triton`` under a CUDA graph over enough distinct weights that none
stays in L2 (consecutive calls are independent, so under programmatic dependent launch one call's weight
stream overlaps the previous one's tail, as between a decode layer's kernels) for every candidate tile set,
checks the winner against ``fused_linear_ref``, and writes it when it beats the tiles of
``kernels.gemv._choose_config``'s rule by ``--margin`` (default 3%); otherwise the shape's entry is removed,
so the rule applies. Other entries of the file are kept. About 20 s a shape on an H200, most of it compiling.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path

import torch

# name: [(N, K, prologue)] of a model's one-row GEMVs (prologue: "rms_norm", "silu_and_mul" or None)
SHAPES = {
    # q_proj (16 heads x 192) stacked with kv_a_proj_with_mqa (512 + 64), the input norm in its prologue;
    # o_proj; layer 0's dense MLP: gate/up stacked (2 x 10944), down with SiLU-and-mul in its prologue
    "deepseek-v2-lite": [(3648, 2048, "rms_norm"), (2048, 2048, None), (21888, 2048, "rms_norm"),
                         (2048, 10944, "silu_and_mul")],
    "llama-3-8b": [(6144, 4096, "rms_norm"), (4096, 4096, None), (28672, 4096, "rms_norm"),
                   (4096, 14336, "silu_and_mul")],
    # q (32 heads x 128), k and v (4 heads x 128) stacked, the input norm in its prologue; o_proj
    "qwen3-30b-a3b": [(5120, 2048, "rms_norm"), (2048, 4096, None)],
}
ROTATE_BYTES = 1 << 30  # distinct weights a graph cycles through: 20x an H200's L2


def candidates() -> list[dict]:
    """Tile sets timed per shape: 4 to 16 output rows a program, K tiles of 512 to 2048, 4 or 8 warps,
    3 or 4 stages."""
    return [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
            for bn, bk, w, s in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8), (3, 4))]


def parse_shape(text: str) -> tuple[str, list[tuple[int, int, str | None]]]:
    """A name of :data:`SHAPES` or ``NxK[:prologue]``. Raises: ValueError naming the problem."""
    if text in SHAPES:
        return text, SHAPES[text]
    dims, _, prologue = text.partition(":")
    try:
        n, k = (int(v) for v in dims.split("x"))
    except ValueError:
        raise ValueError(f"shape {text!r}: a name of {sorted(SHAPES)} or NxK[:rms_norm|silu_and_mul]") from None
    if prologue not in ("", "rms_norm", "silu_and_mul") or n < 1 or k < 1:
        raise ValueError(f"shape {text!r}: N, K positive; prologue rms_norm, silu_and_mul or none")
    return text, [(n, k, prologue or None)]


def tune_shape(n: int, k: int, prologue: str | None, dtype: torch.dtype, log=print, fp8: bool = False,
               device: str = "cuda") -> dict:
    """{"config": best tiles, "us": its time, "rule": the rule's tiles, "rule_us": their time, "max_abs_err":
    the winner against the torch reference} of one [n, k] weight (``fp8``: float8_e4m3fn in 128 x 128 blocks,
    ``kernels.block_fp8``'s format, against the reference on the dequantized weight)."""
    from rayinfer.jobs import benchlib
    from rayinfer.kernels.block_fp8 import block_fp8_dequant_ref, quantize_block_fp8
    from rayinfer.kernels.gemv import _choose_config, fused_linear_ref, fused_linear_triton

    gen = torch.Generator(device=device).manual_seed(0)
    rotate = ROTATE_BYTES if device == "cuda" else 1  # off CUDA (tests): one weight
    layers = max(1, min(256, math.ceil(rotate / (n * k * (1 if fp8 else 2)))))
    ws = [(torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype) for _ in range(layers)]
    scales: list = [None] * layers
    if fp8:
        ws, scales = (list(t) for t in zip(*(quantize_block_fp8(w) for w in ws)))
    x = torch.randn(1, 2 * k if prologue == "silu_and_mul" else k, generator=gen, device=device).to(dtype)
    norm = (torch.rand(k, generator=gen, device=device) + 0.5).to(dtype) if prologue == "rms_norm" else None
    kw = dict(norm_weight=norm, eps=1e-6, silu_and_mul_input=prologue == "silu_and_mul")

    def time_us(cfg: dict) -> float:
        return benchlib.graph_time_us([lambda w=w, s=s: fused_linear_triton(x, w, config=cfg, weight_scale=s, **kw)
                              for w, s in zip(ws, scales)])

    rule = _choose_config(n, k, True)
    rule_us = time_us(rule)
    best, best_us = rule, rule_us
    for cfg in candidates():
        try:
            us = time_us(cfg)
        except Exception as exc:  # a set the device cannot hold (shared memory, registers)
            log(f"  {n}x{k} {cfg}: {type(exc).__name__}")
            continue
        if us < best_us:
            best, best_us = cfg, us
    ref_w = block_fp8_dequant_ref(ws[0], scales[0], dtype) if fp8 else ws[0]
    err = (fused_linear_triton(x, ws[0], config=best, weight_scale=scales[0], **kw).float()
           - fused_linear_ref(x, ref_w, **kw).float()).abs().max().item()
    return {"config": best, "us": best_us, "rule": rule, "rule_us": rule_us, "max_abs_err": err}


def merge_table(path: Path, device: str, dtype: str, tuned: dict[tuple[int, int], dict], margin: float) -> dict:
    """The table at ``path`` with each tuned shape's entry set (its winner beat the rule by ``margin``) or
    removed (it did not); other shapes and keys are kept. Raises: ValueError when the file is another
    device's or the result is malformed."""
    from rayinfer.kernels.fused_moe_config import _check_gemv_entry, gemv_key

    table = json.loads(path.read_text()) if path.is_file() else {"device": device, "entries": {}}
    if table.get("device") != device:
        raise ValueError(f"{path} holds the table of {table.get('device')!r}, not of {device!r}")
    gemv = table.setdefault("gemv", {})
    for (n, k), r in tuned.items():
        key = gemv_key(n, k, dtype)
        if r["us"] < (1 - margin) * r["rule_us"]:
            gemv[key] = _check_gemv_entry(r["config"])
        else:
            gemv.pop(key, None)
    table["gemv"] = dict(sorted(gemv.items()))
    return table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shapes", default="deepseek-v2-lite",
                        help=f"comma-separated names ({', '.join(SHAPES)}) or NxK[:rms_norm|silu_and_mul]")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--fp8", action="store_true",
                        help="fp8 block weights (table entries of dtype float8_e4m3fn; activations in --dtype)")
    parser.add_argument("--margin", type=float, default=0.03,
                        help="how much faster (a fraction) than the rule's tiles a winner must be to be written")
    parser.add_argument("--out", default=None, help="table path (default: rayinfer/kernels/configs/<device>.json)")
    parser.add_argument("--report", default=None, help="also write every shape's timings here (JSON)")
    parser.add_argument("--git-rev", default=None, help="revision recorded in the report (default: git's HEAD)")
    args = parser.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",") if s]
    except ValueError as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        parser.error("tune_gemv needs a CUDA device")
    from rayinfer.kernels.fused_moe_config import table_path

    dtype = getattr(torch, args.dtype)
    device = torch.cuda.get_device_name()
    started = time.time()
    tuned: dict[tuple[int, int], dict] = {}
    with torch.inference_mode():
        for name, dims in shapes:
            for n, k, prologue in dims:
                r = tuned[(n, k)] = tune_shape(n, k, prologue, dtype, log=lambda s: print(s, flush=True), fp8=args.fp8)
                print(f"{name} {n}x{k} ({prologue}): rule {r['rule']} {r['rule_us']:.2f} us, best {r['config']} "
                      f"{r['us']:.2f} us, max abs err {r['max_abs_err']:.2e}", flush=True)
    out = Path(args.out) if args.out else table_path(device)
    table = merge_table(out, device, "float8_e4m3fn" if args.fp8 else args.dtype, tuned, args.margin)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {out} ({time.time() - started:.0f} s)")
    from rayinfer.jobs import benchlib

    report = {**benchlib.run_metadata(torch.device("cuda"), args.git_rev), "table": str(out),
              "results": {f"{n}x{k}": r for (n, k), r in tuned.items()}}
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
