"""Expert-parallel load balancer: redundant experts and their placement on GPUs, after DeepSeek EPLB.

Given each logical expert's load (tokens routed to it, per MoE layer), choose how many copies each
expert gets and which GPU slot holds each copy, so that the busiest GPU carries as little as possible.
Same semantics and outputs as DeepSeek's published ``eplb.py`` (github.com/deepseek-ai/EPLB), written
anew here; ``rank_loads`` and ``moe_load_balance`` measure the result.

Glossary:
    X           any leading batch of independent rows (MoE layers, or layers x nodes).
    log         logical expert: an expert of the model, ids ``0 .. num_log - 1``.
    phy         physical expert: one slot on one GPU holding a copy of a logical expert; slots are
                numbered GPU-major, slot ``s`` lives on GPU ``s // (num_phy // num_gpus)``.
    phy2log     ``[X, num_phy]``: the logical expert held by each physical slot.
    log2phy     ``[X, num_log, max_cnt]``: the physical slots holding each logical expert, in replica
                rank order, padded with -1.
    logcnt      ``[X, num_log]``: copies (replicas) of each logical expert, >= 1.
    phyrank     ``[X, num_phy]``: replica rank of a slot among its expert's copies (0 .. logcnt - 1).
    group       expert group of grouped (node-limited) top-k routing: ``num_log // num_groups``
                consecutive logical experts. The hierarchical policy keeps a group on one node.
    pack        a bin of ``balanced_packing``: a node in step 1, a GPU in step 3 of the hierarchy.
    mlog        node-major logical id: logical experts renumbered so node k's experts are the
                contiguous ids ``[k * num_log / num_nodes, (k + 1) * num_log / num_nodes)``.
    pphy        packed physical id: the final slot, ``gpu * phy_per_gpu + position on the GPU``.
    moe_lb      max rank load / mean rank load (1.0 is perfect balance).
"""

from __future__ import annotations

import numpy as np
import torch


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Inverse of each row of ``perm`` [X, n] int64 (a permutation of 0..n-1 per row)."""
    inv = torch.empty_like(perm)
    inv.scatter_(-1, perm, torch.arange(perm.size(-1), dtype=perm.dtype).expand_as(perm).contiguous())
    return inv


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split n weighted items into ``num_packs`` packs of exactly n / num_packs items, balancing pack sums.

    Algorithm (greedy, after DeepSeek EPLB):
        1. If each pack takes one item, item i goes to pack i.
        2. Otherwise visit the items heaviest first (ties: lower index first).
        3. Put each into the pack with the smallest sum among packs that still have room
           (ties: lowest pack index); its rank in the pack is the pack's item count before it.

    Args:
        weight: [X, n] float or int, the weight of each item; rows are independent.
        num_packs: number of packs; must divide n.

    Returns:
        pack_index: [X, n] int64, the pack of each item.
        rank_in_pack: [X, n] int64, the item's position inside its pack (0 .. n / num_packs - 1).

    Raises:
        ValueError: weight not 2-D, or n not a multiple of num_packs.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [X, n]; got shape {tuple(weight.shape)}")
    num_rows, num_items = weight.shape
    if num_packs < 1 or num_items % num_packs != 0:
        raise ValueError(f"num_packs={num_packs} must divide the number of items n={num_items}")
    items_per_pack = num_items // num_packs

    if items_per_pack == 1:
        pack_index = torch.arange(num_items, dtype=torch.int64).expand(num_rows, num_items).clone()
        return pack_index, torch.zeros(num_rows, num_items, dtype=torch.int64)

    weight = weight.detach().float().cpu()
    order = weight.sort(dim=-1, descending=True, stable=True).indices.tolist()
    rows = weight.numpy()
    pack_index = np.full((num_rows, num_items), -1, dtype=np.int64)
    rank_in_pack = np.full((num_rows, num_items), -1, dtype=np.int64)
    for row in range(num_rows):
        pack_sum = np.zeros(num_packs, dtype=np.float32)  # float32 like DeepSeek's, so near-ties fall alike
        pack_count = [0] * num_packs
        for item in order[row]:
            open_packs = (p for p in range(num_packs) if pack_count[p] < items_per_pack)
            pack = min(open_packs, key=pack_sum.__getitem__)  # first lightest on ties
            pack_index[row, item] = pack
            rank_in_pack[row, item] = pack_count[pack]
            pack_sum[pack] += rows[row, item]
            pack_count[pack] += 1
    return torch.from_numpy(pack_index), torch.from_numpy(rank_in_pack)


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expand num_log logical experts into num_phy physical copies, minimising the largest load per copy.

    Algorithm (greedy, after DeepSeek EPLB):
        1. Physical slot i < num_log holds logical expert i as its replica 0.
        2. Each further slot copies the expert with the largest load per copy, ``weight / logcnt``
           (ties: lowest expert id); the new copy's replica rank is that expert's count before it.

    Args:
        weight: [X, num_log] float or int, load of each logical expert; rows are independent.
        num_phy: physical experts after replication, >= num_log.

    Returns:
        phy2log: [X, num_phy] int64, logical expert of each physical slot.
        phyrank: [X, num_phy] int64, replica rank of each physical slot.
        logcnt: [X, num_log] int64, copies of each logical expert.

    Raises:
        ValueError: weight not 2-D, or num_phy < num_log.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [X, num_log]; got shape {tuple(weight.shape)}")
    num_rows, num_log = weight.shape
    if num_phy < num_log:
        raise ValueError(f"num_phy={num_phy} must be >= the number of logical experts {num_log}")
    weight = weight.detach().float().cpu()
    rows = torch.arange(num_rows)
    phy2log = torch.cat(
        [torch.arange(num_log, dtype=torch.int64).expand(num_rows, num_log),
         torch.empty(num_rows, num_phy - num_log, dtype=torch.int64)], dim=-1
    )
    phyrank = torch.zeros(num_rows, num_phy, dtype=torch.int64)
    logcnt = torch.ones(num_rows, num_log, dtype=torch.int64)
    for slot in range(num_log, num_phy):
        expert = (weight / logcnt).argmax(dim=-1)  # first maximum on ties
        phy2log[:, slot] = expert
        phyrank[:, slot] = logcnt[rows, expert]
        logcnt[rows, expert] += 1
    return phy2log, phyrank, logcnt


def rebalance_experts_hierarchical(
    weight: torch.Tensor, num_physical_experts: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place replicated experts in two levels: expert groups onto nodes, then copies onto GPUs.

    Keeping each expert group on one node lets grouped top-k routing send a token's experts to few
    nodes; replication happens inside a node so copies never cross the slower inter-node links.

    Algorithm (after DeepSeek EPLB):
        1. Sum each group's load and pack the groups onto nodes (``balanced_packing``, groups per
           node equal); renumber the logical experts node-major (log -> mlog).
        2. Inside each node, replicate its num_log / num_nodes experts into num_phy / num_nodes
           physical experts (``replicate_experts``).
        3. Inside each node, pack its physical experts onto its GPUs by load per copy
           (``balanced_packing``), giving each its final slot (pphy); map back to logical ids.

    Args:
        weight: [num_layers, num_log] float or int, load of each logical expert.
        num_physical_experts: num_phy, physical slots in total; a multiple of num_gpus, >= num_log.
        num_groups: expert groups; divides num_log and is a multiple of num_nodes.
        num_nodes: nodes (fast intra-node links inside); divides num_gpus.
        num_gpus: GPUs (expert-parallel ranks) in total.

    Returns:
        phy2log: [num_layers, num_phy] int64, logical expert of each slot (GPU-major slots).
        phyrank: [num_layers, num_phy] int64, replica rank of each slot.
        logcnt: [num_layers, num_log] int64, copies of each logical expert.

    Raises:
        ValueError: weight not 2-D, or a divisibility rule above does not hold.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [num_layers, num_logical_experts]; got shape {tuple(weight.shape)}")
    num_layers, num_log = weight.shape
    num_phy = num_physical_experts
    _check_divides(num_groups, num_log, "num_groups", "the number of logical experts")
    _check_divides(num_nodes, num_groups, "num_nodes", "num_groups")
    _check_divides(num_nodes, num_gpus, "num_nodes", "num_gpus")
    _check_divides(num_gpus, num_phy, "num_gpus", "num_physical_experts")
    if num_phy < num_log:
        raise ValueError(f"num_physical_experts={num_phy} must be >= the number of logical experts {num_log}")
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    log_per_node = num_log // num_nodes
    phy_per_node = num_phy // num_nodes
    phy_per_gpu = num_phy // num_gpus
    weight = weight.detach().float().cpu()

    # Step 1: groups -> nodes. Group g lands at position r of node p, so its experts become mlog ids
    # (p * groups_per_node + r) * group_size + 0 .. group_size - 1.
    group_load = weight.reshape(num_layers, num_groups, group_size).sum(dim=-1)  # [L, G]
    group_node, group_rank = balanced_packing(group_load, num_nodes)  # [L, G] each
    group_base = (group_node * groups_per_node + group_rank) * group_size  # [L, G]
    log2mlog = (group_base.unsqueeze(-1) + torch.arange(group_size)).flatten(-2)  # [L, num_log]
    mlog2log = _inverse(log2mlog)  # [L, num_log]

    # Step 2: replicate inside each node; rows become (layer, node).
    mlog_load = weight.gather(-1, mlog2log).view(num_layers * num_nodes, log_per_node)
    phy2mlog, phyrank, mlogcnt = replicate_experts(mlog_load, phy_per_node)  # [L*N, phy_per_node] ...

    # Step 3: physical experts -> GPUs of their node, by load per copy.
    phy_load = (mlog_load / mlogcnt).gather(-1, phy2mlog)  # [L*N, phy_per_node]
    gpu_index, rank_on_gpu = balanced_packing(phy_load, num_gpus // num_nodes)
    phy2pphy = gpu_index * phy_per_gpu + rank_on_gpu  # node-local final slot of each physical expert
    pphy2phy = _inverse(phy2pphy)

    node_offset = (torch.arange(num_nodes) * log_per_node).view(1, num_nodes, 1)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy).view(num_layers, num_nodes, phy_per_node) + node_offset
    pphy2log = mlog2log.gather(-1, pphy2mlog.flatten(-2))  # [L, num_phy]
    pphyrank = phyrank.gather(-1, pphy2phy).view(num_layers, num_phy)
    logcnt = mlogcnt.view(num_layers, num_log).gather(-1, log2mlog)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EPLB entry point: choose copies and GPU slots for every logical expert of every MoE layer.

    Policy (after DeepSeek EPLB):
        1. Hierarchical when num_groups % num_nodes == 0 (groups stay on one node; the prefill
           setting with a smaller EP size); otherwise global, i.e. hierarchical with one group
           and one node (the decode setting with a larger EP size).
        2. Invert phy2log into log2phy, padding to the largest copy count with -1.

    Args:
        weight: [num_layers, num_log] float or int, load statistics of each logical expert.
        num_replicas: physical experts (slots) in total, a multiple of num_gpus, >= num_log.
        num_groups: expert groups of the routing (1 when routing is not grouped).
        num_nodes: nodes with fast intra-node links.
        num_gpus: GPUs (EP ranks) in total, a multiple of num_nodes.

    Returns:
        phy2log: [num_layers, num_replicas] int64, logical expert of each slot; slot s is on GPU
            ``s // (num_replicas // num_gpus)``.
        log2phy: [num_layers, num_log, max_cnt] int64, slots of each expert by replica rank, -1 padded.
        logcnt: [num_layers, num_log] int64, copies of each expert.

    Raises:
        ValueError: weight not 2-D, or a divisibility rule of the chosen policy does not hold.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [num_layers, num_logical_experts]; got shape {tuple(weight.shape)}")
    num_layers, num_log = weight.shape
    if num_groups >= 1 and num_nodes >= 1 and num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_gpus)

    max_cnt = int(logcnt.max())
    log2phy = torch.full((num_layers, num_log * max_cnt), -1, dtype=torch.int64)
    slots = torch.arange(num_replicas, dtype=torch.int64).expand(num_layers, num_replicas).contiguous()
    log2phy.scatter_(-1, phy2log * max_cnt + phyrank, slots)
    return phy2log, log2phy.view(num_layers, num_log, max_cnt), logcnt


def rank_loads(
    logical_load: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_ranks: int
) -> torch.Tensor:
    """Expected load of each EP rank when each logical expert's load splits evenly over its copies.

    Args:
        logical_load: [num_layers, num_log] float or int, tokens per logical expert.
        phy2log: [num_layers, num_phy] int64, from ``rebalance_experts`` (or ``arange`` for no EPLB).
        logcnt: [num_layers, num_log] int64, copies of each expert.
        num_ranks: EP ranks; divides num_phy (slots are GPU-major).

    Returns:
        [num_layers, num_ranks] float64, tokens per rank.

    Raises:
        ValueError: num_ranks does not divide num_phy.
    """
    num_layers, num_phy = phy2log.shape
    _check_divides(num_ranks, num_phy, "num_ranks", "the number of physical experts")
    per_copy = logical_load.double() / logcnt.double()  # [L, num_log]
    slot_load = per_copy.gather(-1, phy2log)  # [L, num_phy]
    return slot_load.view(num_layers, num_ranks, num_phy // num_ranks).sum(dim=-1)


def moe_load_balance(loads: torch.Tensor, num_ranks: int) -> float:
    """The moe_lb metric: max rank load / mean rank load, averaged over layers (1.0 is perfect).

    Args:
        loads: [num_layers, num_phy] or [num_phy] tokens per physical expert (GPU-major slots,
            num_phy a multiple of num_ranks), or per-rank loads [num_layers, num_ranks] (the same
            formula with one slot per rank).
        num_ranks: EP ranks.

    Returns:
        mean over layers of max/mean rank load; a layer with no load counts as 1.0.

    Raises:
        ValueError: loads not 1-D/2-D, or num_ranks does not divide its last dimension.
    """
    if loads.dim() == 1:
        loads = loads.unsqueeze(0)
    if loads.dim() != 2:
        raise ValueError(f"loads must be [num_layers, num_phy] or [num_phy]; got shape {tuple(loads.shape)}")
    num_layers, num_slots = loads.shape
    _check_divides(num_ranks, num_slots, "num_ranks", "the number of slots")
    per_rank = loads.double().reshape(num_layers, num_ranks, num_slots // num_ranks).sum(dim=-1)
    mean = per_rank.mean(dim=-1)
    ratio = torch.where(mean > 0, per_rank.max(dim=-1).values / mean.clamp_min(1e-30), torch.ones_like(mean))
    return float(ratio.mean())


def _check_divides(divisor: int, value: int, divisor_name: str, value_name: str) -> None:
    if divisor < 1 or value % divisor != 0:
        raise ValueError(f"{divisor_name}={divisor} must divide {value_name} ({value})")
