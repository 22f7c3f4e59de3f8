"""Replica topologies of a job or service: colocated NORMAL replicas, prefill/decode disaggregation,
or one expert-parallel MoE replica (``conf/parallel/*.yaml``), and the client each one is driven by."""

from __future__ import annotations

from dataclasses import dataclass

from rayinfer.engine.config import EngineConfig, ModelConfig


@dataclass
class ParallelSpec:
    """Replicas of the batch job: ``dp`` NORMAL replicas (topology "colocated"), or prefill and decode
    replicas with a KV store between them (topology "pd"; see actors/pd.py and conf/parallel/)."""

    dp: int = 1
    num_cpus_per_replica: int | None = None  # None: the machine's CPUs split evenly
    num_gpus_per_replica: float = 0.0
    topology: str = "colocated"  # "colocated" | "pd"
    num_prefill: int = 1  # pd only
    num_decode: int = 1  # pd only
    kv_transport: str = "auto"  # pd only: auto | object_store | nccl | cuda_ipc | gloo
    kv_store_max_gib: float | None = 2.0  # pd only
    kv_store_ttl_s: float | None = None  # pd only
    max_restarts: int = 3  # pd only: Ray restarts of each engine actor
    ep: int = 1  # ep only: expert-parallel ranks of the MoE replica
    num_redundant_experts: int = 0  # ep only
    eplb_interval: int = 0  # ep only: rebalance every this many steps (0: never)
    eplb_window: int = 1000  # ep only
    num_nodes: int = 1  # ep only

    def __post_init__(self):
        if self.dp <= 0:
            raise ValueError(f"parallel.dp must be positive, got {self.dp}")
        if self.topology not in ("colocated", "pd", "ep"):
            raise ValueError(f"parallel.topology must be colocated, pd or ep, got {self.topology!r}")

    @property
    def num_replicas(self) -> int:
        return {"pd": self.num_prefill + self.num_decode, "ep": self.ep}.get(self.topology, self.dp)


def make_client(model: ModelConfig, engine: EngineConfig, p: ParallelSpec):
    """The job's client: EngineClient over ``dp`` NORMAL replicas, PDClient for topology "pd", EPClient
    (expert-parallel MoE replica with EPLB) for topology "ep".

    Raises:
        ValueError: for a bad parallel config.
    """
    import ray

    num_cpus = p.num_cpus_per_replica or max(1, int(ray.available_resources().get("CPU", 1)) // p.num_replicas)
    if p.topology == "pd":
        from rayinfer.actors.pd import PDClient, PDConfig

        return PDClient(model, engine, PDConfig(
            num_prefill=p.num_prefill, num_decode=p.num_decode, kv_transport=p.kv_transport,
            kv_store_max_gib=p.kv_store_max_gib, kv_store_ttl_s=p.kv_store_ttl_s, max_restarts=p.max_restarts,
            num_cpus_per_replica=num_cpus, num_gpus_per_replica=p.num_gpus_per_replica))
    if p.topology == "ep":
        from rayinfer.actors.ep_group import EPClient
        from rayinfer.engine.config import EPConfig

        return EPClient(model, engine, EPConfig(ep=p.ep, num_redundant_experts=p.num_redundant_experts,
                                                        eplb_interval=p.eplb_interval, eplb_window=p.eplb_window,
                                                        num_nodes=p.num_nodes))
    from rayinfer.actors.client import EngineClient

    return EngineClient(model, engine, num_replicas=p.dp, num_cpus_per_replica=num_cpus,
                        num_gpus_per_replica=p.num_gpus_per_replica)
