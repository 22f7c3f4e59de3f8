"""Gemma-3-270M (real weights, converted from the GGUF chunk packages): the engine's greedy tokens equal
Hugging Face transformers' (float32, CPU), with one prompt longer than the 512-token sliding window.

The model and the reference are loaded once per module; generations are short to keep this fast.
"""

import pytest
import torch

from rayinfer.engine.types import SamplingParams

MAX_TOKENS = 8
TIE = 1e-3


def long_text() -> str:
    return " ".join(f"On day {i} the weather was {'sunny' if i % 3 else 'rainy'} and {i % 7} birds sang."
                    for i in range(36)) + " To sum up, the weather was"


@pytest.fixture(scope="module")
def gemma():
    """``(model, tokenizer, model_dir)``: our Gemma3ForCausalLM in float32 on the CPU."""
    from rayinfer.model.loader import load_model, load_tokenizer, resolve_model

    model = load_model("gemma3", torch.float32, "cpu")
    return model, load_tokenizer("gemma3"), resolve_model("gemma3")


@pytest.fixture(scope="module")
def prompts(gemma):
    _, tok, _ = gemma
    texts = ["The capital of France is", "def fibonacci(n):\n   ", "Roses are red,", long_text()]
    out = [tok(t).input_ids for t in texts]
    assert len(out[-1]) > 520, len(out[-1])  # longer than the window (512)
    # last: the long prompt and a few new tokens (a prefix hit past the window once the long one ran)
    return out + [out[-1] + tok(" and the birds", add_special_tokens=False).input_ids]


@pytest.fixture(scope="module")
def reference(gemma, prompts):
    """HF greedy tokens and, per step, the gap between the top-2 logits."""
    import transformers

    _, tok, path = gemma
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=tok.pad_token_id, eos_token_id=None)
            gaps = [float(l[0].topk(2).values.diff().abs()) for l in out.logits]
            refs.append((out.sequences[0, len(p):].tolist(), gaps))
    return refs


def engine_for(gemma, **kw):
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.engine.llm_engine import LLMEngine

    model, tok, _ = gemma
    config = EngineConfig(**{"device": "cpu", "num_kv_blocks": 256, "max_num_seqs": 8,
                             "max_num_batched_tokens": 1024, **kw})
    return LLMEngine(ModelConfig(dtype="float32"), config, model=model, tokenizer=tok)


def check_equal(completions, refs):
    for c, (ref_ids, gaps) in zip(completions, refs):
        assert c.error is None, c.error
        got = c.output_token_ids
        for k, (g, r) in enumerate(zip(got, ref_ids)):
            if g != r:
                assert gaps[k] < TIE, f"{c.request_id}: token {k} differs ({g} vs {r}), gap {gaps[k]}"
                break
        else:
            assert len(got) == len(ref_ids), f"{c.request_id}: length {len(got)} vs {len(ref_ids)}"


def greedy(n=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(gemma):
    return engine_for(gemma, max_num_batched_tokens=200)


def test_greedy_matches_hf(engine, prompts, reference):
    """One batch; the long prompt is prefilled in chunks of 200 tokens, so its last chunk's windows
    start past the first block."""
    check_equal(engine.generate(prompts[:-1], greedy()), reference[:-1])
    stats = engine.stats()
    assert stats["num_replayed_tokens"] == 0
    assert stats["num_local_free_blocks"] == stats["num_local_blocks"] - 1  # all back but the null block


def test_prefix_hit_replays_only_the_window(engine, gemma, prompts, reference):
    """The long prompt is cached (previous test): a prompt extending it hits 528 tokens, restores the
    full-attention layers' KV and recomputes the sliding layers' KV of the last W - 1 = 511 hit tokens
    with the new ones, in one forward; its greedy tokens still equal Hugging Face's cold run. (Replay is
    approximate, see ``engine.kv_cache_manager``: log-probabilities move by up to ~0.3 nats here, so
    this checks tokens, not logits.)"""
    model = gemma[0]
    window = model.sliding_window
    before = engine.stats()
    out = engine.generate(prompts[-1:], greedy(), request_ids=["warm"])
    after = engine.stats()
    check_equal(out, reference[-1:])
    hit = out[0].num_cached_tokens
    assert hit == len(prompts[-2]) // 16 * 16 > window
    assert after["num_replayed_tokens"] - before["num_replayed_tokens"] == window - 1
    # the sliding layers computed the replay + the uncached suffix (+ the decode steps), not the prefix
    suffix = len(prompts[-1]) - hit
    computed = after["num_computed_tokens"] - before["num_computed_tokens"]
    assert computed == (window - 1) + suffix + MAX_TOKENS - 1


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pd_roles_refuse_sliding_window_models(gemma, role):
    with pytest.raises(ValueError, match=f"role={role}: prefill/decode disaggregation does not support sliding-window"):
        engine_for(gemma, role=role)
