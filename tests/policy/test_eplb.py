import pytest
import torch

from rayinfer.policy.eplb import (
    balanced_packing,
    moe_load_balance,
    rank_loads,
    rebalance_experts,
    rebalance_experts_hierarchical,
    replicate_experts,
)

# DeepSeek EPLB README example: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs.
README_WEIGHT = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


# ---- balanced_packing ---------------------------------------------------------------------------


def test_balanced_packing_hand_case():
    # heaviest first: 3 -> pack 0; 2 -> pack 1; 2 -> pack 1 (2 < 3); pack 1 full, so 1 -> pack 0.
    pack_index, rank_in_pack = balanced_packing(torch.tensor([[3, 2, 2, 1]]), 2)
    assert pack_index.tolist() == [[0, 1, 1, 0]]
    assert rank_in_pack.tolist() == [[0, 0, 1, 1]]
    sums = torch.zeros(2).index_add_(0, pack_index[0], torch.tensor([3.0, 2, 2, 1]))
    assert sums.tolist() == [4.0, 4.0]


def test_balanced_packing_one_item_per_pack_is_identity():
    pack_index, rank_in_pack = balanced_packing(torch.tensor([[1.0, 5.0, 3.0]]), 3)
    assert pack_index.tolist() == [[0, 1, 2]]
    assert rank_in_pack.tolist() == [[0, 0, 0]]


def test_balanced_packing_rejects_uneven_split():
    with pytest.raises(ValueError, match="num_packs"):
        balanced_packing(torch.ones(1, 5), 2)


# ---- replicate_experts --------------------------------------------------------------------------


def test_replicate_experts_hand_case():
    # 10/1 is largest -> copy expert 0; 10/2 = 5 still beats 1 -> copy it again.
    phy2log, phyrank, logcnt = replicate_experts(torch.tensor([[10, 1, 1, 1]]), 6)
    assert phy2log.tolist() == [[0, 1, 2, 3, 0, 0]]
    assert phyrank.tolist() == [[0, 0, 0, 0, 1, 2]]
    assert logcnt.tolist() == [[3, 1, 1, 1]]


def test_replicate_experts_ties_pick_lowest_expert():
    phy2log, _, logcnt = replicate_experts(torch.tensor([[4.0, 4.0]]), 3)
    assert phy2log.tolist() == [[0, 1, 0]]
    assert logcnt.tolist() == [[2, 1]]


def test_replicate_experts_rejects_too_few_slots():
    with pytest.raises(ValueError, match="num_phy"):
        replicate_experts(torch.ones(1, 4), 3)


# ---- rebalance_experts --------------------------------------------------------------------------


def test_deepseek_readme_example():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, num_groups=4, num_nodes=2, num_gpus=8)
    assert phy2log.tolist() == README_PHY2LOG
    assert logcnt.tolist() == [
        [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
        [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1],
    ]
    assert log2phy.shape == (2, 12, 2)


def test_hierarchical_small_hand_case():
    # weight [6, 1, 2, 3], groups {0,1} and {2,3}, 2 nodes x 2 GPUs x 2 slots.
    # Step 1: one group per node, in order. Step 2: node 0 copies expert 0 twice (6, then 6/2 = 3 > 1);
    # node 1 copies expert 3 (3 > 2), then expert 2 (2 > 3/2). Step 3: node 0 per-copy loads
    # [2, 1, 2, 2] -> GPU 0 gets copies {r0, r2} of e0, GPU 1 gets {e0 r1, e1}; node 1 per-copy loads
    # [1, 1.5, 1.5, 1] -> GPU 2 gets {e3 r0, e2 r0}, GPU 3 gets {e3 r1, e2 r1}.
    phy2log, log2phy, logcnt = rebalance_experts(torch.tensor([[6, 1, 2, 3]]), 8, 2, 2, 4)
    assert phy2log.tolist() == [[0, 0, 0, 1, 3, 2, 3, 2]]
    assert logcnt.tolist() == [[3, 1, 2, 2]]
    assert log2phy.tolist() == [[[0, 2, 1], [3, -1, -1], [5, 7, -1], [4, 6, -1]]]
    _, phyrank, _ = rebalance_experts_hierarchical(torch.tensor([[6.0, 1, 2, 3]]), 8, 2, 2, 4)
    assert phyrank.tolist() == [[0, 2, 1, 0, 0, 0, 1, 1]]
    assert rank_loads(torch.tensor([[6, 1, 2, 3]]), phy2log, logcnt, 4).tolist() == [[4.0, 3.0, 2.5, 2.5]]


def test_rebalance_accepts_non_contiguous_grad_input():
    weight = README_WEIGHT.t().contiguous().t().float().requires_grad_()  # [2, 12], column-major strides
    phy2log, _, _ = rebalance_experts(weight, 16, 4, 2, 8)
    assert phy2log.tolist() == README_PHY2LOG


def test_groups_not_divisible_by_nodes_uses_global_policy():
    g = torch.Generator().manual_seed(1)
    weight = torch.rand(3, 24, generator=g) * 100
    got = rebalance_experts(weight, 32, num_groups=3, num_nodes=2, num_gpus=8)
    want_phy2log, _, want_logcnt = rebalance_experts_hierarchical(weight, 32, 1, 1, 8)
    assert torch.equal(got[0], want_phy2log)
    assert torch.equal(got[2], want_logcnt)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_replicas=18, num_groups=4, num_nodes=2, num_gpus=8), "num_gpus"),  # 18 % 8
        (dict(num_replicas=16, num_groups=5, num_nodes=1, num_gpus=8), "num_groups"),  # 12 % 5
        (dict(num_replicas=16, num_groups=4, num_nodes=2, num_gpus=3), "num_nodes"),  # 3 % 2
        (dict(num_replicas=8, num_groups=4, num_nodes=2, num_gpus=8), "num_physical_experts"),  # 8 < 12
    ],
)
def test_rebalance_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rebalance_experts(README_WEIGHT, **kwargs)


CONFIGS = [
    # (num_log, num_replicas, num_groups, num_nodes, num_gpus)
    (12, 16, 4, 2, 8),
    (16, 16, 4, 4, 4),  # no redundancy
    (64, 80, 8, 2, 8),
    (64, 72, 8, 4, 8),
    (32, 48, 4, 1, 4),
    (24, 32, 3, 2, 8),  # global policy
    (256, 288, 8, 4, 32),  # DeepSeek-V3 prefill shape
]


@pytest.mark.parametrize("num_log, num_replicas, num_groups, num_nodes, num_gpus", CONFIGS)
@pytest.mark.parametrize("kind", ["uniform", "skewed", "integer_ties", "zeros"])
def test_rebalance_invariants(num_log, num_replicas, num_groups, num_nodes, num_gpus, kind):
    g = torch.Generator().manual_seed(num_log * 31 + num_replicas)
    num_layers = 3
    if kind == "uniform":
        weight = torch.rand(num_layers, num_log, generator=g) * 100
    elif kind == "skewed":
        weight = (torch.randn(num_layers, num_log, generator=g) * 1.5).exp() * 100
    elif kind == "integer_ties":
        weight = torch.randint(0, 4, (num_layers, num_log), generator=g)
    else:
        weight = torch.zeros(num_layers, num_log)
    phy2log, log2phy, logcnt = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)

    assert phy2log.shape == (num_layers, num_replicas)
    assert logcnt.shape == (num_layers, num_log)
    assert log2phy.shape == (num_layers, num_log, int(logcnt.max()))
    assert bool((logcnt >= 1).all())
    assert logcnt.sum(-1).tolist() == [num_replicas] * num_layers
    for layer in range(num_layers):
        assert torch.bincount(phy2log[layer], minlength=num_log).tolist() == logcnt[layer].tolist()
        for expert in range(num_log):
            cnt = int(logcnt[layer, expert])
            slots = log2phy[layer, expert]
            assert bool((slots[cnt:] == -1).all())
            assert bool((phy2log[layer, slots[:cnt]] == expert).all())
        # Every slot is filled exactly once; slots are GPU-major, so each GPU gets num_replicas / num_gpus.
        assert sorted(log2phy[layer][log2phy[layer] >= 0].tolist()) == list(range(num_replicas))

    if num_groups % num_nodes == 0:
        # Each node holds whole expert groups: the logical experts of a node's slots are exactly
        # num_groups / num_nodes complete groups.
        group_size = num_log // num_groups
        for layer in range(num_layers):
            for node_slots in phy2log[layer].view(num_nodes, -1):
                groups = set((node_slots // group_size).tolist())
                assert len(groups) == num_groups // num_nodes


@pytest.mark.parametrize("num_items, num_packs", [(8, 2), (12, 4), (9, 3), (64, 8)])
def test_balanced_packing_equal_counts_and_greedy_bound(num_items, num_packs):
    g = torch.Generator().manual_seed(num_items)
    weight = torch.rand(4, num_items, generator=g)
    pack_index, rank_in_pack = balanced_packing(weight, num_packs)
    per_pack = num_items // num_packs
    for row in range(4):
        assert torch.bincount(pack_index[row], minlength=num_packs).tolist() == [per_pack] * num_packs
        slots = (pack_index[row] * per_pack + rank_in_pack[row]).sort().values
        assert slots.tolist() == list(range(num_items))
        sums = torch.zeros(num_packs).index_add_(0, pack_index[row], weight[row])
        # With items visited heaviest first, the heaviest pack exceeds the mean by at most one item.
        assert float(sums.max()) <= float(weight[row].sum()) / num_packs + float(weight[row].max()) + 1e-5


# ---- metrics ------------------------------------------------------------------------------------


def test_moe_load_balance_hand_cases():
    assert moe_load_balance(torch.tensor([[3.0, 1.0]]), 2) == pytest.approx(1.5)
    assert moe_load_balance(torch.tensor([1.0, 2.0, 3.0, 2.0]), 2) == pytest.approx(5 / 4)  # ranks 3, 5
    assert moe_load_balance(torch.tensor([[2.0, 2.0], [4.0, 0.0]]), 2) == pytest.approx((1.0 + 2.0) / 2)
    assert moe_load_balance(torch.zeros(2, 4), 4) == 1.0
    with pytest.raises(ValueError, match="num_ranks"):
        moe_load_balance(torch.ones(1, 6), 4)


def test_rank_loads_split_load_evenly_over_copies():
    loads = rank_loads(torch.tensor([[9, 3]]), torch.tensor([[0, 0, 0, 1]]), torch.tensor([[3, 1]]), 2)
    assert loads.tolist() == [[6.0, 6.0]]


@pytest.mark.parametrize("num_groups, num_nodes", [(1, 1), (8, 2)])
def test_rebalancing_skewed_load_lowers_moe_lb(num_groups, num_nodes):
    num_layers, num_log, num_ranks = 4, 64, 8
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(num_layers, num_log, generator=g).exp() * 100  # log-normal expert loads
    identity = torch.arange(num_log).expand(num_layers, num_log)
    ones = torch.ones(num_layers, num_log, dtype=torch.int64)
    before = moe_load_balance(rank_loads(weight, identity, ones, num_ranks), num_ranks)
    phy2log, _, logcnt = rebalance_experts(weight, num_log + num_ranks, num_groups, num_nodes, num_ranks)
    after = moe_load_balance(rank_loads(weight, phy2log, logcnt, num_ranks), num_ranks)
    assert before > 1.5
    assert after < 1.15
