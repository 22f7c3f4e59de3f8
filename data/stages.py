"""The processor's three stages as Ray Data UDFs: prepare (CPU tasks), the engine (a pool of stateful
actors), finish (CPU tasks). Batches are ``pyarrow.Table``s; columns the stages do not own pass through.

Rows are read and written in the batch job's line format, through the job's own ``parse_lines`` and
``output_record`` (``rayinfer.jobs.generate``, imported lazily): a row renders, parses and answers
exactly as the same line in ``python jobs/generate.py``, ``key`` included, so the two modes agree and
share resume keys.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import pickle
import re
import uuid
from typing import Any, AsyncIterator

import pyarrow as pa

JOB_COLUMN = "__job"  # prepare -> engine: the parsed row (a pickled LineJob)
RECORD_COLUMN = "__record"  # engine -> finish: the batch job's output line (JSON text)
INPUT_COLUMNS = ("line", "messages", "prompt", "id", "sampling_params")  # what prepare reads

# finish's output columns and their Arrow types (fixed, so blocks always share one schema)
OUTPUT_SCHEMA = pa.schema([
    ("id", pa.string()), ("prompt_token_ids", pa.list_(pa.int64())), ("output_token_ids", pa.list_(pa.int64())),
    ("text", pa.string()), ("finish_reason", pa.string()), ("num_prompt_tokens", pa.int64()),
    ("num_output_tokens", pa.int64()), ("num_cached_tokens", pa.int64()), ("error", pa.string()),
    ("key", pa.string()), ("logprobs", pa.string()), ("choices", pa.string()),
])


# -- prepare -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _tokenizer(model: str):
    """One tokenizer per worker process and model (Ray reuses task workers, so later tasks find it)."""
    from rayinfer.model.loader import load_tokenizer

    return load_tokenizer(model)


def _drop_nulls(value: Any) -> Any:
    """Arrow gives a struct field that another row had as None; JSON null means absent in OpenAI's API."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def row_line(row: dict[str, Any]) -> str:
    """A dataset row as a line of the batch job's input.

    Args:
        row: either ``line`` (a JSON text line of the batch job's format, as :func:`rayinfer.data.read_lines`
            gives), or ``messages`` (chat) / ``prompt`` (text) with an optional ``id`` and an optional
            ``sampling_params`` dict of the job's sampling fields (``max_tokens``, ``temperature``, ...).
    Returns:
        JSON text; a row with neither gets the job's own error for it.
    """
    if row.get("line") is not None:
        return str(row["line"])
    rec: dict[str, Any] = {} if row.get("id") is None else {"id": row["id"]}
    for name in ("messages", "prompt"):
        if row.get(name) is not None:
            rec[name] = _drop_nulls(row[name])
    rec.update(_drop_nulls(row.get("sampling_params") or {}))
    return json.dumps(rec)


def _shift_line_number(text: str, pattern: str, index: int) -> str:
    """``text`` with the first line number that ``pattern`` matches moved on by ``index`` (parse_lines
    numbers the one line it is given as the first)."""
    return re.sub(pattern, lambda m: m.group(0)[: m.start(1) - m.start(0)] + str(int(m.group(1)) + index),
                  text, count=1)


def parse_row(line: str, index: int, tokenizer, defaults: dict[str, Any], model: str):
    """Parse one line as the batch job does (``parse_lines``), numbered as line ``index`` of the input
    (the id of a line without one, and a malformed line's message). Returns a ``LineJob``; never raises."""
    from rayinfer.jobs.generate import parse_lines

    job = parse_lines([line], tokenizer, defaults, model)[0]
    job.index = index
    try:
        rec = json.loads(line)
        has_id = isinstance(rec, dict) and rec.get("id") is not None
    except json.JSONDecodeError:
        has_id = False
    if not has_id:
        job.id = _shift_line_number(job.id, r"(\d+)$", index)
    if job.error is not None and job.key is None:
        job.error = _shift_line_number(job.error, r"\bline (\d+)\b", index)
    return job


def prepare_batch(batch: pa.Table, *, model: str, defaults: dict[str, Any]) -> pa.Table:
    """Render, tokenize and parse each row (a CPU task).

    Args:
        batch: rows as :func:`row_line` reads them, and optionally ``line_index`` (int, the row's
            number in its file: the default id is ``line-<line_index>``; else the row's number in the
            batch).
        model: the model whose tokenizer and chat template apply (also hashed into ``key``).
        defaults: sampling fields of every row (a row's own win).
    Returns:
        ``batch`` without ``line``, with ``id`` (str), ``prompt_token_ids`` (list[int64], empty for a bad
        row), ``key`` (str, the job's resume key; null for a bad row), ``error`` (str or null) and the
        internal ``__job`` column.
    """
    tokenizer = _tokenizer(model)
    names = [c for c in INPUT_COLUMNS if c in batch.column_names]
    rows = batch.select(names).to_pylist()
    indexes = batch.column("line_index").to_pylist() if "line_index" in batch.column_names else range(len(rows))
    jobs = [parse_row(row_line(row), int(i), tokenizer, defaults, model) for row, i in zip(rows, indexes)]
    out = batch.drop_columns([c for c in ("line", "id", "prompt_token_ids", "key", "error", JOB_COLUMN)
                              if c in batch.column_names])
    columns = {
        "id": pa.array([j.id for j in jobs], pa.string()),
        "prompt_token_ids": pa.array([j.prompt_token_ids or [] for j in jobs], pa.list_(pa.int64())),
        "key": pa.array([j.key for j in jobs], pa.string()),
        "error": pa.array([j.error for j in jobs], pa.string()),
        JOB_COLUMN: pa.array([pickle.dumps(j) for j in jobs], pa.binary()),
    }
    for name, column in columns.items():
        out = out.append_column(name, column)
    return out


# -- resume --------------------------------------------------------------------------------------
def resume_digest(row_id: str | None, key: str | None, error: str | None) -> bytes | None:
    """What marks a row as answered in an output, 16 bytes of SHA-256: ``(id, key)`` of a row that
    succeeded, or ``(id, error)`` of a row that could not be parsed (it fails the same way again). A row
    that failed in the engine (key and error set) has none: a rerun tries it again."""
    if key and error is None:
        text = f"{row_id}\0{key}"
    elif key is None and error is not None:
        text = f"{row_id}\0error:{error}"
    else:
        return None
    return hashlib.sha256(text.encode()).digest()[:16]


def skip_done(batch: pa.Table, done: list | None = None) -> pa.Table:
    """Drop the rows whose :func:`resume_digest` is in ``done`` (a CPU task after prepare).

    Args:
        batch: prepared rows (``id``, ``key``, ``error``).
        done: ``[ObjectRef]`` of a sorted ``numpy`` array of dtype ``S16`` (read zero-copy from the
            object store by every task).
    """
    import numpy as np
    import ray

    digests = ray.get(done[0]) if done else np.empty(0, dtype="S16")
    if len(digests) == 0:
        return batch
    ids, keys, errors = (batch.column(c).to_pylist() for c in ("id", "key", "error"))
    mine = np.array([resume_digest(*x) or b"" for x in zip(ids, keys, errors)], dtype="S16")
    pos = np.minimum(np.searchsorted(digests, mine), len(digests) - 1)
    found = (digests[pos] == mine) & (mine != b"")
    return batch.filter(pa.array(~found))


# -- the engine ----------------------------------------------------------------------------------
class EngineStage:
    """A Ray Data actor UDF holding one deployment: it answers each prepared row of a batch and adds
    ``__record`` (the batch job's output line, JSON text).

    Args:
        model, engine, parallel: the deployment (``ModelConfig``, ``EngineConfig``, ``ParallelConfig``).
        in_process: run one engine replica in this actor (colocated, ``dp=1``); else start the fleet of
            ``parallel`` from here (its actors live as long as this one) and drive it through a client.
    Raises:
        ValueError, TimeoutError: the fleet cannot start (bad config, resources not granted in time).
    """

    def __init__(self, model, engine, parallel, in_process: bool):
        if in_process:
            from rayinfer.actors.engine_actor import EngineActorImpl

            replica = EngineActorImpl(model, engine)

            async def complete(prompt, params, request_id):
                return await replica.complete(request_id, prompt, params)
        else:
            from rayinfer.actors.client import make_client

            client = make_client(model, engine, parallel)

            async def complete(prompt, params, request_id):
                return await client.complete(prompt, params, request_id=request_id)
        self._complete = complete

    async def answer(self, job) -> str:
        """The output line of one parsed row (its ``n`` choices run concurrently)."""
        from rayinfer.jobs.generate import choice_params, output_record

        if job.error is not None:
            return json.dumps(output_record(job))
        prompt, choices = job.prompt_token_ids or [], choice_params(job.params)
        tag = uuid.uuid4().hex[:8]  # ids are not checked for duplicates across batches: keep engine ids unique
        results = await asyncio.gather(*[self._complete(prompt, p, f"{job.id}#{i}-{tag}") for i, p in enumerate(choices)])
        return json.dumps(output_record(job, results[0] if len(results) == 1 else list(results)))

    async def __call__(self, batch: pa.Table) -> AsyncIterator[pa.Table]:
        jobs = [pickle.loads(b) for b in batch.column(JOB_COLUMN).to_pylist()]
        records = await asyncio.gather(*[self.answer(job) for job in jobs])
        yield batch.drop_columns([JOB_COLUMN]).append_column(RECORD_COLUMN, pa.array(records, pa.string()))


# -- finish --------------------------------------------------------------------------------------
def record_columns(record: dict[str, Any]) -> dict[str, Any]:
    """One output line of the batch job as the processor's flat columns (:data:`OUTPUT_SCHEMA`):
    usage becomes ``num_*_tokens``; ``logprobs`` and ``choices`` stay JSON text (their per-token maps
    have no fixed Arrow schema), null when the row did not ask for them."""
    usage = record.get("usage") or {}
    return {
        "id": record["id"], "prompt_token_ids": record["prompt_token_ids"],
        "output_token_ids": record["output_token_ids"], "text": record["text"],
        "finish_reason": record["finish_reason"], "num_prompt_tokens": usage.get("prompt_tokens", 0),
        "num_output_tokens": usage.get("completion_tokens", 0), "num_cached_tokens": usage.get("cached_tokens", 0),
        "error": record["error"], "key": record["key"],
        "logprobs": json.dumps(record["logprobs"]) if "logprobs" in record else None,
        "choices": json.dumps(record["choices"]) if "choices" in record else None,
    }


def finish_batch(batch: pa.Table) -> pa.Table:
    """Turn ``__record`` into the output columns of :data:`OUTPUT_SCHEMA` (a CPU task); other columns
    pass through, and a column of the same name is replaced."""
    rows = [record_columns(json.loads(r)) for r in batch.column(RECORD_COLUMN).to_pylist()]
    out = batch.drop_columns([c for c in (RECORD_COLUMN, *OUTPUT_SCHEMA.names) if c in batch.column_names])
    for f in OUTPUT_SCHEMA:
        out = out.append_column(f, pa.array([r[f.name] for r in rows], f.type))
    return out
