"""Expert-parallel dispatch and combine by all-to-all: each token goes only to the ranks that hold its experts.

A MoE layer under expert parallelism (``model.moe.RoutedExperts`` with a group) runs, on every rank of the
group at the same step:

1. **route**: each (token, slot) pair of logical expert ``e`` goes to replica ``row % replicas(e)`` of ``e``
   (``row = token * ep + rank``, so ranks spread one-token steps over replicas), i.e. to physical slot
   ``p``, held by rank ``p // E`` as its local slot ``p % E`` (``E`` slots per rank);
2. **dispatch**: each token travels once to each rank holding at least one of its slots, as one byte
   row (its hidden row, its k physical slots and its k routing weights), the same row for every
   destination, so one ``all_to_all_single`` moves everything; a rank keeps the slots it holds and
   skips the others;
3. **experts**: each rank runs its fused MoE over the rows it received;
4. **combine**: the output rows go back by the reverse all-to-all, and the home rank adds each token's
   partial sums (one per destination rank, in rank order).

Two buffer layouts (:func:`all_to_all_moe`):

- *exact splits* (``capacity=None``): the ranks first exchange their row counts (a ``[ep]`` all-to-all
  on the device), the host reads them once, and only real rows cross the link. Eager steps.
- *fixed capacity* (``capacity=C``): every (source, destination) pair has a ``C``-row chunk, rows
  compacted to its front on the device, unused rows zero (their slot ids read as -1, so the experts
  skip them). No count exchange and no host read: shapes are fixed, so a CUDA graph can capture the
  step (all ranks then replay the same padded batch size, ``C`` = that size). Used automatically while
  a graph is being captured.

Both give the same result up to float summation order; in batch-invariant mode (per-slot outputs, one
nonzero term per element) exactly the same bits. Collectives: NCCL on GPU, gloo on CPU.
After DeepSeek-V3's EP deployment (dispatch/combine by all-to-all, DeepEP) and vLLM's/SGLang's
``all2all`` managers; the byte-row packing and the capacity layout are this project's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

ExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DispatchCounters:
    """Rows this rank moved in its layer's all-to-alls since the last reset (tests, metrics).

    Attributes:
        num_rows_sent: token rows dispatched to other ranks and to itself (real rows only).
        num_rows_received: token rows received for this rank's experts (real rows only).
        num_exchanges: dispatches run (one per layer forward).
    """

    num_rows_sent: int = 0
    num_rows_received: int = 0
    num_exchanges: int = 0


def is_capturing(x: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``x``'s device (False off CUDA)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def route_to_ranks(topk_ids: torch.Tensor, log2phy: torch.Tensor, replica_counts: torch.Tensor, ep_rank: int,
                   ep_size: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical slot and destination rank of every (token, slot) pair (step 1 of the module docstring).

    Args:
        topk_ids: [T, k] int logical expert ids (-1 = none).
        log2phy: [L, max_replicas] int64 physical slots of each logical expert (-1 padded).
        replica_counts: [L] int64.
        ep_rank, ep_size: this rank and the group size.
        num_local: E, physical slots per rank (rank d holds slots ``d * E .. d * E + E - 1``).
    Returns:
        (physical [T, k] int64 slot, -1 for a pair with no expert; dest [T, k] int64 rank, -1 likewise).
    """
    num_tokens = topk_ids.shape[0]
    rows = torch.arange(num_tokens, device=topk_ids.device)[:, None] * ep_size + ep_rank
    valid = topk_ids >= 0
    logical = topk_ids.long().clamp(min=0)
    physical = torch.where(valid, log2phy[logical, rows % replica_counts[logical]], -1)
    return physical, torch.where(valid, physical // num_local, -1)


def pack_rows(hidden: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One byte row per token: hidden, ``slot_ids + 1`` as int32 (0 means no expert, so a zeroed row is
    empty) and the weights as float32.

    Args:
        hidden: [..., H]; slot_ids: [..., k] int physical slots (-1 = none); weights: [..., k] float.
    Returns:
        [..., H * itemsize + 8 * k] uint8.
    """
    parts = [hidden.contiguous(), (slot_ids + 1).to(torch.int32), weights.to(torch.float32).contiguous()]
    return torch.cat([p.view(torch.uint8) for p in parts], dim=-1)


def unpack_rows(rows: torch.Tensor, dtype: torch.dtype, hidden_size: int,
                top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_rows`: [N, B] uint8 -> (hidden [N, H] ``dtype``, slot ids [N, k] int64 with -1
    for none, weights [N, k] float32)."""
    hb = hidden_size * dtype.itemsize
    hidden = rows[:, :hb].contiguous().view(dtype)
    ids = rows[:, hb : hb + 4 * top_k].contiguous().view(torch.int32).long() - 1
    weights = rows[:, hb + 4 * top_k :].contiguous().view(torch.float32)
    return hidden, ids, weights


def _local_slots(physical: torch.Tensor, ep_rank: int, num_local: int) -> torch.Tensor:
    """[N, k] physical slots -> this rank's local slot ids, -1 for slots other ranks compute."""
    local = physical - ep_rank * num_local
    return torch.where((physical >= 0) & (local >= 0) & (local < num_local), local, -1)


def all_to_all_moe(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertFn, *,
                   group, log2phy: torch.Tensor, replica_counts: torch.Tensor, num_local: int,
                   capacity: int | None = None, counters: DispatchCounters | None = None) -> torch.Tensor:
    """The expert-parallel MoE output of this rank's tokens (the module docstring's steps 1-4).

    Every rank of ``group`` must call it at the same step with the same ``capacity`` (any number of
    tokens, zero included).

    Args:
        hidden: [T, H] this rank's tokens.
        topk_ids: [T, k] int logical expert ids; topk_weights: [T, k] float routing weights.
        experts: ``experts(hidden [N, H], slot_ids [N, k] int64 local slots (-1: skip), weights [N, k]
            float32)`` -> [N, H] (hidden's dtype), or [N, k, H] float32 per-slot outputs (batch-invariant
            mode: then the result is [T, k, H] float32 with each slot's output from the rank computing it).
        group: the EP process group; log2phy, replica_counts: the layer's map (:func:`route_to_ranks`);
        num_local: E, slots per rank.
        capacity: None for exact splits; C >= T (the same on every rank) for the fixed-capacity layout.
        counters: add this dispatch's row counts here.
    Returns:
        [T, H] in hidden's dtype (or [T, k, H] float32, see ``experts``).
    Raises:
        ValueError: if T > capacity.
    """
    ep_size, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    num_tokens, top_k = topk_ids.shape
    if capacity is not None and num_tokens > capacity:
        raise ValueError(f"{num_tokens} tokens on EP rank {ep_rank} exceed the dispatch capacity {capacity}")
    if _fused_applies(hidden):
        return _all_to_all_fused(hidden, topk_ids, topk_weights, experts, group, ep_rank, ep_size, log2phy,
                                 replica_counts, num_local, capacity, counters)
    physical, dest = route_to_ranks(topk_ids, log2phy, replica_counts, ep_rank, ep_size, num_local)
    ranks = torch.arange(ep_size, device=hidden.device)
    to_rank = (dest[:, None, :] == ranks[None, :, None]).any(dim=2)  # [T, R]: the token goes to rank d
    packed = pack_rows(hidden, physical, topk_weights)  # the same row for every destination

    def run_experts(recv: torch.Tensor) -> torch.Tensor:
        rows, slots, weights = unpack_rows(recv, hidden.dtype, hidden.shape[1], top_k)
        return experts(rows, _local_slots(slots, ep_rank, num_local), weights)

    if capacity is None:
        back, home = _exchange_exact(packed, to_rank, run_experts, group, counters)
        out = back.new_zeros((num_tokens, *back.shape[1:]))
        return out.index_add_(0, home, back)
    # rank d's chunk holds the tokens going there, compacted: token t at row d * C + (its place among them)
    place = torch.cumsum(to_rank.long(), dim=0) - 1
    flat = torch.where(to_rank, ranks * capacity + place, ep_size * capacity)  # [T, R]; the extra row: unused
    send = torch.zeros(ep_size * capacity + 1, packed.shape[1], dtype=torch.uint8, device=hidden.device)
    send[flat.reshape(-1)] = packed[:, None, :].expand(-1, ep_size, -1).reshape(-1, packed.shape[1])
    recv = torch.empty_like(send[:-1])
    dist.all_to_all_single(recv, send[:-1], group=group)
    got = run_experts(recv)
    back = torch.empty_like(got)
    dist.all_to_all_single(back, got.contiguous(), group=group)
    back = torch.cat([back, back.new_zeros((1, *back.shape[1:]))])
    if counters is not None and not is_capturing(hidden):
        counters.num_rows_sent += int(to_rank.sum())
        counters.num_rows_received += int((recv[:, hidden.shape[1] * hidden.dtype.itemsize:] != 0).any(1).sum())
        counters.num_exchanges += 1
    return back[flat].sum(dim=1)  # [T, R, ...] -> each token's partial sums, rank by rank


def _fused_applies(hidden: torch.Tensor) -> bool:
    """Whether :func:`all_to_all_moe` takes the Triton kernels (``kernels.ep_dispatch``): CUDA tensors (or the
    interpreter), a contiguous hidden whose rows are whole 32-bit words, and ``RAYINFER_EP_FUSED_DISPATCH``
    not "0" (the torch path stays for A/B runs)."""
    from rayinfer import envs
    from rayinfer.kernels._triton_utils import use_triton

    return (envs.ep_fused_dispatch() and use_triton(hidden) and hidden.dim() == 2 and hidden.is_contiguous()
            and hidden.shape[1] * hidden.element_size() % 4 == 0)


def _all_to_all_fused(hidden, topk_ids, topk_weights, experts: ExpertFn, group, ep_rank: int, ep_size: int,
                      log2phy, replica_counts, num_local: int, capacity: int | None,
                      counters: DispatchCounters | None) -> torch.Tensor:
    """:func:`all_to_all_moe` through the Triton kernels of ``kernels.ep_dispatch``: route + place, pack,
    unpack and combine in one launch each; rows travel as 32-bit words (the same bytes as :func:`pack_rows`)."""
    from rayinfer.kernels.ep_dispatch import combine_rows, pack_rows_to, route_and_place, unpack_local

    num_tokens, top_k = topk_ids.shape
    hidden_size = hidden.shape[1]
    hidden_words = hidden_size * hidden.element_size() // 4
    row_words = hidden_words + 2 * top_k
    physical, place, counts, offsets = route_and_place(topk_ids, log2phy, replica_counts, ep_rank, ep_size,
                                                       num_local, capacity)
    if capacity is None:
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        splits = torch.cat([counts, recv_counts]).tolist()  # the step's one host read
        send_splits, recv_splits = splits[:ep_size], splits[ep_size:]
        send = hidden.new_empty((sum(send_splits), row_words), dtype=torch.int32)
        recv = hidden.new_empty((sum(recv_splits), row_words), dtype=torch.int32)
    else:
        send_splits = recv_splits = None  # equal C-row chunks
        send = hidden.new_zeros((ep_size * capacity, row_words), dtype=torch.int32)  # zero rows: no expert
        recv = torch.empty_like(send)
    pack_rows_to(send, hidden, physical, topk_weights, place, offsets)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    rows, slot_ids, weights = unpack_local(recv, hidden.dtype, hidden_size, top_k, ep_rank, num_local)
    got = experts(rows, slot_ids, weights)
    back = got.new_empty((send.shape[0], *got.shape[1:]))  # the rows this rank sent, each with its partial output
    dist.all_to_all_single(back, got.contiguous(), send_splits, recv_splits, group=group)
    if counters is not None and not is_capturing(hidden):
        counters.num_rows_sent += int(counts.sum()) if send_splits is None else sum(send_splits)
        counters.num_rows_received += (int((recv[:, hidden_words:hidden_words + top_k] != 0).any(1).sum())
                                       if recv_splits is None else sum(recv_splits))
        counters.num_exchanges += 1
    out = combine_rows(back.reshape(back.shape[0], -1), place, offsets, num_tokens)
    return out.view(num_tokens, *back.shape[1:])


def _exchange_exact(packed: torch.Tensor, to_rank: torch.Tensor, run_experts, group,
                    counters: DispatchCounters | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch, experts and combine with exact split sizes (one count exchange and one host read).

    Returns:
        (the partial outputs that came back [S, ...], the home token of each [S] int64), rows grouped by
        destination rank in rank order.
    """
    home = to_rank.t().nonzero(as_tuple=True)[1]  # sorted by destination, then token
    send_counts = to_rank.sum(dim=0)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    recv = packed.new_empty((sum(recv_splits), packed.shape[1]))
    dist.all_to_all_single(recv, packed[home], recv_splits, send_splits, group=group)
    got = run_experts(recv)
    back = got.new_empty((len(home), *got.shape[1:]))
    dist.all_to_all_single(back, got.contiguous(), send_splits, recv_splits, group=group)
    if counters is not None:
        counters.num_rows_sent += len(home)
        counters.num_rows_received += recv.shape[0]
        counters.num_exchanges += 1
    return back, home
