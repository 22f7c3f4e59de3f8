"""Bad input gets an OpenAI error object with the right status; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=60,
                      headers={"Authorization": f"Bearer {live_server.api_key}"}) as c:
        yield c


def _check_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 2}, "messages"),
    ({"messages": [], "max_tokens": 2}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, None),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_tokens": -3}, "max_tokens"),
    ({**GOOD, "max_tokens": "5"}, "max_tokens"),
    ({**GOOD, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**GOOD, "max_tokens": 10**6}, "max_tokens"),
    ({**GOOD, "temperature": "hot"}, "temperature"),
    ({**GOOD, "temperature": -1}, "temperature"),
    ({**GOOD, "top_p": 1.5}, "top_p"),
    ({**GOOD, "n": 0}, "n"),
    ({**GOOD, "top_logprobs": 3}, "top_logprobs"),
    ({**GOOD, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**GOOD, "stop": 7}, "stop"),
    ({**GOOD, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format"),
    ({**GOOD, "tool_choice": "required"}, "tool_choice"),
])
def test_chat_bad_input_is_400(http, body, param):
    _check_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_invalid_json_body_is_400(http):
    err = _check_error(http.post("/v1/chat/completions", content=b'{"messages": [', headers={
        "Content-Type": "application/json"}), 400)
    assert "JSON" in err["message"]
    _check_error(http.post("/v1/chat/completions", json=[1, 2]), 400)


def test_prompt_longer_than_context_is_400(http, live_server):
    long_text = "hello " * 1500  # > max_model_len tokens
    err = _check_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long_text}]}),
                       400, "messages")
    assert err["code"] == "context_length_exceeded"
    _check_error(http.post("/v1/completions", json={"prompt": long_text, "max_tokens": 2}), 400, "prompt")


@pytest.mark.parametrize("body,param", [
    ({"prompt": "", "max_tokens": 2}, "prompt"),
    ({"prompt": [], "max_tokens": 2}, "prompt"),
    ({"prompt": [10**9], "max_tokens": 2}, None),
    ({"prompt": "x", "logprobs": 9}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": 3.5}, "prompt"),
])
def test_completions_bad_input_is_400(http, body, param):
    _check_error(http.post("/v1/completions", json=body), 400, param)


def test_unknown_model_is_404(http):
    err = _check_error(http.post("/v1/chat/completions", json={**GOOD, "model": "gpt-17"}), 404, "model")
    assert err["code"] == "model_not_found"
    _check_error(http.post("/v1/completions", json={"prompt": "x", "model": "nope"}), 404, "model")


def test_unknown_route_is_openai_shaped_404(http):
    _check_error(http.get("/v1/nothing-here"), 404)


def test_api_key_is_required(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=30) as anon:
        err = _check_error(anon.post("/v1/chat/completions", json=GOOD), 401)
        assert err["type"] == "authentication_error"
        _check_error(anon.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert anon.get("/health").status_code == 200  # health stays open for probes
        for path in ("/metrics", "/docs", "/openapi.json"):  # public_metrics_and_docs is off by default
            _check_error(anon.get(path), 401)
            assert anon.get(path, headers={"Authorization": f"Bearer {live_server.api_key}"}).status_code == 200


def test_server_still_serves_after_errors(http):
    r = http.post("/v1/chat/completions", json=GOOD)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


def test_bad_requests_do_not_disturb_a_concurrent_stream(live_server):
    import asyncio

    headers = {"Authorization": f"Bearer {live_server.api_key}"}

    async def good(client):
        text = ""
        async with client.stream("POST", "/v1/chat/completions", headers=headers, json={
                **GOOD, "max_tokens": 12, "stream": True, "ignore_eos": True}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    assert '"error"' not in line
                    text += line
        return text

    async def bad(client, i):
        body = [{"messages": []}, {**GOOD, "max_tokens": -1}, {**GOOD, "model": "x"},
                {**GOOD, "response_format": {"type": "regex", "regex": "("}}][i % 4]
        return (await client.post("/v1/chat/completions", headers=headers, json=body)).status_code

    async def main():
        async with httpx.AsyncClient(base_url=live_server.base_url, timeout=60) as client:
            return await asyncio.gather(good(client), *[bad(client, i) for i in range(20)])

    text, *codes = asyncio.run(main())
    assert '"finish_reason": "length"' in text
    assert sorted(set(codes)) == [400, 404]


def test_text_no_tokenizer_takes_is_400_through_serve(http):
    raw = b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}'
    err = _check_error(http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}),
                       400, "messages.0.content")
    assert "surrogate" in err["message"]
    _check_error(http.post("/v1/completions", content=b"[" * 50_000 + b"]" * 50_000), 400)
    assert http.post("/v1/chat/completions", json=GOOD).status_code == 200


def test_a_killed_engine_replica_restarts_and_the_stream_in_flight_resumes_there(http, live_server):
    """The replica is killed mid-stream: Ray restarts the actor (ParallelConfig.max_restarts) and the stream
    in flight resumes on it from the tokens it had, so the caller's stream ends normally with every token
    asked for; the service answers again."""
    import json
    import threading
    import time

    import ray
    from ray import serve

    router = serve.get_deployment_handle("EngineFleet", live_server.app_name).router_handle.remote().result()
    replica = ray.get(router.start.remote()).replicas[0]
    lines: list[str] = []

    def stream():
        with http.stream("POST", "/v1/chat/completions", timeout=240,
                         json={**GOOD, "max_tokens": 300, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}}) as r:
            lines.extend(r.iter_lines())

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 60
    while not any('"content"' in ln for ln in lines[1:]) and time.monotonic() < deadline:
        time.sleep(0.1)
    ray.kill(replica, no_restart=False)
    t.join(timeout=240)
    chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    assert chunks and not any("error" in c for c in chunks), lines[-3:]
    assert [ln for ln in lines if ln.startswith("data: ")][-1] == "data: [DONE]"
    finish = [ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
    assert finish == ["length"] and chunks[-1]["usage"]["completion_tokens"] == 300
    deadline = time.monotonic() + 240
    while http.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the replica did not come back"
        time.sleep(1.0)
    r = http.post("/v1/chat/completions", json=GOOD)
    assert r.status_code == 200, r.text
