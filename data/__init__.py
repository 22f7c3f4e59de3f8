"""Batch inference as Ray Data pipelines: :func:`build_processor` (after ``ray.data.llm``), the batch
job's JSONL read and written streamed (:func:`read_lines`, :class:`JsonlSink`), and resume by content
hash (``jobs/generate.py engine_mode=ray_data``, :mod:`rayinfer.data.job`)."""

from rayinfer.data.config import PoolConfig, ProcessorConfig
from rayinfer.data.processor import Processor, build_processor, engine_actor_resources


def read_lines(paths, **read_args):
    """See :func:`rayinfer.data.io.read_lines` (imported on first use: it needs ``ray.data``)."""
    from rayinfer.data.io import read_lines as read

    return read(paths, **read_args)


__all__ = ["PoolConfig", "Processor", "ProcessorConfig", "build_processor", "engine_actor_resources", "read_lines"]
