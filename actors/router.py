"""Router: the one owner of a fleet of engine replicas and of its load balancers (a Ray actor).

The fleet is started once, by the batch job or by Serve's ``EngineFleet`` deployment, and any number of
clients (Serve ingress replicas, the job's driver) share it and its one view of load:

- colocated: ``dp`` NORMAL replicas; clients ask :meth:`Router.pick` for a replica (prefix affinity,
  least in flight; ``rayinfer.policy.routing.ReplicaLoadBalancer``) and stream from it directly;
- pd: prefill and decode replicas and a KV store; clients run each request's PD state machine
  (``rayinfer.actors.pd``) and ask the router for prefill and decode tickets; KV transfers over the
  fleet's transfer group (nccl, gloo) are batched here: the requests waiting to move between a pair of
  replicas go as one send/recv, one batch at a time per replica (send/recv pairs must line up, so one
  process orders them), each batch first reserving its bytes from the decode replica's budget; over
  cuda_ipc (replicas sharing a GPU) each request reserves its bytes there before it moves;
- ep: one expert-parallel replica whose ranks drive their own step loops (they agree on each step by
  an all-gathered vote); requests stream through :meth:`Router.generate`, which sends them to a rank
  and reads the ranks' output streams here (``rayinfer.actors.ep_group.EPLoop``), with no call per step.

With ``parallel.encoder.num_encoders > 0`` (colocated or pd; "epd" for encode / prefill / decode
disaggregation) the fleet also runs that many EncoderActors (``rayinfer.actors.encoder_actor``), one
placement group of one bundle each; clients send every request's images there first and pass the
embeddings' object refs on to the prefill (or NORMAL) replica, whose encoder then never runs.

With ``parallel.cp > 1`` (colocated only) each replica is ``cp`` ranks in one placement group: the
EngineActor on bundle 0 and ``cp - 1`` CP peers (EngineActors too, ``rayinfer.actors.cp_group``) that join
its long prefills and otherwise serve short prompts of their own: the fleet's replicas are the rank 0s, then
the peers, and :meth:`Router.pick` sends prompts of ``cp_min_tokens`` or more to a rank 0.

Data between clients and replicas flows directly where it can (tokens of colocated and PD requests
never pass through the router); the router only decides. Each replica is placed by a placement group
whose bundles come from the ParallelConfig (``rayinfer.placement``); a cluster that cannot grant them
fails start-up with a message that names what is missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, TypeVar

import ray
import ray.exceptions
from ray.util import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayinfer.actors.cluster import configure_worker_logging
from rayinfer.actors.cp_group import start_cp_group
from rayinfer.actors.encoder_actor import EncoderActor, EncoderActorRDT, check_encoder_model, resolve_encoder_transport
from rayinfer.actors.engine_actor import EngineActor, EngineActorImpl
from rayinfer.actors.kv_store import KVStoreActor
from rayinfer.actors.kv_transport import COLLECTIVE_TRANSPORTS, resolve_kv_transport
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.errors import EngineInternalError, ReplicasDeadError, UnsupportedError
from rayinfer.engine.protocol import EncoderStats, EPStats, FleetStats, KVStoreStats, ReplicaStats
from rayinfer.engine.types import RequestOutput, SamplingParams
from rayinfer.placement.bundles import fleet_shortfall, rank_resources
from rayinfer.placement.parallel_config import ParallelConfig
from rayinfer.policy.pd import DeviceTransferBreaker
from rayinfer.policy.routing import DecodeBalancer, DecodeTicket, PrefillBalancer, PrefillTicket, ReplicaLoadBalancer

logger = logging.getLogger(__name__)
_GIB = 1 << 30
_SLOW_TRANSFER_S = 10.0  # a cuda_ipc transfer slower than this is logged
_DEAD_AFTER = 4  # a replica whose ready() fails this many times in a row (1 s apart) is gone for good
_PROBES = 600  # ready() calls, up to 1 s apart, before a probe leaves a restarting replica to the picks
_ROLES = ("colocated", "prefill", "decode")
_Grant = TypeVar("_Grant")  # what a balancer grants: a replica index or a ticket


def _death_reason(error: BaseException) -> str:
    """One line on why an actor died, from Ray's error: its type and the sentence saying why (Ray puts it
    after the actor's id, pid and address), else the start of the message."""
    text = " ".join(str(error).split())
    because = text.find("The actor is dead because")
    return f"{type(error).__name__}: {text[because:] if because >= 0 else text}"[:300]


def _not_parked(request_id: str, prefill_replica: int) -> KeyError:
    """The error of a transfer whose request holds no KV on its prefill replica (expired or dropped)."""
    return KeyError(f"no parked KV for request {request_id!r} on prefill replica {prefill_replica}")


def _start_kv_store(*args) -> tuple[Any, str]:
    """A KVStoreActor (restarted by Ray whenever it dies) under a name of its own in this job's namespace, and
    that name. Engine actors get the name, not the handle: Ray cannot restart an actor whose constructor
    arguments live in its object store (an actor handle counts), and logs an error saying so at start-up."""
    name = f"rayinfer-kv-store-{uuid.uuid4().hex[:12]}"
    return KVStoreActor.options(name=name, num_cpus=0, max_restarts=-1).remote(*args), name


@dataclass
class FleetInfo:
    """What a client needs to talk to the fleet (picklable; handles stay valid across actor restarts).

    Attributes:
        topology: "colocated", "pd" or "ep".
        max_model_len: context limit in tokens.
        block_size: tokens per KV block.
        replicas: NORMAL replicas (colocated; with cp > 1 the rank 0s, then every replica's CP peers), or
            prefill replicas then decode replicas (pd).
        num_prefill: how many of ``replicas`` are prefill replicas (pd).
        kv_store: the KVStoreActor (pd, or colocated with ``kv_store.enabled``), else None.
        kv_transport: the resolved KV transport (pd), else None.
        model: the model name or path (for the client's tokenizer).
        max_retries: PD: re-runs of one request's leg after errors other than a replica failing.
        retry_deadline_s: PD: seconds after its first failure a request keeps retrying (``pd.retry_deadline_s``).
        encoders: the EncoderActors (``encoder.num_encoders``; empty: the engines encode their images).
        encoder_transport: how their embeddings reach the engines ("object_store" or "cuda_ipc").
    """

    topology: str
    max_model_len: int
    block_size: int
    replicas: list = field(default_factory=list)
    num_prefill: int = 0
    kv_store: Any = None
    kv_transport: str | None = None
    model: str = ""
    max_retries: int = 0
    retry_deadline_s: float = 0.0
    encoders: list = field(default_factory=list)
    encoder_transport: str = "object_store"

    @property
    def prefills(self) -> list:
        return self.replicas[: self.num_prefill]

    @property
    def decodes(self) -> list:
        return self.replicas[self.num_prefill:] if self.topology == "pd" else []


def check_supported(parallel: ParallelConfig) -> None:
    """Refuse parallel configs that the placement maps but no topology runs yet.

    Raises:
        UnsupportedError: naming the field.
    """
    if parallel.cp > 1 and parallel.is_disaggregated:
        raise UnsupportedError("parallel.cp > 1 (context-parallel prefill) runs in colocated replicas only; "
                               "prefill/decode disaggregation (num_prefill/num_decode) with cp > 1 is not supported", "cp")
    if parallel.cp > 1 and parallel.ep > 1:
        raise UnsupportedError("parallel.cp > 1 with ep > 1 is not supported: context-parallel prefill runs in "
                               "dense (Llama-architecture) colocated replicas", "cp")
    if parallel.ep > 1 and (parallel.dp > 1 or parallel.is_disaggregated):
        raise UnsupportedError("parallel.ep > 1 runs one expert-parallel replica: keep dp = 1 and no "
                               "num_prefill/num_decode", "ep")
    if parallel.num_encoders and parallel.ep > 1:
        raise UnsupportedError("parallel.encoder.num_encoders > 0 (vision-encoder replicas) runs with colocated or "
                               "pd replicas, not with ep > 1 (the MoE models served with ep take no images)",
                               "encoder.num_encoders")


class Router:
    """Starts the fleet of a ParallelConfig and answers its clients' routing questions.

    Args:
        model_config: every replica's model.
        engine_config: every replica's engine (``role`` is set per replica for PD).
        parallel: the topology, sections and per-rank resources.
    Raises:
        UnsupportedError: for a topology that is not run yet (see :func:`check_supported`).
        ValueError: for a bad config.
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, parallel: ParallelConfig):
        configure_worker_logging()
        check_supported(parallel)
        self.model_config, self.engine_config, self.parallel = model_config, engine_config, parallel
        self.topology = parallel.topology
        self.info: FleetInfo | None = None
        self._placed = parallel  # with num_cpus_per_replica resolved, in start()
        self._placement_groups: list = []
        self._cp_leaders: int | None = None  # cp > 1: fleet.replicas[:n] are the rank 0s (they lead CP prefills)
        self.encoders: list = []  # EncoderActors (encoder.num_encoders)
        self._encoders_loaded: list = []  # their ready() refs
        # colocated
        self.balancer: ReplicaLoadBalancer | None = None
        # pd
        self.prefill_lb: PrefillBalancer | None = None
        self.decode_lb: DecodeBalancer | None = None
        # replicas by role ("colocated", "prefill", "decode") and index within the role (report_failure)
        self._suspects: dict[str, set[int]] = {r: set() for r in _ROLES}  # out of picks until ready answers
        self._restarted: dict[str, set[int]] = {r: set() for r in _ROLES}  # restarted or new: not in the RDT group
        self._dead: dict[str, set[int]] = {r: set() for r in _ROLES}  # gone for good, not replaced
        self._last_death: dict[str, str] = {}  # role -> why its last replica dead for good died (one line)
        self._probes: dict[tuple[str, int], asyncio.Task] = {}  # (role, index) -> its probe (and replacement)
        self._specs: dict[int, tuple] = {}  # fleet index -> (class, options, args, kwargs) that _place used
        self._num_replaced: dict[int, int] = {}  # fleet index -> new actors started in its place
        self.num_replacements = 0  # replacements that came up
        self._device = DeviceTransferBreaker(enabled=False, recoverable=False)  # KV by device transfer (PD)
        self._rdt_locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._transfer_queues: dict[tuple[int, int], deque] = {}  # (prefill, decode) -> waiting transfers
        self._pumps: dict[tuple[int, int], asyncio.Task] = {}
        self._budget_blocks: list[int] = []  # per decode replica: blocks one transfer batch may hold
        self.admission: AdmissionGate | None = None  # requests waiting for room in prefill + decode
        self.num_admitted = 0  # PD requests between admit() and leave()
        self.num_transfer_batches = 0
        self.num_transferred = 0
        self.num_retries = 0
        self.num_handbacks = 0
        self.num_resent = 0  # colocated requests a client sent again after their replica died
        self.num_kv_device_failures = 0  # PD device KV transfers that failed for the transport's reason
        # ep
        self.ep_loop = None

    # -- typed access to what start() built (a call before start() is a bug: EngineInternalError) --
    @property
    def fleet(self) -> FleetInfo:
        if self.info is None:
            raise EngineInternalError("the fleet is not started (call Router.start first)")
        return self.info

    def _lb(self, kind: str):
        lb = {"colocated": self.balancer, "prefill": self.prefill_lb, "decode": self.decode_lb}[kind]
        if lb is None:
            raise EngineInternalError(f"this fleet ({self.topology}) has no {kind} balancer")
        return lb

    # -- start-up --------------------------------------------------------------------------------
    async def start(self) -> FleetInfo:
        """Place and start every replica and wait until their models are loaded (idempotent).

        Raises:
            TimeoutError: the cluster cannot grant a replica's bundle; the message names the shortfall.
        """
        if self.info is not None:
            return self.info
        p, cfg = self.parallel, self.engine_config
        self._placed = self._resolved(p)  # once: later replicas must not see the CPUs earlier ones took
        missing = fleet_shortfall(self._placed, ray.cluster_resources())
        if missing is not None:  # nodes may still join (an autoscaler): wait, but say so at once
            logger.warning("%s; waiting up to %g s (parallel.placement_timeout_s) for more nodes",
                           missing, p.placement_timeout_s)
        check_encoder_model(p, self.model_config.model)
        if self.topology == "ep":
            from rayinfer.actors.ep_group import EPLoop

            # EPLoop's start-up blocks on ray.get in a worker thread, never on this event loop; Ray warns of any
            # blocking get inside an async actor, whichever thread makes it
            os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
            self.ep_loop = await asyncio.to_thread(EPLoop, self.model_config, cfg, self._placed)
            self.info = FleetInfo("ep", self.ep_loop.max_model_len, cfg.block_size, model=self.model_config.model)
            return self.info
        if p.num_encoders:  # placed first, loading while the engines start
            await self._start_encoders()
        if self.topology == "pd":
            await self._start_pd()
        else:
            ks = p.kv_store
            store, store_name = None, None
            if ks.enabled:
                store, store_name = _start_kv_store(
                    ks.max_blocks, int(ks.max_gib * _GIB) if ks.max_gib else None, ks.ttl_s, ks.directory,
                    self.model_config.model)
            replicas = [await self._place(self._engine_actor_cls(), i, self.model_config, cfg, i,
                                          kv_store=store_name) for i in range(p.dp)]
            peers = []  # cp > 1: each replica's ranks 1..cp-1, replicas of their own for short prompts
            if p.cp > 1:
                peers = [await self._start_cp_peer(pg, i, r, kv_store=store_name)
                         for i, pg in enumerate(self._placement_groups[: p.dp]) for r in range(1, p.cp)]
            info = await asyncio.gather(*[r.ready.remote() for r in replicas + peers])
            await self._encoders_ready()
            if p.cp > 1:
                await asyncio.gather(*[start_cp_group(r, peers[i * (p.cp - 1): (i + 1) * (p.cp - 1)], p.cp_min_tokens)
                                       for i, r in enumerate(replicas)])
            self._cp_leaders = p.dp if p.cp > 1 else None
            replicas += peers
            self.balancer = ReplicaLoadBalancer(len(replicas), cfg.block_size)
            self.info = FleetInfo("colocated", info[0]["max_model_len"], cfg.block_size, replicas,
                                  kv_store=store, model=self.model_config.model, encoders=self.encoders)
        self.fleet.encoder_transport = self._encoder_transport
        logger.info("fleet ready: %s, %d replica(s), %d encoder(s)", self.topology, len(self.fleet.replicas),
                    len(self.fleet.encoders))
        return self.fleet

    async def _start_encoders(self) -> None:
        """Start the EncoderActors, each in a placement group of one bundle (the engine ranks' resources),
        restarted in place by Ray; an encode call that an actor's death cut short is retried by Ray. Their
        ``ready`` is awaited with the engines' (:meth:`_encoders_ready`)."""
        p, cfg = self._placed, self.engine_config
        cls = EncoderActorRDT if self._encoder_transport != "object_store" else EncoderActor
        encoders = [await self._place(cls, self.parallel.num_replicas + i, self.model_config, cfg.device,
                                      p.encoder.cache_tokens, num_bundles=1, max_task_retries=-1)
                    for i in range(p.num_encoders)]
        self.encoders = encoders
        self._encoders_loaded = [e.ready.remote() for e in encoders]

    @property
    def _encoder_transport(self) -> str:
        p = self.parallel
        return resolve_encoder_transport(p.encoder.transport, p.num_gpus_per_replica) if p.num_encoders \
            else "object_store"

    def _engine_actor_cls(self):
        """EngineActor, with Ray Direct Transport enabled when image embeddings move by cuda_ipc."""
        if self._encoder_transport == "cuda_ipc":
            return ray.remote(enable_tensor_transport=True)(EngineActorImpl)  # pyright: ignore[reportCallIssue]
        return EngineActor

    async def _encoders_ready(self) -> None:
        await asyncio.gather(*self._encoders_loaded)

    def _resolved(self, p: ParallelConfig) -> ParallelConfig:
        """``p`` with ``num_cpus_per_replica`` set: None splits the cluster's CPUs over the ranks."""
        if p.num_cpus_per_replica is not None:
            return p
        cpus = ray.available_resources().get("CPU", 1.0)
        return dataclasses.replace(p, num_cpus_per_replica=float(max(1, math.floor(cpus / p.num_bundles))))

    async def _place(self, actor_cls, replica_id: int, *args, num_bundles: int | None = None,
                     max_task_retries: int = 0, **kwargs):
        """One replica in a placement group of its own (so it restarts in place): its ``cp`` ranks' bundles
        (``rayinfer.placement``; one unless colocated with cp > 1, or ``num_bundles``), the actor (rank 0) on
        bundle 0."""
        p = self._placed
        bundle = rank_resources(p)
        if num_bundles is None:
            num_bundles = p.cp if self.topology == "colocated" else 1
        pg = placement_group([bundle] * num_bundles, strategy="PACK", name="")
        self._placement_groups.append(pg)
        timeout = p.placement_timeout_s
        try:
            await asyncio.wait_for(pg.ready(), timeout)
        except asyncio.TimeoutError:
            whole = fleet_shortfall(p, ray.cluster_resources(), ray.available_resources())
            raise TimeoutError(
                f"cannot place replica {replica_id} after {timeout:g} s: "
                f"{whole or f'it needs {_fmt(bundle)}; the cluster has {_fmt(ray.available_resources())} free'} "
                "(lower parallel.num_cpus_per_replica / num_gpus_per_replica or the replica count, or add "
                "nodes)") from None
        opts = dict(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0), max_restarts=p.max_restarts,
                    max_concurrency=4096, **({"max_task_retries": max_task_retries} if max_task_retries else {}),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                         placement_group_bundle_index=0))
        self._specs[replica_id] = (actor_cls, opts, args, kwargs)  # to start it again (_replace)
        return actor_cls.options(**opts).remote(*args, **kwargs)  # pyright: ignore[reportCallIssue]

    async def _start_cp_peer(self, pg, replica: int, cp_rank: int, kv_store: str | None = None):
        """CP rank ``cp_rank`` >= 1 of colocated replica ``replica``: an EngineActor on that bundle of the
        replica's placement group, serving requests of its own (``rayinfer.actors.cp_group``); its replica
        id in stats follows the rank-0 replicas'. Not restarted by Ray: a dead peer leaves its group."""
        p, bundle = self._placed, rank_resources(self._placed)
        replica_id = p.dp + replica * (p.cp - 1) + cp_rank - 1
        return self._engine_actor_cls().options(  # pyright: ignore[reportAttributeAccessIssue]
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0), max_restarts=0, max_concurrency=4096,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                 placement_group_bundle_index=cp_rank),
        ).remote(self.model_config, self.engine_config, replica_id, kv_store=kv_store)

    async def _start_pd(self) -> None:
        p, pd, cfg = self.parallel, self.parallel.pd, self.engine_config
        transport = resolve_kv_transport(pd.kv_transport, p.num_gpus_per_replica)
        group = transport in COLLECTIVE_TRANSPORTS
        # device transports keep room for payloads in flight out of the KV pools: the decode replica's (received,
        # not yet imported) and, over a group, the prefill replica's send staging (over cuda_ipc the decode
        # replica reads the prefill replica's blocks in place: nothing to stage there)
        buffers = {"kv_transfer_buffer_gib": pd.transfer_buffer_gib} if transport != "object_store" else {}
        pcfg = dataclasses.replace(cfg, role="prefill", **(buffers if group else {}), **pd.prefill_overrides)
        dcfg = dataclasses.replace(cfg, role="decode", **buffers, **pd.decode_overrides)
        max_bytes = int(pd.kv_store_max_gib * _GIB) if pd.kv_store_max_gib else None
        store, store_name = _start_kv_store(pd.kv_store_max_blocks, max_bytes, pd.kv_store_ttl_s,
                                            p.kv_store.directory, self.model_config.model)
        actor_cls = self._engine_actor_cls()
        prefills = [await self._place(actor_cls, i, self.model_config, pcfg, i, kv_store=store_name,
                                      kv_transport=transport) for i in range(p.num_prefill)]
        decodes = [await self._place(actor_cls, p.num_prefill + i, self.model_config, dcfg, p.num_prefill + i,
                                     kv_transport=transport) for i in range(p.num_decode)]
        info = await asyncio.gather(*[r.ready.remote() for r in prefills + decodes])
        await self._encoders_ready()
        if group:  # replica i is rank i: prefill replicas first, then decode replicas
            replicas = prefills + decodes
            address, port = await replicas[0].transfer_address.remote()
            await asyncio.gather(*[r.join_transfer_group.remote(address, port, len(replicas), rank)
                                   for rank, r in enumerate(replicas)])
        self._device = DeviceTransferBreaker(enabled=transport != "object_store", recoverable=transport == "cuda_ipc",
                                             retry_s=pd.device_retry_s)
        decode_info = info[p.num_prefill:]
        self._budget_blocks = [i.get("transfer_budget_blocks", 0) for i in decode_info]
        num_decode_blocks = min(i["num_blocks"] for i in decode_info)
        self.prefill_lb = PrefillBalancer(p.num_prefill)
        max_num_seqs = min(i["max_num_seqs"] for i in decode_info)
        self.decode_lb = DecodeBalancer(p.num_decode, max_num_seqs, num_decode_blocks * cfg.block_size)
        if pd.admission_headroom is not None:
            limit = max(1, math.ceil(p.num_decode * max_num_seqs * (1 + pd.admission_headroom)))
            self.admission = AdmissionGate(limit, lambda: self.num_admitted)
        self.info = FleetInfo("pd", info[0]["max_model_len"], cfg.block_size, prefills + decodes, p.num_prefill,
                              store, transport, self.model_config.model, pd.max_retries, pd.retry_deadline_s,
                              self.encoders)
        note = ""
        if group:
            note = f" (batches up to {pd.transfer_buffer_gib:g} GiB)"
        elif transport == "cuda_ipc" and p.num_gpus_per_replica <= 0:
            note = " (no GPU: the payloads themselves go through Ray calls)"
        logger.info("pd fleet: %d prefill + %d decode replicas, KV over %s%s", p.num_prefill, p.num_decode,
                    transport, note)

    # -- colocated -------------------------------------------------------------------------------
    async def pick(self, prompt_prefix: list[int], num_prompt_tokens: int | None = None) -> int:
        """A NORMAL replica for a request whose prompt starts with ``prompt_prefix`` (its first block is
        enough) and has ``num_prompt_tokens`` tokens; counted against it until :meth:`release`. With
        ``parallel.cp > 1`` a prompt of at least ``cp_min_tokens`` tokens goes to a rank 0 (which leads CP
        prefills), any other to any rank, CP peers included. A replica reported failed is left out while
        another can serve; when none can, the pick waits for one to restart or be replaced.

        Raises:
            ReplicasDeadError: every replica is gone for good.
        """
        lb = self._lb("colocated")
        if self._cp_leaders is not None and (num_prompt_tokens or 0) >= self.parallel.cp_min_tokens:
            among = range(self._cp_leaders)
        else:
            among = range(len(lb.in_flight))
        return await self._pick_serving(
            "colocated", lambda out: lb.pick(prompt_prefix, among=[r for r in among if r not in out] or among),
            lambda replica: replica, lb.done)

    def release(self, replica: int) -> None:
        self._lb("colocated").done(replica)

    def replicas(self) -> list:
        """The fleet's replica actors now (``FleetInfo.replicas``): a client refreshes its handles from here
        after a failure, as a dead replica may have been replaced by a new actor (:meth:`report_failure`)."""
        return list(self.fleet.replicas)

    def in_flight(self) -> list[int]:
        """Requests each replica holds by the balancers' count (NORMAL replicas, or prefill then decode
        replicas), as every client of this router sees it."""
        if self.balancer is not None:
            return list(self.balancer.in_flight)
        if self.prefill_lb is not None:
            return [sum(b) for b in self.prefill_lb.bucket_counts] + list(self._lb("decode").num_running)
        return []

    # -- pd --------------------------------------------------------------------------------------
    async def admit(self) -> None:
        """Let a PD request in (its client calls this before anything else, and :meth:`leave` once when
        it ends however it ends): waits while the requests in flight (prefill, transfer, decode or a
        retry's backoff) number ``pd.admission_headroom`` more than the decode replicas' ``max_num_seqs``;
        first come, first served."""
        if self.admission is not None:
            await self.admission.admit()
        self.num_admitted += 1

    def leave(self) -> None:
        """A request let in by :meth:`admit` ended: the next waiting one may start."""
        self.num_admitted = max(self.num_admitted - 1, 0)
        if self.admission is not None:
            self.admission.wake()

    def admission_stats(self) -> dict[str, int | None]:
        """PD: requests let in now, waiting now, that had to wait so far, and the limit (None: no gate)."""
        gate = self.admission
        return {"admitted": self.num_admitted, "waiting": gate.num_waiting if gate else 0,
                "waited": gate.num_waited if gate else 0, "limit": gate.limit if gate else None}

    async def pick_prefill(self, num_tokens: int, num_cached_tokens: int) -> PrefillTicket:
        """A prefill replica (its restart awaited when every replica is out); see PrefillBalancer.

        Raises:
            ReplicasDeadError: every prefill replica is gone for good.
        """
        lb = self._lb("prefill")
        return await self._pick_serving("prefill", lambda out: lb.pick(num_tokens, num_cached_tokens, out),
                                        lambda t: t.replica, lb.done)

    def release_prefill(self, ticket: PrefillTicket) -> None:
        self._lb("prefill").done(ticket)

    async def pick_decode(self, num_tokens: int, prefill_replica: int) -> tuple[DecodeTicket, bool]:
        """A decode replica, and whether the KV may move by a device transfer from ``prefill_replica``
        (no: over a collective group (nccl, gloo), either end restarted since the fleet started, or a device
        transfer failed; over cuda_ipc, which needs no group, a transfer failed within the last
        ``pd.device_retry_s`` (doubling with each failed retry): see :class:`DeviceTransferBreaker`).

        Raises:
            ReplicasDeadError: every decode replica is gone for good.
        """
        lb = self._lb("decode")
        ticket = await self._pick_serving("decode", lambda out: lb.pick(num_tokens, out), lambda t: t.replica,
                                          lb.done)
        in_group = (prefill_replica not in self._restarted["prefill"]
                    and ticket.replica not in self._restarted["decode"])
        return ticket, (in_group or self.fleet.kv_transport == "cuda_ipc") and self._device.allow()

    def release_decode(self, ticket: DecodeTicket, num_tokens_grown: int = 0) -> None:
        self._lb("decode").grow(ticket, num_tokens_grown)
        self._lb("decode").done(ticket)

    async def transfer_kv(self, prefill_replica: int, decode_replica: int, request_id: str) -> None:
        """Move a prefilled request's KV to a decode replica without the object store.

        nccl / gloo: the request joins the pair's queue and moves in the next batch (every request
        queued for the pair, up to the decode replica's transfer budget, as one send/recv); cuda_ipc:
        the prefill replica names the request's blocks in its KV cache (shared once over CUDA IPC), the
        decode replica gathers them into its own memory, and the prefill replica then frees them (each
        request on its own, within the decode replica's receive budget). A failure
        turns device transfers off for the fleet: over nccl / gloo for good (a broken group or a dead end);
        over cuda_ipc for ``pd.device_retry_s``, then a trial transfer decides (:class:`DeviceTransferBreaker`),
        and not at all when one of its replicas died (that takes no other transfer with it). The caller
        retries the request either way.

        Raises:
            ray.exceptions.RayError: the transfer failed.
            KeyError: the prefill replica holds no KV for the request (expired or dropped).
        """
        prefill, decode = self.fleet.prefills[prefill_replica], self.fleet.decodes[decode_replica]
        if self.fleet.kv_transport in COLLECTIVE_TRANSPORTS:
            pair = (prefill_replica, decode_replica)
            future = asyncio.get_running_loop().create_future()
            self._transfer_queues.setdefault(pair, deque()).append((request_id, future))
            pump = self._pumps.get(pair)
            if pump is None or pump.done():
                self._pumps[pair] = asyncio.get_running_loop().create_task(self._pump(*pair))
            await future
            return
        # cuda_ipc: one-sided, no pairing; the request's bytes are reserved in the decode replica's receive
        # budget before it copies the blocks, so payloads copied there and not yet imported never outgrow the
        # memory it keeps for them
        [num_blocks] = await prefill.parked_blocks.remote([request_id])
        if num_blocks == 0:
            raise _not_parked(request_id, prefill_replica)
        await decode.reserve_kv.remote(num_blocks, request_id)
        start = time.monotonic()
        # a replica that dies fails only the transfers it is part of (the client retries them and reports it);
        # any other error is the transport's, and the fleet falls back to the object store
        try:
            handle = await prefill.share_kv.remote(request_id)
            await decode.receive_kv.remote(request_id, handle)
        except ray.exceptions.RayError as e:
            decode.unreserve_kv.remote(request_id)  # a no-op once receive_kv took or gave back the reservation
            if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, KeyError):
                raise _not_parked(request_id, prefill_replica) from e  # expired meanwhile: not a transport failure
            if not isinstance(e, ray.exceptions.RayActorError):
                logger.error("cuda_ipc transfer of request %s failed after %.1f s: %s", request_id,
                             time.monotonic() - start, _death_reason(e))
                self._device_transfer_failed("cuda_ipc")
            raise
        finally:  # the decode replica has read the blocks in place (or never will): free them
            prefill.release_kv.remote([request_id])
        if self._device.succeeded():
            logger.warning("a trial KV transfer over cuda_ipc went through; moving KV over cuda_ipc again")
        elapsed = time.monotonic() - start
        if elapsed > _SLOW_TRANSFER_S:
            logger.warning("cuda_ipc transfer of request %s took %.1f s", request_id, elapsed)

    async def _pump(self, prefill_replica: int, decode_replica: int) -> None:
        """Move the pair's queued requests in batches until its queue is empty."""
        queue = self._transfer_queues[(prefill_replica, decode_replica)]
        prefill, decode = self.fleet.prefills[prefill_replica], self.fleet.decodes[decode_replica]
        src, dst = prefill_replica, self.fleet.num_prefill + decode_replica  # ranks in the transfer group
        while queue:
            batch = [queue.popleft() for _ in range(len(queue))]
            try:
                ids = [rid for rid, _ in batch]
                blocks = await prefill.parked_blocks.remote(ids)
                for (rid, fut), n in zip(batch, blocks):
                    if n == 0 and not fut.done():
                        fut.set_exception(_not_parked(rid, prefill_replica))
                live = [(rid, fut, n) for (rid, fut), n in zip(batch, blocks) if n > 0]
                # batches no larger than the decode budget; the rest goes back to the queue's front
                cut = _fit([n for _, _, n in live], self._budget_blocks[decode_replica])
                for rid, fut, n in reversed(live[cut:]):
                    queue.appendleft((rid, fut))
                live = live[:cut]
                if not live:
                    continue
                ids, nums = [rid for rid, _, _ in live], [n for _, _, n in live]
                reserved = await decode.reserve_kv.remote(sum(nums))
                async with self._lock("prefill", prefill_replica), self._lock("decode", decode_replica):
                    await asyncio.gather(prefill.send_kv.remote(ids, dst),
                                         decode.recv_kv.remote(ids, nums, src, reserved))
            except ray.exceptions.RayError as e:
                self._device_transfer_failed(self.fleet.kv_transport or "")
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            self.num_transfer_batches += 1
            self.num_transferred += len(live)
            for _, fut, _ in live:
                if not fut.done():
                    fut.set_result(None)

    def _device_transfer_failed(self, transport: str) -> None:
        self.num_kv_device_failures += 1
        before = self._device.num_failures
        wait_s = self._device.failed()
        if self._device.num_failures == before:  # one in flight when an earlier failure opened the breaker
            return
        if wait_s is None:
            logger.error("a KV transfer over %s failed; using the object store from now on", transport)
        else:
            logger.error("a KV transfer over %s failed (%d in a row); using the object store for %.0f s, then "
                         "trying %s again", transport, self._device.num_failures, wait_s, transport)

    def report_failure(self, role: str, replica: int, actor_id: str | None) -> None:
        """A client saw replica ``replica`` of ``role`` ("colocated", "prefill" or "decode") fail: keep it
        out of new picks until its ``ready`` answers again. A replica that stays dead (out of Ray's
        restarts, or ended by Ray) is replaced by a new actor in its placement group, up to
        ``parallel.max_replacements`` times; then it is dead for good.

        Only when ``actor_id`` names this replica's actor now (or names none): a report about an actor
        already replaced is old news. A restarted or new actor is outside the collective group (nccl, gloo),
        so its KV goes through the object store from then on (cuda_ipc has no group: it keeps moving by device).
        """
        actor = self._actor(role, replica)
        if replica in self._suspects[role] or (actor_id is not None and actor_id != actor._actor_id.hex()):
            return
        self._suspects[role].add(replica)
        self._restarted[role].add(replica)
        self._probes[(role, replica)] = asyncio.get_running_loop().create_task(self._probe(role, replica, actor))

    async def _probe(self, role: str, replica: int, actor) -> None:
        """Ask a reported replica's ``ready`` until it answers (it stays or comes back from a restart), or
        until it is dead: then replace it (:meth:`_replace`) or, out of replacements, mark it dead."""
        died = 0
        for attempt in range(_PROBES):
            try:
                await actor.ready.remote()
                self._suspects[role].discard(replica)
                return
            except ray.exceptions.ActorUnavailableError:  # restarting: ask again (picks wait on this probe)
                await asyncio.sleep(min(0.1 * 2**attempt, 1.0))
            except ray.exceptions.RayError as e:  # died: asked again a few times, as a restart may still begin
                died += 1
                if died == _DEAD_AFTER:
                    why = _death_reason(e)
                    if await self._replace(role, replica, why):
                        self._suspects[role].discard(replica)
                    else:  # stays out (balancers ignore the exclusion if all are)
                        self._dead[role].add(replica)
                        self._last_death[role] = why
                        logger.error("%s replica %d is dead and will not restart (%s)", role, replica, why)
                    return
                await asyncio.sleep(1.0)

    async def _replace(self, role: str, replica: int, why: str) -> bool:
        """Start a new actor in place of a dead replica, in its placement group bundle and with the
        arguments it was started with, until one answers ``ready`` or ``parallel.max_replacements`` for
        this replica are spent (-1: no limit). True when a new actor is up; it serves from then on
        (clients fetch it from :meth:`replicas`)."""
        index = self._index(role, replica)
        limit = self.parallel.max_replacements
        if self.parallel.cp > 1 or index not in self._specs:  # a CP rank 0 leads a group; EP ranks: not here
            return False
        while limit < 0 or self._num_replaced.get(index, 0) < limit:
            n = self._num_replaced[index] = self._num_replaced.get(index, 0) + 1
            logger.error("%s replica %d is dead (%s); starting a new actor in its place (replacement %d%s)",
                         role, replica, why, n, f" of {limit}" if limit >= 0 else "")
            ray.kill(self.fleet.replicas[index], no_restart=True)  # its bundle must be free for the new actor
            actor_cls, opts, args, kwargs = self._specs[index]
            new = actor_cls.options(**opts).remote(*args, **kwargs)
            try:
                await new.ready.remote()
            except ray.exceptions.RayError as e:
                why = _death_reason(e)
                ray.kill(new, no_restart=True)
                await asyncio.sleep(1.0)
                continue
            self.fleet.replicas[index] = new
            self.num_replacements += 1
            if self.fleet.kv_transport in COLLECTIVE_TRANSPORTS and role != "colocated":
                logger.warning("%s replica %d is back: a new actor serves in its place (outside the %s group, its "
                               "KV moves through the object store)", role, replica, self.fleet.kv_transport)
            else:
                logger.warning("%s replica %d is back: a new actor serves in its place", role, replica)
            return True
        return False

    def count_resend(self) -> None:
        """A client sent a colocated request to another pick after its replica died."""
        self.num_resent += 1

    def count_leg(self, handed_back: bool) -> None:
        """A client re-ran a PD leg: after a decode hand-back, or after a failure."""
        if handed_back:
            self.num_handbacks += 1
        else:
            self.num_retries += 1

    def _index(self, role: str, replica: int) -> int:
        """The position in ``FleetInfo.replicas`` of replica ``replica`` of ``role``."""
        return self.fleet.num_prefill + replica if role == "decode" else replica

    def _actor(self, role: str, replica: int):
        return self.fleet.replicas[self._index(role, replica)]

    def _num_replicas(self, role: str) -> int:
        return len({"colocated": self.fleet.replicas, "prefill": self.fleet.prefills,
                    "decode": self.fleet.decodes}[role])

    def _check_alive(self, role: str) -> None:
        if len(self._dead[role]) == self._num_replicas(role):
            what = "replica" if role == "colocated" else f"{role} replica"
            raise ReplicasDeadError(f"every {what} of the fleet is dead and will not restart (the last: "
                                    f"{self._last_death.get(role, 'unknown')}); start the fleet again")

    async def _pick_serving(self, role: str, choose: Callable[[set[int]], _Grant], replica_of: Callable[[_Grant], int],
                            give_back: Callable[[_Grant], None]) -> _Grant:
        """A balancer's grant (``choose(excluded)``) of a replica of ``role`` that can serve. Excluded are
        the reported replicas while another can serve, else the dead ones only, so that the pick waits for
        one that restarts or is being replaced (:meth:`_wait_until_up`); a grant of a replica that turns
        out dead is given back and the pick goes on.

        Raises:
            ReplicasDeadError: every replica of ``role`` is gone for good.
        """
        while True:
            self._check_alive(role)
            suspects = self._suspects[role]
            grant = choose(suspects if len(suspects) < self._num_replicas(role) else self._dead[role])
            if await self._wait_until_up(role, replica_of(grant)):
                return grant
            give_back(grant)

    async def _wait_until_up(self, role: str, replica: int) -> bool:
        """Wait until a picked replica can serve: at once unless it was reported; else until its probe
        ends (a restart or a replacement) and it answers. False: it turned out dead for good."""
        if replica not in self._suspects[role]:
            return True
        probe = self._probes.get((role, replica))
        if probe is not None:
            await asyncio.shield(probe)
        if replica in self._dead[role]:
            return False
        try:
            await self._actor(role, replica).ready.remote()
        except ray.exceptions.ActorUnavailableError:
            pass  # restarting again: the request's call waits for it or fails and is retried
        except ray.exceptions.RayError:  # died again since its probe ended: probe it anew and pick again
            self._suspects[role].discard(replica)
            self.report_failure(role, replica, None)
            return False
        return True

    def _lock(self, role: str, replica: int) -> asyncio.Lock:
        return self._rdt_locks.setdefault((role, replica), asyncio.Lock())

    # -- ep --------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """EP topology: stream a request's token deltas from its EP rank (a Ray generator).

        Raises:
            InvalidRequestError: the rank rejected the request.
            UnsupportedError: for another topology (its clients stream from the replicas directly).
        """
        if self.ep_loop is None:
            raise UnsupportedError(f"Router.generate streams the ep topology only, not {self.topology}")
        async for out in self.ep_loop.generate(request_id, prompt_token_ids, params):
            yield out

    def abort(self, request_id: str) -> None:
        """EP topology: abort a request (unknown ids are ignored)."""
        if self.ep_loop is not None:
            self.ep_loop.abort(request_id)

    # -- stats and shutdown ----------------------------------------------------------------------
    async def stats(self) -> FleetStats:
        """Every replica's stats; a replica that cannot answer is reported with ``error`` set."""
        info = self.fleet
        if self.ep_loop is not None:
            raw = await asyncio.to_thread(self.ep_loop.stats)
            ranks = [ReplicaStats.from_dict(r, replica_id=r["ep_rank"], role="normal") for r in raw["ranks"]]
            ep = EPStats(raw["ep"], raw["num_steps"], raw["moe_lb"], raw["num_rebalances"],
                         raw.get("eplb_history", []), raw.get("rebalance_stall_s", 0.0))
            return FleetStats("ep", ranks, ep=ep)
        calls = [r.stats.remote() for r in info.replicas]
        if info.kv_store is not None:
            calls.append(info.kv_store.stats.remote())
        encoder_results = await asyncio.gather(*[e.stats.remote() for e in info.encoders], return_exceptions=True)
        encoders = [EncoderStats(replica_id=i, error=f"{type(r).__name__}: {r}") if isinstance(r, BaseException)
                    else EncoderStats.from_dict(r, replica_id=i) for i, r in enumerate(encoder_results)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        replicas = []
        for i, r in enumerate(results[: len(info.replicas)]):
            role = "normal" if info.topology == "colocated" else ("prefill" if i < info.num_prefill else "decode")
            if isinstance(r, BaseException):
                replicas.append(ReplicaStats(replica_id=i, role=role, error=f"{type(r).__name__}: {r}"))
            else:
                replicas.append(ReplicaStats.from_dict(r, replica_id=i, role=role))
        store = None
        if info.kv_store is not None:
            r = results[-1]
            store = (KVStoreStats(error=f"{type(r).__name__}: {r}") if isinstance(r, BaseException)
                     else KVStoreStats.from_dict(r))
        return FleetStats(info.topology, replicas, store, num_retries=self.num_retries,
                          num_handbacks=self.num_handbacks, encoders=encoders,
                          num_replacements=self.num_replacements, num_resent=self.num_resent,
                          kv_device_transfers=self._device.closed if self._device.enabled else None,
                          num_kv_device_failures=self.num_kv_device_failures)

    async def flush(self) -> None:
        """Wait until the replicas' KV-store writes reached the store (PD prefill replicas; colocated
        replicas with ``kv_store.enabled``) (tests, benchmarks)."""
        if self.info is not None and self.info.kv_store is not None:
            writers = self.info.prefills if self.info.topology == "pd" else self.info.replicas
            await asyncio.gather(*[p.flush_kv_writes.remote() for p in writers], return_exceptions=True)

    def shutdown(self) -> None:
        """Kill every replica (no restart) and free their placement groups."""
        if self.ep_loop is not None:
            self.ep_loop.shutdown()
            self.ep_loop = None
        if self.info is not None:
            for actor in self.info.replicas + ([self.info.kv_store] if self.info.kv_store is not None else []):
                ray.kill(actor, no_restart=True)
        for actor in self.encoders:
            ray.kill(actor, no_restart=True)
        self.encoders = []
        for pg in self._placement_groups:
            remove_placement_group(pg)
        self._placement_groups = []


class AdmissionGate:
    """First come, first served admission while a count of requests in flight stays under a limit.

    Args:
        limit: requests in flight at most (a soft bound: a request between two tickets is not counted).
        in_flight: returns the requests in flight now (those admitted and not yet woken count too).
    """

    def __init__(self, limit: int, in_flight: Callable[[], int]):
        self.limit = limit
        self._in_flight = in_flight
        self._waiters: deque[asyncio.Future] = deque()
        self._woken = 0  # admitted by wake() and not yet counted by in_flight()
        self.num_waited = 0  # requests that had to wait

    @property
    def num_waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    async def admit(self) -> None:
        """Return once the caller may take a ticket (at once when there is room and nobody waits). The
        caller must take its ticket before its next await, so ``in_flight`` counts it."""
        if not self._waiters and self._in_flight() + self._woken < self.limit:
            return
        self.num_waited += 1
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # woken, then cancelled: pass the room on
                self._woken -= 1
                self.wake()
            raise
        self._woken -= 1

    def wake(self) -> None:
        """Admit waiters, first come first served, while there is room (call when a request leaves)."""
        while self._waiters and self._in_flight() + self._woken < self.limit:
            fut = self._waiters.popleft()
            if fut.done():  # its caller was cancelled
                continue
            fut.set_result(None)
            self._woken += 1


def _fit(num_blocks: list[int], budget_blocks: int) -> int:
    """How many leading requests (of ``num_blocks`` blocks each) one batch takes: as many as fit the
    budget, and at least one (a request larger than the budget goes alone)."""
    total = 0
    for i, n in enumerate(num_blocks):
        total += n
        if total > budget_blocks and i > 0:
            return i
    return len(num_blocks)


def _fmt(resources: dict) -> str:
    keys = [k for k in ("CPU", "GPU", "NPU", "memory") if k in resources]
    return "{" + ", ".join(f"{k}: {resources[k]:g}" for k in keys) + "}"


RouterActor = ray.remote(num_cpus=0, max_concurrency=10000)(Router)  # pyright: ignore[reportCallIssue]
