"""Context-parallel replicas on Ray: a colocated fleet with parallel.cp=2 (rank 0 and its CP peer both
EngineActors, one gloo group) gives the tokens of a one-rank engine while the peer serves short prompts of
its own and joins rank 0's long prefills (also one that extends a cached prompt); after the peer dies
rank 0 prefills alone; unsupported combinations are refused."""

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
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (70, 9, 12, 15, 6, 11)]
    want = [c.output_token_ids for c in LLMEngine(model_config, ENGINE).generate(prompts, PARAMS)]
    client = make_client(model_config, ENGINE, ParallelConfig(cp=2, cp_min_tokens=32, num_cpus_per_replica=1))
    try:
        assert len(client.info.replicas) == 2  # rank 0, then its peer: both serve requests
        done = asyncio.run(_complete_all(client, prompts))
        assert [c.error for c in done] == [None] * len(prompts)
        assert [c.output_token_ids for c in done] == want
        rank0, peer = ray.get([r.stats.remote() for r in client.info.replicas])
        assert rank0["cp"] == 2 and rank0["num_cp_prefills"] == 1  # the long prompt only, led by rank 0
        assert rank0["num_cp_prefill_tokens"] == 69
        assert peer["cp_rank"] == 1 and peer["num_cp_peer_prefills"] == 1  # the peer joined it
        # the short prompts went to the least loaded rank: the peer served some itself, between its share
        served = peer["num_prompt_tokens"]
        assert 0 < served < sum(len(p) for p in prompts[1:]) + 1, served
        assert rank0["num_prompt_tokens"] + served == sum(len(p) for p in prompts)

        # a prompt extending the long one: CP computes only its uncached part (rank 0 broadcasts the hit)
        ext = prompts[0] + torch.randint(0, 49152, (40,), generator=gen).tolist()
        fresh = torch.randint(0, 49152, (66,), generator=gen).tolist()
        want_ext, want_fresh = [c.output_token_ids for c in LLMEngine(model_config, ENGINE).generate([ext, fresh], PARAMS)]
        got = asyncio.run(client.complete(ext, PARAMS))
        assert got.output_token_ids == want_ext and got.num_cached_tokens == 68  # 17 blocks of the 70-token prompt
        rank0, peer = ray.get([r.stats.remote() for r in client.info.replicas])
        assert rank0["num_cp_prefills"] == 2 and rank0["num_cp_prefill_tokens"] == 69 + (len(ext) - 1 - 68)
        assert peer["num_cp_peer_prefills"] == 2

        # the peer dies: rank 0 finds out before its next CP prefill and computes the prompt alone
        ray.kill(client.info.replicas[1], no_restart=True)
        got = asyncio.run(client.complete(fresh, PARAMS))
        assert got.error is None and got.output_token_ids == want_fresh
        rank0 = ray.get(client.info.replicas[0].stats.remote())
        assert rank0["num_cp_solo_prefills"] == 1 and rank0["cp_active"] is False and rank0["num_cp_prefills"] == 2
    finally:
        client.shutdown()


def test_long_prompts_go_to_rank0():
    """Router.pick's rule with cp > 1: prompts of cp_min_tokens or more only to the rank 0s (which lead
    CP prefills), shorter ones to any rank by load."""
    from rayinfer.policy.routing import ReplicaLoadBalancer

    lb = ReplicaLoadBalancer(4, block_size=4)  # 2 replicas x cp 2: rank 0s are 0 and 1, peers 2 and 3
    lb.in_flight = [5, 5, 0, 1]
    assert lb.pick([1, 2, 3, 4], among=range(2)) in (0, 1)
    assert lb.pick([5, 6, 7, 8]) == 2
    with pytest.raises(ValueError, match="no replica"):
        lb.pick([1], among=[])


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
