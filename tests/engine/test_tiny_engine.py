"""The engine core over an injected tiny random Llama (CPU, float32): greedy output equals a step-by-step
Hugging Face reference cold, with prefix-cache hits, chunked prefill and pipelined scheduling; stop strings
end requests outside the core, which drops what it produced after them."""

import asyncio

import pytest

from rayinfer.engine.async_engine import AsyncLLMEngine
from rayinfer.engine.errors import InvalidRequestError
from rayinfer.engine.types import SamplingParams

NUM_NEW = 10
TIE = 1e-4  # a near tie in the reference may flip under another float32 summation order


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["The quick brown fox jumps over the lazy dog because it wants to see what is there.",
             "Once upon a time", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
             "Les élèves ont été très contents de la sortie au musée, 日本語も少し。"]
    return [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def reference(tiny_reference, prompts):
    return [tiny_reference(p, NUM_NEW) for p in prompts]


def check_equal(completions, refs):
    for c, (ref_ids, gaps) in zip(completions, refs):
        assert c.error is None, c.error
        for k, (got, want) in enumerate(zip(c.output_token_ids, ref_ids)):
            if got != want:
                assert gaps[k] < TIE, f"{c.request_id}: token {k} differs ({got} vs {want}), gap {gaps[k]}"
                break
        else:
            assert len(c.output_token_ids) == len(ref_ids)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def test_greedy_matches_step_by_step_reference(tiny_engine, prompts, reference):
    check_equal(tiny_engine().generate(prompts, GREEDY), reference)


@pytest.mark.parametrize("engine_kw", [dict(max_num_batched_tokens=8), dict(async_scheduling=True),
                                       dict(debug_eager_graphs=True)],
                         ids=["chunked-prefill", "async-scheduling", "decode-graph-padding"])
def test_greedy_matches_reference_chunked_and_pipelined(tiny_engine, prompts, reference, engine_kw):
    check_equal(tiny_engine(**engine_kw).generate(prompts, GREEDY), reference)


def test_warm_up_prefill_leaves_outputs_unchanged(tiny_engine, prompts, reference):
    """The start-up prefill (CUDA engines run it at construction) writes scratch KV into the cache's first
    blocks: requests afterwards still give the reference; a warm-up longer than the cache is refused."""
    engine = tiny_engine()
    assert engine.runner.warm_up_prefill(64 * 4) == [256, 255]  # the whole cache, then one token less
    engine.runner.WARM_UP_MIN_TOKENS = 64  # then halvings down to the minimum, each also one token less
    assert engine.runner.warm_up_prefill(64 * 4) == [256, 255, 128, 127, 64, 63]
    check_equal(engine.generate(prompts, GREEDY), reference)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        engine.runner.warm_up_prefill(64 * 4 + 1)


def test_prefix_cache_hit_gives_the_cold_output(tiny_engine, prompts, reference):
    engine = tiny_engine()
    cold = engine.generate(prompts, GREEDY)
    warm = engine.generate(prompts, GREEDY, request_ids=[f"again-{i}" for i in range(len(prompts))])
    # every full block of the prompt hits but the one holding its last token (its logits are needed)
    assert [c.num_cached_tokens for c in warm] == [(len(p) - 1) // 4 * 4 for p in prompts]
    assert [c.output_token_ids for c in warm] == [c.output_token_ids for c in cold]
    check_equal(warm, reference)


def test_core_deltas_carry_token_ids_not_text(tiny_engine, prompts):
    engine = tiny_engine()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, stop=["e"], logprobs=2)
    engine.add_request("r", prompts[0], params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [len(d.new_token_ids) for d in deltas] == [1, 1, 1]
    assert all(d.new_text == "" for d in deltas)  # stop strings are not the core's business
    assert [d.finished for d in deltas] == [False, False, True] and deltas[-1].finish_reason == "length"
    assert all(len(d.new_logprobs) == 1 and len(d.new_logprobs[0].top_logprobs) == 2 for d in deltas)


def _stop_case(engine, prompt):
    """A stop string from the middle of the prompt's greedy text, and that text cut before it."""
    free = engine.generate([prompt], GREEDY)[0]
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and text.find(stop) > 0
    return stop, text[: text.find(stop)], free.output_token_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_generate_stops_on_a_stop_string_and_drops_later_tokens(tiny_engine, tokenizer, prompts, async_scheduling):
    engine = tiny_engine(async_scheduling=async_scheduling)
    stop, want_text, free_ids = _stop_case(engine, prompts[0])
    c = engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True,
                                                       stop=[stop]))[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (want_text, "stop", stop)
    n = len(c.output_token_ids)
    assert n < NUM_NEW and c.output_token_ids == free_ids[:n]
    assert stop in tokenizer.decode(c.output_token_ids) and stop not in tokenizer.decode(c.output_token_ids[:-1])
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and stats["num_free_blocks"] == stats["num_blocks"]


def test_async_engine_stops_on_a_stop_string_and_aborts_in_the_core(tiny_engine, tokenizer, prompts):
    core = tiny_engine(async_scheduling=True)
    stop, want_text, free_ids = _stop_case(core, prompts[0])
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, stop=[stop])

    async def run():
        engine = AsyncLLMEngine(core)
        try:
            outs = [o async for o in engine.generate("s", prompts[0], params)]
            done = await engine.complete("c", prompts[0], params)
            for _ in range(200):  # the abort crosses to the loop thread
                if not core.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            return outs, done
        finally:
            engine.shutdown()

    outs, done = asyncio.run(run())
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert "".join(o.new_text for o in outs) == want_text == done.text
    ids = [t for o in outs for t in o.new_token_ids]
    assert ids == done.output_token_ids == free_ids[: len(ids)]
    assert not core.has_unfinished_requests()
    assert core.stats()["num_free_blocks"] == core.stats()["num_blocks"]


def test_reused_id_never_gets_the_aborted_requests_in_flight_token(tiny_engine, prompts):
    engine = tiny_engine(async_scheduling=True)
    want = engine.generate([prompts[1]], GREEDY, request_ids=["cold"])[0].output_token_ids
    engine.add_request("x", prompts[0], GREEDY)
    assert engine.step() == []  # launched, not yet processed (pipelined)
    engine.abort_request("x")  # e.g. a stop string found outside the core
    engine.add_request("x", prompts[1], GREEDY)
    got = []
    while engine.has_unfinished_requests():
        got += [t for o in engine.step() if o.request_id == "x" for t in o.new_token_ids]
    assert got == want


def test_add_request_errors_name_the_field(tiny_engine):
    engine = tiny_engine()
    cases = [([], GREEDY, "prompt"), ([10**9], GREEDY, "prompt"), ([1] * 600, GREEDY, "prompt"),
             ([1, 2], SamplingParams(max_tokens=511), "max_tokens"), ([1, 2], SamplingParams(n=2), "n")]
    for prompt, params, param in cases:
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("bad", prompt, params)
        assert e.value.param == param and isinstance(e.value, ValueError)
    engine.add_request("dup", [1, 2], GREEDY)
    with pytest.raises(InvalidRequestError, match="duplicate request id 'dup'"):
        engine.add_request("dup", [1, 2], GREEDY)
    with pytest.raises(InvalidRequestError, match="KV blocks") as e:
        engine.add_request("big", [1] * 300, SamplingParams(max_tokens=8))  # 77 blocks of 4 > 64
    assert e.value.param is None


def test_huge_seed_and_top_k_run_beside_others(tiny_engine, tokenizer):
    """Any integer seed (past int64, or seed + i of an n-th choice) is taken modulo 2**64 and any top_k
    past the vocabulary filters nothing: such requests never fail a step, theirs or their neighbours'."""
    from rayinfer.engine.types import SamplingParams

    engine = tiny_engine()
    prompt = tokenizer.encode("The sky is")
    sampled = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    done = engine.generate(
        [prompt] * 5,
        [SamplingParams(seed=2**64 + 7, **sampled), SamplingParams(seed=7, **sampled),
         SamplingParams(seed=-(2**63) - 1, **sampled), SamplingParams(top_k=2**31, seed=3, **sampled),
         SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)],
        ["wrapped", "plain", "negative", "top-k", "greedy"])
    assert all(c.error is None and len(c.output_token_ids) == 6 for c in done), [c.error for c in done]
    assert done[0].output_token_ids == done[1].output_token_ids  # 2**64 + 7 is seed 7
    unfiltered = tiny_engine().generate([prompt], SamplingParams(top_k=0, seed=3, **sampled))[0]
    assert done[3].output_token_ids == unfiltered.output_token_ids  # top_k past the vocabulary: no filter
    greedy = tiny_engine().generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert done[4].output_token_ids == greedy.output_token_ids  # the neighbours are untouched


def test_max_model_len_beyond_the_models_positions_is_named():
    """A context limit past the positions the model was built for (its max_position_embeddings) is a config
    error at engine construction, as in vLLM, not a wrong or failing RoPE lookup later."""
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.engine.llm_engine import LLMEngine
    from rayinfer.model.loader import load_config

    limit = load_config("llama-tiny").max_position_embeddings
    want = f"max_model_len {limit + 1} exceeds the model's max_position_embeddings {limit}"
    with pytest.raises(ValueError, match=want):
        LLMEngine(ModelConfig("llama-tiny", load_format="dummy", max_model_len=limit + 1),
                  EngineConfig(device="cpu", num_kv_blocks=16))


def test_a_failing_warm_up_prefill_is_a_warning(tiny_engine, prompts, reference, monkeypatch, caplog):
    """The start-up prefill is an optimization: if it raises, the engine logs why and serves as before."""
    engine = tiny_engine()

    def broken(num_tokens):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(engine.runner, "warm_up_prefill", broken)
    with caplog.at_level("WARNING", logger="rayinfer.engine.llm_engine"):
        engine._warm_up_prefill(True)  # as a CUDA engine calls it
    assert "warm-up prefill of 256 tokens failed (RuntimeError: no kernel for you)" in caplog.text
    check_equal(engine.generate(prompts, GREEDY), reference)



def test_a_handle_that_leaves_out_cached_blocks_imports_the_rest(tiny_engine, prompts):
    """A KV-store handle may leave out the leading blocks the replica has cached (``first_block``): the
    scheduler takes those from the prefix cache (or loads them from the host tier) and imports only the
    payload's blocks; if they were evicted from both by admission, the handle is dropped and the prompt
    computed. Outputs equal a run without a handle."""
    from rayinfer.engine.model_runner import kv_layout_tag
    from rayinfer.engine.types import KVHandle
    from rayinfer.policy.kv_store_index import block_hashes

    shared = prompts[0][:12]  # three blocks of 4 tokens
    prompt = shared + prompts[1] + prompts[2][:9]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = tiny_engine()
    want = ref.generate([prompt], params)[0].output_token_ids
    hashes = block_hashes(prompt, 4)
    pool = ref.scheduler.kv.pool
    ids = [pool.hash_to_block[h] for h in hashes]
    skip = 3

    def handle(rid):
        payload = ref.kv_cache[:, ids[skip:]].clone()
        return KVHandle(rid, hashes, len(hashes) * 4, kv_layout_tag(ref.kv_cache), payload, first_block=skip)

    engine = tiny_engine()
    engine.generate([shared + prompts[3][:5]], params)  # the shared blocks are now cached here
    computed = engine.num_computed_tokens
    engine.add_request("with-handle", prompt, params, kv_handle=handle("with-handle"))
    out = drain_one(engine)
    assert out == want
    assert engine.num_computed_tokens - computed == len(prompt) - len(hashes) * 4 + params.max_tokens - 1

    cold = tiny_engine()  # the blocks the handle leaves out are not cached: dropped, the prompt computed
    cold.add_request("no-prefix", prompt, params, kv_handle=handle("no-prefix"))
    assert drain_one(cold) == want
    assert cold.num_computed_tokens == len(prompt) + params.max_tokens - 1

    # host tier: the left-out blocks were evicted from the device pool to host memory; they load back from there
    tiered = tiny_engine(num_kv_blocks=16, host_kv_cache_gib=0.01)
    tiered.generate([shared + prompts[3][:5]], params)
    tiered.generate([(prompts[2] * 3)[:58]], params)  # 58 + 6 tokens fill all 16 blocks: the shared ones are evicted
    kv = tiered.scheduler.kv
    assert not any(h in kv.pool.hash_to_block for h in hashes[:skip]) and all(h in kv.host.hash_to_slot
                                                                           for h in hashes[:skip])
    loaded, computed = kv.host.num_loaded, tiered.num_computed_tokens
    tiered.add_request("from-host", prompt, params, kv_handle=handle("from-host"))
    assert drain_one(tiered) == want
    assert kv.host.num_loaded - loaded == skip
    assert tiered.num_computed_tokens - computed == len(prompt) - len(hashes) * 4 + params.max_tokens - 1

    with pytest.raises(InvalidRequestError, match=r"leaves out \d+ leading blocks; it may leave out only its \d+ hashed"):
        bad = KVHandle("bad", hashes, len(hashes) * 4, kv_layout_tag(ref.kv_cache), None, first_block=len(hashes) + 1)
        engine.add_request("bad", prompt, params, kv_handle=bad)


def drain_one(engine) -> list[int]:
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens
