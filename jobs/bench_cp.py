"""TTFT of one long prompt with context-parallel prefill (``parallel.cp``) against one rank, through the
real fleet (Router, EngineActor rank 0, CP peers; ``rayinfer.engine.context_parallel``).

Usage::

    python jobs/bench_cp.py                                  # GPUs: llama-3-8b shape, dummy bf16, 32K tokens, cp 1 2
    python jobs/bench_cp.py --cp 1 2 4 8 --tokens 16384 65536
    python jobs/bench_cp.py --device cpu --model llama-tiny --tokens 2048 --cp 1 2   # CPU smoke run, seconds

For each cp size a fleet of one replica (cp ranks, one GPU each on "cuda") is started; each prompt
length is measured ``--repeats`` times after one warm-up request (fresh random prompts: no prefix-cache
hits), TTFT being the time from submitting the request to its first token at the client. Prints one JSON
object (command, device, git revision, the medians per cp and length, the speed-up against the smallest
cp, and each length's prefill against its FLOP roofline: the prompt's matmul FLOPs, causal attention
included, over ``cp`` times the measured bf16 matmul rate of one device) and writes it to ``--out`` when
given. ``cp_min_tokens`` is set to 1 so every prompt uses CP.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import torch


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", help="a built-in shape (load_format=dummy) or a checkpoint dir")
    p.add_argument("--load-format", default=None, help="default: dummy for a built-in shape, else auto")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=float, default=None, help="CPU: the KV pool's size (default 1 GiB)")
    p.add_argument("--ray-address", default="local",
                   help='"local" (default): a new embedded Ray cluster; "auto" or host:port: join that one')
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


async def _ttft(client, prompt: list[int]) -> float:
    from rayinfer.engine.types import SamplingParams

    start = time.perf_counter()
    first = None
    async for out in client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)):
        if out.error is not None:
            raise RuntimeError(out.error)
        if first is None and out.new_token_ids:
            first = time.perf_counter() - start
    assert first is not None
    return first


def run(args: argparse.Namespace) -> dict:
    """Measure every (cp, tokens) pair; returns the result object (see the module docstring)."""
    import ray

    from rayinfer.actors.client import make_client
    from rayinfer.actors.cluster import RayConfig, init_ray
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.jobs.benchlib import run_metadata
    from rayinfer.model.shapes import shape_name
    from rayinfer.placement.parallel_config import ParallelConfig

    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = "cuda" if on_cuda else "cpu"
    is_shape = shape_name(args.model) is not None
    load_format = args.load_format or ("dummy" if is_shape else "auto")
    dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    max_len = max(args.tokens) + 16
    model = ModelConfig(args.model, dtype=dtype, load_format=load_format, max_model_len=max_len)
    engine = EngineConfig(device=device, block_size=args.block_size, max_num_seqs=4, max_num_batched_tokens=max_len,
                          kv_cache_memory_gib=args.kv_cache_gib or 1.0)  # the CPU pool's size (GPU: from memory)
    embedded = args.ray_address == "local"
    init_ray(RayConfig(address=args.ray_address),
             num_cpus=max(os.cpu_count() or 1, max(args.cp) + 1) if embedded else None, log_to_driver=False)
    vocab = 1000  # token ids below every model's vocabulary
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    for cp in args.cp:
        parallel = ParallelConfig(cp=cp, cp_min_tokens=1, num_gpus_per_replica=1.0 if on_cuda else 0.0,
                                  num_cpus_per_replica=1)
        client = make_client(model, engine, parallel)
        try:
            asyncio.run(_ttft(client, torch.randint(0, vocab, (min(args.tokens),), generator=gen).tolist()))
            for n in args.tokens:
                times = [asyncio.run(_ttft(client, torch.randint(0, vocab, (n,), generator=gen).tolist()))
                         for _ in range(args.repeats)]
                results.setdefault(str(n), {})[f"cp{cp}"] = statistics.median(times)
        finally:
            client.shutdown()
    base = f"cp{min(args.cp)}"
    speedup = {n: {k: r[base] / v for k, v in r.items()} for n, r in results.items()}
    meta = run_metadata(torch.device("cuda" if on_cuda else "cpu"))
    ray.shutdown()
    return {**meta, "model": args.model, "load_format": load_format, "dtype": dtype, "repeats": args.repeats,
            "ttft_s": results, "speedup_vs_" + base: speedup,
            **_roofline(model, torch.device(device), getattr(torch, dtype), results)}


def _roofline(model, device: torch.device, dtype: torch.dtype, results: dict) -> dict:
    """Each length's prefill FLOPs (``jobs/roofline.py``'s cost model of the architecture), the measured
    matmul rate of one device, and per cp the TTFT's share of the FLOP roofline on cp devices."""
    from rayinfer.jobs import roofline as rl
    from rayinfer.model.loader import load_config

    cost = rl.cost_model_for(load_config(model.model), dtype.itemsize)
    ceil = rl.measure_ceilings(device, dtype, 256 << 20 if device.type == "cuda" else 16 << 20,
                               8192 if device.type == "cuda" else 512)
    flops = {n: rl.prefill_cost(cost, int(n))[1] for n in results}
    pct = {n: {k: 100 * flops[n] / (int(k.removeprefix("cp")) * ceil["matmul_flops"]) / t for k, t in r.items()}
           for n, r in results.items()}
    return {"prefill_flops": flops, "matmul_tflops_per_device": ceil["matmul_flops"] / 1e12,
            "pct_of_flop_roofline": pct}


def main(argv=None) -> None:
    from rayinfer.jobs.benchlib import emit_json

    args = _args(argv)
    emit_json(run(args), args.out)


if __name__ == "__main__":
    main()
