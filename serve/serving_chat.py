"""``/v1/chat/completions``: chat template, tools, structured output, streaming and plain responses."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from rayinfer.engine.errors import RayInferError
from rayinfer.engine.types import MultiModalInput
from rayinfer.serve.chat import OnImage, render_messages
from rayinfer.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    NamedToolChoice,
    parse_body,
    response_format_of,
)
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
from rayinfer.serve.tools import (
    ToolStreamParser,
    parse_tool_calls,
    tool_call_format,
)


class ChatServing:
    """Handles chat completion requests.

    Args:
        serving: the shared OpenAIServing (engine client, tokenizer, limits, metrics).
    """

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create(self, body: Any, arrival: float, request_id: str | None = None,
                     record: RequestRecord | None = None) -> dict | AsyncIterator[str]:
        """Validate a request and run it.

        Args:
            body: the decoded JSON body (:func:`rayinfer.serve.protocol.parse_json_body`).
            arrival: ``time.perf_counter()`` when the request arrived (for TTFT).
            request_id: the response id (``chatcmpl-...``); a new one when None.
            record: where the finish reasons go (for metrics), or None.
        Returns:
            a ``chat.completion`` dict, or (``stream: true``) an iterator of SSE events.
        Raises:
            APIError: 400 for bad input (the message names the field; whatever the template or the
                tokenizer raises on this input included), 404 for an unknown model.
        """
        s = self.serving
        request_id = request_id or f"chatcmpl-{uuid.uuid4().hex}"
        # the template and the tokenizer run off the event loop: a long prompt stalls no other stream
        ctx, jobs = await s.prepare(self._prepare, body, request_id, record, param="messages")
        num_prompt_tokens = len(jobs[0][0])
        if ctx.req.stream:
            stream, first = await s.start(request_id, jobs, arrival, ctx.mm_inputs)
            return self._stream(ctx, stream, first, num_prompt_tokens, ctx.req.n)
        states = await s.collect(request_id, jobs, arrival, ctx.mm_inputs)
        return self._response(ctx, states, num_prompt_tokens)

    def prepare(self, body: Any, request_id: str | None = None) -> PreparedRequest:
        """Parse, render and tokenize a request in this thread, without running it: the path
        :meth:`create` takes, for callers without HTTP (the batch job).

        Args:
            body: the decoded JSON body of a ``/v1/chat/completions`` request (``stream`` is ignored).
            request_id: the response id; a new ``chatcmpl-...`` when None.
        Returns:
            the request's engine jobs and its response builder.
        Raises:
            APIError: as :meth:`create` would answer it (400 bad input, 404 unknown model).
        """
        request_id = request_id or f"chatcmpl-{uuid.uuid4().hex}"
        try:
            ctx, jobs = self._prepare(body, request_id, None)
        except Exception as e:  # noqa: BLE001 - whatever the template or tokenizer raised: a 400
            raise refused(e, "messages") from None
        num_prompt_tokens = len(jobs[0][0])
        return PreparedRequest(request_id, jobs, lambda states: self._response(ctx, states, num_prompt_tokens),
                               ctx.mm_inputs)

    def _prepare(self, body: Any, request_id: str, record: RequestRecord | None):
        """Parse, render and tokenize (on the serving's executor): ``(context, [(prompt_ids, params)])``."""
        s = self.serving
        req: ChatCompletionRequest = parse_body(ChatCompletionRequest, body, request_id)  # pyright: ignore[reportAssignmentType]
        s.check_model(req.model)
        s.check_prompt_chars([body.get("messages"), body.get("tools")], "messages")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        tc = req.tool_choice
        if tc is not None and tc != "none" and not tools:
            raise APIError("tool_choice needs tools", param="tool_choice")
        tool_choice: str | dict = (tc.model_dump() if isinstance(tc, NamedToolChoice)
                                   else tc if tc is not None else "auto" if tools else "none")
        use_tools = bool(tools) and tool_choice != "none"
        try:
            forced = tool_call_format(tools or [], tool_choice, req.parallel_tool_calls) if use_tools else None
        except ValueError as e:
            raise APIError(str(e), param="tool_choice") from None
        rf = response_format_of(req)
        if forced is not None:
            if rf is not None:
                raise APIError("response_format cannot be combined with tool_choice required or named",
                               param="response_format")
            for t in tools or []:
                s.check_response_format({"type": "json_schema", "json_schema": {
                    "name": t["function"]["name"], "schema": t["function"].get("parameters") or {}}},
                    param="tools")
            rf = forced
        s.check_response_format(rf)

        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        mm_inputs: list[MultiModalInput] = []
        on_image: OnImage | None = None
        if s.images is not None:
            loader = s.images

            def load_image(url: str, offset: int, index: int) -> list[int]:
                mm = loader.load(url, offset, index)  # InvalidRequestError naming the image: a 400
                mm_inputs.append(mm)
                return loader.processor.placeholder_ids(mm.length)

            on_image = load_image
        try:
            prompt_ids = render_messages(s.tokenizer, messages, tools if use_tools else None,
                                         add_generation_prompt=req.add_generation_prompt, on_image=on_image)
        except RayInferError as e:
            raise APIError(e.message, param=e.param or "messages") from None
        except ValueError as e:
            raise APIError(str(e), param="messages") from None

        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, param = req.max_tokens, "max_tokens"
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(f"top_logprobs must be between 0 and 20, got {req.top_logprobs}", param="top_logprobs")
        top_n = req.top_logprobs or 0
        params = s.sampling_params(req, max_tokens=max_tokens, max_tokens_param=param,
                                   logprobs=top_n if req.logprobs else None,
                                   num_prompt_tokens=len(prompt_ids), prompt_param="messages",
                                   response_format=rf, n=req.n)
        tool_names = {t["function"]["name"] for t in tools or []} if use_tools else set()
        ctx = _Context(request_id, int(time.time()), s.model_name, req, top_n, tool_names, record)
        ctx.mm_inputs = mm_inputs
        return ctx, [(prompt_ids, p) for p in params]

    # -- plain response ------------------------------------------------------------------------
    def _response(self, ctx: "_Context", states: list[ChoiceState], num_prompt_tokens: int) -> dict:
        choices = []
        for st in states:
            message = {"role": "assistant", "content": st.text, "refusal": None}
            reason = finish_reason(st.finish_reason)
            if ctx.tool_names:
                content, calls = parse_tool_calls(st.text, ctx.tool_names)
                if calls:
                    message.update(content=content, tool_calls=calls)
                    reason = "tool_calls" if reason == "stop" else reason
            logprobs = ({"content": self.serving.chat_logprobs(st.logprobs, ctx.top_n)}
                        if ctx.req.logprobs else None)
            ctx.record.finish_reasons[st.index] = reason
            choices.append({"index": st.index, "message": message, "logprobs": logprobs, "finish_reason": reason})
        return {
            "id": ctx.request_id, "object": "chat.completion", "created": ctx.created, "model": ctx.model,
            "choices": choices, "system_fingerprint": None,
            "usage": usage(num_prompt_tokens, sum(len(st.token_ids) for st in states),
                           max((st.num_cached_tokens for st in states), default=0)),
        }

    # -- streaming -----------------------------------------------------------------------------
    def _chunk(self, ctx: "_Context", index: int, delta: dict, reason: str | None = None,
               logprobs: list[dict] | None = None) -> str:
        chunk = {"id": ctx.request_id, "object": "chat.completion.chunk", "created": ctx.created,
                 "model": ctx.model, "system_fingerprint": None,
                 "choices": [{"index": index, "delta": delta,
                              "logprobs": {"content": logprobs} if logprobs is not None else None,
                              "finish_reason": reason}]}
        if ctx.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    async def _stream(self, ctx: "_Context", stream, first, num_prompt_tokens: int, n: int) -> AsyncIterator[str]:
        """SSE events: a role delta per choice, content (or tool-call) deltas, a finish chunk per choice,
        a usage chunk with ``stream_options.include_usage``, then ``[DONE]``."""
        parsers = [ToolStreamParser(ctx.tool_names) if ctx.tool_names else None for _ in range(n)]
        num_tokens = [0] * n
        cached = 0
        try:
            for i in range(n):
                yield self._chunk(ctx, i, {"role": "assistant", "content": ""})
            async for i, out in with_first(first, stream):
                num_tokens[i] += len(out.new_token_ids)
                text = parsers[i].feed(out.new_text) if parsers[i] else out.new_text
                logprobs = (self.serving.chat_logprobs(out.new_logprobs or [], ctx.top_n)
                            if ctx.req.logprobs else None)
                if text or logprobs:
                    yield self._chunk(ctx, i, {"content": text}, logprobs=logprobs)
                if out.finished:
                    cached = max(cached, out.num_cached_tokens)
                    reason = finish_reason(out.finish_reason)
                    if parsers[i]:
                        rest, calls = parsers[i].finish()
                        if rest:
                            yield self._chunk(ctx, i, {"content": rest})
                        if calls:
                            reason = "tool_calls" if reason == "stop" else reason
                            deltas = [{"index": k, **call} for k, call in enumerate(calls)]
                            yield self._chunk(ctx, i, {"tool_calls": deltas})
                    ctx.record.finish_reasons[i] = reason
                    yield self._chunk(ctx, i, {}, reason=reason)
            if ctx.include_usage:
                yield sse({"id": ctx.request_id, "object": "chat.completion.chunk", "created": ctx.created,
                           "model": ctx.model, "choices": [],
                           "usage": usage(num_prompt_tokens, sum(num_tokens), cached)})
        except Exception as e:  # after the 200 went out, an error can only travel as an event
            yield error_event(e, ctx.request_id, ctx.record)
        finally:
            await stream.aclose()
        yield sse("[DONE]")


class _Context:
    """Per-request facts the response builders need."""

    def __init__(self, request_id: str, created: int, model: str, req: ChatCompletionRequest, top_n: int,
                 tool_names: set[str], record: RequestRecord | None = None):
        self.request_id, self.created, self.model, self.req = request_id, created, model, req
        self.top_n, self.tool_names = top_n, tool_names
        self.record = record if record is not None else RequestRecord()
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.mm_inputs: list[MultiModalInput] = []  # the prompt's images
