"""Reading and writing the batch job's JSONL with Ray Data, streamed: input lines with their numbers,
output part files that appear whole, and the resume digests of an output directory."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
from ray.data.block import Block, BlockAccessor
from ray.data.datasource import Datasink, FileBasedDatasource

from rayinfer.data.stages import RECORD_COLUMN, record_digest

_CHUNK_BYTES = 1 << 20
_BLOCK_LINES = 4096


def _iter_lines(f) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of the non-blank lines of a binary stream, numbered as the batch job
    numbers them (1-based, blank lines counted), read in chunks: a file never has to fit in memory."""
    line_no, rest = 0, b""
    while True:
        chunk = f.read(_CHUNK_BYTES)
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop() if chunk else b""
        for raw in parts:
            line_no += 1
            text = raw.decode("utf-8", errors="replace").rstrip("\r")
            if text.strip():
                yield line_no, text
        if not chunk:
            return


def _lines_table(numbers: list[int], lines: list[str]) -> pa.Table:
    return pa.table({"line": pa.array(lines, pa.string()), "line_no": pa.array(numbers, pa.int64())})


class _LinesDatasource(FileBasedDatasource):
    """Non-blank lines of text files with their line numbers (:func:`_iter_lines`)."""

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[Block]:
        numbers: list[int] = []
        lines: list[str] = []
        for line_no, text in _iter_lines(f):
            numbers.append(line_no)
            lines.append(text)
            if len(lines) >= _BLOCK_LINES:
                yield _lines_table(numbers, lines)
                numbers, lines = [], []
        if lines:
            yield _lines_table(numbers, lines)


def detect_input_format(path: str, max_lines: int = 1000) -> str:
    """The batch job's format of a JSONL input (``rayinfer.jobs.batch_io.detect_format`` on its first
    ``max_lines`` non-blank lines; a directory: its first file), "rayinfer" when it has no JSON object line.
    A compressed file is read by its extension."""
    from rayinfer.jobs.batch_io import detect_format

    fs, root = _filesystem(path)
    if fs.get_file_info(root).type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        files = sorted(i.path for i in infos if i.type == pafs.FileType.File and not i.base_name.startswith("."))
        if not files:
            return "rayinfer"
        root = files[0]
    head: list[tuple[int, str]] = []
    with fs.open_input_stream(root, compression="detect") as f:
        for item in _iter_lines(f):
            head.append(item)
            if len(head) >= max_lines:
                break
    return detect_format(head)


def read_lines(paths: str | list[str], **read_args: Any):
    """A dataset of the non-blank lines of JSONL files: ``line`` (str) and ``line_no`` (int64, the
    line's number in its file, 1-based, blank lines counted, as the batch job numbers them). Compressed
    files (``.gz``, ...) are read by their extension.

    Args:
        paths: files, directories or URIs (``s3://``, ...); on a multi-node cluster every node must see
            them (a shared path, object storage, or ``local://`` for a file on the head node).
        read_args: passed to ``ray.data.read_datasource`` (``override_num_blocks``, ...).
    Raises:
        FileNotFoundError: no such file.
    """
    import ray.data

    return ray.data.read_datasource(_LinesDatasource(paths), **read_args)


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and path of ``uri`` (a local path, absolute or relative, or ``scheme://...``)."""
    if "://" in uri:
        fs, path = pafs.FileSystem.from_uri(uri)
        return fs, path
    return pafs.LocalFileSystem(), str(Path(uri).resolve())


def output_files(directory: str) -> list[str]:
    """The finished part files (``*.jsonl``, not hidden) of an output directory, as URIs or paths
    ``read_lines`` takes; none when it does not exist."""
    fs, root = _filesystem(directory)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        return []
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=False))
    names = sorted(i.base_name for i in infos if i.type == pafs.FileType.File
                   and i.base_name.endswith(".jsonl") and not i.base_name.startswith("."))
    prefix = directory.rstrip("/") if "://" in directory else root
    return [f"{prefix}/{name}" for name in names]


def _digests_of_records(batch: pa.Table) -> pa.Table:
    import json

    out = []
    for line in batch.column("line").to_pylist():
        try:
            digest = record_digest(json.loads(line))
        except ValueError:  # a cut or malformed line
            digest = None
        if digest is not None:
            out.append(digest)
    return pa.table({"digest": pa.array(out, pa.binary(16))})


def read_done_digests(directory: str) -> np.ndarray:
    """The resume digests (``rayinfer.data.stages.record_digest``) of every record in an output
    directory, read with Ray Data.

    Returns:
        ``[num_done]`` numpy ``S16``, sorted and unique (empty when there is no output yet): what
        ``skip_done`` searches. Memory: 16 bytes per answered row, on the driver.
    """
    files = output_files(directory)
    if not files:
        return np.empty(0, dtype="S16")
    ds = read_lines(files).map_batches(_digests_of_records, batch_format="pyarrow")
    parts = [np.asarray(b["digest"], dtype="S16") for b in ds.iter_batches(batch_format="numpy", batch_size=None)]
    return np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype="S16")


def output_tokens(rec: dict) -> int:
    """The completion tokens of an output record of either format (0 for a failed line)."""
    if "custom_id" in rec:
        body = (rec.get("response") or {}).get("body") or {}
        return (body.get("usage") or {}).get("completion_tokens", 0)
    return (rec.get("usage") or {}).get("completion_tokens", 0)


class JsonlSink(Datasink):
    """Writes one column of JSON text lines as part files of a directory. Each write task writes a
    hidden temporary file and renames it when whole, so an interrupted run leaves whole files only, and a
    rerun adds files of its own beside them.

    Args:
        directory: a local path or a URI (``s3://...``); created when missing.
        column: the column to write (one line per row).
    Attributes (after ``write_datasink``):
        num_rows, num_failed: records written, and the failed ones (``batch_io.is_error``).
        num_output_tokens: ``usage.completion_tokens`` summed (an OpenAI record's response body's).
        failures: (id or custom_id, error text) of the first 20 failed records.
        files: the part files written.
    """

    def __init__(self, directory: str, column: str = RECORD_COLUMN):
        self.directory = directory
        self.column = column
        self.run_id = uuid.uuid4().hex[:8]
        self.num_rows = self.num_failed = self.num_output_tokens = 0
        self.failures: list[tuple[str, str]] = []
        self.files: list[str] = []

    def on_write_start(self, schema=None) -> None:
        fs, root = _filesystem(self.directory)
        fs.create_dir(root, recursive=True)

    def write(self, blocks: Iterable[Block], ctx) -> dict:
        import json

        from rayinfer.jobs.batch_io import error_text, is_error

        fs, root = _filesystem(self.directory)
        name = f"part-{self.run_id}-{ctx.task_idx:06d}-{uuid.uuid4().hex[:6]}.jsonl"
        tmp, final = f"{root}/.{name}.tmp", f"{root}/{name}"
        stats: dict[str, Any] = {"num_rows": 0, "num_failed": 0, "num_output_tokens": 0, "failures": [], "file": None}
        with fs.open_output_stream(tmp) as out:
            for block in blocks:
                for line in BlockAccessor.for_block(block).to_arrow().column(self.column).to_pylist():
                    out.write((line + "\n").encode())
                    rec = json.loads(line)
                    stats["num_rows"] += 1
                    stats["num_output_tokens"] += output_tokens(rec)
                    if is_error(rec):
                        stats["num_failed"] += 1
                        if len(stats["failures"]) < 20:
                            stats["failures"].append((rec.get("custom_id", rec.get("id")), error_text(rec)))
        if stats["num_rows"] == 0:
            fs.delete_file(tmp)
            return stats
        fs.move(tmp, final)
        stats["file"] = final
        return stats

    def on_write_complete(self, write_result) -> None:
        for stats in write_result.write_returns:
            self.num_rows += stats["num_rows"]
            self.num_failed += stats["num_failed"]
            self.num_output_tokens += stats["num_output_tokens"]
            self.failures.extend(stats["failures"][: 20 - len(self.failures)])
            if stats["file"]:
                self.files.append(stats["file"])
