"""The processor's stages as Ray Data UDFs: prepare (CPU tasks), the engine (a pool of stateful actors),
records and finish (CPU tasks). Batches are ``pyarrow.Table``s; columns the stages do not own pass through.

Rows are read and answered on the batch job's one path (``rayinfer.jobs.batch_io``, imported lazily):
``LineParser`` turns a line into the service's prepared request (``ChatServing.prepare`` /
``CompletionServing.prepare``), the engine stage runs it as the job does (``OpenAIServing.collect``), and
``output_record`` builds the output line. A row renders, parses and answers exactly as the same line in
``python jobs/generate.py``, ``key`` and ids included, so the two modes agree and share resume keys.

Both input formats run: ``rayinfer`` lines (and dataset rows of ``messages`` / ``prompt``), and OpenAI
Batch lines (``input_format="openai"``, or detected per line with ``"auto"``). An OpenAI line's response
builder is a closure over the service's handler, which does not cross processes: the records stage
prepares such a line once more (a second tokenization, in a CPU task) to build its response body, so its
response ``id`` is a fresh one, not the one its engine requests ran under.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
import pickle
import time
from typing import Any, AsyncIterator

import pyarrow as pa

logger = logging.getLogger(__name__)

JOB_COLUMN = "__job"  # prepare -> engine -> records: the parsed row (a pickled _Row)
RESUME_COLUMN = "__resume"  # prepare -> skip_done: the row's resume digest (16 bytes, or null)
RESULT_COLUMN = "__result"  # engine -> records: (states, error) pickled
RECORD_COLUMN = "__record"  # records -> finish / the job's sink: the batch job's output line (JSON text)
INTERNAL_COLUMNS = (JOB_COLUMN, RESUME_COLUMN, RESULT_COLUMN, RECORD_COLUMN)
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
def line_parser(model: str, model_name: str | None, max_model_len: int | None, defaults_json: str):
    """One ``LineParser`` per worker process and setting (Ray reuses task workers, so later tasks find it).

    Args:
        model: the model whose tokenizer and chat template apply (also hashed into ``key``).
        model_name: the name a body's ``model`` must match and responses carry (None: ``model``).
        max_model_len: the context limit (None: the model config's ``max_position_embeddings``).
        defaults_json: the ``rayinfer`` lines' sampling defaults, as JSON (hashable).
    """
    from rayinfer.jobs.batch_io import LineParser
    from rayinfer.model.loader import load_config, load_tokenizer

    max_len = max_model_len or load_config(model).max_position_embeddings
    return LineParser(load_tokenizer(model), model_name or model, max_len, json.loads(defaults_json),
                      key_model=model)


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
        row: either ``line`` (a JSON text line of the batch job's input, as :func:`rayinfer.data.read_lines`
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


def _no_respond(states):
    raise RuntimeError("an OpenAI line's response is built after preparing it again (records_batch)")


@dataclasses.dataclass
class _Row:
    """A parsed row as it crosses processes: the ``LineJob`` (its response builder dropped), and the line
    it came from (an OpenAI line is prepared again where its record is built)."""

    job: Any
    line: str


def _portable(job):
    """``job`` without its prepared request's response builder (a closure that does not pickle)."""
    if job.prepared is None:
        return job
    return dataclasses.replace(job, prepared=dataclasses.replace(job.prepared, respond=_no_respond))


def parse_row(parser, line: str, line_no: int, fmt: str):
    """Parse one line as the batch job does (``LineParser.parse``), as line ``line_no`` of its file.

    Args:
        fmt: "rayinfer", "openai", or "auto" (this line decides, as ``detect_format`` would for a file
            starting with it).
    Returns:
        a ``LineJob``; never raises (a bad line has ``error`` set). Ids are not checked for duplicates
        (rows are parsed one at a time, in many tasks).
    """
    return parser.parse([(line_no, line)], fmt)[0]


def prepare_batch(batch: pa.Table, *, model: str, defaults: dict[str, Any], input_format: str = "rayinfer",
                  model_name: str | None = None, max_model_len: int | None = None) -> pa.Table:
    """Render, tokenize and parse each row (a CPU task).

    Args:
        batch: rows as :func:`row_line` reads them, and optionally ``line_no`` (int, the row's 1-based
            line number in its file: the default id is ``line-<line_no>``; else the row's number in the
            batch, from 1).
        model: the model whose tokenizer and chat template apply (also hashed into ``key``).
        defaults: sampling fields of every ``rayinfer`` row (a row's own win).
        input_format: "rayinfer", "openai" or "auto" (per line); rows without ``line`` are ``rayinfer``.
        model_name: the name an OpenAI body's ``model`` must match (None: ``model``).
        max_model_len: the context limit (None: the model's).
    Returns:
        ``batch`` without ``line``, with ``id`` (str: the line's id or custom_id), ``prompt_token_ids``
        (list[int64], empty for a bad row), ``key`` (str, the job's resume key; null for a bad row),
        ``error`` (str or null) and the internal ``__job`` and ``__resume`` columns.
    """
    from rayinfer.jobs.batch_io import INPUT_FORMATS

    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {input_format!r}")
    parser = line_parser(model, model_name, max_model_len, json.dumps(defaults, sort_keys=True))
    names = [c for c in INPUT_COLUMNS if c in batch.column_names]
    rows = batch.select(names).to_pylist()
    numbers = batch.column("line_no").to_pylist() if "line_no" in batch.column_names else range(1, len(rows) + 1)
    jobs, lines = [], []
    for row, line_no in zip(rows, numbers):
        line = row_line(row)
        fmt = input_format if row.get("line") is not None else "rayinfer"
        jobs.append(parse_row(parser, line, int(line_no), fmt))
        lines.append(line)
    out = batch.drop_columns([c for c in ("line", "line_no", "id", "prompt_token_ids", "key", "error",
                                          *INTERNAL_COLUMNS) if c in batch.column_names])
    columns = {
        "id": pa.array([j.id for j in jobs], pa.string()),
        "prompt_token_ids": pa.array([j.prompt_token_ids for j in jobs], pa.list_(pa.int64())),
        "key": pa.array([j.key for j in jobs], pa.string()),
        "error": pa.array([None if j.error is None else j.error.message for j in jobs], pa.string()),
        JOB_COLUMN: pa.array([pickle.dumps(_Row(_portable(j), ln)) for j, ln in zip(jobs, lines)], pa.binary()),
        RESUME_COLUMN: pa.array([job_digest(j) for j in jobs], pa.binary(16)),
    }
    for name, column in columns.items():
        out = out.append_column(name, column)
    return out


# -- resume --------------------------------------------------------------------------------------
def _digest(*parts: str | None) -> bytes:
    return hashlib.sha256(json.dumps(parts).encode()).digest()[:16]


def resume_digest(row_id: str | None, key: str | None, error: str | None) -> bytes | None:
    """What marks a ``rayinfer`` row as answered in an output, 16 bytes of SHA-256: ``(id, key)`` of a
    row that succeeded, or ``(id, error)`` of a row that could not be parsed (it fails the same way
    again). A row that failed in the engine (key and error set) has none: a rerun tries it again."""
    if key and error is None:
        return _digest("ok", row_id, key)
    if key is None and error is not None:
        return _digest("bad", row_id, error)
    return None


def record_digest(rec: Any) -> bytes | None:
    """The resume digest of an output record of either format (None: run the line again).

    ``rayinfer``: :func:`resume_digest`. ``openai``: a finished record by its ``id`` (a hash of custom_id
    and the request's key, ``LineJob.output_id``); a line that never reached the engine (its id
    ``batch_req_line-<n>``) by custom_id, id and error; a request that failed in the engine, none.
    """
    from rayinfer.jobs.batch_io import error_text, is_error

    if not isinstance(rec, dict) or "id" not in rec:
        return None
    if "custom_id" not in rec:
        return resume_digest(str(rec["id"]), rec.get("key"), rec.get("error"))
    rid = str(rec["id"])
    if not is_error(rec):
        return _digest("ok", rid) if rid.startswith("batch_req_") else None
    if rid.startswith("batch_req_line-"):
        return _digest("bad", rec.get("custom_id"), rid, error_text(rec))
    return None


def job_digest(job) -> bytes | None:
    """The digest (:func:`record_digest`) that the record of a parsed line will have, when it has one
    before running: a prepared line's, or the record of a line that fails without running."""
    from rayinfer.jobs.batch_io import output_record

    if job.error is not None:
        return record_digest(output_record(job))
    if job.format == "openai":
        return _digest("ok", job.output_id)
    return resume_digest(job.id, job.key, None)


def skip_done(batch: pa.Table, done: list | None = None) -> pa.Table:
    """Drop the rows whose resume digest (``__resume``) is in ``done`` (a CPU task after prepare).

    Args:
        batch: prepared rows.
        done: ``[ObjectRef]`` of a sorted ``numpy`` array of dtype ``S16`` (read zero-copy from the
            object store by every task).
    """
    import numpy as np
    import ray

    digests = ray.get(done[0]) if done else np.empty(0, dtype="S16")
    if len(digests) == 0:
        return batch
    mine = np.array([d or b"" for d in batch.column(RESUME_COLUMN).to_pylist()], dtype="S16")
    pos = np.minimum(np.searchsorted(digests, mine), len(digests) - 1)
    found = (digests[pos] == mine) & (mine != b"")
    return batch.filter(pa.array(~found))


# -- the engine ----------------------------------------------------------------------------------
class _InProcessClient:
    """An ``EngineClient``'s ``generate`` over a replica in this process (``EngineActorImpl``)."""

    def __init__(self, replica):
        self.replica = replica

    def generate(self, prompt_token_ids: list[int], params, request_id: str | None = None):
        return self.replica.generate(request_id, prompt_token_ids, params)


class EngineStage:
    """A Ray Data actor UDF holding one deployment: it runs each prepared row of a batch on the service's
    request path (``OpenAIServing.collect``, as the batch job does) and adds ``__result``.

    Args:
        model, engine, parallel: the deployment (``ModelConfig``, ``EngineConfig``, ``ParallelConfig``).
        in_process: run one engine replica in this actor (colocated, ``dp=1``); else start the fleet of
            ``parallel`` from here (its actors live as long as this one) and drive it through a client.
    Raises:
        ValueError, TimeoutError: the fleet cannot start (bad config, resources not granted in time).
    """

    def __init__(self, model, engine, parallel, in_process: bool):
        from rayinfer.serve.serving import OpenAIServing

        if in_process:
            from rayinfer.actors.engine_actor import EngineActorImpl

            replica = EngineActorImpl(model, engine)
            client, tokenizer = _InProcessClient(replica), replica.engine.engine.tokenizer
        else:
            from rayinfer.actors.client import make_client
            from rayinfer.model.loader import load_tokenizer

            client, tokenizer = make_client(model, engine, parallel), load_tokenizer(model.model)
        # only collect() is used: the request path's fan-out of a line's n choices, errors mapped
        self.serving = OpenAIServing(client, tokenizer, model.model, model.max_model_len or 0)

    async def answer(self, row: _Row) -> bytes:
        """Run one parsed row; returns ``pickle((states, error))`` (see :func:`records_batch`)."""
        from rayinfer.jobs.batch_io import run_error

        job = row.job
        if job.error is not None:
            return pickle.dumps((None, None))
        request_id = job.prepared.request_id
        try:
            states = await self.serving.collect(request_id, job.prepared.jobs, time.perf_counter())
            return pickle.dumps((states, None))
        except Exception as e:  # noqa: BLE001 - this row fails alone, as its line would in the job
            err = run_error(e, request_id)
            if err.status >= 500:
                logger.error("line %d (%s) failed (request id %s)", job.line_no, job.id, request_id, exc_info=e)
            try:
                pickle.dumps(e)
            except Exception:  # noqa: BLE001 - an exception that does not cross processes: its text does
                e = RuntimeError(str(e))
            return pickle.dumps((None, (err, e)))

    async def __call__(self, batch: pa.Table) -> AsyncIterator[pa.Table]:
        rows = [pickle.loads(b) for b in batch.column(JOB_COLUMN).to_pylist()]
        results = await asyncio.gather(*[self.answer(row) for row in rows])
        out = batch.drop_columns([c for c in (RESUME_COLUMN, RESULT_COLUMN) if c in batch.column_names])
        yield out.append_column(RESULT_COLUMN, pa.array(results, pa.binary()))


# -- records -------------------------------------------------------------------------------------
def records_batch(batch: pa.Table, *, model: str, defaults: dict[str, Any], model_name: str | None = None,
                  max_model_len: int | None = None) -> pa.Table:
    """Turn ``__job`` and ``__result`` into ``__record``, the batch job's output line (``output_record``,
    JSON text), in a CPU task. An OpenAI line is prepared again here for its response builder (the
    parser's arguments must be prepare's)."""
    from rayinfer.jobs.batch_io import output_record

    records = []
    for raw_row, raw_result in zip(batch.column(JOB_COLUMN).to_pylist(), batch.column(RESULT_COLUMN).to_pylist()):
        row: _Row = pickle.loads(raw_row)
        states, error = pickle.loads(raw_result)
        job = row.job
        if job.format == "openai" and job.error is None and error is None:
            parser = line_parser(model, model_name, max_model_len, json.dumps(defaults, sort_keys=True))
            job = parse_row(parser, row.line, job.line_no, "openai")  # the same request, with its builder
        records.append(json.dumps(output_record(job, states, error)))
    out = batch.drop_columns([c for c in INTERNAL_COLUMNS if c in batch.column_names])
    return out.append_column(RECORD_COLUMN, pa.array(records, pa.string()))


# -- finish --------------------------------------------------------------------------------------
def record_columns(record: dict[str, Any]) -> dict[str, Any]:
    """One output line of the batch job as the processor's flat columns (:data:`OUTPUT_SCHEMA`):
    usage becomes ``num_*_tokens``; ``logprobs`` and ``choices`` stay JSON text (their per-token maps
    have no fixed Arrow schema), null when the row did not ask for them."""
    if "custom_id" in record:
        raise ValueError("an OpenAI Batch line's record has no flat columns: read it from the records stage "
                         "(Processor.records), as the batch job does")
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
