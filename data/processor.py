"""The processor: batch inference as stages of a Ray Data pipeline, after ``ray.data.llm``'s
``build_llm_processor`` (preprocess -> engine stage on an actor pool -> postprocess).

    import ray.data
    from rayinfer.data import ProcessorConfig, build_processor

    processor = build_processor(ProcessorConfig(concurrency=2, batch_size=16, sampling={"max_tokens": 64}))
    ds = ray.data.read_parquet("s3://bucket/prompts/")          # columns: messages or prompt, ...
    processor(ds).write_parquet("s3://bucket/answers/")        # + id, text, finish_reason, token counts, ...

Nothing runs until the dataset is consumed; it streams, so the input may be larger than memory.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from rayinfer.data.config import ProcessorConfig
from rayinfer.data.stages import EngineStage, finish_batch, prepare_batch, records_batch
from rayinfer.placement.parallel_config import ParallelConfig

Row = dict[str, Any]


def engine_actor_resources(config: ProcessorConfig, cluster_cpus: float | None) -> tuple[float, float, ParallelConfig]:
    """Each engine actor's Ray resources, and the deployment it starts.

    In process (colocated, ``dp=1``) the actor reserves the replica's resources itself; otherwise it
    reserves none and its fleet's actors do. ``num_cpus_per_replica`` unset shares the cluster's CPUs,
    less ``num_cpus_per_task`` kept for the CPU tasks, among the most actors the pool may hold and their
    ranks: whole CPUs where there are enough, else a fraction (a pool that took every CPU would leave the
    prepare tasks none, and the pipeline would wait forever).

    Args:
        config: the processor's config.
        cluster_cpus: the cluster's CPUs (None: unknown, 1 CPU per rank).
    Returns:
        (actor num_cpus, actor num_gpus, the ParallelConfig the actor deploys).
    """
    parallel = config.parallel
    if parallel.num_cpus_per_replica is None:
        ranks = config.pool_sizes[1] * parallel.world_size
        share = 1.0 if cluster_cpus is None else (cluster_cpus - config.num_cpus_per_task) / ranks
        cpus = float(math.floor(share)) if share >= 1 else max(round(share, 2), 0.01)
        parallel = dataclasses.replace(parallel, num_cpus_per_replica=cpus)
    if config.is_in_process:
        return float(parallel.num_cpus_per_replica or 1.0), float(parallel.num_gpus_per_replica), parallel
    return 0.0, 0.0, parallel


class Processor:
    """Batch inference over a ``ray.data.Dataset``; call it on a dataset to get the answered dataset.

    Stages, each a ``map_batches`` (the dataset is never materialized):

    1. ``preprocess`` (optional, ``Dataset.map``): your row -> a row the next stage reads.
    2. prepare (CPU tasks): the batch job's line parser (``rayinfer.jobs.batch_io.LineParser``, on the
       service's request path): chat template and tokenization, sampling parameters, the resume ``key``.
    3. engine (``concurrency`` stateful actors, ``ActorPoolStrategy``): each holds one deployment of
       ``parallel`` and runs up to ``max_concurrent_batches`` batches of ``batch_size`` rows at once.
    4. records (CPU tasks): the batch job's output line of each row (``output_record``).
    5. finish (CPU tasks): the output columns. 6. ``postprocess`` (optional, ``Dataset.map``).

    Input rows: ``messages`` (a chat, rendered with the model's template) or ``prompt`` (text), an
    optional ``id`` and an optional ``sampling_params`` dict (the batch job's field names:
    ``max_tokens``, ``temperature``, ``n``, ``logprobs``, ``response_format``, ...); or ``line``, one
    ``rayinfer`` line of the batch job's JSONL (:func:`rayinfer.data.read_lines`). Other columns pass
    through. OpenAI Batch lines run through ``prepare(ds, input_format="openai")``, ``generate`` and
    ``records`` (the job's ``engine_mode=ray_data`` does); they have no flat output columns.

    Output columns added: ``id`` (str: the row's, else ``line-<line_no>``, 1-based), ``prompt_token_ids``,
    ``output_token_ids`` (list[int64]), ``text``, ``finish_reason`` (str: "stop", "length", "error"),
    ``num_prompt_tokens``, ``num_output_tokens``, ``num_cached_tokens`` (int64), ``error`` (str or null:
    a bad row's own message, e.g. an unknown sampling field; other rows still run), ``key`` (str: the
    batch job's hash of the model, prompt tokens and parameters), ``logprobs``, ``choices`` (JSON text
    of the batch job's fields when the row asked for logprobs or ``n`` > 1, else null).

    Args:
        config: model, deployment, sampling defaults and pool (:class:`ProcessorConfig`).
        preprocess, postprocess: optional row functions (``dict -> dict``) run before and after.
    """

    def __init__(self, config: ProcessorConfig, preprocess: Callable[[Row], Row] | None = None,
                 postprocess: Callable[[Row], Row] | None = None):
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess

    def __call__(self, ds):
        return self.finish(self.records(self.generate(self.prepare(ds))))

    @property
    def _parser_kwargs(self) -> dict[str, Any]:
        """What prepare and records build their line parser from (the same on both sides)."""
        cfg = self.config
        return {"model": cfg.model.model, "defaults": {"max_tokens": 256, "temperature": 0.0, **cfg.sampling},
                "model_name": cfg.served_model_name, "max_model_len": cfg.model.max_model_len}

    def prepare(self, ds, input_format: str = "rayinfer"):
        """Stages 1-2: rows -> prepared rows (``id``, ``prompt_token_ids``, ``key``, ``error``, and the
        internal ``__job`` and ``__resume``).

        Args:
            input_format: how ``line`` rows read: "rayinfer", "openai" (OpenAI Batch lines), or "auto"
                (each line by its fields); rows without ``line`` are ``rayinfer`` rows.
        """
        cfg = self.config
        if self.preprocess is not None:
            ds = ds.map(self.preprocess, num_cpus=cfg.num_cpus_per_task)
        return ds.map_batches(prepare_batch, batch_format="pyarrow", batch_size=cfg.batch_size,
                              num_cpus=cfg.num_cpus_per_task,
                              fn_kwargs={**self._parser_kwargs, "input_format": input_format})

    def records(self, ds):
        """Stage 4: rows the engine answered -> rows with ``__record`` (the batch job's output line, JSON
        text, in the line's format)."""
        return ds.map_batches(records_batch, batch_format="pyarrow", num_cpus=self.config.num_cpus_per_task,
                              fn_kwargs=self._parser_kwargs)

    def generate(self, ds):
        """Stage 3: prepared rows -> rows with the engine's results (internal ``__result``)."""
        import ray
        import ray.data

        cfg = self.config
        cluster_cpus = ray.cluster_resources().get("CPU") if ray.is_initialized() else None
        num_cpus, num_gpus, parallel = engine_actor_resources(cfg, cluster_cpus)
        lo, hi = cfg.pool_sizes
        # blocks of at most batch_size rows: Ray Data hands an actor whole blocks, so one large block (a
        # small file is read as one) would keep every other actor of the pool idle. It also keeps Ray Data
        # from fusing prepare into the engine actors: tokenization stays in CPU tasks
        ds = ds.repartition(target_num_rows_per_block=cfg.batch_size)
        return ds.map_batches(
            EngineStage, batch_format="pyarrow", batch_size=cfg.batch_size,
            fn_constructor_kwargs={"model": cfg.model, "engine": cfg.engine, "parallel": parallel,
                                   "in_process": cfg.is_in_process},
            compute=ray.data.ActorPoolStrategy(min_size=lo, max_size=hi,
                                               max_concurrent_calls_per_actor=cfg.max_concurrent_batches),
            num_cpus=num_cpus, num_gpus=num_gpus)

    def finish(self, ds):
        """Stages 5-6: rows with ``__record`` (``rayinfer`` lines) -> the output columns."""
        ds = ds.map_batches(finish_batch, batch_format="pyarrow", num_cpus=self.config.num_cpus_per_task)
        if self.postprocess is not None:
            ds = ds.map(self.postprocess, num_cpus=self.config.num_cpus_per_task)
        return ds


def build_processor(config: ProcessorConfig, preprocess: Callable[[Row], Row] | None = None,
                    postprocess: Callable[[Row], Row] | None = None) -> Processor:
    """A :class:`Processor` for ``config`` (as ``ray.data.llm.build_llm_processor``); it builds nothing
    until called on a dataset.

    Raises:
        TypeError: ``config`` is not a ProcessorConfig.
    """
    if not isinstance(config, ProcessorConfig):
        raise TypeError(f"config must be a rayinfer.data.ProcessorConfig, got {type(config).__name__}")
    return Processor(config, preprocess, postprocess)
