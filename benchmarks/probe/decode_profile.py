"""Probe: where a decode step's time goes, kernel by kernel (the step replayed from the engine's CUDA graph
under ``torch.profiler``), per A/B variant of ``jobs/bench_moe.py``.

For each variant: the step's median time (graph replay plus the logits, as ``bench_moe.bench_step`` times it),
each kernel's device time a step (sum and calls), and one step's timeline (kernel, start offset from the step's
first kernel, duration), and each kernel's increment (its end minus the end of the kernel before it: its
share of the step's critical path; median and sum a step). Under PDL a kernel starts before the one ahead of it ends, so its duration includes
its wait: read the timeline's starts and ends, not the sum of durations (``no-pdl`` gives standalone times).

    PYTHONPATH=. python benchmarks/probe/decode_profile.py --variants default,no-pdl --out /tmp/profile.json
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from jobs.bench_moe import BLOCK_SIZE, MODELS, ab_variant, build_model, time_ms  # noqa: E402

from rayinfer.engine.cuda_graph import DecodeGraphs  # noqa: E402
from rayinfer.kernels.attention_metadata import AttentionMetadata  # noqa: E402


def profile_variant(model, name: str, batch: int, context: int, steps: int, reps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cfg, device, dtype = model.config, model.lm_head.weight.device, model.lm_head.weight.dtype
    seq_len = context + 1
    blocks = -(-seq_len // BLOCK_SIZE)
    kv = torch.zeros(model.kv_cache_shape(batch * blocks, BLOCK_SIZE), dtype=dtype, device=device)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [seq_len] * batch, tables, BLOCK_SIZE, device)
    ids = torch.randint(0, cfg.vocab_size, (batch,), generator=torch.Generator().manual_seed(0)).to(device)
    pos = torch.full((batch,), context, device=device)
    with ab_variant(model, name), torch.inference_mode():
        graphs = DecodeGraphs(model, kv, BLOCK_SIZE, max_model_len=seq_len, max_num_seqs=batch)
        graphs.capture()

        def step():
            return model.compute_logits(graphs.run(ids, pos, meta.slot_mapping, meta.seq_lens, meta.block_tables))

        ms = time_ms(step, device, reps)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
                torch.cuda.synchronize()
        del graphs
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0]
    kernels.sort(key=lambda e: e.time_range.start)
    # steps are separated by the host's sync: split at the largest gaps
    gaps = sorted(range(1, len(kernels)), key=lambda i: kernels[i].time_range.start - kernels[i - 1].time_range.end)
    cuts = sorted(gaps[-(steps - 1):]) if steps > 1 else []
    per_step = [kernels[a:b] for a, b in zip([0, *cuts], [*cuts, len(kernels)])]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    summary = sorted(({"name": k[:120], "us_per_step": sum(v) / steps, "calls_per_step": len(v) / steps}
                      for k, v in by_name.items()), key=lambda r: -r["us_per_step"])
    # each kernel's share of the step's critical path under PDL: its end minus the end of the kernel before it
    # (the step's first kernel: its duration), median over its calls in all steps, and the sum a step
    inc: dict[str, list[float]] = {}
    for ks in per_step:
        for prev, e in zip([None, *ks[:-1]], ks):
            d = e.time_range.end - (prev.time_range.end if prev is not None else e.time_range.start)
            inc.setdefault(e.name, []).append(d)
    increments = sorted(({"name": k[:120], "median_us": statistics.median(v), "us_per_step": sum(v) / steps}
                         for k, v in inc.items()), key=lambda r: -r["us_per_step"])
    mid = per_step[len(per_step) // 2]
    t0 = mid[0].time_range.start
    timeline = [{"name": e.name[:80], "start_us": round(e.time_range.start - t0, 2),
                 "us": round(e.time_range.elapsed_us(), 2)} for e in mid]
    span = [s[-1].time_range.end - s[0].time_range.start for s in per_step]
    return {"variant": name, "batch": batch, "context": context, "ms": ms, "kernels_per_step": len(mid),
            "device_span_us_median": statistics.median(span), "increments": increments, "kernels": summary,
            "timeline": timeline}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-v2-lite", choices=sorted(MODELS))
    ap.add_argument("--variants", default="default,no-pdl")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", required=True)
    ap.add_argument("--git-rev", default=None)
    args = ap.parse_args()
    spec = MODELS[args.model]
    model = build_model(spec.full, torch.bfloat16, torch.device("cuda"), spec.model_type)
    rows = []
    for name in args.variants.split(","):
        row = profile_variant(model, name, args.batch, args.context, args.steps, args.reps)
        rows.append(row)
        print(f"{name}: {row['ms']:.3f} ms, {row['kernels_per_step']} kernels, device span "
              f"{row['device_span_us_median']:.0f} us", flush=True)
        for k in row["increments"][:12]:
            print(f"   {k['us_per_step']:8.1f} us a step, median {k['median_us']:6.2f} us  {k['name'][:70]}", flush=True)
    rev = args.git_rev or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True).stdout.strip()
    out = {"command": "PYTHONPATH=. python " + " ".join(sys.argv), "git_rev": rev,
           "device": torch.cuda.get_device_name(), "model": args.model, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
