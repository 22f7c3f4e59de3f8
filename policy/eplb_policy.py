"""Expert-load balancing policy: which window of expert load to keep, when to rebalance, the new map.

Plain classes on CPU tensors (no Ray): the EP ranks keep an :class:`ExpertLoadWindow` each, and the
``EPLBCoordinator`` actor drives an :class:`EPLBPolicy` with their summed windows.

Glossary (see also ``rayinfer.model.moe`` and ``rayinfer.policy.eplb``):
    L           logical experts of a MoE layer; P = L + redundant physical slots, P / ep per rank.
    load        tokens routed to each logical expert: [num_moe_layers, L] int64.
    load window the last W steps' loads of one rank (a ring buffer); the coordinator sums it over ranks.
    phy2log     [num_moe_layers, P] int64, logical expert of each slot; slot s is on rank s // (P / ep).
    moe_lb      max rank load / mean rank load, averaged over layers (1.0 is perfect balance).
    step        one step of the EP group (all ranks run it); "after n steps" means n steps have completed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayinfer.placement.parallel_config import ParallelConfig
from rayinfer.policy.eplb import moe_load_balance, rank_loads, rebalance_experts


class ExpertLoadWindow:
    """The expert load of one rank's last ``window`` steps, one [num_moe_layers, L] record per step.

    Args:
        window: W, steps kept (older records are overwritten).
        num_moe_layers, num_logical: the record shape.
        device: where the ring buffer lives (the model's device, so recording never syncs the host).
    """

    def __init__(self, window: int, num_moe_layers: int, num_logical: int, device: torch.device | str = "cpu"):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.loads = torch.zeros(window, num_moe_layers, num_logical, dtype=torch.int64, device=device)
        self.num_recorded = 0

    @property
    def window(self) -> int:
        return self.loads.shape[0]

    def record(self, load: torch.Tensor) -> None:
        """Add one step's load, [num_moe_layers, L] int, replacing the record of W steps ago.

        Raises:
            ValueError: on a shape other than the window's record shape.
        """
        if tuple(load.shape) != tuple(self.loads.shape[1:]):
            raise ValueError(f"load of shape {tuple(load.shape)}, expected {tuple(self.loads.shape[1:])}")
        self.loads[self.num_recorded % self.window].copy_(load)
        self.num_recorded += 1

    def total(self) -> torch.Tensor:
        """Summed load of the last min(W, recorded) steps: [num_moe_layers, L] int64 on CPU."""
        return self.loads.sum(dim=0).cpu()


def is_rebalance_step(num_steps: int, interval: int) -> bool:
    """True when, after ``num_steps`` completed steps, a rebalance is due (every ``interval``; 0 = never)."""
    return interval > 0 and num_steps > 0 and num_steps % interval == 0


def placement_balance(load: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> float:
    """moe_lb of a load served by a placement, each expert's load split evenly over its replicas.

    Args:
        load: [num_moe_layers, L] tokens per logical expert.
        phy2log: [num_moe_layers, P] int64 (P a multiple of num_ranks, rank-major slots).
        num_ranks: EP ranks.
    Returns:
        mean over layers of max/mean rank load (1.0 for a layer without load).
    """
    num_logical = load.shape[-1]
    logcnt = torch.stack([torch.bincount(row, minlength=num_logical) for row in phy2log.cpu()])
    return moe_load_balance(rank_loads(load.cpu(), phy2log.cpu(), logcnt, num_ranks), num_ranks)


@dataclass(frozen=True)
class EPLBDecision:
    """One rebalance.

    Attributes:
        num_steps: steps completed when it was decided; ranks switch maps before the next step.
        phy2log: [num_moe_layers, P] int64, the new map.
        changed: False when the map is the one already in place (nothing moves).
        moe_lb: balance of the window under the map in place while it was recorded.
        moe_lb_expected: balance of the same window under the new map.
        num_tokens: routed (token, expert) pairs in the window, all layers.
    """

    num_steps: int
    phy2log: torch.Tensor
    changed: bool
    moe_lb: float
    moe_lb_expected: float
    num_tokens: int


class EPLBPolicy:
    """Every ``config.eplb.interval`` steps, rebalance the experts of every MoE layer for the last window.

    Args:
        config: the parallel config: ``ep``, the ``eplb`` section (redundant experts, interval), and
            ``ep_num_nodes`` (nodes the EP group spans).
        num_moe_layers: MoE layers of the model.
        num_logical: L, routed experts per layer.
        num_groups: expert groups of the routing (DeepSeek ``n_group``; 1 for plain top-k).
    Raises:
        ValueError: if P = L + redundant does not split over ``config.ep`` ranks.
    Source: the rebalancing step of DeepSeek EPLB (``policy.eplb.rebalance_experts``).
    """

    def __init__(self, config: ParallelConfig, num_moe_layers: int, num_logical: int, num_groups: int = 1):
        self.config = config
        self.num_logical = num_logical
        self.num_groups = num_groups
        self.num_physical = config.eplb.num_physical(num_logical, config.ep)
        initial = torch.arange(self.num_physical, dtype=torch.int64) % num_logical  # as ExpertParallelism
        self.phy2log = initial.expand(num_moe_layers, self.num_physical).clone()
        self.history: list[EPLBDecision] = []

    def is_due(self, num_steps: int) -> bool:
        """True when a rebalance is due after ``num_steps`` completed steps."""
        return is_rebalance_step(num_steps, self.config.eplb.rebalance_interval)

    def balance(self, load: torch.Tensor) -> float:
        """moe_lb of ``load`` [num_moe_layers, L] under the current map."""
        return placement_balance(load, self.phy2log, self.config.ep)

    def rebalance(self, load: torch.Tensor, num_steps: int) -> EPLBDecision | None:
        """Choose a new map for the window's load and make it current.

        Args:
            load: [num_moe_layers, L] the window summed over all ranks.
            num_steps: steps completed (recorded in the decision).
        Returns:
            the decision (also appended to ``history``), or None for a window without load (the map
            stays: there is nothing to balance).
        """
        load = load.cpu()
        if int(load.sum()) == 0:
            return None
        before = self.balance(load)
        new, _, _ = rebalance_experts(load, self.num_physical, self.num_groups, self.config.ep_num_nodes,
                                      self.config.ep)
        changed = not torch.equal(new, self.phy2log)
        self.phy2log = new
        decision = EPLBDecision(num_steps, new, changed, before, self.balance(load), int(load.sum()))
        self.history.append(decision)
        return decision
