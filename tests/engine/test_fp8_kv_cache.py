"""kv_cache_dtype="fp8": the cache holds float8_e4m3fn, written as the model's keys/values rounded to fp8,
and generation stays close to the full-precision engine's."""

import pytest
import torch

from rayinfer.engine.config import EngineConfig
from rayinfer.engine.types import SamplingParams

QUESTIONS = ["What is 2 + 2?", "Name a primary color.", "Why is the sky blue?", "Write a haiku about the sea."]


def run(kv_cache_dtype: str, smollm2):
    from rayinfer.serve.chat import render_chat

    engine = smollm2.engine(num_kv_blocks=128, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    prompts = [render_chat(smollm2.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, logprobs=1))
    return engine, prompts, done


@pytest.fixture(scope="module")
def runs(smollm2):
    return run("auto", smollm2), run("fp8", smollm2)


def test_cache_is_fp8_and_holds_the_rounded_keys_and_values(smollm2):
    from rayinfer.serve.chat import render_chat

    prompt = render_chat(smollm2.tokenizer, [{"role": "user", "content": QUESTIONS[2]}])
    caches = {}
    for kv in ("auto", "fp8"):  # max_tokens=1: only the prompt's keys and values reach the cache
        engine = smollm2.engine(num_kv_blocks=16, kv_cache_dtype=kv)
        engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        caches[kv] = engine.kv_cache
    full, fp8 = caches["auto"], caches["fp8"]
    assert full.dtype == torch.float32 and fp8.dtype == torch.float8_e4m3fn and fp8.shape == full.shape
    # Layer 0's keys and values depend on the embeddings only, so both engines computed the same ones
    # (into the same blocks); the fp8 cache holds them rounded to fp8.
    want = full[0].to(torch.float8_e4m3fn)
    assert fp8[0].float().abs().sum() > 0
    assert torch.equal(fp8[0].view(torch.uint8), want.view(torch.uint8))


def test_generation_stays_close_to_full_precision(runs):
    (_, _, ref), (_, _, got) = runs
    for a, b in zip(ref, got):
        assert a.error is None and b.error is None
        assert b.output_token_ids[0] == a.output_token_ids[0], (a.text, b.text)  # the first token agrees
        n = next((i for i, (x, y) in enumerate(zip(a.output_token_ids, b.output_token_ids)) if x != y),
                 len(a.output_token_ids))
        drift = max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs[:n], b.logprobs[:n]))
        assert drift < 0.5, (a.text, b.text, drift)


def test_bad_kv_cache_dtype_is_named():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*'int4'"):
        EngineConfig(kv_cache_dtype="int4")
