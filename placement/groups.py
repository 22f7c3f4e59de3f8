"""Ray placement groups for a ParallelConfig, and torch.distributed collective groups inside actors.

Driver side: :func:`create_placement_group` reserves the bundles of :func:`placement_bundles` and
:func:`scheduling_strategy_for` pins an actor to one bundle. Actor side: rank 0 picks an address with
:func:`node_ip` and :func:`free_port`, hands it to every member, and each member calls
:func:`init_process_group` and then :func:`new_subgroups` for its EP/CP group. One process group per
replica (world = the replica's ranks, ranks = local ranks): replicas never run collectives together.
"""

from __future__ import annotations

import datetime
import socket

import ray
import ray.exceptions
import torch.distributed as dist
from ray.util import placement_group as _ray_placement_group
from ray.util import remove_placement_group
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayinfer.placement.bundles import placement_bundles
from rayinfer.placement.parallel_config import ParallelConfig

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_BACKENDS = {"cpu": "gloo", "gpu": "nccl", "npu": "hccl"}


def create_placement_group(
    cfg: ParallelConfig,
    *,
    strategy: str = "PACK",
    replica_id: int | None = None,
    name: str = "",
    timeout_s: float | None = 60.0,
) -> PlacementGroup:
    """Reserve the deployment's bundles (one per rank) as a Ray placement group and wait until ready.

    Args:
        cfg: the deployment.
        strategy: Ray strategy; "PACK" (default: fill nodes, neighbours share a node) or
            "STRICT_SPREAD" (one bundle per node, so it needs ``len(bundles)`` nodes), or
            "SPREAD" / "STRICT_PACK".
        replica_id: None reserves every rank (bundle index = global rank); an id reserves only
            that replica's ranks (bundle index = local rank), so replicas can be placed and
            restarted independently.
        name: optional placement-group name.
        timeout_s: seconds to wait for the reservation; None waits forever.

    Returns:
        the ready PlacementGroup.

    Raises:
        ValueError: unknown strategy, or replica_id out of range.
        TimeoutError: the cluster could not grant the bundles in time; the group is removed first.
    """
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}; got {strategy!r}")
    bundles = placement_bundles(cfg)
    if replica_id is not None:
        if not 0 <= replica_id < cfg.num_replicas:
            raise ValueError(f"replica_id must be in [0, {cfg.num_replicas}); got {replica_id}")
        bundles = bundles[: cfg.ranks_per_replica]  # all bundles are alike
    pg = _ray_placement_group(bundles, strategy=strategy, name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise TimeoutError(
            f"placement group of {len(bundles)} x {bundles[0]} ({strategy}) not ready after {timeout_s}s; "
            f"cluster resources: {ray.cluster_resources()}"
        ) from None
    return pg


def scheduling_strategy_for(
    pg: PlacementGroup, bundle_index: int, *, capture_child_tasks: bool = False
) -> PlacementGroupSchedulingStrategy:
    """Scheduling strategy that pins a task or actor to one bundle of ``pg``.

    Use as ``Actor.options(scheduling_strategy=scheduling_strategy_for(pg, i), num_cpus=1)``; the
    actor's resource request must fit inside the bundle (see ``bundle_resources``).

    Raises:
        ValueError: bundle_index outside ``[0, pg.bundle_count)``.
    """
    if not 0 <= bundle_index < pg.bundle_count:
        raise ValueError(f"bundle_index must be in [0, {pg.bundle_count}); got {bundle_index}")
    return PlacementGroupSchedulingStrategy(
        placement_group=pg,
        placement_group_bundle_index=bundle_index,
        placement_group_capture_child_tasks=capture_child_tasks,
    )


def collective_backend(device: str) -> str:
    """torch.distributed backend for a device kind: cpu -> "gloo", gpu -> "nccl", npu -> "hccl".

    Raises:
        ValueError: for an unknown device.
    """
    try:
        return _BACKENDS[device]
    except KeyError:
        raise ValueError(f"device must be one of cpu, gpu, npu; got {device!r}") from None


def node_ip() -> str:
    """IP address of this node as Ray sees it (the address other members can reach)."""
    return ray.util.get_node_ip_address()


def free_port(host: str = "") -> int:
    """A TCP port that was free on this host a moment ago (bind to port 0, read it, close).

    Another process may take it before the caller binds; callers retry on "address in use".
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> None:
    """Join the default torch.distributed process group over TCP rendezvous at master_addr:master_port.

    Every member calls this with the same world_size, address and backend; the call blocks until all
    have joined. On "nccl", set the CUDA device first.

    Raises:
        ValueError: rank outside ``[0, world_size)`` or an unknown backend.
        RuntimeError: a default group already exists in this process (from torch.distributed).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}); got {rank}")
    if backend not in _BACKENDS.values():
        raise ValueError(f"backend must be one of gloo, nccl, hccl; got {backend!r}")
    host = f"[{master_addr}]" if ":" in master_addr else master_addr  # IPv6 literal
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{host}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def new_group(ranks: list[int], backend: str | None = None) -> dist.ProcessGroup:
    """Sub-group of the default group; every member of the default group must call it, same order."""
    group = dist.new_group(ranks=sorted(ranks), backend=backend)
    assert isinstance(group, dist.ProcessGroup)  # new_group returns a group to every member
    return group


def new_subgroups(groups: list[list[int]], rank: int, backend: str | None = None) -> dist.ProcessGroup | None:
    """Create every group of a partition (e.g. ``ep_groups(cfg, local=True)``) and return ``rank``'s.

    torch.distributed requires all members of the default group to create each sub-group in the same
    order, including groups they are not in; this does that.

    Args:
        groups: disjoint lists of ranks of the default group.
        rank: this process's rank in the default group.

    Returns:
        the group containing ``rank``, or None when no group does.
    """
    mine = None
    for ranks in groups:
        group = new_group(ranks, backend=backend)
        if rank in ranks:
            mine = group
    return mine


def destroy_process_group() -> None:
    """Leave and destroy the default group and all sub-groups, if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
