"""The client protocol every topology implements, and the typed stats it reports.

``EngineClient`` is what the batch job, Serve and the benchmarks speak: colocated replicas
(``rayinfer.actors.client.ColocatedClient``), prefill/decode disaggregation (``rayinfer.actors.pd.PDClient``)
and the expert-parallel replica (``rayinfer.actors.client.EPClient``) implement all of it, streaming
included. Errors are those of ``rayinfer.engine.errors``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, AsyncIterator, Protocol, runtime_checkable

from rayinfer.engine.types import Completion, MultiModalInput, RequestOutput, SamplingParams


@dataclass
class ReplicaStats:
    """One engine replica's gauges and counters (a snapshot as of its last step).

    Attributes:
        replica_id: the replica's index in the fleet (or EP rank).
        role: "normal", "prefill" or "decode".
        num_running, num_waiting: requests in the scheduler.
        kv_cache_usage: fraction of KV blocks in use, [0, 1].
        prefix_cache_hit_rate: hit tokens / queried tokens of the prefix cache, [0, 1].
        prefix_cache_queries, prefix_cache_hits: token counts behind that rate.
        num_preemptions: requests preempted so far.
        num_prompt_tokens, num_generation_tokens, num_computed_tokens: token counters.
        num_free_blocks, num_blocks: KV blocks free and in the pool.
        num_replayed_tokens, num_local_free_blocks, num_local_blocks: sliding-window models (two KV
            groups): tokens recomputed for the sliding layers only after prefix hits (bounded replay),
            and the sliding layers' pool (0 for other models).
        num_parked_kv: PREFILL role: prefilled requests whose KV waits in the pool for its transfer.
        num_steps, step_busy_s: engine steps run so far and the seconds the step loop spent in them (the
            replica's busy fraction is the rate of ``step_busy_s``).
        host_kv_blocks, host_kv_num_blocks: blocks held by / slots of the host KV tier (0 when off).
        host_kv_queries, host_kv_hits: blocks looked up in the host tier after a device-pool miss, and
            found there (loaded back instead of recomputed).
        host_kv_offloaded_blocks, host_kv_loaded_blocks, host_kv_bytes_moved: host tier traffic.
        kv_store_lookups, kv_store_hit_blocks, kv_store_skipped_blocks: NORMAL role with a KV store: store
            lookups made for prompts the replica's own tiers missed, blocks loaded from the store, and
            leading blocks of those hits taken from the replica's own device pool and host tier instead of fetched.
        num_encoder_runs, encoder_cache_hits, encoder_cache_tokens: vision-language models: images this
            replica's own encoder ran on, images served from its encoder cache, and the cache's rows (all
            stay 0 behind encoder replicas, which send embeddings).
        kv_transfer: nccl / gloo PD transports: ``kv_transfer_batches``, ``kv_transfer_bytes_sent``,
            ``kv_transfer_bytes_received``, ``kv_transfer_budget`` (bytes), ``kv_transfer_budget_used`` and
            ``kv_transfer_budget_peak`` (received bytes not yet imported, now and at most).
        spec_decode: speculative decoding's counters (``spec_num_drafts_proposed`` / ``_verified`` /
            ``_accepted``, ``spec_num_verify_steps``, ``spec_acceptance_rate``, ``spec_mean_accepted_length``,
            ``spec_acceptance_by_position``: a list, one rate per draft position; ``spec_device_drafted_steps``,
            ``spec_chained_steps``: steps drafted on the device, verification steps chained); empty when it is off.
        context_parallel: a CP replica's counters: on rank 0 ``cp`` (the group's size), ``cp_active``
            (False once a peer was lost), ``num_cp_prefills``, ``num_cp_prefill_tokens`` (tokens the group
            computed; prefix hits excluded), ``num_cp_solo_prefills`` (prefilled alone after a loss); on a
            peer ``cp_rank`` and ``num_cp_peer_prefills``; empty without CP.
        error: set (and the gauges zero) when the replica could not be asked (dead or restarting).
    """

    replica_id: int = 0
    role: str = "normal"
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_computed_tokens: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_replayed_tokens: int = 0
    num_local_free_blocks: int = 0
    num_local_blocks: int = 0
    num_parked_kv: int = 0
    num_steps: int = 0
    step_busy_s: float = 0.0
    host_kv_blocks: int = 0
    host_kv_num_blocks: int = 0
    host_kv_queries: int = 0
    host_kv_hits: int = 0
    host_kv_offloaded_blocks: int = 0
    host_kv_loaded_blocks: int = 0
    host_kv_bytes_moved: int = 0
    kv_store_lookups: int = 0
    kv_store_hit_blocks: int = 0
    kv_store_skipped_blocks: int = 0
    num_encoder_runs: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_tokens: int = 0
    kv_transfer: dict[str, int] = field(default_factory=dict)
    spec_decode: dict[str, Any] = field(default_factory=dict)
    context_parallel: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any], **extra: Any) -> "ReplicaStats":
        """From an engine's ``stats()`` dict (unknown keys are ignored) plus ``extra`` fields."""
        names = {f.name for f in fields(cls)}
        transfer = {k: v for k, v in data.items() if k.startswith("kv_transfer_")}
        spec = {k: v for k, v in data.items() if k.startswith("spec_")}
        cp = {k: v for k, v in data.items() if k in _CP_KEYS}
        return cls(**{k: v for k, v in {**data, **extra}.items() if k in names}, kv_transfer=transfer,
                   spec_decode=spec, context_parallel=cp)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_CP_KEYS = ("cp", "cp_active", "num_cp_prefills", "num_cp_prefill_tokens", "num_cp_solo_prefills", "cp_rank",
            "num_cp_peer_prefills")


@dataclass
class KVStoreStats:
    """The KV store's gauges and counters (blocks, bytes, lookups; on disk also the blocks dropped for a
    missing or damaged file and those found in the index at start)."""

    kv_store_blocks: int = 0
    kv_store_bytes: int = 0
    kv_store_queries: int = 0
    kv_store_hits: int = 0
    kv_store_hit_rate: float = 0.0
    kv_store_evicted: int = 0
    kv_store_expired: int = 0
    kv_store_put_blocks: int = 0
    kv_store_corrupt: int = 0
    kv_store_restored: int = 0
    error: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KVStoreStats":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class EncoderStats:
    """One vision-encoder replica's counters (``rayinfer.actors.encoder_actor.EncoderActor``).

    Attributes:
        replica_id: the encoder's index in the fleet.
        num_images: images asked of it; num_encoder_runs: images it encoded (the rest were cache hits,
            ``encoder_cache_hits``, or duplicates within a batch); num_batches: ``encode_images`` calls.
        encoder_cache_tokens: embedding rows its cache holds.
        error: set when the encoder could not be asked (dead or restarting).
    """

    replica_id: int = 0
    num_images: int = 0
    num_encoder_runs: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_tokens: int = 0
    num_batches: int = 0
    error: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any], **extra: Any) -> "EncoderStats":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in {**data, **extra}.items() if k in names})


@dataclass
class EPStats:
    """The expert-parallel replica's balance.

    Attributes:
        ep: EP ranks.
        num_steps: steps the EP ranks ran (every rank runs the same steps).
        moe_lb: max rank load / mean rank load over the load window (1.0 is perfect balance).
        num_rebalances: expert maps changed by EPLB so far.
        eplb_history: one summary per EPLB decision (num_steps, changed, moe_lb, moe_lb_expected, num_tokens).
        rebalance_stall_s: seconds the ranks' steps waited at map switches (weights still moving, and
            their copy into place), the slowest rank's, summed over switches.
    """

    ep: int = 1
    num_steps: int = 0
    moe_lb: float = 1.0
    num_rebalances: int = 0
    eplb_history: list[dict[str, Any]] = field(default_factory=list)
    rebalance_stall_s: float = 0.0


@dataclass
class FleetStats:
    """What ``EngineClient.stats()`` returns: every replica, plus the topology's own parts.

    Attributes:
        topology: "colocated", "pd" or "ep".
        replicas: one entry per engine replica (prefill first, then decode, for PD; EP ranks for EP).
        kv_store: the KV store (PD), else None.
        ep: the expert-parallel balance (EP), else None.
        num_retries: PD legs re-run after an actor failure.
        num_handbacks: PD legs re-run after a decode replica preempted a request.
        encoders: the vision-encoder replicas (``encoder.num_encoders``), else empty.
        num_replacements: new actors the router started in place of replicas dead for good
            (``parallel.max_replacements``).
        num_resent: colocated requests sent to another pick after their replica died (one that had
            streamed tokens resumes from them; see ``ColocatedClient``).
        kv_device_transfers: PD over a device transport (nccl, gloo, cuda_ipc): whether the router lets KV move
            by device now (False while the object store stands in after a failed transfer); None for other
            fleets. Over nccl / gloo a client that lost a replica in a device transfer also stops using them on
            its own, for good, and restarted replicas are outside the group whatever this says.
        num_kv_device_failures: PD: device KV transfers the router saw fail: over cuda_ipc for the transport's
            reason (a replica's death is not counted), over nccl / gloo any failed batch. The first of a run
            switches the fleet to the object store (for good over nccl / gloo, for ``pd.device_retry_s`` and
            more over cuda_ipc); transfers already in flight then are counted too.
    """

    topology: str = "colocated"
    replicas: list[ReplicaStats] = field(default_factory=list)
    kv_store: KVStoreStats | None = None
    ep: EPStats | None = None
    num_retries: int = 0
    num_handbacks: int = 0
    encoders: list[EncoderStats] = field(default_factory=list)
    num_replacements: int = 0
    num_resent: int = 0
    kv_device_transfers: bool | None = None
    num_kv_device_failures: int = 0

    def by_role(self, role: str) -> list[ReplicaStats]:
        """The replicas of one role."""
        return [r for r in self.replicas if r.role == role]


@runtime_checkable
class EngineClient(Protocol):
    """The caller's side of a fleet of engine replicas, whatever its topology.

    Attributes:
        max_model_len: the context limit in tokens (prompt + output).
    """

    max_model_len: int

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str | None = None, mm_inputs: list[MultiModalInput] | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """Stream one request's deltas (``params.n`` must be 1; callers fan out ``n``). ``mm_inputs``:
        the prompt's images (vision-language models; colocated and pd topologies).

        Leaving the iterator early (client disconnect, cancellation) aborts the request and frees its
        KV blocks.

        Raises:
            InvalidRequestError: the request is rejected (bad prompt, parameter, grammar).
            UnsupportedError: the topology cannot run it.
            EngineInternalError: a replica failed and retries did not help.
        """
        ...

    async def complete(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, mm_inputs: list[MultiModalInput] | None = None) -> Completion:
        """Run one request to the end; a rejected or failed request comes back with ``error`` set."""
        ...

    async def stats(self) -> FleetStats:
        """Every replica's gauges and counters (a dead replica is reported with ``error`` set)."""
        ...

    def shutdown(self) -> None:
        """Stop what this client started (the fleet, when it owns it)."""
        ...
