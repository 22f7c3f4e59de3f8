"""Shared fixtures: one embedded Ray instance per test session, the default model's tokenizer, and the
default model itself loaded once (CPU, float32) for the engines that tests build around it."""

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


class SharedModel:
    """The default model (SmolLM2-135M-Instruct) on the CPU in float32, loaded once per session.

    :meth:`engine` builds an engine around it with its own KV cache, scheduler and sampler; engines
    never write the weights, so tests can share them.
    """

    def __init__(self):
        import torch

        from rayinfer.model.loader import load_model, load_tokenizer

        self.tokenizer = load_tokenizer("SmolLM2-135M-Instruct")
        torch.manual_seed(0)
        self.model = load_model("SmolLM2-135M-Instruct", torch.float32, torch.device("cpu"), "auto", seed=0)

    def engine(self, config=None, **engine_config):
        """An engine around the shared model: ``config`` (an EngineConfig) or EngineConfig's fields."""
        from rayinfer.engine.config import EngineConfig, ModelConfig
        from rayinfer.engine.llm_engine import LLMEngine

        config = config or EngineConfig(**{"device": "cpu", **engine_config})
        return LLMEngine(ModelConfig(dtype="float32"), config, model=self.model, tokenizer=self.tokenizer)


@pytest.fixture(scope="session")
def smollm2():
    """The default model loaded once (see :class:`SharedModel`)."""
    return SharedModel()
