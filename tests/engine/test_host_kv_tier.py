"""Host-memory KV tier: evicted device blocks go to a host pool and load back on a prefix hit."""

import random

import pytest

from rayinfer.engine.config import EngineConfig
from rayinfer.engine.host_kv_cache import HostBlockIndex
from rayinfer.engine.types import SamplingParams


def test_host_index_lru_and_pins():
    idx = HostBlockIndex(2)
    assert idx.offload(11) == 0 and idx.offload(12) == 1
    assert idx.offload(11) is None  # already held: refreshed, no copy; 12 is now the LRU
    assert idx.match([11, 99]) == [0]  # leading run only; slot 0 pinned
    assert idx.offload(13) == 1  # evicts 12 (LRU, unpinned)
    assert idx.offload(14) == 1  # 11 is older but pinned: 13 goes
    assert list(idx.hash_to_slot) == [11, 14]
    assert (idx.num_queries, idx.num_hits, idx.num_offloaded) == (2, 1, 4)


def test_host_index_evicts_unpinned():
    idx = HostBlockIndex(2)
    idx.offload(1), idx.offload(2)
    idx.match([1, 2])  # both pinned
    assert idx.offload(3) is None  # nothing to evict: the copy is skipped (it is a cache)
    idx.unpin_all()
    assert idx.offload(3) == 1  # LRU after match is 2 (the tail is touched first, the head ends newest)


def test_config_validation():
    with pytest.raises(ValueError, match="host_kv_cache_gib"):
        EngineConfig(host_kv_cache_gib=-1)
    with pytest.raises(ValueError, match="host_kv_cache_gib"):
        EngineConfig(host_kv_cache_gib=float("inf"))


def _multi_turn(engine, turns):
    """Run conversations turn by turn (each turn resends the conversation); returns all outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    history = {c: list(p) for c, p in enumerate(turns[0])}
    outs = []
    for t, new_turn in enumerate(turns):
        for c in history:
            if t:
                history[c] += new_turn[c]
            done = engine.generate([history[c]], params, [f"c{c}-t{t}"])[0]
            assert done.error is None
            outs.append(done.output_token_ids)
            history[c] += outs[-1]
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_eviction_to_host_and_reload(tiny_engine, async_scheduling):
    """Three conversations interleaved on a 24-block device pool: each turn evicts the others' prefixes.
    With the host tier the outputs are the same, host hits rise and fewer tokens are computed."""
    rng = random.Random(0)
    turns = [[[rng.randrange(1, 4000) for _ in range(n)] for _ in range(3)] for n in (30, 9)]
    base = tiny_engine(num_kv_blocks=24, async_scheduling=async_scheduling)
    tiered = tiny_engine(num_kv_blocks=24, async_scheduling=async_scheduling,
                         host_kv_cache_gib=64 * base.kv_cache[:, 0].numel() * 4 / 2**30)
    assert _multi_turn(tiered, turns) == _multi_turn(base, turns)
    s, b = tiered.stats(), base.stats()
    assert s["host_kv_hits"] > 0 and s["host_kv_offloaded_blocks"] > 0 and s["host_kv_loaded_blocks"] == s["host_kv_hits"]
    assert s["host_kv_bytes_moved"] > 0
    assert s["num_computed_tokens"] < b["num_computed_tokens"]
    assert "host_kv_hits" not in b


def test_host_tier_needs_prefix_caching(tiny_engine):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        tiny_engine(host_kv_cache_gib=0.01, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no KV block"):
        tiny_engine(host_kv_cache_gib=1e-12)


@pytest.mark.gpu
def test_eviction_to_host_and_reload_cuda(tiny_llama, tokenizer):
    """The CUDA path: pinned host pool, side-stream copies, async scheduling and CUDA graphs on."""
    import copy

    import torch

    from rayinfer.engine.config import ModelConfig
    from rayinfer.engine.llm_engine import LLMEngine

    model = copy.deepcopy(tiny_llama[0]).cuda()

    def make(**kw):
        cfg = EngineConfig(device="cuda", block_size=4, num_kv_blocks=24, max_num_seqs=8, **kw)
        return LLMEngine(ModelConfig("tiny-llama", max_model_len=512), cfg, model=model, tokenizer=tokenizer)

    rng = random.Random(1)
    turns = [[[rng.randrange(1, 4000) for _ in range(n)] for _ in range(3)] for n in (30, 9, 9, 9)]
    base = make()
    tiered = make(host_kv_cache_gib=64 * base.kv_cache[:, 0].numel() * 4 / 2**30)
    assert tiered.runner.host_cache.host.is_pinned()
    assert _multi_turn(tiered, turns) == _multi_turn(base, turns)
    s, b = tiered.stats(), base.stats()
    assert s["host_kv_hits"] > 0 and s["num_computed_tokens"] < b["num_computed_tokens"]
    torch.cuda.synchronize()
