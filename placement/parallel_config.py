"""The one parallel config of a deployment: replicas and roles, each replica's context/expert-parallel
sizes, the PD, EPLB and encoder sections, and the Ray resources of each rank.

Every topology, the batch job, Serve and the placement code read only :class:`ParallelConfig` (Hydra
schema of ``conf/parallel/*.yaml``; the YAML files only override it).

Vocabulary (one rank = one device = one placement-group bundle, since tp is reserved at 1):

- replica: one independent engine (its own scheduler and KV cache). ``dp`` NORMAL replicas when
  colocated; ``num_prefill`` PREFILL plus ``num_decode`` DECODE replicas when disaggregated.
- cp (context parallel): a long prompt's tokens are split over ``cp`` ranks for its prefill; decode
  runs on the replica's rank 0 (colocated replicas only).
- ep (expert parallel): the MoE layers' physical experts are split over ``ep`` ranks, and those
  same ranks run attention data-parallel (each serves its own requests), DeepSeek style.
- A replica therefore spans ``cp * ep`` ranks laid out as a ``[cp, ep]`` grid, ep fastest.

Topologies (:attr:`ParallelConfig.topology`): "colocated" (``dp`` NORMAL replicas), "pd"
(``num_prefill`` + ``num_decode`` > 0) and "ep" (``ep`` > 1: one MoE replica of ``ep`` rank actors).
``encoder.num_encoders`` > 0 puts vision-encoder replicas in front of a colocated or pd fleet
("epd": encode / prefill / decode disaggregation, ``conf/parallel/epd.yaml``); each encoder is one
more rank, after the engine ranks.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, field
from typing import Any

DEVICE_KINDS = ("auto", "cpu", "gpu", "npu")
KV_TRANSPORTS = ("auto", "object_store", "nccl", "gloo", "cuda_ipc")
TOPOLOGIES = ("colocated", "pd", "ep")


class _Sealed:
    """Frozen after ``__post_init__``: assigning a field then raises ``FrozenInstanceError``.

    Not ``@dataclass(frozen=True)``: OmegaConf makes a frozen dataclass a read-only node, so Hydra could
    not apply YAML files or command-line overrides to the schema. Build a changed copy with
    ``dataclasses.replace``.
    """

    def _seal(self) -> None:
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_sealed", False):
            raise FrozenInstanceError(f"cannot assign to field {name!r} of a sealed {type(self).__name__}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r} of {type(self).__name__}")


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")


@dataclass
class PDSection(_Sealed):
    """Prefill/decode disaggregation settings (used when ``num_prefill`` and ``num_decode`` are > 0).

    Attributes:
        kv_transport: "auto" (nccl when each replica holds a whole GPU, cuda_ipc when replicas share
            GPUs, else the object store), "object_store", "nccl", "cuda_ipc" or "gloo"
            (``rayinfer.actors.kv_transport``).
        kv_store_max_blocks, kv_store_max_gib, kv_store_ttl_s: KV store limits (None: no limit).
        max_retries: re-runs of one request's leg after errors that are not a replica failing (a task
            raised, an object was lost) before the request fails.
        retry_deadline_s: seconds after a request's first failure during which it keeps re-running
            legs, waiting for failed replicas to restart (10-70 s on CPU); then it fails with an error.
        transfer_buffer_gib: device transports (nccl, gloo, cuda_ipc): the KV in flight to one decode
            replica, in GiB (nccl / gloo: also the largest batch one transfer moves); each decode replica
            (and over nccl / gloo each prefill replica) keeps this much device memory out of its KV pool for
            the received payloads not yet imported / the batches it sends (a decode replica takes no more
            while its received payloads fill it: back-pressure instead of out-of-memory).
        device_retry_s: after a cuda_ipc transfer fails for another reason than a dead replica, KV goes through
            the object store for this many seconds (0 to 600), then one trial transfer tries cuda_ipc again (its
            success brings cuda_ipc back; its failure doubles the wait, up to 600 s). 0: the object store for
            good, as always over nccl / gloo, whose failed transfer breaks the group.
        admission_headroom: how far prefill may run ahead of decode: requests are admitted to prefill
            while those in prefill or decode number fewer than the decode replicas' ``max_num_seqs``
            times ``1 + admission_headroom``; the rest wait before their prefill. A request then waits
            where waiting costs its TTFT, not between its first token and the rest (where it would
            stall mid-stream), and a freed decode slot still finds a prefilled request ready. None:
            no limit (prefill runs ahead as far as its KV pool lets it).
        prefill_overrides, decode_overrides: EngineConfig fields set on one role only.
    """

    kv_transport: str = "auto"
    kv_store_max_blocks: int | None = None
    kv_store_max_gib: float | None = 2.0
    kv_store_ttl_s: float | None = None
    max_retries: int = 5
    transfer_buffer_gib: float = 4.0
    retry_deadline_s: float = 120.0
    device_retry_s: float = 30.0
    admission_headroom: float | None = 0.25
    prefill_overrides: dict[str, Any] = field(default_factory=dict)
    decode_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"pd.kv_transport must be one of {KV_TRANSPORTS}; got {self.kv_transport!r}")
        _check_int("pd.max_retries", self.max_retries, 0)
        if isinstance(self.retry_deadline_s, bool) or not isinstance(self.retry_deadline_s, (int, float)) \
                or not self.retry_deadline_s >= 0:
            raise ValueError(f"pd.retry_deadline_s must be a number of seconds >= 0; got {self.retry_deadline_s!r}")
        if isinstance(self.device_retry_s, bool) or not isinstance(self.device_retry_s, (int, float)) \
                or not 0 <= self.device_retry_s <= 600:
            raise ValueError(f"pd.device_retry_s must be a number of seconds from 0 to 600 (the longest wait between "
                             f"trials); got {self.device_retry_s!r}")
        if self.kv_store_max_blocks is not None:
            _check_int("pd.kv_store_max_blocks", self.kv_store_max_blocks, 1)
        if self.admission_headroom is not None and (isinstance(self.admission_headroom, bool) or not isinstance(
                self.admission_headroom, (int, float)) or not self.admission_headroom >= 0):
            raise ValueError(f"pd.admission_headroom must be a number >= 0 or null; got {self.admission_headroom!r}")
        if not (isinstance(self.transfer_buffer_gib, (int, float)) and self.transfer_buffer_gib > 0):
            raise ValueError(f"pd.transfer_buffer_gib must be positive; got {self.transfer_buffer_gib!r}")
        for name in ("kv_store_max_gib", "kv_store_ttl_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"pd.{name} must be positive or null; got {value!r}")
        self._seal()


@dataclass
class KVStoreSection(_Sealed):
    """The KV store as a third KV tier (device pool, host pool, store) for every topology.

    Attributes:
        enabled: colocated replicas share a KVStoreActor: each looks up the leading blocks its own pools
            miss there and writes finished requests' full blocks to it (PD always has a store).
        directory: keep the store's blocks in files there (one per block, plus a msgpack index that
            survives a restart of the store actor; ``rayinfer.actors.kv_disk_store``), also for PD's store;
            None keeps them in the Ray object store's memory (lost with the store actor).
        max_gib, max_blocks: limits of the colocated store (None: none); least recently used blocks go.
        ttl_s: blocks not used for this long expire (default 3 days, DeepSeek's for block KV; None: never).
    """

    enabled: bool = False
    directory: str | None = None
    max_gib: float | None = 16.0
    max_blocks: int | None = None
    ttl_s: float | None = 3 * 24 * 3600.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"kv_store.enabled must be true or false; got {self.enabled!r}")
        if self.directory is not None and (not isinstance(self.directory, str) or not self.directory):
            raise ValueError(f"kv_store.directory must be a non-empty path or null; got {self.directory!r}")
        if self.max_blocks is not None:
            _check_int("kv_store.max_blocks", self.max_blocks, 1)
        for name in ("max_gib", "ttl_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"kv_store.{name} must be positive or null; got {value!r}")
        self._seal()


# DeepSeek's published EPLB settings (DeepSeek-V3 technical report, section 3.4, and the EPLB repository):
# the load window, the rearrangement period and the redundant expert slots, per deployment role
EPLB_PROFILES: dict[str, dict[str, int]] = {
    "prefill": {"num_redundant_experts": 4, "window": 100, "interval": 1000},
    "decode": {"num_redundant_experts": 1, "window": 1000, "interval": 10000},
}


@dataclass
class EPLBSection(_Sealed):
    """Expert-parallel load balancer settings (after DeepSeek EPLB; ``rayinfer.policy.eplb_policy``).

    Attributes:
        profile: None, or a key of :data:`EPLB_PROFILES` ("prefill", "decode"): DeepSeek's published
            settings for that role fill the fields left unset (None). Its redundant experts are a minimum,
            rounded up so that the physical experts split evenly over the ranks (:meth:`num_physical`).
        num_redundant_experts: extra physical expert slots per MoE layer (P = L + this); set explicitly, P
            must split evenly over the ``ep`` ranks. Unset: the profile's (rounded up), else 0.
        interval: rebalance every this many steps; 0 never rebalances (loads are still counted). Unset: the
            profile's, else 0.
        window: steps of expert load each rank keeps; rebalancing and ``moe_lb`` use their sum. Unset: the
            profile's, else 1000.
    Raises:
        ValueError: for an unknown profile or a value out of range.
    """

    profile: str | None = None
    num_redundant_experts: int | None = None
    interval: int | None = None
    window: int | None = None

    def __post_init__(self) -> None:
        # unset fields stay None (so that a profile chosen later, by a YAML or an override, still fills
        # them); rebalance_interval, load_window and num_physical give the values in force
        if self.profile is not None and self.profile not in EPLB_PROFILES:
            raise ValueError(f"eplb.profile must be one of {sorted(EPLB_PROFILES)} or null; got {self.profile!r}")
        for name, low in (("interval", 0), ("window", 1), ("num_redundant_experts", 0)):
            if getattr(self, name) is not None:
                _check_int(f"eplb.{name}", getattr(self, name), low)
        self._seal()

    def _preset(self, name: str, default: int) -> int:
        value = getattr(self, name)
        return value if value is not None else EPLB_PROFILES.get(self.profile or "", {}).get(name, default)

    @property
    def rebalance_interval(self) -> int:
        """Steps between rebalances in force: ``interval``, else the profile's, else 0 (never)."""
        return self._preset("interval", 0)

    @property
    def load_window(self) -> int:
        """Steps of expert load kept in force: ``window``, else the profile's, else 1000."""
        return self._preset("window", 1000)

    def num_physical(self, num_logical: int, ep: int) -> int:
        """Physical expert slots per MoE layer for ``num_logical`` experts over ``ep`` ranks: L plus the
        redundant experts (an explicit count as given; the profile's minimum rounded up to the next count
        that splits evenly over the ranks).

        Raises:
            ValueError: if an explicit count does not split evenly over the ranks.
        """
        if self.num_redundant_experts is not None:
            physical = num_logical + self.num_redundant_experts
            if physical % ep:
                raise ValueError(f"{num_logical} experts + eplb.num_redundant_experts={self.num_redundant_experts} = "
                                 f"{physical} physical experts do not split over ep={ep} ranks")
            return physical
        if self.profile is not None:
            least = num_logical + EPLB_PROFILES[self.profile]["num_redundant_experts"]
            return -(-least // ep) * ep
        if num_logical % ep:
            raise ValueError(f"{num_logical} experts do not split over ep={ep} ranks; set eplb.num_redundant_experts "
                             f"or eplb.profile")
        return num_logical


ENCODER_TRANSPORTS = ("auto", "object_store", "cuda_ipc")


@dataclass
class EncoderSection(_Sealed):
    """Vision-encoder replicas (role ENCODE, ``rayinfer.actors.encoder_actor``) in front of the engine
    replicas, for vision-language models (E + PD, "epd"; or E + colocated replicas).

    Each encoder replica is one rank (one bundle, of the same resources as an engine rank) holding the
    model's vision tower; clients send every image there (fewest patches in flight first) and pass its
    embeddings to the prefill (or NORMAL) replica through the Ray object store, so the engines never
    run their own encoders.

    Attributes:
        num_encoders: encoder replicas; 0 (default): the engines encode their images themselves.
        cache_tokens: each encoder replica's cache of embeddings by image content hash, in rows.
        transport: how embeddings reach the engine replica: "object_store" (host copies through Ray's
            object store), "cuda_ipc" (Ray Direct Transport between GPU actors: the engine replica takes
            the encoder's device tensors and copies them on the device) or "auto" (object_store, which
            measured faster for images of a few MB; see ``actors.encoder_actor.resolve_encoder_transport``).
    """

    num_encoders: int = 0
    cache_tokens: int = 16384
    transport: str = "auto"

    def __post_init__(self) -> None:
        _check_int("encoder.num_encoders", self.num_encoders, 0)
        _check_int("encoder.cache_tokens", self.cache_tokens, 0)
        if self.transport not in ENCODER_TRANSPORTS:
            raise ValueError(f"encoder.transport must be one of {ENCODER_TRANSPORTS}; got {self.transport!r}")
        self._seal()


@dataclass
class ParallelConfig(_Sealed):
    """Parallel sizes, roles, sections and per-rank resources of a deployment; validates itself and is
    frozen once built (``dataclasses.replace`` makes a changed copy).

    Attributes:
        dp: colocated NORMAL replicas (data parallel). Must stay 1 when disaggregated, where
            ``num_prefill`` and ``num_decode`` count the replicas instead.
        cp: context-parallel size inside each replica: a colocated replica of ``cp`` ranks prefills long
            prompts over all of them and decodes on its rank 0 (``rayinfer.engine.context_parallel``;
            Llama-architecture models; refused with PD or ep > 1 when the fleet starts).
        cp_min_tokens: with cp > 1, prompts whose part not in the prefix cache has at least this many
            tokens are prefilled with CP; shorter ones run on rank 0 alone (the other ranks idle).
        ep: expert-parallel size of the MoE replica (also its attention data-parallel size).
        tp: tensor-parallel size; reserved, must be 1.
        num_prefill, num_decode: PREFILL and DECODE replicas; both > 0 turns on disaggregation.
        device: "auto" ("gpu" when ``num_gpus_per_replica`` > 0, else "cpu"), "cpu", "gpu" or "npu":
            the accelerator each bundle reserves.
        num_cpus_per_replica: CPUs of each rank's actor (a replica of one rank: the replica's); None
            splits the cluster's CPUs evenly over the ranks.
        num_gpus_per_replica: GPUs of each rank's actor; a fraction lets replicas share a GPU (PD over
            cuda_ipc).
        max_restarts: Ray restarts of each engine actor (-1: forever).
        max_replacements: new actors the router may start in place of one colocated or PD replica
            that is dead for good (out of ``max_restarts``, or ended by Ray), one at a time in the
            replica's placement group (-1: no limit; 0: a dead replica stays dead). Not with cp > 1.
        placement_timeout_s: seconds to wait for the cluster to grant a replica's bundles before
            start-up fails with a message naming the shortfall.
        devices_per_node: devices on one node, when known. Replicas and EP groups must then either
            fit inside one node or span whole nodes, so that node counts are exact.
        pd, eplb, encoder, kv_store: the sections above.
    Raises:
        ValueError: naming the offending field, for any size < 1 (< 0 for num_prefill/num_decode),
            tp != 1, an unknown device, only one of num_prefill/num_decode set, dp != 1 together with
            disaggregation, GPUs with device=cpu, or a replica/EP group that straddles node boundaries.
            Combinations the placement maps but no topology runs yet (cp > 1 with disaggregation or
            ep > 1, ep > 1 with dp > 1 or with disaggregation) are refused when the fleet starts
            (``rayinfer.actors.router.check_supported``), as are encoder replicas with ep > 1.
    """

    dp: int = 1
    cp: int = 1
    cp_min_tokens: int = 8192
    ep: int = 1
    tp: int = 1
    num_prefill: int = 0
    num_decode: int = 0
    device: str = "auto"
    num_cpus_per_replica: float | None = None
    num_gpus_per_replica: float = 0.0
    max_restarts: int = 3
    max_replacements: int = 3
    placement_timeout_s: float = 120.0
    devices_per_node: int | None = None
    pd: PDSection = field(default_factory=PDSection)
    eplb: EPLBSection = field(default_factory=EPLBSection)
    encoder: EncoderSection = field(default_factory=EncoderSection)
    kv_store: KVStoreSection = field(default_factory=KVStoreSection)

    def __post_init__(self) -> None:
        for name, cls in (("pd", PDSection), ("eplb", EPLBSection), ("encoder", EncoderSection),
                          ("kv_store", KVStoreSection)):
            if isinstance(getattr(self, name), dict):  # a section given as a plain mapping (JSON, kwargs)
                object.__setattr__(self, name, cls(**getattr(self, name)))
        for name in ("dp", "cp", "ep", "tp"):
            _check_int(name, getattr(self, name), 1)
        _check_int("cp_min_tokens", self.cp_min_tokens, 1)
        if self.tp != 1:
            raise ValueError(f"tp is reserved and must be 1 for now; got {self.tp}")
        if self.device not in DEVICE_KINDS:
            raise ValueError(f"device must be one of {', '.join(DEVICE_KINDS)}; got {self.device!r}")
        for name in ("num_prefill", "num_decode"):
            _check_int(name, getattr(self, name), 0)
        if (self.num_prefill > 0) != (self.num_decode > 0):
            missing = "num_decode" if self.num_prefill > 0 else "num_prefill"
            raise ValueError(
                f"{missing} must be > 0 when disaggregating (num_prefill={self.num_prefill}, "
                f"num_decode={self.num_decode}); set both, or both to 0 for colocated replicas"
            )
        if self.is_disaggregated and self.dp != 1:
            raise ValueError(f"dp must be 1 when num_prefill/num_decode are set (they count the replicas); "
                             f"got dp={self.dp}")
        if self.num_cpus_per_replica is not None and not self.num_cpus_per_replica > 0:
            raise ValueError(f"num_cpus_per_replica must be positive or null; got {self.num_cpus_per_replica!r}")
        if not isinstance(self.num_gpus_per_replica, (int, float)) or self.num_gpus_per_replica < 0:
            raise ValueError(f"num_gpus_per_replica must be >= 0; got {self.num_gpus_per_replica!r}")
        if self.device == "cpu" and self.num_gpus_per_replica > 0:
            raise ValueError("num_gpus_per_replica must be 0 with device=cpu")
        if not isinstance(self.max_restarts, int) or self.max_restarts < -1:
            raise ValueError(f"max_restarts must be an integer >= -1; got {self.max_restarts!r}")
        if not isinstance(self.max_replacements, int) or self.max_replacements < -1:
            raise ValueError(f"max_replacements must be an integer >= -1; got {self.max_replacements!r}")
        if not self.placement_timeout_s > 0:
            raise ValueError(f"placement_timeout_s must be positive; got {self.placement_timeout_s!r}")
        self._check_node_fit()
        self._seal()

    def _check_node_fit(self) -> None:
        n = self.devices_per_node
        if n is None:
            return
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"devices_per_node must be an integer >= 1 or None; got {n!r}")
        # A replica (or EP group) that is neither inside one node nor a whole number of nodes would
        # share a node with its neighbour unevenly, and EPLB's node count would not be an integer.
        for what, size in (("replica (cp*ep)", self.ranks_per_replica), ("EP group (ep)", self.ep)):
            if size % n != 0 and n % size != 0:
                raise ValueError(
                    f"devices_per_node={n} does not fit a {what} of {size} ranks: one must divide the other"
                )

    @property
    def topology(self) -> str:
        """"pd" when disaggregated, "ep" when ``ep`` > 1, else "colocated" (see :data:`TOPOLOGIES`)."""
        if self.is_disaggregated:
            return "pd"
        return "ep" if self.ep > 1 else "colocated"

    @property
    def device_kind(self) -> str:
        """The bundles' device: ``device``, with "auto" resolved from ``num_gpus_per_replica``."""
        if self.device != "auto":
            return self.device
        return "gpu" if self.num_gpus_per_replica > 0 else "cpu"

    @property
    def is_disaggregated(self) -> bool:
        """True when prefill and decode run in separate PREFILL and DECODE replicas."""
        return self.num_prefill > 0

    @property
    def num_replicas(self) -> int:
        """Replicas of all roles: ``dp`` colocated, else ``num_prefill + num_decode``."""
        return self.num_prefill + self.num_decode if self.is_disaggregated else self.dp

    @property
    def ranks_per_replica(self) -> int:
        """Devices one replica spans: ``cp * ep * tp``."""
        return self.cp * self.ep * self.tp

    @property
    def world_size(self) -> int:
        """Devices (ranks) of the engine replicas; the encoder replicas come on top (:attr:`num_bundles`)."""
        return self.num_replicas * self.ranks_per_replica

    @property
    def num_encoders(self) -> int:
        """Vision-encoder replicas (``encoder.num_encoders``), one rank each."""
        return self.encoder.num_encoders

    @property
    def num_bundles(self) -> int:
        """Devices (bundles) of the whole deployment: the engine ranks, then one per encoder replica."""
        return self.world_size + self.num_encoders

    @property
    def num_nodes(self) -> int:
        """Nodes the deployment fills when packed; 1 when ``devices_per_node`` is unknown."""
        if self.devices_per_node is None:
            return 1
        return -(-self.num_bundles // self.devices_per_node)

    @property
    def ep_num_nodes(self) -> int:
        """Nodes one EP group spans when packed (EPLB's ``num_nodes``); 1 when unknown."""
        if self.devices_per_node is None:
            return 1
        return max(1, self.ep // self.devices_per_node)
