"""The batch job's lines: the two input formats, parsed onto the service's own request path, their output
records, and what a rerun may reuse.

Formats (detected per file from its first JSON object line, or forced with ``input_format``):

- ``openai``: OpenAI's Batch API files. In: ``{"custom_id", "method": "POST", "url":
  "/v1/chat/completions" | "/v1/completions", "body": {...}}``; out: ``{"id", "custom_id", "response":
  {"status_code", "request_id", "body"}, "error"}``, where ``body`` is exactly what the service answers
  to that request (a ``chat.completion`` / ``text_completion``, or an OpenAI error object with a 4xx/5xx
  ``status_code``); a line that is no request at all (bad JSON, no ``custom_id``, another url) gets
  ``"response": null, "error": {"code", "message"}``.
- ``rayinfer``: ``{"id"?, "messages" | "prompt", sampling fields...}`` in; ``{id, prompt_token_ids,
  output_token_ids, text, finish_reason, usage, error, key, logprobs?, choices?}`` out.

Both become an OpenAI body (``rayinfer`` lines through :func:`rayinfer_body`) and go through
``ChatServing.prepare`` / ``CompletionServing.prepare``: the service's request models, chat rendering,
sampling parameters (``n``, seeds, logprobs, response_format, tools) and, for ``openai`` lines, its
response builder. Line numbers are the file's, 1-based (blank lines count).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayinfer.engine.errors import RayInferError
from rayinfer.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, from_error
from rayinfer.serve.serving import ChoiceState, OpenAIServing, PreparedRequest
from rayinfer.serve.serving_chat import ChatServing
from rayinfer.serve.serving_completion import CompletionServing

INPUT_FORMATS = ("auto", "openai", "rayinfer")
BATCH_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


def _default_id(line_no: int) -> str:
    """The id of a line that gives none."""
    return f"line-{line_no}"


@dataclass
class LineJob:
    """One input line, parsed.

    Attributes:
        line_no: the line's number in the file (1-based).
        id: the line's ``id`` / ``custom_id``, else ``line-<line_no>``.
        format: "openai" or "rayinfer".
        prepared: the request on the service's path (None when the line failed before that).
        error: why the line fails without running: an APIError the service would answer (``status`` >= 400),
            or, with ``status`` 0, a line that is no request at all (``code`` says why).
        key: the resume key of a prepared line (:func:`line_key`).
        custom_id: an ``openai`` line's custom_id (None when it has none).
    """

    line_no: int
    id: str
    format: str
    prepared: PreparedRequest | None = None
    error: APIError | None = None
    key: str | None = None
    custom_id: str | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        """The first prompt's token ids ([] before the line was prepared)."""
        return list(self.prepared.jobs[0][0]) if self.prepared else []

    @property
    def wants_logprobs(self) -> bool:
        return self.prepared is not None and self.prepared.jobs[0][1].logprobs is not None

    @property
    def has_own_id(self) -> bool:
        """Whether the line gave its ``id`` / ``custom_id`` (not the default ``line-<line_no>``)."""
        return self.id != _default_id(self.line_no)

    @property
    def output_id(self) -> str:
        """An ``openai`` output line's ``id``: a hash of custom_id and key, so a rerun recognises it."""
        if self.key is None or self.custom_id is None:
            return f"batch_req_line-{self.line_no}"
        return "batch_req_" + hashlib.sha256(f"{self.custom_id}\0{self.key}".encode()).hexdigest()[:32]


def line_error(code: str, message: str) -> APIError:
    """The error of a line that is no request (``status`` 0: it never reached the service's path)."""
    return APIError(message, status=0, code=code)


def read_lines(path: Path) -> list[tuple[int, str]]:
    """The non-blank lines of a file with their 1-based line numbers."""
    return [(i + 1, ln) for i, ln in enumerate(path.read_text().splitlines()) if ln.strip()]


def detect_format(lines: list[tuple[int, str]]) -> str:
    """"openai" when the first line that is a JSON object has ``custom_id`` or ``body`` and neither
    ``messages`` nor ``prompt``; else "rayinfer"."""
    for _, line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            is_batch = ("custom_id" in rec or "body" in rec) and not ({"messages", "prompt"} & set(rec))
            return "openai" if is_batch else "rayinfer"
    return "rayinfer"


def line_key(model: str, fmt: str, endpoint: str, body: dict, prepared: PreparedRequest) -> str:
    """A line's resume key: SHA-256 (hex) of the model, the format, the endpoint, the request body (ids
    left out) and every engine job's prompt token ids and sampling parameters, so that a stored answer is
    reused only for the same request."""
    payload = json.dumps({"model": model, "format": fmt, "endpoint": endpoint, "body": body,
                          "jobs": [[list(ids), dataclasses.asdict(p)] for ids, p in prepared.jobs]},
                         sort_keys=True, default=repr)
    return hashlib.sha256(payload.encode()).hexdigest()


_CHAT_FIELDS = set(ChatCompletionRequest.model_fields)
_COMPLETION_FIELDS = set(CompletionRequest.model_fields) | {"max_completion_tokens", "top_logprobs"}


def rayinfer_body(rec: dict[str, Any], defaults: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A ``rayinfer`` line (without its ``id``) as an OpenAI request body.

    ``messages`` makes a chat body and ``prompt`` (a string) a completion body; ``defaults`` fill the
    fields the line leaves out. The liberal names the format takes become the endpoint's own:
    ``logprobs`` as an integer on a chat line is ``logprobs: true, top_logprobs: k``; on a prompt line
    ``logprobs: true`` (with ``top_logprobs``) is the integer and ``max_completion_tokens`` is
    ``max_tokens``.

    Returns:
        ("chat" | "completions", body).
    Raises:
        APIError: 400 for a line with both or neither of messages and prompt, a field neither endpoint
            knows, or conflicting fields.
    """
    messages, prompt = rec.get("messages"), rec.get("prompt")
    if (messages is None) == (prompt is None):
        raise APIError("each line needs exactly one of 'messages' or 'prompt'")
    endpoint = "chat" if messages is not None else "completions"
    body = {**defaults, **rec}
    known = _CHAT_FIELDS if endpoint == "chat" else _COMPLETION_FIELDS
    unknown = sorted(set(body) - known)
    if unknown:
        hints = [f"{name} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(name, known, 1))
                 else name for name in unknown]
        raise APIError(f"unknown field(s) for a {'messages' if messages is not None else 'prompt'} line: "
                       f"{', '.join(hints)}", param=unknown[0])
    if "max_completion_tokens" in rec and "max_tokens" not in rec:
        body.pop("max_tokens", None)  # the line's own limit beats the job's default
    if endpoint == "chat":
        lp = body.get("logprobs")
        if isinstance(lp, int) and not isinstance(lp, bool):
            if body.get("top_logprobs") not in (None, lp):
                raise APIError("give logprobs as true with top_logprobs, or as an integer, not both",
                               param="top_logprobs")
            body["logprobs"], body["top_logprobs"] = True, lp
        elif lp is None:
            body.pop("logprobs", None)
        return endpoint, body
    if not isinstance(prompt, str):
        raise APIError("'prompt' must be a string", param="prompt")
    if "max_completion_tokens" in body:
        value = body.pop("max_completion_tokens")
        if rec.get("max_tokens") is not None and value is not None and rec["max_tokens"] != value:
            raise APIError("give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        if value is not None:
            body["max_tokens"] = value
    top = body.pop("top_logprobs", None)
    if isinstance(body.get("logprobs"), bool):
        body["logprobs"] = (top or 0) if body["logprobs"] else None
    elif top is not None:
        raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
    return endpoint, body


class LineParser:
    """Turns input lines into :class:`LineJob` on the service's request path.

    Args:
        tokenizer: the model's HF tokenizer.
        model_name: the name a body's ``model`` must match (as the service checks it), and the one the
            responses carry.
        max_model_len: the context limit in tokens (prompt + max_tokens are checked against it).
        defaults: sampling fields of every ``rayinfer`` line (a line's own fields win); ``openai``
            bodies are taken as the service takes them.
        key_model: the model name that goes into each resume key (the model's path or name).
        images: a vision-language model's :class:`~rayinfer.serve.images.ImageLoader`: chat lines may then
            carry ``image_url`` parts as the service takes them (``data:`` URLs, paths under its allowed
            directory); None refuses them.
    """

    def __init__(self, tokenizer, model_name: str, max_model_len: int, defaults: dict[str, Any] | None = None,
                 key_model: str | None = None, images=None):
        self.serving = OpenAIServing(None, tokenizer, model_name, max_model_len, images=images)
        self.handlers = {"chat": ChatServing(self.serving), "completions": CompletionServing(self.serving)}
        self.defaults = dict(defaults or {})
        self.key_model = key_model or model_name

    def parse(self, lines: list[tuple[int, str]], fmt: str = "auto") -> list[LineJob]:
        """Parse ``(line number, text)`` lines; a bad line gets ``error`` set, and nothing raises.

        Args:
            lines: the file's non-blank lines (:func:`read_lines`).
            fmt: "openai", "rayinfer", or "auto" (:func:`detect_format`).
        """
        fmt = detect_format(lines) if fmt == "auto" else fmt
        if fmt not in INPUT_FORMATS[1:]:
            raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {fmt!r}")
        jobs, seen = [], set()
        for line_no, line in lines:
            job = LineJob(line_no, _default_id(line_no), fmt)
            jobs.append(job)
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                # the file's line and the column in it (json's own "line 1 column N" counts within the line)
                job.error = line_error("invalid_json", f"malformed JSON on line {line_no}, column {e.colno}: {e.msg}")
                continue
            if not isinstance(rec, dict):
                job.error = line_error("invalid_request", f"line {line_no} must be a JSON object")
                continue
            try:
                if fmt == "openai":
                    endpoint, body = self._batch_request(job, rec, seen)
                else:
                    if rec.get("id") is not None:
                        job.id = str(rec["id"])
                    rec.pop("id", None)
                    if job.id in seen:
                        raise line_error("duplicate_id", f"line {line_no}: duplicate id {job.id!r}")
                    seen.add(job.id)
                    endpoint, body = rayinfer_body(rec, self.defaults)
                prepared = job.prepared = self.handlers[endpoint].prepare(body)
                job.key = line_key(self.key_model, fmt, endpoint, body, prepared)
            except APIError as e:
                job.error = e
        return jobs

    def _batch_request(self, job: LineJob, rec: dict, seen: set) -> tuple[str, dict]:
        """Check an ``openai`` line's envelope; returns (endpoint, body). Raises APIError (status 0)."""
        n = job.line_no
        cid = rec.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise line_error("missing_custom_id", f"line {n} needs a non-empty string 'custom_id'")
        job.id = job.custom_id = cid
        if cid in seen:
            raise line_error("duplicate_custom_id", f"line {n}: duplicate custom_id {cid!r}")
        seen.add(cid)
        if rec.get("method") != "POST":
            raise line_error("invalid_method", f"line {n}: 'method' must be \"POST\", got {rec.get('method')!r}")
        url = rec.get("url")
        if url not in BATCH_URLS:
            raise line_error("invalid_url", f"line {n}: 'url' must be one of {sorted(BATCH_URLS)}, got {url!r}")
        body = rec.get("body")
        if not isinstance(body, dict):
            raise line_error("invalid_body", f"line {n}: 'body' must be a JSON object")
        return BATCH_URLS[url], body


# -- output records ------------------------------------------------------------------------------------
def run_error(e: Exception, request_id: str) -> APIError:
    """The error a run of a prepared line ended with, as the service maps it (``from_error``); a 5xx
    message says "internal error" and the request id, under which the job logs the detail."""
    return from_error(e, request_id=request_id)


def output_record(job: LineJob, states: list[ChoiceState] | None = None,
                  error: tuple[APIError, Exception] | None = None) -> dict[str, Any]:
    """The output line of ``job`` in its format.

    Args:
        job: the parsed line.
        states: one finished ChoiceState per engine job (None when the line did not run or failed).
        error: (the API error, the exception) a run ended with, or None.
    """
    if job.format == "openai":
        return _openai_record(job, states, error[0] if error else None)
    return _rayinfer_record(job, states, error)


def _openai_record(job: LineJob, states: list[ChoiceState] | None, run_err: APIError | None) -> dict[str, Any]:
    err = job.error or run_err
    out: dict[str, Any] = {"id": job.output_id, "custom_id": job.custom_id, "response": None, "error": None}
    if err is not None and err.status == 0:
        out["error"] = {"code": err.code, "message": err.message}
        return out
    request_id = job.prepared.request_id if job.prepared else f"batch_req_line-{job.line_no}"
    if err is not None:
        out["response"] = {"status_code": err.status, "request_id": request_id, "body": err.body()}
    else:
        assert job.prepared is not None and states is not None
        out["response"] = {"status_code": 200, "request_id": request_id, "body": job.prepared.respond(states)}
    return out


def _rayinfer_record(job: LineJob, states: list[ChoiceState] | None,
                     error: tuple[APIError, Exception] | None) -> dict[str, Any]:
    states = states or []
    first = states[0] if states else None
    prompt = job.prompt_token_ids
    message = job.error.message if job.error else None
    if error is not None:
        api_error, e = error
        # the job's user runs the fleet: an engine failure's own text, not the service's "internal error"
        message = (api_error.message if api_error.status < 500 else
                   str(e) if isinstance(e, RayInferError) else f"internal error: {type(e).__name__}")
    num_out = sum(len(st.token_ids) for st in states)
    rec: dict[str, Any] = {
        "id": job.id,
        "prompt_token_ids": prompt,
        "output_token_ids": first.token_ids if first else [],
        "text": first.text if first else "",
        "finish_reason": "error" if message else first.finish_reason if first else None,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": num_out, "total_tokens": len(prompt) + num_out,
                  "cached_tokens": max((st.num_cached_tokens for st in states), default=0)},
        "error": message,
        "key": job.key,
    }
    if job.wants_logprobs:
        rec["logprobs"] = _token_logprobs(first)
    if len(states) > 1:
        rec["choices"] = [{"index": st.index, "text": st.text, "output_token_ids": st.token_ids,
                           "finish_reason": st.finish_reason,
                           **({"logprobs": _token_logprobs(st)} if job.wants_logprobs else {})} for st in states]
    return rec


def _token_logprobs(state: ChoiceState | None) -> list[dict[str, Any]]:
    """Per output token: its id, logprob and the top-k ``{token id: logprob}`` (token ids, as the
    ``rayinfer`` format gives every token; ``openai`` lines carry the service's text form)."""
    if state is None:
        return []
    return [{"token_id": s.token_id, "logprob": s.logprob, "top_logprobs": s.top_logprobs or {}}
            for s in state.logprobs]


def is_error(rec: dict[str, Any]) -> bool:
    """Whether an output record (either format) is a failed line."""
    if "custom_id" in rec:
        return rec.get("error") is not None or (rec.get("response") or {}).get("status_code") != 200
    return rec.get("error") is not None


def error_text(rec: dict[str, Any]) -> str:
    """A failed output record's message (either format)."""
    if "custom_id" in rec:
        if rec.get("error"):
            return str(rec["error"].get("message"))
        body = (rec.get("response") or {}).get("body") or {}
        return f"{rec['response'].get('status_code')}: {(body.get('error') or {}).get('message')}"
    return str(rec.get("error"))


def record_text(rec: dict[str, Any]) -> str:
    """The first choice's text of a finished output record (either format)."""
    if "custom_id" not in rec:
        return rec.get("text", "")
    choice = rec["response"]["body"]["choices"][0]
    return choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content") or ""


# -- resume ---------------------------------------------------------------------------------------------
def _stored_key(rec: dict[str, Any]) -> str | None:
    """The key under which a finished stored record is found: an ``openai`` record's id, a ``rayinfer``
    one's key; None for failed records (they run again)."""
    if not isinstance(rec, dict) or is_error(rec):
        return None
    if "custom_id" in rec:
        return rec.get("id") if str(rec.get("id", "")).startswith("batch_req_") else None
    return rec.get("key") if "id" in rec else None


def read_done(*paths: Path) -> dict[str, list[dict]]:
    """Finished records of earlier runs, by key; a later file's record of the same id and key replaces an
    earlier one. Cut or malformed lines are skipped."""
    by_id_key: dict[tuple[str, str], dict] = {}
    for path in paths:
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
                key = _stored_key(rec)
                if key:
                    by_id_key[(str(rec.get("custom_id", rec.get("id"))), key)] = rec
    done: dict[str, list[dict]] = {}
    for (_, key), rec in by_id_key.items():
        done.setdefault(key, []).append(rec)
    return done


def match_done(jobs: list[LineJob], stored: dict[str, list[dict]]) -> dict[str, dict]:
    """The jobs that an earlier run already answered; returns job id -> record.

    A ``rayinfer`` record is used once, for a job of the same key (one of the same id first) and takes
    the job's id; an ``openai`` record only for the line of the same custom_id and request.
    """
    done = {}
    for job in jobs:
        if job.error is not None or job.key is None:
            continue
        recs = stored.get(job.output_id if job.format == "openai" else job.key)
        if recs:
            rec = next((r for r in recs if r.get("id") == job.id), recs[0])
            recs.remove(rec)
            done[job.id] = rec if job.format == "openai" else {**rec, "id": job.id}
    return done


def drop_cut_line(path: Path) -> int:
    """Truncate a JSONL file after its last newline: a last line without one was cut by a crash while
    it was written, and the next record must not be appended to its fragment. Returns the bytes dropped."""
    if not path.exists():
        return 0
    with path.open("rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)
        return len(data) - keep


def append_record(f, rec: dict) -> None:
    """Append one record as one line with a single write to an unbuffered binary file (``open(path,
    "ab", buffering=0)``): a crash leaves at most that line cut, never a line and a half."""
    data = (json.dumps(rec) + "\n").encode()
    view = memoryview(data)
    while view:  # a regular file takes it in one write; loop in case the OS returns a short count
        view = view[f.write(view):]

