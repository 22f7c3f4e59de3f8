"""Probe: where the fixed ~20 us of TileLang's keys-as-rows MLA decode launch goes, and the split merges.

Twenty-second round: a fit of graph time against bytes over batch 32 / 64 / 128 (4K context) leaves about 20 us a
launch beyond the bytes at the streaming rate, which keeps batch 32 at 74% of the copy bandwidth. This probe
(1) times, per batch and split merge (``merge`` of the builder: a merge kernel after the program, the token's
last program, or a cluster of the token's programs), the whole call and the program alone, each replayed from a
CUDA graph over enough layers to leave L2; (2) with --trace, runs a copy of the program with ``%globaltimer`` stamps
written per program (start, after the PDL wait and query copy, after the key loop, after the stores: the copy is built
from the builder's own source with the stamps inserted) and reports, per layer of one graph replay, the spread of
the programs' starts and ends, the gap to the layer before, the medians of each phase, and each program's
multiprocessor (``%smid``) with how well each multiprocessor's loop time in one half of the layers predicts the other
half's (``by_sm``). ``--cases 32x4096x4,...`` limits the batch x context x splits cases.

    PYTHONPATH=. python benchmarks/probe/mla_rows_timeline.py [[--trace] [--cases 32x4096x4] | --neighbors [--carveouts -1,86,100]] --out t.json
"""
import argparse
import importlib.util
import inspect
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import bench_graph, measure_ceilings, mla_decode_inputs, write_probe  # noqa: E402

from rayinfer.kernels import mla_tilelang  # noqa: E402
from rayinfer.kernels._triton_utils import triton  # noqa: E402
from rayinfer.kernels.mla_attention import _mla_merge_splits_kernel  # noqa: E402

_NOW = ('__device__ __forceinline__ long long rl_now() { unsigned long long t; '
        'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return (long long)t; }\n'
        '__device__ __forceinline__ long long rl_smid() { unsigned int s; '
        'asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return (long long)s; }\n')
_STAMP = 'trace[tok, split, {i}] = T.call_extern("int64", "rl_now")'
_EDITS = [
    ("            T.import_source(_MERGE_HELPERS)", "            T.import_source(_MERGE_HELPERS + _NOW)"),
    ("        qk_scale: T.float32,\n    ):",
     '        qk_scale: T.float32,\n        trace: T.Tensor((num_tokens, splits, 5), "int64"),\n    ):'),
    ("            if pdl:\n                pdl_sync()",
     "            " + _STAMP.format(i=0) + "\n            if pdl:\n"
     "                pdl_sync()"),
    ("            T.fill(m_cur, -T.infinity(accum))\n",
     "            T.fill(m_cur, -T.infinity(accum))\n            " + _STAMP.format(i=1) + "\n"),
    ("            if in_cluster:\n", "            " + _STAMP.format(i=2) + "\n            if in_cluster:\n"),
    ("    return mla_decode_keys_as_rows",
     "            " + _STAMP.format(i=3) + "\n            trace[tok, split, 4] = T.call_extern(\"int64\", \"rl_smid\")"
     "\n\n    return mla_decode_keys_as_rows"),
]


def traced_builder():
    """build_mla_decode_keys_as_rows with the four stamps (a module written from its source, as TileLang's
    parser reads the function's source file)."""
    src = inspect.getsource(mla_tilelang.build_mla_decode_keys_as_rows)
    for old, new in _EDITS:
        assert src.count(old) == 1, f"the builder's source changed: {old!r}"
        src = src.replace(old, new)
    # the copy sees the module's globals, as the builder does
    head = ("from rayinfer.kernels import mla_tilelang\n"
            "globals().update({k: v for k, v in vars(mla_tilelang).items() if not k.startswith('__')})\n"
            f"_NOW = {_NOW!r}\n")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(head + src)
    spec = importlib.util.spec_from_file_location("mla_rows_traced", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_mla_decode_keys_as_rows


def case(build_traced, trace_it, ceil, batch, ctx, splits, merge, cache, meta, ql, qp, want, nbytes, layers) -> dict:
    """One (batch, context, splits, merge) case: graph times of the whole call, the kernel alone and the merge
    alone, and the stamps of one replay of the traced copy (whole call)."""
    import tilelang

    cfg = {**mla_tilelang.default_config(16, 64), "merge": merge}
    kern = mla_tilelang._compiled(16, 512, 64, 64, "bfloat16", splits, tuple(sorted(cfg.items())))
    kw = {k: v for k, v in cfg.items() if k != "layout"}
    traced = tilelang.compile(build_traced(16, 512, 64, 64, "bfloat16", splits, **kw), out_idx=None,
                              target="cuda") if trace_it else None
    in_kernel = merge != "launch" and splits > 1
    counters = mla_tilelang._arrival_counters(ql.device)[:batch]
    out = torch.empty_like(ql)
    part_out = torch.empty((batch, 16, splits, 512), dtype=torch.float32, device="cuda")
    part_lse = torch.empty((batch, 16, splits), dtype=torch.float32, device="cuda")
    trace = torch.zeros((layers, batch, splits, 5), dtype=torch.int64, device="cuda")
    qsl, sl, bt = meta.query_start_loc.int(), meta.seq_lens.int(), meta.block_tables.int()
    scale = 0.1 * 1.4426950408889634
    rows_of = [cache[i].view(-1, 576) for i in range(layers)]

    def kernel(i, t=None):
        if t is None:
            kern(ql, qp, rows_of[i], qsl, sl, bt, part_out, part_lse, out, counters, scale)
        else:
            traced(ql, qp, rows_of[i], qsl, sl, bt, part_out, part_lse, out, counters, scale, t[i])

    def merge_launch():
        if splits > 1 and not in_kernel:
            _mla_merge_splits_kernel[(batch, 16, 4)](  # as mla_decode_tilelang launches it
                part_out, part_lse, out, 16, splits, out.stride(0), out.stride(1),
                RANK=512, BLOCK_R=512, BLOCK_S=triton.next_power_of_2(splits), BLOCK_C=128, num_warps=4)

    def full(i, t=None):
        kernel(i, t)
        merge_launch()

    out.zero_()
    full(0)
    err = (out.float() - want).abs().max().item()
    assert not (counters[:, 0] % 32).any() and not counters[:, 1].any(), "a counter left set"
    row = {"batch": batch, "ctx": ctx, "splits": splits, "merge": merge, "layers": layers, "nbytes": nbytes,
           "max_abs_err": err, "full_us": bench_graph([lambda i=i: full(i) for i in range(layers)])}
    row["pct_full"] = 100 * nbytes / row["full_us"] / 1e3 / ceil["copy_GBps"]
    if traced is None:
        print(json.dumps(row), flush=True)
        return row
    full(0, trace)
    row["max_abs_err_traced"] = (out.float() - want).abs().max().item()
    row["kernel_us"] = bench_graph([lambda i=i: kernel(i) for i in range(layers)])
    row["traced_full_us"] = bench_graph([lambda i=i: full(i, trace) for i in range(layers)])
    row["pct_kernel"] = 100 * nbytes / row["kernel_us"] / 1e3 / ceil["copy_GBps"]
    # one replay's stamps (bench_graph's last replay left them)
    torch.cuda.synchronize()
    tr = trace[..., :4].cpu().double() / 1e3  # us
    smid = trace[..., 4].cpu().reshape(layers, -1)  # the multiprocessor each program ran on
    layer_rows = []
    for i in range(layers):
        t = tr[i].reshape(-1, 4)
        layer_rows.append({
            "start_spread": (t[:, 0].max() - t[:, 0].min()).item(),
            "end_spread": (t[:, 3].max() - t[:, 3].min()).item(),
            "span": (t[:, 3].max() - t[:, 0].min()).item(),
            "gap_before": (t[:, 0].min() - tr[i - 1].reshape(-1, 4)[:, 3].max()).item() if i else None,
            "prologue_med": (t[:, 1] - t[:, 0]).median().item(),
            "loop_med": (t[:, 2] - t[:, 1]).median().item(),
            "loop_min": (t[:, 2] - t[:, 1]).min().item(),
            "loop_max": (t[:, 2] - t[:, 1]).max().item(),
            "epilogue_med": (t[:, 3] - t[:, 2]).median().item(),
            "epilogue_max": (t[:, 3] - t[:, 2]).max().item(),
        })
    row["timeline_median_over_layers"] = {
        k: statistics.median(v for r in layer_rows if (v := r[k]) is not None) if any(
            r[k] is not None for r in layer_rows) else None for k in layer_rows[0]}
    row["timeline_layers"] = layer_rows[:4]
    row["by_sm"] = by_sm(tr.reshape(layers, -1, 4), smid)
    print(json.dumps({k: v for k, v in row.items() if k != "timeline_layers"}), flush=True)
    return row


def by_sm(t: torch.Tensor, smid: torch.Tensor) -> dict:
    """Whether a program's key-loop time follows its multiprocessor: ``t`` [layers, programs, 4] stamps (us),
    ``smid`` [layers, programs]. Gives each multiprocessor's mean loop time over the layers' two halves and the
    correlation of the halves (near 1: the same multiprocessors are slow in every layer, so the spread is the
    hardware's; near 0: it moves from launch to launch), the least and greatest of those means, and each one."""
    loop = t[..., 2] - t[..., 1]
    half = t.shape[0] // 2
    means = []
    for part in (slice(0, half), slice(half, t.shape[0])):
        sums, counts = torch.zeros(1024, dtype=torch.float64), torch.zeros(1024, dtype=torch.float64)
        sums.index_add_(0, smid[part].reshape(-1), loop[part].reshape(-1))
        counts.index_add_(0, smid[part].reshape(-1), torch.ones(loop[part].numel(), dtype=torch.float64))
        means.append((sums, counts))
    seen = (means[0][1] > 0) & (means[1][1] > 0)
    a = (means[0][0] / means[0][1].clamp(min=1))[seen]
    b = (means[1][0] / means[1][1].clamp(min=1))[seen]
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item() if seen.sum() > 2 else None
    allm = (means[0][0] + means[1][0]) / (means[0][1] + means[1][1]).clamp(min=1)
    used = (means[0][1] + means[1][1]) > 0
    return {"num_sms_used": int(used.sum()), "halves_corr": corr,
            "sm_mean_loop_min": allm[used].min().item(), "sm_mean_loop_max": allm[used].max().item(),
            "sm_mean_loop": {int(i): round(allm[i].item(), 2) for i in used.nonzero().flatten()}}


_LOADED: list[int] = []  # CUfunction handles of every Triton kernel loaded since record_triton_loads()


def record_triton_loads() -> None:
    """Keep each Triton kernel's CUfunction as it loads (for :func:`set_carveout`)."""
    from triton.compiler.compiler import CompiledKernel

    init = CompiledKernel._init_handles

    def recorded(self):
        fresh = self.module is None
        init(self)
        if fresh and self.function:
            _LOADED.append(self.function)

    CompiledKernel._init_handles = recorded


def set_carveout(percent: int) -> None:
    """cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT) on every recorded Triton kernel: the share of the
    SM's L1/shared memory a kernel prefers as shared memory (-1: no preference, CUDA's default; 100: all). A
    kernel next to one of another carveout may wait for the SM to drain before it can start on it."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    for fn in _LOADED:
        err = cuda.cuFuncSetAttribute(ctypes.c_void_p(fn), 9, ctypes.c_int(percent))  # 9: the carveout
        if err:
            raise RuntimeError(f"cuFuncSetAttribute(carveout {percent}) failed: CUresult {err}")


def neighbor_cases(carveouts=(-1,)) -> list[dict]:
    """The model's attention step in miniature: each backend's decode call alone, the W_UV product after it
    (``_times_uv``, a [16, 128, 512] weight) alone, and both in one graph, at batch 16 / 32 / 64 / 128 and 4K
    on blocks of 64. ``excess_us`` = both - alone - product: what a backend pays next to a kernel that is not
    itself (the twenty-third round's model A/B lost 7-8 us a layer on TileLang against its kernel timing).
    Each case runs at every shared-memory carveout of ``carveouts`` set on the Triton kernels (-1: CUDA's
    default), to test whether switching the SM's carveout between the 168 KB TileLang program and its
    neighbors is that cost."""
    from rayinfer.kernels.mla_attention import _times_uv, mla_decode_triton

    rows = []
    for batch in (16, 32, 64, 128):
        cache, meta, ql, qp, want, nbytes, layers = mla_decode_inputs(batch, 4096, bs=64)
        w_uv = torch.randn((16, 128, 512), device="cuda", dtype=ql.dtype) * 0.05
        out = mla_decode_triton(ql, qp, cache[0], meta, 0.1)
        for carveout in carveouts:
            set_carveout(carveout)
            product = bench_graph([lambda: _times_uv(out, w_uv) for _ in range(layers)])
            for backend, fn in (("triton", mla_decode_triton), ("tilelang", mla_tilelang.mla_decode_tilelang)):
                run = lambda i, f=fn: f(ql, qp, cache[i], meta, 0.1, max_seq_len=8192)  # noqa: E731
                alone = bench_graph([lambda i=i: run(i) for i in range(layers)])
                both = bench_graph([lambda i=i: _times_uv(run(i), w_uv) for i in range(layers)])
                row = {"batch": batch, "ctx": 4096, "backend": backend, "carveout": carveout, "alone_us": alone,
                       "product_us": product, "both_us": both,
                       "excess_us": both - alone - product if None not in (alone, both, product) else None}
                print(json.dumps(row), flush=True)
                rows.append(row)
        del cache
        torch.cuda.empty_cache()
    set_carveout(-1)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--trace", action="store_true", help="also time the stamped copy and report its phases")
    p.add_argument("--git-rev", default=None, help="revision of the code (default: git rev-parse --short HEAD)")
    p.add_argument("--neighbors", action="store_true",
                   help="only the decode call beside the W_UV product, per backend (neighbor_cases)")
    p.add_argument("--carveouts", default="-1",
                   help="with --neighbors: the Triton kernels' shared-memory carveouts (percent of the SM's 228 KB) to "
                   "try, e.g. -1,86,100 (86: the 196 KB configuration, the least that holds the TileLang program)")
    p.add_argument("--cases", default=None,
                   help="only these batch x context x splits cases, e.g. 32x4096x4,64x4096x2 (default: the full list)")
    p.add_argument("--merges", default=None,
                   help="only these split merges, e.g. launch,spread (default: every one the case takes)")
    args = p.parse_args()
    record_triton_loads()
    ceil = measure_ceilings()
    print(ceil, flush=True)
    if args.neighbors:
        rows = neighbor_cases([int(c) for c in args.carveouts.split(",")])
    else:
        build_traced, rows = traced_builder(), []
        cases = [(32, 4096, 4), (64, 4096, 2), (128, 4096, 1), (16, 4096, 8), (8, 4096, 16),
                 (1, 1024, 32), (4, 4096, 32), (32, 1024, 4), (32, 8192, 4), (64, 1024, 2)]
        if args.cases:
            cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
        for batch, ctx, splits in cases:
            cache, meta, ql, qp, want, nbytes, layers = mla_decode_inputs(batch, ctx, bs=64)
            merges = ["launch", "last_program", "spread"] + (
                ["cluster"] if splits <= mla_tilelang.MAX_CLUSTER_SPLITS else [])
            if args.merges:
                merges = [m for m in merges if m in args.merges.split(",")]
            for merge in merges if splits > 1 else ["launch"]:
                rows.append(case(build_traced, args.trace, ceil, batch, ctx, splits, merge, cache, meta, ql, qp,
                                 want, nbytes, layers))
            del cache
            torch.cuda.empty_cache()
    if args.out:
        write_probe(args.out, args.git_rev, ceil, rows)


if __name__ == "__main__":
    main()
