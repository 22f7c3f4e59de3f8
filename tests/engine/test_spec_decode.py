"""Speculative decoding: greedy output equals plain greedy output token for token (SmolLM2 real weights,
n-gram and the model drafting for itself; stop strings, stop tokens, max_tokens and min_tokens mid-draft,
logprobs, preemption); seeded sampling equals plain seeded sampling and its distribution passes a
chi-square test against plain sampling; the pieces (n-gram lookup, scheduler rollback, the confidence
choice, config checks) by hand."""

import logging
import math
from collections import Counter

import numpy as np
import pytest
import torch

from rayinfer.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.scheduler import Scheduler, SchedulerConfig
from rayinfer.engine.spec_decode import AcceptanceCalibrator, Draft, TokenBuffer, choose_num_drafts, ngram_lookup
from rayinfer.engine.types import Request, SampledToken, SamplingParams, StepOutput



@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: these models are small enough that threads only add barriers (and a second
    process on the machine turns them into spinning)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the pieces ------------------------------------------------------------------------------------


def scan_lookup(tokens, k, ngram_min, ngram_max):
    """Prompt lookup by comparing every window of the context with its suffix (the plain reference)."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= length]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start: start + k].tolist()
    return []


def test_ngram_lookup_equals_the_window_scan_at_every_length():
    """The candidate search returns the window scan's draft for every prefix of sequences with loops and
    repeats, for several k and n ranges; the token buffer gives the context array as it grows (and
    rebuilds when the tokens change)."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 5, 300), np.tile(rng.integers(0, 50, 7), 30), rng.integers(0, 1000, 200),
            np.concatenate([np.tile([1, 2, 3], 20), rng.integers(0, 3, 100)])]
    for seq in seqs:
        buffer = TokenBuffer()
        for length in range(1, len(seq) + 1):
            context = buffer.sync(seq[:length].tolist())
            assert np.array_equal(context, seq[:length])
            for (lo, hi), k in [((1, 4), 3), ((2, 3), 5), ((1, 1), 1)]:
                want = scan_lookup(seq[:length], k, lo, hi)
                assert ngram_lookup(context, k, lo, hi) == want, (length, lo, hi, k)
                assert buffer.ngram_lookup(k, lo, hi) == want, (length, lo, hi, k)  # the indexed fast path
    assert TokenBuffer().sync([]).size == 0
    buffer = TokenBuffer()
    buffer.sync([1, 2, 3, 4])
    assert buffer.sync([1, 2, 9]).tolist() == [1, 2, 9]  # shorter and changed: rebuilt
    split = TokenBuffer()  # a request's prompt and outputs, given apart
    for outputs in ([], [7], [7, 8, 9], list(range(7, 80))):
        assert split.sync([1, 2, 3], outputs).tolist() == [1, 2, 3, *outputs]
        assert split.positions == {t: [i] for i, t in enumerate([1, 2, 3, *outputs])}
    assert split.sync([1, 2, 3], [7, 5]).tolist() == [1, 2, 3, 7, 5]  # an output changed (shorter): rebuilt
    assert split.positions == {1: [0], 2: [1], 3: [2], 7: [3], 5: [4]}
    assert split.sync([1, 2, 3], [7, 5, 1, 2, 3]).tolist() == [1, 2, 3, 7, 5, 1, 2, 3]
    assert split.positions[1] == [0, 5] and split.ngram_lookup(2, 1, 3) == [7, 5]
    assert split.sync([1, 2, 3, 4, 5, 6, 7, 8, 9], [9]).tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 9]  # rebuilt, longer
    assert split.positions == {**{t: [t - 1] for t in range(1, 9)}, 9: [8, 9]}


def test_ngram_lookup_takes_the_longest_recurring_suffix():
    t = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7])
    assert ngram_lookup(t, 3, 1, 4) == [8, 9, 1]  # "5 6 7" recurs; what followed it
    assert ngram_lookup(t, 10, 1, 4) == [8, 9, 1, 5, 6, 7]  # cut at the end of the context
    assert ngram_lookup(np.array([1, 2, 3, 4]), 3, 1, 4) == []  # nothing recurs
    loop = np.array([3, 4, 3, 4, 3, 4])  # the latest occurrence followed by k tokens, not the last period
    assert ngram_lookup(loop, 2, 1, 2) == [3, 4]
    assert ngram_lookup(np.array([2, 9, 9, 2]), 2, 2, 2) == []  # only n=2 tried: "9 2" never recurs


def _decoding_request(sched: Scheduler, drafts: list[int], **params) -> Request:
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, **params))
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, StepOutput({"r": SampledToken(6)}))
    req.draft_token_ids = list(drafts)
    return req


def test_scheduler_verifies_drafts_in_one_step_and_rolls_back_the_rejected():
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16, max_model_len=64))
    req = _decoding_request(sched, [7, 8, 9], max_tokens=10)
    out = sched.schedule()
    [s] = out.scheduled
    assert s.token_ids == (6, 7, 8, 9) and s.start_pos == 5 and s.num_draft_tokens == 3 and s.needs_sample
    assert req.num_computed_tokens == 9 and req.draft_token_ids == []
    # drafts 7 and 8 accepted, 9 rejected: the target's token after 8 is 4
    step = StepOutput({"r": SampledToken(4)}, accepted={"r": [SampledToken(7), SampledToken(8)]})
    sched.update_from_output(out, step)
    assert req.output_token_ids == [6, 7, 8, 4]
    assert req.num_computed_tokens == 8  # 6, 7, 8 computed; the slot of 9 is written again next step
    [s] = sched.schedule().scheduled
    assert s.token_ids == (4,) and s.start_pos == 8


def test_scheduler_stops_mid_draft_and_caps_drafts_by_max_tokens_and_budget():
    sched = Scheduler(SchedulerConfig(block_size=4, num_blocks=16, max_model_len=64))
    req = _decoding_request(sched, [7, 8, 9, 10], max_tokens=4, stop_token_ids=[8])
    out = sched.schedule()
    assert out.scheduled[0].num_draft_tokens == 2  # 1 output + 2 drafts + 1 sampled = max_tokens
    step = StepOutput({"r": SampledToken(3)}, accepted={"r": [SampledToken(7), SampledToken(8)]})
    sched.update_from_output(out, step)
    assert req.output_token_ids == [6, 7, 8] and req.finish_reason == "stop" and req.stop_reason == 8
    assert step.tokens("r") == [SampledToken(7), SampledToken(8)]  # cut to what was appended
    small = Scheduler(SchedulerConfig(block_size=4, num_blocks=16, max_model_len=64, max_num_batched_tokens=5))
    _decoding_request(small, [7, 8, 9, 10, 11, 12], max_tokens=10)
    assert small.schedule().scheduled[0].num_draft_tokens == 4  # the token budget: 1 + 4 tokens


def test_choose_num_drafts_maximizes_expected_tokens_per_second():
    conf = torch.tensor([[0.9, 0.8, 0.1], [0.5, 0.2, 0.0]])
    # 2 requests, 2 tokens without drafts; a step costs 1 + 0.25 * tokens: rate 2/1.5 = 1.33 without drafts.
    # taking 0.9 -> 2.9/1.75 = 1.66; +0.8 -> 3.7/2 = 1.85; +0.5 -> 4.2/2.25 = 1.87; +0.2 -> 4.4/2.5 = 1.76
    assert choose_num_drafts(conf, 2, 2.0, 1.0, 0.25, 100, 0.0).tolist() == [2, 1]
    assert choose_num_drafts(conf, 2, 2.0, 1.0, 0.5, 100, 0.0).tolist() == [2, 0]  # 4.2/3.5 < 3.7/3
    assert choose_num_drafts(conf, 2, 2.0, 1.0, 0.25, 1, 0.0).tolist() == [1, 0]  # max_verify_tokens
    assert choose_num_drafts(conf, 2, 2.0, 1.0, 0.25, 100, 0.85).tolist() == [1, 0]  # min_confidence
    assert choose_num_drafts(conf, 2, 2.0, 0.0, 1.0, 100, 0.0).tolist() == [0, 0]  # drafts cost a token each


def test_speculation_gate_tries_both_modes_after_warm_up_and_keeps_buckets_apart():
    from rayinfer.engine.spec_decode import SpeculationGate

    gate = SpeculationGate(explore_fraction=0.1, decay=0.5, warmup_steps=2)
    assert gate.speculate(8)  # nothing measured: speculation first
    gate.record(True, 8, num_output_tokens=16, seconds=1.0)  # a mode's first steps (compiles): not measured
    assert gate.speculate(8)
    gate.record(True, 8, num_output_tokens=16, seconds=0.5)
    assert gate.speculate(8) and not gate.rates
    gate.record(True, 8, num_output_tokens=16, seconds=0.004)  # 4,000 tok/s
    for _ in range(2):
        assert not gate.speculate(8)  # then plain
        gate.record(False, 8, num_output_tokens=8, seconds=0.5)  # warm-up
    assert not gate.speculate(8)
    gate.record(False, 8, num_output_tokens=0, seconds=0.0002)  # pipelined: launched, nothing back yet
    gate.record(False, 8, num_output_tokens=16, seconds=0.0018)  # 16 tokens in 2 ms over the two: 8,000 tok/s
    assert gate.rates[(False, gate.bucket(8))] == pytest.approx(16 / (0.5 * 0.0002 + 0.0018), rel=1e-6)
    assert not gate.speculate(8)
    # tokens of a drafting step that came back in a plain call count for speculation
    gate.record(False, 8, num_output_tokens=8, seconds=0.001, other_tokens=24)
    assert gate.rates[(True, gate.bucket(8))] == pytest.approx(40 / 0.004)
    assert gate.speculate(1) and gate.speculate(16)  # other batch buckets have their own measurements
    for bad in (dict(explore_fraction=0.0), dict(explore_fraction=1.0), dict(decay=1.0), dict(explore_steps=0),
                dict(warmup_steps=-1), dict(switch_steps=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SpeculationGate(**bad)


def _run_gate(gate, num_steps, step, batch=8):
    """Drive ``gate`` on a fake clock: ``step(i, speculative)`` gives a step's (output tokens, seconds).
    Returns (tokens, seconds, picks)."""
    tokens = seconds = 0.0
    picks = []
    for i in range(num_steps):
        spec = gate.speculate(batch)
        n, s = step(i, spec)
        gate.record(spec, batch, n, s)
        tokens, seconds = tokens + n, seconds + s
        picks.append(spec)
    return tokens, seconds, picks


@pytest.mark.parametrize("spec_over_plain", [0.3, 0.6, 0.9, 0.97, 1.05, 1.3, 1.8])
@pytest.mark.parametrize("spec_step_cost", [1.5, 4.0, 10.0])
def test_speculation_gate_stays_within_its_regret_budget(spec_over_plain, spec_step_cost):
    """Whichever mode is faster and however much a drafting step costs, the gate's throughput stays within
    about explore_fraction (5%) of the faster mode's (the re-measurements' regret), warm-up included."""
    from rayinfer.engine.spec_decode import SpeculationGate

    plain_s, batch = 0.001, 8
    spec_s = plain_s * spec_step_cost
    spec_tokens = batch * spec_over_plain * spec_step_cost  # spec rate = spec_over_plain x plain's

    def step(i, spec):
        return (spec_tokens, spec_s) if spec else (batch, plain_s)

    tokens, seconds, picks = _run_gate(SpeculationGate(), 5000, step)
    best = max(batch / plain_s, spec_tokens / spec_s)
    assert tokens / seconds >= 0.95 * best, (tokens / seconds / best, sum(picks))


@pytest.mark.parametrize("spec_over_plain", [0.5, 0.9, 1.0, 1.1, 1.6])
def test_speculation_gate_pays_for_its_switches(spec_over_plain):
    """A switch of mode costs time of its own (a drained pipeline and its refill: here two plain steps'
    worth, on the step after each switch, where the engine measures it). Two modes measured close must
    not re-measure each other so often that the switches eat the budget: the gate stays within about 5%
    of the faster mode's throughput (at the 8B shape the switches of a confidence engine re-measuring
    n-gram every few steps took 25%)."""
    from rayinfer.engine.spec_decode import SpeculationGate

    plain_s, batch, switch_s = 0.001, 8, 0.002
    spec_s = 2 * plain_s
    last = [None]

    def step(i, spec):
        n, s = (batch * spec_over_plain * 2, spec_s) if spec else (batch, plain_s)
        if last[0] is not None and last[0] != spec:
            s += switch_s
        last[0] = spec
        return n, s

    tokens, seconds, picks = _run_gate(SpeculationGate(), 5000, step)
    best = max(batch / plain_s, batch * spec_over_plain * 2 / spec_s)
    switches = sum(a != b for a, b in zip(picks, picks[1:]))
    assert tokens / seconds >= 0.95 * best, (tokens / seconds / best, switches)


def test_speculation_gate_re_measures_close_modes_often_and_far_ones_rarely():
    from rayinfer.engine.spec_decode import SpeculationGate

    def explorations(spec_over_plain, **kw):
        gate = SpeculationGate(**kw)
        _run_gate(gate, 4000, lambda i, spec: (8 * 4 * spec_over_plain, 0.004) if spec else (8, 0.001))
        return gate.num_explore_steps

    close, far = explorations(0.95, switch_steps=0.0), explorations(0.3, switch_steps=0.0)
    # time-share would re-try a 4 ms drafting step every 80 ms for both; by regret the close one is re-tried
    # 14x as often (1 - 0.3) / (1 - 0.95)
    assert close >= 8 * far and far >= 4, (close, far)
    # the switches' own cost (two plain steps a re-measurement) spaces out the close one's re-measurements
    assert explorations(0.3) <= far and explorations(0.95) < close / 2


@pytest.mark.parametrize("first, then", [(1.6, 0.5), (0.5, 1.6)])
def test_speculation_gate_follows_a_change_of_acceptance_mid_run(first, then):
    """Acceptance changes mid-run (the text stops repeating, or starts): within a few hundred steps the
    gate takes the mode that is now faster, and its throughput is again within ~3% of that mode's."""
    from rayinfer.engine.spec_decode import SpeculationGate

    gate = SpeculationGate()
    rate = lambda i: first if i < 2000 else then  # spec's rate against plain's  # noqa: E731
    steps = []

    def step(i, spec):
        steps.append((32 * rate(i), 0.004) if spec else (8, 0.001))
        return steps[-1]

    _run_gate(gate, 3000, step)
    for lo, hi, r in ((1000, 2000, first), (2300, 3000, then)):
        tokens, seconds = (sum(x) for x in zip(*steps[lo:hi]))
        assert tokens / seconds >= 0.95 * 8000 * max(r, 1.0), (lo, tokens / seconds / 8000)


def test_speculation_gate_keeps_speculating_through_n_gram_steps_that_find_no_draft():
    """Batch 1 with n-gram drafts: four steps in ten find no draft (one token, in more time than a plain
    step: the proposer and a drained pipeline), the others accept 0..4 drafts; speculating always is 1.6x
    faster than plain. Noisy single samples must not keep the gate plain: it gets >= 90% of the gain."""
    import random

    from rayinfer.engine.spec_decode import SpeculationGate

    rng = random.Random(0)

    def step(i, spec):
        if not spec:
            return 1, 0.0013
        if rng.random() < 0.4:
            return 1, 0.0016
        return 1 + rng.choice([0, 2, 3, 4, 4, 4]), 0.0019

    always = [step(i, True) for i in range(20000)]
    spec_rate = sum(n for n, _ in always) / sum(s for _, s in always)
    assert spec_rate > 1.5 / 0.0013
    rng.seed(1)
    tokens, seconds, _ = _run_gate(SpeculationGate(), 4000, step, batch=1)
    assert tokens / seconds >= 0.9 * spec_rate, (tokens / seconds) / spec_rate


def _run_gate_with_drafts(gate, num_steps, drafts_found, notes=True, batch=8):
    """Drive ``gate`` through n-gram-like steps on a fake clock: at step i the lookup finds ``drafts_found(i)``
    drafts a request; a drafting step gives 1 + 1.1 x that many tokens a request in 1 + drafts/8 plain
    steps' time (plus half a plain step of lookup and drain). Drafting steps note what they found, and every
    8th plain step looks (the engine's DRAFT_LOOKUP_EVERY) when ``notes``. Returns per step (tokens, s)."""
    plain_s, out = 0.001, []
    for i in range(num_steps):
        spec, found = gate.speculate(batch), drafts_found(i)
        if notes and (spec or i % 8 == 0):
            gate.note_drafts(spec, batch, found)
        step = ((batch * (1 + 1.1 * found), plain_s * (1.5 + found / 8)) if spec else (batch, plain_s))
        gate.record(spec, batch, *step)
        out.append(step)
    return out


def test_speculation_gate_re_measures_speculation_when_drafts_turn_up():
    """Early in its output a request gives an n-gram lookup nothing to find (speculation measures 0.67x of
    plain), later it repeats its prompt (3.5 drafts a request, 2.2x). The plain steps' lookups see the drafts
    appear, and the gate re-measures speculation at once instead of after its regret schedule's pause: from
    10 steps after the change it runs at >= 90% of speculation's rate; without the lookups it is still plain."""
    from rayinfer.engine.spec_decode import SpeculationGate

    found = lambda i: 0.0 if i < 200 else 3.5  # noqa: E731
    spec_rate = 8 * (1 + 1.1 * 3.5) / (0.001 * (1.5 + 3.5 / 8))

    def window_rate(steps, lo, hi):
        tokens, seconds = (sum(x) for x in zip(*steps[lo:hi]))
        return tokens / seconds

    gate = SpeculationGate()
    steps = _run_gate_with_drafts(gate, 600, found)
    assert window_rate(steps, 210, 600) >= 0.9 * spec_rate and gate.num_draft_triggers == 1
    blind = SpeculationGate()  # here it re-measures 75 steps after the change (real runs: often never in 128)
    assert window_rate(_run_gate_with_drafts(blind, 600, found, notes=False), 210, 270) < 0.5 * spec_rate
    # drafts found as often as when speculation was measured, or speculation already the faster mode: no trigger
    same = SpeculationGate()
    _run_gate_with_drafts(same, 600, lambda i: 0.0)
    faster = SpeculationGate()
    _run_gate_with_drafts(faster, 600, lambda i: 3.5 if i < 200 else 4.0)
    assert same.num_draft_triggers == 0 and faster.num_draft_triggers == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["drained", "pipelined"])
def test_confidence_schedule_looks_for_n_gram_drafts_in_plain_steps(tiny_pair, tokenizer, async_scheduling):
    """With n-gram drafts (found or not depending on the text), every 8th plain decode step of the confidence
    schedule looks drafts up and tells the gate how many it found a request, as drafting steps do; the
    lookups change no output (greedy, seeded). A batch larger than DRAFT_LOOKUP_REQUESTS is sampled, every
    request in turn."""
    prompts = list(PROMPTS)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=5),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    plain = _tiny_spec_engine(tiny_pair, tokenizer, {}, async_scheduling=async_scheduling).generate(prompts, params)
    engine = _tiny_spec_engine(tiny_pair, tokenizer, dict(method="ngram", schedule="confidence"),
                               async_scheduling=async_scheduling)
    picks = []
    engine.gate.speculate = lambda batch_size: picks.append(len(picks) % 10 >= 8) or picks[-1]  # 8 plain, 2 drafting
    notes, note = [], engine.gate.note_drafts
    engine.gate.note_drafts = lambda spec, batch, found: notes.append((spec, batch, found)) or note(spec, batch, found)
    engine.DRAFT_LOOKUP_REQUESTS = 2  # of the 3 requests
    looked, look, propose, in_look = [], engine._look_for_drafts, engine.proposer.propose, []
    engine._look_for_drafts = lambda: (in_look.append(1), look(), in_look.pop())
    engine.proposer.propose = lambda reqs, ks: (looked.append([r.request_id for r in reqs]) if in_look else None,
                                                propose(reqs, ks))[1]
    _check_same(engine.generate(prompts, params), plain)
    assert looked and all(len(ids) == 2 for ids in looked), looked
    assert len({i for ids in looked for i in ids}) == 3, looked  # in turn: each request's drafts counted
    plain_notes = [n for n in notes if not n[0]]
    assert len(plain_notes) == picks.count(False) // 8 and len(plain_notes) >= 3, (len(plain_notes), picks.count(False))
    assert all(b == 3 for _, b, _ in notes) and max(f for _, _, f in plain_notes) > 0
    assert any(spec for spec, _, _ in notes)
    assert engine.stats()["spec_gate_draft_triggers"] == engine.gate.num_draft_triggers


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["drained", "pipelined"])
def test_confidence_schedule_stops_speculating_where_it_loses(tiny_pair, tokenizer, async_scheduling):
    """A proposer that costs 30 ms a step makes speculation slower than plain decoding: the gate keeps
    the decode steps plain and calls the proposer only to re-measure; greedy output is unchanged. With
    pipelined scheduling the plain steps run pipelined (launched while the previous one is in flight)
    and drafting steps drain the pipeline first."""
    import time as _time

    prompts = list(PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = _tiny_spec_engine(tiny_pair, tokenizer, {}).generate(prompts, params)

    def slow_engine(spec):
        engine = _tiny_spec_engine(tiny_pair, tokenizer, spec, async_scheduling=async_scheduling)
        propose, calls, overlapped = engine.proposer.propose, [], []
        engine.proposer.propose = lambda reqs, ks: (calls.append(len(reqs)), _time.sleep(0.03), propose(reqs, ks))[2]
        execute = engine.runner.execute_async
        # pipelined: a step is launched with the previous one still in flight (its tokens as placeholders)
        engine.runner.execute_async = lambda sched, reqs, prev=None: (overlapped.append(prev is not None),
                                                                      execute(sched, reqs, prev))[1]
        return engine, calls, overlapped

    engine, calls, overlapped = slow_engine(dict(method="ngram", schedule="confidence"))
    assert engine.async_scheduling is async_scheduling
    lookups, note = [], engine.gate.note_drafts
    engine.gate.note_drafts = lambda spec, *a: (lookups.append(0) if not spec else None, note(spec, *a))[1]
    assert [c.output_token_ids for c in engine.generate(prompts, params)] == [c.output_token_ids for c in plain]
    # it measured speculation (a warm-up step, dropped, and a timed one), then re-tried it at most once per
    # 0.6 s of plain steps (30 ms / explore_fraction 0.05); the plain steps' draft lookups (n-gram's drafts
    # vary with the text) take at most 5% of the time: the first, then none for 0.6 s. A lookup that finds
    # more drafts than the measured drafting steps did has speculation re-measured (explore_steps steps).
    triggers = engine.gate.num_draft_triggers
    assert 1 <= len(lookups) <= 2 and triggers <= 1, (calls, lookups)
    assert 2 <= len(calls) - len(lookups) <= 4 + triggers * engine.gate.explore_steps, (calls, lookups)
    assert engine.stats()["num_spec_gated_steps"] >= 30
    assert (sum(overlapped) > 20) is async_scheduling
    fixed, fixed_calls, _ = slow_engine(dict(method="ngram"))  # fixed-k always speculates (and drains)
    assert fixed.async_scheduling is False
    assert [c.output_token_ids for c in fixed.generate(prompts, params)] == [c.output_token_ids for c in plain]
    assert len(fixed_calls) > 30 and fixed.stats()["num_spec_gated_steps"] == 0


@pytest.mark.parametrize("spec", [dict(method="ngram", schedule="confidence"),
                                  dict(method="draft_model", schedule="confidence")], ids=["ngram", "draft"])
def test_pipelined_confidence_schedule_keeps_greedy_and_seeded_output(tiny_pair, tokenizer, spec):
    prompts = list(PROMPTS)
    for params in (SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)):
        plain = _tiny_spec_engine(tiny_pair, tokenizer, {}).generate(prompts, params)
        engine = _tiny_spec_engine(tiny_pair, tokenizer, spec, async_scheduling=True)
        turns = iter(range(10**6))
        engine.gate.speculate = lambda batch_size: next(turns) % 3 == 0  # drafting steps between pipelined ones
        got = engine.generate(prompts, params)
        assert engine.stats()["spec_num_drafts_verified"] > 0
        assert [c.output_token_ids for c in got] == [c.output_token_ids for c in plain]


def _simulate_device_wait(engine, seconds: float) -> None:
    """A simulated device on CPU: each decode step's tokens wait ``seconds`` where the engine processes them (a
    GPU would still be running the step there), so a pipelined step's wait lands in the call after its launch."""
    import time as _time

    process = engine._process

    def device_wait(sched, launched_step, step_reqs):
        if sched.scheduled and all(len(s.token_ids) == 1 for s in sched.scheduled):
            _time.sleep(seconds)
        return process(sched, launched_step, step_reqs)

    engine._process = device_wait


def test_gate_credits_tokens_to_the_mode_that_computed_them(tiny_pair, tokenizer):
    """Pipelined: a drafting step that found no draft is left in flight and its tokens come back in the next
    call; they count for speculation, not for the plain step of that call (they once did, so n-gram steps
    without drafts measured as zero-token drafting steps and plain looked faster than it was). So does the
    wait for that step (here 10 ms a decode step, as a sleep where its tokens are processed: the device still
    runs it): it once counted for the plain call, and plain steps measured 17.6 ms against drafting's 3.4 ms
    for the same forward."""
    prompts = list(PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = _tiny_spec_engine(tiny_pair, tokenizer, {}).generate(prompts, params)
    engine = _tiny_spec_engine(tiny_pair, tokenizer, dict(method="ngram", schedule="confidence"),
                               async_scheduling=True)
    engine.proposer.propose = lambda reqs, ks: [Draft() for _ in reqs]  # never finds a draft
    turns, mode = iter(range(10**6)), []
    engine.gate.speculate = lambda batch_size: (mode.append(next(turns) % 3 == 0), mode[-1])[1]
    launched = {True: 0, False: 0}  # decode tokens launched per mode
    execute = engine.runner.execute_async

    def counting_execute(sched, reqs, prev=None):
        if all(len(s.token_ids) == 1 for s in sched.scheduled) and sched.scheduled:
            launched[mode[-1]] += len(sched.scheduled)
        return execute(sched, reqs, prev)

    engine.runner.execute_async = counting_execute
    credited, credited_s = {True: 0, False: 0}, {True: 0.0, False: 0.0}
    record = engine.gate.record

    def spy(speculative, batch_size, num_output_tokens, seconds, other_tokens=0, other_seconds=0.0):
        credited[speculative] += num_output_tokens
        credited[not speculative] += other_tokens
        credited_s[speculative] += seconds
        credited_s[not speculative] += other_seconds
        record(speculative, batch_size, num_output_tokens, seconds, other_tokens, other_seconds)

    engine.gate.record = spy
    _simulate_device_wait(engine, 0.01)
    fitted = []  # (drafting step, tokens) of the steps the per-draft schedule's StepTimeModel fits
    update = engine.step_time.update
    engine.step_time.update = lambda n, secs: (fitted.append((bool(mode) and mode[-1], n)), update(n, secs))[1]
    got = engine.generate(prompts, params)
    assert [c.output_token_ids for c in got] == [c.output_token_ids for c in plain]
    assert launched[True] >= 20
    # the last decode step's tokens come back in a call that schedules nothing (not measured)
    assert launched[True] - len(prompts) <= credited[True] <= launched[True], (launched, credited)
    assert launched[False] - len(prompts) <= credited[False] <= launched[False], (launched, credited)
    # the same forward, the same sleep: about the same seconds a step (plain's were 1.5x drafting's before)
    per_step = {m: credited_s[m] / (launched[m] / len(prompts)) for m in (True, False)}
    assert 0.75 < per_step[False] / per_step[True] < 1.3, per_step
    # pipelined plain decode steps are not fitted (a call there overlaps two steps): only drafting and
    # prefill steps are
    assert any(spec for spec, _ in fitted) and all(spec or n > len(prompts) for spec, n in fitted), fitted


@pytest.mark.parametrize("pattern", [(4, 4), (1, 1), (2, 7)], ids=["4-4", "1-1", "2-7"])
@pytest.mark.parametrize("proposer", ["draft_model", "mtp"])
def test_chained_confidence_engine_switching_to_plain_keeps_output(mtp_checkpoint, tiny_pair, tokenizer, proposer,
                                                                   pattern):
    """A verification step is left in flight (chained); when the gate turns to plain, it is processed before the
    plain step is planned: its rejected drafts roll the requests back, and a step planned before that started
    past them (greedy output differed from plain decoding's whenever the gate switched; the confidence schedule
    chains since 41044d3). Its wait (here 30 ms a verification, as a sleep) and its tokens count for
    speculation, not for the plain call: plain steps once measured several times slower than they run."""
    import time as _time

    drafting, plain_steps = pattern
    prompts = list(PROMPTS)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=27, ignore_eos=True, seed=5),
              SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)]
    spec = dict(method=proposer, schedule="confidence", num_draft_tokens=3)
    kw = dict(async_scheduling=True, debug_eager_graphs=True)
    if proposer == "mtp":
        path = mtp_checkpoint[0]
        want = _mtp_engine(path, tokenizer).generate(prompts, params)
        engine = _mtp_engine(path, tokenizer, spec, **kw)
    else:
        want = _tiny_spec_engine(tiny_pair, tokenizer, {}).generate(prompts, params)
        engine = _tiny_spec_engine(tiny_pair, tokenizer, spec, **kw)
    assert engine.chain_verification
    picks = []
    engine.gate.speculate = lambda batch_size: (picks.append(len(picks) % (drafting + plain_steps) < drafting)
                                                or picks[-1])
    engine.step_time.update = lambda *a: None  # every draft verified (the fixed step-time model's choice)
    process = engine._process

    def slow_verification(sched, launched, step_reqs):
        if any(s.num_draft_tokens for s in sched.scheduled):
            _time.sleep(0.03)  # the device still runs the verification step
        return process(sched, launched, step_reqs)

    engine._process = slow_verification
    records, record = [], engine.gate.record
    engine.gate.record = lambda spec_, batch, n, secs, **kw: (records.append((spec_, n, secs, kw)),
                                                               record(spec_, batch, n, secs, **kw))[1]
    _check_same(engine.generate(prompts, params), want)
    # a verification step is left in flight even when the next one does not chain (one drafting step at a time)
    assert (engine.stats()["spec_chained_steps"] > 0) is (drafting > 1) and picks.count(False) >= 3
    plain_records = [r for r in records if not r[0]]
    assert plain_records and any(r[0] and r[2] >= 0.03 for r in records), records
    assert max(secs for _, _, secs, _ in plain_records) < 0.025, plain_records


def test_gate_keeps_decoding_plain_where_drafting_steps_verify_nothing(tiny_pair, tokenizer):
    """Pipelined, with a simulated device (10 ms a decode step, waited for where its tokens are processed) and a
    proposer that takes 2 ms and never finds a draft: a drafting step is a drained plain step plus the lookup,
    so plain decoding is faster and the gate keeps most steps plain. When the wait for a drafting step in flight
    counted for the plain call after it, plain measured slower and the gate drafted in 65 of 80 steps (as it did
    at the Llama-3-8B shape on the H100, 98 of 132, with n-gram drafts it never accepted)."""
    import time as _time

    prompts = list(PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    plain = _tiny_spec_engine(tiny_pair, tokenizer, {}).generate(prompts, params)
    engine = _tiny_spec_engine(tiny_pair, tokenizer, dict(method="ngram", schedule="confidence"),
                               async_scheduling=True)
    engine.proposer.propose = lambda reqs, ks: (_time.sleep(0.002), [Draft() for _ in reqs])[1]
    _simulate_device_wait(engine, 0.01)
    _check_same(engine.generate(prompts, params), plain)
    gate = engine.gate
    assert gate.num_plain_steps >= 3 * gate.num_drafting_steps, (gate.num_plain_steps, gate.num_drafting_steps,
                                                                 gate.rates)


def test_gate_times_a_step_up_to_the_next_call(tiny_pair, tokenizer):
    """A decode call is measured up to the next call (the caller's work on its outputs is part of a step's
    cost, and speculation saves it by taking fewer steps), a gap longer than the call counting as the
    call's length (the caller idled); a refill of the pipeline is charged to speculation; a call that processed
    a pipelined step of the other mode gives that mode the processing, the caller's work and the tokens."""
    engine = _tiny_spec_engine(tiny_pair, tokenizer, dict(method="ngram", schedule="confidence"))
    got = []
    engine.gate.record = lambda *args, **kw: got.append(("record", args, kw))
    engine.gate.charge = lambda *args: got.append(("charge", args))
    engine._gate_sample = (False, 4, 3, 0, None, False, 10.0, 10.010)  # a plain call of 10 ms
    engine._flush_gate_sample(10.013)  # the caller took 3 ms
    engine._flush_gate_sample(10.5)  # nothing pending: nothing recorded
    engine._gate_sample = (True, 4, 12, 0, None, False, 20.0, 20.010)
    engine._flush_gate_sample(25.0)  # idle for 5 s: counts as 10 ms
    engine._gate_sample = (False, 4, 0, 0, None, True, 30.0, 30.002)
    engine._flush_gate_sample(30.003)
    # a plain call of 10 ms, 8 of them processing a drafting step in flight (its 4 tokens), then the caller's 2 ms
    engine._gate_sample = (False, 4, 0, 4, 0.008, False, 40.0, 40.010)
    engine._flush_gate_sample(40.012)
    assert [(kind, args[:-1]) for kind, args, *_ in got] == [
        ("record", (False, 4, 3)), ("record", (True, 4, 12)), ("charge", (True, 4)), ("record", (True, 4, 4))]
    assert [g[1][-1] for g in got] == pytest.approx([0.013, 0.020, 0.003, 0.010])
    assert got[0][2] == {} and got[3][2] == {"other_tokens": 0, "other_seconds": pytest.approx(0.002)}


def test_calibrator_learns_acceptance_from_verifications():
    cal = AcceptanceCalibrator(max_drafts=3)
    d = Draft([1, 2], probs=[0.05, 0.05])  # a flat drafter whose drafts are nonetheless always accepted
    assert cal.confidence(d) == pytest.approx([0.5, 0.25])
    for _ in range(18):
        cal.record(d.probs, 2, 2)
    assert cal.confidence(d) == pytest.approx([37 / 38, (37 / 38) ** 2])
    n = Draft([1, 2, 3])  # no probabilities: per position
    cal.record(None, 3, 0)  # only the first draft was observed (rejected)
    assert cal.confidence(n) == pytest.approx([1 / 3, 1 / 6, 1 / 12])


def test_speculative_config_errors_name_the_field():
    with pytest.raises(ValueError, match="speculative.method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeConfig(method="ngram", num_draft_tokens=0)
    with pytest.raises(ValueError, match="schedule"):
        SpeculativeConfig(method="ngram", schedule="adaptive")
    with pytest.raises(ValueError, match="draft_model is set"):
        SpeculativeConfig(method="ngram", draft_model="SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="schedule is set but method is 'none'"):  # else it would do nothing
        SpeculativeConfig(schedule="confidence")
    with pytest.raises(ValueError, match="ngram_on_device is set but method"):
        SpeculativeConfig(ngram_on_device=True)
    with pytest.raises(ValueError, match="prefill"):
        EngineConfig(role="prefill", speculative=SpeculativeConfig(method="ngram"))
    assert EngineConfig(speculative={"method": "ngram"}).speculative.method == "ngram"  # as Hydra passes it


# -- greedy equality on SmolLM2 (real weights) ------------------------------------------------------

REPEAT = ("Repeat this text exactly.\nText: The cat sat on the mat. The dog lay by the door. The bird sang in the "
          "tree, and the sun rose over the quiet hills.\nRepeated: The cat sat on the mat.")


@pytest.fixture(scope="module")
def smollm(tokenizer):
    """``make(**engine_kw)`` -> an engine over one float32 SmolLM2-135M (loaded once)."""
    base = {}

    def make(spec=None, **kw):
        cfg = dict(device="cpu", block_size=8, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=256,
                   async_scheduling=False)
        cfg.update(kw)
        engine_config = EngineConfig(**cfg, speculative=SpeculativeConfig(**(spec or {})))
        if "model" not in base:
            engine = LLMEngine(ModelConfig(dtype="float32"), engine_config)
            base["model"] = engine.model
            return engine
        return LLMEngine(ModelConfig(dtype="float32"), engine_config, model=base["model"], tokenizer=tokenizer)

    return make


@pytest.fixture(scope="module")
def greedy_cases(smollm, tokenizer):
    """(prompts, params, plain completions): the repeat prompt free with logprobs, then with a stop
    string, a stop token from the middle of its plain output, and min_tokens past another stop token;
    an odd max_tokens."""
    prompts = [tokenizer.encode(REPEAT), tokenizer.encode("1, 2, 3, 4, 5, 6,")]
    free = SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True, logprobs=1)
    plain = smollm().generate(prompts, free)
    words, ids = plain[0].text.split(), plain[0].output_token_ids
    mid = next(i for i in range(6, len(ids)) if ids[i] not in ids[:i])  # a token first seen mid-output
    cases = [(prompts[0], free), (prompts[1], free),
             (prompts[0], SamplingParams(temperature=0.0, max_tokens=19, stop=[" ".join(words[3:5])])),
             (prompts[0], SamplingParams(temperature=0.0, max_tokens=19, stop_token_ids=[ids[mid]])),
             (prompts[1], SamplingParams(temperature=0.0, max_tokens=13, min_tokens=11, stop_token_ids=[11]))]
    ps, params = [c[0] for c in cases], [c[1] for c in cases]
    return ps, params, plain[:2] + smollm().generate(ps[2:], params[2:])


def _check_same(got, want):
    for g, w in zip(got, want):
        assert g.error is None, g.error
        assert g.output_token_ids == w.output_token_ids, g.request_id
        assert (g.text, g.finish_reason, g.stop_reason) == (w.text, w.finish_reason, w.stop_reason)
        if w.logprobs is not None:
            assert g.logprobs is not None and len(g.logprobs) == len(w.logprobs)
            for a, b in zip(g.logprobs, w.logprobs):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-3)
                assert (a.top_logprobs or {}).keys() == (b.top_logprobs or {}).keys()


@pytest.mark.parametrize("spec", [dict(method="ngram"), dict(method="draft_model", num_draft_tokens=3)],
                         ids=["ngram", "self-draft"])
def test_greedy_speculative_output_equals_plain(smollm, greedy_cases, spec):
    prompts, params, plain = greedy_cases
    assert [c.finish_reason for c in plain[2:]] == ["stop", "stop", "length"]  # they do stop mid-output
    assert len(plain[2].output_token_ids) < 19 and len(plain[3].output_token_ids) < 19
    engine = smollm(spec)
    _check_same(engine.generate(prompts, params), plain)
    stats = engine.stats()
    assert stats["spec_num_drafts_verified"] > 0 and stats["spec_num_drafts_accepted"] > 0
    if spec["method"] == "draft_model":  # drafting for itself: every draft is accepted
        assert stats["spec_num_drafts_accepted"] == stats["spec_num_drafts_verified"]
        assert stats["spec_acceptance_by_position"] == [1.0, 1.0, 1.0]


# -- sampling: token-for-token reproducible, and the distribution ----------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tokenizer):
    """(target, draft): a 2-layer random Llama over the first 64 token ids (so that sampling many
    requests is cheap on CPU) and a copy with its weights perturbed by ~10%, whose greedy drafts the
    target sometimes accepts and sometimes rejects."""
    import copy

    import transformers

    from rayinfer.model.llama import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                                   architectures=["LlamaForCausalLM"])
    target = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(0)
    for p in target.parameters():
        if p.dim() > 1:
            p.data.normal_(0, 0.3, generator=gen)
    target = target.eval().requires_grad_(False)
    draft = copy.deepcopy(target)
    for p in draft.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.1)
    return target, draft


PROMPTS = ([5, 9, 11, 5, 9, 11, 5, 9], [3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2, 7, 7, 2, 7])


def _tiny_spec_engine(tiny_pair, tokenizer, spec, num_kv_blocks=1024, async_scheduling=False, gate=True, **kw):
    """``gate=False``: the confidence schedule always drafts (its SpeculationGate would turn speculation
    off on this tiny model, where plain decode steps are faster). ``kw``: more engine settings."""
    from rayinfer.engine.spec_decode import DraftModelProposer

    target, draft = tiny_pair
    cfg = dict(device="cpu", block_size=4, num_kv_blocks=num_kv_blocks, max_num_seqs=128, max_num_batched_tokens=2048,
               async_scheduling=async_scheduling, speculative=SpeculativeConfig(**spec))
    engine = LLMEngine(ModelConfig("tiny-llama", max_model_len=512), EngineConfig(**{**cfg, **kw}), model=target,
                       tokenizer=tokenizer)
    if spec.get("method") == "draft_model":  # draft with the perturbed copy instead of the target itself
        engine.proposer = DraftModelProposer(draft, 1024, 4, engine.vocab_size)
        if engine.engine_config.speculative.device_drafts:  # as the engine set up the one it built
            engine.proposer.enable_device_drafts(engine.max_model_len, 128, engine.engine_config.speculative.num_draft_tokens)
    if not gate:
        engine.gate.speculate = lambda batch_size: True
    return engine


@pytest.mark.parametrize("spec", [dict(method="ngram", schedule="confidence"),
                                  dict(method="draft_model", schedule="confidence")], ids=["ngram", "draft"])
def test_confidence_schedule_keeps_greedy_output(tiny_pair, tokenizer, spec):
    prompts = list(PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _tiny_spec_engine(tiny_pair, tokenizer, {}).generate(prompts, params)
    engine = _tiny_spec_engine(tiny_pair, tokenizer, spec, gate=False)
    assert [c.output_token_ids for c in engine.generate(prompts, params)] == [c.output_token_ids for c in plain]
    stats = engine.stats()
    assert 0 < stats["spec_num_drafts_verified"] <= stats["spec_num_drafts_proposed"]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_verification_and_draft_steps_through_graph_buffers(tiny_pair, tokenizer, method):
    """The CUDA-graph path of speculative steps (engine/cuda_graph.py ``run_ragged``), replayed eagerly on
    the CPU: verification steps and the draft model's steps padded per request to their longest query
    (confidence-scheduled, so widths vary) and to a captured batch size (3 requests in a graph of 4);
    greedy and seeded outputs equal plain decoding."""
    from rayinfer.engine.cuda_graph import DecodeGraphs

    prompts = list(PROMPTS)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=23, ignore_eos=True, seed=5),
              SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True, logprobs=0)]
    plain = _tiny_spec_engine(tiny_pair, tokenizer, {}).generate(prompts, params)
    engine = _tiny_spec_engine(tiny_pair, tokenizer, dict(method=method, schedule="confidence", num_draft_tokens=3),
                               gate=False)
    replays = []

    def counted(graphs):
        run = graphs.run

        def wrapper(*args, query_len=1, **kw):
            replays.append((graphs is engine.runner.graphs, args[3].shape[0], query_len))
            return run(*args, query_len=query_len, **kw)
        graphs.run = wrapper
        return graphs

    runner = engine.runner
    runner.graphs = counted(DecodeGraphs(runner.model, runner.kv_cache, runner.block_size, 512, 4, max_query_len=4, eager=True))
    if method == "draft_model":
        prop = engine.proposer
        prop.graphs = counted(DecodeGraphs(prop.model, prop.cache.kv_cache, prop.cache.block_size, 512, 4,
                                           max_query_len=4, eager=True))
    _check_same(engine.generate(prompts, params), plain)
    verify = [r for r in replays if r[0] and r[2] > 1]
    assert verify and any(n == 3 for _, n, _ in verify), replays  # 3 requests padded to a graph of 4
    assert len({q for _, _, q in verify}) > 1, "every verification had the same width"
    if method == "draft_model":
        assert any(not mine and q == 1 for mine, _, q in replays)  # one-token draft steps
    assert engine.stats()["spec_num_drafts_accepted"] > 0


@pytest.mark.parametrize("query_lens", [[3], [7, 1, 12], [30, 2], [5, 5, 6, 1], [17]])
def test_catch_up_rounds_feed_every_token_once_and_end_together(tiny_pair, query_lens):
    """A catch-up longer than the captured widths runs as replays of the widest: each request's tokens are
    fed once, in order, none more than the width a replay, and the last replay holds every request."""
    from rayinfer.engine.cuda_graph import DecodeGraphs

    model = tiny_pair[1]
    kv = torch.zeros(model.kv_cache_shape(64, 4))
    graphs = DecodeGraphs(model, kv, 4, 512, 4, max_query_len=3, eager=True, catch_up_len=6)
    assert graphs.query_lens() == [1, 2, 3, 6] and graphs.catch_up_sizes == [1, 2, 4]
    seq_lens = [q + 10 for q in query_lens]
    rounds = graphs.catch_up_rounds(query_lens, seq_lens)
    assert rounds is not None
    fed = [sum(r[i] for r in rounds) for i in range(len(query_lens))]
    last = [q - f for q, f in zip(query_lens, fed)]
    assert all(1 <= n <= 6 for n in last) and all(0 <= t <= 6 for r in rounds for t in r)
    assert len(rounds) == max(0, -(-max(query_lens) // 6) - 1)
    assert graphs.ragged_width(last, seq_lens) == (6 if max(last) > 3 else max(last))
    assert graphs.catch_up_rounds([100], [110]) is None  # 17 replays: one eager forward instead
    wide = DecodeGraphs(model, kv, 4, 512, 8, max_query_len=3, eager=True, catch_up_len=6, max_catch_up_tokens=24)
    assert wide.catch_up_sizes == [1, 2, 4] and wide.ragged_width([5] * 8, [20] * 8) is None
    model.max_graph_query_len = 5  # as MLA models cap it: no catch-up graphs past the cap
    try:
        capped = DecodeGraphs(model, kv, 4, 512, 4, max_query_len=3, eager=True, catch_up_len=6)
    finally:
        del model.max_graph_query_len
    assert capped.query_lens() == [1, 2, 3] and capped.catch_up_rounds([7], [17]) is None  # one eager forward
    assert capped.catch_up_rounds([3, 1], [13, 11]) == []  # a verification's width: one replay


@pytest.mark.parametrize("path", ["graphs", "eager-bounded"])
def test_draft_model_catches_up_on_plain_steps_in_rounds(tiny_pair, tokenizer, path):
    """The confidence schedule's plain steps leave the draft model behind; back to drafting, it catches up in
    rounds: replays of its widest graph (eagerly on CPU, same buffers), or eager forwards of at most
    ``max_catch_up_tokens`` rows. Greedy and seeded output equal plain decoding's, catch-ups longer than one
    round occurred, and the drafts equal those of one unbounded eager catch-up forward."""
    from rayinfer.engine.cuda_graph import DecodeGraphs

    prompts = list(PROMPTS)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=37, ignore_eos=True, seed=5),
              SamplingParams(temperature=0.0, max_tokens=35, ignore_eos=True, logprobs=0)]
    plain = _tiny_spec_engine(tiny_pair, tokenizer, {}).generate(prompts, params)
    spec = dict(method="draft_model", schedule="confidence", num_draft_tokens=3)
    engine = _tiny_spec_engine(tiny_pair, tokenizer, spec)
    calls = []
    engine.gate.speculate = lambda batch_size: len(calls.append(0) or calls) % 12 >= 9  # 9 plain, then 3 drafting
    engine.step_time.update = lambda *a: None  # drafts verified by the fixed step-time model, not by the clock
    prop = engine.proposer
    rows_per_forward, widths, plans = [], [], []
    if path == "graphs":
        prop.graphs = DecodeGraphs(prop.model, prop.cache.kv_cache, prop.cache.block_size, 512, 4, max_query_len=4,
                                   eager=True, catch_up_len=6)
        plan, run_ragged = prop.graphs.catch_up_rounds, prop.graphs.run_ragged
        prop.graphs.catch_up_rounds = lambda *a, **kw: plans.append(plan(*a, **kw)) or plans[-1]
        prop.graphs.run_ragged = lambda *a: widths.append(a[-1]) or run_ragged(*a)
    else:
        prop.max_catch_up_tokens = 5
        forward = prop._forward
        prop._forward = lambda ids, lens, *a: rows_per_forward.append(sum(lens)) or forward(ids, lens, *a)
    drafts = _recorded_drafts(prop)
    _check_same(engine.generate(prompts, params), plain)
    if path == "graphs":
        assert any(p for p in plans), plans  # some catch-up took more than one replay
        assert None not in plans and 6 in widths
    else:
        assert max(rows_per_forward) <= 5 and rows_per_forward.count(5) > 3, rows_per_forward
    assert engine.stats()["spec_num_drafts_accepted"] > 0
    # the same drafts as one unbounded eager catch-up forward makes
    eager = _tiny_spec_engine(tiny_pair, tokenizer, spec)
    calls.clear()
    eager.gate.speculate, eager.step_time.update = engine.gate.speculate, engine.step_time.update
    want = _recorded_drafts(eager.proposer)
    eager.generate(prompts, params)
    assert drafts == want and len(drafts) > 10


def _recorded_drafts(prop) -> list:
    """Every draft ``prop.propose`` makes from now on, in order (token ids)."""
    out, propose = [], prop.propose
    prop.propose = lambda reqs, ks: [out.append(d.token_ids) or d for d in propose(reqs, ks)]
    return out


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_and_seeded_output_under_preemption(tiny_pair, tokenizer, method):
    prompts = list(PROMPTS)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["zzzz"]),
              SamplingParams(temperature=0.8, max_tokens=23, ignore_eos=True, seed=5),
              SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True, logprobs=0)]
    plain = _tiny_spec_engine(tiny_pair, tokenizer, {}).generate(prompts, params)
    engine = _tiny_spec_engine(tiny_pair, tokenizer, dict(method=method), num_kv_blocks=16)
    _check_same(engine.generate(prompts, params), plain)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_drafts_accepted"] > 0


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.001 quantile of chi-square(df) (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_seeded_speculative_sampling_equals_plain_and_its_distribution_matches(tiny_pair, tokenizer):
    prompt = list(PROMPTS[1])
    num = 400
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True, seed=s) for s in range(num)]
    spec_engine = _tiny_spec_engine(tiny_pair, tokenizer, dict(method="draft_model", num_draft_tokens=3))
    spec = spec_engine.generate([prompt] * num, params)
    stats = spec_engine.stats()
    assert 0.1 < stats["spec_acceptance_rate"] < 0.9, stats  # both the accept and the residual paths ran
    plain = _tiny_spec_engine(tiny_pair, tokenizer, {}).generate([prompt] * num, params)
    # the coupled rule: the same seed draws the same tokens as plain sampling, whatever was drafted
    assert [c.output_token_ids for c in spec] == [c.output_token_ids for c in plain]
    # the distribution, against plain sampling with other seeds: a two-sample chi-square per position
    other = [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True, seed=10_000 + s)
             for s in range(num)]
    plain2 = _tiny_spec_engine(tiny_pair, tokenizer, {}).generate([prompt] * num, other)
    for pos in (1, 2, 3):
        a = Counter(c.output_token_ids[pos] for c in spec)
        b = Counter(c.output_token_ids[pos] for c in plain2)
        tokens = [t for t in set(a) | set(b) if a[t] + b[t] >= 5]
        stat = sum((a[t] - b[t]) ** 2 / (a[t] + b[t]) for t in tokens)  # equal sample sizes
        assert len(tokens) >= 3 and stat < _chi_square_critical(len(tokens) - 1), (pos, stat, a, b)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_decode_role_verifies_drafts_after_a_kv_import(tiny_pair, tokenizer, method):
    import dataclasses

    target = tiny_pair[0]

    def engine(role, spec=None):
        return LLMEngine(ModelConfig("tiny", max_model_len=512),
                         EngineConfig(device="cpu", block_size=4, num_kv_blocks=64, role=role,
                                      speculative=SpeculativeConfig(**(spec or {}))),
                         model=target, tokenizer=tokenizer)

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = list(PROMPTS)
    want = [c.output_token_ids for c in engine("normal").generate(prompts, params)]
    prefill, decode = engine("prefill"), engine("decode", dict(method=method))
    for i, p in enumerate(prompts):
        prefill.add_request(str(i), p, params)
    got = {}
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            assert out.finish_reason == "prefilled"
            handle = dataclasses.replace(out.kv_handle, payload=prefill.take_kv(out.request_id))
            got[out.request_id] = list(out.new_token_ids)
            decode.add_request(out.request_id, prompts[int(out.request_id)], params, kv_handle=handle,
                               output_token_ids=list(out.new_token_ids))
    while decode.has_unfinished_requests():
        for out in decode.step():
            got[out.request_id] += out.new_token_ids
    assert [got[str(i)] for i in range(len(prompts))] == want
    assert decode.stats()["spec_num_drafts_accepted"] > 0


# -- MTP: DeepSeek-V3's multi-token-prediction module drafts (tiny random checkpoint) ---------------


def _tiny_deepseek_config():
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
        q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16, n_group=4, topk_group=2,
        num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=256, num_nextn_predict_layers=1, eos_token_id=127,
        architectures=["DeepseekV3ForCausalLM"])


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """(directory, its tensors): a tiny random DeepSeek-V3 whose checkpoint has its MTP layer as released
    checkpoints store it (decoder layer ``num_hidden_layers``, per-expert names, copies of the embedding
    and LM head). The MTP module nearly passes the target's hidden state through (its block's outputs
    scaled down), so it drafts roughly "the target's next token repeats": drafts are accepted and
    rejected at every position."""
    from safetensors.torch import save_file

    from rayinfer.model.deepseek_v3 import DeepseekV3ForCausalLM

    cfg = _tiny_deepseek_config()
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg, enable_mtp=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
        for name, p in model.mtp[0].named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.01 * torch.randn_like(p))  # norms
            elif name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
                p.mul_(0.05)
        model.mtp[0].eh_proj.weight.copy_(torch.cat([0.02 * torch.randn(64, 64), torch.eye(64)], dim=1))
    inter, n, tensors = cfg.moe_intermediate_size, cfg.num_hidden_layers, {}
    for name, t in model.state_dict().items():
        if not name.startswith("mtp.0."):
            tensors[name] = t
            continue
        name = f"model.layers.{n}." + name.removeprefix("mtp.0.")
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                tensors[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :inter]
                tensors[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                tensors[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e]
        elif not name.endswith(("expert_counts", "phy2log", "log2phy", "num_replicas")):
            tensors[name] = t
    tensors[f"model.layers.{n}.embed_tokens.weight"] = model.model.embed_tokens.weight
    tensors[f"model.layers.{n}.shared_head.head.weight"] = model.lm_head.weight
    path = tmp_path_factory.mktemp("tiny-deepseek-mtp")
    cfg.save_pretrained(path)
    tensors = {k: v.contiguous().clone() for k, v in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"))
    return path, tensors


def _mtp_engine(path, tokenizer, spec=None, model=None, **kw):
    cfg = dict(device="cpu", block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=512,
               async_scheduling=False, speculative=SpeculativeConfig(**(spec or {})))
    cfg.update(kw)
    return LLMEngine(ModelConfig(str(path), dtype="float32", max_model_len=256), EngineConfig(**cfg), model=model,
                     tokenizer=tokenizer)


MTP_PROMPTS = ([5, 9, 11, 5, 9, 11, 5, 9], [3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2, 7, 7, 2, 7])


def test_mtp_loads_from_the_checkpoint_and_keeps_greedy_output(mtp_checkpoint, tokenizer):
    import re

    path, tensors = mtp_checkpoint
    engine = _mtp_engine(path, tokenizer, dict(method="mtp", num_draft_tokens=3))
    model = engine.model
    state = model.hf_state_dict()  # the loader fused shared experts and projections: checkpoint names again
    for name, t in tensors.items():  # every MTP tensor landed where it belongs
        m = re.fullmatch(r"model\.layers\.2\.(.*)", name)
        if not m:
            continue
        rest = m.group(1)
        expert = re.fullmatch(r"(.*experts)\.(\d+)\.(gate|up|down)_proj\.weight", rest)
        if expert:
            prefix, e, kind = expert.group(1), int(expert.group(2)), expert.group(3)
            stacked = state[f"mtp.0.{prefix}.{'down_proj' if kind == 'down' else 'gate_up_proj'}"][e]
            got = {"gate": stacked[:32], "up": stacked[32:], "down": stacked}[kind]
        elif rest in ("embed_tokens.weight", "shared_head.head.weight"):  # equal copies: shared with the main
            got = model.model.embed_tokens.weight if rest.startswith("embed") else model.lm_head.weight
        else:
            got = state[f"mtp.0.{rest}"]
        assert torch.equal(got, t), name
    assert model.mtp[0].embed_weight is None and model.mtp[0].head_weight is None

    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain_engine = _mtp_engine(path, tokenizer, model=model)
    plain = plain_engine.generate(list(MTP_PROMPTS), free)
    text = plain[1].text
    stop = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[text[len(text) // 2:][:2]])
    cases = [free, free, free, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), stop]
    prompts = list(MTP_PROMPTS) + [MTP_PROMPTS[0], MTP_PROMPTS[1]]
    want = plain + plain_engine.generate(prompts[3:], cases[3:])
    assert want[4].finish_reason == "stop" and len(want[4].output_token_ids) < 24
    _check_same(engine.generate(prompts, cases), want)
    stats = engine.stats()
    assert 0 < stats["spec_num_drafts_accepted"] < stats["spec_num_drafts_verified"]
    assert all(0 < a < 1 for a in stats["spec_acceptance_by_position"])  # accepted and rejected at every depth

    confident = _mtp_engine(path, tokenizer, dict(method="mtp", schedule="confidence"), model=model)
    _check_same(confident.generate(prompts, cases), want)
    assert 0 < confident.stats()["spec_num_drafts_verified"] <= confident.stats()["spec_num_drafts_proposed"]


def test_mtp_draft_chain_matches_the_step_by_step_loop(mtp_checkpoint, tokenizer):
    """MtpDraftGraphs (a step's catch-up forward, padded to the step's widest, and the chained drafts in one
    replay, positions/lengths/slots advanced on the device; run eagerly on the CPU through the same code)
    drafts exactly what the one-forward-per-draft loop drafts, including requests near max_tokens that
    want fewer drafts (their extra chained steps write nothing), and greedy output stays plain's."""
    from rayinfer.engine.spec_decode import MtpDraftGraphs

    path, _ = mtp_checkpoint
    spec = dict(method="mtp", num_draft_tokens=4, device_drafts=False)
    loop = _mtp_engine(path, tokenizer, spec)
    chained = _mtp_engine(path, tokenizer, spec, model=loop.model)
    prop = chained.proposer
    prop.graphs = MtpDraftGraphs(prop.model, prop.cache, prop.vocab_size, chained.max_model_len, 4, 4, eager=True)
    chain_runs = []
    run_graphs = prop.graphs.run
    prop.graphs.run = lambda *a: (chain_runs.append((len(a[1]), max(len(c) for c in a[3]))), run_graphs(*a))[1]
    logs = {}
    for name, eng in (("loop", loop), ("chain", chained)):
        log = logs[name] = []
        propose = eng.proposer.propose

        def logged(reqs, ks, propose=propose, log=log):
            drafts = propose(reqs, ks)
            log.append([(d.token_ids, d.probs) for d in drafts])
            return drafts

        eng.proposer.propose = logged
    prompts = list(MTP_PROMPTS)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 23, 21)]
    want = loop.generate(prompts, params)
    _check_same(chained.generate(prompts, params), want)
    assert len(logs["chain"]) == len(logs["loop"]) > 3
    for got, ref in zip(logs["chain"], logs["loop"]):
        assert [ids for ids, _ in got] == [ids for ids, _ in ref]
        for (_, p), (_, q) in zip(got, ref):
            assert p == pytest.approx(q, abs=1e-5)
    assert any(len(ids) == 4 for step in logs["chain"] for ids, _ in step)  # chained past the first draft
    assert any(0 < len(ids) < 4 for step in logs["chain"] for ids, _ in step)  # near max_tokens: fewer
    assert chained.stats()["spec_num_drafts_accepted"] > 0
    assert len(chain_runs) >= len(logs["chain"]) - 2, (chain_runs, len(logs["chain"]))  # all but prompts' catch-ups
    assert any(n == 3 for n, _ in chain_runs) and any(w > 1 for _, w in chain_runs)  # padded to 4; wide catch-ups


def _same_drafts_on_device_and_host(host, device, prompts) -> dict[str, list]:
    """Run greedy requests (max_tokens 24, 23, 21: near the end they want fewer drafts) through an engine
    drafting on the host and one drafting on the device; assert the same output, the same drafts at every
    step (probabilities within 1e-5), some of them k = 3 long. Returns each engine's per-step drafts."""
    logs = {}
    for name, eng in (("host", host), ("device", device)):
        log = logs[name] = []
        propose = eng._propose

        def logged(eng=eng, propose=propose, log=log):
            propose()
            log.append(sorted((r.request_id, tuple(r.draft_token_ids), tuple(eng._draft_probs.get(r.request_id) or ()))
                              for r in eng.scheduler.running if r.draft_token_ids))

        eng._propose = logged
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 23, 21)]
    _check_same(device.generate(prompts, params), host.generate(prompts, params))
    assert len(logs["device"]) == len(logs["host"]) > 3
    for got, ref in zip(logs["device"], logs["host"]):
        assert [(rid, ids) for rid, ids, _ in got] == [(rid, ids) for rid, ids, _ in ref]
        for (*_, p), (*_, q) in zip(got, ref):
            assert p == pytest.approx(q, abs=1e-5)
    assert any(len(ids) == 3 for step in logs["device"] for _, ids, _ in step)
    return logs


@pytest.mark.parametrize("schedule", ["fixed", "confidence"])
def test_mtp_device_drafts_equal_the_host_drafts(mtp_checkpoint, tokenizer, schedule):
    """Drafting at the end of each verification step on the device (``launch_drafts``: accepted count,
    catch-up and chained drafts from the step's own samples, no host sync) gives every step the drafts
    ``propose`` gives it from the tokens on the host, and the same greedy output; requests near max_tokens
    take a prefix of them."""
    path, _ = mtp_checkpoint
    host = _mtp_engine(path, tokenizer, dict(method="mtp", num_draft_tokens=3, device_drafts=False, schedule=schedule))
    device = _mtp_engine(path, tokenizer, dict(method="mtp", num_draft_tokens=3, schedule=schedule), model=host.model)
    for eng in (host, device):
        # the confidence schedule's choices read measured step times: frozen (and the gate held at drafting), so
        # both engines choose alike on a loaded machine (the drafts are what is compared here)
        eng.step_time.update = lambda num_tokens, seconds: None
        eng.gate.speculate = lambda batch_size: True
    logs = _same_drafts_on_device_and_host(host, device, list(MTP_PROMPTS))
    stats = device.stats()
    assert stats["spec_device_drafted_steps"] >= len(logs["device"]) - 3  # all but the prompts' first drafts
    assert host.stats()["spec_device_drafted_steps"] == 0
    assert stats["spec_num_drafts_accepted"] > 0


def test_mtp_output_under_preemption(mtp_checkpoint, tokenizer):
    path, _ = mtp_checkpoint
    spec = _mtp_engine(path, tokenizer, dict(method="mtp"), num_kv_blocks=16)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["zzzz"]),
              SamplingParams(temperature=0.8, max_tokens=23, ignore_eos=True, seed=5),
              SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True, logprobs=0)]
    plain = _mtp_engine(path, tokenizer, model=spec.model).generate(list(MTP_PROMPTS), params)
    _check_same(spec.generate(list(MTP_PROMPTS), params), plain)
    stats = spec.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_drafts_accepted"] > 0


def test_mtp_needs_a_model_with_mtp_modules(tiny_pair, tokenizer):
    with pytest.raises(ValueError, match="multi-token-prediction"):
        LLMEngine(ModelConfig("llama-tiny", load_format="dummy"),
                  EngineConfig(device="cpu", speculative=SpeculativeConfig(method="mtp")))
    with pytest.raises(ValueError, match="multi-token-prediction"):
        LLMEngine(ModelConfig("tiny"), EngineConfig(device="cpu", num_kv_blocks=16,
                                                    speculative=SpeculativeConfig(method="mtp")),
                  model=tiny_pair[0], tokenizer=tokenizer)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_mla_verification_steps_through_graph_buffers(mtp_checkpoint, tokenizer, monkeypatch, method):
    """DeepSeek-V3 (MLA) verification steps run in the captured-graph path (``run_ragged``, replayed
    eagerly on the CPU) in the absorbed attention, never the expanded one, which reads host-side lengths;
    with MTP the graphs also return the hidden states it drafts from. Greedy output equals plain."""
    import rayinfer.model.deepseek_v3 as dsv3
    from rayinfer.engine.cuda_graph import DecodeGraphs

    path, _ = mtp_checkpoint
    # confidence-scheduled: some steps verify no draft, so the one-token graphs run too
    engine = _mtp_engine(path, tokenizer, dict(method=method, num_draft_tokens=3, schedule="confidence"))
    prompts = list(MTP_PROMPTS)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 23, 21)]
    plain = _mtp_engine(path, tokenizer, model=engine.model).generate(prompts, params)
    replays, in_graph = [], [False]
    expanded = dsv3.mla_prefill

    def no_expanded_in_graphs(*args, **kw):
        assert not in_graph[0], "the expanded MLA (host-side lengths) ran inside a graph"
        return expanded(*args, **kw)

    monkeypatch.setattr(dsv3, "mla_prefill", no_expanded_in_graphs)
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.block_size, 256, 4,
                          max_query_len=engine.model.max_graph_query_len, eager=True,
                          with_hidden=runner.capture_hidden)
    run = graphs.run

    def wrapper(*args, query_len=1, **kw):
        replays.append((args[3].shape[0], query_len))
        in_graph[0] = True
        try:
            return run(*args, query_len=query_len, **kw)
        finally:
            in_graph[0] = False

    graphs.run = wrapper
    runner.graphs = graphs
    _check_same(engine.generate(prompts, params), plain)
    assert any(q > 1 for _, q in replays) and any(q == 1 for _, q in replays), replays
    assert any(n == 3 for n, q in replays if q > 1), replays  # 3 requests padded to a graph of 4
    assert engine.stats()["spec_num_drafts_accepted"] > 0
    assert runner.capture_hidden == (method == "mtp")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["ngram", "ngram-chained", "mtp", "mtp-chained", "draft_model-chained"])
def test_mla_verification_cuda_graphs_on_gpu(mtp_checkpoint, tokenizer, method):
    """On the GPU, DeepSeek-V3's verification steps replay captured graphs (split-KV absorbed MLA; with MTP
    the graphs return the hidden states too) without a host sync, and greedy output equals the eager
    plain engine's. "-chained": pipelined scheduling, each verification step launched behind the one in
    flight (its inputs and positions from the device, drafted there by MTP or by the model drafting for
    itself in its own graphs, or looked up there by n-gram), still without a host sync while launching."""
    path, _ = mtp_checkpoint
    prompts = list(MTP_PROMPTS)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 23, 21)]
    plain = _mtp_engine(path, tokenizer, device="cuda", enforce_eager=True).generate(prompts, params)
    spec = dict(method=method.removesuffix("-chained"), num_draft_tokens=3,
                **({"ngram_on_device": True} if method == "ngram-chained" else {}))
    engine = _mtp_engine(path, tokenizer, spec, device="cuda", debug_sync_guard=True,
                         async_scheduling=method.endswith("-chained"))
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.max_query_len == 4 and any(q == 4 for _, q in graphs.graphs)
    replays = []
    run = graphs.run

    def counted(*args, query_len=1, **kw):
        replays.append(query_len)
        return run(*args, query_len=query_len, **kw)

    graphs.run = counted
    out = engine.generate(prompts, params)
    # float32 both; the graphs split the KV for max_model_len, eager steps for the real lengths, so a
    # difference is tolerated only as a near-tie flip late in one sequence (as tests/engine/test_gpu_engine.py)
    same = sum(c.output_token_ids == p.output_token_ids for c, p in zip(out, plain))
    assert same >= len(out) - 1, [(c.output_token_ids, p.output_token_ids) for c, p in zip(out, plain)]
    assert all(c.output_token_ids[:8] == p.output_token_ids[:8] for c, p in zip(out, plain))
    assert any(q > 1 for q in replays), replays
    assert engine.stats()["spec_num_drafts_accepted"] > 0
    if method != "ngram":  # drafted on the device behind the verification steps, under the sync guard
        assert engine.stats()["spec_device_drafted_steps"] > 0
    assert (engine.stats().get("spec_chained_steps", 0) > 0) is method.endswith("-chained")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mtp_device_drafts_without_graphs_on_gpu(mtp_checkpoint, tokenizer):
    """``enforce_eager`` on CUDA: MTP still drafts on the device behind each verification step (its forwards
    eager, reading the lengths on the device), nothing chains (no graphs), and greedy output equals the
    eager plain engine's (up to one near-tie flip late in a sequence, as the graph test allows)."""
    path, _ = mtp_checkpoint
    prompts = list(MTP_PROMPTS)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 23, 21)]
    plain_engine = _mtp_engine(path, tokenizer, device="cuda", enforce_eager=True)
    plain = plain_engine.generate(prompts, params)
    engine = _mtp_engine(path, tokenizer, dict(method="mtp", num_draft_tokens=3), device="cuda", enforce_eager=True,
                         async_scheduling=True)
    out = engine.generate(prompts, params)
    same = sum(c.output_token_ids == p.output_token_ids for c, p in zip(out, plain))
    assert same >= len(out) - 1, [(c.output_token_ids, p.output_token_ids) for c, p in zip(out, plain)]
    assert all(c.output_token_ids[:8] == p.output_token_ids[:8] for c, p in zip(out, plain))
    stats = engine.stats()
    assert engine.runner.graphs is None and not engine.chain_verification and stats["spec_chained_steps"] == 0
    assert stats["spec_device_drafted_steps"] > 0 and stats["spec_num_drafts_accepted"] > 0


def test_mtp_chained_verification_keeps_plain_output(mtp_checkpoint, tokenizer):
    """Pipelined speculative decoding (``Scheduler.schedule_chained``): each verification step is launched
    behind the one in flight from the drafts made on the device, its positions moved on the device by the
    drafts the step before did not accept. Greedy, seeded and logprob output equal plain decoding's, with
    stop strings, max_tokens mid-draft and requests of different lengths; nearly every step drafted on the
    device chains, up to each request's end."""
    path, _ = mtp_checkpoint
    spec = dict(method="mtp", num_draft_tokens=3)
    chained = _mtp_engine(path, tokenizer, spec, async_scheduling=True, debug_eager_graphs=True)
    assert chained.chain_verification
    plain = _mtp_engine(path, tokenizer, model=chained.model)
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want_free = plain.generate([MTP_PROMPTS[1]], free)[0].text
    params = [free,
              SamplingParams(temperature=0.8, max_tokens=37, ignore_eos=True, seed=5, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=31, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[want_free[len(want_free) // 2:][:2]])]
    prompts = list(MTP_PROMPTS) + [MTP_PROMPTS[1]]
    want = plain.generate(prompts, params)
    _check_same(chained.generate(prompts, params), want)
    assert want[3].finish_reason == "stop" and len(want[3].output_token_ids) < 40
    stats = chained.stats()
    assert stats["spec_num_drafts_accepted"] > 0
    # requests of different lengths keep chaining to their ends (what a step samples past max_tokens is dropped)
    assert stats["spec_chained_steps"] >= stats["spec_device_drafted_steps"] - 2 > 10, stats


def test_mtp_chained_verification_with_a_full_queue(mtp_checkpoint, tokenizer):
    """Requests waiting while ``max_num_seqs`` are running (a saturated engine) do not stop the chain: they
    could not be admitted before one finishes anyway; each finish drains the pipeline once to admit the next.
    Output equals plain decoding's."""
    path, _ = mtp_checkpoint
    chained = _mtp_engine(path, tokenizer, dict(method="mtp", num_draft_tokens=3), async_scheduling=True,
                          debug_eager_graphs=True, max_num_seqs=2)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 27, 21, 25)]
    params += [SamplingParams(temperature=0.7, max_tokens=33, ignore_eos=True, seed=3),
               SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True, logprobs=1)]
    prompts = list(MTP_PROMPTS) * 2
    _check_same(chained.generate(prompts, params),
                _mtp_engine(path, tokenizer, model=chained.model, max_num_seqs=2).generate(prompts, params))
    stats = chained.stats()
    assert stats["spec_chained_steps"] >= 0.8 * stats["spec_device_drafted_steps"] > 20, stats


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_chained_verification_under_preemption_and_admission(mtp_checkpoint, tokenizer, method):
    """Chained verification steps with a KV pool too small for every request (preemption) and more
    requests than ``max_num_seqs`` (admissions mid-chain): the chain breaks and drains there, output stays
    plain's (MTP, and n-gram looked up on the device, whose rows are reused by the requests admitted later)."""
    path, _ = mtp_checkpoint
    spec = dict(method=method, num_draft_tokens=3, **({"ngram_on_device": True} if method == "ngram" else {}))
    chained = _mtp_engine(path, tokenizer, spec, async_scheduling=True, debug_eager_graphs=True, num_kv_blocks=18,
                          max_num_seqs=3)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=27, ignore_eos=True, seed=5),
              SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.5, max_tokens=25, ignore_eos=True, seed=9)]
    prompts = list(MTP_PROMPTS) + [MTP_PROMPTS[0][::-1]]
    want = _mtp_engine(path, tokenizer, model=chained.model).generate(prompts, params)
    _check_same(chained.generate(prompts, params), want)
    stats = chained.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_chained_steps"] > 3, stats


def test_draft_model_device_drafts_equal_the_host_drafts(tiny_pair, tokenizer):
    """A draft model drafting at the end of each verification step on the device (``launch_drafts``: the
    accepted count, a two-token catch-up at the accepted position, chained one-token forwards, all moved
    on the device) gives every step the drafts ``propose`` gives it from the tokens on the host, and the
    same greedy output; requests near max_tokens take a prefix of them."""
    spec = dict(method="draft_model", num_draft_tokens=3)
    host = _tiny_spec_engine(tiny_pair, tokenizer, dict(spec, device_drafts=False))
    device = _tiny_spec_engine(tiny_pair, tokenizer, spec)
    assert host.proposer.device_graphs is None and device.proposer.device_graphs is not None
    logs = _same_drafts_on_device_and_host(host, device, list(PROMPTS))
    stats = device.stats()
    assert stats["spec_device_drafted_steps"] >= len(logs["device"]) - 3  # all but the prompts' first drafts
    assert host.stats()["spec_device_drafted_steps"] == 0
    assert 0 < stats["spec_num_drafts_accepted"] < stats["spec_num_drafts_verified"]


def _check_chained_keeps_plain_output(chained, tiny_pair, tokenizer):
    """Greedy, seeded and logprob output of an engine chaining its verification steps equal plain decoding's
    (the tiny target's); some drafts are accepted, some rejected; most steps chain."""
    prompts = list(PROMPTS) + [PROMPTS[0][::-1]]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=37, ignore_eos=True, seed=5, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=31, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=1.0, max_tokens=33, ignore_eos=True, seed=11)]
    want = _tiny_spec_engine(tiny_pair, tokenizer, {}).generate(prompts, params)
    _check_same(chained.generate(prompts, params), want)
    stats = chained.stats()
    assert 0 < stats["spec_num_drafts_accepted"] < stats["spec_num_drafts_verified"]
    assert stats["spec_chained_steps"] > 10, stats


def test_draft_model_chained_verification_keeps_plain_output(tiny_pair, tokenizer):
    """Chained verification steps with a draft model drafting on the device behind each (pipelined
    scheduling): greedy, seeded and logprob output equal plain decoding's; most steps chain."""
    spec = dict(method="draft_model", num_draft_tokens=3)
    chained = _tiny_spec_engine(tiny_pair, tokenizer, spec, async_scheduling=True, debug_eager_graphs=True)
    chained.chain_verification = True  # the engine decided it for the proposer it built, replaced above
    _check_chained_keeps_plain_output(chained, tiny_pair, tokenizer)


@pytest.mark.parametrize("proposer", ["mtp", "draft_model"])
def test_chained_verification_of_varying_width(mtp_checkpoint, tiny_pair, tokenizer, proposer):
    """The confidence schedule chains too: each chained step verifies the first m of the k drafts made on
    the device, m chosen per step (``_chained_num_drafts``; cycled here through 3, 1, 2, and then the
    schedule's own choice), so the in-flight step's advance counts its own m. Greedy and seeded output
    equal plain decoding's."""
    import itertools

    spec = dict(method=proposer, num_draft_tokens=3, schedule="confidence")
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=37, ignore_eos=True, seed=5, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=31, ignore_eos=True)]
    for own_choice in (False, True):
        if proposer == "mtp":
            path, _ = mtp_checkpoint
            chained = _mtp_engine(path, tokenizer, spec, async_scheduling=True, debug_eager_graphs=True)
            want = _mtp_engine(path, tokenizer, model=chained.model).generate(list(MTP_PROMPTS), params)
        else:
            chained = _tiny_spec_engine(tiny_pair, tokenizer, spec, async_scheduling=True, debug_eager_graphs=True)
            chained.chain_verification = True  # for the proposer swapped in above
            want = _tiny_spec_engine(tiny_pair, tokenizer, {}).generate(list(MTP_PROMPTS), params)
        assert chained.chain_verification
        chained.gate.speculate = lambda batch_size: True  # the tiny models decode faster plain
        widths = []
        if not own_choice:
            cycle = itertools.cycle([3, 1, 2])
            chained._chained_num_drafts = lambda: widths.append(next(cycle)) or widths[-1]
        _check_same(chained.generate(list(MTP_PROMPTS), params), want)
        stats = chained.stats()
        assert stats["spec_chained_steps"] > 5, stats
        if not own_choice:
            verified = stats["spec_num_drafts_verified"]
            assert 0 < stats["spec_num_drafts_accepted"] < verified
            by_position = chained.spec_stats.verified_by_position
            assert by_position[0] > by_position[1] > by_position[2] > 0  # widths 1 and 2 left later drafts out


def test_ngram_device_lookup_frees_the_rows_of_ended_requests(tiny_pair, tokenizer):
    """Each request holds a row of the device lookup's buffer (``max_num_seqs`` rows) until it ends. A request
    that ends while the verification step chained behind it is launched must not take a row back (the
    engine already released it): rows would leak until none is left and nothing chains any more (the
    bench's two warm-up requests once held 2 of 8 rows, and chaining fell from 14 steps to 4)."""
    spec = dict(method="ngram", num_draft_tokens=3, ngram_on_device=True)
    engine = _tiny_spec_engine(tiny_pair, tokenizer, spec, async_scheduling=True, debug_eager_graphs=True, max_num_seqs=4)
    lookup = engine.proposer.device_graphs
    prompts = list(PROMPTS) + [PROMPTS[0][::-1]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 37, 31, 33)]
    # short requests that repeat themselves (as the bench's warm-up did on the SmolLM2 shape): each ends in a
    # verification step processed after the next step was scheduled with it
    for n in range(3, 9):
        engine.generate([[5, 9, 11] * 6, [3, 1, 4, 1] * 5], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        assert lookup.slots == {} and len(lookup.free) == 4, (n, lookup.slots)
    chained = []
    for _ in range(3):
        before = engine.stats()["spec_chained_steps"]
        engine.generate(prompts, params)
        chained.append(engine.stats()["spec_chained_steps"] - before)
        assert lookup.slots == {} and len(lookup.free) == 4, lookup.slots
    assert min(chained) > 10 and max(chained) - min(chained) <= 2, chained


@pytest.mark.parametrize("method", ["mtp", "mtp-confidence", "draft_model", "ngram-chained"])
def test_proposers_forget_requests_that_end(mtp_checkpoint, tiny_pair, tokenizer, method):
    """Once every request has ended, no proposer holds state for any: no MTP state (its pending hidden rows
    live on the device) or draft blocks, no draft-model cache, no n-gram context or device row, although
    requests of different lengths end while a step with them is in flight (pipelined scheduling)."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 9, 14, 3)]
    prompts = list(MTP_PROMPTS) + [[5, 9, 11] * 4]
    kw = dict(async_scheduling=True, debug_eager_graphs=True)
    if method.startswith("mtp"):
        spec = dict(method="mtp", num_draft_tokens=2, schedule="confidence" if method == "mtp-confidence" else "fixed")
        engine = _mtp_engine(mtp_checkpoint[0], tokenizer, spec, **kw)
    else:
        spec = dict(method="ngram", ngram_on_device=True) if method == "ngram-chained" else dict(method=method)
        engine = _tiny_spec_engine(tiny_pair, tokenizer, spec, **kw)
    if method == "mtp-confidence":  # plain steps (pipelined) between drafting ones
        picks = []
        engine.gate.speculate = lambda batch_size: picks.append(len(picks) % 3 == 2) or picks[-1]
    for _ in range(2):
        engine.generate(prompts, params)
    from rayinfer.engine.spec_decode import _NgramDeviceLookup

    prop = engine.proposer
    held = {name: getattr(prop, name) for name in ("states", "expected_num_tokens", "_contexts", "_launched")
            if getattr(prop, name, None)}
    if hasattr(prop, "cache"):
        held.update({k: v for k, v in (("blocks", prop.cache.block_ids), ("computed", prop.cache.computed)) if v})
    if isinstance(prop.device_graphs, _NgramDeviceLookup) and prop.device_graphs.slots:
        held["rows"] = prop.device_graphs.slots
    assert not held, {k: list(v) for k, v in held.items()}
    assert engine.stats()["spec_num_drafts_proposed"] > 0


def test_ngram_chained_verification_keeps_plain_output(tiny_pair, tokenizer, caplog):
    """``speculative.ngram_on_device``: n-gram drafts looked up on the device behind each verification step,
    so verification steps chain (pipelined scheduling): greedy, seeded and logprob output equal plain
    decoding's, and most steps chain. The drafts a chained step verifies are the host lookup's (padded with
    token 0 where it has fewer than k)."""
    spec = dict(method="ngram", num_draft_tokens=3, ngram_on_device=True)
    chained = _tiny_spec_engine(tiny_pair, tokenizer, spec, async_scheduling=True, debug_eager_graphs=True)
    assert chained.chain_verification
    from rayinfer.engine.spec_decode import ngram_lookup

    proposer, taken, checked = chained.proposer, [], []
    real_take, real_step_chained = proposer.take_chained, chained._step_chained
    proposer.take_chained = lambda: taken.append(real_take()) or taken[-1]

    def step_chained(started):
        outputs = real_step_chained(started)
        if outputs is not None:  # the step in flight is processed now: its requests' tokens are on the host
            for rid, d in taken[-1].items():
                req = chained.scheduler.requests.get(rid)
                if req is not None and not req.is_finished:
                    want = ngram_lookup(np.array(req.all_token_ids), 3, 1, 4)
                    checked.append(d.token_ids == want + [0] * (3 - len(want)))
        return outputs

    chained._step_chained = step_chained
    _check_chained_keeps_plain_output(chained, tiny_pair, tokenizer)
    assert len(checked) > 10 and all(checked), checked
    # off by default: fixed-k n-gram steps drain (pipelined scheduling turned off), as before
    assert not _tiny_spec_engine(tiny_pair, tokenizer, dict(method="ngram"), async_scheduling=True,
                                 debug_eager_graphs=True).chain_verification
    # where no step can chain (no graphs; the confidence schedule, whose n-gram drafts carry no probabilities
    # to choose a chained width from), the device lookup is off rather than run behind every step for nothing
    for kw, sched in (({}, "fixed"), (dict(async_scheduling=True, debug_eager_graphs=True), "confidence")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="rayinfer.engine.llm_engine"):
            idle = _tiny_spec_engine(tiny_pair, tokenizer, dict(spec, schedule=sched), **kw)
        assert idle.proposer.device_graphs is None and not idle.chain_verification, (kw, sched)
        # and the log says so, naming what is missing (a fresh user saw 0 chained steps and no word why)
        said = [r.getMessage() for r in caplog.records if "ngram_on_device has no effect" in r.getMessage()]
        assert len(said) == 1 and f"schedule {sched}" in said[0], (kw, sched, said)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rayinfer.engine.llm_engine"):
        _tiny_spec_engine(tiny_pair, tokenizer, spec, async_scheduling=True, debug_eager_graphs=True)
    assert not any("ngram_on_device has no effect" in r.getMessage() for r in caplog.records)
