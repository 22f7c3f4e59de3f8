"""Triton kernels of the expert-parallel dispatch and combine (``model.ep_dispatch``): route + pack, unpack,
combine, each one launch, in place of the ~50 small torch ops of the reference path.

The wire format is the reference's byte row, seen as 32-bit words: a token's row is its hidden vector's
words, then its k physical slot ids + 1 (int32; 0 = none), then its k routing weights (float32 bits),
``W = H * itemsize / 4 + 2k`` words, the same row for every destination rank.

1. :func:`route_and_place` (one program): each (token, slot)'s physical slot (replica
   ``(token * ep + rank) % replicas(e)`` of its logical expert ``e``) and destination rank
   (``slot // E``), and each token's place among the tokens going to each rank (a running count over
   token blocks, so rows keep token order within a destination), plus the row count per rank.
2. :func:`pack_rows_to` (grid tokens x word blocks): writes each token's row at its place in the send
   buffer of every rank it goes to: ``offset[rank] + place`` (exact splits: offsets are the exclusive scan
   of the counts) or ``rank * C + place`` (fixed capacity C).
3. :func:`unpack_local` (grid rows): the receiving rank's local slot ids (-1: another rank's slot or none)
   and weights from the received rows; the hidden vectors stay a strided view of the rows.
4. :func:`combine_rows` (grid tokens x hidden blocks): each token's partial outputs summed in rank order,
   in float32, rounded once to the output dtype.

No host sync in any of them, so the fixed-capacity layout captures in a CUDA graph.
"""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import tl, triton


@triton.jit
def _route_place_kernel(ids_ptr, log2phy_ptr, replica_counts_ptr, physical_ptr, place_ptr, counts_ptr, offsets_ptr,
                        num_tokens, stride_r, ep_rank, num_local, capacity,
                        EP: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_T: tl.constexpr):
    ranks = tl.arange(0, BLOCK_R)
    slots = tl.arange(0, BLOCK_K)
    running = tl.zeros([BLOCK_R], dtype=tl.int32)
    for t0 in range(0, num_tokens, BLOCK_T):
        tok = t0 + tl.arange(0, BLOCK_T)
        t_ok = tok < num_tokens
        pair_ok = t_ok[:, None] & (slots[None, :] < TOP_K)
        ids = tl.load(ids_ptr + tok[:, None] * TOP_K + slots[None, :], mask=pair_ok, other=-1).to(tl.int32)
        valid = pair_ok & (ids >= 0)
        logical = tl.where(valid, ids, 0)
        replicas = tl.load(replica_counts_ptr + logical, mask=valid, other=1).to(tl.int32)
        row = tok[:, None] * EP + ep_rank
        physical = tl.load(log2phy_ptr + logical.to(tl.int64) * stride_r + row % replicas, mask=valid,
                           other=-1).to(tl.int32)
        physical = tl.where(valid, physical, -1)
        tl.store(physical_ptr + tok[:, None] * TOP_K + slots[None, :], physical, mask=pair_ok)
        dest = tl.where(physical >= 0, physical // num_local, -1)
        goes = tl.max((dest[:, :, None] == ranks[None, None, :]).to(tl.int32), axis=1)  # [BLOCK_T, BLOCK_R]
        place = tl.cumsum(goes, 0) - 1 + running[None, :]
        tl.store(place_ptr + tok[:, None] * EP + ranks[None, :], tl.where(goes > 0, place, -1),
                 mask=t_ok[:, None] & (ranks[None, :] < EP))
        running += tl.sum(goes, 0)
    tl.store(counts_ptr + ranks, running.to(tl.int64), mask=ranks < EP)
    # first send row of each destination: segments back to back (exact splits), or C-row chunks
    first = tl.where(capacity > 0, ranks * capacity, tl.cumsum(running, 0) - running)
    tl.store(offsets_ptr + ranks, first.to(tl.int64), mask=ranks < EP)


def route_and_place(topk_ids: torch.Tensor, log2phy: torch.Tensor, replica_counts: torch.Tensor, ep_rank: int,
                    ep_size: int, num_local: int, capacity: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1 of the module docstring, one launch.

    Args:
        topk_ids: [T, k] int logical expert ids (-1 = none), contiguous.
        log2phy: [L, max_replicas] int64 physical slots of each logical expert (-1 padded).
        replica_counts: [L] int64; ep_rank, ep_size: this rank and the group size; num_local: E.
        capacity: None for exact splits, else the rows of each destination's chunk.
    Returns:
        (physical [T, k] int32 slot (-1 none), place [T, ep] int32 (the token's row among those going to
        each rank, -1 where it does not go), counts [ep] int64 rows per destination rank, offsets [ep]
        int64 first send row of each destination: the exclusive scan of counts, or ``rank * capacity``).
    """
    num_tokens, top_k = topk_ids.shape
    dev = topk_ids.device
    physical = torch.empty((num_tokens, top_k), dtype=torch.int32, device=dev)
    place = torch.empty((num_tokens, ep_size), dtype=torch.int32, device=dev)
    counts = torch.empty(ep_size, dtype=torch.int64, device=dev)
    offsets = torch.empty(ep_size, dtype=torch.int64, device=dev)
    block_r = triton.next_power_of_2(ep_size)
    block_t = max(16, min(1024, 8192 // (triton.next_power_of_2(top_k) * block_r)))
    _route_place_kernel[(1,)](
        topk_ids.contiguous(), log2phy, replica_counts, physical, place, counts, offsets, num_tokens,
        log2phy.stride(0), ep_rank, num_local, capacity or 0, EP=ep_size, TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_R=block_r,
        BLOCK_T=block_t, num_warps=4)
    return physical, place, counts, offsets


@triton.jit
def _pack_kernel(hidden_ptr, physical_ptr, weights_ptr, place_ptr, offsets_ptr, send_ptr,
                 hidden_words, row_words,
                 EP: tl.constexpr, TOP_K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    w_ok = w < hidden_words
    words = tl.load(hidden_ptr + token * hidden_words + w, mask=w_ok)
    last = (tl.program_id(1) == tl.num_programs(1) - 1).to(tl.int32)  # the block that also writes ids, weights
    j = tl.arange(0, BLOCK_K)
    j_ok = (j < TOP_K) & ((j * 0 + last) > 0)
    ids1 = tl.load(physical_ptr + token * TOP_K + j, mask=j_ok, other=-1) + 1
    wts = tl.load(weights_ptr + token * TOP_K + j, mask=j_ok, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    for r in tl.static_range(EP):
        p = tl.load(place_ptr + token * EP + r)
        if p >= 0:
            row = send_ptr + (tl.load(offsets_ptr + r) + p).to(tl.int64) * row_words
            tl.store(row + w, words, mask=w_ok)
            tl.store(row + hidden_words + j, ids1, mask=j_ok)
            tl.store(row + hidden_words + TOP_K + j, wts, mask=j_ok)


def pack_rows_to(send: torch.Tensor, hidden: torch.Tensor, physical: torch.Tensor, topk_weights: torch.Tensor,
                 place: torch.Tensor, offsets: torch.Tensor) -> None:
    """Step 2: write each token's row into ``send`` [rows, W] int32 at ``offsets[r] + place[t, r]`` for every
    rank r it goes to (rows no token goes to are left as they are).

    Args:
        hidden: [T, H] contiguous, H * itemsize a multiple of 4; physical: [T, k] int32 (-1 none);
        topk_weights: [T, k] float; place: [T, ep] int32 (:func:`route_and_place`); offsets: [ep] int64
        first row of each destination rank's segment.
    """
    num_tokens, hidden_size = hidden.shape
    if num_tokens == 0:
        return
    top_k, ep_size = physical.shape[1], place.shape[1]
    hidden_words = hidden_size * hidden.element_size() // 4
    block_w = min(1024, triton.next_power_of_2(hidden_words))
    _pack_kernel[(num_tokens, triton.cdiv(hidden_words, block_w))](
        hidden.view(torch.int32), physical, topk_weights.contiguous(), place, offsets, send,
        hidden_words, send.shape[1], EP=ep_size, TOP_K=top_k, BLOCK_W=block_w,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=4)


@triton.jit
def _unpack_kernel(recv_ptr, ids_ptr, weights_ptr, num_rows, hidden_words, row_words, first_local, num_local,
                   TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_K)
    ok = (n[:, None] < num_rows) & (j[None, :] < TOP_K)
    row = recv_ptr + n.to(tl.int64)[:, None] * row_words + hidden_words
    slot = tl.load(row + j[None, :], mask=ok, other=0) - 1  # -1: none (a zeroed row of the capacity layout)
    local = slot - first_local
    mine = (slot >= 0) & (local >= 0) & (local < num_local)
    tl.store(ids_ptr + n[:, None] * TOP_K + j[None, :], tl.where(mine, local, -1), mask=ok)
    wts = tl.load(row + TOP_K + j[None, :], mask=ok, other=0).to(tl.float32, bitcast=True)
    tl.store(weights_ptr + n[:, None] * TOP_K + j[None, :], wts, mask=ok)


def unpack_local(recv: torch.Tensor, dtype: torch.dtype, hidden_size: int, top_k: int, ep_rank: int,
                 num_local: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 3: received rows [N, W] int32 -> (hidden [N, H] ``dtype``, a strided view of the rows; local slot
    ids [N, k] int32, -1 for another rank's slot or none; weights [N, k] float32)."""
    num_rows = recv.shape[0]
    hidden_words = hidden_size * dtype.itemsize // 4
    hidden = recv[:, :hidden_words].view(dtype)
    ids = torch.empty((num_rows, top_k), dtype=torch.int32, device=recv.device)
    weights = torch.empty((num_rows, top_k), dtype=torch.float32, device=recv.device)
    if num_rows:
        block_n = 64
        _unpack_kernel[(triton.cdiv(num_rows, block_n),)](
            recv, ids, weights, num_rows, hidden_words, recv.shape[1], ep_rank * num_local, num_local,
            TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(top_k), num_warps=4)
    return hidden, ids, weights


@triton.jit
def _combine_kernel(back_ptr, place_ptr, offsets_ptr, out_ptr, hidden_size,
                    EP: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < hidden_size
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r in tl.static_range(EP):  # rank order, as the reference adds the partial sums
        p = tl.load(place_ptr + token * EP + r)
        if p >= 0:
            row = (tl.load(offsets_ptr + r) + p).to(tl.int64)
            acc += tl.load(back_ptr + row * hidden_size + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden_size + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine_rows(back: torch.Tensor, place: torch.Tensor, offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Step 4: [T, H] in back's dtype, token t = the sum over ranks r (in order) of ``back[offsets[r] +
    place[t, r]]`` where ``place[t, r] >= 0`` (float32 sum, one rounding; zeros for a token sent nowhere).

    Args:
        back: [S, H] the partial outputs that came back, contiguous; place: [T, ep] int32; offsets: [ep] int64.
    """
    hidden_size = back.shape[1]
    out = torch.empty((num_tokens, hidden_size), dtype=back.dtype, device=back.device)
    if num_tokens:
        block_h = min(1024, triton.next_power_of_2(hidden_size))
        _combine_kernel[(num_tokens, triton.cdiv(hidden_size, block_h))](
            back, place, offsets, out, hidden_size, EP=place.shape[1], BLOCK_H=block_h, num_warps=4)
    return out
