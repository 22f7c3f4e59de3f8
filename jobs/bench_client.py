"""Offline throughput through a fleet (Router actor, replicas, the caller's client) against one engine in
this process, on the same seeded workload, in one run: what the distributed layer costs at scale.

    python jobs/bench_client.py                                    # GPU: Llama-3-8B shape, 500 x 1000/500
    python jobs/bench_client.py --parallel num_prefill=1 num_decode=1 num_gpus_per_replica=1   # a PD fleet
    python jobs/bench_client.py --model SmolLM2-135M-Instruct --dtype float32 --device cpu \\
        --num-prompts 16 --input-len 64 --output-len 16             # CPU, a minute

Every request arrives at time 0 with random prompt token ids, greedy, ``ignore_eos``, exactly
``--output-len`` tokens. The in-process engine is timed from its step loop (``benchlib.run_offline``);
the fleet through ``EngineClient.generate`` (TTFT when its first delta reaches the caller). Writes one
JSON under ``benchmarks/results/`` with the command, device and git revision.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.types import SamplingParams
from rayinfer.jobs import benchlib as bl
from rayinfer.placement.parallel_config import ParallelConfig


_TIMELINE_KEYS = ("role", "num_running", "num_waiting", "kv_cache_usage", "num_parked_kv", "num_prompt_tokens",
                  "num_generation_tokens", "num_steps", "step_busy_s", "num_preemptions")


async def sample_stats(client, every_s: float, timeline: list[dict], start: float) -> None:
    """Append the fleet's replica stats to ``timeline`` every ``every_s`` seconds until cancelled: where a
    topology's time goes (steps per second, tokens per step, queues, parked KV, busy fraction per replica)."""
    while True:
        await asyncio.sleep(every_s)
        try:
            stats = await client.stats()
        except Exception as e:  # noqa: BLE001 - a sample lost is not a failed run
            timeline.append({"t": round(time.perf_counter() - start, 2), "error": str(e)})
            continue
        timeline.append({"t": round(time.perf_counter() - start, 2), "replicas": [
            {k: getattr(r, k) for k in _TIMELINE_KEYS} | {"kv_transfer_bytes_received":
                                                        r.kv_transfer.get("kv_transfer_bytes_received", 0)}
            for r in stats.replicas]})


async def run_client(client, items: list[bl.WorkItem], mode: str = "stream",
                     stats_every_s: float = 0.0, timeline: list[dict] | None = None) -> bl.OfflineRun:
    """Send every item at once through the client and time each request.

    Args:
        mode: "stream" (``client.generate``: TTFT and TPOT from the deltas as they reach the caller) or
            "complete" (``client.complete``: one answer per request, as the batch job asks; latency only).
        stats_every_s, timeline: when both are given, the fleet's stats are sampled into ``timeline``.
    """
    start = time.perf_counter()
    sampler = (asyncio.get_running_loop().create_task(sample_stats(client, stats_every_s, timeline, start))
               if stats_every_s > 0 and timeline is not None else None)

    async def one(i: int, item: bl.WorkItem) -> bl.RequestTiming:
        t = bl.RequestTiming(len(item.prompt_token_ids))
        params = SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True)
        if mode == "complete":
            done = await client.complete(item.prompt_token_ids, params, f"bench-{mode}-{i}")
            if done.error:
                raise RuntimeError(f"request {i} failed: {done.error}")
            t.num_output_tokens, t.latency_s = len(done.output_token_ids), time.perf_counter() - start
            return t
        async for out in client.generate(item.prompt_token_ids, params, f"bench-{mode}-{i}"):
            if out.error:
                raise RuntimeError(f"request {i} failed: {out.error}")
            if out.new_token_ids:
                now = time.perf_counter() - start
                t.ttft_s = now if t.ttft_s is None else t.ttft_s
                t.latency_s = now
                t.num_output_tokens += len(out.new_token_ids)
        return t

    try:
        timings = await asyncio.gather(*[one(i, item) for i, item in enumerate(items)])
    finally:
        if sampler is not None:
            sampler.cancel()
    return bl.OfflineRun(list(timings), time.perf_counter() - start)


def parse_parallel(pairs: list[str]) -> dict:
    """``key=value`` pairs of ParallelConfig fields (numbers parsed as JSON)."""
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default=None, help="default: dummy for a built-in shape, else auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=500)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--parallel", nargs="*", default=[], help="ParallelConfig fields, e.g. dp=1 num_gpus_per_replica=1")
    p.add_argument("--skip-engine", action="store_true", help="measure the fleet only")
    p.add_argument("--modes", nargs="+", default=["complete", "stream"], choices=["complete", "stream"],
                   help="how the fleet is asked: complete (the batch job) and/or stream (Serve)")
    p.add_argument("--stats-every", type=float, default=0.0,
                   help="sample the replicas' stats every this many seconds into the JSON's timeline (0: off)")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--git-rev", default=None, help="revision to record (a checkout copied without .git)")
    args = p.parse_args(argv)

    from rayinfer.engine.llm_engine import resolve_device
    from rayinfer.model.loader import load_config

    device = resolve_device(args.device)
    load_format = args.load_format or ("dummy" if args.model == "llama-3-8b" else "auto")
    model = ModelConfig(args.model, dtype=args.dtype, load_format=load_format)
    engine = EngineConfig(device=args.device, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    parallel = ParallelConfig(**{"num_gpus_per_replica": 1.0 if device.type == "cuda" else 0.0,
                                 **parse_parallel(args.parallel)})
    items = bl.fixed_workload(args.num_prompts, args.input_len, args.output_len,
                              load_config(model.model).vocab_size, seed=0)
    result = {**bl.run_metadata(device, args.git_rev), "workload": {
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len},
        "engine": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
        "parallel": {"topology": parallel.topology, **parse_parallel(args.parallel)}}

    if not args.skip_engine:
        replica = bl.OfflineReplica(model, engine)
        result["engine_in_process"] = replica.run(items).summary()
        print(f"in-process engine: {result['engine_in_process']['output_tok_s']:.0f} output tok/s", flush=True)
        del replica
        bl.release_device_memory()

    import ray

    from rayinfer.actors.client import make_client

    from rayinfer.actors.cluster import init_ray

    print(init_ray(log_to_driver=False, logging_level=logging.WARNING), flush=True)
    client = make_client(model, engine, parallel)
    try:
        asyncio.run(run_client(client, items[:2]))  # warm-up: CUDA graphs, first-call paths
        for mode in args.modes:
            timeline: list[dict] = []
            run = asyncio.run(run_client(client, items, mode, args.stats_every, timeline))
            result[f"fleet_{mode}"] = fleet = run.summary()
            if timeline:
                result[f"timeline_{mode}"] = timeline
            print(f"fleet ({parallel.topology}, {mode}): {fleet['output_tok_s']:.0f} output tok/s", flush=True)
            if "engine_in_process" in result:
                ratio = fleet["output_tok_s"] / result["engine_in_process"]["output_tok_s"]
                result[f"fleet_{mode}_over_engine"] = ratio
                print(f"  / in-process engine: {ratio:.3f}", flush=True)
        result["num_preemptions"] = sum(r.num_preemptions for r in asyncio.run(client.stats()).replicas)
    finally:
        client.shutdown()

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device).lower().replace(" ", "-") if device.type == "cuda" else "cpu"
    path = out_dir / f"bench-client-{model.model.lower()}-{parallel.topology}-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
