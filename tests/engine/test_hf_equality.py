"""SmolLM2 greedy outputs of the engine equal Hugging Face transformers token for token (float32, CPU).

Divergence is allowed only after a step where the reference's top-2 logits are within 1e-3 (a near tie
that float32 summation order can flip). The same check holds with prefix-cache hits, forced preemption,
chunked prefill and different batch compositions.
"""

import pytest
import torch

from rayinfer.engine.types import SamplingParams
from rayinfer.serve.chat import encode_plain, render_chat

MAX_TOKENS = 20
TIE = 1e-3
SYSTEM = "You are a concise assistant. Answer in plain English and keep answers short."


def build_prompts(tok):
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a primary color."}],
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 2?"}],
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why is the sky blue?"}],
        [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    ]
    raws = ["The quick brown fox", "def fibonacci(n):\n   ", "Paris is"]
    long_text = " ".join(f"Item {i}: the weather on day {i} was {'sunny' if i % 3 else 'rainy'}." for i in range(64))
    prompts = [render_chat(tok, c) for c in chats] + [encode_plain(tok, r) for r in raws]
    # exactly two blocks long: its first decoded token needs a new block (forces preemption below)
    prompts.append(encode_plain(tok, "Once upon a time, in a small village by the sea, " * 4)[:32])
    prompts.append(render_chat(tok, [{"role": "user", "content": long_text + "\nSummarize the weather."}]))
    assert len(prompts[-1]) > 512  # several chunks of the chunked-prefill test, 30+ blocks
    return prompts


@pytest.fixture(scope="module")
def model_path():
    from rayinfer.model.loader import resolve_model

    return resolve_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def reference(model_path):
    """HF greedy tokens and, per step, the gap between the top-2 logits."""
    import transformers

    from rayinfer.model.loader import load_tokenizer

    tok = load_tokenizer("SmolLM2-135M-Instruct")
    hf = transformers.LlamaForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompts = build_prompts(tok)
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
            ids = out.sequences[0, len(p):].tolist()
            gaps = []
            for step_logits in out.logits:
                top2 = step_logits[0].float().topk(2).values
                gaps.append(float(top2[0] - top2[1]))
            refs.append((ids, gaps))
    return prompts, refs


def check_equal(completions, refs):
    for c, (ref_ids, gaps) in zip(completions, refs):
        assert c.error is None, c.error
        got = c.output_token_ids
        n = min(len(got), len(ref_ids))
        for k in range(n):
            if got[k] != ref_ids[k]:
                assert gaps[k] < TIE, f"{c.request_id}: token {k} differs ({got[k]} vs {ref_ids[k]}), gap {gaps[k]}"
                break
        else:
            assert len(got) == len(ref_ids), f"{c.request_id}: length {len(got)} vs {len(ref_ids)}"


def run_engine(smollm2, prompts, **engine_kw):
    kw = dict(num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=2048)
    kw.update(engine_kw)
    engine = smollm2.engine(**kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return engine, engine.generate(prompts, params)


@pytest.fixture(scope="module")
def first_pass(smollm2, reference):
    """One engine's first pass over every prompt (its prefix cache then holds them)."""
    prompts, _ = reference
    return run_engine(smollm2, prompts)


def test_greedy_batch_matches_hf(reference, first_pass):
    _, refs = reference
    _, out = first_pass
    check_equal(out, refs)
    assert out[0].text.strip(), "the capital question got an empty answer"


def test_prefix_cache_hits_keep_outputs(reference, first_pass):
    prompts, refs = reference
    engine, first = first_pass
    hits_before = engine.stats()["prefix_cache_hits"]
    second = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                             request_ids=[f"again-{i}" for i in range(len(prompts))])
    assert engine.stats()["prefix_cache_hits"] > hits_before
    assert all(c.num_cached_tokens > 0 for c in second if len(c.prompt_token_ids) > 32)
    # the shared system prompt hit within the first pass too
    assert any(c.num_cached_tokens > 0 for c in first[1:4])
    check_equal(second, refs)


def test_forced_preemption_keeps_outputs(smollm2, reference):
    prompts, refs = reference
    short = prompts[:-1]  # the pool fits every short prompt at admission but not their growth
    blocks = sum(-(-len(p) // 16) for p in short)  # exact fit: the first block boundary preempts
    engine, out = run_engine(smollm2, short, num_kv_blocks=blocks, enable_prefix_caching=False)
    assert engine.stats()["num_preemptions"] > 0
    check_equal(out, refs[:-1])


def test_chunked_prefill_keeps_outputs(smollm2, reference):
    prompts, refs = reference
    engine, out = run_engine(smollm2, prompts, max_num_batched_tokens=64)
    check_equal(out, refs)


def test_batch_composition_does_not_change_outputs(smollm2, reference):
    prompts, refs = reference
    engine = smollm2.engine(num_kv_blocks=512, max_num_seqs=3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    alone = [engine.generate([p], params, request_ids=[f"solo-{i}"])[0] for i, p in enumerate(prompts[:4])]
    check_equal(alone, refs[:4])
    # reversed order, three at a time; the 500-token prompt is left to the chunked-prefill test (its
    # prefill alone would double this test's time)
    mixed = engine.generate(prompts[-2::-1], params, request_ids=[f"rev-{i}" for i in range(len(prompts) - 1)])
    check_equal(mixed, refs[-2::-1])
