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

``build_grouped_gemm(..., silu_and_mul=True)`` is the gate/up GEMM with SwiGLU fused: the program holds a gate and
an up accumulator for the same ``block_n / 2`` intermediate channels (weight rows ``c`` and ``I + c`` of
``w13`` [E, 2I, H]) and stores ``silu(gate) * up`` [P, I] (no [P, 2I] intermediate, no activation launch).
``silu_and_mul=False`` is the down GEMM (``w2`` [E, H, I]).

Measured on an H100, these programs are slower than torch's grouped GEMM: V2-Lite's two GEMMs at 2048 tokens take
717-824 us (47-54% of the matmul rate) against torch's 603 us (65%). So ``fused_moe`` runs them only when asked
(``fused_moe.GROUPED_TILELANG``).

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


def build_grouped_gemm_persistent(num_experts: int, n: int, k: int, dtype: str, silu_and_mul: bool, num_sms: int,
                                  block_n: int = 256, block_k: int = 64, num_stages: int = 3, mma_depth: int = 1):
    """The same grouped GEMM as :func:`build_grouped_gemm` as one persistent, warp-specialized program.

    ``num_sms`` programs of 384 threads walk the output tiles (128 rows of one expert x ``block_n`` columns,
    the column tiles of an M-tile next to each other) in turn. In each, one producer warpgroup (40 registers a
    thread) streams the tile's rows and weight rows through a ring of ``num_stages`` shared-memory stages by
    TMA, and two math warpgroups (232 registers; 64 rows each) multiply them on ``wgmma``, each into two
    64 x ``block_n / 2`` float32 accumulators: the gate and the up channels with ``silu_and_mul`` (stored as
    ``silu(gate) * up``), else the two halves of the tile's columns. ``mma_depth`` 1 keeps a step's products in
    flight while the next step's are issued and frees a stage one step late (as CUTLASS's and DeepGEMM's
    Hopper GEMMs do); 0 waits for each step's products. A tile's output goes through shared memory: a full
    one by TMA, an expert's last (partial) one by row-masked vector stores. The first producer pass over the
    tiles and the math warpgroups' epilogue of one tile overlap the next tile's loads, which the one-tile-a-
    program form (:func:`build_grouped_gemm`) cannot do.

    Args:
        num_experts, n, k: the weight ``w`` [E, N, K] (N = 2I with ``silu_and_mul``).
        dtype: "bfloat16" or "float16".
        silu_and_mul: the gate/up GEMM with SwiGLU fused (output [P, N / 2]), else a plain product ([P, N]).
        num_sms: the device's multiprocessors (the persistent grid).
        block_n: output columns of a tile, gate and up counted together with ``silu_and_mul``.
        block_k: the reduction step; num_stages: the ring's depth; mma_depth: 0 or 1 (above).
    Returns:
        a prim_func of (a [P, K], w [E * N, K], group_ends [E] int32, out [P, N or N / 2]); P is dynamic.
    Raises:
        ValueError: on tiles that do not divide the weight (:func:`_shape_problem`).
    Source: the warp-specialized persistent Hopper GEMM of CUTLASS (``KernelTmaWarpSpecializedCooperative``)
    and DeepGEMM's m-grouped GEMM, here with our alignment's group ends and SwiGLU in the epilogue.
    """
    import tilelang
    import tilelang.language as T

    problem = _shape_problem(n, k, silu_and_mul, block_n, block_k)
    if problem:
        raise ValueError(problem)
    half_m, block_m, tn = 64, 128, block_n // 2
    out_n = n // 2 if silu_and_mul else n
    num_n = out_n // tn if silu_and_mul else out_n // block_n  # column tiles of the output
    out_w = tn if silu_and_mul else block_n  # output columns a tile writes
    k_iters = k // block_k
    search = max(1, (num_experts - 1).bit_length())
    accum = "float32"
    num_rows = T.dynamic("num_rows")

    @T.macro
    def resolve(tile, s_cum, s_ends, lo, hi, info):
        """info <- (expert, first row, valid rows, column tile) of output tile ``tile``."""
        m_tile = tile // num_n
        lo[0] = 0
        hi[0] = num_experts - 1
        for _ in T.serial(search):  # the expert whose M-tiles hold m_tile
            mid = (lo[0] + hi[0]) >> 1
            if s_cum[mid + 1] <= m_tile:
                lo[0] = mid + 1
            else:
                hi[0] = mid
        e = lo[0]
        start = T.if_then_else(e > 0, s_ends[T.max(e - 1, 0)], 0)
        info[0] = e
        info[1] = start + (m_tile - s_cum[e]) * block_m
        info[2] = s_ends[e] - info[1]
        info[3] = tile % num_n

    @T.macro
    def math_warpgroup(wg, a_s, b0_s, b1_s, full, empty, acc0, acc1, c_s, s_cum, s_ends, out, pid, num_waves,
                       total):
        T.inc_max_nreg(232)
        lo = T.alloc_local((1,), "int32")
        hi = T.alloc_local((1,), "int32")
        info = T.alloc_local((4,), "int32")
        prev = T.alloc_local((1,), "int32")
        gi = T.alloc_var("int32", init=0)
        for wave in T.serial(num_waves):
            tile = wave * num_sms + pid
            if tile < total:
                resolve(tile, s_cum, s_ends, lo, hi, info)
                for kk in T.serial(k_iters):
                    slot = gi % num_stages
                    T.barrier_wait(full[slot], (gi // num_stages) & 1)
                    T.wgmma_gemm(a_s[slot, :, :], b0_s[slot, :, :], acc0, transpose_B=True,
                                 policy=T.GemmWarpPolicy.FullRow, clear_accum=(kk == 0))
                    T.wgmma_gemm(a_s[slot, :, :], b1_s[slot, :, :], acc1, transpose_B=True,
                                 policy=T.GemmWarpPolicy.FullRow, clear_accum=(kk == 0))
                    if mma_depth == 1:
                        if kk > 0:  # the previous step's products are done: free their stage
                            T.wait_wgmma(2)
                            T.barrier_arrive(empty[prev[0]])
                    else:
                        T.wait_wgmma(0)
                        T.barrier_arrive(empty[slot])
                    prev[0] = slot
                    gi = gi + 1
                if mma_depth == 1:
                    T.wait_wgmma(0)
                    T.barrier_arrive(empty[prev[0]])
                T.warpgroup_fence_operand(acc0, num_regs=half_m * tn // 128)
                T.warpgroup_fence_operand(acc1, num_regs=half_m * tn // 128)
                row0 = info[1] + wg * half_m
                rows = T.max(0, T.min(half_m, info[2] - wg * half_m))
                col0 = info[3] * out_w
                T.sync_threads(barrier_id=4 + wg, arrive_count=128)  # the last tile's store has read c_s
                if silu_and_mul:
                    for i, j in T.Parallel(half_m, tn):
                        c_s[i, j] = T.cast(acc0[i, j] / (1.0 + T.exp(-acc0[i, j])) * acc1[i, j], dtype)
                else:
                    for i, j in T.Parallel(half_m, tn):
                        c_s[i, j] = T.cast(acc0[i, j], dtype)
                    for i, j in T.Parallel(half_m, tn):
                        c_s[i, tn + j] = T.cast(acc1[i, j], dtype)
                T.fence_proxy_async()
                T.sync_threads(barrier_id=4 + wg, arrive_count=128)
                if rows == half_m:
                    T.copy(c_s, out[row0:row0 + half_m, col0:col0 + out_w])
                elif rows > 0:
                    for i, j in T.Parallel(half_m, out_w):
                        if i < rows:
                            out[row0 + i, col0 + j] = c_s[i, j]

    @T.prim_func
    def grouped_gemm_persistent(
        a: T.Tensor((num_rows, k), dtype),
        w: T.Tensor((num_experts * n, k), dtype),
        group_ends: T.Tensor((num_experts,), "int32"),
        out: T.Tensor((num_rows, out_n), dtype),
    ):
        with T.Kernel(num_sms, threads=384) as (pid,):
            a_top = T.alloc_shared((num_stages, half_m, block_k), dtype)
            a_bot = T.alloc_shared((num_stages, half_m, block_k), dtype)
            b0_s = T.alloc_shared((num_stages, tn, block_k), dtype)
            b1_s = T.alloc_shared((num_stages, tn, block_k), dtype)
            c_s0 = T.alloc_shared((half_m, out_w), dtype)
            c_s1 = T.alloc_shared((half_m, out_w), dtype)
            acc0_0 = T.alloc_fragment((half_m, tn), accum)
            acc1_0 = T.alloc_fragment((half_m, tn), accum)
            acc0_1 = T.alloc_fragment((half_m, tn), accum)
            acc1_1 = T.alloc_fragment((half_m, tn), accum)
            s_ends = T.alloc_shared((num_experts,), "int32")
            s_cum = T.alloc_shared((num_experts + 1,), "int32")
            T.annotate_layout({buf: tilelang.layout.make_swizzled_layout(buf)
                               for buf in (a_top, a_bot, b0_s, b1_s, c_s0, c_s1)})
            full = T.alloc_barrier([128] * num_stages)  # the producer's threads, and the TMA bytes
            empty = T.alloc_barrier([256] * num_stages)  # both math warpgroups' threads
            tx = T.get_thread_binding()
            for e in T.Parallel(num_experts):
                s_ends[e] = group_ends[e]
            T.sync_threads()
            if tx == 0:  # M-tiles before each expert's
                s_cum[0] = 0
                for e in T.serial(num_experts):
                    start = T.if_then_else(e > 0, s_ends[T.max(e - 1, 0)], 0)
                    s_cum[e + 1] = s_cum[e] + T.ceildiv(s_ends[e] - start, block_m)
            T.sync_threads()
            total = s_cum[num_experts] * num_n
            num_waves = T.ceildiv((T.ceildiv(num_rows, block_m) + num_experts) * num_n, num_sms)
            if tx < 128:  # the producer warpgroup
                T.dec_max_nreg(40)
                lo = T.alloc_local((1,), "int32")
                hi = T.alloc_local((1,), "int32")
                info = T.alloc_local((4,), "int32")
                gi = T.alloc_var("int32", init=0)
                for wave in T.serial(num_waves):
                    tile = wave * num_sms + pid
                    if tile < total:
                        resolve(tile, s_cum, s_ends, lo, hi, info)
                        row0 = info[1]
                        wrow = info[0] * n + info[3] * (tn if silu_and_mul else block_n)
                        off1 = (n // 2) if silu_and_mul else tn
                        for kk in T.serial(k_iters):
                            slot = gi % num_stages
                            k0 = kk * block_k
                            T.barrier_wait(empty[slot], ((gi // num_stages) & 1) ^ 1)
                            T.tma_copy(a[row0:row0 + half_m, k0:k0 + block_k], a_top[slot, :, :],
                                       barrier=full[slot])
                            T.tma_copy(a[row0 + half_m:row0 + block_m, k0:k0 + block_k], a_bot[slot, :, :],
                                       barrier=full[slot])
                            T.tma_copy(w[wrow:wrow + tn, k0:k0 + block_k], b0_s[slot, :, :], barrier=full[slot])
                            T.tma_copy(w[wrow + off1:wrow + off1 + tn, k0:k0 + block_k], b1_s[slot, :, :],
                                       barrier=full[slot])
                            T.barrier_arrive(full[slot])
                            gi = gi + 1
            elif tx < 256:
                math_warpgroup(0, a_top, b0_s, b1_s, full, empty, acc0_0, acc1_0, c_s0, s_cum, s_ends, out, pid,
                               num_waves, total)
            else:
                math_warpgroup(1, a_bot, b0_s, b1_s, full, empty, acc0_1, acc1_1, c_s1, s_cum, s_ends, out, pid,
                               num_waves, total)

    return grouped_gemm_persistent


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
    """Why ``tiles``' program and epilogue options (``kernel``, ``store``, ``gate_up_mma``, ``mma_depth``) are not
    known values, or None."""
    for key, values in {"kernel": ("tiles", "persistent"), "store": ("direct", "shared"),
                        "gate_up_mma": ("split", "merged"), "mma_depth": (1, 0)}.items():
        if tiles.get(key, values[0]) not in values:
            return f"grouped GEMM tiles: {key} = {tiles[key]!r}; one of {values}"
    return None


_SMEM_BYTES = 227 * 1024  # a Hopper multiprocessor's shared memory for one program


def _smem_problem(n: int, silu_and_mul: bool, tiles: dict, itemsize: int = 2) -> str | None:
    """Why the persistent program's stages and output staging do not fit in shared memory, or None."""
    if tiles.get("kernel", "tiles") != "persistent":
        return None
    block_n, block_k, stages = tiles["block_n"], tiles["block_k"], tiles["num_stages"]
    out_w = block_n // 2 if silu_and_mul else block_n
    need = (stages * (128 + block_n) * block_k + 2 * 64 * out_w) * itemsize
    if need > _SMEM_BYTES:
        return (f"grouped GEMM tiles: the persistent program needs {need // 1024} KiB of shared memory with "
                f"{stages} stages of {block_n} x {block_k}; at most {_SMEM_BYTES // 1024}")
    return None


def _problem(n: int, k: int, silu_and_mul: bool, tiles: dict) -> str | None:
    """Why ``tiles`` (block_m, block_n, block_k, threads, num_stages and the options) do not suit a weight
    [E, N, K], or None: the first of :func:`_shape_problem`, :func:`_tiles_problem`, :func:`_options_problem`
    and :func:`_smem_problem`."""
    return (_shape_problem(n, k, silu_and_mul, tiles["block_n"], tiles["block_k"])
            or _tiles_problem(tiles["block_m"], tiles["threads"]) or _options_problem(tiles)
            or _smem_problem(n, silu_and_mul, tiles))


@functools.lru_cache(maxsize=None)
def _compiled(num_experts: int, n: int, k: int, dtype: str, silu_and_mul: bool, tiles: tuple, num_sms: int = 0):
    import tilelang

    t = dict(tiles)
    if t.get("kernel", "tiles") == "persistent":
        func = build_grouped_gemm_persistent(num_experts, n, k, dtype, silu_and_mul, num_sms, block_n=t["block_n"],
                                             block_k=t["block_k"], num_stages=t["num_stages"],
                                             mma_depth=t.get("mma_depth", 1))
        return tilelang.compile(func, out_idx=None, target="cuda", pass_configs={
            "tl.disable_warp_specialized": True, "tl.disable_thread_storage_sync": True})
    t.pop("kernel", None)
    t.pop("mma_depth", None)
    return tilelang.compile(build_grouped_gemm(num_experts, n, k, dtype, silu_and_mul, **t),
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
    t = {**DEFAULT_TILES, **(tiles or {})}
    num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count if t.get("kernel") == "persistent" else 0
    kernel = _compiled(num_experts, n, k, str(a.dtype).removeprefix("torch."), silu_and_mul, tuple(sorted(t.items())),
                       num_sms)
    kernel(a.contiguous(), w.reshape(num_experts * n, k), group_ends, out)
    return out
