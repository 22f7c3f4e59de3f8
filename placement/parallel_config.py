"""How one deployment is laid out: replica count and roles, and each replica's context/expert parallel sizes.

Vocabulary (one rank = one device = one placement-group bundle, since tp is reserved at 1):

- replica: one independent engine (its own scheduler and KV cache). ``dp`` NORMAL replicas when
  colocated; ``num_prefill`` PREFILL plus ``num_decode`` DECODE replicas when disaggregated.
- cp (context parallel): a long prompt's tokens are split over ``cp`` ranks for attention.
- ep (expert parallel): the MoE layers' physical experts are split over ``ep`` ranks, and those
  same ranks run attention data-parallel (each serves its own requests), DeepSeek style.
- A replica therefore spans ``cp * ep`` ranks laid out as a ``[cp, ep]`` grid, ep fastest.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICE_KINDS = ("cpu", "gpu", "npu")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel sizes and device kind of a deployment; validates itself on construction.

    Args:
        dp: number of colocated NORMAL replicas (data parallel). Must stay 1 when disaggregated,
            where ``num_prefill`` and ``num_decode`` count the replicas instead.
        cp: context-parallel size inside each replica.
        ep: expert-parallel size inside each replica (also its attention data-parallel size).
        tp: tensor-parallel size; reserved, must be 1.
        device: "cpu", "gpu" or "npu".
        num_prefill: PREFILL replicas; > 0 together with ``num_decode`` turns on prefill/decode
            disaggregation. 0/0 means colocated NORMAL replicas.
        num_decode: DECODE replicas (see ``num_prefill``).
        devices_per_node: devices on one node, when known. Replicas and EP groups must then either
            fit inside one node or span whole nodes, so that node counts are exact.

    Raises:
        ValueError: naming the offending field, for any size < 1 (< 0 for num_prefill/num_decode),
            tp != 1, an unknown device, only one of num_prefill/num_decode set, dp != 1 together
            with disaggregation, or a replica/EP group that straddles node boundaries.
    """

    dp: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    device: str = "cpu"
    num_prefill: int = 0
    num_decode: int = 0
    devices_per_node: int | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "ep", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if self.tp != 1:
            raise ValueError(f"tp is reserved and must be 1 for now; got {self.tp}")
        if self.device not in DEVICE_KINDS:
            raise ValueError(f"device must be one of {', '.join(DEVICE_KINDS)}; got {self.device!r}")
        for name in ("num_prefill", "num_decode"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {value!r}")
        if (self.num_prefill > 0) != (self.num_decode > 0):
            missing = "num_decode" if self.num_prefill > 0 else "num_prefill"
            raise ValueError(
                f"{missing} must be > 0 when disaggregating (num_prefill={self.num_prefill}, "
                f"num_decode={self.num_decode}); set both, or both to 0 for colocated replicas"
            )
        if self.is_disaggregated and self.dp != 1:
            raise ValueError(
                f"dp must be 1 when num_prefill/num_decode are set (they count the replicas); "
                f"got dp={self.dp}"
            )
        self._check_node_fit()

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
        """Devices (ranks, bundles) of the whole deployment."""
        return self.num_replicas * self.ranks_per_replica

    @property
    def num_nodes(self) -> int:
        """Nodes the deployment fills when packed; 1 when ``devices_per_node`` is unknown."""
        if self.devices_per_node is None:
            return 1
        return -(-self.world_size // self.devices_per_node)

    @property
    def ep_num_nodes(self) -> int:
        """Nodes one EP group spans when packed (EPLB's ``num_nodes``); 1 when unknown."""
        if self.devices_per_node is None:
            return 1
        return max(1, self.ep // self.devices_per_node)
