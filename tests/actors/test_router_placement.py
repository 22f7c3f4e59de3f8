"""A topology the cluster cannot place fails after ``placement_timeout_s`` with one line naming what is
missing (the whole deployment's need against the cluster's resources), not a hang."""

import pytest

from rayinfer.actors.client import make_client
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.placement.parallel_config import ParallelConfig


def test_unplaceable_pd_fleet_fails_with_one_line_naming_the_shortfall(ray_cluster):
    total = ray_cluster.cluster_resources()["CPU"]
    per_rank = total + 1  # not even the first replica fits, so nothing is placed or loaded
    with pytest.raises(TimeoutError) as info:
        make_client(ModelConfig(dtype="float32"), EngineConfig(device="cpu", num_kv_blocks=64),
                    ParallelConfig(num_prefill=2, num_decode=2, num_cpus_per_replica=per_rank,
                                   placement_timeout_s=1))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("cannot place replica 0 after 1 s: ")
    assert f"parallel (pd) needs 4 ranks x {{CPU: {per_rank:g}}} = {{CPU: {4 * per_rank:g}}}" in message
    assert f"the cluster has {{CPU: {total:g}}} in all" in message
    assert "parallel.num_cpus_per_replica" in message
