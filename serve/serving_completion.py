"""``/v1/completions``: text or token-id prompts (one or many), echo, logprobs, streaming."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from rayinfer.serve.logprobs import TextOffsets
from rayinfer.serve.protocol import APIError, CompletionRequest, parse_body, response_format_of
from rayinfer.serve.serving import (
    ChoiceState,
    OpenAIServing,
    PreparedRequest,
    RequestRecord,
    error_event,
    finish_reason,
    refused,
    sse,
    usage,
    with_first,
)


class CompletionServing:
    """Handles legacy text completion requests.

    Args:
        serving: the shared OpenAIServing (engine client, tokenizer, limits, metrics).
    """

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    def _prompts(self, prompt) -> list[list[int]]:
        """Normalize ``prompt`` (str, [str], [int], [[int]]) into token-id lists.

        Raises:
            APIError: 400 for an empty prompt or token ids out of the vocabulary.
        """
        tok = self.serving.tokenizer
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                # the whole prompt belongs to the caller, so special-token text is parsed (as in vLLM)
                ids = tok.encode(p, add_special_tokens=True) if p else []
            else:
                ids = list(p)
            if not ids:
                raise APIError("prompt must not be empty", param="prompt")
            out.append(ids)
        return out

    async def create(self, body: Any, arrival: float, request_id: str | None = None,
                     record: RequestRecord | None = None) -> dict | AsyncIterator[str]:
        """Validate a request and run it.

        Args:
            body: the decoded JSON body (:func:`rayinfer.serve.protocol.parse_json_body`).
            arrival: ``time.perf_counter()`` when the request arrived (for TTFT).
            request_id: the response id (``cmpl-...``); a new one when None.
            record: where the finish reasons go (for metrics), or None.
        Returns:
            a ``text_completion`` dict, or (``stream: true``) an iterator of SSE events.
        Raises:
            APIError: 400 for bad input (the message names the field; whatever the tokenizer raises on
                this input included), 404 for an unknown model.
        """
        s = self.serving
        request_id = request_id or f"cmpl-{uuid.uuid4().hex}"
        record = record if record is not None else RequestRecord()
        # tokenization runs off the event loop: a long prompt stalls no other stream
        req, jobs, echo_ids, num_prompt_tokens = await s.prepare(self._prepare, body, request_id, param="prompt")
        ctx = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": s.model_name}
        if req.stream:
            stream, first = await s.start(request_id, jobs, arrival)
            return self._stream(ctx, req, stream, first, echo_ids, num_prompt_tokens, record)
        states = await s.collect(request_id, jobs, arrival)
        return self._response(ctx, req, states, echo_ids, num_prompt_tokens, record)

    def prepare(self, body: Any, request_id: str | None = None) -> PreparedRequest:
        """Parse and tokenize a request in this thread, without running it: the path :meth:`create`
        takes, for callers without HTTP (the batch job).

        Args:
            body: the decoded JSON body of a ``/v1/completions`` request (``stream`` is ignored).
            request_id: the response id; a new ``cmpl-...`` when None.
        Returns:
            the request's engine jobs and its response builder.
        Raises:
            APIError: as :meth:`create` would answer it (400 bad input, 404 unknown model).
        """
        request_id = request_id or f"cmpl-{uuid.uuid4().hex}"
        try:
            req, jobs, echo_ids, num_prompt_tokens = self._prepare(body, request_id)
        except Exception as e:  # noqa: BLE001 - whatever the tokenizer raised: a 400
            raise refused(e, "prompt") from None
        ctx = {"id": request_id, "object": "text_completion", "created": int(time.time()),
               "model": self.serving.model_name}
        return PreparedRequest(request_id, jobs, lambda states: self._response(
            ctx, req, states, echo_ids, num_prompt_tokens, RequestRecord()))

    def _prepare(self, body: Any, request_id: str | None = None):
        """Parse and tokenize (on the serving's executor): ``(request, jobs, echo ids, prompt tokens)``."""
        s = self.serving
        req: CompletionRequest = parse_body(CompletionRequest, body, request_id)  # pyright: ignore[reportAssignmentType]
        s.check_model(req.model)
        s.check_prompt_chars(body.get("prompt"), "prompt")
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of other than n is not supported", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise APIError(f"logprobs must be between 0 and 5, got {req.logprobs}", param="logprobs")
        rf = response_format_of(req)
        s.check_response_format(rf)
        prompts = self._prompts(req.prompt)
        jobs, echo_ids = [], []
        for ids in prompts:
            params = s.sampling_params(req, max_tokens=req.max_tokens, max_tokens_param="max_tokens",
                                       logprobs=req.logprobs, num_prompt_tokens=len(ids), prompt_param="prompt",
                                       response_format=rf, n=req.n)
            jobs += [(ids, p) for p in params]
            echo_ids += [ids] * req.n
        return req, jobs, echo_ids, sum(len(ids) for ids in prompts)

    def _echo_text(self, ids: list[int]) -> str:
        return self.serving.tokenizer.decode(ids)

    def _response(self, ctx: dict, req: CompletionRequest, states: list[ChoiceState], echo_ids, num_prompt_tokens,
                  record: RequestRecord):
        choices = []
        for st in states:
            prefix = self._echo_text(echo_ids[st.index]) if req.echo else ""
            logprobs = None
            if req.logprobs is not None:
                logprobs = self.serving.completion_logprobs(st.logprobs, TextOffsets(), req.logprobs,
                                                            echo_ids[st.index] if req.echo else None)
            record.finish_reasons[st.index] = finish_reason(st.finish_reason)
            choices.append({"index": st.index, "text": prefix + st.text, "logprobs": logprobs,
                            "finish_reason": finish_reason(st.finish_reason)})
        return {**ctx, "choices": choices, "system_fingerprint": None,
                "usage": usage(num_prompt_tokens, sum(len(st.token_ids) for st in states),
                               max((st.num_cached_tokens for st in states), default=0))}

    async def _stream(self, ctx: dict, req: CompletionRequest, stream, first, echo_ids,
                      num_prompt_tokens: int, record: RequestRecord) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        num_choices = len(echo_ids)
        offsets = [TextOffsets() for _ in range(num_choices)]
        started = [False] * num_choices
        num_tokens, cached = 0, 0

        def chunk(i: int, text: str, logprobs, reason) -> str:
            body = {**ctx, "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}]}
            if include_usage:
                body["usage"] = None
            return sse(body)

        try:
            async for i, out in with_first(first, stream):
                num_tokens += len(out.new_token_ids)
                text, echoed = out.new_text, None
                if req.echo and not started[i]:
                    text = self._echo_text(echo_ids[i]) + text
                    echoed = echo_ids[i]
                started[i] = True
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self.serving.completion_logprobs(out.new_logprobs or [], offsets[i], req.logprobs,
                                                                echoed)
                reason = finish_reason(out.finish_reason) if out.finished else None
                if out.finished:
                    cached = max(cached, out.num_cached_tokens)
                    record.finish_reasons[i] = reason
                if text or logprobs or reason:
                    yield chunk(i, text, logprobs, reason)
            if include_usage:
                yield sse({**ctx, "choices": [], "usage": usage(num_prompt_tokens, num_tokens, cached)})
        except Exception as e:  # after the 200 went out, an error can only travel as an event
            yield error_event(e, ctx["id"], record)
        finally:
            await stream.aclose()
        yield sse("[DONE]")
