"""``python jobs/generate.py engine_mode=ray_data``: the batch job as a Ray Data pipeline.

    python jobs/generate.py input=big.jsonl output=answers/ engine_mode=ray_data data.concurrency=4

The input's lines (OpenAI Batch lines or rayinfer lines, as in the plain job: ``input_format``, detected
from the file's first lines by default) stream through the processor (:mod:`rayinfer.data.processor`) on
the plain job's parsing and output path (``rayinfer.jobs.batch_io``), and land as whole part files in the
output directory, in no particular order (each record has its ``id`` / ``custom_id``; a record is the
plain job's record of that line). Resume is by content hash: a rerun onto the same directory skips every
line already answered there with the same request (``key``: the job's hash of the model, prompt tokens and
parameters) and adds new part files for the rest.

Differences from the plain job: ids (custom_ids) are not checked for duplicates across the file (lines
are parsed in many tasks); an OpenAI line's response ``id`` is not the one its engine requests ran under
(its response is built in another task); the input and output may be URIs Ray Data reads and writes
(``s3://...``).
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


def _resolve(path: str, base) -> str:
    """A local path resolved as the plain job resolves it (``base_dir``, ``~``, ``file://``); a URI as is."""
    from rayinfer.jobs.generate import resolve_path

    if "://" in path and not path.startswith("file://"):
        return path
    return str(resolve_path(path, base))


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
        cfg: the job's ``GenerateConfig`` (``input``, ``output``, ``input_format``, ``base_dir``,
            ``served_model_name``, ``model``, ``engine``, ``parallel``, ``sampling``, ``ray``,
            ``print_outputs`` and ``data``, a :class:`PoolConfig`).
    Raises:
        ValueError: unknown model; FileNotFoundError: a local input file that does not exist (both
            before any work).
    """
    import ray
    import ray.data

    from rayinfer.actors.cluster import init_ray
    from rayinfer.data.io import JsonlSink, detect_input_format, output_files, read_done_digests, read_lines
    from rayinfer.data.processor import Processor
    from rayinfer.data.stages import RECORD_COLUMN, skip_done
    from rayinfer.jobs.batch_io import error_text, is_error, record_text
    from rayinfer.jobs.generate import BUILTIN_PROMPTS
    from rayinfer.model.loader import resolve_model

    base = (Path(_resolve(cfg.base_dir, Path.cwd())) if cfg.base_dir else Path.cwd()).resolve()
    inp = _resolve(cfg.input, base) if cfg.input else None
    if inp and "://" not in inp and not Path(inp).exists():
        raise FileNotFoundError(f"input file not found: {inp}")
    resolve_model(cfg.model.model)
    pool: PoolConfig = cfg.data
    config = ProcessorConfig(model=cfg.model, engine=cfg.engine, parallel=cfg.parallel,
                             sampling={"max_tokens": 256, "temperature": 0.0, **cfg.sampling},
                             served_model_name=cfg.served_model_name,
                             **{f.name: getattr(pool, f.name) for f in dataclasses.fields(PoolConfig)})
    print(init_ray(cfg.ray, log_to_driver=True, logging_level=logging.WARNING), flush=True)
    out = output_dir(inp, _resolve(cfg.output, base) if cfg.output else None)
    if not inp and not cfg.output:
        out = str(base / out)
    fmt = cfg.input_format
    if fmt == "auto":
        fmt = detect_input_format(inp) if inp else "rayinfer"
    print(f"reading {inp or 'the built-in prompts'} ({fmt} format)")
    done = read_done_digests(out)
    if len(done):
        print(f"resuming: {len(done)} lines already answered in {out} are skipped (same id, prompt and parameters)")
    if inp:
        ds = read_lines(inp)
    else:
        ds = ray.data.from_items([{"line": json.dumps(p), "line_no": i + 1} for i, p in enumerate(BUILTIN_PROMPTS)])
    processor = Processor(config)
    ds = processor.prepare(ds, input_format=fmt)
    if len(done):
        ds = ds.map_batches(skip_done, batch_format="pyarrow", num_cpus=pool.num_cpus_per_task,
                            fn_kwargs={"done": [ray.put(done)]})
    ds = processor.records(processor.generate(ds)).select_columns([RECORD_COLUMN])
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
                    text = "ERROR: " + error_text(rec) if is_error(rec) else record_text(rec)
                    print(f"\n[{rec.get('custom_id', rec['id'])}] {text}")
    print(f"\n{sink.num_rows - sink.num_failed} ok, {sink.num_failed} failed, {len(done)} answered before; "
          f"wrote {len(sink.files)} part files to {out} ({len(output_files(out))} in all)")
    for row_id, error in sink.failures:
        print(f"  {row_id}: {error}")
    return 0
