"""Vision-encoder benchmark: (a) the encoder's throughput against its latency by batch size (DeepSeek's
encoder Pareto curve), and (b) time to first token (TTFT) of an image-heavy workload with encode / prefill /
decode disaggregation (``parallel=epd``) against colocated replicas that encode their own images.

Usage::

    python jobs/bench_encoder.py --device cpu --model llava-tiny              # CPU smoke run, seconds
    # GPU, LLaVA-1.5 layout (CLIP ViT-L/14-336 + a ~1.1B Llama decoder), dummy bf16 weights:
    python jobs/bench_encoder.py --model llava-clip-l-1b --part pareto       # (a) only, one GPU
    python jobs/bench_encoder.py --model llava-clip-l-1b                     # (a) and (b); (b) needs 3 GPUs
    python jobs/bench_encoder.py --model llava-clip-l-1b --part ttft --gpus-per-replica 0.3 \\
        --gpu-memory-utilization 0.25                                       # (b) with E, P, D on one GPU

(a) ``pareto``: the model's ``encode_images`` alone, in this process (no Ray), on random pixels, for each
``--batch-sizes`` (default 1 2 4 8 16 32): ``--repeats`` timed calls after one warm-up; reports the p50
latency per batch and images/s = batch / p50 latency.

(b) ``ttft``: ``--requests`` requests (default 64) arrive at once, each one image and a short prompt of
``--prompt-tokens`` random text tokens around its placeholders, asking ``--max-tokens`` tokens; every
``--repeat-every``-th request reuses an earlier image (encoder-cache and prefix-cache hits). The same
workload runs on two fleets, one after the other: ``colocated`` (one NORMAL replica that encodes its own
images) and ``epd`` (``--encoders`` EncoderActors + 1 prefill + 1 decode replica; one ``epd-<transport>`` fleet
per ``--encoder-transports`` entry when several are given: how embeddings reach the prefill replica). Reports TTFT p50 / p90 /
mean and the wall time per fleet, plus the encoder counters (images encoded and cache hits, on the
encoders and on the prefill replica, which must encode none).

Prints one JSON object (command, device, git revision via ``jobs/benchlib.run_metadata``, the model,
both parts) and writes it to ``--out`` when given. Built-in shapes load with ``load_format=dummy``.
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
    p.add_argument("--model", default="llava-clip-l-1b", help="a built-in LLaVA shape (dummy weights) or a LLaVA dir")
    p.add_argument("--load-format", default=None, help="default: dummy for a built-in shape, else auto")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--part", default="both", choices=["both", "pareto", "ttft"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--repeat-every", type=int, default=4, help="every n-th request reuses an earlier image (0: never)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--encoders", type=int, default=1)
    p.add_argument("--encoder-transports", nargs="+", default=["auto"],
                   help="EPD fleets to run, one per encoder.transport (object_store, cuda_ipc, auto)")
    p.add_argument("--gpus-per-replica", type=float, default=1.0, help="GPUs of each replica and encoder (cuda)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--ray-address", default="local",
                   help='"local" (default): a new embedded Ray cluster; "auto" or host:port: join that one')
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def encoder_pareto(model, batch_sizes: list[int], repeats: int, device: torch.device) -> list[dict]:
    """p50 latency (s) and images/s of ``model.encode_images`` at each batch size (random pixels)."""
    size = model.image_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batch_sizes:
        pixels = torch.randn(b, 3, size, size, generator=gen).to(device)
        times = []
        with torch.inference_mode():
            for i in range(repeats + 1):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                model.encode_images(pixels)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i:  # the first call warms up
                    times.append(time.perf_counter() - start)
        p50 = statistics.median(times)
        rows.append({"batch_size": b, "p50_latency_s": p50, "images_per_s": b / p50})
    return rows


def image_workload(num_requests: int, repeat_every: int, prompt_tokens: int, image_size: int, num_image_tokens: int,
                   patch_size: int, image_token_id: int, seed: int = 0):
    """``num_requests`` (prompt token ids, [MultiModalInput]) pairs: random text around one image's
    placeholders; every ``repeat_every``-th request reuses an earlier request's image."""
    from rayinfer.engine.multimodal import hash_pixel_values
    from rayinfer.engine.types import MultiModalInput

    gen = torch.Generator().manual_seed(seed)
    images: list[torch.Tensor] = []
    out = []
    for i in range(num_requests):
        if repeat_every and i % repeat_every == repeat_every - 1 and images:
            pixels = images[int(torch.randint(0, len(images), (1,), generator=gen))]
        else:
            pixels = torch.randn(3, image_size, image_size, generator=gen)
            images.append(pixels)
        head = torch.randint(3, 1000, (prompt_tokens // 4,), generator=gen).tolist()
        tail = torch.randint(3, 1000, (prompt_tokens - len(head),), generator=gen).tolist()
        prompt = [1] + head + [image_token_id] * num_image_tokens + tail
        mm = MultiModalInput(hash_pixel_values(pixels), 1 + len(head), num_image_tokens, pixel_values=pixels,
                             num_patches=(image_size // patch_size) ** 2)
        out.append((prompt, [mm]))
    return out


async def _burst(client, workload, max_tokens: int) -> tuple[list[float], float]:
    """Send every request at once; returns (TTFT of each, wall seconds until the last finished)."""
    from rayinfer.engine.types import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()

    async def one(prompt, mm):
        first = None
        async for out in client.generate(prompt, params, mm_inputs=mm):
            if out.error is not None:
                raise RuntimeError(out.error)
            if first is None and out.new_token_ids:
                first = time.perf_counter() - start
        assert first is not None
        return first

    ttfts = await asyncio.gather(*[one(p, mm) for p, mm in workload])
    return list(ttfts), time.perf_counter() - start


def ttft_compare(args, model_config, engine_config, net, on_cuda: bool) -> dict:
    """Run the image workload on the colocated fleet, then on the EPD fleet (see the module docstring)."""
    from rayinfer.actors.client import make_client
    from rayinfer.jobs.benchlib import percentile
    from rayinfer.placement.parallel_config import EncoderSection, ParallelConfig

    workload = image_workload(args.requests, args.repeat_every, args.prompt_tokens, net.image_size,
                              net.num_image_tokens, net.patch_size, net.image_token_id)
    warm = image_workload(2, 0, args.prompt_tokens, net.image_size, net.num_image_tokens, net.patch_size,
                          net.image_token_id, seed=1)
    gpus = args.gpus_per_replica if on_cuda else 0.0
    fleets = {"colocated": ParallelConfig(num_cpus_per_replica=1, num_gpus_per_replica=gpus)}
    for transport in args.encoder_transports:
        name = "epd" if len(args.encoder_transports) == 1 else f"epd-{transport}"
        fleets[name] = ParallelConfig(num_prefill=1, num_decode=1, num_cpus_per_replica=1, num_gpus_per_replica=gpus,
                                      encoder=EncoderSection(num_encoders=args.encoders, transport=transport))
    out = {}
    for name, parallel in fleets.items():
        client = make_client(model_config, engine_config, parallel)
        try:
            asyncio.run(_burst(client, warm, 2))  # loads, first-call costs
            ttfts, wall = asyncio.run(_burst(client, workload, args.max_tokens))
            stats = asyncio.run(client.stats())
        finally:
            client.shutdown()
        engines = {r.role: {"num_encoder_runs": r.num_encoder_runs, "encoder_cache_hits": r.encoder_cache_hits}
                   for r in stats.replicas}
        out[name] = {"ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
                     "ttft_mean_s": statistics.fmean(ttfts), "wall_s": wall, "engines": engines,
                     "encoders": [{"num_images": e.num_images, "num_encoder_runs": e.num_encoder_runs,
                                   "encoder_cache_hits": e.encoder_cache_hits, "num_batches": e.num_batches}
                                  for e in stats.encoders]}
    return {"requests": args.requests, "repeat_every": args.repeat_every, "prompt_tokens": args.prompt_tokens,
            "image_tokens": net.num_image_tokens, "max_tokens": args.max_tokens, "encoders": args.encoders,
            "gpus_per_replica": gpus, "fleets": out}


def run(args: argparse.Namespace) -> dict:
    """Measure the parts ``args.part`` names; returns the result object (see the module docstring)."""
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.jobs.benchlib import run_metadata
    from rayinfer.model.loader import load_model, parse_dtype
    from rayinfer.model.shapes import shape_name

    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if on_cuda else "cpu")
    load_format = args.load_format or ("dummy" if shape_name(args.model) is not None else "auto")
    dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    net = load_model(args.model, parse_dtype(dtype, device), device, load_format)
    if not getattr(net, "is_multimodal", False):
        raise SystemExit(f"error: model {args.model!r} has no vision encoder")
    result = {**run_metadata(device), "model": args.model, "load_format": load_format, "dtype": dtype,
              "image_size": net.image_size, "image_tokens": net.num_image_tokens}
    if args.part in ("both", "pareto"):
        result["pareto"] = encoder_pareto(net, args.batch_sizes, args.repeats, device)
    if args.part in ("both", "ttft"):
        import ray

        from rayinfer.actors.cluster import RayConfig, init_ray

        vision = {"image_size": net.image_size, "num_image_tokens": net.num_image_tokens,
                  "patch_size": net.patch_size, "image_token_id": net.image_token_id}
        del net  # the fleets load their own copies
        if on_cuda:
            torch.cuda.empty_cache()
        net = argparse.Namespace(**vision)
        max_len = args.prompt_tokens + net.num_image_tokens + args.max_tokens + 16
        model_config = ModelConfig(args.model, dtype=dtype, load_format=load_format, max_model_len=max_len)
        extra = {"gpu_memory_utilization": args.gpu_memory_utilization} if args.gpu_memory_utilization else {}
        engine_config = EngineConfig(device="cuda" if on_cuda else "cpu", max_num_seqs=max(8, args.requests),
                                     max_num_batched_tokens=max(2048, 4 * max_len), **extra)
        embedded = args.ray_address == "local"
        init_ray(RayConfig(address=args.ray_address), num_cpus=max(os.cpu_count() or 1, 2 + args.encoders + 1)
                 if embedded else None, log_to_driver=False)
        try:
            result["ttft"] = ttft_compare(args, model_config, engine_config, net, on_cuda)
        finally:
            ray.shutdown()
    return result


def main(argv=None) -> None:
    from rayinfer.jobs.benchlib import emit_json

    args = _args(argv)
    emit_json(run(args), args.out)


if __name__ == "__main__":
    main()
