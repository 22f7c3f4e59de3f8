"""Configs of the Ray Data processor (leaf module: dataclasses only, no Ray, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.placement.parallel_config import ParallelConfig


@dataclass
class PoolConfig:
    """How a Ray Data pipeline runs the engine: the actor pool and the batches it is fed.

    Attributes:
        concurrency: engine actors in the pool (a fixed pool), or the most of them when
            ``min_concurrency`` is set. Each actor holds one deployment of ``parallel`` (see
            :class:`ProcessorConfig`).
        min_concurrency: when set, an autoscaling pool between this and ``concurrency`` actors.
        batch_size: rows per ``map_batches`` batch sent to an engine actor.
        max_concurrent_batches: batches one engine actor runs at once (its Ray ``max_concurrency``), so
            the engine's running batch never drains at a batch boundary; ``batch_size *
            max_concurrent_batches`` should reach ``engine.max_num_seqs``.
        num_cpus_per_task: CPUs of each preprocess / postprocess task (chat template, tokenization,
            output columns).
    Raises:
        ValueError: naming the field, for a size < 1 or ``min_concurrency`` > ``concurrency``.
    """

    concurrency: int = 1
    min_concurrency: int | None = None
    batch_size: int = 32
    max_concurrent_batches: int = 8
    num_cpus_per_task: float = 1.0

    def __post_init__(self) -> None:
        for name in ("concurrency", "batch_size", "max_concurrent_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        m = self.min_concurrency
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= self.concurrency):
            raise ValueError(f"min_concurrency must be an integer in [1, concurrency={self.concurrency}], got {m!r}")
        if not self.num_cpus_per_task > 0:
            raise ValueError(f"num_cpus_per_task must be positive, got {self.num_cpus_per_task!r}")

    @property
    def pool_sizes(self) -> tuple[int, int]:
        """(min, max) engine actors."""
        return (self.min_concurrency or self.concurrency, self.concurrency)


@dataclass
class ProcessorConfig(PoolConfig):
    """What :func:`rayinfer.data.build_processor` builds: the model, each engine actor's deployment,
    sampling defaults, and the pool (:class:`PoolConfig`'s fields).

    Attributes:
        model, engine: each replica's configs (as in the batch job).
        parallel: the deployment each engine actor holds. Colocated with ``dp=1`` (the default): the
            actor runs the engine in its own process and reserves ``num_cpus_per_replica`` /
            ``num_gpus_per_replica`` itself, so Ray Data places and scales it. Any other topology
            (``dp`` > 1, ``1p1d``, ``ep2``, ...): the actor starts that fleet and drives it through a
            client, as the batch job does; the fleet's actors reserve the resources.
        sampling: sampling fields every row gets unless it gives its own (the batch job's ``rayinfer``
            line names: ``max_tokens``, ``temperature``, ...); OpenAI Batch bodies are taken as they are.
        served_model_name: the name an OpenAI Batch body's ``model`` must match and responses carry
            (None: ``model.model``), as in the batch job.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sampling: dict[str, Any] = field(default_factory=dict)
    served_model_name: str | None = None

    @property
    def is_in_process(self) -> bool:
        """True when each engine actor runs its engine in process (colocated, ``dp=1``)."""
        return self.parallel.topology == "colocated" and self.parallel.dp == 1
