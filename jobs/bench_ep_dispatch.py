"""Expert-parallel dispatch and combine of one MoE layer, against the link's all-to-all bandwidth.

Usage::

    python jobs/bench_ep_dispatch.py                     # ep = the GPUs here (NCCL), DeepSeek-V2-Lite's MoE shape, bf16
    python jobs/bench_ep_dispatch.py --tokens 1 32 128 512 4096 --shape qwen3-30b-a3b --skew 2.0
    python jobs/bench_ep_dispatch.py --device cpu --ep 2 --shape tiny --tokens 4 64   # gloo on CPU

Starts ``--ep`` processes (one GPU each with NCCL, or CPU processes with gloo). For each token count T
per rank, with random top-k routing over the shape's L experts (uniform, or Zipf-skewed by ``--skew``)
and experts spread over the ranks (P = L, identity placement), it times one layer's communication:

1. ``exact``: :func:`rayinfer.model.ep_dispatch.all_to_all_moe` with exact splits (count exchange, host
   read, only real rows on the link), the experts replaced by the identity, so only routing, packing,
   the two all-to-alls and the sum at home are timed; on CUDA through the Triton kernels of
   ``kernels.ep_dispatch``, and again as torch ops (``exact_torch_us``, ``RAYINFER_EP_FUSED_DISPATCH=0``);
2. ``fixed``: the same with fixed-size buffers (capacity T; the layout a CUDA graph captures), run
   eagerly (also as torch ops: ``fixed_torch_us``) and, on CUDA, replayed from a captured graph
   (``fixed_graph_us``: what a decode step pays);
3. ``all_gather``: the layout it replaced (all-gather every rank's tokens and routing, all-reduce the
   [ep * T, H] partial sums), for comparison;
4. ``link``: a plain ``all_to_all_single`` of as many bytes per rank as the ``fixed`` dispatch moves,
   the ceiling the dispatch is measured against (GB/s of bytes each rank sends).

Times are medians over ``--repeats`` after a warm-up, the slowest rank's. Bytes are each rank's mean
bytes sent over both directions (dispatch rows + returned outputs). Results go to ``--out`` as JSON
with the command, device and git revision.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# (hidden size, top-k, routed experts) of the MoE layers of each shape
SHAPES = {"deepseek-v2-lite": (2048, 6, 64), "qwen3-30b-a3b": (2048, 8, 128), "tiny": (32, 2, 8)}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, default=None, help="ranks (default: the GPUs here, at least 2)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="deepseek-v2-lite")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048, 8192],
                   help="tokens per rank")
    p.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of expert popularity (0: uniform)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON result path")
    p.add_argument("--git-rev", default=None, help="revision to record (a checkout without .git)")
    args = p.parse_args(argv)
    if args.ep is None:
        args.ep = max(2, torch.cuda.device_count()) if args.device == "cuda" else 2
    if args.device == "cuda" and torch.cuda.device_count() < args.ep:
        p.error(f"--ep {args.ep} needs {args.ep} GPUs; {torch.cuda.device_count()} visible (use --device cpu for gloo)")
    if args.ep < 1:
        p.error("--ep must be >= 1")
    return args


def _routing(num_tokens: int, top_k: int, num_experts: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """[T, k] distinct expert ids per token, experts drawn with Zipf(skew) popularity (uniform at 0)."""
    popularity = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -skew
    return torch.multinomial(popularity.expand(num_tokens, -1), top_k, replacement=False, generator=gen)


def _all_gather_layout(hidden, ids, weights, group) -> torch.Tensor:
    """The replaced layout: all-gather tokens and routing, all-reduce the [ep * T, H] partial sums."""
    world = dist.get_world_size(group)
    gathered = []
    for x in (hidden, ids, weights):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        gathered.append(torch.cat(parts))
    partial = gathered[0].clone()  # the identity experts' partial sums
    dist.all_reduce(partial, group=group)
    rank = dist.get_rank(group)
    return partial[rank * hidden.shape[0] : (rank + 1) * hidden.shape[0]]


def _time(fn, device: torch.device, repeats: int, group) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, the slowest rank's (each run starts together)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)  # NCCL: on the GPU
    dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return float(median)


def _capture(fn, device: torch.device) -> "torch.cuda.CUDAGraph":
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream); every rank captures together."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _rank_main(rank: int, args: argparse.Namespace, store: str, results: dict) -> None:
    from rayinfer.model.ep_dispatch import DispatchCounters, all_to_all_moe, pack_rows

    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=args.ep,
                            timeout=timedelta(seconds=300))
    group = dist.group.WORLD
    hidden_size, top_k, num_experts = SHAPES[args.shape]
    dtype = DTYPES[args.dtype]
    num_local = num_experts // args.ep
    log2phy = torch.arange(num_experts, device=device)[:, None]
    replica_counts = torch.ones(num_experts, dtype=torch.int64, device=device)
    rows = []
    try:
        for num_tokens in args.tokens:
            gen = torch.Generator().manual_seed(1000 * rank + num_tokens)
            hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(device, dtype)
            ids = _routing(num_tokens, top_k, num_experts, args.skew, gen).to(device)
            weights = torch.rand(num_tokens, top_k, generator=gen).to(device)
            counters = DispatchCounters()

            def dispatch(capacity, counters=counters):
                return all_to_all_moe(hidden, ids, weights, lambda h, i, w: h, group=group, log2phy=log2phy,
                                      replica_counts=replica_counts, num_local=num_local, capacity=capacity,
                                      counters=counters)

            dispatch(None)  # one counted exchange: the real rows this rank sends
            real_rows = counters.num_rows_sent
            row_bytes = pack_rows(hidden[:1], ids[:1], weights[:1]).shape[1]
            out_bytes = hidden_size * dtype.itemsize
            exact_s = _time(lambda: dispatch(None), device, args.repeats, group)
            fixed_s = _time(lambda: dispatch(num_tokens), device, args.repeats, group)
            gather_s = _time(lambda: _all_gather_layout(hidden, ids, weights, group), device, args.repeats, group)
            os.environ["RAYINFER_EP_FUSED_DISPATCH"] = "0"  # the torch-op path, for comparison
            exact_torch_s = _time(lambda: dispatch(None), device, args.repeats, group)
            fixed_torch_s = _time(lambda: dispatch(num_tokens), device, args.repeats, group)
            os.environ.pop("RAYINFER_EP_FUSED_DISPATCH")
            graph_s = None
            if device.type == "cuda":  # the fixed layout as a decode step runs it: replayed from a CUDA graph
                graph = _capture(lambda: dispatch(num_tokens), device)
                graph_s = _time(graph.replay, device, args.repeats, group)
            fixed_bytes = args.ep * num_tokens * (row_bytes + out_bytes)  # both directions, all chunks full
            link_buf = torch.zeros(args.ep * num_tokens * (row_bytes + out_bytes), dtype=torch.uint8, device=device)
            link_out = torch.empty_like(link_buf)
            link_s = _time(lambda: dist.all_to_all_single(link_out, link_buf, group=group), device, args.repeats, group)
            sizes = torch.tensor([real_rows], dtype=torch.float64, device=device)
            dist.all_reduce(sizes, group=group)
            mean_rows = float(sizes) / args.ep
            exact_bytes = mean_rows * (row_bytes + out_bytes)
            rows.append({
                "tokens_per_rank": num_tokens,
                "rows_sent_per_rank": mean_rows,
                "exact_us": exact_s * 1e6, "fixed_us": fixed_s * 1e6, "all_gather_us": gather_s * 1e6,
                "exact_torch_us": exact_torch_s * 1e6, "fixed_torch_us": fixed_torch_s * 1e6,
                "fixed_graph_us": None if graph_s is None else graph_s * 1e6,
                "link_us": link_s * 1e6,
                "exact_bytes_per_rank": exact_bytes, "fixed_bytes_per_rank": fixed_bytes,
                "link_GBps": fixed_bytes / link_s / 1e9,
                "exact_GBps": exact_bytes / exact_s / 1e9, "fixed_GBps": fixed_bytes / fixed_s / 1e9,
                "fixed_vs_link": link_s / fixed_s,
            })
            if rank == 0:
                r = rows[-1]
                graph_text = "" if graph_s is None else f" (graph {r['fixed_graph_us']:7.1f})"
                print(f"T={num_tokens:6d}  exact {r['exact_us']:9.1f} us (torch ops {r['exact_torch_us']:9.1f})  fixed "
                      f"{r['fixed_us']:9.1f} us (torch ops {r['fixed_torch_us']:9.1f}){graph_text}  "
                      f"all-gather {r['all_gather_us']:9.1f} us  link {r['link_us']:9.1f} us "
                      f"({r['link_GBps']:.1f} GB/s; fixed at {r['fixed_vs_link']:.0%} of it)", flush=True)
        if rank == 0:
            results["rows"] = rows
    finally:
        dist.destroy_process_group()


def _worker(rank: int, args: argparse.Namespace, store: str, queue) -> None:
    results: dict = {}
    _rank_main(rank, args, store, results)
    if rank == 0:
        queue.put(results)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns (and with ``--out`` writes) the result dict."""
    import queue as queue_module
    import tempfile

    from rayinfer.jobs.benchlib import emit_json, run_metadata

    args = _parse(argv)
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, args, str(Path(tmp) / "store"), queue)) for r in range(args.ep)]
        for proc in procs:
            proc.start()
        results = None
        while results is None:  # rank 0's result, unless a rank dies first
            try:
                results = queue.get(timeout=5)
            except queue_module.Empty:
                if any(proc.exitcode not in (None, 0) for proc in procs):
                    break
        for proc in procs:
            proc.join(timeout=60)
    if results is None or any(proc.exitcode for proc in procs):
        raise RuntimeError("a rank failed: see its traceback above")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    hidden_size, top_k, num_experts = SHAPES[args.shape]
    result = {**run_metadata(device, args.git_rev), "ep": args.ep, "backend": "nccl" if args.device == "cuda" else "gloo",
              "shape": {"name": args.shape, "hidden_size": hidden_size, "top_k": top_k, "num_experts": num_experts,
                        "dtype": args.dtype}, "skew": args.skew, "repeats": args.repeats, **results}
    emit_json(result, args.out)
    return result


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(0 if main() else 1)
