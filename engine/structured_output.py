"""Structured output: compile ``response_format`` specs into xgrammar grammars, off the request path.

A response format is a JSON-like dict (the shape of ``SamplingParams.response_format``):

    {"type": "text"}                                   no constraint
    {"type": "json_object"}                            any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}   OpenAI structured output
    {"type": "regex", "regex": "..."}                  the whole output matches the regex
    {"type": "ebnf", "ebnf": "root ::= ..."}           xgrammar EBNF ("grammar" is an alias)
    {"type": "structural_tag", "format": {...}}        an xgrammar structural tag (tool calls use it)

:func:`check_response_format` validates a spec without a tokenizer (the HTTP ingress calls it, so a bad
schema is a 400 before any engine work). :class:`GrammarCompilerService` compiles on a thread pool with
an LRU cache keyed by the canonical spec and a timeout; the engine masks logits with the matcher that
:meth:`GrammarCompilerService.matcher` returns (``LLMEngine.add_request(grammar=...)``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import threading
from typing import Any

from rayinfer.engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_TYPES = ("text", "json_object", "json_schema", "regex", "ebnf", "grammar", "structural_tag")


class GrammarError(InvalidRequestError):
    """A response format that is malformed, fails to compile, or takes too long to compile (param
    ``response_format``)."""

    def __init__(self, message: str, param: str | None = "response_format"):
        super().__init__(message, param)


def canonical_key(response_format: dict) -> str:
    """The cache key of a response format: its JSON with sorted keys."""
    return json.dumps(response_format, sort_keys=True, separators=(",", ":"))


def is_constrained(response_format: dict | None) -> bool:
    """True when the format constrains the output (anything but None or ``{"type": "text"}``)."""
    return response_format is not None and response_format.get("type") != "text"


def json_schema_of(response_format: dict) -> Any:
    """The JSON schema inside a ``json_schema`` format (accepts ``schema`` at either nesting level).

    Raises:
        GrammarError: if the schema is missing or not an object/boolean.
    """
    spec = response_format.get("json_schema")
    if isinstance(spec, dict) and "schema" in spec:
        schema = spec["schema"]
    elif isinstance(spec, dict) and spec and "name" not in spec:
        schema = spec  # a bare schema (vLLM's guided_json style)
    elif "schema" in response_format:
        schema = response_format["schema"]
    else:
        raise GrammarError("response_format.json_schema.schema is required")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"response_format.json_schema.schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("response_format.json_schema.schema must be a JSON object")
    return schema


def _string_field(response_format: dict, *names: str) -> str:
    for name in names:
        value = response_format.get(name)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise GrammarError(f"response_format.{name} must be a non-empty string")
            return value
    raise GrammarError(f"response_format.{names[0]} is required for type {response_format.get('type')!r}")


def _failed(fut: concurrent.futures.Future) -> bool:
    return fut.done() and (fut.cancelled() or fut.exception() is not None)


def _clean_error(e: Exception) -> str:
    """xgrammar's C++ errors start with a timestamp and a source location; keep the message."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "] " in msg and msg.startswith("["):
        msg = msg.split("] ", 1)[1]
    if ": " in msg and ".cc:" in msg.split(": ", 1)[0]:
        msg = msg.split(": ", 1)[1]
    return msg


def build_grammar(response_format: dict):
    """Parse a response format into an (uncompiled) ``xgrammar.Grammar``; needs no tokenizer.

    Returns:
        an ``xgrammar.Grammar``, or None for ``{"type": "text"}``.
    Raises:
        GrammarError: naming the problem (unknown type, missing field, invalid schema/regex/EBNF).
    """
    import xgrammar as xgr

    if not isinstance(response_format, dict):
        raise GrammarError("response_format must be an object with a 'type' field")
    kind = response_format.get("type")
    if kind not in _TYPES:
        raise GrammarError(f"response_format.type must be one of {', '.join(_TYPES)}; got {kind!r}")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return xgr.Grammar.from_json_schema({"type": "object"}, any_whitespace=False)
        if kind == "json_schema":
            schema = json_schema_of(response_format)
            _check_schema(schema)
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return xgr.Grammar.from_regex(_string_field(response_format, "regex", "pattern"))
        if kind in ("ebnf", "grammar"):
            return xgr.Grammar.from_ebnf(_string_field(response_format, "ebnf", "grammar"))
        return xgr.Grammar.from_structural_tag(json.dumps(response_format))
    except GrammarError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError (C++) or pydantic errors (structural tags)
        raise GrammarError(f"invalid response_format ({kind}): {_clean_error(e)}") from None


def _check_schema(schema: Any) -> None:
    """Reject a schema that is not valid JSON Schema (draft 2020-12) before xgrammar sees it."""
    if isinstance(schema, bool):
        return
    try:
        import jsonschema
    except ImportError:  # optional: xgrammar's own converter still rejects most bad schemas
        return
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise GrammarError(f"response_format has an invalid JSON schema{' at ' + where if where else ''}: "
                          f"{e.message}") from None


def check_response_format(response_format: dict | None) -> None:
    """Validate a response format without a tokenizer (cheap; for the HTTP boundary).

    Raises:
        GrammarError: naming the problem.
    """
    if response_format is not None:
        build_grammar(response_format)


class GrammarCompilerService:
    """Compiles response formats for one tokenizer on a thread pool, with an LRU cache and a timeout.

    Concurrent requests with the same spec share one compilation (the cache holds futures). A failed
    compilation is evicted so a later request retries; a timed-out one keeps running in the pool and
    lands in the cache if it finishes, so a repeat of the same slow grammar can still succeed.

    Args:
        tokenizer_info: an ``xgrammar.TokenizerInfo`` whose vocab size is the model's logits width.
        max_workers: compile threads.
        cache_size: compiled grammars kept (least recently used evicted first).
        timeout_s: seconds a request waits for its grammar before it fails with a GrammarError.
    """

    def __init__(self, tokenizer_info, max_workers: int = 2, cache_size: int = 128, timeout_s: float = 10.0):
        import xgrammar as xgr

        self.tokenizer_info = tokenizer_info
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_workers, cache_enabled=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids=None, **kwargs) -> "GrammarCompilerService":
        """Build from a Hugging Face tokenizer.

        Args:
            tokenizer: the model's HF tokenizer.
            vocab_size: the model's vocab size (logits width), which may exceed ``len(tokenizer)``: the
                extra ids are padding the grammar never allows.
            stop_token_ids: ids that end a constrained output (default: the tokenizer's EOS).
        """
        import xgrammar as xgr

        stop = list(stop_token_ids) if stop_token_ids else None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        return cls(info, **kwargs)

    def _compile_now(self, response_format: dict):
        grammar = build_grammar(response_format)
        if grammar is None:
            return None
        try:
            return self._compiler.compile_grammar(grammar)
        except Exception as e:
            raise GrammarError(f"response_format failed to compile: {_clean_error(e)}") from None

    def _future(self, response_format: dict) -> concurrent.futures.Future:
        key = canonical_key(response_format)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not _failed(fut):
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile_now, response_format)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

        def evict_on_error(f: concurrent.futures.Future) -> None:
            if _failed(f):
                with self._lock:
                    if self._cache.get(key) is f:
                        del self._cache[key]

        fut.add_done_callback(evict_on_error)
        return fut

    def compile(self, response_format: dict, timeout_s: float | None = None):
        """Compile (or fetch from the cache), blocking. Returns a CompiledGrammar, or None for text.

        Raises:
            GrammarError: for a bad spec, a failed compilation or a timeout.
        """
        fut = self._future(response_format)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"response_format took longer than {timeout:g} s to compile") from None

    async def compile_async(self, response_format: dict, timeout_s: float | None = None):
        """Like :meth:`compile`, awaiting on the caller's event loop instead of blocking it."""
        fut = asyncio.wrap_future(self._future(response_format))
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise GrammarError(f"response_format took longer than {timeout:g} s to compile") from None

    async def matcher(self, response_format: dict | None, timeout_s: float | None = None):
        """A fresh ``xgrammar.GrammarMatcher`` for one request, or None when nothing is constrained.

        Raises:
            GrammarError: for a bad spec, a failed compilation or a timeout.
        """
        import xgrammar as xgr

        if not is_constrained(response_format):
            return None
        compiled = await self.compile_async(response_format, timeout_s)
        return None if compiled is None else xgr.GrammarMatcher(compiled)

    def cache_info(self) -> dict:
        """Entries held and the keys' count of finished compilations (for tests and stats)."""
        with self._lock:
            return {"size": len(self._cache), "done": sum(f.done() for f in self._cache.values())}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
