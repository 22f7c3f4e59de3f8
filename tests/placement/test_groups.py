import pytest
import torch

from rayinfer.placement.bundles import ep_groups, replica_specs
from rayinfer.placement.groups import (
    collective_backend,
    create_placement_group,
    free_port,
    init_process_group,
    scheduling_strategy_for,
)
from rayinfer.placement.parallel_config import ParallelConfig


def test_collective_backend():
    assert [collective_backend(d) for d in ("cpu", "gpu", "npu")] == ["gloo", "nccl", "hccl"]
    with pytest.raises(ValueError, match="device"):
        collective_backend("tpu")


def test_free_port_is_bindable():
    import socket

    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("", port))


def test_init_process_group_rejects_bad_rank():
    with pytest.raises(ValueError, match="rank"):
        init_process_group(2, 2, "127.0.0.1", 1)
    with pytest.raises(ValueError, match="backend"):
        init_process_group(0, 1, "127.0.0.1", 1, backend="mpi")


def test_two_actors_in_placement_group_all_reduce_over_gloo(ray_cluster):
    ray = ray_cluster
    from ray.util import remove_placement_group

    # Defined here so Ray ships the class by value (test modules are not importable on workers).
    @ray.remote(num_cpus=1)
    class Member:
        def address(self):
            from rayinfer.placement.groups import free_port, node_ip

            return node_ip(), free_port()

        def all_reduce(self, rank, world_size, addr, port, groups):
            import torch.distributed as dist

            from rayinfer.placement.groups import destroy_process_group, init_process_group, new_subgroups

            init_process_group(rank, world_size, addr, port, backend="gloo", timeout_s=60)
            try:
                t = torch.tensor([float(rank + 1)])
                dist.all_reduce(t)
                sub = new_subgroups(groups, rank)
                s = torch.tensor([10.0 * (rank + 1)])
                dist.all_reduce(s, group=sub)
                return t.item(), s.item(), dist.get_world_size(sub)
            finally:
                destroy_process_group()

    cfg = ParallelConfig(ep=2)
    pg = create_placement_group(cfg, strategy="PACK", timeout_s=60)
    try:
        (spec,) = replica_specs(cfg)
        members = [
            Member.options(scheduling_strategy=scheduling_strategy_for(pg, i)).remote()
            for i in spec.bundle_indices
        ]
        addr, port = ray.get(members[0].address.remote())
        groups = ep_groups(cfg, local=True)  # [[0, 1]]
        results = ray.get(
            [
                m.all_reduce.remote(info.local_rank, spec.num_ranks, addr, port, groups)
                for m, info in zip(members, spec.ranks)
            ],
            timeout=120,
        )
        assert results == [(3.0, 30.0, 2), (3.0, 30.0, 2)]
        with pytest.raises(ValueError, match="bundle_index"):
            scheduling_strategy_for(pg, 2)
    finally:
        remove_placement_group(pg)
