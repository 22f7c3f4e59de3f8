"""What chat and text completions share: sampling params from a request, the fan-out of ``n`` engine
requests into one stream, logprob formatting, usage, and SSE framing."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Callable, TypeVar

from rayinfer.engine.errors import EngineInternalError
from rayinfer.engine.structured_output import GrammarError, check_response_format
from rayinfer.engine.types import MultiModalInput, RequestOutput, SampledToken, SamplingParams
from rayinfer.serve.logprobs import TextOffsets, TokenBytes
from rayinfer.serve.protocol import APIError, from_error, from_value_error, num_text_chars

logger = logging.getLogger(__name__)
_DONE = object()
_T = TypeVar("_T")


def sse(obj: Any) -> str:
    """One server-sent event carrying a JSON object (or the literal ``[DONE]``)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class RequestRecord:
    """What the ingress learns of one HTTP request as it is answered (for its metrics).

    Attributes:
        finish_reasons: OpenAI finish reason per choice index, filled in as choices finish.
        error_status: the HTTP status of an error that ended a stream after its 200, or None.
    """

    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    error_status: int | None = None

    @property
    def finish_reason(self) -> str | None:
        """The finish reason of the first choice (None before it finished)."""
        return self.finish_reasons.get(0)


@dataclass
class ChoiceState:
    """One choice's accumulated output (one engine request)."""

    index: int
    num_prompt_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs or [])
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.num_cached_tokens = out.num_cached_tokens


@dataclass
class PreparedRequest:
    """A chat or text completion request parsed, rendered and tokenized, not yet run: how the batch job
    answers an OpenAI body without HTTP, on the service's own path (``ChatServing.prepare``,
    ``CompletionServing.prepare``).

    Attributes:
        request_id: the response's id (``chatcmpl-...`` / ``cmpl-...``).
        jobs: one ``(prompt token ids, SamplingParams)`` per engine request, in choice order (``n`` per
            prompt; a completion with several prompts has ``n`` per prompt, prompt-major).
        respond: builds the non-streaming response body (a ``chat.completion`` or ``text_completion``
            dict) from one finished :class:`ChoiceState` per job, in the order of ``jobs``.
        mm_inputs: the images of a chat prompt (vision-language models), the same for every job.
    """

    request_id: str
    jobs: list[tuple[list[int], SamplingParams]]
    respond: Callable[[list["ChoiceState"]], dict]
    mm_inputs: list[MultiModalInput] = field(default_factory=list)  # the prompt's images, every job's


def refused(e: Exception, param: str | None = None) -> APIError:
    """What a request gets when parsing, rendering or tokenizing it raised ``e``: ``e`` itself when it is
    an APIError, else a 400 naming ``param`` and the exception (whatever a tokenizer, a chat template or
    a JSON decoder throws at some input is that input's fault, never the server's)."""
    if isinstance(e, APIError):
        return e
    logger.info("request refused while preparing it", exc_info=e)
    where = f"'{param}' " if param else "the request "
    return APIError(f"{where}could not be turned into tokens: {type(e).__name__}: {e}", param=param,
                    code="invalid_text")


class OpenAIServing:
    """Shared request handling of the OpenAI endpoints (no HTTP inside; the app maps APIError to JSON).

    Args:
        client: an EngineClient (``generate(prompt_ids, params, request_id)``).
        tokenizer: the model's HF tokenizer.
        model_name: the served model name (requests naming another model get a 404).
        max_model_len: the context limit in tokens.
        metrics: a ServeMetrics, or None.
        executor: where :meth:`prepare` runs parsing, chat templates and tokenization, off the event loop
            that streams every other request; it must have one thread (a HF fast tokenizer flips shared
            state per ``encode`` call, ``split_special_tokens``, so two encodes must never overlap).
            None runs them inline (tests).
        max_prompt_chars: the most characters of prompt text a request may carry (checked before any
            tokenization).
        images: turns chat image parts into image inputs (a vision-language model's
            :class:`~rayinfer.serve.images.ImageLoader`); None refuses image parts.
    """

    def __init__(self, client, tokenizer, model_name: str, max_model_len: int, metrics=None,
                 executor: Executor | None = None, max_prompt_chars: int = 2**20, images=None):
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.executor = executor
        self.max_prompt_chars = max_prompt_chars
        self.images = images
        self.token_bytes = TokenBytes(tokenizer)

    async def prepare(self, fn: Callable[..., _T], *args: Any, param: str | None = None) -> _T:
        """Run ``fn(*args)`` (parsing, rendering, tokenizing one request) on the executor.

        Every exception ``fn`` raises is this request's fault, never the server's: whatever a tokenizer,
        a chat template or a JSON decoder throws at some input becomes a 400.

        Raises:
            APIError: ``fn``'s own, or a 400 naming ``param`` and the exception for any other.
        """
        try:
            if self.executor is None:
                return fn(*args)
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - see the docstring
            raise refused(e, param) from None

    def check_prompt_chars(self, value: Any, param: str) -> None:
        """Raises APIError 400 when ``value`` (decoded JSON) holds more than ``max_prompt_chars``
        characters of text (called before tokenizing)."""
        num_chars = num_text_chars(value)
        if num_chars > self.max_prompt_chars:
            raise APIError(f"'{param}' holds {num_chars} characters of text; this server takes at most "
                           f"{self.max_prompt_chars} per request", param=param, code="prompt_too_long")

    # -- validation ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """Raises APIError 404 for a model this app does not serve (None means the served one)."""
        if model is not None and model != self.model_name:
            raise APIError(f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                           status=404, param="model", code="model_not_found")

    def check_response_format(self, response_format: dict | None, param: str = "response_format") -> None:
        """Raises APIError 400 for a malformed or invalid schema / regex / grammar (no engine work)."""
        try:
            check_response_format(response_format)
        except GrammarError as e:
            raise APIError(str(e), param=param, code="invalid_response_format") from None

    def sampling_params(self, req, *, max_tokens: int | None, max_tokens_param: str, logprobs: int | None,
                        num_prompt_tokens: int, prompt_param: str, response_format: dict | None,
                        n: int) -> list[SamplingParams]:
        """One engine SamplingParams per choice (``n = 1`` each; with a seed, choice i gets seed + i).

        Raises:
            APIError: 400 for a prompt or max_tokens beyond the context, or a bad sampling field.
        """
        if num_prompt_tokens >= self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens, but the "
                           f"prompt has {num_prompt_tokens} tokens", param=prompt_param,
                           code="context_length_exceeded")
        if max_tokens is not None and max_tokens > 0 and num_prompt_tokens + max_tokens > self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens; you asked "
                           f"for {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, "
                           f"{max_tokens} for the completion)", param=max_tokens_param,
                           code="context_length_exceeded")
        if req.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")
        if not isinstance(n, int) or not 1 <= n <= 128:
            raise APIError(f"n must be between 1 and 128, got {n}", param="n")
        base: dict[str, Any] = dict(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            max_tokens=max_tokens if max_tokens is not None else self.max_model_len - num_prompt_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop or [],
            stop_token_ids=req.stop_token_ids or [],
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            response_format=response_format,
            skip_special_tokens=req.skip_special_tokens,
        )
        out = []
        try:
            for i in range(n):
                out.append(SamplingParams(**base, seed=None if req.seed is None else req.seed + i))
        except ValueError as e:
            err = from_value_error(e)
            if err.param == "max_tokens":
                err.param = max_tokens_param
                err.message = err.message.replace("max_tokens", max_tokens_param, 1)
            raise err from None
        return out

    # -- the fan-out ---------------------------------------------------------------------------
    async def run(self, request_id: str, jobs: list[tuple[list[int], SamplingParams]],
                  arrival: float, mm_inputs: list[MultiModalInput] | None = None
                  ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Run one engine request per job concurrently and yield ``(job index, delta)`` as they come.
        ``mm_inputs``: the prompt's images, sent with every job.

        If the consumer stops early or is cancelled (client disconnect), every engine request still
        running is aborted (EngineClient.generate frees its KV blocks on the replica).

        Raises:
            ValueError: when the engine rejects a request (bad prompt ids, grammar failure, ...).
            EngineInternalError: when a request ends with finish_reason "error" (a PD request out of
                retries, a fault inside an engine step); the detail is logged.
        """
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, prompt_ids: list[int], params: SamplingParams) -> None:
            extra = {"mm_inputs": mm_inputs} if mm_inputs else {}
            gen = None
            first = last = queue_time = reason = None
            num_out, itl = 0, []
            try:
                # called inside the try: a client that raises at the call (not in the stream) still
                # answers the consumer, which would otherwise wait on the queue forever
                gen = self.client.generate(prompt_ids, params, request_id=f"{request_id}-{i}", **extra)
                async for out in gen:
                    if out.finish_reason == "error":  # failed (a PD request out of retries, a step fault):
                        # an error event or a 5xx, never an answer that looks complete
                        logger.error("request %s-%d failed: %s", request_id, i, out.error)
                        if self.metrics is not None:
                            self.metrics.count_finished("error")
                        raise EngineInternalError(f"request {request_id}-{i} failed: {out.error}")
                    if out.new_token_ids:
                        now = time.perf_counter()
                        if last is not None:  # k tokens in one delta: k gaps of (time since the last) / k
                            itl.extend([(now - last) / len(out.new_token_ids)] * len(out.new_token_ids))
                        first, last = first or now, now
                    queue_time = out.queue_time_s if out.queue_time_s is not None else queue_time
                    reason = out.finish_reason or reason
                    num_out = out.num_output_tokens or num_out
                    queue.put_nowait((i, out))
                queue.put_nowait((i, _DONE))
                if self.metrics is not None:
                    self.metrics.observe_sequence(None if first is None else first - arrival,
                                                  time.perf_counter() - arrival, len(prompt_ids), num_out,
                                                  finish_reason=reason, queue_time_s=queue_time, itl_s=itl)
            except asyncio.CancelledError:
                if self.metrics is not None:  # the client left (or a sibling choice failed): vLLM's "abort"
                    self.metrics.count_finished("abort")
                raise
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
                queue.put_nowait((i, e))
            finally:
                if gen is not None:
                    await gen.aclose()

        tasks = [asyncio.create_task(pump(i, ids, p)) for i, (ids, p) in enumerate(jobs)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def start(self, request_id: str, jobs, arrival: float, mm_inputs: list[MultiModalInput] | None = None):
        """Start :meth:`run` and wait for its first delta, so a rejected request is still a plain 400.

        Returns:
            (the run's iterator, its first item or None).
        Raises:
            APIError: 400 when the engine rejects the request.
        """
        stream = self.run(request_id, jobs, arrival, mm_inputs)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return stream, None
        except ValueError as e:
            await stream.aclose()
            raise _engine_error(e, request_id) from None
        except BaseException:
            await stream.aclose()
            raise
        return stream, first

    async def collect(self, request_id: str, jobs, arrival: float,
                      mm_inputs: list[MultiModalInput] | None = None) -> list[ChoiceState]:
        """Run to the end; one ChoiceState per job. Raises APIError 400 when the engine rejects it."""
        states = [ChoiceState(i, len(ids)) for i, (ids, _) in enumerate(jobs)]
        try:
            async for i, out in self.run(request_id, jobs, arrival, mm_inputs):
                states[i].add(out)
        except ValueError as e:
            raise _engine_error(e, request_id) from None
        return states

    # -- formatting ----------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """A token's string in logprobs (its own bytes as text, ``"bytes:\\xf0\\x9f"`` for part of a
        character; see :mod:`rayinfer.serve.logprobs`)."""
        return self.token_bytes.text_of(token_id)

    def chat_logprobs(self, tokens: list[SampledToken], top_n: int) -> list[dict]:
        """OpenAI chat ``logprobs.content`` entries for sampled tokens.

        Returns:
            ``[{"token": str, "logprob": float, "bytes": [int], "top_logprobs": [{token, logprob, bytes}]}]``;
            ``bytes`` are the token's own bytes, so those of a response's tokens concatenate to the
            UTF-8 of its text.
        """
        tb = self.token_bytes
        out = []
        for s in tokens:
            top = sorted((s.top_logprobs or {}).items(), key=lambda kv: -kv[1])[:top_n]
            out.append({"token": tb.text_of(s.token_id), "logprob": _finite(s.logprob),
                        "bytes": list(tb.bytes_of(s.token_id)),
                        "top_logprobs": [{"token": tb.text_of(t), "logprob": _finite(lp),
                                          "bytes": list(tb.bytes_of(t))} for t, lp in top]})
        return out

    def completion_logprobs(self, tokens: list[SampledToken], offsets: TextOffsets, top_n: int,
                            prompt_ids: list[int] | None = None) -> dict:
        """OpenAI legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset).

        Args:
            tokens: sampled tokens with logprobs.
            offsets: the choice's text offsets so far (advanced past these tokens).
            top_n: alternatives per token.
            prompt_ids: echoed prompt tokens to put first (their logprobs are null: not computed).
        Returns:
            ``{"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}], "text_offset":
            [int]}``; a token string is unique per token id, so ``top_logprobs`` keeps ``top_n`` entries.
        """
        tb = self.token_bytes
        result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in prompt_ids or []:
            result["tokens"].append(tb.text_of(t))
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            result["text_offset"].append(offsets.add(tb.bytes_of(t)))
        for s in tokens:
            top = sorted((s.top_logprobs or {}).items(), key=lambda kv: -kv[1])[:top_n]
            result["tokens"].append(tb.text_of(s.token_id))
            result["token_logprobs"].append(_finite(s.logprob))
            result["top_logprobs"].append({tb.text_of(t): _finite(lp) for t, lp in top} if top_n else None)
            result["text_offset"].append(offsets.add(tb.bytes_of(s.token_id)))
        return result


async def with_first(first, stream):
    """Yield ``first`` (the item :meth:`OpenAIServing.start` already took off ``stream``, or None) and
    then the rest of ``stream``."""
    if first is not None:
        yield first
    async for item in stream:
        yield item


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def finish_reason(reason: str | None) -> str | None:
    """Engine finish reasons in OpenAI's words ("abort" and "error" end the stream as "stop")."""
    return None if reason is None else {"abort": "stop", "error": "stop"}.get(reason, reason)


def _engine_error(e: Exception, request_id: str | None = None) -> APIError:
    """An engine-side error as an OpenAI error, by its type (``serve.protocol.from_error``); a 5xx is
    logged here with its detail, under ``request_id``, which its body names."""
    err = from_error(e, request_id=request_id)
    if isinstance(e, GrammarError):
        err.code = "invalid_response_format"
    if err.status >= 500:
        logger.error("request %s failed", request_id, exc_info=e)
    return err


def _finite(x: float | None) -> float | None:
    if x is None:
        return None
    return max(float(x), -9999.0)  # -inf is not valid JSON; OpenAI reports -9999.0 for such tokens


def error_event(err: Exception, request_id: str, record: RequestRecord | None = None) -> str:
    """An SSE event carrying an OpenAI error object (an error after the stream started; a 5xx says
    "internal error" and the request id, and its detail goes to the log); its status goes to ``record``."""
    api_error = _engine_error(err, request_id)
    if record is not None:
        record.error_status = api_error.status
    return sse(api_error.body())
