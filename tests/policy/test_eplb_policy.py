"""The EPLB policy without Ray: the per-rank load window, the rebalance interval, decisions and moe_lb,
checked by hand."""

import pytest
import torch

from rayinfer.placement.parallel_config import EPLBSection, ParallelConfig
from rayinfer.policy.eplb_policy import EPLBPolicy, ExpertLoadWindow, is_rebalance_step, placement_balance


def test_window_keeps_the_last_w_steps():
    window = ExpertLoadWindow(3, num_moe_layers=2, num_logical=4)
    assert window.total().tolist() == [[0] * 4] * 2
    for step in range(5):  # step s routes s + 1 tokens to expert s % 4 in layer 0, one to expert 3 in layer 1
        load = torch.zeros(2, 4, dtype=torch.int64)
        load[0, step % 4] = step + 1
        load[1, 3] = 1
        window.record(load)
    # steps 2, 3, 4 remain: layer 0 gets 3 (expert 2), 4 (expert 3), 5 (expert 0)
    assert window.total().tolist() == [[5, 0, 3, 4], [0, 0, 0, 3]]
    assert window.num_recorded == 5 and window.window == 3
    with pytest.raises(ValueError, match="shape"):
        window.record(torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="window"):
        ExpertLoadWindow(0, 1, 4)


@pytest.mark.parametrize("num_steps, interval, due", [
    (0, 4, False), (3, 4, False), (4, 4, True), (8, 4, True), (9, 4, False), (4, 0, False), (1, 1, True),
])
def test_rebalance_interval(num_steps, interval, due):
    assert is_rebalance_step(num_steps, interval) is due
    policy = EPLBPolicy(ParallelConfig(ep=2, eplb=EPLBSection(interval=interval)), num_moe_layers=1, num_logical=4)
    assert policy.is_due(num_steps) is due


def test_placement_balance_by_hand():
    # 2 ranks, slots [0, 1 | 2, 3] then [0, 1, 0 | 2, 3, 1] (expert 0 twice, expert 1 twice)
    load = torch.tensor([[60, 20, 10, 10]])
    assert placement_balance(load, torch.tensor([[0, 1, 2, 3]]), 2) == pytest.approx(80 / 50)
    # rank 0: 30 + 10 + 30 = 70; rank 1: 10 + 10 + 10 = 30
    assert placement_balance(load, torch.tensor([[0, 1, 0, 2, 3, 1]]), 2) == pytest.approx(70 / 50)
    assert placement_balance(torch.zeros(1, 4), torch.tensor([[0, 1, 2, 3]]), 2) == 1.0


def test_rebalance_splits_hot_experts_and_records_history():
    """Two hot experts start on one rank; with no redundancy they are split, with two redundant slots
    each gets a second copy."""
    load = torch.tensor([[100, 100, 0, 0], [0, 0, 100, 100]])  # layer 0: rank 0 hot; layer 1: rank 1 hot
    policy = EPLBPolicy(ParallelConfig(ep=2, eplb=EPLBSection(interval=10)), num_moe_layers=2, num_logical=4)
    assert policy.phy2log.tolist() == [[0, 1, 2, 3]] * 2
    assert policy.balance(load) == pytest.approx(2.0)
    decision = policy.rebalance(load, num_steps=10)
    assert decision.changed and decision.num_steps == 10 and decision.num_tokens == 400
    assert decision.moe_lb == pytest.approx(2.0) and decision.moe_lb_expected == pytest.approx(1.0)
    for row, hot in zip(decision.phy2log.tolist(), ([0, 1], [2, 3])):
        assert sorted(row) == [0, 1, 2, 3] and (row.index(hot[0]) < 2) != (row.index(hot[1]) < 2)
    assert torch.equal(policy.phy2log, decision.phy2log) and policy.history == [decision]
    again = policy.rebalance(load, num_steps=20)  # same load, same map: nothing to move
    assert not again.changed and again.moe_lb == pytest.approx(1.0) and len(policy.history) == 2
    assert policy.rebalance(torch.zeros(2, 4, dtype=torch.int64), num_steps=30) is None
    assert len(policy.history) == 2

    redundant = EPLBPolicy(ParallelConfig(ep=2, eplb=EPLBSection(num_redundant_experts=2)), num_moe_layers=1, num_logical=4)
    assert redundant.phy2log.tolist() == [[0, 1, 2, 3, 0, 1]]  # ExpertParallelism's initial map
    decision = redundant.rebalance(torch.tensor([[90, 90, 10, 10]]), num_steps=1)
    assert torch.bincount(decision.phy2log[0], minlength=4).tolist() == [2, 2, 1, 1]
    assert decision.moe_lb_expected == pytest.approx(1.0)


def test_policy_and_config_validation():
    with pytest.raises(ValueError, match="do not split over ep=4"):
        EPLBPolicy(ParallelConfig(ep=4, eplb=EPLBSection(num_redundant_experts=1)), num_moe_layers=1, num_logical=8)
    for bad in (dict(num_redundant_experts=-1), dict(interval=-1), dict(window=0), dict(interval=True)):
        with pytest.raises(ValueError, match=f"eplb.{next(iter(bad))}"):
            EPLBSection(**bad)
    for bad in (dict(ep=0), dict(ep=True), dict(ep=6, devices_per_node=4)):
        with pytest.raises(ValueError, match="ep" if "devices_per_node" not in bad else "devices_per_node"):
            ParallelConfig(**bad)
