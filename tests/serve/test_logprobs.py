"""serve/logprobs.py against the real tokenizer's own decode: token bytes, unique strings, offsets."""

from __future__ import annotations

import pytest

from rayinfer.serve.logprobs import TextOffsets, TokenBytes

EMOJI = "🍕🧀🍅"


def test_every_tokens_bytes_decode_as_the_tokenizer_decodes_it(tokenizer):
    tb = TokenBytes(tokenizer)
    for i in range(len(tokenizer)):
        assert tb.bytes_of(i).decode("utf-8", errors="replace") == tokenizer.decode([i]), i


@pytest.mark.parametrize("text", [EMOJI, " pizza 🍕!", "naïve café — 東京", "a\u200db \U0001f468\u200d\U0001f469"])
def test_token_bytes_concatenate_to_the_utf8_of_the_text(tokenizer, text):
    tb = TokenBytes(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tb.bytes_of(i) for i in ids) == text.encode()
    offsets = TextOffsets()
    starts = [offsets.add(tb.bytes_of(i)) for i in ids]
    assert offsets.offset == len(text)
    # a token starts at the characters the tokens before it completed (the HF decode of that prefix, minus
    # a trailing partial character)
    for k, at in enumerate(starts):
        assert at == len(tokenizer.decode(ids[:k]).rstrip("\ufffd")), k


def test_partial_tokens_get_unique_strings(tokenizer):
    tb = TokenBytes(tokenizer)
    partial = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd"]
    real = [i for i in partial if tb.bytes_of(i) == "\ufffd".encode()]  # the vocabulary holds U+FFFD itself
    assert len(real) == 1 and tb.text_of(real[0]) == "\ufffd"
    partial = [i for i in partial if i not in real]
    assert len(partial) > 100
    names = [tb.text_of(i) for i in partial]
    assert len(set(names)) == len(names) and all(n.startswith("bytes:\\x") for n in names)
    assert tb.text_of(tokenizer.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
