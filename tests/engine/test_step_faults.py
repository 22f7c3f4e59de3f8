"""A fault of one request inside an engine step (its sampling inputs, its grammar, anything the model
raises over its tokens) ends that request with an error; the step goes on for the others, whose tokens
equal a run without the faulty request."""

import asyncio

import pytest

from rayinfer.engine.async_engine import AsyncLLMEngine
from rayinfer.engine.types import Completion, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=8, ignore_eos=True)
POISON = 777  # a prompt token the poisoned model refuses


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(t) for t in ["Once upon a time", "The capital of France is", "def add(a, b):"]]


class FailingGrammar:
    """A grammar matcher whose mask raises from its ``fail_at``-th step on (0: the first)."""

    def __init__(self, fail_at: int = 0):
        self.fail_at, self.calls = fail_at, 0

    def is_terminated(self) -> bool:
        return False

    def fill_next_token_bitmask(self, bitmask, row) -> None:
        self.calls += 1
        if self.calls > self.fail_at:
            raise RuntimeError("grammar matcher broke")

    def accept_token(self, token) -> bool:
        return True


class PoisonedModel:
    """The tiny model, except that a forward over a batch holding token ``POISON`` raises."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, *args):
        if bool((input_ids == POISON).any()):
            raise RuntimeError("poisoned token in the batch")
        return self.model(input_ids, *args)

    def __getattr__(self, name):
        return getattr(self.model, name)


def run(engine, requests) -> dict[str, Completion]:
    """Drive the core to the end; ``requests``: (request id, prompt, params, add_request kwargs)."""
    results = {}
    for rid, prompt, params, kw in requests:
        engine.add_request(rid, prompt, params, **kw)
        results[rid] = Completion(rid, list(prompt))
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id].add(out)
    return results


def good_requests(prompts):
    return [(f"ok-{i}", p, GREEDY if i % 2 else SEEDED, {}) for i, p in enumerate(prompts)]


def assert_others_unharmed(engine, baseline, got, bad_id):
    assert got[bad_id].finish_reason == "error"
    assert got[bad_id].error
    for rid, want in baseline.items():
        assert got[rid].error is None, got[rid].error
        assert got[rid].output_token_ids == want.output_token_ids, rid
        assert got[rid].finish_reason == want.finish_reason == "length"
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.usage == 0.0  # the failed request's blocks were freed too


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fail_at", [0, 3], ids=["first-step", "mid-stream"])
def test_grammar_that_raises_fails_its_request_only(tiny_engine, prompts, async_scheduling, fail_at):
    baseline = run(tiny_engine(async_scheduling=async_scheduling), good_requests(prompts))
    engine = tiny_engine(async_scheduling=async_scheduling)
    bad = ("bad", prompts[0], GREEDY, {"grammar": FailingGrammar(fail_at)})
    got = run(engine, [*good_requests(prompts)[:1], bad, *good_requests(prompts)[1:]])
    assert "grammar matcher broke" in (got["bad"].error or "")
    assert len(got["bad"].output_token_ids) == fail_at
    assert_others_unharmed(engine, baseline, got, "bad")


def test_sampling_input_that_raises_fails_its_request_only(tiny_engine, prompts):
    baseline = run(tiny_engine(), good_requests(prompts))
    engine = tiny_engine()
    broken = SamplingParams(temperature=0.5, max_tokens=8)
    broken.top_k = "many"  # type: ignore[assignment]  # past validation: what a buggy caller could do
    got = run(engine, [("bad", prompts[1], broken, {}), *good_requests(prompts)])
    assert "many" in (got["bad"].error or "")
    assert_others_unharmed(engine, baseline, got, "bad")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_model_fault_over_one_request_is_isolated_by_rerun(tiny_engine, prompts, async_scheduling):
    baseline = run(tiny_engine(async_scheduling=async_scheduling), good_requests(prompts))
    engine = tiny_engine(async_scheduling=async_scheduling)
    engine.runner.model = PoisonedModel(engine.runner.model)
    got = run(engine, [*good_requests(prompts), ("bad", [POISON, *prompts[2]], GREEDY, {})])
    assert "poisoned token" in (got["bad"].error or "")
    assert got["bad"].output_token_ids == []
    assert_others_unharmed(engine, baseline, got, "bad")
    # the replica still serves: a later request runs as before
    again = run(engine, [("again", prompts[0], SEEDED, {})])
    assert again["again"].output_token_ids == baseline["ok-0"].output_token_ids


def test_async_engine_streams_the_error_and_the_others_finish(tiny_engine, prompts):
    baseline = run(tiny_engine(), good_requests(prompts))

    async def main():
        engine = AsyncLLMEngine(tiny_engine())
        try:
            calls = [engine.complete(rid, p, params) for rid, p, params, _ in good_requests(prompts)]
            calls.append(engine.complete("bad", prompts[0], GREEDY, grammar=FailingGrammar(2)))
            return await asyncio.gather(*calls)
        finally:
            engine.shutdown()

    *good, bad = asyncio.run(main())
    assert bad.finish_reason == "error" and "grammar matcher broke" in (bad.error or "")
    assert len(bad.output_token_ids) == 2
    assert [c.output_token_ids for c in good] == [baseline[c.request_id].output_token_ids for c in good]
    assert all(c.error is None and c.finish_reason == "length" for c in good)
