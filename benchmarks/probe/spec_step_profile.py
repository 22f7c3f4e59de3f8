"""Probe: where a speculative engine's step spends its wall time, host against device (torch.profiler).

Runs the speculative bench's workload (``jobs/bench_spec.py``) through ``LLMEngine.step()`` on one engine: a
warm-up run, then one run under ``torch.profiler``. Prints per step the wall time, the device's busy time (the
union of the kernels' intervals, so overlapping streams count once) and so the time the device sat idle, then the
operations with the most host time and the kernels with the most device time. With ``--method none`` it is the
same workload without speculation, the baseline. ``--cprofile`` profiles the run with cProfile instead: the
Python functions' cumulative host time a step (what torch.profiler, recording only torch ops, does not show).
``--phases`` times the engine's phases instead (host wall time a step in each, nested phases inclusive; with
little overhead, so the wall time is the engine's): planning, launching (the graph replay, sampling), processing a
step (``device wait``: the host blocked on a step's event), the proposer's drafting and lookups.

    python benchmarks/probe/spec_step_profile.py --method ngram --batch 1
    python benchmarks/probe/spec_step_profile.py --method none --batch 1 --out /tmp/p.json

``steps`` and ``tokens`` count the profiled run; ``stats`` are the engine's counters over the warm-up run and the
profiled one together.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rayinfer.engine.config import EngineConfig, ModelConfig, SpeculativeConfig  # noqa: E402
from rayinfer.engine.llm_engine import LLMEngine  # noqa: E402
from rayinfer.jobs import benchlib as bl  # noqa: E402
from rayinfer.jobs.bench_spec import spec_workload  # noqa: E402


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


# (object path from the engine, method, label): what --phases times
PHASES = [("", "_flush_gate_sample", "gate accounting"), ("", "_step_chained", "chained step (whole)"),
          ("", "_propose", "drafting (host)"), ("", "_look_for_drafts", "plain-step lookups"),
          ("", "_process", "processing a step"), ("scheduler", "schedule", "schedule"),
          ("scheduler", "schedule_chained", "schedule_chained"), ("scheduler", "update_from_output", "update_from_output"),
          ("runner", "execute_async", "launch (whole)"), ("runner", "_upload", "upload"), ("runner", "_download", "download"),
          ("runner", "finish", "finish (incl. device wait)"), ("runner.graphs", "run", "graph replay + inputs"),
          ("runner.sampler", "sample", "sampling (launch)"), ("runner.model", "compute_logits", "LM head (launch)"),
          ("proposer", "propose", "proposer.propose"), ("proposer", "launch_drafts", "proposer.launch_drafts"),
          ("proposer", "take_chained", "proposer.take_chained")]


def time_phases(engine: LLMEngine) -> dict[str, float]:
    """Wrap the methods of :data:`PHASES` (those the engine has) and the CUDA events' ``synchronize`` with
    perf_counter timers; returns the dict the seconds accumulate in, by label (``device wait``: the event waits)."""
    import functools

    total: dict[str, float] = {}

    def timed(fn, label):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                total[label] = total.get(label, 0.0) + time.perf_counter() - t
        return wrapper

    for path, name, label in PHASES:
        obj = engine
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, name):
            setattr(obj, name, timed(getattr(obj, name), label))
    if torch.cuda.is_available():
        torch.cuda.Event.synchronize = timed(torch.cuda.Event.synchronize, "device wait")  # type: ignore[method-assign]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model name or a built-in shape (e.g. smollm2-135m, llama-tiny)")
    ap.add_argument("--load-format", default="auto", help="auto: the model's weights; dummy: random ones")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype (float32 on a CPU)")
    ap.add_argument("--method", default="ngram", choices=["ngram", "draft_model", "mtp", "none"],
                    help="engine.speculative.method (none: plain decoding, the baseline)")
    ap.add_argument("--schedule", default="fixed", choices=["fixed", "confidence"], help="engine.speculative.schedule")
    ap.add_argument("--ngram-on-device", action="store_true",
                    help="engine.speculative.ngram_on_device: chain n-gram verification steps (needs graphs)")
    ap.add_argument("--num-draft-tokens", type=int, default=4, help="engine.speculative.num_draft_tokens (k)")
    ap.add_argument("--batch", type=int, default=1, help="requests at once (the workload's prompts)")
    ap.add_argument("--output-len", type=int, default=128, help="tokens each request generates")
    ap.add_argument("--num-kv-blocks", type=int, default=8192, help="KV-cache blocks")
    ap.add_argument("--device", default="auto", help="cuda, cpu, or auto")
    ap.add_argument("--debug-eager-graphs", action="store_true",
                    help="off CUDA: run decode steps through the graphs' padded buffers, pipelined, so steps chain as on a GPU "
                    "(host work on a CPU, e.g. --model llama-tiny --load-format dummy --dtype float32 --device cpu)")
    ap.add_argument("--top", type=int, default=15, help="rows of each table (torch.profiler mode)")
    ap.add_argument("--cprofile", action="store_true", help="cProfile's Python functions instead of torch ops")
    ap.add_argument("--phases", action="store_true",
                    help="instead: the host time per step spent in each engine phase (its 'stats' count the "
                    "warm-up run too)")
    ap.add_argument("--out", default=None, help="also write the result as JSON here")
    ap.add_argument("--git-rev", default=None, help="the code's revision, recorded in the JSON")
    args = ap.parse_args()

    sc = SpeculativeConfig(method=args.method, schedule=args.schedule, num_draft_tokens=args.num_draft_tokens,
                           ngram_on_device=args.ngram_on_device)
    engine = LLMEngine(ModelConfig(model=args.model, load_format=args.load_format, dtype=args.dtype),
                       EngineConfig(device=args.device, max_num_seqs=args.batch, num_kv_blocks=args.num_kv_blocks,
                                    speculative=sc, debug_eager_graphs=args.debug_eager_graphs,
                                    async_scheduling=True if args.debug_eager_graphs else None))
    items = spec_workload(engine.tokenizer, args.batch, args.output_len)
    bl.run_offline(engine, items, request_prefix="warm")
    steps = [0]
    step = engine.step

    def counted_step():
        steps[0] += 1
        return step()

    engine.step = counted_step  # type: ignore[method-assign]

    def profiled_run():
        """The workload once more: (its result, steps, output tokens)."""
        res = bl.run_offline(engine, items, request_prefix="prof")
        return res, max(steps[0], 1), sum(t.num_output_tokens for t in res.timings)

    def write(payload: dict) -> None:
        if args.out:
            bl.emit_json({**bl.run_metadata(engine.device, args.git_rev), "command": "python " + " ".join(sys.argv),
                          "args": vars(args), **payload}, args.out, echo=False)
            print(f"wrote {args.out}")

    if args.phases:
        phases = time_phases(engine)
        res, n, tokens = profiled_run()
        summary = {"steps": n, "tokens": tokens, "wall_ms_per_step": res.elapsed_s * 1e3 / n,
                   "phases_ms_per_step": {k: round(v * 1e3 / n, 4) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])},
                   "stats": {k: v for k, v in engine.stats().items() if k.startswith("spec_")}}
        print(json.dumps(summary, indent=1))
        write(summary)
        return
    if args.cprofile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        res, n, tokens = profiled_run()
        prof.disable()
        print({"steps": n, "tokens": tokens, "wall_ms_per_step": res.elapsed_s * 1e3 / n})
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(r"rayinfer|engine/|kernels/|triton|torch/cuda", 45)
        text = buf.getvalue()
        print(text)
        write({"steps": n, "wall_ms_per_step": res.elapsed_s * 1e3 / n, "cprofile": text})
        return
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        res, n, tokens = profiled_run()
    kernels = [e for e in prof.events() or () if e.device_type == torch.profiler.DeviceType.CUDA]
    dev_us = busy_us([(e.time_range.start, e.time_range.end) for e in kernels])
    avg = prof.key_averages()
    host = sorted(avg, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    dev = sorted(avg, key=lambda e: e.self_device_time_total, reverse=True)[:args.top]
    summary = {"steps": n, "tokens": tokens, "wall_ms_per_step": res.elapsed_s * 1e3 / n,
               "device_busy_ms_per_step": dev_us / 1e3 / n, "tokens_per_step": tokens / n,
               "output_tok_s": tokens / res.elapsed_s}
    print(summary)
    print("host (self CPU ms a step):")
    for e in host:
        print(f"  {e.self_cpu_time_total / 1e3 / n:8.3f}  x{e.count / n:6.1f}  {e.key[:100]}")
    print("device (self device ms a step):")
    for e in dev:
        if e.self_device_time_total:
            print(f"  {e.self_device_time_total / 1e3 / n:8.3f}  x{e.count / n:6.1f}  {e.key[:100]}")
    write({"summary": summary,
           "host_top": [[e.key, e.self_cpu_time_total / 1e3 / n, e.count / n] for e in host],
           "device_top": [[e.key, e.self_device_time_total / 1e3 / n, e.count / n] for e in dev]})

if __name__ == "__main__":
    main()
