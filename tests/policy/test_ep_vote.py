"""The EP ranks' per-step agreement (``policy.ep_vote``): hand-checked plans from gathered votes."""

from __future__ import annotations

import pytest

from rayinfer.policy.ep_vote import NUM_VOTE_FIELDS, RankVote, StepPlan, plan_step
from rayinfer.policy.routing import StepVote


def vote(prefill=0, decode=0, streak=0, busy=None, progressed=True, version=0, stop=False, ready=0) -> RankVote:
    busy = bool(prefill or decode) if busy is None else busy
    return RankVote(StepVote(prefill, decode, streak), busy, progressed, version, stop, ready)


def test_vote_round_trips_as_ints():
    v = vote(prefill=40, decode=3, streak=2, busy=True, progressed=False, version=5, stop=True, ready=4)
    assert v.to_list() == [40, 3, 2, 1, 0, 5, 1, 4] and len(v.to_list()) == NUM_VOTE_FIELDS
    assert RankVote.from_list(v.to_list()) == v
    with pytest.raises(ValueError, match="8 fields"):
        RankVote.from_list([1, 2, 3])


def test_no_work_anywhere_is_an_idle_iteration():
    assert plan_step([vote(), vote()], 0) == StepPlan(run=False)


def test_a_rank_without_work_follows_the_voted_kind():
    # rank 1 has nothing: it still runs the step (a dummy forward) of the kind rank 0's work asks for
    assert plan_step([vote(prefill=30), vote()], 0) == StepPlan(run=True, step_kind="prefill")
    # a decode step: every rank replays the graph of the largest decode batch (the idle rank too)
    assert plan_step([vote(decode=4), vote()], 0) == StepPlan(run=True, step_kind="decode", graph_batch_size=4)
    assert plan_step([vote(decode=4), vote(decode=9)], 0).graph_batch_size == 9
    # both kinds waiting: decode until the streak or the waiting prompt tokens call for a prefill
    assert plan_step([vote(decode=4, streak=3), vote(prefill=30)], 0, 8, 512).step_kind == "decode"
    assert plan_step([vote(decode=4, streak=8), vote(prefill=30)], 0, 8, 512).step_kind == "prefill"
    assert plan_step([vote(decode=4), vote(prefill=600)], 0, 8, 512).step_kind == "prefill"


def test_mixed_step_when_stuck_or_busy_without_schedulable_work():
    # the last step moved no rank (a prompt waits for blocks that decodes free): a mixed step
    assert plan_step([vote(decode=2, progressed=False), vote(prefill=30, progressed=False)], 0) == \
        StepPlan(run=True, step_kind=None)
    # one rank moved: the voted kind stands
    assert plan_step([vote(decode=2), vote(prefill=30, progressed=False)], 0).step_kind == "decode"
    # no pending work but a rank still holds requests: a mixed step, not an idle iteration
    assert plan_step([vote(busy=True), vote()], 0) == StepPlan(run=True, step_kind=None)


def test_stop_wins_over_work():
    assert plan_step([vote(decode=3), vote(stop=True)], 0) == StepPlan(stop=True)


def test_placement_moves_then_switches_when_every_rank_is_ready():
    # rank 1 has not received version 1 yet: nothing moves
    assert plan_step([vote(decode=1, version=1), vote(version=0)], 0).move_version is None
    # both have it: the weights start moving (the step still runs, with the map in use), no switch yet
    plan = plan_step([vote(decode=1, version=1), vote(version=1)], 0)
    assert plan.move_version == 1 and plan.placement_version is None and plan.step_kind == "decode"
    assert plan_step([vote(version=1), vote(version=1)], 0) == StepPlan(run=False, move_version=1)
    # while version 1 moves: no second move; switch once every rank reports it ready
    assert plan_step([vote(version=2, ready=1), vote(version=2, ready=0)], 0, moving_version=1) == StepPlan(run=False)
    assert plan_step([vote(version=2, ready=1), vote(version=2, ready=1)], 0, moving_version=1) == \
        StepPlan(run=False, placement_version=1)
    # after the switch the next common version moves: the newest all ranks have
    assert plan_step([vote(version=3, ready=1), vote(version=2, ready=1)], 1).move_version == 2
    assert plan_step([vote(version=1), vote(version=1)], 1).move_version is None


def test_empty_votes_raise():
    with pytest.raises(ValueError, match="one RankVote per rank"):
        plan_step([], 0)
