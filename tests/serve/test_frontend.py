"""The HTTP front end (serve/frontend.py) in process: a fake fleet client, the real tokenizer, httpx over
ASGI. No Ray, no model."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import pytest
from fastapi.responses import StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from rayinfer.engine.config import ModelConfig
from rayinfer.engine.detokenizer import IncrementalDetokenizer
from rayinfer.engine.protocol import FleetStats, ReplicaStats
from rayinfer.engine.types import RequestOutput, SampledToken
from rayinfer.serve.config import ServeConfig
from rayinfer.serve.frontend import OpenAIFrontend, create_app

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class FakeClient:
    """An EngineClient that answers every request with ``reply`` (token ids), one token per delta.

    ``block_after`` makes generate wait forever after that many tokens (a request in flight); ``fail``
    makes it raise.
    """

    max_model_len = 1024

    def __init__(self, tokenizer, reply: list[int] | None = None):
        self.tokenizer = tokenizer
        self.reply = reply if reply is not None else tokenizer.encode("Hello there", add_special_tokens=False)
        self.block_after: int | None = None
        self.fail: Exception | None = None
        self.prompts: list[list[int]] = []
        self.top_logprobs: dict[int, float] | None = None

    async def generate(self, prompt_token_ids, params, request_id=None):
        self.prompts.append(list(prompt_token_ids))
        if self.fail is not None:
            raise self.fail
        reply = self.reply[: params.max_tokens]
        detok = IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids), params)  # the engine's own
        for k, t in enumerate(reply):
            if k == self.block_after:
                await asyncio.Event().wait()
            last = k == len(reply) - 1
            detok.add_tokens([t])
            lp = SampledToken(t, -0.5, self.top_logprobs or {t: -0.5}) if params.logprobs is not None else None
            yield RequestOutput("r", [t], detok.take_delta(last), [lp] if lp else None, finished=last,
                                finish_reason="length" if last else None,
                                num_prompt_tokens=len(prompt_token_ids), num_output_tokens=k + 1)

    async def stats(self):
        return FleetStats("colocated", [ReplicaStats(0, num_blocks=8, num_free_blocks=8)])


def make(tokenizer, client=None, **cfg):
    fake = client or FakeClient(tokenizer)

    async def connect():
        return fake

    cfg.setdefault("api_key", KEY)
    fe = OpenAIFrontend(ServeConfig(model=ModelConfig(), **cfg), tokenizer, connect)
    return fe, fake


async def _call(fe, method: str, path: str, **kw) -> httpx.Response:
    transport = httpx.ASGITransport(app=create_app(fe))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await c.request(method, path, **kw)


def call(fe, method: str, path: str, **kw) -> httpx.Response:
    return asyncio.run(_call(fe, method, path, **kw))


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def requests_total(fe) -> dict[tuple, float]:
    fams = {f.name: f for f in text_string_to_metric_families(fe.metrics.render().decode())}
    return {(s.labels["endpoint"], s.labels["outcome"], s.labels["finish_reason"]): s.value
            for s in fams["rayinfer_requests"].samples if s.name == "rayinfer_requests_total"}


# -- 1. text the tokenizer cannot take is a 400, never a 500 ----------------------------------------
LONE = '{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}'


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/chat/completions", LONE, "messages.0.content"),
    ("/v1/completions", '{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "x\\udfff"], "max_tokens": 2}', "prompt.1"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud83d"]}', "stop.0"),
    ("/v1/chat/completions", '{"model": "\\udc00", "messages": [{"role": "user", "content": "hi"}]}', "model"),
])
def test_lone_surrogates_are_400_naming_the_field(tokenizer, path, raw, param):
    fe, fake = make(tokenizer)
    err = _error(call(fe, "POST", path, content=raw.encode(), headers=AUTH), 400)
    assert err["param"] == param and err["code"] == "invalid_text" and "surrogate" in err["message"]
    assert fake.prompts == []  # nothing reached the engine


def test_surrogate_pairs_are_text(tokenizer):
    fe, fake = make(tokenizer)
    raw = '{"messages": [{"role": "user", "content": "pizza \\ud83c\\udf55"}], "max_tokens": 2}'
    r = call(fe, "POST", "/v1/chat/completions", content=raw.encode(), headers=AUTH)
    assert r.status_code == 200, r.text
    # the pair decoded to U+1F355, whose UTF-8 went through the template and the tokenizer
    assert "pizza 🍕" in tokenizer.decode(fake.prompts[0])


@pytest.mark.parametrize("depth", [150, 5000, 100_000])
def test_deeply_nested_bodies_are_400(tokenizer, depth):
    fe, _ = make(tokenizer)
    raw = '{"messages": [{"role": "user", "content": "hi"}], "x": ' + "[" * depth + "]" * depth + "}"
    err = _error(call(fe, "POST", "/v1/chat/completions", content=raw.encode(), headers=AUTH), 400)
    assert "deeper than 100 levels" in err["message"] and err["code"] == "invalid_json"
    bare = "[" * depth + "]" * depth
    err = _error(call(fe, "POST", "/v1/completions", content=bare.encode(), headers=AUTH), 400)
    assert "deeper than" in err["message"]


class _BrokenTokenizer:
    """The real tokenizer, except that ``encode`` raises what a tokenizer might raise on odd input."""

    def __init__(self, tok, exc):
        self._tok, self._exc = tok, exc

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, *a, **kw):
        raise self._exc


@pytest.mark.parametrize("exc", [TypeError("TextEncodeInput must be Union[...]"), RuntimeError("Already borrowed"),
                                 OverflowError("int too big"), RecursionError("maximum recursion depth")])
@pytest.mark.parametrize("path,body,param", [("/v1/chat/completions", CHAT, "messages"),
                                             ("/v1/completions", {"prompt": "hi"}, "prompt")])
def test_any_exception_while_tokenizing_is_that_requests_400(tokenizer, exc, path, body, param):
    fe, fake = make(tokenizer)
    fe.tokenizer = _BrokenTokenizer(tokenizer, exc)
    err = _error(call(fe, "POST", path, json=body, headers=AUTH), 400)
    assert err["param"] == param and type(exc).__name__ in err["message"]
    assert fake.prompts == []
    fe.tokenizer = tokenizer  # the next request is served (a new frontend: serving holds the tokenizer)
    fe2, _ = make(tokenizer)
    assert call(fe2, "POST", path, json=body, headers=AUTH).status_code == 200


def test_a_template_error_is_400(tokenizer):
    fe, _ = make(tokenizer)
    asyncio.run(fe.connect())
    assert fe.serving is not None

    class Tok(_BrokenTokenizer):
        def apply_chat_template(self, *a, **kw):
            import jinja2

            raise jinja2.TemplateError("Conversation roles must alternate user/assistant")

    fe.serving.tokenizer = Tok(tokenizer, None)
    err = _error(call(fe, "POST", "/v1/chat/completions", json=CHAT, headers=AUTH), 400)
    assert err["param"] == "messages" and "roles must alternate" in err["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
])
def test_the_ignored_fields_warning_names_the_request_id(tokenizer, caplog, path, body):
    fe, _ = make(tokenizer)
    with caplog.at_level("WARNING", logger="rayinfer.serve.protocol"):
        r = call(fe, "POST", path, json={**body, "temprature": 0.5}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert caplog.text.strip().endswith(f"request {r.json()['id']}: the following fields were present in the "
                                        "request but ignored: temprature")


# -- 2. size limits, and tokenization off the event loop ------------------------------------------
def test_body_over_the_limit_is_413_before_parsing(tokenizer):
    fe, fake = make(tokenizer, max_request_bytes=1000)
    body = {"messages": [{"role": "user", "content": "x" * 2000}]}
    err = _error(call(fe, "POST", "/v1/chat/completions", json=body, headers=AUTH), 413)
    assert "1000 bytes" in err["message"] and err["code"] == "request_too_large"
    # no Content-Length (chunked): the limit holds as the body is read
    async def chunks():
        for _ in range(4):
            yield b" " * 400

    err = _error(call(fe, "POST", "/v1/chat/completions", content=chunks(), headers=AUTH), 413)
    assert fake.prompts == []
    assert call(fe, "POST", "/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 60}, {"role": "user", "content": "y" * 41}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "description": "d" * 100}}]}, "messages"),
    ("/v1/completions", {"prompt": ["x" * 50, "y" * 51]}, "prompt"),
])
def test_text_over_the_limit_is_400_before_tokenizing(tokenizer, path, body, param):
    fe, fake = make(tokenizer, max_prompt_chars=100)
    fe.tokenizer = _BrokenTokenizer(tokenizer, AssertionError("tokenized a text over the limit"))
    err = _error(call(fe, "POST", path, json=body, headers=AUTH), 400)
    assert err["param"] == param and err["code"] == "prompt_too_long" and "at most 100" in err["message"]
    assert fake.prompts == []


def test_tokenizing_a_long_prompt_does_not_stall_the_event_loop(tokenizer):
    """Each encode blocks until a coroutine on the event loop lets it go: if an encode ran on the loop's
    thread, that coroutine could not run and the encode would give up (a stalled loop). A handshake, not a
    timing, so a busy machine cannot fail it."""
    fe, _ = make(tokenizer)
    started, release = threading.Event(), threading.Event()
    encode_threads: list[int] = []
    stalled: list[bool] = []

    class SlowTokenizer(_BrokenTokenizer):
        def encode(self, *a, **kw):  # a long prompt: holds its thread until the loop answers
            encode_threads.append(threading.get_ident())
            started.set()
            stalled.append(not release.wait(timeout=10.0))
            return self._tok.encode(*a, **kw)

    fe.tokenizer = SlowTokenizer(tokenizer, None)

    async def main():
        async def let_go_once_started():
            while not started.is_set():
                await asyncio.sleep(0.001)
            release.set()

        helper = asyncio.create_task(let_go_once_started())
        r = await _call(fe, "POST", "/v1/chat/completions", json=CHAT, headers=AUTH)
        await helper
        return r, threading.get_ident()

    r, loop_thread = asyncio.run(main())
    assert r.status_code == 200, r.text
    assert encode_threads and loop_thread not in encode_threads  # every encode ran off the loop's thread...
    assert stalled and not any(stalled)  # ...and the loop ran while the first one was in progress


# -- 6. 5xx bodies carry no detail -----------------------------------------------------------------
MEMORY_REPORT = ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.\n"
                 "Memory on the node (IP: 10.0.0.7) was 61.2GB / 64GB; top 10 memory users: PID 1234 ...")


@pytest.mark.parametrize("stream", [False, True])
def test_a_dead_engine_is_an_internal_error_with_a_request_id_only(tokenizer, caplog, stream):
    fe, fake = make(tokenizer)
    fake.fail = RuntimeError(MEMORY_REPORT)
    with caplog.at_level("ERROR"):
        r = call(fe, "POST", "/v1/chat/completions", json={**CHAT, "stream": stream}, headers=AUTH)
    err = _error(r, 500)
    assert err["type"] == "internal_error"
    assert err["message"].startswith("internal error (request id chatcmpl-")
    assert "memory" not in r.text.lower() and "10.0.0.7" not in r.text
    request_id = err["message"].split("request id ")[1].rstrip(")")
    logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert logged and "10.0.0.7" in str(logged[0].exc_info[1])


def test_an_engine_failure_mid_stream_is_an_error_event_without_detail(tokenizer, caplog):
    fe, fake = make(tokenizer)
    real = fake.generate

    async def fails_after_one(prompt_ids, params, request_id=None):
        async for out in real(prompt_ids, params, request_id):
            yield out
            raise RuntimeError(MEMORY_REPORT)

    fake.generate = fails_after_one  # type: ignore[method-assign]  # pyright: ignore[reportAttributeAccessIssue]
    with caplog.at_level("ERROR"):
        r = call(fe, "POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    err = events[-1]["error"]
    assert err["message"].startswith("internal error (request id chatcmpl-") and "memory" not in r.text.lower()
    assert any("10.0.0.7" in str(rec.exc_info[1]) for rec in caplog.records if rec.exc_info)
    assert requests_total(fe) == {("chat", "error_500", "error"): 1.0}


# -- 7. /metrics and the docs behind the key -------------------------------------------------------
@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json", "/redoc", "/v1/models"])
def test_every_route_but_health_needs_the_key(tokenizer, path):
    fe, _ = make(tokenizer)
    assert _error(call(fe, "GET", path), 401)["code"] == "invalid_api_key"
    assert call(fe, "GET", path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert call(fe, "GET", path, headers=AUTH).status_code == 200
    assert call(fe, "GET", "/health").status_code == 200


def test_public_metrics_and_docs_opens_those_routes_only(tokenizer):
    fe, _ = make(tokenizer, public_metrics_and_docs=True)
    for path in ("/metrics", "/docs", "/openapi.json"):
        assert call(fe, "GET", path).status_code == 200, path
    assert "/v1/chat/completions" in call(fe, "GET", "/openapi.json").json()["paths"]
    assert call(fe, "GET", "/v1/models").status_code == 401
    assert call(fe, "POST", "/v1/chat/completions", json=CHAT).status_code == 401


def test_without_a_key_everything_is_open(tokenizer):
    fe, _ = make(tokenizer, api_key=None)
    for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
        assert call(fe, "GET", path).status_code == 200, path


# -- 8. disconnects are counted as aborts ----------------------------------------------------------
def _request(body: dict):
    """A starlette Request for POST /v1/chat/completions carrying ``body``."""
    from starlette.requests import Request

    raw = json.dumps(body).encode()
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
             "headers": [(b"authorization", AUTH["Authorization"].encode()), (b"content-length", str(len(raw)).encode())]}
    return Request(scope, receive)


def test_a_client_disconnect_counts_as_abort(tokenizer):
    fe, fake = make(tokenizer)
    fake.block_after = 1

    async def main():
        # plain: Serve cancels the handler when the client hangs up
        task = asyncio.create_task(fe.handle("chat", _request(CHAT)))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # streaming: the server closes the event stream when the client hangs up
        response = await fe.handle("chat", _request({**CHAT, "stream": True}))
        assert isinstance(response, StreamingResponse)
        events: Any = response.body_iterator  # the frontend's async generator of SSE events
        first = await events.__anext__()
        assert '"role": "assistant"' in first
        await events.__anext__()  # the first token
        await events.aclose()

    asyncio.run(main())
    assert requests_total(fe) == {("chat", "abort", "abort"): 2.0}


def test_finished_and_failed_requests_are_counted_once(tokenizer):
    fe, fake = make(tokenizer)
    assert call(fe, "POST", "/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
    assert call(fe, "POST", "/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True},
                headers=AUTH).status_code == 200
    assert call(fe, "POST", "/v1/completions", json={"prompt": ""}, headers=AUTH).status_code == 400
    fake.fail = RuntimeError("boom")
    assert call(fe, "POST", "/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 500
    assert requests_total(fe) == {("chat", "ok", "length"): 1.0, ("completions", "ok", "length"): 1.0,
                                  ("completions", "error_400", "error"): 1.0, ("chat", "error_500", "error"): 1.0}


# -- 5. one rendering of chat messages for the service and the batch job ---------------------------
@pytest.mark.parametrize("messages", [
    [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Bonjour"},
     {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, {"role": "user", "content": "more"}],
])
def test_service_and_batch_job_render_the_same_prompt(tokenizer, messages):
    from rayinfer.jobs.batch_io import LineParser

    fe, fake = make(tokenizer)
    r = call(fe, "POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200, r.text
    [job] = LineParser(tokenizer, "m", 8192).parse([(1, json.dumps({"messages": messages, "max_tokens": 2}))])
    assert job.error is None and job.prompt_token_ids == fake.prompts[0]
    # developer is the system role (the OpenAI spec), never a literal "developer" turn
    as_system = [{"role": "system" if m["role"] == "developer" else m["role"],
                  "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
                 for m in messages]
    expected = tokenizer.apply_chat_template(as_system, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(fake.prompts[0]) == expected and "developer" not in expected


# -- 3. logprobs carry each token's own bytes --------------------------------------------------------
EMOJI = "🍕🧀🍅"


def _emoji_fake(tokenizer):
    fe, fake = make(tokenizer)
    fake.reply = tokenizer.encode(EMOJI, add_special_tokens=False)
    # alternatives: three partial-byte tokens, which all decode alone to U+FFFD
    fake.top_logprobs = {231: -0.5, 230: -1.0, 238: -2.0}
    return fe, fake


def test_chat_logprob_bytes_are_the_tokens_own(tokenizer):
    fe, fake = _emoji_fake(tokenizer)
    body = {"messages": [{"role": "user", "content": "Reply with three emojis that describe pizza."}],
            "temperature": 0, "max_tokens": 9, "logprobs": True, "top_logprobs": 3}
    r = call(fe, "POST", "/v1/chat/completions", json=body, headers=AUTH)
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == EMOJI
    content = choice["logprobs"]["content"]
    assert len(content) == len(fake.reply)
    assert bytes(b for e in content for b in e["bytes"]) == EMOJI.encode()
    assert all(e["token"] != "\ufffd" and [239, 191, 189] != e["bytes"] for e in content)
    assert content[0]["token"] == "bytes:\\xf0\\x9f" and content[0]["bytes"] == [0xF0, 0x9F]
    top = content[0]["top_logprobs"]
    assert [(t["token"], t["bytes"]) for t in top] == [("bytes:\\x8d", [0x8D]), ("bytes:\\x8c", [0x8C]),
                                                       ("bytes:\\x94", [0x94])]
    # streamed: the same entries
    r = call(fe, "POST", "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    streamed = [e for ev in events for c in ev["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert streamed == content


@pytest.mark.parametrize("stream", [False, True])
def test_legacy_logprobs_keep_n_distinct_alternatives(tokenizer, stream):
    fe, fake = _emoji_fake(tokenizer)
    body = {"prompt": "Three emojis for pizza:", "max_tokens": 9, "logprobs": 2, "temperature": 0, "stream": stream}
    r = call(fe, "POST", "/v1/completions", json=body, headers=AUTH)
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        parts = [c["logprobs"] for ev in events for c in ev["choices"] if c.get("logprobs")]
        lp = {k: [x for p in parts for x in p[k]] for k in ("tokens", "top_logprobs", "text_offset")}
        text = "".join(c["text"] for ev in events for c in ev["choices"])
    else:
        choice = r.json()["choices"][0]
        lp, text = choice["logprobs"], choice["text"]
    assert text == EMOJI
    assert all(len(alts) == 2 for alts in lp["top_logprobs"])
    assert lp["top_logprobs"][0] == {"bytes:\\x8d": -0.5, "bytes:\\x8c": -1.0}
    assert lp["tokens"][:3] == ["bytes:\\xf0\\x9f", "bytes:\\x8d", "bytes:\\x95"]
    # each emoji is one character: its three tokens start at 0, 0, 0, then 1, 1, 1, ...
    assert lp["text_offset"] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_engine_gauges_vanish_when_the_fleet_cannot_answer(tokenizer):
    fe, fake = make(tokenizer)
    running = lambda: [s.value for f in text_string_to_metric_families(  # noqa: E731
        call(fe, "GET", "/metrics", headers=AUTH).text) if f.name == "rayinfer_num_requests_running" for s in f.samples]

    async def busy():
        return FleetStats("colocated", [ReplicaStats(0, num_running=3)])

    fake.stats = busy
    assert running() == [3.0]

    async def dead():
        raise RuntimeError("the replica died")

    fake.stats = dead
    assert running() == []  # no gauge frozen at its last value
    assert call(fe, "GET", "/health").status_code == 503


def test_health_answers_503_starting_while_the_fleet_connects(tokenizer, monkeypatch):
    """A probe during startup gets 503 "starting" at once instead of waiting for the replicas to load; once
    connected, 200; a failed connection is 503 "unhealthy" and the next probe tries again."""
    from rayinfer.serve import frontend as frontend_module

    monkeypatch.setattr(frontend_module, "HEALTH_WAIT_S", 0.05)
    fake = FakeClient(tokenizer)
    attempts = []

    async def scenario():
        loaded = asyncio.Event()

        async def connect():
            attempts.append(len(attempts))
            if len(attempts) == 1:
                raise RuntimeError("the replica actor died while loading")
            await loaded.wait()
            return fake

        fe = OpenAIFrontend(ServeConfig(model=ModelConfig(), api_key=KEY), tokenizer, connect)
        failed = await _call(fe, "GET", "/health")
        first = await _call(fe, "GET", "/health")  # a new attempt, still loading
        second = await _call(fe, "GET", "/health")  # polls the same attempt
        loaded.set()
        await asyncio.sleep(0)
        ready = await _call(fe, "GET", "/health")
        return failed, first, second, ready

    failed, first, second, ready = asyncio.run(scenario())
    assert failed.status_code == 503 and failed.json() == {"status": "unhealthy", "error": "RuntimeError"}
    assert first.status_code == second.status_code == 503 and first.json() == {"status": "starting"}
    assert ready.status_code == 200 and ready.json() == {"status": "ok"}
    assert len(attempts) == 2
