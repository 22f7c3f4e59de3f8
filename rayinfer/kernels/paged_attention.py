"""Attention of new tokens over a paged KV cache (prefill, chunked prefill, extend and decode)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayinfer.kernels._triton_utils import (
    device_sms, is_interpreting, pdl_launch, pdl_wait, tl, triton, use_pdl, use_triton,
)
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.batch_invariant import is_batch_invariant


_SHORT_QUERY = 16  # query rows up to which the reference takes its matmul path (decode, short extends)


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole cached context (plain torch).

    The new tokens' keys and values must already be in ``kv_cache`` (see ``kernels.kv_write``). Query
    row ``j`` of request ``i`` sits at position ``seq_lens[i] - query_len_i + j`` and attends to
    positions ``0..`` that position inclusive. Grouped-query attention: query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``. With ``sliding_window`` W, a query at position p sees only
    keys ``p - W + 1 .. p`` (Gemma, Mistral; as Hugging Face's sliding-window mask); blocks wholly
    before the first query's window are not read, so their table entries may be placeholders; nor are
    keys before ``meta.kv_start`` (when set; sliding-window attention only).

    Args:
        q: [T, num_heads, head_dim].
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim] (one layer); q's dtype or
            float8_e4m3fn (an fp8 KV cache, widened on load).
        meta: the step's :class:`AttentionMetadata`.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: W (tokens), or None for full causal attention.
    Returns:
        [T, num_heads, head_dim], q's dtype; accumulation in float32.
    """
    num_heads = q.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    block_size = kv_cache.shape[2]
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        num_blocks = (seq_len + block_size - 1) // block_size
        first_key = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)
        kv_start = meta.kv_start_cpu[i] if sliding_window is not None and meta.kv_start_cpu is not None else 0
        first_block = max(first_key, kv_start) // block_size
        blocks = meta.block_tables[i, first_block:num_blocks].long()
        kv = kv_cache[blocks]  # [n, 2, bs, Hkv, D]
        k_lo = first_block * block_size  # position of the first key read
        k = kv[:, 0].reshape(-1, num_kv_heads, kv.shape[-1])[: seq_len - k_lo]
        v = kv[:, 1].reshape(-1, num_kv_heads, kv.shape[-1])[: seq_len - k_lo]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(k_lo, seq_len, device=q.device)
        mask = q_pos[:, None] >= k_pos[None, :]
        if sliding_window is not None:
            mask &= (k_pos[None, :] > q_pos[:, None] - sliding_window) & (k_pos[None, :] >= kv_start)
        if q_len <= _SHORT_QUERY:
            # decode and short extends: two batched matmuls per KV head group, no K/V copies per query
            # head (on the CPU several times faster than scaled_dot_product_attention for these shapes)
            qi = q[start : start + q_len].float().reshape(q_len, num_kv_heads, group, -1)
            qi = qi.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, -1)  # [Hkv, g*q, D]
            s = torch.bmm(qi, k.float().transpose(0, 1).transpose(1, 2)) * scale  # [Hkv, g*q, s]
            s = s.masked_fill(~mask.repeat(group, 1), float("-inf"))
            o = torch.bmm(torch.softmax(s, dim=-1), v.float().transpose(0, 1))  # [Hkv, g*q, D]
            o = o.reshape(num_kv_heads, group, q_len, -1).permute(2, 0, 1, 3).reshape(q_len, num_heads, -1)
            out[start : start + q_len] = o.to(q.dtype)
        else:
            qi = q[start : start + q_len].float().transpose(0, 1)  # [H, q, D]
            k = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, s, D]
            v = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
            out[start : start + q_len] = o.transpose(0, 1).to(q.dtype)
        start += q_len
    return out


# ----------------------------------------------------------------------------------------------------
# Triton kernel. One program computes one tile of ``BLOCK_Q`` query tokens of one request times all
# ``GROUP`` query heads that share one KV head (rows ``token * GROUP_PAD + head_in_group``), so each
# K/V tile read from the cache serves the whole group (GQA). It streams the request's keys in tiles of
# ``BLOCK_N`` tokens gathered through the block table, with an online softmax in base 2 (after
# FlashAttention-2, Dao 2023). Keys before the tile's first query position need no causal mask and
# take the unmasked loop. For few, long requests the keys are split over ``num_splits`` programs that
# write partial outputs and log-sum-exps, merged by a second kernel (split-KV "flash decoding").
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _find_request(query_start_loc_ptr, program, num_reqs, BLOCK_Q: tl.constexpr):
    """Request of a flat tile index: the last i with ``query_start_loc[i] // BLOCK_Q + i <= program``.

    ``query_start_loc[i] // BLOCK_Q + i`` bounds the tiles of the requests before i from above, so
    every request gets at least ``cdiv(query_len, BLOCK_Q)`` consecutive programs (after vLLM's
    unified attention); the surplus ones exit at once.
    """
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.zeros([], dtype=tl.int32) + num_reqs  # a tensor even when num_reqs is specialized to 1
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, table, kv_base, start, kv_hi, q_pos, qk_scale,
    stride_cb, stride_ckv, stride_cs, dims, dim_ok,
    BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    IEEE: tl.constexpr, KV_CAST: tl.constexpr, ROWWISE: tl.constexpr, win_lo=0, window=0,
    SLIDING: tl.constexpr = False,
):
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < kv_hi
    if SLIDING:  # keys before the tile's first window are placeholders: neither loaded nor seen
        n_ok = n_ok & (n >= win_lo)
    if MASKED:
        blk = tl.load(table + n // KV_BLOCK_SIZE, mask=n_ok, other=0)
    else:
        blk = tl.load(table + n // KV_BLOCK_SIZE)
    rows = blk.to(tl.int64) * stride_cb + (n % KV_BLOCK_SIZE) * stride_cs
    k_ptrs = kv_base + rows[:, None] + dims[None, :]
    if MASKED:
        if EVEN_D:
            kv_mask = n_ok[:, None]
        else:
            kv_mask = n_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(k_ptrs + stride_ckv, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(k_ptrs + stride_ckv)
    else:
        k = tl.load(k_ptrs, mask=dim_ok[None, :], other=0.0)
        v = tl.load(k_ptrs + stride_ckv, mask=dim_ok[None, :], other=0.0)
    if KV_CAST:  # an fp8 cache: widen for the tensor cores (q is already in that dtype)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if ROWWISE:  # batch-invariant mode under the interpreter (see ROWWISE in kernels._triton_utils)
        s = tl.sum(q.to(tl.float32)[:, :, None] * tl.trans(k).to(tl.float32)[None, :, :], 1)
    elif IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    if MASKED:
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if SLIDING:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; shift by 0 there to avoid inf - inf.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if ROWWISE:
        acc += tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
    elif IEEE:
        acc += tl.dot(p, v, input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    q_ptr, kv_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, kv_start_ptr,
    num_reqs, num_heads, num_splits, qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    ONE_TILE: tl.constexpr, REVERSE: tl.constexpr, USE_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    KV_CAST: tl.constexpr, KV_F16: tl.constexpr, ROWWISE: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    ALL_MASKED: tl.constexpr = False, SLIDING: tl.constexpr = False, HAS_KV_START: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    program = tl.program_id(0)
    if REVERSE:  # the last query tiles see the most keys: start them first to shorten the tail
        program = tl.num_programs(0) - 1 - program
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if ONE_TILE:  # every request fits one tile: program i is request i
        req = program
        tile_first = 0
    else:
        req = _find_request(query_start_loc_ptr, program, num_reqs, BLOCK_Q)
        tile_first = (program - (tl.load(query_start_loc_ptr + req) // BLOCK_Q + req)) * BLOCK_Q
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if tile_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # tokens of the request already cached before this step

    M: tl.constexpr = BLOCK_Q * GROUP_PAD
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    rows = tl.arange(0, M)
    tok = tile_first + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & ((rows % GROUP_PAD) < GROUP)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=io_mask, other=0.0)
    if KV_F16:  # an fp8 cache with 16-bit queries: compute in fp16, whose conversion from e4m3 is one
        # instruction per pair (bf16's goes through fp32 and made the fp8 kernel slower than bf16's)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    q_pos = ctx_len + tok

    kv_lo = 0
    kv_hi = ctx_len + tl.minimum(q_len, tile_first + BLOCK_Q)  # last row's position + 1
    win_lo = 0
    if SLIDING:  # the first key any row of the tile sees; tiles wholly before it are skipped
        win_lo = tl.maximum(ctx_len + tile_first - window + 1, 0)
        if HAS_KV_START:  # keys before a bounded replay's start were never computed
            win_lo = tl.maximum(win_lo, tl.load(kv_start_ptr + req))
        kv_lo = win_lo // BLOCK_N * BLOCK_N
    if USE_SPLITS:  # this request's keys in num_splits equal parts (whole tiles), sized at run time: a
        # graph captured for the longest context still spreads a short one over every split
        split_size = tl.cdiv(tl.cdiv(kv_hi - kv_lo, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + split * split_size
        kv_hi = tl.minimum(kv_hi, kv_lo + split_size)
    # Keys up to the tile's first query position are visible to every row: no mask needed there
    # (with a sliding window every tile takes the masked loop, which also hides keys before the window).
    full_hi = tl.minimum(kv_hi, ctx_len + tile_first + 1)
    full_hi = kv_lo + tl.maximum(full_hi - kv_lo, 0) // BLOCK_N * BLOCK_N
    if ALL_MASKED or SLIDING:  # batch-invariant: one code path for every tile (the compiler may round the
        # unmasked loop's scale-and-subtract differently, e.g. fused into an FMA), whatever the row's tile
        # start; a sliding window: the masked loop also hides keys before the window
        full_hi = kv_lo

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, BLOCK_D], tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    kv_base = kv_ptr + kv_head.to(tl.int64) * stride_ch
    for start in range(kv_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, table, kv_base, start, kv_hi, q_pos, qk_scale, stride_cb, stride_ckv, stride_cs,
            dims, dim_ok, BLOCK_N, KV_BLOCK_SIZE, False, EVEN_D, IEEE, KV_CAST, ROWWISE,
        )
    for start in range(full_hi, kv_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, table, kv_base, start, kv_hi, q_pos, qk_scale, stride_cb, stride_ckv, stride_cs,
            dims, dim_ok, BLOCK_N, KV_BLOCK_SIZE, True, EVEN_D, IEEE, KV_CAST, ROWWISE, win_lo, window, SLIDING,
        )

    if USE_SPLITS:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        part = (q_rows * num_heads + head) * num_splits + split  # [T, H, num_splits] row-major
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], acc / l_safe[:, None], mask=io_mask)
    else:
        out = acc / l_i[:, None]
        out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_heads, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * num_heads + head) * num_splits
    splits = tl.arange(0, BLOCK_S)
    s_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    lse = tl.load(part_lse_ptr + base + splits, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: some split holds the query's own position, always visible
    w = tl.exp2(lse - m)
    o = tl.load(part_out_ptr + (base + splits)[:, None] * BLOCK_D + dims[None, :], mask=s_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


_MAX_SPLITS = 64
_MIN_SPLIT_TOKENS = 128


_MAX_SPLITS_PDL = 8


def _choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int, pdl: bool = False) -> int:
    """Split-KV factor: about two programs per multiprocessor, >= 128 keys per split, and at most 8
    splits under programmatic dependent launch.

    Measured on an H200 (Llama-3-8B heads, bf16): batch 1-16 gain 1.5-8x from splitting; batch 32
    (256 programs) gains ~7% from 2 splits at 4K context and nothing at 1K; more splits than that lose.
    Under PDL many splits cost: a batch-1 decode step (1K context, graph captured for 8192) took 4.07 ms
    with 8 splits, 4.37 with 16 and 4.62 with 33 (without PDL, 4.32 with 8 and 4.36 with 33), while
    batch 8 and 32 at 4K context lost 3% and 7% when cut to 2 and 1 splits.
    """
    if num_programs >= 2 * num_sms or max_seq_len < 2 * _MIN_SPLIT_TOKENS:
        return 1
    want = triton.cdiv(2 * num_sms, num_programs)
    return max(1, min(want, max_seq_len // _MIN_SPLIT_TOKENS, _MAX_SPLITS_PDL if pdl else _MAX_SPLITS))


# Long prefills (many query rows over many keys) on Hopper: 256-row tiles (64 tokens x 4 heads), 64 keys,
# 8 warps, 2 stages. H200, bf16, Llama-3-8B heads, one causal prompt (benchmarks/kernels.py --only-sweeps
# prefill_long): 16K tokens 5.38 ms against 5.88 with the 64-row tiles (408 against 374 TFLOP/s), 32K 20.8
# against 23.3 ms (424 against 378); 128-row tiles took 5.43 / 21.8 ms. Needs ~128 KB of shared memory.
_LONG_PREFILL_KEYS = 16384
_LONG_PREFILL_QUERIES = 1024


def _choose_config(max_query_len: int, group_pad: int, block_d: int, is_fp32: bool, kv_bytes: int = 2,
                   batch_invariant: bool = False, max_seq_len: int = 0, hopper: bool = False) -> dict:
    """Tile shape and launch options; decode tiles take the tensor cores' smallest M (16 rows).

    Prefill tiles of 64 query rows x 64 keys, 4 warps, 3 stages ran a 4K causal prefill (bf16, d=128,
    GQA 4) at 329 TFLOP/s on an H200, against 268-326 for 128-row tiles (benchmarks/kernels.py --sweep).
    ``batch_invariant``: the prefill tiles for every step, decode included. A decode tile of 4 query
    tokens (16 rows) with the prefill's key tile would be faster (bf16, Llama-3-8B heads, H200: batch
    256 / 1K context 265 us against 333) and matched the prefill rows in kernel tests, but it moved a
    logprob in the engine test (SmolLM2 shape: 32 of 33 trials of the 128-token-chunk engine differed at
    the 22nd token; with the prefill tiles 60 trials gave one output), so it is not used.
    """
    decode_block_q = max(1, 16 // group_pad)
    if max_query_len <= decode_block_q and not batch_invariant:
        # 16-bit caches: 64 keys, 2 stages (H200, bf16: batch 32 / 1K context 40 us against 50 with 3
        # stages, batch 256 / 1.5K 372 against 408; less shared memory, more programs per multiprocessor).
        # fp8 caches: 128 keys, 3 stages (batch 256 / 1.5K: 282 us; 295 with 2 stages, 395 with 256 keys).
        if kv_bytes == 1 and not is_fp32:
            return dict(block_q=decode_block_q, block_n=128, num_warps=4, num_stages=3)
        return dict(block_q=decode_block_q, block_n=32 if is_fp32 else 64, num_warps=4, num_stages=2)
    if is_fp32 or block_d > 128:
        return dict(block_q=max(1, 64 // group_pad), block_n=32, num_warps=4, num_stages=2)
    if (hopper and not batch_invariant and kv_bytes == 2 and max_seq_len >= _LONG_PREFILL_KEYS
            and max_query_len >= _LONG_PREFILL_QUERIES):
        return dict(block_q=max(1, 256 // group_pad), block_n=64, num_warps=8, num_stages=2)
    return dict(block_q=max(1, 64 // group_pad), block_n=64, num_warps=4, num_stages=3)


def _is_hopper(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a CUDA device of compute capability 9.x (where the long-prefill tiles were
    measured and fit in shared memory)."""
    return t.is_cuda and not is_interpreting() and torch.cuda.get_device_capability(t.device)[0] == 9


def paged_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    config: dict | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Triton kernel of :func:`paged_attention_ref` (same contract; no host sync).

    Grid sizes come from the host lists of ``meta`` (``query_lens_cpu``, ``seq_lens_cpu``).

    Args:
        num_splits: split-KV factor; by default chosen from the batch shape. Used only when every
            request's queries fit one tile (decode and short extends). In batch-invariant mode
            (``kernels.batch_invariant``) always 1, with the prefill's key tile for every step: each query
            row then reads its keys in the same ``BLOCK_N`` tiles from position 0, in the same order,
            whether it is computed in a prefill, an extend after a prefix hit or chunk, or a decode.
        max_seq_len: bound on every ``seq_lens`` entry (default ``meta.max_seq_len``); it picks the
            split count, which is baked into the launch (a CUDA graph captured once passes the longest
            context it will replay). Each request's split size is computed in the kernel from its own
            length, so a short context still uses every split.
        config: tile override for benchmarks: keys block_q, block_n, num_warps, num_stages, reverse,
            kv_f16 (an fp8 cache computes in fp16; False widens to q's dtype).
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    kv_start = meta.kv_start if sliding_window is not None else None
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_reqs = meta.num_reqs
    if num_tokens == 0 or num_reqs == 0:
        return out
    pdl = use_pdl(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(head_dim)
    is_fp32 = q.dtype == torch.float32
    max_query_len = meta.max_query_len
    max_seq_len = max(max_seq_len or meta.max_seq_len, 1)
    kv_cast = kv_cache.dtype != q.dtype
    invariant = is_batch_invariant()
    cfg = {"reverse": True, "kv_f16": True,
           **_choose_config(max_query_len, group_pad, block_d, is_fp32, kv_cache.element_size(), invariant,
                            max_seq_len, _is_hopper(q)),
           **(config or {})}
    block_q, block_n = cfg["block_q"], cfg["block_n"]
    # float32 in batch-invariant mode never takes the one-tile variant: its decode rows differed from
    # the prefill's on an H200 (IEEE tl.dot), the tile-walking variant is the prefill's own code
    one_tile = max_query_len <= block_q and not (invariant and is_fp32)
    grid_x = num_reqs if one_tile else num_tokens // block_q + num_reqs
    if not one_tile or invariant:  # batch-invariant: every row reads its keys in one pass of BLOCK_N tiles
        num_splits = 1
    elif num_splits is None:
        num_splits = _choose_num_splits(num_reqs * num_kv_heads, max_seq_len, device_sms(q), pdl)
    num_splits = max(1, min(num_splits, triton.cdiv(max_seq_len, block_n)))
    use_splits = num_splits > 1
    if use_splits and not is_fp32 and "block_n" not in (config or {}):
        # split decode (few requests) streams each split faster in 128-key tiles: batch 1 / 1K context
        # 6.9 us against 7.7 with 64 (H200, bf16); with many requests 64 stays ahead (372 vs 383 us)
        block_n = 128
    if use_splits:
        part_out = torch.empty((num_tokens, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _paged_attention_kernel[(grid_x, num_kv_heads, num_splits)](
        q, kv_cache, out, part_out, part_lse,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        meta.seq_lens if kv_start is None else kv_start, num_reqs, num_heads, num_splits, scale * 1.4426950408889634, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), meta.block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
        HEAD_DIM=head_dim, BLOCK_D=block_d, KV_BLOCK_SIZE=block_size,
        ONE_TILE=one_tile, REVERSE=bool(cfg["reverse"]) and not one_tile, USE_SPLITS=use_splits, IEEE=is_fp32,
        KV_CAST=kv_cast, KV_F16=kv_cast and not is_fp32 and bool(cfg["kv_f16"]),
        ROWWISE=invariant and is_interpreting(), ALL_MASKED=invariant, SLIDING=sliding_window is not None,
        HAS_KV_START=kv_start is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(pdl),
    )
    if use_splits:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, num_heads, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4, **pdl_launch(pdl),
        )
    return out


def _triton_applies(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    return (
        q.dim() == 3
        and kv_cache.dim() == 5
        and kv_cache.dtype in (q.dtype, torch.float8_e4m3fn)
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and q.shape[1] % kv_cache.shape[3] == 0
        and q.shape[2] == kv_cache.shape[4]
        and 16 <= q.shape[2] <= 256
        and kv_cache.stride(-1) == 1
        and use_triton(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    )


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Same contract as :func:`paged_attention_ref`; the Triton kernel on CUDA tensors."""
    if _triton_applies(q, kv_cache, meta):
        return paged_attention_triton(q, kv_cache, meta, scale, sliding_window=sliding_window)
    return paged_attention_ref(q, kv_cache, meta, scale, sliding_window)
