"""1 prefill + 1 decode replica with a KV store: greedy outputs equal the colocated engine's, and a second
pass over a shared-prefix workload loads its prefixes from the store instead of computing them."""

import asyncio
import dataclasses

import pytest

from rayinfer.actors.client import make_client
from rayinfer.placement.parallel_config import ParallelConfig, PDSection

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(ray_cluster, pd):
    # prefix caching off on the replicas: every prefix hit comes from the KV store; KV moves by Ray Direct
    # Transport over gloo (the nccl path's code on CPU); a small decode pool makes the decode replica
    # preempt (hand requests back) under load
    c = make_client(pd.model, pd.engine_config(enable_prefix_caching=False),
                    ParallelConfig(num_prefill=1, num_decode=1, num_cpus_per_replica=1,
                                   pd=PDSection(kv_transport="gloo", decode_overrides={"num_kv_blocks": 21})))
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


def test_seeded_sampling_equals_colocated_across_hand_backs(ray_cluster, pd, cases):
    """Seeded random sampling draws by (seed, output position, token), so a request split across replicas
    (first token on the prefill replica, the rest on the decode replica, re-prefilled when the decode
    replica hands it back) samples what one engine does."""
    from rayinfer.engine.llm_engine import LLMEngine
    from rayinfer.engine.types import SamplingParams

    seeded = [dataclasses.replace(c, request_id=f"seeded-{i}",
                                  params=SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i,
                                                        max_tokens=48, ignore_eos=True))
              for i, c in enumerate(cases[:5])]
    engine = LLMEngine(pd.model, pd.engine_config())
    want = {c.request_id: c.output_token_ids for c in engine.generate(
        [c.prompt_token_ids for c in seeded], [c.params for c in seeded], [c.request_id for c in seeded])}
    # a decode pool too small for all of them at once: each grows to 8 blocks over 48 decode steps, so any
    # two that overlap exhaust the 12 blocks and the decode replica hands one back
    small = make_client(pd.model, pd.engine_config(enable_prefix_caching=False),
                        ParallelConfig(num_prefill=1, num_decode=1, num_cpus_per_replica=1,
                                       pd=PDSection(decode_overrides={"num_kv_blocks": 12})))
    try:
        streams = asyncio.run(pd.stream_all(small, seeded, "~s"))
        for rid, outs in streams.items():
            assert outs[-1].error is None, outs[-1].error
            assert [t for o in outs for t in o.new_token_ids] == want[rid.split("~")[0]], rid
        assert small.num_handbacks > 0
    finally:
        small.shutdown()
