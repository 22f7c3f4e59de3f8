"""Routing policies by hand: prefill (queued compute, stored credit, buckets), decode (running + KV), votes."""

import math

import pytest

from rayinfer.policy.routing import (
    DecodeBalancer,
    PrefillBalancer,
    ReplicaLoadBalancer,
    StepVote,
    vote_step_kind,
)


def test_replica_load_balancer_keeps_prefix_affinity():
    lb = ReplicaLoadBalancer(2, block_size=4, affinity_slack=1)
    a = [1, 2, 3, 4, 5]
    assert lb.pick(a) == 0
    assert lb.pick([9, 9, 9, 9]) == 1
    assert lb.pick(a) == 0  # in flight 1 vs 1: affinity wins
    assert lb.pick(a) == 0  # 2 <= 1 + slack: still affine
    assert lb.pick(a) == 1  # 3 > 1 + slack: least loaded wins, and takes over the affinity
    assert lb.pick(a) == 1
    lb.done(0)
    assert lb.in_flight == [2, 3]


def test_prefill_cost_credits_stored_prefix():
    lb = PrefillBalancer(2, bucket_bounds=(100,), attn_tokens=100)
    assert lb.cost(100) == 100 + 10000 / 200 == 150
    assert lb.cost(100, 50) == 50 + (10000 - 2500) / 200 == 87.5
    assert lb.cost(100, 500) == 0
    assert [lb.bucket(n) for n in (0, 99, 100, 10**6)] == [0, 0, 1, 1]


def test_prefill_picks_least_queued_compute():
    lb = PrefillBalancer(2, bucket_bounds=(100,), attn_tokens=100)
    t0 = lb.pick(100)
    assert t0.replica == 0 and lb.queued_cost == [150, 0]
    t1 = lb.pick(50)
    assert t1.replica == 1 and lb.queued_cost == [150, 62.5]
    t2 = lb.pick(200, num_cached_tokens=150)  # 137.5 with the stored prefix credited
    assert t2.replica == 1 and lb.queued_cost == [150, 200]
    assert lb.pick(10).replica == 0
    lb.done(t1)
    assert lb.queued_cost == [160.5, 137.5] and lb.bucket_counts == [[1, 1], [0, 1]]
    assert lb.pick(10, exclude={1}).replica == 0


def test_prefill_ties_spread_a_length_bucket():
    lb = PrefillBalancer(2, bucket_bounds=(100,), attn_tokens=math.inf)  # linear cost: tokens to compute
    assert lb.pick(150).replica == 0  # long
    assert lb.pick(60).replica == 1
    assert lb.pick(90).replica == 1  # queues now 150 and 150
    assert lb.pick(120).replica == 1  # tie: replica 1 holds no long prompt yet


def test_decode_balances_running_and_kv_tokens_together():
    lb = DecodeBalancer(2, max_num_seqs=4, kv_capacity=100)
    big = lb.pick(80)
    assert big.replica == 0  # tie at 1.05: lower index
    assert [lb.pick(10).replica for _ in range(3)] == [1, 1, 1]  # r0 would be 0.5 + 0.9 = 1.4
    assert lb.load(1) == pytest.approx(3 / 4 + 30 / 100)
    assert lb.pick(10).replica == 0  # both 1.4 now: the KV-heavy replica takes it by index
    lb.grow(big, 5)
    assert lb.kv_tokens == [95, 30] and big.num_tokens == 85
    lb.done(big)
    assert lb.num_running == [1, 3] and lb.kv_tokens == [10, 30]
    assert lb.pick(1, exclude={0}).replica == 1


def test_step_vote():
    idle, dec, pre = StepVote(), StepVote(num_decode_requests=3, num_decode_steps=2), StepVote(num_prefill_tokens=40)
    assert vote_step_kind([idle, idle]) == "idle"
    assert vote_step_kind([idle, pre]) == "prefill"
    assert vote_step_kind([dec, idle]) == "decode"
    assert vote_step_kind([dec, pre]) == "decode"  # little prefill work, short decode streak
    assert vote_step_kind([dec, pre], min_prefill_tokens=40) == "prefill"
    assert vote_step_kind([StepVote(0, 3, 8), pre]) == "prefill"  # the streak bound
    assert StepVote(1, 2, 3).to_list() == [1, 2, 3]
    with pytest.raises(ValueError):
        vote_step_kind([])


def test_bad_policy_arguments():
    with pytest.raises(ValueError):
        PrefillBalancer(0)
    with pytest.raises(ValueError):
        PrefillBalancer(1, bucket_bounds=(10, 5))
    with pytest.raises(ValueError):
        DecodeBalancer(1, max_num_seqs=0, kv_capacity=1)
