"""A colocated replica that Ray ended for good (no restarts left): the router starts a new actor in its
placement group (parallel.max_replacements) and requests sent to the dead one are sent again, so they
answer as a one-process engine does; once the replacements are spent, requests fail at once with an error
that says every replica is dead."""

import asyncio

import pytest
import ray
import torch

from rayinfer.actors.client import make_client
from rayinfer.engine.config import EngineConfig
from rayinfer.engine.errors import ReplicasDeadError
from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.types import SamplingParams
from rayinfer.placement.parallel_config import ParallelConfig

ENGINE = EngineConfig(device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=4, async_scheduling=False)
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


async def _stream_tokens(client, prompt) -> list[int]:
    return [t async for out in client.generate(prompt, PARAMS) for t in out.new_token_ids]


def test_a_dead_replica_is_replaced_then_dead_for_good(ray_cluster, tiny_llama_config):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (9, 14)]
    want = [c.output_token_ids for c in LLMEngine(tiny_llama_config, ENGINE).generate(prompts, PARAMS)]
    client = make_client(tiny_llama_config, ENGINE,
                         ParallelConfig(dp=1, max_restarts=0, max_replacements=1, num_cpus_per_replica=1))
    try:
        first = client.info.replicas[0]
        assert asyncio.run(client.complete(prompts[0], PARAMS)).output_token_ids == want[0]

        ray.kill(first, no_restart=True)  # as Ray's RDT ends the replicas of a failed CUDA IPC transfer
        got = asyncio.run(client.complete(prompts[1], PARAMS))  # sent to the dead actor, then to the new one
        assert got.error is None and got.output_token_ids == want[1]
        assert client.info.replicas[0]._actor_id.hex() != first._actor_id.hex()
        assert asyncio.run(_stream_tokens(client, prompts[0])) == want[0]  # streaming reaches it too
        stats = asyncio.run(client.stats())
        assert stats.num_replacements == 1 and stats.replicas[0].error is None

        ray.kill(client.info.replicas[0], no_restart=True)  # the one replacement is spent: dead for good
        got = asyncio.run(client.complete(prompts[1], PARAMS))
        assert got.finish_reason == "error" and got.error is not None
        assert got.error.startswith("every replica of the fleet is dead"), got.error
        assert "(the last: ActorDiedError: The actor is dead because it was killed by `ray.kill`" in got.error
        with pytest.raises(ReplicasDeadError, match="every replica of the fleet is dead"):
            asyncio.run(_stream_tokens(client, prompts[0]))
        assert asyncio.run(client.stats()).num_replacements == 1
    finally:
        client.shutdown()
