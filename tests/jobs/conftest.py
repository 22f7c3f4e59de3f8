"""Shared by the batch-job tests: one fleet of the default model (SmolLM2, float32, CPU) for the whole
session, which ``run(cfg, client=fleet)`` uses instead of starting its own (a fleet takes tens of seconds
to start on a small CPU)."""

import pytest


@pytest.fixture(scope="session")
def fleet(ray_cluster):
    """A colocated client of one SmolLM2 replica (1 CPU, 256 KV blocks), shut down after the session."""
    from rayinfer.actors.client import make_client
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.placement.parallel_config import ParallelConfig

    client = make_client(ModelConfig(dtype="float32"), EngineConfig(device="cpu", num_kv_blocks=256),
                         ParallelConfig(dp=1, num_cpus_per_replica=1))
    yield client
    client.shutdown()
