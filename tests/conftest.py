"""Shared fixtures: one embedded Ray instance per test session, the default model's tokenizer."""

import os

import pytest

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster():
    """An embedded Ray instance on loopback (logical CPUs beyond the physical ones so several actors
    fit), never a cluster someone else started on the machine; ``$RAY_ADDRESS`` when set."""
    import ray

    from rayinfer import envs
    from rayinfer.actors.cluster import RayConfig, init_ray

    started = not ray.is_initialized()
    if started:
        init_ray(RayConfig(address=None if envs.ray_address() else "local"), num_cpus=8, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def tokenizer():
    from rayinfer.model.loader import load_tokenizer

    return load_tokenizer("SmolLM2-135M-Instruct")
