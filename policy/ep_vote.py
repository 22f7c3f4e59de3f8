"""The EP ranks' per-step agreement (pure, no Ray or torch.distributed inside).

Ranks of one expert-parallel replica drive themselves: before each step every rank all-gathers a
:class:`RankVote` (``[NUM_VOTE_FIELDS]`` int64 per rank) and calls :func:`plan_step` on the same gathered
list, so all ranks take the same :class:`StepPlan` without a leader or a driver round trip (after
DeepSeek's data-parallel step vote; the step kind itself is ``policy.routing.vote_step_kind``).

Glossary: a *dummy step* is a forward over zero tokens that a rank without work of the voted kind runs
so that the MoE layers' collectives line up; an *idle iteration* is one where no rank has work, so no
rank steps and all wait briefly for requests before voting again.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayinfer.policy.routing import StepVote, vote_step_kind

NUM_VOTE_FIELDS = 8


@dataclass(frozen=True)
class RankVote:
    """One EP rank's message before a step.

    Attributes:
        step: the rank's work (``StepVote``: prompt tokens waiting, decodes ready, decode streak).
        has_unfinished: the rank holds live requests (they may have no schedulable work: a prompt
            waiting for KV blocks).
        progressed: the rank's last step computed tokens (True before the first step).
        placement_version: the newest expert map the rank has received (0: the initial map).
        stop: the rank was asked to stop; every rank leaves its loop at this vote.
        ready_version: the newest expert map whose weights this rank holds moved and ready to switch to
            (the map in use while a move is in flight).
    """

    step: StepVote = StepVote()
    has_unfinished: bool = False
    progressed: bool = True
    placement_version: int = 0
    stop: bool = False
    ready_version: int = 0

    def to_list(self) -> list[int]:
        """The vote as ``NUM_VOTE_FIELDS`` ints, for the all-gather."""
        return [*self.step.to_list(), int(self.has_unfinished), int(self.progressed), self.placement_version,
                int(self.stop), self.ready_version]

    @classmethod
    def from_list(cls, values) -> "RankVote":
        """The inverse of :meth:`to_list`.

        Raises:
            ValueError: for a list of another length.
        """
        values = [int(v) for v in values]
        if len(values) != NUM_VOTE_FIELDS:
            raise ValueError(f"a vote has {NUM_VOTE_FIELDS} fields, got {len(values)}")
        return cls(StepVote(*values[:3]), bool(values[3]), bool(values[4]), values[5], bool(values[6]), values[7])


@dataclass(frozen=True)
class StepPlan:
    """What every rank does after one vote.

    Attributes:
        stop: leave the loop now (no step).
        run: run one engine step (False: an idle iteration, wait for requests and vote again).
        step_kind: the step's kind for ``LLMEngine.step``: "prefill", "decode" or None (mixed).
        placement_version: switch to this expert map before the step (its weights are in place on
            every rank: ``finish_expert_placement``); None keeps the map in use.
        move_version: start moving expert weights for this map in the background
            (``start_expert_placement``; the ranks keep stepping with the map in use); None: no new move.
        graph_batch_size: a decode step's padded batch that every rank's decode graph replays (the
            largest decode batch of any rank; ``ModelRunner.group_batch_size``); None for other steps.
    """

    stop: bool = False
    run: bool = False
    step_kind: str | None = None
    placement_version: int | None = None
    move_version: int | None = None
    graph_batch_size: int | None = None


def plan_step(votes: list[RankVote], applied_version: int, max_decode_steps: int = 8,
              min_prefill_tokens: int = 512, moving_version: int | None = None) -> StepPlan:
    """The plan of every rank for the next iteration, from the gathered votes.

    Rules, in order:

    1. a rank asked to stop: every rank stops (so none is left waiting in a collective);
    2. placement, in two agreed phases so that weights move while the ranks serve: with no move in
       flight, the newest version all ranks have received, when newer than ``applied_version``, starts
       moving (every rank posts the same sends and receives at the same iteration); once every rank
       reports that version's weights ready, all switch to it before this iteration's step;
    3. the kind is ``vote_step_kind``; an "idle" kind runs a mixed step while some rank still holds
       requests, else no step runs; a kind voted after a step that moved no rank is replaced by a mixed
       step (prompts that wait for KV blocks freed by decodes must not stall the group). A decode step
       carries the group's largest decode batch (every rank replays that graph size).

    Args:
        votes: one :class:`RankVote` per rank, in rank order (the gathered list, equal on every rank).
        applied_version: the map version in use (equal on every rank).
        max_decode_steps, min_prefill_tokens: ``vote_step_kind``'s rules.
        moving_version: the version whose weights are moving (None: no move in flight; equal on every rank).
    Returns:
        the :class:`StepPlan`.
    Raises:
        ValueError: for an empty list.
    """
    if not votes:
        raise ValueError("votes must hold one RankVote per rank")
    if any(v.stop for v in votes):
        return StepPlan(stop=True)
    switch = move = None
    if moving_version is not None:
        if min(v.ready_version for v in votes) >= moving_version:
            switch = moving_version
    else:
        received = min(v.placement_version for v in votes)
        move = received if received > applied_version else None
    kind = vote_step_kind([v.step for v in votes], max_decode_steps, min_prefill_tokens)
    if kind == "idle":
        return StepPlan(run=any(v.has_unfinished for v in votes), step_kind=None, placement_version=switch,
                        move_version=move)
    step_kind = kind if any(v.progressed for v in votes) else None
    graph = max(v.step.num_decode_requests for v in votes) if step_kind == "decode" else None
    return StepPlan(run=True, step_kind=step_kind, placement_version=switch, move_version=move,
                    graph_batch_size=graph)
