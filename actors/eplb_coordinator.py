"""EPLBCoordinator: gathers the EP ranks' expert-load windows and pushes new expert placements (thin; the
policy is ``rayinfer.policy.eplb_policy.EPLBPolicy``)."""

from __future__ import annotations

import ray
import torch

from rayinfer.actors.cluster import configure_worker_logging
from rayinfer.placement.parallel_config import ParallelConfig
from rayinfer.policy.eplb_policy import EPLBPolicy


class EPLBCoordinatorImpl:
    """Every ``eplb.interval`` steps: sum the ranks' load windows, rebalance, push the map to every rank.

    The ranks step on their own, so there is no moment when none is stepping: rank 0's loop calls
    :meth:`on_step` (fire and forget) after every ``interval``-th step, and the ranks go on meanwhile.
    Rank 0 rather than a poll because it knows the step count exactly and costs one call per interval;
    the load windows read here may hold a step or two more than ``num_steps``. A changed map is pushed
    with a version (1, 2, ...); each rank reports the newest version it holds in its step vote, and all
    ranks switch (a collective weight move) before the first step whose gathered votes show every rank
    has it (``policy.ep_vote.plan_step``).

    Args:
        ranks: the EPRankActor handles, in EP-rank order.
        config: the parallel config (``ep`` and its ``eplb`` section).
        num_moe_layers, num_logical, num_groups: the model's MoE shape (see :class:`EPLBPolicy`).
    """

    def __init__(self, ranks: list, config: ParallelConfig, num_moe_layers: int, num_logical: int, num_groups: int = 1):
        configure_worker_logging()
        self.ranks = list(ranks)
        self.policy = EPLBPolicy(config, num_moe_layers, num_logical, num_groups)
        self.placement_version = 0  # changed maps pushed so far

    def gather_load(self) -> torch.Tensor:
        """The ranks' load windows summed: [num_moe_layers, L] int64."""
        return torch.stack(ray.get([r.load_window.remote() for r in self.ranks])).sum(dim=0)

    def on_step(self, num_steps: int) -> dict | None:
        """After ``num_steps`` steps of the ranks: rebalance when due.

        Returns:
            None when not due or the window is empty; else the decision's summary (moe_lb before and
            expected after, whether the map changed).
        Side effects: when the map changes, every rank gets it as the next placement version.
        """
        if not self.policy.is_due(num_steps):
            return None
        decision = self.policy.rebalance(self.gather_load(), num_steps)
        if decision is None:
            return None
        if decision.changed:
            self.placement_version += 1
            ray.get([r.set_placement.remote(decision.phy2log, self.placement_version) for r in self.ranks])
        return _summary(decision)

    def stats(self) -> dict:
        """``moe_lb`` of the current window under the current map, and the rebalances so far."""
        history = self.policy.history
        return {
            "moe_lb": self.policy.balance(self.gather_load()),
            "num_rebalances": sum(d.changed for d in history),
            "eplb_history": [_summary(d) for d in history],
        }

    def history(self) -> list[dict]:
        """One summary per decision so far (num_steps, changed, moe_lb, moe_lb_expected, num_tokens)."""
        return [_summary(d) for d in self.policy.history]

    def placement(self) -> torch.Tensor:
        """The current map, [num_moe_layers, P] int64."""
        return self.policy.phy2log.clone()


def _summary(decision) -> dict:
    return {"num_steps": decision.num_steps, "changed": decision.changed, "moe_lb": decision.moe_lb,
            "moe_lb_expected": decision.moe_lb_expected, "num_tokens": decision.num_tokens}


EPLBCoordinator = ray.remote(num_cpus=0)(EPLBCoordinatorImpl)
