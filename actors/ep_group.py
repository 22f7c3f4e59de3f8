"""Expert parallelism on Ray: one MoE replica as ``ep`` rank actors that step in lockstep.

DeepSeek's layout: every EP rank is a whole engine (scheduler, KV cache, requests of its own: attention
is data-parallel), while the routed experts of each MoE layer are spread over the ranks and meet in
the layer's collectives (gloo on CPU, NCCL on GPU). Because those collectives need every rank, all
ranks run exactly one forward per step, a rank without work over zero tokens; the driver-side
:class:`EPEngineGroup` issues every rank's ``step`` in one ``ray.get``. With ``eplb.interval`` set, an
:class:`~rayinfer.actors.eplb_coordinator.EPLBCoordinator` rebalances the experts between steps.

    group = EPEngineGroup(ModelConfig("path/to/moe"), EngineConfig(device="cpu"), ParallelConfig(ep=2))
    completions = group.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    group.stats()["moe_lb"]; group.shutdown()
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading

import ray
import torch
import torch.distributed as dist
from ray.util import remove_placement_group

from rayinfer.actors.eplb_coordinator import EPLBCoordinator
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.errors import EngineInternalError, InvalidRequestError
from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.output_processor import OutputProcessor, RequestOutputProcessor
from rayinfer.engine.types import Completion, RequestOutput, SamplingParams
from rayinfer.model.loader import load_config, load_tokenizer
from rayinfer.model.moe import ExpertParallelism
from rayinfer.placement.bundles import replica_specs
from rayinfer.placement.groups import (
    collective_backend,
    create_placement_group,
    destroy_process_group,
    free_port,
    init_process_group,
    node_ip,
    scheduling_strategy_for,
)
from rayinfer.placement.parallel_config import ParallelConfig
from rayinfer.policy.eplb_policy import ExpertLoadWindow, is_rebalance_step, placement_balance
from rayinfer.policy.routing import StepVote, vote_step_kind

logger = logging.getLogger(__name__)


def moe_shape(hf_config) -> tuple[int, int]:
    """(L routed experts per MoE layer, expert groups of the routing) of a Hugging Face MoE config.

    Raises:
        ValueError: for a config without routed experts.
    """
    num_logical = getattr(hf_config, "n_routed_experts", None) or getattr(hf_config, "num_experts", None)
    if not num_logical:
        raise ValueError(f"{getattr(hf_config, 'architectures', None)} is not a MoE model: expert parallelism "
                         "needs routed experts (n_routed_experts or num_experts)")
    return int(num_logical), int(getattr(hf_config, "n_group", None) or 1)


class EPRankImpl:
    """One EP rank: an LLMEngine whose MoE layers hold 1/ep of the physical experts.

    Life cycle: construct (cheap) -> :meth:`address` on rank 0 -> :meth:`start` on every rank at
    once (joins the process group, loads the model) -> lockstep :meth:`step` calls.

    Args:
        ep_rank: this rank's index in the EP group (= its global rank in the group's process group).
        config: the parallel config (``ep`` and its ``eplb`` section).
    """

    def __init__(self, ep_rank: int, config: ParallelConfig):
        self.ep_rank = ep_rank
        self.config = config
        self.engine = None
        self.window: ExpertLoadWindow | None = None
        self.num_steps = 0  # lockstep steps completed (equal on every rank)
        self.num_empty_steps = 0  # steps this rank ran over zero tokens for the others
        self.num_decode_steps = 0  # decode steps since this rank's last prefill (or mixed) step
        self.num_steps_by_kind: dict[str, int] = {}  # "prefill" / "decode" / "mixed" -> steps
        self._pending: tuple[int, torch.Tensor] | None = None  # (apply before step n, phy2log)

    def address(self) -> tuple[str, int]:
        """(IP, free port) for the process group's rendezvous (asked of rank 0)."""
        return node_ip(), free_port()

    def start(self, model_config: ModelConfig, engine_config: EngineConfig, num_physical: int,
              master_addr: str, master_port: int, backend: str, timeout_s: float = 300.0) -> dict:
        """Join the EP process group and load the model with this rank's experts.

        Args:
            model_config, engine_config: as for LLMEngine (the engine is made eager and synchronous:
                the MoE collectives sync the host each step, and CUDA graphs cannot hold them).
            num_physical: P, physical experts per MoE layer.
            master_addr, master_port: rank 0's rendezvous address.
            backend: "gloo" or "nccl".
        Returns:
            the rank's facts: ep_rank, num_moe_layers, num_logical, num_physical, device, max_model_len.
        Raises:
            ValueError: if the model is not a MoE model or P does not split over the ranks.
        """
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray exposes this rank's one GPU as device 0
        init_process_group(self.ep_rank, self.config.ep, master_addr, master_port, backend, timeout_s)
        group = dist.group.WORLD if self.config.ep > 1 else None
        sync = {k: v for k, v in (("async_scheduling", False), ("enforce_eager", True))
                if hasattr(engine_config, k)}
        engine_config = dataclasses.replace(engine_config, **sync)
        ep = ExpertParallelism(group=group, num_physical_experts=num_physical)
        self.engine = LLMEngine(model_config, engine_config, model_kwargs={"ep": ep})
        model = self.engine.model
        if not hasattr(model, "expert_layers") or not model.expert_layers():
            raise ValueError(f"{type(model).__name__} has no routed-expert layers: not a MoE model")
        num_moe_layers = len(model.expert_layers())
        num_logical = model.expert_layers()[0].num_logical_experts
        self.window = ExpertLoadWindow(self.config.eplb.window, num_moe_layers, num_logical, self.engine.device)
        return {"ep_rank": self.ep_rank, "num_moe_layers": num_moe_layers, "num_logical": num_logical,
                "num_physical": num_physical, "device": str(self.engine.device),
                "max_model_len": self.engine.max_model_len}

    # -- requests --------------------------------------------------------------------------------
    def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]]) -> tuple[dict[str, str], StepVote]:
        """Queue requests (id, prompt token ids, params).

        Returns:
            (id -> error for those rejected, this rank's step vote now).
        """
        errors = {}
        for request_id, prompt_token_ids, params in requests:
            try:
                self.engine.add_request(request_id, prompt_token_ids, params)
            except ValueError as e:
                errors[request_id] = str(e)
        return errors, self.vote()

    def vote(self) -> StepVote:
        """This rank's view before the next step (DeepSeek's DP step vote; see ``vote_step_kind``)."""
        num_prefill_tokens, num_decode = self.engine.scheduler.pending_work()
        return StepVote(num_prefill_tokens, num_decode, self.num_decode_steps)

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)

    # -- the lockstep step -----------------------------------------------------------------------
    def step(self, step_kind: str | None = None) -> tuple[list[RequestOutput], bool, StepVote, bool]:
        """One lockstep step: switch expert placement if one is due now, run one forward of the group's
        voted kind (zero tokens when this rank has none of it), record the step's expert load.

        Every rank of the group must call it the same number of times with the same ``step_kind`` (the
        MoE layers are collectives).

        Args:
            step_kind: "prefill", "decode", or None for both (``Scheduler.schedule``).
        Returns:
            (the step's request outputs, whether this rank still has unfinished requests, its vote for
            the next step, whether it computed any token).
        """
        if self._pending is not None and self._pending[0] == self.num_steps:
            self.engine.model.update_expert_placement(self._pending[1])  # collective, same step everywhere
            self._pending = None
        computed = self.engine.num_computed_tokens
        outputs = self.engine.step(run_empty=True, step_kind=step_kind)
        progressed = self.engine.num_computed_tokens != computed
        self.num_empty_steps += not progressed
        self.num_decode_steps = self.num_decode_steps + 1 if step_kind == "decode" else 0
        self.num_steps_by_kind[step_kind or "mixed"] = self.num_steps_by_kind.get(step_kind or "mixed", 0) + 1
        self.window.record(self.engine.model.expert_load(reset=True))
        self.num_steps += 1
        return outputs, self.engine.has_unfinished_requests(), self.vote(), progressed

    # -- EPLB ------------------------------------------------------------------------------------
    def load_window(self) -> torch.Tensor:
        """This rank's expert load over its window: [num_moe_layers, L] int64 (CPU)."""
        return self.window.total()

    def set_placement(self, phy2log: torch.Tensor, apply_at_step: int) -> None:
        """Schedule a new expert map, switched to before step ``apply_at_step`` (on every rank alike).

        Args:
            phy2log: [num_moe_layers, P] int64.
            apply_at_step: a step number not yet run here.
        Raises:
            ValueError: if the step has already run or the map's shape is wrong.
        """
        if apply_at_step < self.num_steps:
            raise ValueError(f"placement due before step {apply_at_step}, but {self.num_steps} steps have run")
        expected = tuple(self.placement().shape)
        if tuple(phy2log.shape) != expected:
            raise ValueError(f"phy2log of shape {tuple(phy2log.shape)}, expected {expected}")
        self._pending = (apply_at_step, phy2log)

    def placement(self) -> torch.Tensor:
        """The map in use: [num_moe_layers, P] int64 (CPU)."""
        return torch.stack([layer.phy2log.cpu() for layer in self.engine.model.expert_layers()])

    def stats(self) -> dict:
        return {"ep_rank": self.ep_rank, "num_steps": self.num_steps, "num_empty_steps": self.num_empty_steps,
                "num_steps_by_kind": dict(self.num_steps_by_kind), **self.engine.stats()}

    def shutdown(self) -> None:
        """Leave the process group (call on every rank together, or not at all)."""
        destroy_process_group()


EPRankActor = ray.remote(EPRankImpl)


class EPEngineGroup:
    """The driver's side of one expert-parallel replica: starts the ranks, spreads requests over them
    (data-parallel attention), and drives lockstep steps and the EPLB coordinator.

    Args:
        model_config: a MoE model (DeepSeek-V3 or Qwen3-MoE architecture); every rank loads it, so
            weights must be a checkpoint directory or ``load_format="dummy"`` (seeded: identical).
        engine_config: every rank's engine config (``device`` "cpu" uses gloo, "cuda" NCCL with one
            GPU per rank; "auto" picks cuda when the cluster has ``ep`` GPUs).
        parallel: ``ep`` and the ``eplb`` section (redundant experts, interval, window); its per-rank
            resources (``num_cpus_per_replica``, one GPU per rank on "cuda").
        placement_strategy: Ray placement-group strategy of the ranks' bundles.
        timeout_s: seconds to wait for the placement group, for start-up, and for a collective.
        max_decode_steps, min_prefill_tokens: the step vote's rules (``vote_step_kind``): a prefill step
            once a rank decoded this many steps in a row, or once this many prompt tokens wait.
    Raises:
        ValueError: for a model without routed experts, or P not divisible by ep.
        TimeoutError: when the cluster cannot place the ranks.
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, parallel: ParallelConfig,
                 placement_strategy: str = "PACK", timeout_s: float = 300.0, max_decode_steps: int = 8,
                 min_prefill_tokens: int = 512):
        self.parallel = parallel
        num_logical, num_groups = moe_shape(load_config(model_config.model))
        num_physical = num_logical + parallel.eplb.num_redundant_experts
        if num_physical % parallel.ep:
            raise ValueError(f"{num_logical} experts + eplb.num_redundant_experts="
                             f"{parallel.eplb.num_redundant_experts} do not split over ep={parallel.ep} ranks")
        device = _device_kind(engine_config.device, parallel.ep)
        placed = dataclasses.replace(parallel, device=device, num_cpus_per_replica=parallel.num_cpus_per_replica or 1,
                                     num_gpus_per_replica=1.0 if device == "gpu" else 0.0)
        self.placement_group = create_placement_group(placed, strategy=placement_strategy, timeout_s=timeout_s)
        (spec,) = replica_specs(placed)
        self.ranks = [
            EPRankActor.options(scheduling_strategy=scheduling_strategy_for(self.placement_group, info.rank),
                                num_cpus=placed.num_cpus_per_replica,
                                num_gpus=placed.num_gpus_per_replica).remote(info.ep_rank, parallel)
            for info in spec.ranks
        ]
        self.coordinator = None
        try:
            addr, port = ray.get(self.ranks[0].address.remote(), timeout=timeout_s)
            self.info = ray.get([r.start.remote(model_config, engine_config, num_physical, addr, port,
                                                collective_backend(device), timeout_s) for r in self.ranks],
                                timeout=timeout_s)
            if parallel.eplb.interval > 0:
                self.coordinator = EPLBCoordinator.remote(self.ranks, parallel, self.info[0]["num_moe_layers"],
                                                          num_logical, num_groups)
        except BaseException:
            self.shutdown()
            raise
        self.max_model_len = self.info[0]["max_model_len"]
        self.tokenizer = load_tokenizer(model_config.model)
        self.num_steps = 0
        self._live: list[set[str]] = [set() for _ in self.ranks]  # request ids per rank
        self._busy = [False] * len(self.ranks)  # rank reported unfinished requests after its last step
        self._rank_of: dict[str, int] = {}
        self._votes = [StepVote() for _ in self.ranks]  # each rank's view before the next step
        self._progressed = True  # the last step computed tokens on some rank
        self.max_decode_steps, self.min_prefill_tokens = max_decode_steps, min_prefill_tokens
        self.eplb_history: list[dict] = []

    # -- requests --------------------------------------------------------------------------------
    def pick_rank(self) -> int:
        """The rank with the fewest live requests (lowest index on ties)."""
        return min(range(len(self.ranks)), key=lambda r: len(self._live[r]))

    def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[str, str]:
        """Spread requests (id, prompt token ids, params) over the ranks; returns id -> error of the rejected.

        Raises:
            ValueError: for an id that is already live or given twice (nothing is queued then).
        """
        ids = [req[0] for req in requests]
        taken = [rid for rid in ids if rid in self._rank_of] or [rid for rid in ids if ids.count(rid) > 1]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already live or given twice")
        batches: list[list] = [[] for _ in self.ranks]
        for req in requests:
            rank = self.pick_rank()
            batches[rank].append(req)
            self._live[rank].add(req[0])
            self._rank_of[req[0]] = rank
        refs = {r: self.ranks[r].add_requests.remote(batch) for r, batch in enumerate(batches) if batch}
        errors: dict[str, str] = {}
        for rank, ref in refs.items():
            rank_errors, self._votes[rank] = ray.get(ref)
            for rid, err in rank_errors.items():
                errors[rid] = err
                self._forget(rid)
            self._busy[rank] = self._busy[rank] or bool(self._live[rank])
        return errors

    def abort(self, request_ids: list[str]) -> None:
        """Abort live requests (unknown ids are ignored)."""
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self._rank_of:
                by_rank.setdefault(self._rank_of[rid], []).append(rid)
                self._forget(rid)
        ray.get([self.ranks[r].abort.remote(ids) for r, ids in by_rank.items()])

    def _forget(self, request_id: str) -> None:
        rank = self._rank_of.pop(request_id, None)
        if rank is not None:
            self._live[rank].discard(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(self._busy) or any(self._live)

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One lockstep step of every rank (one ``ray.get``), of the kind the ranks' votes give
        (``vote_step_kind``: every rank runs the same kind, a rank without such work a dummy step), then
        EPLB when due.

        Returns:
            the outputs of all ranks; nothing runs (and [] returns) when no rank has work.
        """
        if not self.has_unfinished_requests():
            return []
        kind = vote_step_kind(self._votes, self.max_decode_steps, self.min_prefill_tokens)
        # a mixed step when the vote is idle but a rank is still busy, or when the last voted step moved no
        # rank (prompts that cannot be admitted until decodes free KV blocks must not stall the group)
        step_kind = None if kind == "idle" or not self._progressed else kind
        results = ray.get([r.step.remote(step_kind) for r in self.ranks])
        self.num_steps += 1
        outputs = []
        self._progressed = any(r[3] for r in results)
        for rank, (outs, busy, vote, _) in enumerate(results):
            self._busy[rank], self._votes[rank] = busy, vote
            for out in outs:
                if out.finished:
                    self._forget(out.request_id)
            outputs.extend(outs)
        if self.coordinator is not None and is_rebalance_step(self.num_steps, self.parallel.eplb.interval):
            summary = ray.get(self.coordinator.on_step.remote(self.num_steps))
            if summary is not None:
                self.eplb_history.append(summary)
                logger.info("EPLB after step %d: moe_lb %.3f -> %.3f expected%s", self.num_steps,
                            summary["moe_lb"], summary["moe_lb_expected"], "" if summary["changed"] else " (kept)")
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 request_ids: list[str] | None = None) -> list[Completion]:
        """Run prompts to completion over the ranks (as ``LLMEngine.generate``, text and stop strings
        included; errors in ``error``)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = request_ids or [f"gen-{i}" for i in range(len(prompts))]
        results = {rid: Completion(rid, list(p)) for rid, p in zip(ids, prompts)}
        processor = OutputProcessor(self.tokenizer)
        for rid, prompt, p in zip(ids, prompts, params_list):
            processor.add_request(rid, prompt, p)
        errors = self.add_requests(list(zip(ids, prompts, params_list)))
        for rid, err in errors.items():
            results[rid].error, results[rid].finish_reason = err, "error"
            processor.abort_request(rid)
        while self.has_unfinished_requests():
            processed = processor.process_outputs(self.step())
            if processed.reqs_to_abort:
                self.abort(processed.reqs_to_abort)
            for out in processed.request_outputs:
                results[out.request_id].add(out)
        return [results[rid] for rid in ids]

    # -- stats -----------------------------------------------------------------------------------
    def placement(self) -> torch.Tensor:
        """The expert map in use, [num_moe_layers, P] int64 (rank 0's; all ranks hold the same)."""
        return ray.get(self.ranks[0].placement.remote())

    def stats(self) -> dict:
        """Per-rank engine stats, lockstep steps, and ``moe_lb`` (max/mean rank load over the last window).

        ``moe_lb`` is computed from the ranks' load windows under the current map, each expert's load
        split evenly over its replicas (``policy.eplb.rank_loads``); a window that spans a map
        switch is measured under the newer map.
        """
        ranks = ray.get([r.stats.remote() for r in self.ranks])
        out = {"ep": len(self.ranks), "num_steps": self.num_steps, "ranks": ranks}
        if self.coordinator is not None:
            out.update(ray.get(self.coordinator.stats.remote()))
        else:
            load = torch.stack(ray.get([r.load_window.remote() for r in self.ranks])).sum(dim=0)
            out["moe_lb"] = placement_balance(load, self.placement(), len(self.ranks))
            out["num_rebalances"] = 0
        return out

    def shutdown(self) -> None:
        """Kill the ranks and the coordinator, and free the placement group."""
        for actor in [*getattr(self, "ranks", []), self.coordinator]:
            if actor is not None:
                ray.kill(actor)
        self.ranks, self.coordinator = [], None
        if getattr(self, "placement_group", None) is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None


def _device_kind(device: str, ep: int) -> str:
    """ParallelConfig device of an engine device: "cpu" or "gpu" ("auto": gpu when ep GPUs exist)."""
    if device == "auto":
        return "gpu" if ray.cluster_resources().get("GPU", 0) >= ep else "cpu"
    return "gpu" if device == "cuda" else "cpu"


class EPLoop:
    """The lockstep loop of an :class:`EPEngineGroup` on a background thread, with asyncio streams per
    request (the Router runs it; requests of every client share the group).

    Outputs leave the ranks as token deltas; text, stop strings and ``min_tokens`` are applied here by
    one :class:`~rayinfer.engine.output_processor.RequestOutputProcessor` per request, on the caller's loop.

    Args:
        model_config, engine_config, parallel: as :class:`EPEngineGroup`.
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, parallel: ParallelConfig):
        self.group = EPEngineGroup(model_config, engine_config, parallel)
        self.max_model_len = self.group.max_model_len
        self.tokenizer = self.group.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple] = {}  # request id -> (loop, asyncio.Queue)
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="ep-loop", daemon=True)
        self._thread.start()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        """Stream one request's deltas (text included) from the lockstep loop.

        Raises:
            InvalidRequestError: the rank rejected the request.
        """
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        processor = RequestOutputProcessor(self.tokenizer, request_id, list(prompt_token_ids), params)
        self._streams[request_id] = (loop, stream)
        self._inbox.put(("add", request_id, list(prompt_token_ids), params))
        engine_done = False  # the ranks finished or rejected it: nothing to abort there
        try:
            while True:
                item = await stream.get()
                if isinstance(item, Exception):
                    engine_done = True
                    raise item
                engine_done = item.finished
                out = processor.process(item)
                if out is None:
                    continue
                yield out
                if out.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not engine_done:  # the consumer left, or a stop string ended it here
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def _deliver(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _loop(self) -> None:
        while not self._stopped:
            adds, aborts = [], []
            try:
                while True:
                    msg = self._inbox.get(block=not adds and not aborts and not self.group.has_unfinished_requests(),
                                          timeout=0.2)
                    (adds if msg[0] == "add" else aborts).append(msg)
            except queue.Empty:
                pass
            if aborts:
                self.group.abort([m[1] for m in aborts])
            if adds:
                errors = self.group.add_requests([(rid, prompt, params) for _, rid, prompt, params in adds])
                for rid, err in errors.items():
                    self._deliver(rid, InvalidRequestError(err))
            try:
                outputs = self.group.step()
            except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep the loop
                logger.exception("EP step failed")
                for rid in list(self._streams):
                    self._deliver(rid, EngineInternalError(f"EP step failed: {type(e).__name__}: {e}"))
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    def stats(self) -> dict:
        return self.group.stats()

    def shutdown(self) -> None:
        self._stopped = True
        self._thread.join(timeout=10)
        self.group.shutdown()
