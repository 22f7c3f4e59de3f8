"""``python jobs/generate.py engine_mode=ray_data``: the batch job as a Ray Data pipeline.

    python jobs/generate.py input=big.jsonl output=answers/ engine_mode=ray_data data.concurrency=4

The input's lines stream through the processor (:mod:`rayinfer.data.processor`) and land as whole
part files in the output directory, in no particular order (each record has its ``id``). Resume is by
content hash: a rerun onto the same directory skips every line whose ``(id, key)`` is already answered
there (``key``: the job's hash of the model, prompt tokens and parameters) and adds new part files for
the rest.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

from rayinfer.data.config import PoolConfig, ProcessorConfig

ENGINE_MODES = ("client", "ray_data")


def output_dir(input_path: str | None, output: str | None) -> str:
    """Where the job writes: ``output``, else the input's name with ``.out`` for its extension
    (``prompts.jsonl`` -> ``prompts.out``), else ``outputs/generate.out``."""
    if output:
        return output
    if input_path:
        stem, dot, ext = input_path.rpartition(".")
        return (stem if dot and "/" not in ext else input_path) + ".out"
    return "outputs/generate.out"


def run_data_job(cfg) -> int:
    """Run the batch job as a Ray Data pipeline; returns the exit code (0 even when lines failed, 130
    when interrupted: the part files written so far stay, and a rerun finishes the rest).

    Args:
        cfg: the job's ``GenerateConfig`` (``input``, ``output``, ``model``, ``engine``, ``parallel``,
            ``sampling``, ``ray``, ``print_outputs`` and ``data``, a :class:`PoolConfig`).
    Raises:
        ValueError: unknown model; FileNotFoundError: a local input file that does not exist (both
            before any work).
    """
    import ray
    import ray.data

    from rayinfer.actors.cluster import init_ray
    from rayinfer.data.io import JsonlSink, output_files, read_done_digests, read_lines
    from rayinfer.data.processor import Processor
    from rayinfer.data.stages import RECORD_COLUMN, skip_done
    from rayinfer.jobs.generate import BUILTIN_PROMPTS
    from rayinfer.model.loader import resolve_model

    resolve_model(cfg.model.model)
    if cfg.input and "://" not in cfg.input and not Path(cfg.input).is_file():
        raise FileNotFoundError(f"input file {cfg.input} not found")
    pool: PoolConfig = cfg.data
    config = ProcessorConfig(model=cfg.model, engine=cfg.engine, parallel=cfg.parallel,
                             sampling={"max_tokens": 256, "temperature": 0.0, **cfg.sampling},
                             **{f.name: getattr(pool, f.name) for f in dataclasses.fields(PoolConfig)})
    print(init_ray(cfg.ray, logging_config=ray.LoggingConfig(encoding="TEXT", log_level="INFO"),
                   log_to_driver=True, logging_level=logging.WARNING), flush=True)
    out = output_dir(cfg.input, cfg.output)
    done = read_done_digests(out)
    if len(done):
        print(f"resuming: {len(done)} lines already answered in {out} are skipped (same id, prompt and parameters)")
    if cfg.input:
        ds = read_lines(cfg.input)
    else:
        ds = ray.data.from_items([{"line": json.dumps(p), "line_index": i} for i, p in enumerate(BUILTIN_PROMPTS)])
    processor = Processor(config)
    ds = processor.prepare(ds)
    if len(done):
        ds = ds.map_batches(skip_done, batch_format="pyarrow", num_cpus=pool.num_cpus_per_task,
                            fn_kwargs={"done": [ray.put(done)]})
    ds = processor.generate(ds).select_columns([RECORD_COLUMN])
    sink = JsonlSink(out)
    start = time.perf_counter()
    try:
        ds.write_datasink(sink)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the whole part files in {out} are kept; rerun the same command to finish the "
              f"rest", file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - start
    print(f"generated {sink.num_output_tokens} tokens for {sink.num_rows} lines in {elapsed:.1f} s "
          f"({sink.num_output_tokens / max(elapsed, 1e-9):.1f} output tokens/s)")
    if cfg.print_outputs if cfg.print_outputs is not None else not cfg.input:
        for path in (f for f in sink.files if "://" not in f):
            with open(path) as f:
                for rec in map(json.loads, f):
                    print(f"\n[{rec['id']}] {rec['text'] if not rec['error'] else 'ERROR: ' + rec['error']}")
    print(f"\n{sink.num_rows - sink.num_failed} ok, {sink.num_failed} failed, {len(done)} answered before; "
          f"wrote {len(sink.files)} part files to {out} ({len(output_files(out))} in all)")
    for row_id, error in sink.failures:
        print(f"  {row_id}: {error}")
    return 0
