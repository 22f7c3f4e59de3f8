"""Probe: the chained n-gram lookup on the device, the torch reference against the Triton kernel
(``rayinfer.kernels.ngram``): per call, the host's time to launch it and the device's time to run it, for
batches of contexts of a given length (random tokens from a small vocabulary, so n-grams recur).

    PYTHONPATH=. python benchmarks/probe/ngram_device_lookup.py [--batches 1,32,256] [--lengths 1024,8192]
"""
import argparse
import json
import time

import torch

from rayinfer.kernels.ngram import ngram_lookup_ref, ngram_lookup_triton


def timed(fn, iters: int) -> tuple[float, float]:
    """(host ms a call to launch, device ms a call), after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    host_ms = (time.perf_counter() - t) * 1e3 / iters
    torch.cuda.synchronize()
    return host_ms, start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for length in map(int, args.lengths.split(",")):
        for batch in map(int, args.batches.split(",")):
            ctx = torch.randint(0, 500, (batch, length), generator=gen, device=dev, dtype=torch.int32)
            rows = torch.arange(batch, device=dev)
            lengths = torch.full((batch,), length, device=dev, dtype=torch.int64)
            assert torch.equal(ngram_lookup_ref(ctx, rows, lengths, args.k, 1, 4),
                               ngram_lookup_triton(ctx, rows, lengths, args.k, 1, 4))
            row = {"batch": batch, "length": length}
            for name, fn in (("torch", ngram_lookup_ref), ("triton", ngram_lookup_triton)):
                host, device = timed(lambda: fn(ctx, rows, lengths, args.k, 1, 4), args.iters)
                row[name] = {"host_ms": round(host, 4), "device_ms": round(device, 4)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
