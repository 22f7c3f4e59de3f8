"""Probe: a fleet under load loses a replica for good, and the router replaces it (``parallel.max_replacements``).

Two runs of the same seeded workload through ``make_client`` (every request at time 0, greedy, ``ignore_eos``):
one undisturbed, one in which ``--kill`` (a role's first replica: ``prefill``, ``decode`` or ``colocated``) is
ended with ``ray.kill(no_restart=True)`` ``--kill-after-s`` seconds in, as Ray's RDT ends the replicas of a
failed CUDA IPC transfer. Reports, per run, requests finished and failed (with the first errors), elapsed time
and output tok/s, with each replica's KV transfer counters (receive budget peak); for the second, when the
new actor came up, the fleet's replacement and retry counts and the streams resumed (colocated).

    PYTHONPATH=. python benchmarks/probe/replica_loss.py --parallel num_prefill=1 num_decode=1 --kill prefill \\
        --model smollm2 --load-format dummy --dtype float32 --num-prompts 300 --input-len 64 --output-len 16
    PYTHONPATH=. python benchmarks/probe/replica_loss.py --parallel dp=2 --kill colocated --mode complete ...
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import ray  # noqa: E402

from rayinfer.actors.client import make_client  # noqa: E402
from rayinfer.actors.cluster import init_ray  # noqa: E402
from rayinfer.engine.config import EngineConfig, ModelConfig  # noqa: E402
from rayinfer.engine.llm_engine import resolve_device  # noqa: E402
from rayinfer.engine.types import SamplingParams  # noqa: E402
from rayinfer.jobs import benchlib as bl  # noqa: E402
from rayinfer.jobs.bench_client import parse_parallel  # noqa: E402
from rayinfer.model.loader import load_config  # noqa: E402
from rayinfer.placement.parallel_config import ParallelConfig  # noqa: E402


async def _one(client, i: int, item: bl.WorkItem, mode: str) -> tuple[int, str | None]:
    """(output tokens, error or None) of one request."""
    params = SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True)
    try:
        if mode == "complete":
            done = await client.complete(item.prompt_token_ids, params, f"loss-{i}")
            return len(done.output_token_ids), done.error
        n = 0
        async for out in client.generate(item.prompt_token_ids, params, f"loss-{i}"):
            if out.error:
                return n, out.error
            n += len(out.new_token_ids)
        return n, None
    except Exception as e:  # noqa: BLE001 - a failed request is what this probe counts
        return 0, f"{type(e).__name__}: {e}"


async def _watch(client, index: int, old_id: str, start: float, out: dict) -> None:
    """Record when the fleet's actor at ``index`` is a new one (the replacement is up)."""
    while True:
        await asyncio.sleep(0.25)
        replicas = await client.router.replicas.remote()
        if replicas[index]._actor_id.hex() != old_id:
            out["replaced_at_s"] = round(time.perf_counter() - start, 2)
            return


def run(client, items: list[bl.WorkItem], mode: str, kill: str | None, kill_after_s: float) -> dict:
    async def main() -> dict:
        result: dict = {}
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(_one(client, i, it, mode)) for i, it in enumerate(items)]
        watcher = None
        if kill is not None:
            info = client.info
            index = info.num_prefill if kill == "decode" else 0
            await asyncio.sleep(kill_after_s)
            victim = info.replicas[index]
            result["killed"] = f"{kill} replica 0"
            result["killed_at_s"] = round(time.perf_counter() - start, 2)
            result["done_when_killed"] = sum(t.done() for t in tasks)
            ray.kill(victim, no_restart=True)
            watcher = asyncio.ensure_future(_watch(client, index, victim._actor_id.hex(), start, result))
        outs = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        if watcher is not None:
            await asyncio.wait_for(watcher, 600)
        errors = [e for _, e in outs if e is not None]
        tokens = sum(n for n, e in outs if e is None)
        stats = await client.stats()
        return {"num_requests": len(items), "num_finished": len(items) - len(errors), "num_failed": len(errors),
                "first_errors": sorted(set(errors))[:3], "elapsed_s": round(elapsed, 2),
                "output_tok_s": round(tokens / elapsed, 2), "num_replacements": stats.num_replacements,
                "num_retries": stats.num_retries, "num_resumed": getattr(client, "num_resumed", 0),
                "kv_transfer": [{"role": r.role, **r.kv_transfer} for r in stats.replicas if r.kv_transfer],
                # PD: whether the router still lets KV move by device, and the device transfers it saw fail
                "kv_device_transfers": stats.kv_device_transfers,
                "num_kv_device_failures": stats.num_kv_device_failures,
                **result}

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--parallel", nargs="*", default=["num_prefill=1", "num_decode=1"],
                    help="ParallelConfig fields, e.g. dp=2 or num_prefill=1 num_decode=1 num_gpus_per_replica=0.5")
    ap.add_argument("--engine", nargs="*", default=[], help="EngineConfig fields, e.g. gpu_memory_utilization=0.4")
    ap.add_argument("--kill", choices=["prefill", "decode", "colocated"], default="prefill")
    ap.add_argument("--kill-after-s", type=float, default=10.0)
    ap.add_argument("--mode", choices=["stream", "complete"], default="stream")
    ap.add_argument("--log-to-driver", action="store_true", help="show the actors' logs (warnings and errors)")
    ap.add_argument("--git-rev", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = ModelConfig(args.model, args.dtype, args.load_format)
    engine = EngineConfig(device=args.device, **parse_parallel(args.engine))
    parallel = ParallelConfig(**parse_parallel(args.parallel))
    items = bl.fixed_workload(args.num_prompts, args.input_len, args.output_len, load_config(model.model).vocab_size, 0)
    print(init_ray(log_to_driver=args.log_to_driver, logging_level=logging.WARNING), flush=True)
    result = {**bl.run_metadata(resolve_device(args.device), args.git_rev), "parallel": args.parallel,
              "engine": args.engine, "workload": f"{args.num_prompts} x {args.input_len}/{args.output_len}",
              "mode": args.mode, "runs": {}}
    for label, kill in (("undisturbed", None), ("replica_lost", args.kill)):
        client = make_client(model, engine, parallel)
        try:
            run(client, items[:1], args.mode, None, 0.0)  # warm-up
            result["runs"][label] = r = run(client, items, args.mode, kill, args.kill_after_s)
            print(label, json.dumps(r), flush=True)
            bl.emit_json(result, args.out, echo=False)  # each run as it ends: a cut-off probe keeps the first
        finally:
            client.shutdown()
            bl.release_device_memory()
    bl.emit_json(result, args.out)


if __name__ == "__main__":
    main()
