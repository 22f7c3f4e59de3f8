"""Prompt-lookup (n-gram) drafts for a batch of contexts on the device: the lookup of
``rayinfer.engine.spec_decode.ngram_lookup`` (after Saxena 2023, "Prompt lookup decoding"), with no host sync.

For each n from ``ngram_max`` down to ``ngram_min``, every earlier window of n tokens is compared with the
context's last n; the first n with a match wins, and of its matches the latest one followed by k tokens, else
the first; the draft is the k tokens after it, 0 past the context's end.

:func:`ngram_lookup_ref` does it in torch ops (about ten launches per n, and a [B, W, n] comparison);
:func:`ngram_lookup_triton` in one launch, a program per context scanning its row in blocks.
"""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import tl, triton, use_triton


def ngram_lookup_ref(ctx: torch.Tensor, rows: torch.Tensor, length: torch.Tensor, k: int, ngram_min: int,
                     ngram_max: int) -> torch.Tensor:
    """The n-gram continuation of each context, in torch ops on its device.

    Args:
        ctx: [R, W] int32 or int64 token buffer; context b is ``ctx[rows[b], : length[b]]`` (the rest of the row
            is ignored).
        rows: [B] int64, rows of ``ctx``.
        length: [B] int64 on the same device, each in [1, W].
        k: drafts per context (>= 1).
        ngram_min, ngram_max: n-gram lengths tried, longest first (1 <= ngram_min <= ngram_max).
    Returns:
        [B, k] int64: context b's continuation, 0 past its end (where the host lookup returns fewer than k
        tokens, or none).
    """
    width = ctx.shape[1]
    tokens = ctx[rows]
    batch = tokens.shape[0]
    dev = tokens.device
    length = length[:, None]
    starts_all = torch.arange(width, device=dev)
    found = torch.zeros(batch, dtype=torch.bool, device=dev)
    best = torch.zeros(batch, dtype=torch.long, device=dev)  # where the continuation starts
    for n in range(min(ngram_max, width - 1), ngram_min - 1, -1):
        suffix = tokens.gather(1, (length - n + torch.arange(n, device=dev)).clamp(min=0))  # [B, n]
        windows = tokens.unfold(1, n, 1)  # [B, W - n + 1, n]
        starts = starts_all[: windows.shape[1]][None]
        # an earlier occurrence: it ends before the last token (and the context has n + 1 tokens at least)
        match = (windows == suffix[:, None, :]).all(dim=-1) & (starts + n <= length - 1)
        full = match & (starts + n + k <= length)
        latest_full = torch.where(full, starts, -1).amax(dim=1)
        first = torch.where(match, starts, width).amin(dim=1)
        start = torch.where(latest_full >= 0, latest_full, first)
        take = match.any(dim=1) & ~found
        best = torch.where(take, start + n, best)
        found |= take
    pos = best[:, None] + torch.arange(k, device=dev)
    ok = found[:, None] & (pos < length)
    return torch.where(ok, tokens.gather(1, pos.clamp(max=width - 1)), torch.zeros_like(pos)).long()


@triton.jit
def _ngram_lookup_kernel(ctx_ptr, stride_row, rows_ptr, len_ptr, out_ptr, K: tl.constexpr, KP: tl.constexpr,
                         NMIN: tl.constexpr, NMAX: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = ctx_ptr + tl.load(rows_ptr + b).to(tl.int64) * stride_row
    length = tl.load(len_ptr + b).to(tl.int32)
    big = 1 << 30
    best = length * 0  # where the continuation starts; 0 while no n matched (a match puts it at n >= 1 or later)
    offs = tl.arange(0, BLOCK)
    # n ascending: a longer n with a match overrides a shorter one (the longest n with a match wins)
    for n in tl.static_range(NMIN, NMAX + 1):
        latest_full = best * 0 - 1
        first = best * 0 + big
        # windows start at s with s + n <= length - 1: they end before the context's last token
        for s0 in range(0, length - n, BLOCK):
            s = s0 + offs
            m = s + n <= length - 1
            for j in tl.static_range(n):
                want = tl.load(row + length - n + j)
                m = m & (tl.load(row + s + j, mask=m, other=0) == want)
            latest_full = tl.maximum(latest_full, tl.max(tl.where(m & (s + n + K <= length), s, -1), axis=0))
            first = tl.minimum(first, tl.min(tl.where(m, s, big), axis=0))
        take = first < big
        best = tl.where(take, tl.where(latest_full >= 0, latest_full, first) + n, best)
    kk = tl.arange(0, KP)
    pos = best + kk
    ok = (pos > kk) & (pos < length) & (kk < K)  # pos > kk: best > 0, an n matched
    draft = tl.load(row + pos, mask=ok, other=0)
    tl.store(out_ptr + b * K + kk, draft.to(tl.int64), mask=kk < K)


def ngram_lookup_triton(ctx: torch.Tensor, rows: torch.Tensor, length: torch.Tensor, k: int, ngram_min: int,
                        ngram_max: int) -> torch.Tensor:
    """:func:`ngram_lookup_ref` in one Triton launch (a program per context; the same arguments and result)."""
    batch = rows.shape[0]
    out = torch.empty(batch, k, dtype=torch.int64, device=ctx.device)
    if batch == 0:
        return out
    assert ctx.stride(1) == 1, "the token buffer's rows must be contiguous"
    _ngram_lookup_kernel[(batch,)](ctx, ctx.stride(0), rows, length, out, K=k, KP=triton.next_power_of_2(k),
                                   NMIN=ngram_min, NMAX=ngram_max, BLOCK=1024, num_warps=4)
    return out


def ngram_lookup_device(ctx: torch.Tensor, rows: torch.Tensor, length: torch.Tensor, k: int, ngram_min: int,
                        ngram_max: int) -> torch.Tensor:
    """The n-gram drafts of :func:`ngram_lookup_ref` (same arguments, shapes and dtypes): the Triton kernel on CUDA
    (or under the interpreter), else the torch reference."""
    if use_triton(ctx, rows, length):
        return ngram_lookup_triton(ctx, rows, length, k, ngram_min, ngram_max)
    return ngram_lookup_ref(ctx, rows, length, k, ngram_min, ngram_max)
