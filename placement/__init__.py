"""Parallel configs -> placement-group bundles, rank maps and collective groups.

The EPLB algorithm lives in ``rayinfer.policy.eplb``.

Pure parts are re-exported here; ``rayinfer.placement.groups`` (Ray and torch.distributed) is
imported on its own by the code that creates placement groups or joins collectives.
"""

from rayinfer.placement.bundles import (
    RankInfo,
    ReplicaSpec,
    bundle_resources,
    cp_groups,
    encoder_bundle_indices,
    ep_groups,
    placement_bundles,
    rank_map,
    replica_specs,
)
from rayinfer.placement.parallel_config import ParallelConfig

__all__ = [
    "ParallelConfig",
    "RankInfo",
    "ReplicaSpec",
    "bundle_resources",
    "cp_groups",
    "encoder_bundle_indices",
    "ep_groups",
    "placement_bundles",
    "rank_map",
    "replica_specs",
]
