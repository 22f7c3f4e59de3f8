"""Where a step's time goes: device kernels of one decode step, and host time of the offline loop.

    python jobs/profile_step.py                                  # llama-3-8b dummy bf16 on the GPU
    python jobs/profile_step.py --batches 1 256 --offline-prompts 300 --out /tmp/prof.json
    python jobs/profile_step.py --model llama-tiny --device cpu --batches 1 8 --offline-prompts 16

For each batch size it replays the engine's decode CUDA graph (eager on CPU) under ``torch.profiler``
and prints the kernels by total device time, with their count per step: the gap between the kernel sum
and the step's wall time is launch and idle time. Then it runs an offline workload through
``LLMEngine.step`` under ``cProfile`` and prints the host functions by own time, and how long the host
waited for the device (``Event.synchronize``): a loop that never waits is bound by the host.
Results also go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.jobs import benchlib as bl


def kernel_table(model, kv_cache, graphs, batch: int, context: int, steps: int = 5, top: int = 25) -> dict:
    """Profile ``steps`` decode steps of ``batch`` requests at ``context`` tokens; kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    block_size = graphs.block_size if graphs is not None else 16
    tables, _ = bl.decode_block_tables(batch, context, block_size, kv_cache.shape[1])
    gen = torch.Generator().manual_seed(0)
    ids, pos, meta = bl._step_inputs([1] * batch, [context] * batch, tables, block_size, model.config.vocab_size,
                                     kv_cache.device, gen)
    use_graph = graphs is not None and graphs.padded_size(batch) is not None

    def step():
        if use_graph:
            hidden = graphs.run(ids, pos, meta.slot_mapping, meta.seq_lens, meta.block_tables)
        else:
            hidden = model(ids, pos, kv_cache, meta)
        return model.compute_logits(hidden)

    wall = bl.time_fn(step, kv_cache.device, 3, 10)
    cuda = kv_cache.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", 0) if cuda else e.self_cpu_time_total
        if dev_us <= 0 or (cuda and e.device_type.name != "CUDA"):
            continue
        rows.append({"name": e.key[:90], "count_per_step": e.count / steps, "us_per_step": dev_us / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    kernel_us = sum(r["us_per_step"] for r in rows)
    out = {"batch": batch, "context": context, "path": "cuda_graph" if use_graph else "eager",
           "wall_ms": statistics.median(wall) * 1e3, "kernel_ms": kernel_us / 1e3,
           "kernels_per_step": sum(r["count_per_step"] for r in rows), "top": rows[:top]}
    print(f"\n== decode B={batch} ctx={context} ({out['path']}): wall {out['wall_ms']:.3f} ms, kernels "
          f"{out['kernel_ms']:.3f} ms, {out['kernels_per_step']:.0f} kernels/step")
    for r in rows[:top]:
        print(f"  {r['us_per_step']:9.1f} us  x{r['count_per_step']:6.1f}  {r['name']}")
    return out


def host_profile(engine, num_prompts: int, input_len: int, output_len: int, top: int = 30) -> dict:
    """Offline workload under cProfile: host functions by own time, and time spent waiting on the device."""
    items = bl.fixed_workload(num_prompts, input_len, output_len, engine.vocab_size, seed=0)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    run = bl.run_offline(engine, items, request_prefix="prof")
    prof.disable()
    elapsed = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    rows, wait_s = [], 0.0
    for (file, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
        if "synchronize" in name:  # Event.synchronize / torch.cuda.synchronize: the host waiting
            wait_s += tt
        rows.append({"fn": f"{file.split('/')[-1]}:{line}:{name}"[:100], "calls": nc, "tottime_s": tt,
                     "cumtime_s": ct})
    rows.sort(key=lambda r: -r["tottime_s"])
    summary = run.summary()
    out = {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "elapsed_s": elapsed,
           "num_steps": run.num_steps, "host_ms_per_step": (elapsed - wait_s) / max(run.num_steps, 1) * 1e3,
           "device_wait_s": wait_s, "output_tok_s": summary["output_tok_s"], "top": rows[:top]}
    print(f"\n== offline {num_prompts} x {input_len}/{output_len}: {elapsed:.1f} s under cProfile, "
          f"{run.num_steps} steps, {summary['output_tok_s']:.0f} out tok/s, waited on the device "
          f"{wait_s:.1f} s, host {out['host_ms_per_step']:.2f} ms/step")
    for r in rows[:top]:
        print(f"  {r['tottime_s']:8.3f} s own {r['cumtime_s']:8.3f} s cum  {r['calls']:8d}  {r['fn']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--offline-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from rayinfer.engine.llm_engine import LLMEngine

    from rayinfer.model.loader import load_config

    max_len = min(8192, load_config(args.model).max_position_embeddings)
    engine = LLMEngine(ModelConfig(args.model, args.dtype, "dummy", max_model_len=max_len),
                       EngineConfig(device=args.device, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens))
    bl.warm_up(engine, engine.engine_config.block_size)
    graphs = getattr(engine.runner, "graphs", None)
    result = {**bl.run_metadata(engine.device), "args": vars(args), "decode": [], "offline": None}
    with torch.inference_mode():
        for b in args.batches:
            result["decode"].append(kernel_table(engine.model, engine.kv_cache, graphs, b, args.context))
    if args.offline_prompts:
        result["offline"] = host_profile(engine, args.offline_prompts, args.input_len, args.output_len)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
