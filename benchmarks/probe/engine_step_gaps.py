"""Probe: where the engine's batch-1 decode step spends device time outside its kernels.

Runs one request through ``LLMEngine.step()`` (the engine's own pipelined loop, dummy weights), and once it
decodes, records ``--steps`` steps under ``torch.profiler``. From the device timeline it reports the step
period, the kernels' busy time, and the idle gaps between consecutive device operations, summed by the pair
of operations around them (e.g. the graph's last kernel and the next memcpy), so a gap the host or a launch
boundary causes shows by name. It also reports how long before its first kernel each ``cudaGraphLaunch``
was issued: a launch that comes after the device went idle means the host is on the critical path.

    PYTHONPATH=. python benchmarks/probe/engine_step_gaps.py --out /tmp/gaps.json
    PYTHONPATH=. python benchmarks/probe/engine_step_gaps.py --fused-inputs 0 --side-stream-copies 0 --out /tmp/b.json
"""
import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rayinfer.engine.config import EngineConfig, ModelConfig  # noqa: E402
from rayinfer.engine.llm_engine import LLMEngine  # noqa: E402
from rayinfer.engine.types import SamplingParams  # noqa: E402
from rayinfer.jobs import benchlib as bl  # noqa: E402

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def timeline(trace: dict) -> tuple[list[dict], list[dict]]:
    """Device operations and host graph launches of a Chrome trace, each sorted by start (us)."""
    dev, launches = [], []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        if e.get("cat") in DEVICE_CATS:
            dev.append({"name": e["name"][:80], "ts": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"]),
                        "corr": e.get("args", {}).get("correlation")})
        elif e.get("cat") == "cuda_runtime" and "GraphLaunch" in e["name"]:
            launches.append({"ts": float(e["ts"]), "corr": e.get("args", {}).get("correlation")})
    dev.sort(key=lambda d: d["ts"])
    launches.sort(key=lambda d: d["ts"])
    return dev, launches


def analyse(dev: list[dict], launches: list[dict], steps: int, min_gap_us: float) -> dict:
    span = dev[-1]["end"] - dev[0]["ts"]
    busy, gaps = 0.0, collections.Counter()
    counts: collections.Counter = collections.Counter()
    last_end = dev[0]["ts"]
    prev = "start"
    for d in dev:
        gap = d["ts"] - last_end
        if gap >= min_gap_us:
            gaps[(prev, d["name"])] += gap
            counts[(prev, d["name"])] += 1
        busy += max(0.0, d["end"] - max(d["ts"], last_end))
        if d["end"] >= last_end:
            last_end, prev = d["end"], d["name"]
    by_corr: dict = {}
    for d in dev:  # the first device op of each correlation id
        if d["corr"] is not None:
            by_corr.setdefault(d["corr"], d)
    lead = []  # per graph launch: its first kernel's start minus the launch call's start (us)
    for launch in launches:
        first = by_corr.get(launch["corr"])
        if first is None:  # graph kernels carry the launch's correlation id in recent torch; else the next op
            first = next((d for d in dev if d["ts"] >= launch["ts"]), None)
        if first is not None:
            lead.append(first["ts"] - launch["ts"])
    rows = [{"before": a, "after": b, "us_per_step": g / steps, "count_per_step": counts[(a, b)] / steps}
            for (a, b), g in gaps.most_common(20)]
    return {"steps": steps, "period_us": span / steps, "busy_us": busy / steps, "idle_us": (span - busy) / steps,
            "graph_launch_lead_us": sorted(lead), "gaps": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v2-lite-v3arch")
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--warm-steps", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--min-gap-us", type=float, default=0.5)
    ap.add_argument("--fused-inputs", type=int, choices=(0, 1), default=None,
                    help="1: a replay's inputs go into the graph's buffers in one launch, 0: by torch ops "
                         "(cuda_graph.FUSED_INPUTS; default: the engine's)")
    ap.add_argument("--side-stream-copies", type=int, choices=(0, 1), default=None,
                    help="1: the step's upload and download on copy streams, 0: on the compute stream "
                         "(RAYINFER_SIDE_STREAM_COPIES; default: the engine's)")
    ap.add_argument("--git-rev", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from rayinfer import envs
    from rayinfer.engine import cuda_graph

    if args.side_stream_copies is not None:
        os.environ["RAYINFER_SIDE_STREAM_COPIES"] = str(args.side_stream_copies)
    if args.fused_inputs is not None:
        cuda_graph.FUSED_INPUTS = args.fused_inputs

    engine = LLMEngine(ModelConfig(args.model, "bfloat16", "dummy", max_model_len=8192), EngineConfig())
    engine.add_request("p", list(range(1, args.input_len + 1)),
                       SamplingParams(max_tokens=args.warm_steps + args.steps + 16, ignore_eos=True, temperature=0.0))
    for _ in range(args.warm_steps):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        dev, launches = timeline(json.loads(path.read_text()))
    result = analyse(dev, launches, args.steps, args.min_gap_us)
    result["host_wall_us_per_step"] = wall / args.steps * 1e6
    result = {**bl.run_metadata(torch.device("cuda"), args.git_rev), "model": args.model,
              "fused_inputs": bool(cuda_graph.FUSED_INPUTS), "side_stream_copies": envs.side_stream_copies(), **result}
    lead = result["graph_launch_lead_us"]
    print(f"period {result['period_us']:.1f} us/step, busy {result['busy_us']:.1f}, idle {result['idle_us']:.1f}; "
          f"host {result['host_wall_us_per_step']:.1f} us/step under the profiler; graph launch lead (us) "
          f"min {lead[0] if lead else 'n/a'} median {lead[len(lead) // 2] if lead else 'n/a'}")
    for r in result["gaps"]:
        print(f"  {r['us_per_step']:8.2f} us x{r['count_per_step']:4.1f}  {r['before'][:50]} -> {r['after'][:50]}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
