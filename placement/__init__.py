"""Parallel configs -> placement-group bundles, rank maps and collective groups; the EPLB algorithm.

Pure parts are re-exported here; ``rayinfer.placement.groups`` (Ray and torch.distributed) is
imported on its own by the code that creates placement groups or joins collectives.
"""

from rayinfer.placement.bundles import (
    RankInfo,
    ReplicaSpec,
    bundle_resources,
    cp_groups,
    ep_groups,
    placement_bundles,
    rank_map,
    replica_specs,
)
from rayinfer.placement.eplb import moe_load_balance, rank_loads, rebalance_experts
from rayinfer.placement.parallel_config import ParallelConfig

__all__ = [
    "ParallelConfig",
    "RankInfo",
    "ReplicaSpec",
    "bundle_resources",
    "cp_groups",
    "ep_groups",
    "moe_load_balance",
    "placement_bundles",
    "rank_loads",
    "rank_map",
    "rebalance_experts",
    "replica_specs",
]
