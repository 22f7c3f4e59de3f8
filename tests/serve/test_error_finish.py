"""A request that ends with finish_reason "error" (a PD request out of retries, a fault inside an engine
step) reaches an HTTP client as an error: a 500 without streaming, an error event in a stream; never as a
normal answer ending in "stop"."""

import asyncio
import json

import pytest

from rayinfer.engine.errors import EngineInternalError
from rayinfer.engine.types import RequestOutput
from rayinfer.serve.protocol import from_error
from rayinfer.serve.serving import OpenAIServing
from rayinfer.serve.serving_completion import CompletionServing


class CutShortClient:
    """One token, then the request fails (what PDClient yields when its retries run out)."""

    max_model_len = 512

    async def generate(self, prompt_token_ids, params, request_id: str = "r"):
        yield RequestOutput(request_id, new_token_ids=[42], new_text=" Paris", num_output_tokens=1)
        yield RequestOutput(request_id, finished=True, finish_reason="error", num_output_tokens=1,
                            error="gave up after 9 failed attempts in 120.0 s (pd.retry_deadline_s=120): actor died")


@pytest.fixture
def completions(tokenizer):
    return CompletionServing(OpenAIServing(CutShortClient(), tokenizer, "m", 512))


def test_failed_request_is_a_500_not_an_answer(completions):
    with pytest.raises(EngineInternalError, match="pd.retry_deadline_s") as info:
        asyncio.run(completions.create({"model": "m", "prompt": "The capital of France is", "max_tokens": 8}, 0.0))
    err = from_error(info.value)
    assert err.status == 500 and err.body()["error"]["type"] == "internal_error"


def test_failed_stream_ends_with_an_error_event_and_no_finish(completions):
    async def events():
        stream = await completions.create({"model": "m", "prompt": "The capital of France is", "max_tokens": 8,
                                           "stream": True}, 0.0)
        return [e async for e in stream]

    bodies = [json.loads(e.removeprefix("data: ")) for e in asyncio.run(events()) if e != "data: [DONE]\n\n"]
    assert bodies[0]["choices"][0]["text"] == " Paris"
    assert all(c["finish_reason"] is None for b in bodies if "choices" in b for c in b["choices"])
    assert bodies[-1]["error"]["type"] == "internal_error"
