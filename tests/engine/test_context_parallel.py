"""Context-parallel prefill math without Ray: N ranks as threads meeting in an in-process all-gather,
checked against the one-rank forward (hidden states, KV cache) and, through the engine (rank 0 an
LLMEngine, the other ranks CPPeer threads), against a one-rank engine (greedy tokens, KV cache)."""

from __future__ import annotations

import threading

import pytest
import torch

from rayinfer.engine.context_parallel import (
    CPPeer,
    CPPrefiller,
    CPRankLost,
    cp_prefill_rank,
    scratch_cache,
    zigzag_bounds,
    zigzag_chunks,
)
from rayinfer.engine.types import SamplingParams
from rayinfer.kernels.attention_metadata import AttentionMetadata


class ThreadGroup:
    """An all-gather and a broadcast for N threads of one process (the test's stand-in for a gloo group)."""

    def __init__(self, size: int):
        self.size = size
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def for_rank(self, rank: int):
        def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()  # nobody overwrites its slot before everyone has read
            return out

        return all_gather

    def broadcast_for_rank(self, rank: int):
        def broadcast(t: torch.Tensor) -> None:
            if rank == 0:
                self.slots[0] = t.clone()
            self.barrier.wait()
            if rank:
                t.copy_(self.slots[0])
            self.barrier.wait()

        return broadcast


def run_ranks(fns):
    """Run ``fns[r]()`` on N threads at once; returns their results, re-raising the first error."""
    results, errors = [None] * len(fns), []

    def run(r):
        try:
            results[r] = fns[r]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_zigzag_split_covers_every_token_once_and_balances_causal_work():
    for num_tokens, n in [(8, 2), (37, 2), (100, 4), (9, 4), (1003, 2), (4097, 4)]:
        b = zigzag_bounds(num_tokens, n)
        assert b[0] == 0 and b[-1] == num_tokens and all(b[i + 1] - b[i] in (num_tokens // (2 * n),
                                                                             -(-num_tokens // (2 * n)))
                                                        for i in range(2 * n))
        seen, work = [], []
        for r in range(n):
            (s0, e0), (s1, e1) = zigzag_chunks(num_tokens, n, r)
            seen += list(range(s0, e0)) + list(range(s1, e1))
            work.append(sum(p + 1 for p in list(range(s0, e0)) + list(range(s1, e1))))  # keys each query reads
        assert sorted(seen) == list(range(num_tokens))
        assert num_tokens < 1000 or max(work) <= 1.01 * min(work)  # a contiguous split's last rank would do 2N - 1 times the first's
    assert zigzag_chunks(8, 2, 0) == ((0, 2), (6, 8))
    assert zigzag_chunks(8, 2, 1) == ((2, 4), (4, 6))
    with pytest.raises(ValueError, match="at least 2 \\* cp = 4 tokens"):
        zigzag_bounds(3, 2)


def _reference(model, token_ids, block_size):
    """One-rank forward of the prompt: (hidden [T, hidden], KV of the prompt [L, T, 2, H, D])."""
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    cache = torch.zeros(model.kv_cache_shape(num_blocks, block_size))
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(n), cache, meta)
    return hidden, cache.transpose(2, 3).reshape(cache.shape[0], -1, 2, *cache.shape[4:])[:, :n]


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_forward_matches_one_rank(tiny_llama, cp):
    model = tiny_llama[0]
    block_size, n = 4, 45
    token_ids = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(cp)).tolist()
    ref_hidden, ref_kv = _reference(model, token_ids, block_size)
    group = ThreadGroup(cp)
    caches = [scratch_cache(model, n, block_size, torch.float32) for _ in range(cp)]
    hidden = run_ranks([lambda r=r: cp_prefill_rank(model, token_ids, r, cp, group.for_rank(r), *caches[r])
                        for r in range(cp)])
    for r in range(cp):
        (s0, e0), (s1, e1) = zigzag_chunks(n, cp, r)
        torch.testing.assert_close(hidden[r], torch.cat([ref_hidden[s0:e0], ref_hidden[s1:e1]]),
                                   atol=1e-5, rtol=1e-4)
    # every rank's cache holds the whole prompt's K/V of the last layer (the scratch is one layer, reused)
    layer_cache = caches[0][0][-1]
    kv = layer_cache.transpose(1, 2).reshape(-1, 2, *layer_cache.shape[3:])[:n]
    torch.testing.assert_close(kv, ref_kv[-1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cp, num_cached", [(2, 16), (4, 8), (2, 40)])
def test_cp_forward_after_a_cached_prefix_matches_one_rank(tiny_llama, cp, num_cached):
    """Prefix-cache hit: rank 0's cache holds the first ``num_cached`` tokens' K/V; the ranks compute the
    rest (rank 0 broadcasting the prefix), and get the one-rank forward's hidden states and K/V."""
    model = tiny_llama[0]
    block_size, n = 4, 53
    token_ids = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(num_cached)).tolist()
    ref_hidden, ref_kv = _reference(model, token_ids, block_size)
    group = ThreadGroup(cp)
    caches = [scratch_cache(model, n, block_size, torch.float32) for _ in range(cp)]
    # rank 0's cache is a real one (a tensor per layer) holding the prefix; the peers' scratch starts empty
    rank0 = torch.zeros(model.kv_cache_shape(len(caches[0][1]), block_size))
    num_layers, nb = rank0.shape[0], num_cached // block_size
    rank0[:, :nb] = ref_kv[:, :num_cached].reshape(num_layers, nb, block_size, *ref_kv.shape[2:]).transpose(2, 3)
    caches[0] = (list(rank0), caches[0][1])
    hidden = run_ranks([lambda r=r: cp_prefill_rank(model, token_ids, r, cp, group.for_rank(r), *caches[r],
                                                    num_cached=num_cached, broadcast=group.broadcast_for_rank(r))
                        for r in range(cp)])
    for r in range(cp):
        (s0, e0), (s1, e1) = zigzag_chunks(n - num_cached, cp, r)
        want = torch.cat([ref_hidden[num_cached + s0: num_cached + e0], ref_hidden[num_cached + s1: num_cached + e1]])
        torch.testing.assert_close(hidden[r], want, atol=1e-5, rtol=1e-4)
    got = rank0.transpose(2, 3).reshape(rank0.shape[0], -1, 2, *rank0.shape[4:])[:, :n]
    torch.testing.assert_close(got, ref_kv, atol=1e-5, rtol=1e-4)  # prefix untouched, the rest computed
    with pytest.raises(ValueError, match="multiple of the block size"):
        cp_prefill_rank(model, token_ids, 0, 1, lambda t: [t], *caches[0], num_cached=num_cached + 1,
                        broadcast=lambda t: None)


def cp_engine(make_engine, cp: int, min_tokens: int, check_peers=None, **engine_config):
    """An engine (rank 0) whose CP peers are threads over the same model; returns (engine, peers)."""
    engine = make_engine(**engine_config)
    group = ThreadGroup(cp)
    peers = [CPPeer(engine.model, r, cp, group.for_rank(r), engine.engine_config.block_size, engine.kv_dtype,
                    group.broadcast_for_rank(r))
             for r in range(1, cp)]

    def start_peers(token_ids, num_cached):
        threads = [threading.Thread(target=p.prefill, args=(token_ids, num_cached)) for p in peers]
        for t in threads:
            t.start()
        return lambda: [t.join() for t in threads]

    engine.set_context_parallel(CPPrefiller(cp, min_tokens, group.for_rank(0), start_peers, group.broadcast_for_rank(0),
                                            check_peers))
    return engine, peers


def _prompt_kv(engine, prompt):
    """The prompt's full blocks' KV from the engine's prefix cache: [L, n, 2, bs, H, D]."""
    from rayinfer.engine.block_pool import hash_block_chain

    bs = engine.engine_config.block_size
    hashes = hash_block_chain(prompt[: len(prompt) // bs * bs], bs)
    blocks = engine.scheduler.kv.pool.match_prefix(hashes, count=False)
    assert len(blocks) == len(hashes)
    return engine.kv_cache[:, blocks]


def _check_same(make_engine, prompts, cp, **engine_config):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = make_engine(**engine_config)
    want = plain.generate(prompts, params)
    engine, peers = cp_engine(make_engine, cp, min_tokens=24, **engine_config)
    got = engine.generate(prompts, params)
    assert [c.output_token_ids for c in got] == [c.output_token_ids for c in want]
    long = [p for p in prompts if len(p) - 1 >= 24]
    assert engine.runner.cp.num_prefills == len(long) and all(p.num_prefills == len(long) for p in peers)
    for prompt in long:
        torch.testing.assert_close(_prompt_kv(engine, prompt), _prompt_kv(plain, prompt), atol=1e-4, rtol=1e-4)
    assert all(c.num_cached_tokens == 0 for c in got)  # CP computed them: not prefix-cache hits
    return engine


@pytest.mark.parametrize("cp", [2, 4])
def test_engine_cp_prefill_same_tokens_and_kv_tiny(tiny_engine, cp):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (61, 10, 30)]
    _check_same(tiny_engine, prompts, cp)


def test_engine_cp_prefill_same_tokens_and_kv_smollm2(smollm2):
    text = " ".join(f"Day {i} was {'sunny' if i % 3 else 'rainy'}." for i in range(12)) + " Summarize:"
    prompt = smollm2.tokenizer.encode(text)
    assert len(prompt) > 64
    make = lambda **kw: smollm2.engine(device="cpu", num_kv_blocks=64, block_size=16, async_scheduling=False, **kw)  # noqa: E731
    _check_same(make, [prompt, prompt[:12]], 2)


def test_prefix_hit_skips_cp_when_the_uncached_part_is_short(tiny_engine):
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 1000, (48,), generator=gen).tolist()
    engine, _ = cp_engine(tiny_engine, 2, min_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = engine.generate([prompt], params)[0]
    assert engine.runner.cp.num_prefills == 1
    again = engine.generate([prompt + [5, 6]], params)[0]  # 48 tokens cached: 2 left, under the threshold
    assert engine.runner.cp.num_prefills == 1 and again.num_cached_tokens >= 44
    assert first.output_token_ids == tiny_engine().generate([prompt], params)[0].output_token_ids


@pytest.mark.parametrize("cp", [2, 4])
def test_prefix_hit_reduces_cp_work(tiny_engine, cp):
    """A prompt that extends a cached one: CP computes only its uncached part (the hit's K/V broadcast by
    rank 0), and tokens and KV equal a one-rank engine's."""
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 1000, (40,), generator=gen).tolist()
    prompt = prefix + torch.randint(0, 1000, (37,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine, peers = cp_engine(tiny_engine, cp, min_tokens=24)
    engine.generate([prefix], params)
    assert engine.runner.cp.num_prefill_tokens == 39
    got = engine.generate([prompt], params)[0]
    bs = engine.engine_config.block_size
    hit = len(prefix) // bs * bs  # the prefix's full blocks (its last token was computed by rank 0 alone)
    assert got.num_cached_tokens == hit
    assert engine.runner.cp.num_prefills == 2 and all(p.num_prefills == 2 for p in peers)
    assert engine.runner.cp.num_prefill_tokens == 39 + (len(prompt) - 1 - hit)  # the suffix only
    plain = tiny_engine()
    assert got.output_token_ids == plain.generate([prompt], params)[0].output_token_ids
    torch.testing.assert_close(_prompt_kv(engine, prompt), _prompt_kv(plain, prompt), atol=1e-4, rtol=1e-4)


def test_lost_peer_switches_cp_off_and_rank0_computes_alone(tiny_engine):
    """A peer that does not answer before a prefill: that prompt and later ones run on rank 0 alone (the
    peers are never started, so no collective waits on them), with the one-rank engine's tokens."""
    alive = [True]

    def check_peers():
        if not alive[0]:
            raise CPRankLost("peer 1 did not answer")

    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (50, 60, 45, 55)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine, peers = cp_engine(tiny_engine, 2, min_tokens=24, check_peers=check_peers)
    want = [c.output_token_ids for c in tiny_engine().generate(prompts, params)]
    assert engine.generate(prompts[:1], params)[0].output_token_ids == want[0]
    alive[0] = False
    got = [c.output_token_ids for c in engine.generate(prompts[1:3], params)]
    assert got == want[1:3]
    cp = engine.runner.cp
    # both were admitted as CP prefills before the loss showed; rank 0 computed them alone
    assert cp.num_prefills == 1 and peers[0].num_prefills == 1 and cp.num_solo_prefills == 2
    assert cp.lost == "peer 1 did not answer" and not cp.applies(10_000)
    assert engine.stats()["cp_active"] is False
    assert engine.generate(prompts[3:], params)[0].output_token_ids == want[3]  # now a plain prefill
    assert cp.num_solo_prefills == 2
