import pytest

from rayinfer.engine.types import EngineRole
from rayinfer.placement.bundles import (
    RankInfo,
    bundle_resources,
    cp_groups,
    ep_groups,
    placement_bundles,
    rank_map,
    replica_specs,
)
from rayinfer.placement.parallel_config import ParallelConfig

N = EngineRole.NORMAL


def test_bundle_resources_per_device():
    assert bundle_resources("cpu") == {"CPU": 1.0}
    assert bundle_resources("gpu") == {"GPU": 1.0, "CPU": 1.0}
    assert bundle_resources("npu") == {"NPU": 1.0, "CPU": 1.0}
    with pytest.raises(ValueError, match="device"):
        bundle_resources("tpu")


def test_placement_bundles_one_per_rank():
    assert placement_bundles(ParallelConfig(dp=2, ep=2, device="gpu")) == [{"GPU": 1.0, "CPU": 1.0}] * 4
    # a rank's resources come from the config: CPUs per rank, a fraction of a GPU (replicas sharing one)
    assert placement_bundles(ParallelConfig(num_prefill=1, num_decode=1, num_cpus_per_replica=2,
                                            num_gpus_per_replica=0.5)) == [{"GPU": 0.5, "CPU": 2.0}] * 2


def test_dp2_ep4_on_8_devices():
    cfg = ParallelConfig(dp=2, ep=4)
    assert rank_map(cfg) == [
        RankInfo(rank=0, replica_id=0, role=N, dp_rank=0, local_rank=0, cp_rank=0, ep_rank=0),
        RankInfo(rank=1, replica_id=0, role=N, dp_rank=0, local_rank=1, cp_rank=0, ep_rank=1),
        RankInfo(rank=2, replica_id=0, role=N, dp_rank=0, local_rank=2, cp_rank=0, ep_rank=2),
        RankInfo(rank=3, replica_id=0, role=N, dp_rank=0, local_rank=3, cp_rank=0, ep_rank=3),
        RankInfo(rank=4, replica_id=1, role=N, dp_rank=1, local_rank=0, cp_rank=0, ep_rank=0),
        RankInfo(rank=5, replica_id=1, role=N, dp_rank=1, local_rank=1, cp_rank=0, ep_rank=1),
        RankInfo(rank=6, replica_id=1, role=N, dp_rank=1, local_rank=2, cp_rank=0, ep_rank=2),
        RankInfo(rank=7, replica_id=1, role=N, dp_rank=1, local_rank=3, cp_rank=0, ep_rank=3),
    ]
    specs = replica_specs(cfg)
    assert [(s.replica_id, s.role, s.dp_rank, s.bundle_indices) for s in specs] == [
        (0, N, 0, [0, 1, 2, 3]),
        (1, N, 1, [4, 5, 6, 7]),
    ]
    assert ep_groups(cfg) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cp_groups(cfg) == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert ep_groups(cfg, local=True) == [[0, 1, 2, 3]]
    assert cp_groups(cfg, local=True) == [[0], [1], [2], [3]]


def test_dp2_cp2_ep3_grid_is_ep_fastest():
    cfg = ParallelConfig(dp=2, cp=2, ep=3)
    assert [(i.rank, i.replica_id, i.cp_rank, i.ep_rank) for i in rank_map(cfg)[:7]] == [
        (0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 0, 2), (3, 0, 1, 0), (4, 0, 1, 1), (5, 0, 1, 2), (6, 1, 0, 0),
    ]
    assert ep_groups(cfg) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert cp_groups(cfg) == [[0, 3], [1, 4], [2, 5], [6, 9], [7, 10], [8, 11]]
    assert ep_groups(cfg, local=True) == [[0, 1, 2], [3, 4, 5]]
    assert cp_groups(cfg, local=True) == [[0, 3], [1, 4], [2, 5]]


def test_disaggregated_prefill_first_then_decode():
    cfg = ParallelConfig(ep=2, num_prefill=1, num_decode=2)
    specs = replica_specs(cfg)
    assert [(s.replica_id, s.role, s.dp_rank, s.bundle_indices) for s in specs] == [
        (0, EngineRole.PREFILL, 0, [0, 1]),
        (1, EngineRole.DECODE, 0, [2, 3]),
        (2, EngineRole.DECODE, 1, [4, 5]),
    ]
    assert [i.role for i in rank_map(cfg)] == ["prefill"] * 2 + ["decode"] * 4  # str-valued enum
    assert ep_groups(cfg) == [[0, 1], [2, 3], [4, 5]]
    assert len(placement_bundles(cfg)) == cfg.world_size == 6


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(dp=3, cp=2, ep=4),
        ParallelConfig(cp=4, ep=2, num_prefill=2, num_decode=1),
        ParallelConfig(),
    ],
)
def test_groups_partition_each_replica(cfg):
    infos = rank_map(cfg)
    assert [i.rank for i in infos] == list(range(cfg.world_size))
    for groups, size in ((ep_groups(cfg), cfg.ep), (cp_groups(cfg), cfg.cp)):
        assert sorted(r for g in groups for r in g) == list(range(cfg.world_size))
        assert all(len(g) == size and len({infos[r].replica_id for r in g}) == 1 for g in groups)
    for g in ep_groups(cfg):
        assert [infos[r].ep_rank for r in g] == list(range(cfg.ep))
        assert len({infos[r].cp_rank for r in g}) == 1
    for g in cp_groups(cfg):
        assert [infos[r].cp_rank for r in g] == list(range(cfg.cp))
    for info in infos:
        assert info.local_rank == info.cp_rank * cfg.ep + info.ep_rank
        assert info.rank == info.replica_id * cfg.ranks_per_replica + info.local_rank


def test_fleet_shortfall_names_what_the_cluster_lacks():
    from rayinfer.placement.bundles import fleet_shortfall

    pd = ParallelConfig(num_prefill=2, num_decode=2, num_cpus_per_replica=1)
    assert fleet_shortfall(pd, {"CPU": 2.0, "memory": 1e10}) == (
        "parallel (pd) needs 4 ranks x {CPU: 1} = {CPU: 4}; the cluster has {CPU: 2} in all")
    assert fleet_shortfall(pd, {"CPU": 4.0}) is None
    assert fleet_shortfall(pd, {"CPU": 4.0}, {"memory": 1e10}) == (
        "parallel (pd) needs 4 ranks x {CPU: 1} = {CPU: 4}; the cluster has {CPU: 4} in all, {CPU: 0} free")
    gpu = ParallelConfig(dp=2, num_cpus_per_replica=2, num_gpus_per_replica=1)
    assert fleet_shortfall(gpu, {"CPU": 16.0, "GPU": 1.0}) == (
        "parallel (colocated) needs 2 ranks x {GPU: 1, CPU: 2} = {GPU: 2, CPU: 4}; the cluster has "
        "{GPU: 1, CPU: 16} in all")
    epd = ParallelConfig(num_prefill=1, num_decode=1, num_cpus_per_replica=1, encoder={"num_encoders": 2})
    assert fleet_shortfall(epd, {"CPU": 3.0}) == (
        "parallel (pd + 2 encoder(s)) needs 4 ranks x {CPU: 1} = {CPU: 4}; the cluster has {CPU: 3} in all")
