"""The EP ranks' own step loops (``EPStepLoop``) without Ray or torch.distributed: two loops on threads,
fake engines, and an all-gather over a barrier. Every rank votes and steps the same number of times, a
rank without requests runs dummy steps, a stop from one rank ends both, idle ranks wait on their inbox
instead of spinning, and a new expert map's weights start moving at the same vote on both once both have
it, while both keep stepping, and both switch at the same vote once both report the move done."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rayinfer.actors.ep_rank import EPStepLoop
from rayinfer.engine.types import RequestOutput
from rayinfer.policy.eplb_policy import ExpertLoadWindow

MAP_SHAPE = (1, 4)


class ThreadAllGather:
    """An all-gather between threads: every rank's list, in rank order (two barriers per call)."""

    def __init__(self, num_ranks: int):
        self.slots: list[list[int]] = [[] for _ in range(num_ranks)]
        self.barrier = threading.Barrier(num_ranks, timeout=10)

    def rank(self, rank: int):
        def all_gather(vote: list[int]) -> list[list[int]]:
            self.slots[rank] = list(vote)
            self.barrier.wait()
            out = [list(s) for s in self.slots]
            self.barrier.wait()  # nobody writes the next vote before everyone read this one
            return out
        return all_gather


class FakeEngine:
    """Requests of ``prompt`` tokens prefilled in one step, then decoding ``max_tokens`` tokens one a step."""

    def __init__(self):
        self.requests: dict[str, list[int]] = {}  # id -> [prompt tokens left, tokens left]
        self.num_computed_tokens = 0
        self.steps: list[str | None] = []  # the kind of each step
        self.switches: list[int] = []  # the step count at each map switch
        self.moves_started: list[int] = []  # the step count at each move's start
        self.move_done = threading.Event()  # the background transfers of this rank's move completed
        self.model = SimpleNamespace(expert_load=lambda reset: torch.zeros(MAP_SHAPE, dtype=torch.int64),
                                     start_expert_placement=self.start_move,
                                     finish_expert_placement=lambda moves: self.switches.append(len(self.steps)))
        self.scheduler = SimpleNamespace(pending_work=self.pending_work)

    def start_move(self, phy2log, group):
        self.moves_started.append(len(self.steps))
        return [SimpleNamespace(is_done=self.move_done.is_set)]

    def pending_work(self) -> tuple[int, int]:
        return (sum(p for p, _ in self.requests.values()),
                sum(1 for p, _ in self.requests.values() if p == 0))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        self.requests[request_id] = [len(prompt_token_ids), params]

    def abort_request(self, request_ids) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def step(self, run_empty: bool, step_kind: str | None) -> list[RequestOutput]:
        assert run_empty
        self.steps.append(step_kind)
        outputs = []
        for rid, work in list(self.requests.items()):
            if work[0] and step_kind in (None, "prefill"):
                self.num_computed_tokens += work[0]
                work[0] = 0
            elif not work[0] and step_kind in (None, "decode"):
                self.num_computed_tokens += 1
                work[1] -= 1
                outputs.append(RequestOutput(rid, [7], finished=work[1] == 0))
                if work[1] == 0:
                    del self.requests[rid]
        return outputs


def _loops(num_ranks: int = 2, idle_wait_s: float = 0.02):
    gather = ThreadAllGather(num_ranks)
    engines = [FakeEngine() for _ in range(num_ranks)]
    loops = [EPStepLoop(e, ExpertLoadWindow(4, *MAP_SHAPE), r, gather.rank(r), MAP_SHAPE, idle_wait_s=idle_wait_s)
             for r, e in enumerate(engines)]
    threads = [threading.Thread(target=loop.run, daemon=True) for loop in loops]
    for t in threads:
        t.start()
    return engines, loops, threads


def _drain(loop: EPStepLoop, num_finished: int) -> list[tuple[str, RequestOutput]]:
    items = []
    for batch in loop.outputs():
        items += batch
        if sum(1 for _, o in items if o.finished) == num_finished:
            return items
    raise AssertionError("the output stream ended early")


def _stop(loops, threads, rank: int = 1) -> None:
    loops[rank].request_stop()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)


def test_a_rank_without_requests_keeps_stepping_with_the_other():
    engines, loops, threads = _loops()
    try:
        assert loops[0].add_requests([("a", [1, 2, 3], 3), ("b", [4, 5], 2)]) == {}
        assert loops[0].add_requests([("bad", [], 1)]) == {"bad": "prompt is empty"}
        items = _drain(loops[0], 2)
        assert [o.new_token_ids for rid, o in items if rid == "a"] == [[7]] * 3
    finally:
        _stop(loops, threads)
    stats = [loop.stats() for loop in loops]
    assert stats[0]["num_votes"] == stats[1]["num_votes"] and stats[0]["num_steps"] == stats[1]["num_steps"] == 4
    assert engines[0].steps == engines[1].steps == ["prefill", "decode", "decode", "decode"]
    assert stats[1]["num_empty_steps"] == 4 and stats[0]["num_empty_steps"] == 0  # rank 1 only ran dummy steps
    assert stats[0]["num_steps_by_kind"] == stats[1]["num_steps_by_kind"] == {"prefill": 1, "decode": 3}
    assert stats[0]["loop_error"] is None and not loops[0].is_running
    # after the stop, an add is answered (not left waiting)
    assert "not running" in loops[0].add_requests([("late", [1], 1)], timeout_s=1.0)["late"]


def test_idle_ranks_wait_for_requests_instead_of_spinning():
    engines, loops, threads = _loops(idle_wait_s=0.05)
    try:
        time.sleep(0.5)
    finally:
        _stop(loops, threads, rank=0)
    stats = [loop.stats() for loop in loops]
    assert stats[0]["num_steps"] == 0 and stats[0]["num_votes"] == stats[1]["num_votes"]
    assert 3 <= stats[0]["num_votes"] <= 0.5 / 0.05 + 3  # one vote per idle wait, not a busy loop
    assert engines[0].steps == engines[1].steps == []


def test_placement_moves_in_the_background_and_switches_at_the_same_vote():
    engines, loops, threads = _loops()
    phy2log = torch.tensor([[3, 2, 1, 0]])

    def wait_for(condition) -> None:
        deadline = time.monotonic() + 5
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)

    try:
        loops[0].set_placement(phy2log, 1)
        time.sleep(0.2)  # rank 1 has not got it: nothing moves
        assert [e.moves_started for e in engines] == [[], []]
        loops[1].set_placement(phy2log, 1)  # now both have it: both start the move at the same vote
        wait_for(lambda: all(e.moves_started for e in engines))
        assert engines[0].moves_started == engines[1].moves_started == [0]
        engines[0].move_done.set()  # rank 1's transfers still run: the ranks serve with the old map
        loops[0].add_requests([("a", [1, 2], 6)])
        _drain(loops[0], 1)
        assert [loop.stats()["placement_version"] for loop in loops] == [0, 0]
        assert len(engines[0].steps) == 7 and engines[0].switches == []
        engines[1].move_done.set()  # every rank ready: both switch at the same vote
        wait_for(lambda: all(loop.stats()["placement_version"] == 1 for loop in loops))
    finally:
        _stop(loops, threads)
    assert [loop.stats()["placement_version"] for loop in loops] == [1, 1]
    assert len(engines[0].switches) == 1 and engines[0].switches == engines[1].switches
    assert engines[0].switches == [7]  # after the steps that ran while the weights moved
    assert all(loop.stats()["rebalance_stall_s"] >= 0 for loop in loops)
    with pytest.raises(ValueError, match="already received"):
        loops[0].set_placement(phy2log, 1)
    with pytest.raises(ValueError, match="shape"):
        loops[0].set_placement(torch.zeros(2, 4, dtype=torch.int64), 2)
