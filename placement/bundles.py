"""Pure maps from a ParallelConfig to replicas, ranks, placement-group bundles and rank groups.

Layout, all by construction (so every list here can be checked by hand):

- Global rank r occupies bundle r of the whole-deployment placement group.
- Replicas are numbered by ``replica_id``: PREFILL replicas first, then DECODE; or the ``dp`` NORMAL
  replicas. Replica k holds the contiguous ranks ``[k * R, (k + 1) * R)`` with ``R = cp * ep``.
- Inside a replica, ``local_rank = cp_rank * ep + ep_rank`` (ep fastest, so an EP group's all-to-all
  stays on neighbouring devices, inside a node when it fits).
- Encoder replicas (``encoder.num_encoders``) come after every engine rank: encoder replica i holds
  bundle ``world_size + i`` (:func:`encoder_bundle_indices`), one rank each.
- An EP group is the ``ep`` ranks of one replica that share a cp rank; its ranks also run attention
  data-parallel. A CP group is the ``cp`` ranks of one replica that share an ep rank.

Example, ``ParallelConfig(dp=2, ep=4)`` on 8 devices: replica 0 = ranks 0-3, replica 1 = ranks 4-7;
``ep_groups`` = [[0, 1, 2, 3], [4, 5, 6, 7]]; ``cp_groups`` = [[0], [1], ..., [7]].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rayinfer.engine.types import EngineRole
from rayinfer.placement.parallel_config import ParallelConfig

_ACCELERATOR_RESOURCE = {"cpu": None, "gpu": "GPU", "npu": "NPU"}


@dataclass(frozen=True)
class RankInfo:
    """Where one rank sits: its replica, role and coordinates in the replica's [cp, ep] grid."""

    rank: int  # global rank, == bundle index in the whole-deployment placement group
    replica_id: int  # index into replica_specs(cfg)
    role: EngineRole
    dp_rank: int  # index of the replica among the replicas of its role
    local_rank: int  # rank inside the replica: cp_rank * ep + ep_rank
    cp_rank: int
    ep_rank: int  # also the attention data-parallel rank inside the replica


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica: its id, role, data-parallel rank within its role and its ranks in local order."""

    replica_id: int
    role: EngineRole
    dp_rank: int
    ranks: tuple[RankInfo, ...]

    @property
    def bundle_indices(self) -> list[int]:
        """Bundles the replica occupies in the whole-deployment placement group, local-rank order."""
        return [info.rank for info in self.ranks]

    @property
    def num_ranks(self) -> int:
        """Devices the replica spans (cp * ep)."""
        return len(self.ranks)


def bundle_resources(device: str, num_cpus: float = 1.0, num_accelerators: float = 1.0) -> dict[str, float]:
    """Ray resources of one rank's bundle: ``num_cpus`` CPUs, plus ``num_accelerators`` on "gpu"/"npu".

    Raises:
        ValueError: for a device other than "cpu", "gpu", "npu".
    """
    if device not in _ACCELERATOR_RESOURCE:
        raise ValueError(f"device must be one of cpu, gpu, npu; got {device!r}")
    accelerator = _ACCELERATOR_RESOURCE[device]
    cpus = float(num_cpus)
    return {"CPU": cpus} if accelerator is None else {accelerator: float(num_accelerators), "CPU": cpus}


def rank_resources(cfg: ParallelConfig) -> dict[str, float]:
    """One rank's bundle under ``cfg``: its ``num_cpus_per_replica`` (1 when unset) CPUs and, on an
    accelerator, its ``num_gpus_per_replica`` (1 when unset) devices."""
    return bundle_resources(cfg.device_kind, cfg.num_cpus_per_replica or 1.0, cfg.num_gpus_per_replica or 1.0)


def fleet_shortfall(cfg: ParallelConfig, total: Mapping[str, float],
                    free: Mapping[str, float] | None = None) -> str | None:
    """What the cluster lacks to place the whole deployment, in one line, or None when it holds enough.

    Args:
        cfg: the deployment, with ``num_cpus_per_replica`` resolved.
        total: the cluster's resources (``ray.cluster_resources()``), e.g. ``{"CPU": 2.0}``.
        free: with it, the comparison is against the free resources (``ray.available_resources()``),
            and both are named.
    Returns:
        e.g. "parallel needs 4 ranks x {CPU: 1} = {CPU: 4}; the cluster has {CPU: 2} in all", or None.
    """
    bundle = rank_resources(cfg)
    need = {k: v * cfg.num_bundles for k, v in bundle.items()}
    have = total if free is None else free
    if all(have.get(k, 0.0) >= v for k, v in need.items()):
        return None
    encoders = f" + {cfg.num_encoders} encoder(s)" if cfg.num_encoders else ""
    line = (f"parallel ({cfg.topology}{encoders}) needs {cfg.num_bundles} ranks x {_fmt(bundle)} = {_fmt(need)}; "
            f"the cluster has {_fmt(total, need)} in all")
    return line if free is None else f"{line}, {_fmt(free, need)} free"


def _fmt(resources: Mapping[str, float], keys=None) -> str:
    """``{CPU: 2, GPU: 1}``: the named keys (a missing one as 0), or every key of ``resources``."""
    names = list(keys if keys is not None else resources)
    return "{" + ", ".join(f"{k}: {resources.get(k, 0.0):g}" for k in names) + "}"


def placement_bundles(cfg: ParallelConfig) -> list[dict[str, float]]:
    """The placement-group bundle list: ``cfg.num_bundles`` bundles, bundle i for global rank i (the
    engine ranks, then the encoder replicas)."""
    return [rank_resources(cfg) for _ in range(cfg.num_bundles)]


def encoder_bundle_indices(cfg: ParallelConfig) -> list[int]:
    """The bundle of each encoder replica, by encoder index: ``[world_size, ..., num_bundles - 1]``."""
    return list(range(cfg.world_size, cfg.num_bundles))


def replica_roles(cfg: ParallelConfig) -> list[tuple[EngineRole, int]]:
    """``(role, dp_rank)`` of each replica, by replica_id: PREFILL then DECODE, or all NORMAL."""
    if cfg.is_disaggregated:
        return [(EngineRole.PREFILL, i) for i in range(cfg.num_prefill)] + [
            (EngineRole.DECODE, i) for i in range(cfg.num_decode)
        ]
    return [(EngineRole.NORMAL, i) for i in range(cfg.dp)]


def rank_map(cfg: ParallelConfig) -> list[RankInfo]:
    """Every rank of the deployment, in global-rank (= bundle) order.

    Returns:
        ``cfg.world_size`` RankInfo; ``result[r].rank == r``.
    """
    size = cfg.ranks_per_replica
    infos = []
    for replica_id, (role, dp_rank) in enumerate(replica_roles(cfg)):
        for local_rank in range(size):
            cp_rank, ep_rank = divmod(local_rank, cfg.ep)
            infos.append(
                RankInfo(
                    rank=replica_id * size + local_rank,
                    replica_id=replica_id,
                    role=role,
                    dp_rank=dp_rank,
                    local_rank=local_rank,
                    cp_rank=cp_rank,
                    ep_rank=ep_rank,
                )
            )
    return infos


def replica_specs(cfg: ParallelConfig) -> list[ReplicaSpec]:
    """Every replica with its ranks, by replica_id."""
    infos = rank_map(cfg)
    size = cfg.ranks_per_replica
    specs = []
    for replica_id, (role, dp_rank) in enumerate(replica_roles(cfg)):
        ranks = tuple(infos[replica_id * size : (replica_id + 1) * size])
        specs.append(ReplicaSpec(replica_id=replica_id, role=role, dp_rank=dp_rank, ranks=ranks))
    return specs


def _groups(cfg: ParallelConfig, key, local: bool) -> list[list[int]]:
    # Grouping local ranks of one replica, then shifting per replica, keeps the order canonical:
    # groups sorted by (replica, first member), members ascending.
    buckets: dict[int, list[int]] = {}
    for local_rank in range(cfg.ranks_per_replica):
        cp_rank, ep_rank = divmod(local_rank, cfg.ep)
        buckets.setdefault(key(cp_rank, ep_rank), []).append(local_rank)
    local_groups = list(buckets.values())
    if local:
        return local_groups
    size = cfg.ranks_per_replica
    return [
        [replica_id * size + r for r in group]
        for replica_id in range(cfg.num_replicas)
        for group in local_groups
    ]


def ep_groups(cfg: ParallelConfig, *, local: bool = False) -> list[list[int]]:
    """Expert-parallel groups: the ranks of a replica that share a cp rank.

    Args:
        local: False: all groups of the deployment, in global ranks. True: the groups of one
            replica in local ranks (the same for every replica), ready for ``new_subgroups``
            inside that replica's process group.

    Returns:
        list of groups, each ``ep`` ranks ascending.
    """
    return _groups(cfg, lambda cp_rank, ep_rank: cp_rank, local)


def cp_groups(cfg: ParallelConfig, *, local: bool = False) -> list[list[int]]:
    """Context-parallel groups: the ranks of a replica that share an ep rank.

    Args:
        local: as for :func:`ep_groups`.

    Returns:
        list of groups, each ``cp`` ranks ascending.
    """
    return _groups(cfg, lambda cp_rank, ep_rank: ep_rank, local)
