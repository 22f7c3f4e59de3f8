"""The fused MoE's two grouped GEMMs at prefill sizes as TileLang programs (Hopper warpgroup MMA, bulk copies).

The alternative to torch's grouped GEMM (``kernels.fused_moe.fused_moe_grouped_mm``) over the same layout: the
expert-sorted token rows ``a`` [P, K], expert e's rows ``group_ends[e-1] .. group_ends[e]`` (``group_ends`` int32
[E], the alignment's cumulative group ends; groups start on 16-row boundaries). Program (x, y) computes output
columns tile x of M-tile y, where the M-tiles are each expert's rows cut into ``block_m`` runs (an expert's last
tile is partial: its rows past the group's end belong to the next group and are masked at the store). Each program
finds its expert by walking the E group ends, then streams ``block_k`` columns of its rows and of the expert's
weight rows into shared memory (bulk copies that TileLang pipelines with a producer warpgroup) and multiplies them
on the tensor cores in float32. Programs of one M-tile are adjacent in launch order, so they share its rows in L2,
and an expert's few M-tiles run close together, sharing its weights.

``build_grouped_gemm(..., silu_and_mul=True)`` is the gate/up GEMM with SwiGLU fused: the program computes the gate
and the up products for the same ``block_n / 2`` intermediate channels (weight rows ``c`` and ``I + c`` of
``w13`` [E, 2I, H]; by default loaded as one tile and multiplied as one product) and stores ``silu(gate) * up``
[P, I] (no [P, 2I] intermediate, no activation launch).
``silu_and_mul=False`` is the down GEMM (``w2`` [E, H, I]).

Measured on an H100 (thirty-second round in benchmarks/README.md), these programs are slower than torch's grouped
GEMM: V2-Lite's two GEMMs (with its shared experts as slots) take 685-688 us at 2048 tokens and 1219-1238 us at 4096
on the default tiles (gate and up in one product) against torch's 604-612 and 1040-1098 us, and the whole layer is
10% slower. So ``fused_moe`` runs them only when asked (``fused_moe.GROUPED_TILELANG``).

TileLang is optional (:func:`rayinfer.kernels.mla_tilelang.tilelang_available`). Kernels are compiled once per
(E, N, K, dtype, silu_and_mul, tiles).
Source: the grouped-GEMM form of vLLM's fused MoE (expert-sorted, tile-padded rows) and DeepGEMM's "m-grouped
contiguous" layout; TileLang's GEMM examples for the pipelined tensor-core loop.
"""

# no "from __future__ import annotations": TileLang evaluates the kernel signature's annotations

import functools

import torch

# the fastest set measured on an H100 (thirty-second round in benchmarks/README.md)
DEFAULT_TILES = dict(block_m=128, block_n=256, block_k=64, num_stages=4, threads=256, store="direct",
                     gate_up_mma="merged")


def build_grouped_gemm(num_experts: int, n: int, k: int, dtype: str, silu_and_mul: bool, block_m: int = 128,
                       block_n: int = 128, block_k: int = 64, num_stages: int = 4, threads: int = 256,
                       store: str = "direct", gate_up_mma: str = "split"):
    """The TileLang program of one grouped GEMM shape; see the module docstring.

    Args:
        num_experts, n, k: the weight ``w`` [E, N, K] (N = 2I with ``silu_and_mul``).
        dtype: "bfloat16" or "float16" (rows, weights and output).
        silu_and_mul: the gate/up GEMM with SwiGLU fused (output [P, N / 2]), else a plain product ([P, N]).
        block_m, block_n, block_k: a program's rows, output columns (gate and up columns together with
            ``silu_and_mul``), reduction step.
        store: "direct" writes the output tile from the accumulators' registers (each thread its fragment's
            elements); "shared" stages it in shared memory first, so the rows go out as contiguous vector stores.
        gate_up_mma: with ``silu_and_mul``, "split" multiplies the gate and the up tile as two products (two
            accumulators, a wait after each); "merged" loads both into one [block_n, block_k] tile (gate rows, then
            up rows) and multiplies it once, so each warpgroup issues one N = block_n product per step; its
            epilogue always goes through shared memory (``store`` is not read).
    Returns:
        a prim_func of (a [P, K], w [E * N, K] (the weight's rows stacked), group_ends [E] int32,
        out [P, N or N / 2]); P is dynamic. The grid holds ceil(P / block_m) + E M-tiles, enough for any split of
        P rows into E groups; programs past the last tile store nothing.
    Raises:
        ValueError: when N (or I) is not a multiple of the output tile, or K of ``block_k``; or when ``block_m`` is
            not 128 or ``threads`` not 256 (:func:`_tiles_problem`).
    """
    import tilelang.language as T

    problem = _problem(n, k, silu_and_mul, dict(block_m=block_m, block_n=block_n, block_k=block_k, threads=threads,
                                                 store=store, gate_up_mma=gate_up_mma))
    merged = silu_and_mul and gate_up_mma == "merged"
    if problem:
        raise ValueError(problem)
    out_n, tile_n = (n // 2, block_n // 2) if silu_and_mul else (n, block_n)
    accum = "float32"
    half = n // 2
    num_rows = T.dynamic("num_rows")

    @T.prim_func
    def grouped_gemm(
        a: T.Tensor((num_rows, k), dtype),
        w: T.Tensor((num_experts * n, k), dtype),
        group_ends: T.Tensor((num_experts,), "int32"),
        out: T.Tensor((num_rows, out_n), dtype),
    ):
        with T.Kernel(out_n // tile_n, T.ceildiv(num_rows, block_m) + num_experts, threads=threads) as (bx, by):
            a_s = T.alloc_shared((block_m, block_k), dtype)
            expert = T.alloc_var("int32")
            row0 = T.alloc_var("int32")
            row_end = T.alloc_var("int32")
            seen = T.alloc_var("int32")
            start = T.alloc_var("int32")
            expert = 0
            row0 = 0
            row_end = 0  # no rows: a program past the last tile stores nothing
            seen = 0
            start = 0
            # this program's expert: the group whose M-tiles hold tile `by` (the walk's loads are independent)
            for e in T.unroll(num_experts):
                tiles = T.ceildiv(group_ends[e] - start, block_m)
                if seen <= by and by < seen + tiles:
                    expert = e
                    row0 = start + (by - seen) * block_m
                    row_end = group_ends[e]
                seen = seen + tiles
                start = group_ends[e]
            n0 = bx * tile_n
            steps = T.if_then_else(row0 < row_end, k // block_k, 0)
            if merged:  # gate rows then up rows in one tile, one accumulator [block_m, block_n]
                gu_s = T.alloc_shared((2 * tile_n, block_k), dtype)
                acc = T.alloc_fragment((block_m, 2 * tile_n), accum)
                T.clear(acc)
                for kk in T.Pipelined(steps, num_stages=num_stages):
                    T.copy(a[row0:row0 + block_m, kk * block_k:(kk + 1) * block_k], a_s)
                    T.copy(w[expert * n + n0:expert * n + n0 + tile_n, kk * block_k:(kk + 1) * block_k],
                           gu_s[0:tile_n, 0:block_k])
                    T.copy(w[expert * n + half + n0:expert * n + half + n0 + tile_n,
                             kk * block_k:(kk + 1) * block_k], gu_s[tile_n:2 * tile_n, 0:block_k])
                    T.gemm(a_s, gu_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                # a thread's accumulator holds no gate with its up column, so both go through shared memory
                # (rounded to the output dtype, as torch's path rounds the [P, 2I] product before SwiGLU)
                c_s = T.alloc_shared((block_m, 2 * tile_n), dtype)
                T.copy(acc, c_s)
                for i, j in T.Parallel(block_m, tile_n):
                    if row0 + i < row_end:
                        out[row0 + i, n0 + j] = T.cast(
                            T.cast(c_s[i, j], accum) / (1.0 + T.exp(-T.cast(c_s[i, j], accum)))
                            * T.cast(c_s[i, tile_n + j], accum), dtype)
            else:
                g_s = T.alloc_shared((tile_n, block_k), dtype)
                acc_g = T.alloc_fragment((block_m, tile_n), accum)
                if silu_and_mul:  # the up half's tile and accumulator
                    u_s = T.alloc_shared((tile_n, block_k), dtype)
                    acc_u = T.alloc_fragment((block_m, tile_n), accum)
                T.clear(acc_g)
                if silu_and_mul:
                    T.clear(acc_u)
                for kk in T.Pipelined(steps, num_stages=num_stages):
                    T.copy(a[row0:row0 + block_m, kk * block_k:(kk + 1) * block_k], a_s)
                    T.copy(w[expert * n + n0:expert * n + n0 + tile_n, kk * block_k:(kk + 1) * block_k], g_s)
                    if silu_and_mul:
                        T.copy(w[expert * n + half + n0:expert * n + half + n0 + tile_n,
                                 kk * block_k:(kk + 1) * block_k], u_s)
                    T.gemm(a_s, g_s, acc_g, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    if silu_and_mul:
                        T.gemm(a_s, u_s, acc_u, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                if store == "shared":  # the tile in shared memory, then whole rows out
                    c_s = T.alloc_shared((block_m, tile_n), dtype)
                    for i, j in T.Parallel(block_m, tile_n):
                        if silu_and_mul:
                            c_s[i, j] = T.cast(acc_g[i, j] / (1.0 + T.exp(-acc_g[i, j])) * acc_u[i, j], dtype)
                        else:
                            c_s[i, j] = T.cast(acc_g[i, j], dtype)
                    for i, j in T.Parallel(block_m, tile_n):
                        if row0 + i < row_end:
                            out[row0 + i, n0 + j] = c_s[i, j]
                else:
                    for i, j in T.Parallel(block_m, tile_n):
                        if row0 + i < row_end:
                            if silu_and_mul:
                                out[row0 + i, n0 + j] = T.cast(
                                    acc_g[i, j] / (1.0 + T.exp(-acc_g[i, j])) * acc_u[i, j], dtype)
                            else:
                                out[row0 + i, n0 + j] = T.cast(acc_g[i, j], dtype)

    return grouped_gemm


def _shape_problem(n: int, k: int, silu_and_mul: bool, block_n: int, block_k: int) -> str | None:
    """Why tiles of ``block_n`` output columns (gate and up together with ``silu_and_mul``) and ``block_k``
    reduction steps do not divide a weight [E, N, K], or None when they do."""
    out_n, tile_n = (n // 2, block_n // 2) if silu_and_mul else (n, block_n)
    if (silu_and_mul and n % 2) or out_n % tile_n or k % block_k:
        return (f"grouped GEMM tiles: N = {n} (output {out_n}) must be a multiple of {tile_n} and K = {k} "
                f"of {block_k}")
    return None


def _tiles_problem(block_m: int, threads: int) -> str | None:
    """Why ``block_m`` rows on ``threads`` threads are refused, or None: only 128 rows on 256 threads (one producer
    and two consumer warpgroups once TileLang specializes them) ran on a GPU. The 64-row, 128-thread program
    compiled on an H100 but did not finish within the tiles probe's time limit
    (``benchmarks/results/moe-tilelang-tiles-h100-d7722cd-partial.json``)."""
    if (block_m, threads) != (128, 256):
        return f"grouped GEMM tiles: block_m = {block_m}, threads = {threads}; only block_m 128 on 256 threads runs"
    return None


def _options_problem(tiles: dict) -> str | None:
    """Why ``tiles``' epilogue options (``store``, ``gate_up_mma``) are not known values, or None."""
    for key, values in {"store": ("direct", "shared"), "gate_up_mma": ("split", "merged")}.items():
        if tiles.get(key, values[0]) not in values:
            return f"grouped GEMM tiles: {key} = {tiles[key]!r}; one of {values}"
    return None


def _problem(n: int, k: int, silu_and_mul: bool, tiles: dict) -> str | None:
    """Why ``tiles`` (block_m, block_n, block_k, threads, store, gate_up_mma) do not suit a weight [E, N, K], or
    None: the first of :func:`_shape_problem`, :func:`_tiles_problem` and :func:`_options_problem`."""
    return (_shape_problem(n, k, silu_and_mul, tiles["block_n"], tiles["block_k"])
            or _tiles_problem(tiles["block_m"], tiles["threads"]) or _options_problem(tiles))


@functools.lru_cache(maxsize=None)
def _compiled(num_experts: int, n: int, k: int, dtype: str, silu_and_mul: bool, tiles: tuple):
    import tilelang

    return tilelang.compile(build_grouped_gemm(num_experts, n, k, dtype, silu_and_mul, **dict(tiles)),
                            out_idx=None, target="cuda")


def grouped_gemm_applies(w: torch.Tensor, silu_and_mul: bool, tiles: dict | None = None) -> bool:
    """Whether :func:`grouped_gemm_tilelang` takes a weight of this shape with these tiles."""
    t = {**DEFAULT_TILES, **(tiles or {})}
    _, n, k = w.shape
    return w.dtype in (torch.bfloat16, torch.float16) and not _problem(n, k, silu_and_mul, t)


def grouped_gemm_tilelang(a: torch.Tensor, w: torch.Tensor, group_ends: torch.Tensor, silu_and_mul: bool,
                          out: torch.Tensor | None = None, tiles: dict | None = None) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ w[e].T`` per expert e (``silu(g) * u`` of its two halves with
    ``silu_and_mul``), on one TileLang launch.

    Args:
        a: [P, K] bf16/fp16, expert e's rows ``group_ends[e-1] .. group_ends[e]`` (rows past the last end are
            neither read into any output nor written).
        w: [E, N, K] of a's dtype, contiguous (N = 2I, gate rows then up rows, with ``silu_and_mul``).
        group_ends: [E] int32 on a's device, non-decreasing, at most P.
        out: [P, N] ([P, I] with ``silu_and_mul``) to write, else a new tensor (rows outside every group are
            left as they were).
        tiles: overrides of :data:`DEFAULT_TILES`.
    Returns:
        out.
    Raises:
        ValueError: on shapes or dtypes the program does not take (:func:`grouped_gemm_applies`).
    """
    num_experts, n, k = w.shape
    if a.dim() != 2 or a.shape[1] != k or a.dtype != w.dtype or group_ends.shape != (num_experts,) \
            or group_ends.dtype != torch.int32 or not grouped_gemm_applies(w, silu_and_mul, tiles):
        raise ValueError(f"grouped GEMM: rows {tuple(a.shape)} {a.dtype}, weight {tuple(w.shape)} {w.dtype}, "
                         f"group ends {tuple(group_ends.shape)} {group_ends.dtype} (silu_and_mul={silu_and_mul})")
    out_n = n // 2 if silu_and_mul else n
    if out is None:
        out = torch.empty(a.shape[0], out_n, dtype=a.dtype, device=a.device)
    if a.shape[0] == 0:
        return out
    t = tuple(sorted({**DEFAULT_TILES, **(tiles or {})}.items()))
    kernel = _compiled(num_experts, n, k, str(a.dtype).removeprefix("torch."), silu_and_mul, t)
    kernel(a.contiguous(), w.reshape(num_experts * n, k), group_ends, out)
    return out
