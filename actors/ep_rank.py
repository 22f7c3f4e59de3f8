"""One EP rank that drives its own step loop: :class:`EPStepLoop` (plain: the loop, its inbox and outbox,
tested without Ray) and :class:`EPRankImpl`, its threaded Ray actor (see ``rayinfer.actors.ep_group``).

Each iteration the loop takes the requests and aborts that reached its inbox, all-gathers a
:class:`~rayinfer.policy.ep_vote.RankVote` (over a gloo group kept for this control traffic, also when
the MoE layers use NCCL), and runs the :class:`~rayinfer.policy.ep_vote.StepPlan` that every rank derives
from the same gathered votes: a switch of expert map, exactly one engine step of the voted kind (a dummy
forward over zero tokens when this rank has none of it), an idle wait for requests, or the exit. Outputs
leave through :meth:`EPRankImpl.outputs`, one Ray stream read by the driver, one list per wake-up.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import logging
import queue
import threading
import time
from typing import Callable, Iterator

import ray
import torch
import torch.distributed as dist

from rayinfer.actors.cluster import configure_worker_logging
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.errors import EngineInternalError
from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.types import RequestOutput, SamplingParams
from rayinfer.model.moe import ExpertParallelism
from rayinfer.placement.groups import destroy_process_group, free_port, init_process_group, node_ip
from rayinfer.placement.parallel_config import ParallelConfig
from rayinfer.policy.ep_vote import NUM_VOTE_FIELDS, RankVote, StepPlan, plan_step
from rayinfer.policy.eplb_policy import ExpertLoadWindow, is_rebalance_step
from rayinfer.policy.routing import StepVote

logger = logging.getLogger(__name__)

# the id of an output-stream item that concerns every request of the rank (its loop failed)
ALL_REQUESTS = ""


class EPStepLoop:
    """One EP rank's own step loop over its engine (plain class: no Ray; the vote's all-gather is injected).

    Each iteration: take the inbox (adds, aborts), all-gather this rank's :class:`RankVote`, derive the
    :class:`StepPlan` every rank derives from the same list (``plan_step``), then switch expert map,
    run exactly one engine step of the agreed kind (``engine.step(run_empty=True, ...)``: a forward over
    zero tokens when this rank has none of that work), wait on the inbox for up to ``idle_wait_s`` when
    no rank had work, or leave. Every rank calls ``all_gather`` once per iteration, so the counts match.

    Thread model: :meth:`run` on one thread alone touches the engine's requests; other threads hand work
    through :meth:`add_requests` / :meth:`abort` / :meth:`set_placement` and read :meth:`stats` under
    ``lock``, which the loop holds while it changes the engine (never while it waits in the all-gather).

    Args:
        engine: the rank's LLMEngine (``scheduler.pending_work``, ``add_request``, ``abort_request``,
            ``step``, ``num_computed_tokens``, ``has_unfinished_requests``, and its model's
            ``expert_load`` / ``update_expert_placement``).
        window: the rank's expert-load window (one record per step).
        ep_rank: this rank's index.
        all_gather: this rank's vote ``[NUM_VOTE_FIELDS]`` ints -> every rank's, in rank order (a
            collective: every rank calls it once per iteration).
        map_shape: (num_moe_layers, P), the shape of an expert map.
        max_decode_steps, min_prefill_tokens: the step vote's rules (``vote_step_kind``).
        idle_wait_s: how long an idle iteration waits on the inbox before voting again (seconds).
        on_step: called with the step count after every step (rank 0 tells the EPLB coordinator), or None.
        move_group: the process group of expert-weight moves (one of their own, so that they run in the
            background beside the steps' collectives); None: the MoE layers' group.

    Expert maps change in two agreed phases (``plan_step``): the weights of an agreed version move in the
    background (``model.start_expert_placement``) while the ranks keep stepping with the map in use, then
    every rank switches at the first vote where all report them ready (``finish_expert_placement``). The
    time a switch takes (waiting for transfers, copying the slots) is ``rebalance_stall_s``.
    A decode step runs at the group's largest decode batch (``engine.runner.group_batch_size``), so that
    every rank replays the same CUDA-graph size and its fixed-size MoE dispatch.
    """

    def __init__(self, engine, window: ExpertLoadWindow, ep_rank: int,
                 all_gather: Callable[[list[int]], list[list[int]]], map_shape: tuple[int, ...],
                 max_decode_steps: int = 8, min_prefill_tokens: int = 512, idle_wait_s: float = 0.03,
                 on_step: Callable[[int], None] | None = None, move_group=None):
        self.engine, self.window, self.ep_rank = engine, window, ep_rank
        self.all_gather, self.map_shape, self.on_step = all_gather, tuple(map_shape), on_step
        self.move_group = move_group
        self.moving: tuple[int, list] | None = None  # (version, its moves in flight) between start and switch
        self.rebalance_stall_s = 0.0  # time spent switching maps (waiting for moves, copying slots)
        self.max_decode_steps, self.min_prefill_tokens = max_decode_steps, min_prefill_tokens
        self.idle_wait_s = idle_wait_s
        self.num_steps = 0  # engine steps run (equal on every rank)
        self.num_votes = 0  # all-gathers of the vote (equal on every rank)
        self.num_idle_waits = 0  # iterations where no rank had work
        self.num_empty_steps = 0  # steps this rank ran over zero tokens for the others
        self.num_decode_steps = 0  # decode steps since this rank's last prefill (or mixed) step
        self.num_steps_by_kind: dict[str, int] = {}  # "prefill" / "decode" / "mixed" -> steps
        self.placement_version = 0  # the expert map in use (0: the initial one)
        self.error: str | None = None  # why the loop failed
        self.is_running = False
        self.lock = threading.Lock()
        self._maps: dict[int, torch.Tensor] = {}  # version -> phy2log received, not yet in use
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()  # lists of (request_id, delta or exception); None ends
        self._stop_requested = threading.Event()

    # -- any thread --------------------------------------------------------------------------------
    def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]],
                     timeout_s: float = 300.0) -> dict[str, str]:
        """Hand requests (id, prompt token ids, params) to the loop and wait until it took them.

        Returns:
            id -> error for those the engine rejected (bad input; all of them when the loop is not
            running or does not take them within ``timeout_s``).
        """
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("add", requests, done))
        waited = 0.0
        while True:
            try:
                return done.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                waited += 0.5
                if not self.is_running or waited >= timeout_s:
                    reason = self.error or "the rank's step loop is not running"
                    return {rid: f"EP rank {self.ep_rank}: {reason}" for rid, _, _ in requests}

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests at the loop's next iteration (unknown ids are ignored)."""
        self._inbox.put(("abort", list(request_ids), None))

    def set_placement(self, phy2log: torch.Tensor, version: int) -> None:
        """Receive expert map ``version``; it is switched to before the first step whose gathered votes
        show every rank has it.

        Args:
            phy2log: [num_moe_layers, P] int64.
            version: increasing from 1, one per changed map.
        Raises:
            ValueError: if the version is not newer than those received or the map's shape is wrong.
        """
        with self.lock:
            newest = max(self._maps, default=self.placement_version)
            if version <= newest:
                raise ValueError(f"placement version {version}, but version {newest} was already received")
            if tuple(phy2log.shape) != self.map_shape:
                raise ValueError(f"phy2log of shape {tuple(phy2log.shape)}, expected {self.map_shape}")
            self._maps[version] = phy2log.to(torch.int64)

    def request_stop(self) -> None:
        """Ask every rank's loop to end: this rank's next vote carries the stop."""
        self._stop_requested.set()
        self._inbox.put(("wake", None, None))

    def outputs(self) -> Iterator[list[tuple[str, RequestOutput | Exception]]]:
        """The loop's outputs (one consumer): one list of ``(request_id, delta or exception)`` per wake-up,
        in step order. An exception under ``ALL_REQUESTS`` means the loop failed and every request of the
        rank is lost. Ends when the loop does."""
        while True:
            batch = self._outbox.get()
            if batch is None:
                return
            items = list(batch)
            while True:  # what queued meanwhile goes in the same item
                try:
                    more = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    yield items
                    return
                items.extend(more)
            yield items

    def stats(self) -> dict:
        """The loop's counts: steps (by kind, empty), votes, idle waits, map version, error."""
        with self.lock:
            return {"ep_rank": self.ep_rank, "num_steps": self.num_steps, "num_empty_steps": self.num_empty_steps,
                    "num_steps_by_kind": dict(self.num_steps_by_kind), "num_votes": self.num_votes,
                    "num_idle_waits": self.num_idle_waits, "placement_version": self.placement_version,
                    "rebalance_stall_s": self.rebalance_stall_s, "loop_error": self.error}

    # -- the loop's thread -------------------------------------------------------------------------
    def run(self) -> None:
        """The loop (its thread's body); returns after the agreed stop, or after a failure (the
        collectives are then out of step: ``error`` is set and the outputs carry it)."""
        self.is_running = True
        progressed, idle = True, False
        try:
            while True:
                self._take_inbox(block_s=self.idle_wait_s if idle else 0.0)
                plan = self._vote(progressed)
                if plan.stop:
                    break
                with self.lock:
                    if plan.placement_version is not None:
                        self._switch_placement(plan.placement_version)
                    if plan.move_version is not None:
                        self._start_move(plan.move_version)
                    idle = not plan.run
                    if idle:
                        self.num_idle_waits += 1
                        continue
                    outputs, progressed = self._step(plan.step_kind, plan.graph_batch_size)
                if outputs:
                    self._outbox.put([(out.request_id, out) for out in outputs])
                if self.on_step is not None:
                    self.on_step(self.num_steps)
        except Exception as e:  # noqa: BLE001 - the collectives are out of step: the group cannot go on
            logger.exception("EP rank %d: step loop failed", self.ep_rank)
            self.error = f"step loop failed: {type(e).__name__}: {e}"
            self._outbox.put([(ALL_REQUESTS, EngineInternalError(f"EP rank {self.ep_rank} {self.error}"))])
        finally:
            self.is_running = False
            self._outbox.put(None)
            self._fail_inbox()

    def _take_inbox(self, block_s: float) -> None:
        """Apply what reached the inbox; when ``block_s`` > 0 and it is empty, wait that long for a message."""
        messages = []
        try:
            if block_s > 0:
                messages.append(self._inbox.get(timeout=block_s))
            while True:
                messages.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        if not messages:
            return
        with self.lock:
            for kind, payload, done in messages:
                if kind == "add":
                    errors = {}
                    for request_id, prompt_token_ids, params in payload:
                        try:
                            self.engine.add_request(request_id, prompt_token_ids, params)
                        except ValueError as e:
                            errors[request_id] = str(e)
                    done.set_result(errors)
                elif kind == "abort":
                    self.engine.abort_request(payload)

    def _fail_inbox(self) -> None:
        """After the loop: answer the adds that will never be taken."""
        while True:
            try:
                kind, payload, done = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and not done.done():
                reason = self.error or "the rank's step loop stopped"
                done.set_result({rid: f"EP rank {self.ep_rank}: {reason}" for rid, _, _ in payload})

    def _vote(self, progressed: bool) -> StepPlan:
        """All-gather this rank's vote and plan the iteration."""
        with self.lock:
            num_prefill_tokens, num_decode = self.engine.scheduler.pending_work()
            ready = self.placement_version
            if self.moving is not None and all(m.is_done() for m in self.moving[1]):
                ready = self.moving[0]
            mine = RankVote(StepVote(num_prefill_tokens, num_decode, self.num_decode_steps),
                            self.engine.has_unfinished_requests(), progressed,
                            max(self._maps, default=self.placement_version), self._stop_requested.is_set(), ready)
        votes = [RankVote.from_list(v) for v in self.all_gather(mine.to_list())]
        self.num_votes += 1
        return plan_step(votes, self.placement_version, self.max_decode_steps, self.min_prefill_tokens,
                         moving_version=self.moving[0] if self.moving is not None else None)

    def _start_move(self, version: int) -> None:
        """Start moving the weights of expert map ``version`` in the background (every rank at the same
        iteration: the sends and receives pair up across ranks)."""
        self.moving = (version, self.engine.model.start_expert_placement(self._maps[version], self.move_group))

    def _switch_placement(self, version: int) -> None:
        """Switch to expert map ``version``, whose move every rank reported ready (same iteration everywhere)."""
        assert self.moving is not None and self.moving[0] == version
        started = time.perf_counter()
        self.engine.model.finish_expert_placement(self.moving[1])
        self.rebalance_stall_s += time.perf_counter() - started
        self._maps = {v: m for v, m in self._maps.items() if v > version}
        self.moving = None
        self.placement_version = version

    def _step(self, step_kind: str | None, graph_batch_size: int | None = None) -> tuple[list[RequestOutput], bool]:
        """One engine step of the agreed kind; records the step's expert load.

        ``graph_batch_size``: a decode step's group batch size (the CUDA-graph size every rank replays).
        Returns:
            (the step's outputs, whether this rank computed any token).
        """
        computed = self.engine.num_computed_tokens
        runner = getattr(self.engine, "runner", None)
        if runner is not None:
            runner.group_batch_size = graph_batch_size
        outputs = self.engine.step(run_empty=True, step_kind=step_kind)
        progressed = self.engine.num_computed_tokens != computed
        self.num_empty_steps += not progressed
        self.num_decode_steps = self.num_decode_steps + 1 if step_kind == "decode" else 0
        self.num_steps_by_kind[step_kind or "mixed"] = self.num_steps_by_kind.get(step_kind or "mixed", 0) + 1
        self.window.record(self.engine.model.expert_load(reset=True))
        self.num_steps += 1
        return outputs, progressed


class EPRankImpl:
    """One EP rank: an LLMEngine whose MoE layers hold 1/ep of the physical experts, stepping on its own
    (the Ray shell of an :class:`EPStepLoop`).

    Life cycle: construct (cheap) -> :meth:`address` on rank 0 -> :meth:`start` on every rank at once
    (joins the process group, loads the model) -> :meth:`start_loop` on every rank -> requests through
    :meth:`add_requests` / :meth:`abort`, outputs from :meth:`outputs` -> :meth:`stop` (any rank's stop
    ends every rank's loop at the same vote). The actor is threaded: the loop has a thread of its own,
    the output stream holds one, and calls that wait on the loop (adds, stats, EPLB) take the others.

    Args:
        ep_rank: this rank's index in the EP group (= its global rank in the group's process group).
        config: the parallel config (``ep`` and its ``eplb`` section).
    """

    def __init__(self, ep_rank: int, config: ParallelConfig):
        configure_worker_logging()
        self.ep_rank = ep_rank
        self.config = config
        self.engine: LLMEngine | None = None
        self.window: ExpertLoadWindow | None = None
        self.loop: EPStepLoop | None = None
        self._map_shape: tuple[int, ...] = ()
        self._control = None  # the gloo group of the votes
        self._moves = None  # the process group of expert-weight moves
        self._thread: threading.Thread | None = None

    def address(self) -> tuple[str, int]:
        """(IP, free port) for the process group's rendezvous (asked of rank 0)."""
        return node_ip(), free_port()

    @property
    def _loop(self) -> EPStepLoop:
        """The running loop.

        Raises:
            RuntimeError: before :meth:`start_loop`.
        """
        if self.loop is None:
            raise RuntimeError(f"EP rank {self.ep_rank}: call start and start_loop first")
        return self.loop

    def start(self, model_config: ModelConfig, engine_config: EngineConfig, num_physical: int,
              master_addr: str, master_port: int, backend: str, timeout_s: float = 300.0) -> dict:
        """Join the EP process group (and its gloo group for votes) and load the model with this rank's experts.

        Args:
            model_config, engine_config: as for LLMEngine (the engine is made synchronous; on CUDA its
                decode graphs are captured unless ``enforce_eager``, every rank at once).
            num_physical: P, physical experts per MoE layer.
            master_addr, master_port: rank 0's rendezvous address.
            backend: "gloo" or "nccl" (the MoE layers' collectives; votes always go over gloo).
            timeout_s: seconds for the rendezvous and for any collective (a vote waits this long for a
                rank that is gone).
        Returns:
            the rank's facts: ep_rank, num_moe_layers, num_logical, num_physical, device, max_model_len.
        Raises:
            ValueError: if the model is not a MoE model or P does not split over the ranks.
        """
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray exposes this rank's one GPU as device 0
        init_process_group(self.ep_rank, self.config.ep, master_addr, master_port, backend, timeout_s)
        # every rank creates them in the same order, right after the default group: the votes' gloo group,
        # and the expert-weight moves' own group (they run in the background beside the steps' collectives)
        self._control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._moves = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        group = dist.group.WORLD if self.config.ep > 1 else None
        # synchronous steps (the loop reads each step's outputs before voting again); CUDA graphs stay on:
        # decode steps replay the group's batch size with fixed-size dispatch buffers (EPStepLoop)
        engine_config = dataclasses.replace(engine_config, async_scheduling=False)
        ep = ExpertParallelism(group=group, num_physical_experts=num_physical)
        self.engine = LLMEngine(model_config, engine_config, model_kwargs={"ep": ep})
        self.engine.runner.in_group = group is not None
        model = self.engine.model
        if not hasattr(model, "expert_layers") or not model.expert_layers():
            raise ValueError(f"{type(model).__name__} has no routed-expert layers: not a MoE model")
        num_moe_layers = len(model.expert_layers())
        num_logical = model.expert_layers()[0].num_logical_experts
        self.window = ExpertLoadWindow(self.config.eplb.load_window, num_moe_layers, num_logical, self.engine.device)
        self._map_shape = (num_moe_layers, num_physical)
        return {"ep_rank": self.ep_rank, "num_moe_layers": num_moe_layers, "num_logical": num_logical,
                "num_physical": num_physical, "device": str(self.engine.device),
                "max_model_len": self.engine.max_model_len}

    def start_loop(self, coordinator=None, max_decode_steps: int = 8, min_prefill_tokens: int = 512,
                   idle_wait_s: float = 0.03) -> None:
        """Start the step loop (call on every rank after :meth:`start`; a second call does nothing).

        Args:
            coordinator: the EPLBCoordinator, told every ``eplb.interval`` steps by rank 0 (None: no EPLB).
            max_decode_steps, min_prefill_tokens: the step vote's rules (``vote_step_kind``).
            idle_wait_s: how long an idle iteration waits on the inbox before voting again.
        """
        if self._thread is not None:
            return
        on_step = None
        if coordinator is not None and self.ep_rank == 0:
            interval = self.config.eplb.rebalance_interval

            def on_step(num_steps: int) -> None:
                if is_rebalance_step(num_steps, interval):
                    coordinator.on_step.remote(num_steps)  # it rebalances while the ranks go on

        self.loop = EPStepLoop(self.engine, self.window, self.ep_rank, self._all_gather, self._map_shape,
                               max_decode_steps, min_prefill_tokens, idle_wait_s, on_step, self._moves)
        self._thread = threading.Thread(target=self._run, name=f"ep-rank-{self.ep_rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)  # the current device is per thread
        self.loop.run()

    def _all_gather(self, vote: list[int]) -> list[list[int]]:
        """The votes of every rank: [ep, NUM_VOTE_FIELDS] int64 over the gloo group."""
        send = torch.tensor(vote, dtype=torch.int64)
        gathered = [torch.empty(NUM_VOTE_FIELDS, dtype=torch.int64) for _ in range(self.config.ep)]
        dist.all_gather(gathered, send, group=self._control)
        return [t.tolist() for t in gathered]

    # -- requests (any thread) ---------------------------------------------------------------------
    def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]],
                     timeout_s: float = 300.0) -> dict[str, str]:
        """Hand requests (id, prompt token ids, params) to the loop; returns id -> error of the rejected
        (see :meth:`EPStepLoop.add_requests`)."""
        return self._loop.add_requests(requests, timeout_s)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests at the loop's next iteration (unknown ids are ignored)."""
        self._loop.abort(request_ids)

    def outputs(self) -> Iterator[list[tuple[str, RequestOutput | Exception]]]:
        """The rank's outputs (call with ``num_returns="streaming"``; one consumer): see
        :meth:`EPStepLoop.outputs`."""
        yield from self._loop.outputs()

    # -- EPLB (any thread) -------------------------------------------------------------------------
    def load_window(self) -> torch.Tensor:
        """This rank's expert load over its window: [num_moe_layers, L] int64 (CPU)."""
        with self._loop.lock:
            return self.window.total()

    def set_placement(self, phy2log: torch.Tensor, version: int) -> None:
        """Receive expert map ``version`` (see :meth:`EPStepLoop.set_placement`).

        Raises:
            ValueError: an old version or a map of the wrong shape.
        """
        self._loop.set_placement(phy2log, version)

    def placement(self) -> torch.Tensor:
        """The map in use: [num_moe_layers, P] int64 (CPU)."""
        with self._loop.lock:
            return torch.stack([layer.phy2log.cpu() for layer in self.engine.model.expert_layers()])

    def stats(self) -> dict:
        """Engine stats plus the loop's counts (:meth:`EPStepLoop.stats`)."""
        with self._loop.lock:
            engine = {**self.engine.stats(), "num_group_graph_steps": self.engine.runner.num_group_graph_steps}
        return {**self._loop.stats(), **engine}

    def is_looping(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- stop --------------------------------------------------------------------------------------
    def stop(self, timeout_s: float = 30.0) -> bool:
        """Ask every rank's loop to end (through this rank's next vote) and wait for this one's.

        Returns:
            whether this rank's loop has ended.
        """
        if self.loop is not None:
            self.loop.request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.is_looping()

    def shutdown(self) -> None:
        """Stop the loop and leave the process group (call on every rank together, or not at all)."""
        self.stop()
        destroy_process_group()


# threads: the loop's own, the output stream, and calls that wait on the loop (adds, stats, EPLB)
EPRankActor = ray.remote(max_concurrency=16)(EPRankImpl)
