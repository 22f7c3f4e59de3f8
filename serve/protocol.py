"""OpenAI request bodies (pydantic, only here at the HTTP boundary) and OpenAI-shaped errors.

Scalars are strict (``"5"`` is not an integer, ``true`` is not a number), as the OpenAI API is; unknown
fields are accepted and ignored so newer clients keep working, with a warning in the server's log that
names a request's own unknown fields (as vLLM does; a message's extra fields may be read by the chat
template). Responses are plain dicts built in ``serve/serving_*.py``.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rayinfer.engine.errors import EngineInternalError, OverloadedError, RayInferError

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------
# errors


class APIError(Exception):
    """An error answered with an OpenAI error object: ``{"error": {message, type, param, code}}``.

    Args:
        message: what is wrong, for the user.
        status: HTTP status (400 bad input, 401 auth, 404 unknown model, 500 server).
        type: OpenAI error type (``invalid_request_error``, ``authentication_error``, ...).
        param: the request field at fault, if any.
        code: a machine-readable code, if any.
    """

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field (``messages.0.role``)."""
    err = e.errors()[0]
    param = ".".join(str(p) for p in err["loc"] if _is_field(p)) or None
    msg = err["msg"]
    if err["type"] == "missing":
        msg = f"'{param}' is a required property"
    elif param:
        msg = f"{param}: {msg}"
        if err["type"] not in ("extra_forbidden",) and "input" in err:
            msg += f" (got {_short(err['input'])})"
    return APIError(msg, param=param, code="invalid_type" if err["type"].endswith("_type") else None)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_field(part) -> bool:
    """Keep field names and list indices of an error location; drop pydantic's union-member tags."""
    return isinstance(part, int) or (re.fullmatch(r"[a-z_][a-z0-9_]*", str(part)) is not None
                                     and part not in _TYPE_TAGS)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def from_error(e: Exception, default_param: str | None = None, request_id: str | None = None) -> APIError:
    """One of rayinfer's errors (``rayinfer.engine.errors``) as an OpenAI error, by its type: invalid or
    unsupported -> 400 with ``param`` from the error; overloaded -> 503; internal or anything else ->
    500. A bare ValueError (validation below our types) is a 400.

    A 5xx body never carries the exception's text (a Ray error's text holds tracebacks, node addresses
    and memory reports): it says "internal error" or "overloaded" and, when given, ``request_id``, so an
    operator can find the detail, which the caller logs under that id.
    """
    if isinstance(e, APIError):
        return e
    cause = getattr(e, "cause", None)  # Ray's RayTaskError: its text is the remote traceback; map its cause
    if isinstance(cause, Exception) and type(e).__name__.startswith("RayTaskError"):
        return from_error(cause, default_param, request_id)
    ref = f" (request id {request_id})" if request_id else ""
    if isinstance(e, OverloadedError):
        return APIError(f"the server is overloaded; retry later{ref}", status=503, type="overloaded_error",
                        code="overloaded")
    if isinstance(e, EngineInternalError) or not isinstance(e, (RayInferError, ValueError)):
        return APIError(f"internal error{ref}", status=500, type="internal_error")
    param = getattr(e, "param", None) or default_param
    status = getattr(e, "status", 400)
    if status >= 500:
        return APIError(f"internal error{ref}", status=status, type="internal_error")
    return APIError(str(e), status=status, param=param)


def from_value_error(e: ValueError, default_param: str | None = None) -> APIError:
    """A validation error (SamplingParams, the engine) as a 400 naming its ``param`` (see :func:`from_error`)."""
    return from_error(e, default_param)


# ---------------------------------------------------------------------------------------------------
# raw bodies

MAX_JSON_DEPTH = 100  # nesting of arrays/objects in a request body; deeper is a 400 (no schema needs more)
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def parse_json_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode a request body and check that every string in it is text a tokenizer can take.

    Args:
        raw: the body bytes (UTF-8 JSON).
        max_depth: the deepest nesting of arrays and objects accepted.
    Returns:
        the decoded JSON value.
    Raises:
        APIError: 400 ``invalid_json`` for bytes that are not UTF-8 JSON or nest deeper than
            ``max_depth``; 400 ``invalid_text`` (``param`` the path, e.g. ``messages.0.content``) for a
            string holding a lone UTF-16 surrogate such as ``"\\ud800"`` (valid JSON, but no Unicode
            text: no tokenizer can encode it and no response can echo it).
    """
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(f"the request body nests arrays or objects deeper than {max_depth} levels",
                       code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    # iterative walk: a recursive one would fail on the very bodies it must refuse
    stack: list[tuple[Any, tuple, int]] = [(body, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE_RE.search(value):
                raise _bad_text(path, value)
            continue
        if not isinstance(value, (list, dict)):
            continue
        if depth > max_depth:
            raise APIError(f"the request body nests arrays or objects deeper than {max_depth} levels",
                           param=str(path[0]) if path else None, code="invalid_json")
        if isinstance(value, dict):
            for k, v in value.items():
                if _SURROGATE_RE.search(k):
                    raise _bad_text(path, k)
                stack.append((v, path + (k,), depth + 1))
        else:
            stack.extend((v, path + (i,), depth + 1) for i, v in enumerate(value))
    return body


def num_text_chars(value: Any) -> int:
    """Characters in every string of a decoded JSON value (a request's prompt text, before tokenizing)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def _path(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _bad_text(path: tuple, text: str) -> APIError:
    m = _SURROGATE_RE.search(text)
    assert m is not None
    where = f"'{_path(path)}'" if path else "the request body"
    return APIError(f"{where} holds a lone surrogate (\\u{ord(m.group()):04x} at character {m.start()}), "
                    "which is not valid Unicode text; send UTF-8 text or escape characters outside the "
                    "BMP as surrogate pairs", param=_path(path) or None, code="invalid_text")


# ---------------------------------------------------------------------------------------------------
# request bodies


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str  # a data: URL (base64 PNG/JPEG/WebP), or a local path under the configured media directory
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    """An image content part (vision-language models; see ``rayinfer.serve.images``)."""

    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_\-.]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by chat and text completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` (text) or ``messages`` (a chat, with optional
    ``tools``), rendered as the completion and chat endpoints render them. Other fields of vLLM's
    (``chat_template``, ``continue_final_message``, ...) are refused, not ignored: they would change the
    tokens."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None  # prompt only (default True); a chat template adds its own
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's shape): token ids to text."""

    model: str | None = None
    tokens: list[int]


def parse_body(model: type[BaseModel], body: Any, request_id: str | None = None) -> BaseModel:
    """Validate a decoded JSON body against a request model.

    Top-level fields the model does not know are ignored, and logged as a warning that names them and
    ``request_id`` (a misspelled ``temprature`` would otherwise pass unseen). Nested ones are not named:
    a message's extra fields (``reasoning_content``) go on to the chat template.

    Raises:
        APIError: 400 naming the first bad field.
    """
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    ignored = list(parsed.model_extra or {})  # nested extras (a message's) may reach the chat template
    if ignored:
        logger.warning("request %s: the following fields were present in the request but ignored: %s",
                       request_id or "(no id)", ", ".join(ignored))
    return parsed


def response_format_of(req: _SamplingRequest) -> dict | None:
    """The request's output constraint as a ``SamplingParams.response_format`` dict (or None).

    ``response_format`` wins; vLLM's ``guided_*`` fields are accepted as aliases.

    Raises:
        APIError: if more than one constraint is given.
    """
    given = [name for name in ("response_format", "guided_json", "guided_regex", "guided_grammar",
                               "guided_choice") if getattr(req, name) is not None]
    if len(given) > 1:
        raise APIError(f"give at most one output constraint; got {', '.join(given)}", param=given[1])
    if req.response_format is not None:
        rf = req.response_format
        if rf.get("type") == "text":
            return None
        return rf
    if req.guided_json is not None:
        return {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": req.guided_json}}
    if req.guided_regex is not None:
        return {"type": "regex", "regex": req.guided_regex}
    if req.guided_grammar is not None:
        return {"type": "ebnf", "ebnf": req.guided_grammar}
    if req.guided_choice is not None:
        if not req.guided_choice:
            raise APIError("guided_choice must not be empty", param="guided_choice")
        return {"type": "regex", "regex": "(" + "|".join(re.escape(c) for c in req.guided_choice) + ")"}
    return None
