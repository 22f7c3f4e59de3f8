"""engine/structured_output.py on a toy byte vocabulary (no model, no Ray)."""

from __future__ import annotations

import asyncio
import json

import pytest
import xgrammar as xgr

from rayinfer.engine.structured_output import (
    GrammarCompilerService,
    GrammarError,
    canonical_key,
    check_response_format,
    is_constrained,
)

# one token per printable ASCII character, an EOS, and padding up to the "model" vocab size
VOCAB = [chr(c) for c in range(32, 127)] + ["\n", "<eos>"]
EOS = len(VOCAB) - 1
MODEL_VOCAB = 128  # > len(VOCAB): the model's logits are wider than the tokenizer


@pytest.fixture(scope="module")
def service():
    info = xgr.TokenizerInfo(VOCAB, vocab_size=MODEL_VOCAB, stop_token_ids=[EOS])
    svc = GrammarCompilerService(info, max_workers=2, cache_size=4, timeout_s=10)
    yield svc
    svc.shutdown()


def _accepts(service, rf: dict, text: str) -> bool:
    matcher = asyncio.run(service.matcher(rf))
    return all(matcher.accept_token(VOCAB.index(ch)) for ch in text) and matcher.accept_token(EOS) \
        and matcher.is_terminated()


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("rf,good,bad", [
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
     '{"name": "ann", "age": 3}', '{"name": "ann"}'),
    ({"type": "json_object"}, '{"a": [1, 2]}', "[1, 2]"),
    ({"type": "regex", "regex": r"\d{3}-[a-z]+"}, "123-abc", "12-abc"),
    ({"type": "ebnf", "ebnf": 'root ::= "yes" | "no"'}, "no", "maybe"),
    ({"type": "structural_tag", "format": {"type": "tag", "begin": "<t>", "end": "</t>",
                                           "content": {"type": "json_schema", "json_schema": {"type": "integer"}}}},
     "<t>42</t>", "<t>x</t>"),
])
def test_formats_accept_only_matching_text(service, rf, good, bad):
    assert _accepts(service, rf, good)
    assert not _accepts(service, rf, bad)


def test_bitmask_covers_model_vocab_padding(service):
    matcher = asyncio.run(service.matcher({"type": "regex", "regex": "a+"}))
    mask = xgr.allocate_token_bitmask(1, MODEL_VOCAB)
    matcher.fill_next_token_bitmask(mask)
    import torch

    logits = torch.zeros(1, MODEL_VOCAB)
    xgr.apply_token_bitmask_inplace(logits, mask)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed == [VOCAB.index("a")]  # padding ids past the tokenizer are never allowed


@pytest.mark.parametrize("rf,needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "invalid JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is required"),
    ({"type": "regex", "regex": "a(b"}, "parenthesis"),
    ({"type": "regex"}, "regex is required"),
    ({"type": "ebnf", "ebnf": "root ::= undefined_rule"}, "not defined"),
    ({"type": "yaml"}, "response_format.type must be one of"),
    ("json", "must be an object"),
])
def test_bad_formats_raise_grammar_error(rf, needle):
    with pytest.raises(GrammarError, match=needle):
        check_response_format(rf)
    assert issubclass(GrammarError, ValueError)  # so the engine path turns it into a 400


def test_cache_is_keyed_by_canonical_spec_and_evicts_failures(service):
    a = {"type": "regex", "regex": "x+"}
    b = {"regex": "x+", "type": "regex"}
    assert canonical_key(a) == canonical_key(b)
    g1, g2 = service.compile(a), service.compile(b)
    assert g1 is g2
    with pytest.raises(GrammarError):
        service.compile({"type": "regex", "regex": "("})
    assert all(not f.exception() for f in service._cache.values())  # the failure did not stay cached
    for i in range(6):  # LRU bound
        service.compile({"type": "regex", "regex": f"y{{{i + 1}}}"})
    assert service.cache_info()["size"] <= 4


def test_timeout_gives_grammar_error(service):
    with pytest.raises(GrammarError, match="longer than"):
        service.compile({"type": "regex", "regex": "z" * 3 + "[a-z]{1,400}"}, timeout_s=0.0)


def test_text_is_unconstrained(service):
    assert not is_constrained({"type": "text"}) and not is_constrained(None)
    assert asyncio.run(service.matcher({"type": "text"})) is None
    assert json.loads(canonical_key({"b": 1, "a": 2})) == {"a": 2, "b": 1}
