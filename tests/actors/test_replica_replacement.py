"""A colocated replica that Ray ended for good (no restarts left): the router starts a new actor in its
placement group (parallel.max_replacements) and requests sent to the dead one are sent again, so they
answer as a one-process engine does; a stream cut mid-way resumes on the new actor and reads as one stream;
once the replacements are spent, requests fail at once with an error that says every replica is dead."""

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
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


async def _stream_tokens(client, prompt) -> list[int]:
    return [t async for out in client.generate(prompt, PARAMS) for t in out.new_token_ids]


async def _stream_killing_its_replica(client, prompt) -> list:
    """The deltas of a stream whose replica is killed for good once its first delta arrived."""
    outs = []
    async for out in client.generate(prompt, LONG):
        outs.append(out)
        if len(outs) == 1:
            ray.kill(client.info.replicas[0], no_restart=True)
    return outs


def test_a_dead_replica_is_replaced_then_dead_for_good(ray_cluster, tiny_llama_config):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (9, 14)]
    engine = LLMEngine(tiny_llama_config, ENGINE)
    want = [c.output_token_ids for c in engine.generate(prompts, PARAMS)]
    want_long = engine.generate(prompts[:1], LONG)[0]
    del engine
    client = make_client(tiny_llama_config, ENGINE,
                         ParallelConfig(dp=1, max_restarts=0, max_replacements=2, num_cpus_per_replica=1))
    try:
        first = client.info.replicas[0]
        assert asyncio.run(client.complete(prompts[0], PARAMS)).output_token_ids == want[0]

        ray.kill(first, no_restart=True)  # as Ray's RDT ends the replicas of a failed CUDA IPC transfer
        got = asyncio.run(client.complete(prompts[1], PARAMS))  # sent to the dead actor, then to the new one
        assert got.error is None and got.output_token_ids == want[1]
        assert client.info.replicas[0]._actor_id.hex() != first._actor_id.hex()
        assert asyncio.run(_stream_tokens(client, prompts[0])) == want[0]  # streaming reaches it too
        stats = asyncio.run(client.stats())
        assert stats.num_replacements == 1 and stats.num_resent == 1 and stats.replicas[0].error is None

        # killed mid-stream: the stream resumes on the second new actor from the tokens it has
        outs = asyncio.run(_stream_killing_its_replica(client, prompts[0]))
        stats = asyncio.run(client.stats())
        assert client.num_resumed == 1 and stats.num_replacements == 2 and stats.num_resent == 2
        assert [t for o in outs for t in o.new_token_ids] == want_long.output_token_ids
        assert "".join(o.new_text for o in outs) == want_long.text
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finish_reason == "length"

        ray.kill(client.info.replicas[0], no_restart=True)  # the replacements are spent: dead for good
        got = asyncio.run(client.complete(prompts[1], PARAMS))
        assert got.finish_reason == "error" and got.error is not None
        assert got.error.startswith("every replica of the fleet is dead"), got.error
        assert "(the last: ActorDiedError: The actor is dead because it was killed by `ray.kill`" in got.error
        with pytest.raises(ReplicasDeadError, match="every replica of the fleet is dead"):
            asyncio.run(_stream_tokens(client, prompts[0]))
        assert asyncio.run(client.stats()).num_replacements == 2
    finally:
        client.shutdown()
