"""Scheduler driven without a model: budgets, chunked prefill, prefix hits, preemption, stops."""

from rayinfer.engine.scheduler import Scheduler, SchedulerConfig
from rayinfer.engine.types import EngineRole, Request, RequestStatus, SampledToken, SamplingParams, StepOutput


def make_sched(**kw):
    base = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4, num_blocks=32)
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def req(rid, n, max_tokens=4, base=100, **kw):
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids=(2,))


def run_step(s, token=7):
    out = s.schedule()
    sampled = {x.request_id: SampledToken(token) for x in out.scheduled if x.needs_sample}
    s.update_from_output(out, StepOutput(sampled))
    return out


def test_chunked_prefill_under_token_budget():
    s = make_sched(max_num_batched_tokens=8)
    s.add_request(req("a", 20))
    plans = [run_step(s) for _ in range(3)]
    assert [(p.scheduled[0].start_pos, p.scheduled[0].num_new_tokens) for p in plans] == [(0, 8), (8, 8), (16, 4)]
    assert [p.scheduled[0].needs_sample for p in plans] == [False, False, True]
    assert s.requests["a"].output_token_ids == [7]
    nxt = s.schedule()
    assert nxt.scheduled[0].token_ids == (7,) and nxt.scheduled[0].start_pos == 20


def test_decode_and_new_prefill_share_a_step():
    s = make_sched(max_num_batched_tokens=10)
    s.add_request(req("a", 5))
    run_step(s)
    s.add_request(req("b", 12, base=500))
    out = run_step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 9)]


def test_max_num_seqs_limits_admission():
    s = make_sched(max_num_seqs=2)
    for r in "abc":
        s.add_request(req(r, 3))
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["a", "b"] and s.num_waiting == 1


def test_prefix_hit_skips_cached_tokens():
    s = make_sched()
    s.add_request(req("a", 9))
    run_step(s)
    b = Request("b", list(range(100, 108)) + [5, 6, 7], SamplingParams(max_tokens=2))
    s.add_request(b)
    out = s.schedule()
    sb = [x for x in out.scheduled if x.request_id == "b"][0]
    assert sb.start_pos == 8 and sb.token_ids == (5, 6, 7)
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == s.requests["a"].block_ids[:2]


def test_preemption_by_recompute_when_blocks_run_out():
    s = make_sched(num_blocks=5, max_num_batched_tokens=64)
    s.add_request(req("a", 8, max_tokens=20))
    s.add_request(req("b", 8, max_tokens=20))
    run_step(s)  # a: 2 blocks + b: 2 blocks (+ nothing spare for growth beyond 1 block)
    seen_preempt = []
    for _ in range(10):
        out = run_step(s)
        seen_preempt += list(out.preempted_ids)
    assert seen_preempt and seen_preempt[0] == "b"  # the last admitted is preempted first
    b = s.requests["b"]
    assert b.num_preemptions >= 1
    # recompute restarts from its cached prefix or zero, never loses tokens
    assert b.output_token_ids[0] == 7 and len(b.all_token_ids) == 8 + b.num_output_tokens


def test_stop_conditions():
    s = make_sched()
    s.add_request(req("eos", 3, max_tokens=10))
    s.add_request(req("len", 3, max_tokens=2, ignore_eos=True))
    s.add_request(req("min", 3, max_tokens=10, min_tokens=3))
    s.add_request(req("stopid", 3, max_tokens=10, stop_token_ids=[9], ignore_eos=True))
    run_step(s, token=2)  # EOS for everyone
    assert "eos" not in s.requests and "min" in s.requests and "len" in s.requests and "stopid" in s.requests
    run_step(s, token=9)
    assert "len" not in s.requests and "stopid" not in s.requests
    run_step(s, token=5)
    assert "min" in s.requests  # 3 tokens, 10 allowed
    run_step(s, token=2)
    assert "min" not in s.requests


def test_abort_frees_blocks_and_reports_finished_id():
    s = make_sched()
    s.add_request(req("a", 10))
    run_step(s)
    free_before = s.kv.pool.num_free_blocks
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_free_blocks == free_before + 3
    assert s.schedule().finished_ids == ("a",)


def test_prefill_role_holds_blocks_after_first_token():
    s = make_sched(role=EngineRole.PREFILL)
    r = req("p", 6, max_tokens=5)
    s.add_request(r)
    run_step(s)
    assert r.status == RequestStatus.FINISHED_PREFILLED and r.block_ids and not s.running
    assert s.schedule().is_empty


def test_step_kind_filters_work_and_pending_work_counts_it():
    """A data-parallel rank's voted step kind: "decode" runs only one-token decodes, "prefill" only prompt
    work (admissions and unfinished prompt chunks), "idle" nothing; pending_work() is the rank's vote."""
    import pytest

    s = make_sched(max_num_batched_tokens=8)
    s.add_request(req("a", 5))
    run_step(s)  # a's prompt done: it decodes next
    s.add_request(req("b", 12, base=500))
    assert s.pending_work() == (12, 1)
    assert s.schedule("idle").is_empty and s.pending_work() == (12, 1)
    out = s.schedule("decode")
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1)]
    s.update_from_output(out, StepOutput({"a": SampledToken(7)}))
    out = s.schedule("prefill")  # b's first chunk only; a waits
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 8)]
    s.update_from_output(out, StepOutput({}))
    assert s.pending_work() == (4, 1)
    out = s.schedule("prefill")  # b's last chunk (4 tokens), still prompt work
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 4)]
    s.update_from_output(out, StepOutput({"b": SampledToken(7)}))
    assert s.pending_work() == (0, 2)
    with pytest.raises(ValueError, match="step_kind"):
        s.schedule("both")
