"""2 prefill + 2 decode replicas: outputs equal the colocated engine's; a prefill or decode actor killed
mid-run is restarted and every request still completes exactly once."""

import asyncio
import dataclasses

import pytest
import ray

from rayinfer.actors.client import make_client
from rayinfer.placement.parallel_config import ParallelConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(ray_cluster, pd):
    c = make_client(pd.model, pd.engine_config(),
                    ParallelConfig(num_prefill=2, num_decode=2, max_restarts=2, num_cpus_per_replica=1))
    yield c
    c.shutdown()


def test_2p2d_equals_colocated(pd, client, cases, reference):
    pd.check_streams(asyncio.run(pd.stream_all(client, cases, "~a")), reference)


def _kill_mid_run(pd, client, cases, actor) -> dict:
    many = [dataclasses.replace(c, request_id=f"{c.request_id}~{j}") for j in range(2) for c in cases]

    async def main():
        first = asyncio.Event()
        run = asyncio.create_task(pd.stream_all(client, many, on_output=lambda out: first.set()))
        await first.wait()  # the first token is out; the other prefills are still queued or running
        ray.kill(actor, no_restart=False)
        return await run

    return asyncio.run(main())


def test_killed_prefill_actor_loses_no_request(pd, client, cases, reference):
    retries = client.num_retries
    streams = _kill_mid_run(pd, client, cases, client.prefills[0])
    assert len(streams) == 2 * len(cases)
    pd.check_streams(streams, reference)
    assert client.num_retries > retries  # some requests were in flight on the killed replica


def test_killed_decode_actor_loses_no_request(pd, client, cases, reference):
    streams = _kill_mid_run(pd, client, cases, client.decodes[1])
    pd.check_streams(streams, reference)
