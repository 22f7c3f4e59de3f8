"""The KV store as a third tier for colocated replicas: replica A's finished prefix serves replica B, a
restarted store serves it from disk, and missing or damaged files are a miss (outputs never change)."""

import random
import time

import pytest
import ray
import torch

from rayinfer.actors.engine_actor import EngineActor
from rayinfer.actors.kv_store import KVStoreActor
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.types import SamplingParams

ENGINE = EngineConfig(device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=4, async_scheduling=False)
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model_config(tiny_llama_config) -> ModelConfig:
    return tiny_llama_config


def test_store_across_replicas_and_restart(ray_cluster, model_config, tmp_path):
    rng = random.Random(0)

    def tokens(n):
        return [rng.randrange(1, 49000) for _ in range(n)]

    # three conversations with their own 40-token prefixes: one per check, so no replica has the prefix
    # in its own pool when it is asked for it
    prompts = [[p + tokens(3) for _ in range(2)] for p in (tokens(41), tokens(41), tokens(41))]
    longer = prompts[0][0][:41] + tokens(23)  # conversation 0 goes on: its first 40 tokens stay the same
    ref = LLMEngine(model_config, ENGINE)
    expected = [[c.output_token_ids for c in ref.generate(ps, PARAMS)] for ps in prompts]
    expected_longer = ref.generate([longer], PARAMS)[0].output_token_ids
    del ref

    store = KVStoreActor.options(num_cpus=0, max_restarts=1).remote(None, None, None, str(tmp_path), "tiny")
    a, b = (EngineActor.options(num_cpus=0).remote(model_config, ENGINE, i, kv_store=store) for i in range(2))

    def run(actor, k, i):
        done = ray.get(actor.complete.remote(f"{k}-{i}-{id(actor)}", prompts[k][i], PARAMS))
        assert done.error is None
        assert done.output_token_ids == expected[k][i]  # the same greedy tokens as the engine without a store

    def hit_blocks(actor):
        return ray.get(actor.stats.remote())["kv_store_hit_blocks"]

    for k in range(3):  # replica A computes and writes every prefix
        run(a, k, 0)
    ray.get(a.flush_kv_writes.remote())
    assert ray.get(store.stats.remote())["kv_store_blocks"] >= 30

    run(b, 0, 1)  # replica B loads A's prefix from the store
    sb = ray.get(b.stats.remote())
    assert sb["kv_store_hit_blocks"] >= 10 and sb["num_computed_tokens"] < 20

    # A computes the conversation's next turn; B has its first 40 tokens in its own pool and fetches only the rest
    done = ray.get(a.complete.remote("longer-a", longer, PARAMS))
    assert done.output_token_ids == expected_longer
    ray.get(a.flush_kv_writes.remote())
    done = ray.get(b.complete.remote("longer-b", longer, PARAMS))
    assert done.error is None and done.output_token_ids == expected_longer
    sb2 = ray.get(b.stats.remote())
    assert sb2["kv_store_skipped_blocks"] == 10  # the 40 tokens B had: not fetched again
    assert sb2["kv_store_hit_blocks"] - sb["kv_store_hit_blocks"] == 5  # tokens 40..59 (of 64; one left to compute)
    assert sb2["num_computed_tokens"] - sb["num_computed_tokens"] == len(longer) - 60 + PARAMS.max_tokens - 1
    sb = sb2

    ray.kill(store, no_restart=False)  # the store restarts and reads its index back from disk
    restarted = {}
    for _ in range(300):  # (a lookup while it restarts is a miss: wait until the new instance answers)
        try:
            restarted = ray.get(store.stats.remote(), timeout=30)
        except ray.exceptions.RayError:
            pass
        if restarted.get("kv_store_put_blocks") == 0:  # a fresh instance: it has put nothing yet
            break
        time.sleep(0.1)
    assert restarted["kv_store_put_blocks"] == 0 and restarted["kv_store_restored"] >= 30
    run(b, 1, 1)
    assert hit_blocks(b) >= sb["kv_store_hit_blocks"] + 10

    hits = hit_blocks(b)
    for f in sorted((tmp_path / "blocks").glob("*.kv")):  # damage every file: misses, the same outputs
        f.write_bytes(f.read_bytes()[::-1])
    run(b, 2, 1)
    assert hit_blocks(b) == hits
    assert ray.get(store.stats.remote())["kv_store_corrupt"] >= 1
    for actor in (a, b, store):
        ray.kill(actor, no_restart=True)
