"""OpenAI semantics of the live app, through the official ``openai`` client (chat and completions)."""

from __future__ import annotations

import math

import pytest

MSG = [{"role": "user", "content": "Name three colors."}]


def test_models_lists_the_served_model(client, model):
    ids = [m.id for m in client.models.list().data]
    assert ids == [model]


def test_chat_basic_and_usage(client, model):
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=6, temperature=0)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert c.message.content and c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 6 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_deltas_equal_plain_text_for_same_seed(client, model):
    kw = dict(model=model, messages=MSG, max_tokens=10, temperature=0.9, top_p=0.95, seed=1234)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_max_completion_tokens_and_length_finish(client, model):
    r = client.chat.completions.create(model=model, messages=MSG, max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_n_with_seed_fans_out_and_is_reproducible(client, model):
    kw = dict(model=model, messages=MSG, max_tokens=8, temperature=1.0, seed=7, n=3)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    # choice i uses seed + i: choice 1 of seed 7 is choice 0 of seed 8
    one = client.chat.completions.create(**{**kw, "n": 1, "seed": 8})
    assert one.choices[0].message.content == texts[1]
    streamed = list(client.chat.completions.create(**kw, stream=True))
    by_index = {}
    for ch in streamed:
        for c in ch.choices:
            by_index[c.index] = by_index.get(c.index, "") + (c.delta.content or "")
    assert [by_index[i] for i in range(3)] == texts


def test_stop_string_is_not_in_text(client, model):
    base = client.chat.completions.create(model=model, messages=MSG, max_tokens=12, temperature=0)
    text = base.choices[0].message.content
    word = next((w for w in text.split()[1:] if len(w) > 2), None)
    if word is None:
        pytest.skip(f"output too short to pick a stop string: {text!r}")
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=12, temperature=0, stop=[word])
    assert word not in r.choices[0].message.content
    assert text.startswith(r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop"


def test_chat_logprobs_and_top_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[-1].logprob
        assert math.isclose(tok.logprob, tok.top_logprobs[0].logprob, abs_tol=1e-4)  # greedy: the top one


def test_penalties_change_repetitive_output(client, model):
    kw = dict(model=model, prompt="The cat sat on the mat. The cat sat on the mat. The cat sat on the",
              max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penal = client.completions.create(**kw, **penalty).choices[0].text
        assert penal != plain, penalty


def test_completions_echo_and_logprobs(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text.startswith("The capital of France is")
    lp = c.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert lp.token_logprobs[:n_prompt] == [None] * n_prompt
    assert all(len(t) == 2 for t in lp.top_logprobs[n_prompt:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_completions_token_id_prompts_and_many_prompts(client, model):
    text = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0)
    from rayinfer.model.loader import load_tokenizer

    ids = load_tokenizer(model).encode("Once upon a time")
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text
    many = client.completions.create(model=model, prompt=[ids, ids[:2]], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == text.choices[0].text[: len(many.choices[0].text)]
    assert many.usage.prompt_tokens == len(ids) + 2
    strings = client.completions.create(model=model, prompt=["Once upon a time", "Hello"], max_tokens=3,
                                        temperature=0)
    assert strings.choices[0].text == many.choices[0].text


def test_completions_stream_matches_plain(client, model):
    kw = dict(model=model, prompt="Roses are red,", max_tokens=8, temperature=0.8, seed=3)
    plain = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
    assert chunks[-1].usage.completion_tokens >= 1


def test_seeds_past_int64_and_huge_top_k_are_served(client, model):
    """Seeds are taken modulo 2**64 (README), top_k past the vocabulary filters nothing: such requests
    are answered, and so are the requests beside them."""
    import concurrent.futures

    kw = dict(model=model, prompt="The sky is", max_tokens=3, temperature=1.0)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.completions.create, seed=2**63, **kw),
                   pool.submit(client.completions.create, seed=2**63 - 1, n=2, **kw),
                   pool.submit(client.completions.create, seed=-(2**63) - 1, **kw),
                   pool.submit(client.completions.create, seed=1, extra_body={"top_k": 2**31}, **kw)]
        answers = [f.result() for f in futures]
    assert [len(a.choices) for a in answers] == [1, 2, 1, 1]
    assert all(c.finish_reason == "length" for a in answers for c in a.choices)
    wrapped = client.completions.create(seed=2**64 + 5, **kw).choices[0].text
    assert wrapped == client.completions.create(seed=5, **kw).choices[0].text


def test_chat_logprob_bytes_concatenate_to_the_content(client, model):
    # issue 23: every emoji token came back as "\ufffd" with bytes [239, 191, 189]
    r = client.chat.completions.create(model=model, temperature=0, max_tokens=9, logprobs=True, top_logprobs=3,
                                       messages=[{"role": "user", "content": "Reply with three emojis that describe pizza."}])
    content = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    assert bytes(b for e in content for b in e.bytes) == text.encode()
    assert all(e.bytes != [239, 191, 189] or e.token == "\ufffd" for e in content)
    for e in content:
        assert len({t.token for t in e.top_logprobs}) == len(e.top_logprobs) == 3


def test_legacy_logprobs_keep_n_distinct_alternatives(client, model):
    r = client.completions.create(model=model, prompt="Three emojis for pizza: 🍕", max_tokens=12, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens
    assert all(len(alts) == 2 for alts in lp.top_logprobs)
