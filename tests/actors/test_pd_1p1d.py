"""1 prefill + 1 decode replica with a KV store: greedy outputs equal the colocated engine's, and a second
pass over a shared-prefix workload loads its prefixes from the store instead of computing them."""

import asyncio
import dataclasses

import pytest

from rayinfer.actors.client import make_client
from rayinfer.placement.parallel_config import ParallelConfig, PDSection

pytestmark = pytest.mark.slow
TRANSFER_GIB = 0.02  # ~27 blocks of SmolLM2's float32 KV (737 KiB each)
DECODE_SEQS = 8


@pytest.fixture(scope="module")
def client(ray_cluster, pd):
    # prefix caching off on the replicas: every prefix hit comes from the KV store; KV moves in batches over
    # a gloo transfer group (the nccl path's code on CPU) with a transfer budget of ~27 blocks (a few
    # requests per batch); a small decode pool makes the decode replica preempt (hand requests back); at most
    # DECODE_SEQS requests in flight (admission_headroom 0): the rest of a burst waits before its prefill
    c = make_client(pd.model, pd.engine_config(enable_prefix_caching=False),
                    ParallelConfig(num_prefill=1, num_decode=1, num_cpus_per_replica=1,
                                   pd=PDSection(kv_transport="gloo", transfer_buffer_gib=TRANSFER_GIB,
                                                admission_headroom=0.0,
                                                decode_overrides={"num_kv_blocks": 21, "max_num_seqs": DECODE_SEQS})))
    yield c
    c.shutdown()


def prefill_stats(client):
    stats = asyncio.run(client.stats())
    return stats.by_role("prefill")[0], stats.kv_store


def test_1p1d_equals_colocated_and_second_pass_hits_the_store(pd, client, cases, reference):
    first = asyncio.run(pd.stream_all(client, cases, "~a"))
    pd.check_streams(first, reference)
    asyncio.run(client.flush())
    prefill1, store1 = prefill_stats(client)
    assert store1.kv_store_blocks > 0

    second = asyncio.run(pd.stream_all(client, cases, "~b"))
    pd.check_streams(second, reference)
    prefill2, store2 = prefill_stats(client)
    computed1 = prefill1.num_computed_tokens
    computed2 = prefill2.num_computed_tokens - computed1
    assert store2.kv_store_hit_rate > 0 and store2.kv_store_hits > store1.kv_store_hits
    assert computed2 < computed1 / 2, (computed1, computed2)
    print(f"prefill tokens computed: pass 1 {computed1}, pass 2 {computed2}; store hit rate "
          f"{store2.kv_store_hit_rate:.2f}; hand-backs {client.num_handbacks}")


def test_bad_request_is_rejected_for_that_request_only(pd, client, cases, reference):
    from rayinfer.engine.types import SamplingParams

    async def main():
        bad = client.complete([10**9], SamplingParams(max_tokens=2))
        good = client.complete(cases[0].prompt_token_ids, cases[0].params)
        return await asyncio.gather(bad, good)

    bad, good = asyncio.run(main())
    assert bad.finish_reason == "error" and "token ids" in bad.error
    assert good.error is None and good.output_token_ids == reference[cases[0].request_id][0]


def test_seeded_sampling_equals_colocated_across_hand_backs(pd, client, cases, smollm2):
    """Seeded random sampling draws by (seed, output position, token), so a request split across replicas
    (first token on the prefill replica, the rest on the decode replica, re-prefilled when the decode
    replica hands it back) samples what one engine does."""
    from rayinfer.engine.types import SamplingParams

    seeded = [dataclasses.replace(c, request_id=f"seeded-{i}",
                                  params=SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i,
                                                        max_tokens=48, ignore_eos=True))
              for i, c in enumerate(cases[:3])]
    engine = smollm2.engine(pd.engine_config())
    want = {c.request_id: c.output_token_ids for c in engine.generate(
        [c.prompt_token_ids for c in seeded], [c.params for c in seeded], [c.request_id for c in seeded])}
    # the module's fleet, whose decode pool is too small for all of them at once: each grows to 8 blocks
    # over 48 decode steps, so the three exhaust its 21 blocks and the decode replica hands one back
    handbacks = client.num_handbacks
    streams = asyncio.run(pd.stream_all(client, seeded, "~s"))
    for rid, outs in streams.items():
        assert outs[-1].error is None, outs[-1].error
        assert [t for o in outs for t in o.new_token_ids] == want[rid.split("~")[0]], rid
    assert client.num_handbacks > handbacks


def test_burst_moves_kv_in_batches_within_the_transfer_budget(pd, client, cases, reference):
    """16 requests at once: their KV moves in fewer transfers than requests, the decode replica never holds
    more received bytes than its budget, no more than the decode replica's max_num_seqs are let in at once
    (the others wait before their prefill), and the outputs are the colocated engine's."""
    import ray

    burst = [c for c in cases if c.request_id.startswith("chat") or c.request_id == "raw"] * 4
    assert len(burst) > DECODE_SEQS
    before = asyncio.run(client.stats()).by_role("decode")[0].kv_transfer
    gate_before = ray.get(client.router.admission_stats.remote())
    assert gate_before["limit"] == DECODE_SEQS and gate_before["admitted"] == 0
    streams = {}

    async def main():
        async def one(i, c):
            outs = [o async for o in client.generate(c.prompt_token_ids, c.params, f"{c.request_id}~burst{i}")]
            streams[f"{c.request_id}~burst{i}"] = outs

        await asyncio.gather(*[one(i, c) for i, c in enumerate(burst)])

    asyncio.run(main())
    pd.check_streams(streams, reference)
    # the prefill engine's queue time reaches the caller (the ingress's queue-time metric)
    assert all(outs[-1].queue_time_s is not None and outs[-1].queue_time_s >= 0 for outs in streams.values())
    decode = asyncio.run(client.stats()).by_role("decode")[0].kv_transfer
    batches = decode["kv_transfer_batches"] - before["kv_transfer_batches"]
    budget = decode["kv_transfer_budget"]
    assert budget <= TRANSFER_GIB * (1 << 30)
    assert 0 < decode["kv_transfer_budget_peak"] <= budget
    assert decode["kv_transfer_budget_used"] == 0  # every received batch was imported and given back
    moved = len(burst) - client.num_handbacks  # hand-backs re-prefill and move again: count legs loosely
    assert 0 < batches < len(burst), (batches, moved)
    gate = ray.get(client.router.admission_stats.remote())
    assert gate["waited"] - gate_before["waited"] >= len(burst) - DECODE_SEQS  # the rest waited their turn
    assert gate["admitted"] == 0 and gate["waiting"] == 0  # every request left


def test_decoding_goes_on_while_a_transfer_is_in_flight(pd, client, cases, reference):
    """A receive that waits for its sender occupies the decode replica's transfer thread only: requests
    already decoding there stream to the end meanwhile (no event loop or step blocked)."""
    import ray

    from rayinfer.engine.types import SamplingParams

    prefill, decode = client.prefills[0], client.decodes[0]
    # two requests that fit the decode pool together (~8 blocks each of its 21) (no hand-back, so no transfer but the test's own
    # while the receive waits: the router orders every other transfer, and a send/recv out of order
    # would pair mismatched sizes)
    long = [c for c in cases if c.request_id.startswith("chat")][:2]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main():
        started = asyncio.Event()
        counts = {}

        async def one(c):
            n = 0
            async for out in client.generate(c.prompt_token_ids, params, c.request_id + "~inflight"):
                n += len(out.new_token_ids)
                counts[c.request_id] = n
                if all(counts.get(x.request_id, 0) >= 3 for x in long):
                    started.set()
            return n

        tasks = [asyncio.ensure_future(one(c)) for c in long]
        await asyncio.wait_for(started.wait(), 120)  # both are decoding on the decode replica
        for _ in range(100):  # imported: their received payloads are freed and the budget is back
            if (await decode.stats.remote())["kv_transfer_budget_used"] == 0:
                break
            await asyncio.sleep(0.05)
        assert (await decode.stats.remote())["kv_transfer_budget_used"] == 0
        assert not any(t.done() for t in tasks)  # ...while they are still decoding
        # park one more request on the prefill replica, then have the decode replica wait for it
        out = await prefill.prefill.remote("held", cases[4].prompt_token_ids, params)
        assert out.finish_reason == "prefilled"
        [num_blocks] = await prefill.parked_blocks.remote(["held"])
        reserved = await decode.reserve_kv.remote(num_blocks)
        pending = decode.recv_kv.remote(["held"], [num_blocks], 0, reserved)
        totals = await asyncio.wait_for(asyncio.gather(*tasks), 120)  # they finish while it waits
        done, _ = ray.wait([pending], timeout=0)
        assert not done
        await prefill.send_kv.remote(["held"], 1)
        assert await pending == num_blocks * reserved // num_blocks
        decode.abort.remote("held")  # drop the received payload
        return totals

    totals = asyncio.run(main())
    assert totals == [40] * len(long)


def test_cuda_ipc_receive_budget_bounds_the_payloads_in_flight(pd, client, cases):
    """Over cuda_ipc the router reserves a request's bytes in the decode replica's receive budget before the
    decode replica copies the blocks (``Router.transfer_kv``): a reservation past the budget waits until a
    received payload is gone, and every reservation comes back (payload dropped, or ``unreserve_kv`` after a
    failed transfer). The bookkeeping runs here on CPU, where ``share_kv`` hands over the payload itself
    instead of a handle to the blocks in a CUDA IPC-shared cache (the GPU tests read them in place)."""
    import ray
    import torch

    from rayinfer.actors.engine_actor import EngineActor
    from rayinfer.actors.kv_transport import BlockHandle, DeviceHandle
    from rayinfer.engine.types import SamplingParams

    prefill = client.prefills[0]
    decode = EngineActor.options(num_cpus=0).remote(
        pd.model, pd.engine_config(role="decode", kv_transfer_buffer_gib=TRANSFER_GIB), 9, kv_transport="cuda_ipc")
    try:
        budget_blocks = ray.get(decode.ready.remote())["transfer_budget_blocks"]
        out = ray.get(prefill.prefill.remote("ipc-a", cases[0].prompt_token_ids,
                                             SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
        assert out.finish_reason == "prefilled"
        [num_blocks] = ray.get(prefill.parked_blocks.remote(["ipc-a"]))
        assert 0 < num_blocks < budget_blocks
        reserved = ray.get(decode.reserve_kv.remote(num_blocks, "ipc-a"))
        ray.get(decode.reserve_kv.remote(budget_blocks - num_blocks, "ipc-b"))  # the budget is full
        waiting = decode.reserve_kv.remote(1, "ipc-c")
        assert not ray.wait([waiting], timeout=1.0)[0]
        assert ray.get(decode.receive_kv.remote("ipc-a", prefill.share_kv.remote("ipc-a"))) == reserved
        assert ray.get(prefill.parked_blocks.remote(["ipc-a"])) == [0]  # shared: its prefill blocks are free
        assert not ray.wait([waiting], timeout=0.5)[0]  # the received payload still holds its bytes
        ray.get(decode.abort.remote("ipc-a"))  # the payload is dropped: its bytes come back
        ray.get(waiting, timeout=30)
        ray.get([decode.unreserve_kv.remote("ipc-b"), decode.unreserve_kv.remote("ipc-c"),
                 decode.unreserve_kv.remote("ipc-c")])  # a second give-back of one reservation is a no-op
        stats = ray.get(decode.stats.remote())
        assert stats["kv_transfer_budget_used"] == 0
        assert stats["kv_transfer_budget_peak"] == budget_blocks * reserved // num_blocks
        # a request the prefill replica does not hold: share_kv raises KeyError; a handle the decode replica
        # cannot open (a GPU it does not hold) raises and gives its reservation back
        with pytest.raises(ray.exceptions.RayTaskError) as err:
            ray.get(prefill.share_kv.remote("ipc-missing"))
        assert isinstance(err.value.cause, KeyError)
        ray.get(decode.reserve_kv.remote(1, "ipc-bad"))
        assert ray.get(decode.stats.remote())["kv_transfer_budget_used"] > 0
        with pytest.raises(ray.exceptions.RayTaskError, match="sharing a GPU") as err:
            ray.get(decode.receive_kv.remote("ipc-bad", BlockHandle(DeviceHandle(torch.empty, (), gpu_id="7"), "c", 0,
                                                                     (0,))))
        assert isinstance(err.value.cause, ValueError)
        assert ray.get(decode.stats.remote())["kv_transfer_budget_used"] == 0
        assert ray.get(decode.ready.remote())["transfer_budget_blocks"] == budget_blocks  # the replica lives on
    finally:
        ray.kill(decode)


def test_1p1d_over_cuda_ipc_equals_colocated_within_the_receive_budget(ray_cluster, pd, cases, reference):
    """The router's cuda_ipc path end to end (``Router.transfer_kv``: reserve, ``share_kv``, ``receive_kv``),
    with a receive budget of a few requests: greedy streams equal the colocated engine's, no transfer fails
    (the fleet never falls back to the object store), and every reserved byte comes back. On CPU the
    payload itself stands in for the CUDA IPC handle (the GPU test opens real handles)."""
    c = make_client(pd.model, pd.engine_config(enable_prefix_caching=False),
                    ParallelConfig(num_prefill=1, num_decode=1, num_cpus_per_replica=1,
                                   pd=PDSection(kv_transport="cuda_ipc", transfer_buffer_gib=TRANSFER_GIB)))
    try:
        assert c.transport == "cuda_ipc" and c._rdt_ok
        streams = asyncio.run(pd.stream_all(c, cases, "~ipc"))
        pd.check_streams(streams, reference)
        assert c._rdt_ok, "a cuda_ipc transfer failed and the client fell back to the object store"
        assert c.num_retries == 0
        budget = asyncio.run(c.stats()).by_role("decode")[0].kv_transfer
        assert budget["kv_transfer_budget_used"] == 0
        assert budget["kv_transfer_budget_peak"] > 0
    finally:
        c.shutdown()
