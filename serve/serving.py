"""What chat and text completions share: sampling params from a request, the fan-out of ``n`` engine
requests into one stream, logprob formatting, usage, and SSE framing."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from rayinfer.engine.errors import EngineInternalError
from rayinfer.engine.structured_output import GrammarError, check_response_format
from rayinfer.engine.types import RequestOutput, SampledToken, SamplingParams
from rayinfer.serve.protocol import APIError, from_error, from_value_error

logger = logging.getLogger(__name__)
_DONE = object()


def sse(obj: Any) -> str:
    """One server-sent event carrying a JSON object (or the literal ``[DONE]``)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


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


class OpenAIServing:
    """Shared request handling of the OpenAI endpoints (no HTTP inside; the app maps APIError to JSON).

    Args:
        client: an EngineClient (``generate(prompt_ids, params, request_id)``).
        tokenizer: the model's HF tokenizer.
        model_name: the served model name (requests naming another model get a 404).
        max_model_len: the context limit in tokens.
        metrics: a ServeMetrics, or None.
    """

    def __init__(self, client, tokenizer, model_name: str, max_model_len: int, metrics=None):
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self._token_text: dict[int, str] = {}

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
        base = dict(
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
                  arrival: float) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run one engine request per job concurrently and yield ``(job index, delta)`` as they come.

        If the consumer stops early or is cancelled (client disconnect), every engine request still
        running is aborted (EngineClient.generate frees its KV blocks on the replica).

        Raises:
            ValueError: when the engine rejects a request (bad prompt ids, grammar failure, ...).
            EngineInternalError: when a request ends with finish_reason "error" (a PD request out of
                retries, a fault inside an engine step); the detail is logged.
        """
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, prompt_ids: list[int], params: SamplingParams) -> None:
            gen = self.client.generate(prompt_ids, params, request_id=f"{request_id}-{i}")
            first, num_out = None, 0
            try:
                async for out in gen:
                    if out.finish_reason == "error":  # failed (a PD request out of retries, a step fault):
                        # an error event or a 5xx, never an answer that looks complete
                        logger.error("request %s-%d failed: %s", request_id, i, out.error)
                        raise EngineInternalError(f"request {request_id}-{i} failed: {out.error}")
                    if first is None and out.new_token_ids:
                        first = time.perf_counter()
                    num_out = out.num_output_tokens or num_out
                    queue.put_nowait((i, out))
                queue.put_nowait((i, _DONE))
                if self.metrics is not None:
                    self.metrics.observe_sequence(None if first is None else first - arrival,
                                                  time.perf_counter() - arrival, len(prompt_ids), num_out)
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
                queue.put_nowait((i, e))
            finally:
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

    async def start(self, request_id: str, jobs, arrival: float):
        """Start :meth:`run` and wait for its first delta, so a rejected request is still a plain 400.

        Returns:
            (the run's iterator, its first item or None).
        Raises:
            APIError: 400 when the engine rejects the request.
        """
        stream = self.run(request_id, jobs, arrival)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return stream, None
        except ValueError as e:
            await stream.aclose()
            raise _engine_error(e) from None
        except BaseException:
            await stream.aclose()
            raise
        return stream, first

    async def collect(self, request_id: str, jobs, arrival: float) -> list[ChoiceState]:
        """Run to the end; one ChoiceState per job. Raises APIError 400 when the engine rejects it."""
        states = [ChoiceState(i, len(ids)) for i, (ids, _) in enumerate(jobs)]
        try:
            async for i, out in self.run(request_id, jobs, arrival):
                states[i].add(out)
        except ValueError as e:
            raise _engine_error(e) from None
        return states

    # -- formatting ----------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """A token's text as it appears in output (cached)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def chat_logprobs(self, tokens: list[SampledToken], top_n: int) -> list[dict]:
        """OpenAI chat ``logprobs.content`` entries for sampled tokens."""
        out = []
        for s in tokens:
            text = self.token_text(s.token_id)
            top = sorted((s.top_logprobs or {}).items(), key=lambda kv: -kv[1])[:top_n]
            out.append({"token": text, "logprob": _finite(s.logprob), "bytes": list(text.encode()),
                        "top_logprobs": [{"token": self.token_text(t), "logprob": _finite(lp),
                                          "bytes": list(self.token_text(t).encode())} for t, lp in top]})
        return out

    def completion_logprobs(self, tokens: list[SampledToken], offset: int, top_n: int,
                            prompt_ids: list[int] | None = None) -> dict:
        """OpenAI legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset).

        Args:
            tokens: sampled tokens with logprobs.
            offset: text offset of the first token.
            top_n: alternatives per token.
            prompt_ids: echoed prompt tokens to put first (their logprobs are null: not computed).
        """
        result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in prompt_ids or []:
            text = self.token_text(t)
            result["tokens"].append(text)
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            result["text_offset"].append(offset)
            offset += len(text)
        for s in tokens:
            text = self.token_text(s.token_id)
            top = sorted((s.top_logprobs or {}).items(), key=lambda kv: -kv[1])[:top_n]
            result["tokens"].append(text)
            result["token_logprobs"].append(_finite(s.logprob))
            result["top_logprobs"].append({self.token_text(t): _finite(lp) for t, lp in top} if top_n else None)
            result["text_offset"].append(offset)
            offset += len(text)
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
    return {"abort": "stop", "error": "stop"}.get(reason, reason)


def _engine_error(e: Exception) -> APIError:
    """An engine-side error as an OpenAI error, by its type (``serve.protocol.from_error``)."""
    err = from_error(e)
    if isinstance(e, GrammarError):
        err.code = "invalid_response_format"
    return err


def _finite(x: float | None) -> float | None:
    if x is None:
        return None
    return max(float(x), -9999.0)  # -inf is not valid JSON; OpenAI reports -9999.0 for such tokens


def error_event(err: Exception) -> str:
    """An SSE event carrying an OpenAI error object (an error after the stream started)."""
    return sse(_engine_error(err).body())
