"""1 prefill + 1 decode replica, the prefill actor killed while requests stream: with a restart every
request waits for it (pd.retry_deadline_s) and completes as the colocated engine's; without a restart the
router starts a new actor in its place (parallel.max_replacements) and every request completes the same;
with neither, every request cut short ends with an error, never as a normal answer, and at once: the router
finds the replica dead for good, so no request waits out its retry deadline."""

import asyncio
import dataclasses

import pytest
import ray

from rayinfer.actors.client import make_client
from rayinfer.placement.parallel_config import ParallelConfig, PDSection

pytestmark = pytest.mark.slow


def kill_mid_run(pd, client, cases, no_restart: bool = False, role: str = "prefill") -> dict:
    many = [dataclasses.replace(c, request_id=f"{c.request_id}~{j}") for j in range(2) for c in cases]

    async def main():
        first = asyncio.Event()
        run = asyncio.create_task(pd.stream_all(client, many, on_output=lambda out: first.set()))
        await first.wait()  # a first token is out; other prefills are queued or running
        ray.kill((client.prefills if role == "prefill" else client.decodes)[0], no_restart=no_restart)
        return await run

    return asyncio.run(main())


def test_requests_wait_for_the_restarting_prefill_replica(ray_cluster, pd, cases, reference):
    client = make_client(pd.model, pd.engine_config(),
                         ParallelConfig(num_prefill=1, num_decode=1, max_restarts=1, num_cpus_per_replica=1,
                                        pd=PDSection(retry_deadline_s=600.0)))
    try:
        streams = kill_mid_run(pd, client, cases)
        assert len(streams) == 2 * len(cases)
        pd.check_streams(streams, reference)  # every request complete, exactly once, as colocated
        assert asyncio.run(client.stats()).num_retries > 0  # counted by the router: legs re-run
    finally:
        client.shutdown()


def test_replicas_dead_for_good_are_replaced_and_every_request_completes(ray_cluster, pd, cases, reference):
    """Killed with no restart (as Ray's RDT ends both replicas of a failed CUDA IPC transfer): the router
    starts a new prefill actor in the replica's placement group, the cut-short requests wait for it, and
    the client then sends its prefills to the new actor; then the same for the decode replica."""
    client = make_client(pd.model, pd.engine_config(),
                         ParallelConfig(num_prefill=1, num_decode=1, max_restarts=0, max_replacements=1,
                                        num_cpus_per_replica=1, pd=PDSection(retry_deadline_s=600.0)))
    try:
        killed = client.prefills[0]._actor_id.hex()
        streams = kill_mid_run(pd, client, cases, no_restart=True)
        assert len(streams) == 2 * len(cases)
        pd.check_streams(streams, reference)  # every request complete, exactly once, as colocated
        stats = asyncio.run(client.stats())
        assert stats.num_replacements == 1 and stats.num_retries > 0
        assert client.prefills[0]._actor_id.hex() != killed  # the client fetched the new actor
        assert stats.by_role("prefill")[0].error is None  # the new actor answers

        # the decode replica too: its streams are cut, re-prefilled, and decoded on its new actor
        killed = client.decodes[0]._actor_id.hex()
        streams = kill_mid_run(pd, client, cases, no_restart=True, role="decode")
        pd.check_streams(streams, reference)
        stats = asyncio.run(client.stats())
        assert stats.num_replacements == 2 and client.decodes[0]._actor_id.hex() != killed
        assert [r.error for r in stats.replicas] == [None, None]
    finally:
        client.shutdown()


def test_a_replaced_replica_keeps_kv_moving_over_cuda_ipc(ray_cluster, pd, cases, reference):
    """cuda_ipc needs no collective group: the prefill replica killed for good fails only its own transfers.
    Every request completes as colocated, the fleet never falls back to the object store, and the router
    offers the device transfer between the new prefill actor and the decode replica."""
    client = make_client(pd.model, pd.engine_config(),
                         ParallelConfig(num_prefill=1, num_decode=1, max_restarts=0, max_replacements=1,
                                        num_cpus_per_replica=1,
                                        pd=PDSection(kv_transport="cuda_ipc", retry_deadline_s=600.0)))
    try:
        streams = kill_mid_run(pd, client, cases, no_restart=True)
        pd.check_streams(streams, reference)
        stats = asyncio.run(client.stats())
        assert stats.num_replacements == 1 and stats.num_retries > 0
        assert client._rdt_ok, "the client fell back to the object store after a replica died"
        ticket, rdt = ray.get(client.router.pick_decode.remote(1, 0))
        client.router.release_decode.remote(ticket)
        assert rdt, "the router sends the new prefill actor's KV through the object store"
        pd.check_streams(asyncio.run(pd.stream_all(client, cases, "~after")), reference)
        assert client._rdt_ok
    finally:
        client.shutdown()


def test_requests_cut_short_by_a_dead_prefill_replica_end_with_an_error(ray_cluster, pd, cases, reference):
    client = make_client(pd.model, pd.engine_config(),
                         ParallelConfig(num_prefill=1, num_decode=1, max_restarts=0, max_replacements=0,
                                        num_cpus_per_replica=1, pd=PDSection(retry_deadline_s=600.0)))
    try:
        streams = kill_mid_run(pd, client, cases)
    finally:
        client.shutdown()
    num_failed = 0
    for rid, outs in streams.items():
        last = outs[-1]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], rid
        tokens, text, reason = reference[rid.split("~")[0]]
        if last.finish_reason == "error":
            num_failed += 1
            # not "gave up after ... (pd.retry_deadline_s=600)": the run would have waited 10 minutes for that
            assert last.error and "every prefill replica of the fleet is dead" in last.error, (rid, last.error)
            assert "\n" not in last.error and "\x1b" not in last.error  # one line, no remote traceback
        else:  # it was past its prefill when the replica died: a whole, correct answer
            assert last.error is None and last.finish_reason == reason, rid
            assert [t for o in outs for t in o.new_token_ids] == tokens, rid
    assert num_failed > 0
