"""AsyncLLMEngine compiles ``response_format`` into a matcher before queueing (fake engine, real tokenizer)."""

from __future__ import annotations

import asyncio

import pytest
import xgrammar as xgr

from rayinfer.engine.async_engine import AsyncLLMEngine
from rayinfer.engine.structured_output import GrammarError
from rayinfer.engine.types import SamplingParams


class FakeEngine:
    """Just what AsyncLLMEngine touches: a tokenizer and vocab size, and a request queue that records."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, (tokenizer.eos_token_id,)
        self.added: dict[str, object] = {}
        self.grammars: dict[str, object] = {}  # every request's grammar, kept after aborts
        self.parked: dict[str, object] = {}  # PREFILL role only; AsyncLLMEngine checks it each loop

    def stats(self):
        return {}

    def has_unfinished_requests(self):
        return False

    def add_request(self, rid, prompt, params, grammar=None):
        self.added[rid] = self.grammars[rid] = grammar

    def abort_request(self, rid):
        self.added.pop(rid, None)


@pytest.fixture(scope="module")
def engine():
    from rayinfer.model.loader import load_tokenizer

    tok = load_tokenizer("SmolLM2-135M-Instruct")
    fake = FakeEngine(tok, len(tok) + 64)  # model vocab padded past the tokenizer
    eng = AsyncLLMEngine(fake)
    yield eng
    eng.shutdown()


async def _submit(eng, rid, params):
    gen = eng.generate(rid, [1, 2, 3], params)
    task = asyncio.ensure_future(gen.__anext__())
    for _ in range(50):
        if rid in eng.engine.added or task.done():
            break
        await asyncio.sleep(0.02)
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, StopAsyncIteration):
        pass
    finally:
        await gen.aclose()


def test_constrained_request_gets_a_matcher(engine):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    asyncio.run(_submit(engine, "a", SamplingParams(response_format=rf)))
    assert isinstance(engine.engine.grammars["a"], xgr.GrammarMatcher)
    asyncio.run(_submit(engine, "b", SamplingParams()))
    assert engine.engine.grammars["b"] is None
    assert engine.grammar_compiler().tokenizer_info.vocab_size == engine.engine.vocab_size


def test_bad_or_slow_grammar_raises_before_queueing(engine):
    async def first(params):
        async for _ in engine.generate("bad", [1, 2], params):
            break

    with pytest.raises(GrammarError, match="invalid response_format"):
        asyncio.run(first(SamplingParams(response_format={"type": "regex", "regex": "(x"})))
    svc = engine.grammar_compiler()
    old, svc.timeout_s = svc.timeout_s, 0.0
    try:
        with pytest.raises(GrammarError, match="longer than"):
            asyncio.run(first(SamplingParams(response_format={"type": "regex", "regex": "[0-9a-f]{1,64}x"})))
    finally:
        svc.timeout_s = old
    assert "bad" not in engine.engine.grammars
