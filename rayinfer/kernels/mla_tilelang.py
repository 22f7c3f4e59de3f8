"""Absorbed MLA decode attention as a TileLang kernel (split-KV), the GPU alternative to the Triton kernel.

Same contract as :func:`rayinfer.kernels.mla_attention.mla_decode_ref`: every head's query (latent part
``q_latent`` [T, H, R] and roped part ``q_pe`` [T, H, P]) attends causally over one layer's compressed
paged cache ``[num_blocks, block_size, R + P]`` as multi-query attention with values the latents
(DeepSeek-V2 section 2.1.3). Program (t, g, s) handles query token t, a tile of ``BLOCK_H`` heads and
split s of the token's keys: it finds the token's request in ``query_start_loc``, gathers ``BLOCK_N``
cached rows at a time through the block table into shared memory, and runs the FlashAttention-2 online
softmax with both products on the tensor cores (``T.gemm``: scores ``[BLOCK_H, BLOCK_N]`` from the latent
and rope parts, output ``[BLOCK_H, R]`` from the latents). Splits follow the Triton kernel's rule
(:mod:`rayinfer.kernels.mla_attention`): the launch's split count is fixed by the shapes (graph-safe), each
token uses one split per ``_MIN_SPLIT_TOKENS`` of its own keys, unused splits write an empty
log-sum-exp, and the Triton merge kernel combines the partial outputs.

A second program, :func:`build_mla_decode_keys_as_rows`, swaps the products' operands so that 64 keys fill the
warpgroup MMA's rows (16 or 32 heads as its columns) and streams each tile as one bulk (TMA) copy of one cache
block's run; it is the default where it applies (cache blocks of a multiple of 64 tokens). It merges a token's
splits itself (:func:`merge_kind`): at 2 splits the token's programs form a thread-block cluster and merge through
each other's shared memory, at 3-4 the token's last program to finish merges the partials from L2, at more the
Triton merge kernel runs after it (``merge="spread"``, asked for by name: each program merges one slice of R once
the token's programs have all arrived). The head-tile program copies a tile per cache block, which TileLang 0.1.15
does not pipeline (its copies run synchronously).

TileLang is optional (not a dependency of the package): :func:`tilelang_available` says whether it is
importable with a CUDA device; ``RAYINFER_MLA_BACKEND=tilelang`` makes :func:`mla_decode` take this kernel
(``kernels.mla_attention``), ``RAYINFER_MLA_BACKEND=auto`` the keys-as-rows program for steps of 64 tokens
or more. Kernels are compiled once per (heads, R, P, block size, dtype, splits) shape.
Source: DeepSeek-V2 (2024) for the absorbed form; FlashMLA's decode layout; TileLang's published MLA
decode examples for the shape of a TileLang flash-decoding kernel.
"""

# no "from __future__ import annotations": TileLang evaluates the kernel signature's annotations

import functools
import importlib.util

import torch

from rayinfer.kernels.attention_metadata import AttentionMetadata

_MIN_SPLIT_TOKENS = 128
_LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=1)
def tilelang_available() -> bool:
    """Whether TileLang is importable and a CUDA device is present."""
    return importlib.util.find_spec("tilelang") is not None and torch.cuda.is_available()


def _torch_dtype_name(dtype: torch.dtype) -> str:
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ValueError(f"the TileLang MLA decode kernel takes bfloat16 or float16, not {dtype}")
    return names[dtype]


def build_mla_decode(num_heads: int, rank: int, rope: int, block_size: int, dtype: str, num_splits: int,
                     block_h: int = 16, block_n: int = 64, threads: int = 128, num_stages: int = 2,
                     gather: str = "blocks", min_split_tokens: int = _MIN_SPLIT_TOKENS, policy: str = "row",
                     swizzle: bool = False):
    """The TileLang program of one (shape, split count); see the module docstring.

    Args:
        num_heads, rank, rope: H, R, P (R and P multiples of 16).
        block_size: tokens per cache block.
        dtype: "bfloat16" or "float16" (queries, cache and output).
        num_splits: splits of the launch (>= 1); 1 writes the output, more write partial outputs
            [T, H, num_splits, R] float32 and log-sum-exps [T, H, num_splits] (base 2) for the merge.
        block_h: query rows of a program; more than H pads the rows (zero queries, never written), which
            lets Hopper's warpgroup MMA (64 rows deep) take a tile of 16 heads, as FlashMLA pads its heads.
        policy: "row" splits the products' rows over the warps (``GemmWarpPolicy.FullRow``), "col" their
            columns (``FullCol``: with 64 rows and two warpgroups each computes half the scores and half
            the latent output columns, FlashMLA's split of the [64, 512] accumulator).
        swizzle: a swizzled shared-memory layout for the probabilities tile (fewer bank conflicts).
    Returns:
        a ``tilelang.language`` prim_func with arguments (q_latent [T, H, R], q_pe [T, H, P],
        kv_cache [NB, block_size, R + P], query_start_loc [num_reqs + 1] int32, seq_lens [num_reqs] int32,
        block_tables [num_reqs, max_blocks] int32, part_out, part_lse, out [T, H, R], qk_scale float32
        already multiplied by log2(e)); T, NB, num_reqs and max_blocks are dynamic.
    """
    import tilelang.language as T
    from tilelang.layout import make_swizzled_layout

    accum = "float32"
    width = rank + rope
    head_tiles = -(-num_heads // block_h)
    num_tokens = T.dynamic("num_tokens")
    num_blocks = T.dynamic("num_blocks")
    num_reqs = T.dynamic("num_reqs")
    max_blocks = T.dynamic("max_blocks")
    splits = num_splits
    sub = min(block_n, block_size)  # rows per copy: a run inside one cache block
    if block_n % sub or block_size % sub:
        raise ValueError(f"block_n {block_n} and block_size {block_size} must be multiples of each other")
    if policy not in ("row", "col"):
        raise ValueError(f"policy must be 'row' or 'col', not {policy!r}")
    warp_policy = T.GemmWarpPolicy.FullRow if policy == "row" else T.GemmWarpPolicy.FullCol

    @T.prim_func
    def mla_decode_kernel(
        q_latent: T.Tensor((num_tokens, num_heads, rank), dtype),
        q_pe: T.Tensor((num_tokens, num_heads, rope), dtype),
        kv_cache: T.Tensor((num_blocks, block_size, width), dtype),
        query_start_loc: T.Tensor((num_reqs + 1,), "int32"),
        seq_lens: T.Tensor((num_reqs,), "int32"),
        block_tables: T.Tensor((num_reqs, max_blocks), "int32"),
        part_out: T.Tensor((num_tokens, num_heads, splits, rank), accum),
        part_lse: T.Tensor((num_tokens, num_heads, splits), accum),
        out: T.Tensor((num_tokens, num_heads, rank), dtype),
        qk_scale: T.float32,
    ):
        with T.Kernel(num_tokens, head_tiles, splits, threads=threads) as (tok, tile, split):
            q_shared = T.alloc_shared((block_h, rank), dtype)
            qp_shared = T.alloc_shared((block_h, rope), dtype)
            kv_shared = T.alloc_shared((block_n, rank), dtype)
            kp_shared = T.alloc_shared((block_n, rope), dtype)
            p_shared = T.alloc_shared((block_h, block_n), dtype)
            scores = T.alloc_fragment((block_h, block_n), accum)
            acc = T.alloc_fragment((block_h, rank), accum)
            m_prev = T.alloc_fragment((block_h,), accum)
            m_cur = T.alloc_fragment((block_h,), accum)
            alpha = T.alloc_fragment((block_h,), accum)
            row_sum = T.alloc_fragment((block_h,), accum)
            l_sum = T.alloc_fragment((block_h,), accum)
            req = T.alloc_var("int32")
            kv_lo = T.alloc_var("int32")
            kv_hi = T.alloc_var("int32")
            if swizzle:
                T.annotate_layout({p_shared: make_swizzled_layout(p_shared)})

            # the request of this token: the last r with query_start_loc[r] <= tok
            req = 0
            for r in T.serial(num_reqs):
                if query_start_loc[r] <= tok:
                    req = r
            kv_hi = seq_lens[req] - (query_start_loc[req + 1] - tok) + 1  # own position + 1
            kv_lo = 0
            if splits > 1:
                used = T.min(splits, T.max(T.ceildiv(kv_hi, min_split_tokens), 1))
                split_size = T.ceildiv(T.ceildiv(kv_hi, used), block_n) * block_n
                kv_lo = split * split_size
                kv_hi = T.min(kv_hi, kv_lo + split_size)

            for i, j in T.Parallel(block_h, rank):
                q_shared[i, j] = T.if_then_else(tile * block_h + i < num_heads,
                                                q_latent[tok, tile * block_h + i, j], T.cast(0, dtype))
            for i, j in T.Parallel(block_h, rope):
                qp_shared[i, j] = T.if_then_else(tile * block_h + i < num_heads,
                                                 q_pe[tok, tile * block_h + i, j], T.cast(0, dtype))
            T.fill(acc, 0)
            T.fill(l_sum, 0)
            T.fill(m_cur, -T.infinity(accum))

            num_tiles = T.ceildiv(T.max(kv_hi - kv_lo, 0), block_n)
            for k in T.Pipelined(num_tiles, num_stages=num_stages):
                start = kv_lo + k * block_n
                if gather == "rows":
                    for i, j in T.Parallel(block_n, rank):
                        pos = T.min(start + i, kv_hi - 1)
                        kv_shared[i, j] = kv_cache[block_tables[req, pos // block_size], pos % block_size, j]
                    for i, j in T.Parallel(block_n, rope):
                        pos = T.min(start + i, kv_hi - 1)
                        kp_shared[i, j] = kv_cache[block_tables[req, pos // block_size], pos % block_size, rank + j]
                else:  # whole runs of a cache block per copy (async copies the pipeline can overlap)
                    # rows past the token's keys are read as they are: their scores are masked to -inf,
                    # so their probabilities are 0, which needs finite values there (the engine
                    # zero-initializes its caches and writes only finite latents)
                    for c in T.unroll(block_n // sub):
                        first = start + c * sub  # a multiple of sub: kv_lo and start are multiples of block_n
                        blk = block_tables[req, T.min(first // block_size, max_blocks - 1)]
                        if sub == block_size:  # a whole cache block: a static slice the compiler can bound
                            T.copy(kv_cache[blk, 0:sub, 0:rank], kv_shared[c * sub:(c + 1) * sub, :])
                            T.copy(kv_cache[blk, 0:sub, rank:width], kp_shared[c * sub:(c + 1) * sub, :])
                        else:
                            off = first % block_size
                            T.copy(kv_cache[blk, off:off + sub, 0:rank], kv_shared[c * sub:(c + 1) * sub, :])
                            T.copy(kv_cache[blk, off:off + sub, rank:width], kp_shared[c * sub:(c + 1) * sub, :])
                T.clear(scores)
                T.gemm(q_shared, kv_shared, scores, transpose_B=True, policy=warp_policy)
                T.gemm(qp_shared, kp_shared, scores, transpose_B=True, policy=warp_policy)
                for i, j in T.Parallel(block_h, block_n):
                    scores[i, j] = T.if_then_else(start + j < kv_hi, scores[i, j] * qk_scale, -T.infinity(accum))
                T.copy(m_cur, m_prev)
                T.reduce_max(scores, m_cur, dim=1, clear=False)
                for i in T.Parallel(block_h):
                    alpha[i] = T.exp2(m_prev[i] - m_cur[i])
                for i, j in T.Parallel(block_h, block_n):
                    scores[i, j] = T.exp2(scores[i, j] - m_cur[i])
                T.reduce_sum(scores, row_sum, dim=1)
                for i in T.Parallel(block_h):
                    l_sum[i] = l_sum[i] * alpha[i] + row_sum[i]
                for i, j in T.Parallel(block_h, rank):
                    acc[i, j] *= alpha[i]
                T.copy(scores, p_shared)
                T.gemm(p_shared, kv_shared, acc, policy=warp_policy)

            if splits > 1:
                for i in T.Parallel(block_h):
                    if tile * block_h + i < num_heads:
                        part_lse[tok, tile * block_h + i, split] = T.if_then_else(
                            l_sum[i] > 0, m_cur[i] + T.log2(T.max(l_sum[i], 1e-30)), -T.infinity(accum))
                if kv_lo < kv_hi:
                    for i, j in T.Parallel(block_h, rank):
                        if tile * block_h + i < num_heads:
                            part_out[tok, tile * block_h + i, split, j] = acc[i, j] / l_sum[i]
            else:
                for i, j in T.Parallel(block_h, rank):
                    if tile * block_h + i < num_heads:
                        out[tok, tile * block_h + i, j] = T.cast(acc[i, j] / l_sum[i], dtype)

    return mla_decode_kernel


def build_mla_decode_keys_as_rows(num_heads: int, rank: int, rope: int, block_size: int, dtype: str, num_splits: int,
                                  block_n: int = 64, threads: int = 128, num_stages: int = 2,
                                  min_split_tokens: int = _MIN_SPLIT_TOKENS, pdl: bool = True,
                                  merge: str = "cluster"):
    """The TileLang program with keys as the products' rows: scores ``S^T = K Q^T`` ([BLOCK_N, H]) and output
    ``O^T += V^T P^T`` ([R, H]), so a tile of 64 keys fills the 64 rows of Hopper's warpgroup MMA that 16
    heads cannot, and both products read their operands from shared memory (the K tile serves as ``A`` of
    the first and, transposed, of the second). The online softmax runs along the keys (axis 0). Each tile is
    one run inside one cache block (``block_size`` a multiple of ``block_n``): its block number is one load
    and its rows one bulk (TMA) copy, which TileLang pipelines with a producer warpgroup of its own.

    ``pdl``: the program waits on the kernel before it (programmatic dependent launch) before its loads, then
    lets the next kernel launch (whose own wait orders it after this one, as the Triton kernels' ``pdl_wait``);
    TileLang places the wait at the program's start, so the launch and the barriers' set-up overlap that
    kernel's tail (about 1 us a launch on an H100). No cache row may be read before that wait, not even one
    before the token's own new rows: the KV manager registers a block in the prefix cache when it allocates it,
    so another request of the same step can attend over rows that this step's forward pass is still writing.
    The token's request comes from two loads in a decode step (one token a request), else from a binary search
    over ``query_start_loc``.

    ``merge``, with more than one split (:data:`MERGES`):
        "cluster" (2 to :data:`MAX_CLUSTER_SPLITS` splits): the token's programs are one thread-block cluster
        (grid y); each stores its normalized output's rows ``[d * R / S, (d + 1) * R / S)`` and its log-sum-exps
        into program d's shared memory (``st.shared::cluster``), and after a cluster barrier each merges its
        slice of R for all heads into ``out``. The cluster's programs must fit the GPU at once: at one program
        per multiprocessor, clusters of 4 and 8 did not all fit one wave of an H100.
        "last_program": every program writes its partials; the token's last program to arrive on its
        ``counters`` entry (a fenced atomic increment: the "threadfence reduction" of CUDA's programming guide)
        reads them back from L2, writes ``out`` and resets the counter to 0.
        "spread": every program writes its partials and arrives on the counter (adding 32 / S, so a launch adds
        32 to each token's count: the count stays a multiple of 32 between launches, and each launch's arrivals
        are counted from there), then waits until all S have arrived and merges its own slice
        ``[d * R / S, (d + 1) * R / S)`` of R for all heads from L2: the merge's reads are shared by the S
        programs instead of falling on the last one. A program that waits longer than
        :data:`SPREAD_WAIT_NS` (its siblings not resident, e.g. more programs than one wave) gives its slice up
        on the token's second counter word, and the last to arrive merges every slice given up before it
        arrived (both sides fence between their atomic and their read, so no slice is left unmerged; a slice
        given up after the last arrival is merged by its own program, and a late bit only makes a later launch
        merge that slice twice).
        "launch": the program writes partials only; the caller launches a merge kernel.

    Same arguments, splits and outputs as :func:`build_mla_decode`, plus ``counters`` [T, 2] int32 (the
    arrivals, a multiple of 32 between launches, and the slices given up, zeros; read by "last_program" and
    "spread" only), except that ``num_splits`` is a power of two up to 32 (TileLang
    0.1.15 cannot lower the partial outputs' stores at other counts); the registers hold the [R, H] float32
    accumulator only (64 a thread for R = 512, H = 16), so H is 16 or 32 (the probabilities tile, the second
    product's B operand, needs 32-byte rows).

    Raises:
        ValueError: when ``block_size`` is not a multiple of ``block_n``, ``block_n`` is not 64, the head
            count is not 16 or 32, ``num_splits`` is not a power of two up to 32, or ``merge`` is unknown.
    Source: FlashAttention-2's online softmax; the swapped-operand (keys as rows) form of the Triton kernel's
    ``swap_ab`` tiles; TileLang's paged MLA decode example for the one-copy-per-tile layout; CUDA's
    programming guide ("Distributed Shared Memory"; the threadfence reduction sample) for the two merges.
    """
    import tilelang.language as T
    from tilelang.cuda.language import cluster_sync, pdl_sync, pdl_trigger

    if block_n != 64 or block_size % block_n:
        raise ValueError(f"keys-as-rows tiles take 64 keys inside one cache block; got block_n {block_n}, "
                         f"block_size {block_size}")
    if num_heads not in (16, 32):
        raise ValueError(f"keys-as-rows tiles take 16 or 32 heads, got {num_heads}")
    if num_splits < 1 or num_splits > 32 or num_splits & (num_splits - 1):
        raise ValueError(f"keys-as-rows tiles take a power of two up to 32 splits, got {num_splits}")
    accum = "float32"
    width = rank + rope
    heads = num_heads
    num_tokens = T.dynamic("num_tokens")
    num_rows = T.dynamic("num_rows")
    num_reqs = T.dynamic("num_reqs")
    max_blocks = T.dynamic("max_blocks")
    stride_qt = T.dynamic("stride_qt")  # q_latent may be a transposed view ([H, T, R] storage), as
    stride_qh = T.dynamic("stride_qh")  # kernels.gemv.batched_linear leaves it
    splits = num_splits
    if merge not in MERGES:
        raise ValueError(f"the split merge is one of {MERGES}, got {merge!r}")
    in_program = in_program_merge(merge, splits)
    in_cluster, last_program = in_program == "cluster", in_program == "last_program"
    spread = in_program == "spread"
    slice_rows = rank // splits  # the rows of R each program of a cluster or a spread merge merges
    merge_loop = T.unroll if splits <= 8 else T.serial  # the last_program merge's loop over splits (registers)

    @T.macro
    def split_weights(lse_f, lse_max, lse_den, wgt):
        # the merge's weight of each split [splits, heads] from its log-sum-exps in lse_f (base 2; -inf: empty)
        T.reduce_max(lse_f, lse_max, dim=0)
        for s_, j in T.Parallel(splits, heads):
            lse_f[s_, j] = T.exp2(lse_f[s_, j] - lse_max[j])
        T.reduce_sum(lse_f, lse_den, dim=0)
        for s_, j in T.Parallel(splits, heads):
            wgt[s_, j] = lse_f[s_, j] / lse_den[j]

    @T.macro
    def merge_rows(part_out, out, wgt, merged, tok, row0, rows: int):
        # out[tok, :, row0:row0 + rows] from every split's partials (read from L2) weighted by wgt; merged is a
        # [heads, rows] fragment with threads along R (coalesced)
        T.clear(merged)
        for s_ in merge_loop(splits):
            for j, i in T.Parallel(heads, rows):
                merged[j, i] += wgt[s_, j] * T.call_extern(accum, "__ldcg", T.address_of(
                    part_out[tok, j, s_, row0 + i]))
        for j, i in T.Parallel(heads, rows):
            out[tok, j, row0 + i] = T.cast(merged[j, i], dtype)

    def launch():
        if in_cluster:  # a token's splits are one cluster (grid y), its programs' ranks their split numbers
            return T.ClusterKernel(num_tokens, splits, cluster_dims=(1, splits, 1), threads=threads)
        return T.Kernel(num_tokens, splits, threads=threads)

    @T.prim_func
    def mla_decode_keys_as_rows(
        q_latent: T.StridedTensor((num_tokens, heads, rank), (stride_qt, stride_qh, 1), dtype),
        q_pe: T.Tensor((num_tokens, heads, rope), dtype),
        kv_rows: T.Tensor((num_rows, width), dtype),  # the cache viewed as [num_blocks * block_size, R + P]
        query_start_loc: T.Tensor((num_reqs + 1,), "int32"),
        seq_lens: T.Tensor((num_reqs,), "int32"),
        block_tables: T.Tensor((num_reqs, max_blocks), "int32"),
        part_out: T.Tensor((num_tokens, heads, splits, rank), accum),
        part_lse: T.Tensor((num_tokens, heads, splits), accum),
        out: T.Tensor((num_tokens, heads, rank), dtype),
        counters: T.Tensor((num_tokens, 2), "int32"),  # arrivals (multiples of 32), slices given up (zeros)
        qk_scale: T.float32,
    ):
        with launch() as (tok, split):
            T.import_source(_MERGE_HELPERS)
            q_shared = T.alloc_shared((heads, rank), dtype)
            qp_shared = T.alloc_shared((heads, rope), dtype)
            kv_shared = T.alloc_shared((block_n, rank), dtype)
            kp_shared = T.alloc_shared((block_n, rope), dtype)
            p_shared = T.alloc_shared((block_n, heads), dtype)
            scores = T.alloc_fragment((block_n, heads), accum)
            acc = T.alloc_fragment((rank, heads), accum)
            m_prev = T.alloc_fragment((heads,), accum)
            m_cur = T.alloc_fragment((heads,), accum)
            alpha = T.alloc_fragment((heads,), accum)
            col_sum = T.alloc_fragment((heads,), accum)
            l_sum = T.alloc_fragment((heads,), accum)
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")

            # the request of this token: the last r with query_start_loc[r] <= tok. A decode step (one token a
            # request) has it at r = tok: two loads side by side; otherwise a binary search (each of its loads
            # waits on the one before, and the block table and the first bulk copy wait on all of them)
            guess = T.min(tok, num_reqs - 1)
            lo = 0
            hi = num_reqs
            if query_start_loc[guess] <= tok and tok < query_start_loc[guess + 1]:
                lo = guess + 1
                hi = guess + 1
            for _ in T.serial(31):
                if lo < hi:
                    if query_start_loc[(lo + hi) // 2] <= tok:
                        lo = (lo + hi) // 2 + 1
                    else:
                        hi = (lo + hi) // 2
            req = lo - 1
            n_keys = seq_lens[req] - (query_start_loc[req + 1] - tok) + 1  # own position + 1
            used = T.min(splits, T.max(T.ceildiv(n_keys, min_split_tokens), 1))
            split_size = T.ceildiv(T.ceildiv(n_keys, used), block_n) * block_n
            kv_lo = T.min(split * split_size, n_keys)
            kv_hi = T.min(n_keys, kv_lo + split_size)

            if pdl:
                pdl_sync()  # the query and the cache rows come from the kernels before
                pdl_trigger()  # the next kernel may launch (its own wait orders it after this one), as pdl_wait
            T.copy(q_latent[tok, :, :], q_shared)
            T.copy(q_pe[tok, :, :], qp_shared)
            T.fill(acc, 0)
            T.fill(l_sum, 0)
            T.fill(m_cur, -T.infinity(accum))

            for k in T.Pipelined(T.ceildiv(kv_hi - kv_lo, block_n), num_stages=num_stages):
                start = kv_lo + k * block_n
                # one run of block_n rows inside one cache block; rows past the token's keys are read as they
                # are and masked below (the engine zero-initializes its caches and writes finite latents)
                row0 = block_tables[req, start // block_size] * block_size + start % block_size
                T.copy(kv_rows[row0:row0 + block_n, 0:rank], kv_shared)
                T.copy(kv_rows[row0:row0 + block_n, rank:width], kp_shared)
                T.clear(scores)
                T.gemm(kv_shared, q_shared, scores, transpose_B=True)
                T.gemm(kp_shared, qp_shared, scores, transpose_B=True)
                for i, j in T.Parallel(block_n, heads):
                    scores[i, j] = T.if_then_else(start + i < kv_hi, scores[i, j] * qk_scale, -T.infinity(accum))
                T.copy(m_cur, m_prev)
                T.reduce_max(scores, m_cur, dim=0, clear=False)
                for j in T.Parallel(heads):
                    alpha[j] = T.exp2(m_prev[j] - m_cur[j])
                for i, j in T.Parallel(block_n, heads):
                    scores[i, j] = T.exp2(scores[i, j] - m_cur[j])
                T.reduce_sum(scores, col_sum, dim=0)
                for j in T.Parallel(heads):
                    l_sum[j] = l_sum[j] * alpha[j] + col_sum[j]
                for i, j in T.Parallel(rank, heads):
                    acc[i, j] *= alpha[j]
                T.copy(scores, p_shared)
                T.gemm(kv_shared, p_shared, acc, transpose_A=True)

            if in_cluster:
                # the split merge inside the cluster: each program stores its normalized output's rows
                # [d * slice_rows, (d + 1) * slice_rows) and its log-sum-exps into program d's shared memory,
                # then each merges one slice of R for all heads and stores it
                recv = T.alloc_shared((rank, heads), accum)
                lse_recv = T.alloc_shared((splits, heads), accum)
                lse_f = T.alloc_fragment((splits, heads), accum)
                lse_max = T.alloc_fragment((heads,), accum)
                lse_den = T.alloc_fragment((heads,), accum)
                wgt = T.alloc_shared((splits, heads), accum)
                merged = T.alloc_fragment((slice_rows, heads), accum)
                # TileLang places these buffers over the cache tiles and the query (it sees no writes to
                # them, the remote stores being extern calls): no program stores into another before every
                # program of the cluster has left its key loop
                cluster_sync()
                for j in T.Parallel(heads):
                    for d in T.serial(splits):
                        T.call_extern("handle", "rl_store_remote", T.address_of(lse_recv[split, j]), T.if_then_else(
                            l_sum[j] > 0, m_cur[j] + T.log2(T.max(l_sum[j], 1e-30)), -T.infinity(accum)), d)
                for i, j in T.Parallel(rank, heads):
                    T.call_extern("handle", "rl_store_remote",
                                  T.address_of(recv[split * slice_rows + i % slice_rows, j]),
                                  acc[i, j] / T.max(l_sum[j], 1e-30), i // slice_rows)
                cluster_sync()
                T.copy(lse_recv, lse_f)
                split_weights(lse_f, lse_max, lse_den, wgt)
                T.clear(merged)
                for s_ in T.serial(splits):
                    for i, j in T.Parallel(slice_rows, heads):
                        merged[i, j] += wgt[s_, j] * recv[s_ * slice_rows + i, j]
                for i, j in T.Parallel(slice_rows, heads):
                    out[tok, j, split * slice_rows + i] = T.cast(merged[i, j], dtype)
            elif splits > 1:
                for j in T.Parallel(heads):
                    part_lse[tok, j, split] = T.if_then_else(
                        l_sum[j] > 0, m_cur[j] + T.log2(T.max(l_sum[j], 1e-30)), -T.infinity(accum))
                # written by every program, an unused split's as zeros (its weight in the merge is 0): a store
                # under the program-uniform `kv_lo < kv_hi` fails TileLang's thread-sync lowering at 16 splits
                for i, j in T.Parallel(rank, heads):
                    part_out[tok, j, split, i] = acc[i, j] / T.max(l_sum[j], 1e-30)
                if last_program or spread:
                    # last_program: the token's last program to finish merges every split's partials (from L2)
                    # and resets the token's counter: "threadfence reduction" (CUDA's programming guide); spread:
                    # every program merges its slice of R once the token's programs have all arrived (the last to
                    # arrive, the slices given up too). flag[0]: the arrivals before this program's (last_program)
                    # or the bit mask of the slices it merges (spread)
                    flag = T.alloc_shared((1,), "int32")
                    lse_f = T.alloc_fragment((splits, heads), accum)
                    lse_max = T.alloc_fragment((heads,), accum)
                    lse_den = T.alloc_fragment((heads,), accum)
                    wgt = T.alloc_shared((splits, heads), accum)
                    merged = T.alloc_fragment((heads, _MERGE_ROWS if last_program else slice_rows), accum)
                    T.call_extern("handle", "__threadfence")
                    T.sync_threads()
                    for _ in T.Parallel(1):
                        if last_program:
                            flag[0] = T.call_extern("int32", "rl_arrive", T.address_of(counters[tok, 0]))
                        else:
                            flag[0] = T.call_extern("int32", "rl_spread_arrive", T.address_of(counters[tok, 0]),
                                                    splits, split, SPREAD_WAIT_NS)
                    T.sync_threads()
                    if last_program:
                        if (flag[0] & 31) == splits - 1:
                            T.call_extern("handle", "__threadfence")
                            for s_, j in T.Parallel(splits, heads):
                                lse_f[s_, j] = T.call_extern(accum, "__ldcg", T.address_of(part_lse[tok, j, s_]))
                            split_weights(lse_f, lse_max, lse_den, wgt)
                            for c in T.serial(rank // _MERGE_ROWS):
                                merge_rows(part_out, out, wgt, merged, tok, c * _MERGE_ROWS, _MERGE_ROWS)
                            for _ in T.Parallel(1):
                                counters[tok, 0] = 0
                    elif flag[0] != 0:
                        for s_, j in T.Parallel(splits, heads):
                            lse_f[s_, j] = T.call_extern(accum, "__ldcg", T.address_of(part_lse[tok, j, s_]))
                        split_weights(lse_f, lse_max, lse_den, wgt)
                        for d in T.serial(splits):
                            if (flag[0] >> d) & 1 == 1:
                                merge_rows(part_out, out, wgt, merged, tok, d * slice_rows, slice_rows)
            else:
                for i, j in T.Parallel(rank, heads):
                    out[tok, j, i] = T.cast(acc[i, j] / l_sum[j], dtype)

    return mla_decode_keys_as_rows


# The split merges of build_mla_decode_keys_as_rows: "cluster" (2 to MAX_CLUSTER_SPLITS splits: a token's programs
# form a cluster and merge through each other's shared memory), "last_program" (the token's last program to finish
# merges the partials from L2), "spread" (each program merges a slice from L2 once all have arrived), "launch" (a
# merge kernel after the program)
MERGES = ("cluster", "last_program", "spread", "launch")
COUNTED_MERGES = ("last_program", "spread")  # the merges that count arrivals on _arrival_counters
# how long a spread merge's program waits for its siblings before giving its slice up to the last one (ns)
SPREAD_WAIT_NS = 200_000
_MERGE_ROWS = 256  # rows of R a last_program merge step sums
# rl_store_remote: st.shared::cluster of one float32 into the program of cluster rank `rank` at the address its
# own `addr` has; rl_arrive: one arrival on a token's counter after the program's partial stores (fenced)
_MERGE_HELPERS = """
__device__ __forceinline__ int rl_arrive(int* counter) {
  __threadfence();
  return atomicAdd(counter, 1);
}
__device__ __forceinline__ long long rl_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<long long>(t);
}
// the spread merge's arrival on a token's counters {arrivals, slices given up}: returns the bit mask of R's
// slices this program merges (its own; the last to arrive adds those given up; 0 when it gave its own up)
__device__ __forceinline__ int rl_spread_arrive(int* counters, int splits, int split, long long wait_ns) {
  unsigned* arrivals = reinterpret_cast<unsigned*>(counters);
  unsigned* given_up = arrivals + 1;
  unsigned step = 32u / static_cast<unsigned>(splits);
  __threadfence();
  unsigned old = atomicAdd(arrivals, step);
  unsigned base = old & ~31u;
  unsigned own = 1u << split;
  if (old - base == 32u - step) {  // the last to arrive: its slice and every slice given up so far
    __threadfence();
    return static_cast<int>(own | atomicExch(given_up, 0u));
  }
  long long start = rl_globaltimer();
  while (*reinterpret_cast<volatile unsigned*>(arrivals) - base < 32u) {
    if (rl_globaltimer() - start > wait_ns) {
      atomicOr(given_up, own);
      __threadfence();
      if (*reinterpret_cast<volatile unsigned*>(arrivals) - base < 32u) return 0;  // the last merges it
      break;  // all arrived meanwhile: the last may not have seen the bit; merge it here
    }
  }
  __threadfence();
  return static_cast<int>(own);
}
__device__ __forceinline__ void rl_store_remote(float* addr, float value, int rank) {
  unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(addr)), remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(value) : "memory");
}
"""
# splits merged inside a cluster of their programs (build_mla_decode_keys_as_rows' "cluster" merge) up to this count
MAX_CLUSTER_SPLITS = 8
# tokens a last_program merge counts arrivals for (a step with more takes the merge kernel)
_MAX_COUNTED_TOKENS = 1 << 16
_COUNTERS: dict = {}


def _arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's int32 counters of the last_program and spread merges, [_MAX_COUNTED_TOKENS, 2], allocated
    once: per token its arrivals (a multiple of 32 between launches: a last_program launch's last programs reset
    theirs to 0, a spread launch adds 32) and the slices a spread merge's programs gave up (0 between launches
    but for a slice given up after its token's last arrival). Launches that share them must not overlap: the
    engine runs a device's attention on one stream."""
    key = (device.type, device.index)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros((_MAX_COUNTED_TOKENS, 2), dtype=torch.int32, device=device)
    return _COUNTERS[key]


def in_program_merge(merge: str, num_splits: int) -> str | None:
    """Which merge the keys-as-rows program runs itself for ``merge`` at ``num_splits``: "cluster" (2 to
    :data:`MAX_CLUSTER_SPLITS` splits), "last_program" or "spread" (more than one split), or None (no merge, or
    the merge kernel after the program)."""
    if merge == "cluster" and 2 <= num_splits <= MAX_CLUSTER_SPLITS:
        return "cluster"
    return merge if merge in COUNTED_MERGES and num_splits > 1 else None


def merge_kind(num_tokens: int, num_splits: int) -> str:
    """The split merge the keys-as-rows program takes by default: "cluster" at 2 splits, "last_program" at 3 or 4
    (up to ``_MAX_COUNTED_TOKENS`` tokens), else "launch" (also at one split, which has no merge).

    Measured on an H100 (``benchmarks/probe/mla_rows_timeline.py``, V2-Lite's 16 heads, graph time per layer with
    the merge): batch 64 at 4K, 2 splits: 114.9 us with the merge kernel, 113.3 by the last program, 109.7 in a
    cluster (64 clusters of 2 fit one wave); batch 32 at 4K, 4 splits: 67.4 / 64.6 / 95.2 us (clusters of 4 at
    one program per multiprocessor do not all fit one wave: two waves); batch 16, 8 splits: 39.9 / 40.7 / 62.2;
    batch 8, 16 splits: 24.8 / 33.2 us, batch 1 at 1K, 32 splits: 14.4 / 33.7 us (the last program's merge
    reads 16 or 32 splits one after another). The "spread" merge is not picked: 63.3 us against the last
    program's 64.2 at batch 32 / 4 splits, 42.5 against the merge kernel's 40.1 at batch 16 / 8 splits, 112.5
    against the cluster's 109.7 at batch 64 / 2 splits (H100, b387985), too little for programs that spin on
    their siblings."""
    if num_splits == 2:
        return "cluster"
    return "last_program" if 2 < num_splits <= 4 and num_tokens <= _MAX_COUNTED_TOKENS else "launch"


@functools.lru_cache(maxsize=None)
def _compiled(num_heads: int, rank: int, rope: int, block_size: int, dtype: str, num_splits: int,
              config: tuple = ()):
    import tilelang

    cfg = dict(config)
    build = build_mla_decode_keys_as_rows if cfg.pop("layout") == "keys_as_rows" else build_mla_decode
    return tilelang.compile(build(num_heads, rank, rope, block_size, dtype, num_splits, **cfg), out_idx=None,
                            target="cuda")


def keys_as_rows_applies(num_heads: int, block_size: int) -> bool:
    """Whether :func:`build_mla_decode_keys_as_rows` takes this shape: 16 or 32 heads and cache blocks of a
    multiple of 64 tokens."""
    return num_heads in (16, 32) and block_size % 64 == 0


def default_config(num_heads: int, block_size: int = 16, layout: str | None = None) -> dict:
    """Tiles of the TileLang kernel. ``layout`` "keys_as_rows" (the default where :func:`keys_as_rows_applies`):
    keys as the products' rows (64 keys a tile, one cache block's run, TMA-fed, two stages; ``merge`` None: the
    split merge :func:`merge_kind` picks for the launch); "heads_as_rows"
    (the default otherwise): a head tile of up to 64 heads (MQA over the latents: every head of the tile
    shares each cached row), 64 keys per step, 256 threads, two stages.

    Raises:
        ValueError: for another ``layout``."""
    if layout is None:
        layout = "keys_as_rows" if keys_as_rows_applies(num_heads, block_size) else "heads_as_rows"
    if layout == "keys_as_rows":
        return dict(layout="keys_as_rows", block_n=64, threads=128, num_stages=2, min_split_tokens=_MIN_SPLIT_TOKENS,
                    merge=None)
    if layout != "heads_as_rows":
        raise ValueError(f"the TileLang MLA layout is 'keys_as_rows' or 'heads_as_rows', not {layout!r}")
    return dict(layout="heads_as_rows", block_h=min(64, max(16, 1 << (num_heads - 1).bit_length())), block_n=64,
                threads=256, num_stages=2, min_split_tokens=_MIN_SPLIT_TOKENS)


def one_wave_splits(num_tokens: int, max_seq_len: int, num_sms: int, min_split_tokens: int = _MIN_SPLIT_TOKENS) -> int:
    """Split-KV factor for a kernel of one program per multiprocessor (the keys-as-rows tiles take about 160 KB
    of shared memory): the largest power of two up to 32 whose splits fit one wave, at least
    ``min_split_tokens`` keys each. Measured on an H100 (``benchmarks/kernels.py --only-sweeps mla_rows``,
    V2-Lite's 16 heads, 4K context): 4 / 2 / 1 splits at batch 32 / 64 / 128 beat half and twice as many.

    Args:
        num_tokens: query tokens of the step (programs without splitting).
        max_seq_len: bound on every context length (a CUDA graph passes the longest it will replay).
        num_sms: multiprocessors of the device.
        min_split_tokens: fewest keys a split gets.
    Returns:
        the split count, a power of two in [1, 32]."""
    want = max(1, min(num_sms // max(num_tokens, 1), max_seq_len // min_split_tokens, 32))
    return 1 << (want.bit_length() - 1)


def mla_decode_tilelang(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    num_splits: int | None = None, max_seq_len: int | None = None, config: dict | None = None,
) -> torch.Tensor:
    """TileLang kernel of :func:`~rayinfer.kernels.mla_attention.mla_decode_ref` (same contract; no host
    sync; CUDA graph-safe once compiled). ``num_splits``/``max_seq_len`` as
    :func:`~rayinfer.kernels.mla_attention.mla_decode_triton` (batch-invariant mode: one split);
    ``config`` overrides :func:`default_config`'s tiles (``layout`` "keys_as_rows" or "heads_as_rows",
    block_h, block_n, threads, num_stages, gather; keys-as-rows: merge, one of :data:`MERGES`; "cluster" above
    :data:`MAX_CLUSTER_SPLITS` splits and "last_program" or "spread" above 65,536 tokens take the merge kernel).

    Raises:
        ValueError: for a dtype other than bfloat16/float16, R/P not multiples of 16, or keys-as-rows tiles
            asked for a shape they do not take (:func:`keys_as_rows_applies`).
    """
    from rayinfer.kernels._triton_utils import device_sms, triton
    from rayinfer.kernels.batch_invariant import is_batch_invariant
    from rayinfer.kernels.mla_attention import _mla_merge_splits_kernel, choose_num_splits

    num_tokens, num_heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    dtype = _torch_dtype_name(q_latent.dtype)
    if rank % 16 or rope % 16:
        raise ValueError(f"the TileLang MLA decode kernel needs R and P multiples of 16, got {rank}, {rope}")
    out = torch.empty((num_tokens, num_heads, rank), dtype=q_latent.dtype, device=q_latent.device)
    if num_tokens == 0 or meta.num_reqs == 0:
        return out
    max_seq_len = max(max_seq_len or meta.max_seq_len, 1)
    block_size = kv_cache.shape[1]
    config = config or {}
    # a config that names block_h (the head-tile program's) keeps that program at any block size
    layout = config.get("layout", "heads_as_rows" if "block_h" in config else None)
    cfg = {**default_config(num_heads, block_size, layout), **config}
    keys_as_rows = cfg["layout"] == "keys_as_rows"
    if keys_as_rows and not keys_as_rows_applies(num_heads, block_size):
        raise ValueError(f"keys-as-rows tiles need 16 or 32 heads and cache blocks of a multiple of 64 tokens, "
                         f"got {num_heads} heads, blocks of {block_size}")
    if is_batch_invariant():
        num_splits = 1
    elif num_splits is None and keys_as_rows:
        num_splits = one_wave_splits(num_tokens, max_seq_len, device_sms(q_latent), cfg["min_split_tokens"])
    elif num_splits is None:
        num_splits = choose_num_splits(num_tokens * -(-num_heads // cfg["block_h"]), max_seq_len,
                                       device_sms(q_latent))
    num_splits = max(1, min(num_splits, -(-max_seq_len // cfg["min_split_tokens"])))
    if rank & (rank - 1):
        num_splits = 1  # the merge kernel tiles R as a power of two
    if keys_as_rows:  # a power of two up to 32 (build_mla_decode_keys_as_rows)
        num_splits = 1 << (min(num_splits, 32).bit_length() - 1)
    if keys_as_rows:
        cfg["merge"] = cfg.get("merge") or merge_kind(num_tokens, num_splits)
        if cfg["merge"] in COUNTED_MERGES and num_tokens > _MAX_COUNTED_TOKENS:
            cfg["merge"] = "launch"
    kernel = _compiled(num_heads, rank, rope, block_size, dtype, num_splits, tuple(sorted(cfg.items())))
    # with one split the partial buffers are never written; they keep the signature's shapes
    part_out = torch.empty((num_tokens, num_heads, num_splits, rank), dtype=torch.float32, device=out.device)
    part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=out.device)
    # the keys-as-rows program reads the cache as rows [num_blocks * block_size, R + P] (a view: the cache
    # is contiguous, as the other program needs too)
    cache = kv_cache.view(-1, kv_cache.shape[-1]) if keys_as_rows else kv_cache
    # the keys-as-rows program takes q_latent's strides (a view of batched_linear's [H, T, R] output needs no
    # copy) where the bulk copy can (16-byte aligned rows)
    strided_ok = keys_as_rows and q_latent.stride(-1) == 1 and all(
        (st * q_latent.element_size()) % 16 == 0 for st in q_latent.stride()[:2])
    q_in = q_latent if strided_ok else q_latent.contiguous()
    args = [q_in, q_pe.contiguous(), cache, meta.query_start_loc.int(), meta.seq_lens.int(), meta.block_tables.int(),
            part_out, part_lse, out]
    if keys_as_rows:  # the arrival counters (read by COUNTED_MERGES; zeros, never read, at more tokens)
        args.append(_arrival_counters(out.device)[:num_tokens] if num_tokens <= _MAX_COUNTED_TOKENS
                    else torch.zeros((num_tokens, 2), dtype=torch.int32, device=out.device))
    kernel(*args, float(scale * _LOG2E))
    if num_splits > 1 and not (keys_as_rows and in_program_merge(cfg["merge"], num_splits)):
        block_c = min(rank, 128)  # the merge's column slices, as the Triton backend launches it
        _mla_merge_splits_kernel[(num_tokens, num_heads, triton.cdiv(rank, block_c))](
            part_out, part_lse, out, num_heads, num_splits, out.stride(0), out.stride(1),
            RANK=rank, BLOCK_R=rank, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_C=block_c, num_warps=4,
        )
    return out
