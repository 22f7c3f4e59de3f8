"""Scheduler in the PD roles, without a model: KV imports, stored prefixes, DECODE preemption hands back."""

from rayinfer.engine.block_pool import hash_block_chain
from rayinfer.engine.scheduler import Scheduler, SchedulerConfig
from rayinfer.engine.types import (
    EngineRole,
    KVHandle,
    Request,
    RequestStatus,
    SampledToken,
    SamplingParams,
    StepOutput,
)


def make_sched(**kw):
    base = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4, num_blocks=32)
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def run_step(s, token=7):
    out = s.schedule()
    s.update_from_output(out, StepOutput({x.request_id: SampledToken(token) for x in out.scheduled if x.needs_sample}))
    return out


def prefilled(rid, n, base=100, max_tokens=8):
    """A DECODE-role request: n prompt tokens computed elsewhere, plus the first sampled token."""
    prompt = list(range(base, base + n))
    handle = KVHandle(rid, hash_block_chain(prompt, 4), n, "v1:test")
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), output_token_ids=[5], kv_handle=handle)


def test_decode_admission_imports_the_handle_and_computes_one_token():
    s = make_sched(role=EngineRole.DECODE)
    s.add_request(prefilled("a", 7))
    out = s.schedule()
    (rid, blocks, handle), = out.kv_imports
    assert rid == "a" and len(blocks) == 2 and handle.num_tokens == 7
    (x,) = out.scheduled
    assert (x.start_pos, x.token_ids, x.needs_sample) == (7, (5,), True)
    assert s.requests["a"].kv_handle is None


def test_decode_preemption_hands_the_request_back():
    s = make_sched(role=EngineRole.DECODE, num_blocks=4)
    s.add_request(prefilled("a", 7))
    s.add_request(prefilled("b", 7, base=200))
    run_step(s)  # both admitted: 8 tokens in 2 blocks each, the pool is full
    assert s.kv.pool.num_free_blocks == 0
    out = run_step(s)  # a's 9th token needs a third block: b (the last admitted) is preempted
    assert out.preempted_ids == ("b",) and [x.request_id for x in out.scheduled] == ["a"]
    assert "b" not in s.requests and not s.waiting  # never requeued: a DECODE replica cannot recompute
    (b,) = s.take_handed_back()
    assert b.request_id == "b" and b.status == RequestStatus.PREEMPTED and b.output_token_ids == [5, 7]
    assert b.block_ids == [] and s.take_handed_back() == []
    assert s.kv.pool.num_free_blocks == 4 - 3


def test_normal_preemption_still_recomputes_locally():
    s = make_sched(num_blocks=4)
    s.add_request(Request("a", list(range(100, 107)), SamplingParams(max_tokens=8)))
    s.add_request(Request("b", list(range(200, 207)), SamplingParams(max_tokens=8)))
    for _ in range(3):
        run_step(s)
    assert s.num_preemptions and not s.take_handed_back() and "b" in s.requests


def test_stored_prefix_is_imported_instead_of_computed():
    s = make_sched(role=EngineRole.PREFILL, enable_prefix_caching=False)
    prompt = list(range(100, 110))
    stored = KVHandle("a", hash_block_chain(prompt[:8], 4), 8, "v1:test")
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=4), kv_handle=stored))
    out = s.schedule()
    (_, blocks, _), = out.kv_imports
    assert len(blocks) == 2 and out.scheduled[0].start_pos == 8 and out.scheduled[0].num_new_tokens == 2
    assert s.requests["a"].num_cached_tokens == 8


def test_local_prefix_cache_wins_over_an_equal_stored_prefix():
    s = make_sched(role=EngineRole.PREFILL)
    prompt = list(range(100, 110))
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=4)))
    run_step(s)
    s.finish_requests("a", RequestStatus.FINISHED_PREFILLED)  # export done: blocks freed, still cached
    stored = KVHandle("b", hash_block_chain(prompt[:8], 4), 8, "v1:test")
    s.add_request(Request("b", prompt, SamplingParams(max_tokens=4), kv_handle=stored))
    out = s.schedule()
    assert out.kv_imports == () and out.scheduled[0].start_pos == 8


def test_prefill_role_never_schedules_past_its_in_flight_first_token():
    s = make_sched(role=EngineRole.PREFILL)
    s.add_request(Request("a", list(range(100, 106)), SamplingParams(max_tokens=4)))
    first = s.schedule()  # async scheduling: the next step is planned before this one's token is back
    assert s.schedule().is_empty
    s.update_from_output(first, StepOutput({"a": SampledToken(7)}))
    a = s.requests["a"]
    assert a.status == RequestStatus.FINISHED_PREFILLED and a.num_computed_tokens == 6
