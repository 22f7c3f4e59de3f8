"""Context-parallel replicas on Ray: a colocated fleet with parallel.cp=2 (rank 0 an EngineActor, rank 1 a
CP peer, one gloo group) gives the tokens of a one-rank engine; unsupported combinations are refused."""

import asyncio

import pytest
import ray
import torch

from rayinfer.actors.client import make_client
from rayinfer.actors.router import check_supported
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.errors import UnsupportedError
from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.types import SamplingParams
from rayinfer.placement.parallel_config import ParallelConfig

ENGINE = EngineConfig(device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=4, async_scheduling=False)
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model_config(tiny_llama_config) -> ModelConfig:
    return tiny_llama_config


def test_cp2_fleet_matches_one_rank_engine(ray_cluster, model_config):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (70, 9)]
    want = [c.output_token_ids for c in LLMEngine(model_config, ENGINE).generate(prompts, PARAMS)]
    client = make_client(model_config, ENGINE, ParallelConfig(cp=2, cp_min_tokens=32, num_cpus_per_replica=1))
    try:
        done = asyncio.run(_complete_all(client, prompts))
        assert [c.error for c in done] == [None, None]
        assert [c.output_token_ids for c in done] == want
        stats = ray.get(client.info.replicas[0].stats.remote())
        assert stats["cp"] == 2 and stats["num_cp_prefills"] == 1  # the long prompt only
        assert stats["num_cp_prefill_tokens"] == 69
    finally:
        client.shutdown()


async def _complete_all(client, prompts):
    return await asyncio.gather(*[client.complete(p, PARAMS) for p in prompts])


@pytest.mark.parametrize("parallel, match", [
    (dict(cp=2, num_prefill=1, num_decode=1), "prefill/decode disaggregation"),
    (dict(cp=2, ep=2), "cp > 1 with ep > 1"),
])
def test_unsupported_cp_combinations_are_refused(parallel, match):
    with pytest.raises(UnsupportedError, match=match):
        check_supported(ParallelConfig(**parallel))
    assert isinstance(UnsupportedError("x"), ValueError)


def test_cp_yaml_and_threshold_validation():
    from pathlib import Path

    from omegaconf import OmegaConf

    yaml = Path(__file__).resolve().parents[2] / "conf" / "parallel" / "cp2.yaml"
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ParallelConfig), OmegaConf.load(yaml)))
    assert isinstance(cfg, ParallelConfig)
    assert (cfg.topology, cfg.cp, cfg.cp_min_tokens, cfg.world_size) == ("colocated", 2, 8192, 2)
    check_supported(cfg)
    with pytest.raises(ValueError, match="cp_min_tokens must be an integer >= 1"):
        ParallelConfig(cp=2, cp_min_tokens=0)
