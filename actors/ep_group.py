"""Expert parallelism on Ray: one MoE replica as ``ep`` rank actors that drive their own step loops.

DeepSeek's layout: every EP rank is a whole engine (scheduler, KV cache, requests of its own: attention
is data-parallel), while the routed experts of each MoE layer are spread over the ranks and meet in
the layer's collectives (gloo on CPU, NCCL on GPU). Because those collectives need every rank, all
ranks run exactly one forward per step, a rank without work over zero tokens.

Each :class:`~rayinfer.actors.ep_rank.EPRankImpl` runs its own loop: before each step the ranks
all-gather a small vote over a gloo group and all derive the same plan from it
(``rayinfer.policy.ep_vote.plan_step``: the step kind by ``vote_step_kind``, a mixed step when stuck,
an idle wait when no rank has work, a switch of expert map once every rank has it, the stop). The
driver-side :class:`EPEngineGroup` only hands requests to the rank with the fewest live requests and
reads each rank's output stream on a thread: no call per step. With ``eplb.interval`` set, rank 0 tells
an :class:`~rayinfer.actors.eplb_coordinator.EPLBCoordinator` every ``interval`` steps; it pushes a new
map, which the ranks switch to at a step their votes agree on.

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
from typing import Callable

import ray
import ray.exceptions
import torch
from ray.util import remove_placement_group

from rayinfer.actors.ep_rank import ALL_REQUESTS, EPRankActor, EPRankImpl
from rayinfer.actors.eplb_coordinator import EPLBCoordinator
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.errors import EngineInternalError, InvalidRequestError
from rayinfer.engine.output_processor import OutputProcessor, RequestOutputProcessor
from rayinfer.engine.types import Completion, RequestOutput, SamplingParams
from rayinfer.model.loader import load_config, load_tokenizer
from rayinfer.model.moe import moe_shape
from rayinfer.placement.bundles import replica_specs
from rayinfer.placement.groups import collective_backend, create_placement_group, scheduling_strategy_for
from rayinfer.placement.parallel_config import ParallelConfig
from rayinfer.policy.eplb_policy import placement_balance

__all__ = ["EPEngineGroup", "EPLoop", "EPRankActor", "EPRankImpl", "moe_shape"]

logger = logging.getLogger(__name__)

# (request_id, delta or exception) items, as the ranks stream them
OutputItems = list[tuple[str, "RequestOutput | Exception"]]


class EPEngineGroup:
    """The driver's side of one expert-parallel replica: starts the ranks and their loops, spreads
    requests over them (data-parallel attention), and reads their outputs; it issues no steps.

    Outputs arrive on one reader thread per rank (the rank's ``outputs`` stream) and go to ``sink`` (by
    default an internal queue that :meth:`generate` reads), only for requests still live here: a
    request's items after its abort are dropped. When a rank's loop or stream fails, every live request
    of the group gets an :class:`EngineInternalError` (its MoE collectives cannot go on without the rank).

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
        sink: called on a reader thread with each batch of ``(request_id, delta or exception)`` of live
            requests (None: an internal queue, for :meth:`generate`).
        idle_wait_s: how long idle ranks wait for requests between two votes.
    Raises:
        ValueError: for a model without routed experts, or P not divisible by ep.
        TimeoutError: when the cluster cannot place the ranks.
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, parallel: ParallelConfig,
                 placement_strategy: str = "PACK", timeout_s: float = 300.0, max_decode_steps: int = 8,
                 min_prefill_tokens: int = 512, sink: Callable[[OutputItems], None] | None = None,
                 idle_wait_s: float = 0.03):
        self.parallel = parallel
        self.timeout_s = timeout_s
        num_logical, num_groups = moe_shape(load_config(model_config.model))
        num_physical = parallel.eplb.num_physical(num_logical, parallel.ep)
        device = _device_kind(engine_config.device, parallel.ep)
        placed = dataclasses.replace(parallel, device=device, num_cpus_per_replica=parallel.num_cpus_per_replica or 1,
                                     num_gpus_per_replica=1.0 if device == "gpu" else 0.0)
        self._lock = threading.Lock()  # the request bookkeeping below (callers' threads and readers)
        self._live: list[set[str]] = [set() for _ in range(parallel.ep)]  # request ids per rank
        self._rank_of: dict[str, int] = {}
        self._outputs: queue.Queue = queue.Queue()
        self._sink = sink or self._outputs.put
        self._readers: list[threading.Thread] = []
        self._closing = False
        self.error: str | None = None  # why the group cannot serve any more
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
            if parallel.eplb.rebalance_interval > 0:
                self.coordinator = EPLBCoordinator.remote(self.ranks, parallel, self.info[0]["num_moe_layers"],
                                                          num_logical, num_groups)
                # started before the loops: rank 0's first on_step then never queues behind the actor's
                # start-up, where calls of different callers (the driver's history) can overtake it
                ray.get(self.coordinator.history.remote(), timeout=timeout_s)
            ray.get([r.start_loop.remote(self.coordinator, max_decode_steps, min_prefill_tokens, idle_wait_s)
                     for r in self.ranks], timeout=timeout_s)
            for rank, actor in enumerate(self.ranks):
                stream = actor.outputs.options(num_returns="streaming").remote()
                reader = threading.Thread(target=self._read, args=(rank, stream), name=f"ep-outputs-{rank}",
                                          daemon=True)
                reader.start()
                self._readers.append(reader)
        except BaseException:
            self.shutdown()
            raise
        self.max_model_len = self.info[0]["max_model_len"]
        self.tokenizer = load_tokenizer(model_config.model)

    # -- requests --------------------------------------------------------------------------------
    def pick_rank(self) -> int:
        """The rank with the fewest live requests (lowest index on ties)."""
        return min(range(len(self._live)), key=lambda r: len(self._live[r]))

    def send_requests(self, requests: list[tuple[str, list[int], SamplingParams]]) -> list[ray.ObjectRef]:
        """Spread requests (id, prompt token ids, params) over the ranks without waiting for them.

        Returns:
            one ref per rank used, each to that rank's ``id -> error`` of rejected requests; pass the
            results to :meth:`settle` (:meth:`add_requests` does both).
        Raises:
            ValueError: for an id that is already live or given twice (nothing is sent then).
            EngineInternalError: the group has failed.
        """
        if self.error is not None:
            raise EngineInternalError(self.error)
        ids = [req[0] for req in requests]
        batches: list[list] = [[] for _ in self.ranks]
        with self._lock:
            taken = [rid for rid in ids if rid in self._rank_of] or [rid for rid in ids if ids.count(rid) > 1]
            if taken:
                raise ValueError(f"request id {taken[0]!r} is already live or given twice")
            for req in requests:
                rank = self.pick_rank()
                batches[rank].append(req)
                self._live[rank].add(req[0])
                self._rank_of[req[0]] = rank
        return [self.ranks[r].add_requests.remote(batch, self.timeout_s) for r, batch in enumerate(batches) if batch]

    def settle(self, results: list[dict[str, str]]) -> dict[str, str]:
        """Forget the rejected requests of :meth:`send_requests`' results; returns id -> error of them all."""
        errors = {rid: err for rank_errors in results for rid, err in rank_errors.items()}
        with self._lock:
            for rid in errors:
                self._forget(rid)
        return errors

    def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[str, str]:
        """Spread requests (id, prompt token ids, params) over the ranks; returns id -> error of the rejected.

        Raises:
            ValueError: for an id that is already live or given twice (nothing is queued then).
            EngineInternalError: the group has failed.
        """
        return self.settle(ray.get(self.send_requests(requests), timeout=self.timeout_s))

    def abort(self, request_ids: list[str]) -> None:
        """Abort live requests (unknown ids are ignored): forgotten here at once, dropped by their rank
        at its next iteration (without waiting for it)."""
        by_rank: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                if rid in self._rank_of:
                    by_rank.setdefault(self._rank_of[rid], []).append(rid)
                    self._forget(rid)
        for r, ids in by_rank.items():
            self.ranks[r].abort.remote(ids)

    def _forget(self, request_id: str) -> None:
        rank = self._rank_of.pop(request_id, None)
        if rank is not None:
            self._live[rank].discard(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._rank_of)

    # -- outputs ---------------------------------------------------------------------------------
    def _read(self, rank: int, stream) -> None:
        """Reader thread of one rank's output stream: bookkeeping, then the sink."""
        try:
            for ref in stream:
                self._deliver(ray.get(ref))
            if not self._closing:
                self._fail_all(f"EP rank {rank}'s output stream ended")
        except ray.exceptions.RayError as e:
            if not self._closing:
                self._fail_all(f"EP rank {rank} failed: {type(e).__name__}")

    def _deliver(self, items: OutputItems) -> None:
        live: OutputItems = []
        with self._lock:
            for rid, item in items:
                if rid == ALL_REQUESTS:
                    self.error = str(item)
                    live.extend((r, item) for r in self._rank_of)
                    self._rank_of.clear()
                    self._live = [set() for _ in self._live]
                    continue
                if rid not in self._rank_of:
                    continue  # aborted here, or failed with its group
                live.append((rid, item))
                if isinstance(item, Exception) or item.finished:
                    self._forget(rid)
        if live:
            self._sink(live)

    def _fail_all(self, reason: str) -> None:
        logger.error("EP group failed: %s", reason)
        self._deliver([(ALL_REQUESTS, EngineInternalError(reason))])

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 request_ids: list[str] | None = None) -> list[Completion]:
        """Run prompts to completion over the ranks (as ``LLMEngine.generate``, text and stop strings
        included; errors in ``error``). Reads the internal output queue: only with the default sink.

        Raises:
            TimeoutError: no output for ``timeout_s``.
        """
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
        while processor.has_unfinished_requests():
            try:
                items = self._outputs.get(timeout=self.timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no output from the EP ranks in {self.timeout_s} s") from None
            deltas = []
            for rid, item in items:
                if isinstance(item, Exception):
                    if rid in processor.requests:
                        results[rid].error, results[rid].finish_reason = str(item), "error"
                        processor.abort_request(rid)
                else:
                    deltas.append(item)
            processed = processor.process_outputs(deltas)
            if processed.reqs_to_abort:
                self.abort(processed.reqs_to_abort)
            for out in processed.request_outputs:
                results[out.request_id].add(out)
        return [results[rid] for rid in ids]

    # -- stats -----------------------------------------------------------------------------------
    def placement(self) -> torch.Tensor:
        """The expert map in use, [num_moe_layers, P] int64 (rank 0's; all ranks hold the same)."""
        return ray.get(self.ranks[0].placement.remote())

    @property
    def eplb_history(self) -> list[dict]:
        """One summary per EPLB decision so far (num_steps, changed, moe_lb, moe_lb_expected, num_tokens)."""
        if self.coordinator is None:
            return []
        return ray.get(self.coordinator.history.remote())

    def stats(self) -> dict:
        """Per-rank stats (engine, steps by kind, empty steps, votes), the group's steps (rank 0's count;
        all ranks run the same steps), ``moe_lb`` (max/mean rank load over the last window) and
        ``rebalance_stall_s`` (the slowest rank's time spent switching expert maps).

        ``moe_lb`` is computed from the ranks' load windows under the current map, each expert's load
        split evenly over its replicas (``policy.eplb.rank_loads``); a window that spans a map
        switch is measured under the newer map.
        """
        ranks = ray.get([r.stats.remote() for r in self.ranks])
        out = {"ep": len(self.ranks), "num_steps": ranks[0]["num_steps"], "ranks": ranks,
               "rebalance_stall_s": max(r.get("rebalance_stall_s", 0.0) for r in ranks)}
        if self.coordinator is not None:
            out.update(ray.get(self.coordinator.stats.remote()))
        else:
            load = torch.stack(ray.get([r.load_window.remote() for r in self.ranks])).sum(dim=0)
            out["moe_lb"] = placement_balance(load, self.placement(), len(self.ranks))
            out["num_rebalances"] = 0
        return out

    def shutdown(self) -> None:
        """Stop the ranks' loops (one stop reaches all through the vote), kill the ranks and the
        coordinator, and free the placement group."""
        self._closing = True
        ranks = getattr(self, "ranks", [])
        if ranks:
            try:
                ray.get([r.stop.remote(10.0) for r in ranks], timeout=15)
            except Exception:  # noqa: BLE001 - a rank that is gone or stuck is killed below
                logger.warning("EP ranks did not stop in time; killing them")
        for actor in [*ranks, getattr(self, "coordinator", None)]:
            if actor is not None:
                ray.kill(actor)
        self.ranks, self.coordinator = [], None
        for reader in getattr(self, "_readers", []):
            reader.join(timeout=5)
        if getattr(self, "placement_group", None) is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None


def _device_kind(device: str, ep: int) -> str:
    """ParallelConfig device of an engine device: "cpu" or "gpu" ("auto": gpu when ep GPUs exist)."""
    if device == "auto":
        return "gpu" if ray.cluster_resources().get("GPU", 0) >= ep else "cpu"
    return "gpu" if device == "cuda" else "cpu"


class EPLoop:
    """An :class:`EPEngineGroup` serving asyncio streams per request (the Router runs it; requests of
    every client share the group). The ranks step on their own: this class only sends requests, and
    fans the group's outputs out to the streams.

    Outputs leave the ranks as token deltas; text, stop strings and ``min_tokens`` are applied here by
    one :class:`~rayinfer.engine.output_processor.RequestOutputProcessor` per request, on the caller's loop.

    Args:
        model_config, engine_config, parallel: as :class:`EPEngineGroup`.
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, parallel: ParallelConfig):
        self._streams: dict[str, tuple] = {}  # request id -> (loop, asyncio.Queue)
        self.group = EPEngineGroup(model_config, engine_config, parallel, sink=self._deliver)
        self.max_model_len = self.group.max_model_len
        self.tokenizer = self.group.tokenizer

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        """Stream one request's deltas (text included) from its rank.

        Raises:
            InvalidRequestError: the rank rejected the request (or the id is live already).
            EngineInternalError: the group failed.
        """
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        processor = RequestOutputProcessor(self.tokenizer, request_id, list(prompt_token_ids), params)
        self._streams[request_id] = (loop, stream)
        engine_done = False  # the ranks finished or rejected it: nothing to abort there
        try:
            try:
                refs = self.group.send_requests([(request_id, list(prompt_token_ids), params)])
            except ValueError as e:
                engine_done = True
                raise InvalidRequestError(str(e)) from None
            errors = self.group.settle(list(await asyncio.gather(*refs)))
            if request_id in errors:
                engine_done = True
                raise InvalidRequestError(errors[request_id])
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
            if self._streams.get(request_id, (None, stream))[1] is stream:
                del self._streams[request_id]
            if not engine_done:  # the consumer left, or a stop string ended it here
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.group.abort([request_id])

    def _deliver(self, items: OutputItems) -> None:
        """The group's sink (a reader thread): each item to its request's stream, on the stream's loop."""
        for rid, item in items:
            entry = self._streams.get(rid)
            if entry is not None:
                loop, stream = entry
                loop.call_soon_threadsafe(stream.put_nowait, item)

    def stats(self) -> dict:
        return self.group.stats()

    def shutdown(self) -> None:
        self.group.shutdown()
