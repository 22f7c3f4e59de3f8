"""The metrics families of issue 22 (queue time, inter-token latency, finished sequences by reason,
prompt / generation length histograms), vLLM's metric names, and /tokenize, /detokenize, /version: in
process with the fake fleet of test_frontend, and one live check that the engine reports queue time."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rayinfer import __version__
from rayinfer.engine.protocol import FleetStats, ReplicaStats
from rayinfer.serve.config import ServeConfig
from tests.serve.test_frontend import AUTH, CHAT, FakeClient, call, make  # the fake fleet (python -m pytest: the root is on sys.path)


class SlowQueuedClient(FakeClient):
    """The fake fleet, with a queue time on every delta and 20 ms between tokens; it answers with more
    tokens than CHAT's max_tokens (3), so a request ends by length."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, tokenizer.encode("Hello there, my good friend", add_special_tokens=False))

    async def generate(self, prompt_token_ids, params, request_id=None):
        async for out in super().generate(prompt_token_ids, params, request_id):
            await asyncio.sleep(0.02)
            yield dataclasses.replace(out, queue_time_s=0.25)

    async def stats(self):
        return FleetStats("colocated", [ReplicaStats(0, num_running=2, num_waiting=1, kv_cache_usage=0.5,
                                                     num_prompt_tokens=7, num_generation_tokens=9),
                                        ReplicaStats(1, num_blocks=8)])


def scrape(fe) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics scrape."""
    text = call(fe, "GET", "/metrics", headers=AUTH).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(samples, name: str, **labels) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, [k for k in samples if k[0] == name])
    return hits[0]


def test_request_metrics_change_after_a_request(tokenizer):
    fe, fake = make(tokenizer, client=SlowQueuedClient(tokenizer))
    before = scrape(fe)
    assert not any(n.startswith("rayinfer_request_success") for n, _ in before)  # no sequence finished yet
    assert value(before, "rayinfer_request_queue_time_seconds_count") == 0
    r = call(fe, "POST", "/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.status_code == 200
    after = scrape(fe)
    num_prompt, num_out = len(fake.prompts[0]), r.json()["usage"]["completion_tokens"]
    assert num_out == 3
    assert value(after, "rayinfer_request_queue_time_seconds_count") == 1
    assert value(after, "rayinfer_request_queue_time_seconds_sum") == pytest.approx(0.25)
    assert value(after, "rayinfer_inter_token_latency_seconds_count") == num_out - 1  # one per token after the first
    assert 0.015 < value(after, "rayinfer_inter_token_latency_seconds_sum") / (num_out - 1) < 1.0
    assert value(after, "rayinfer_request_success_total", finished_reason="length") == 1
    assert value(after, "rayinfer_request_prompt_tokens_sum") == num_prompt
    assert value(after, "rayinfer_request_prompt_tokens_bucket", le="+Inf") == 1
    assert value(after, "rayinfer_request_generation_tokens_sum") == num_out
    assert value(after, "rayinfer_request_generation_tokens_bucket", le="2.0") == 0  # 3 tokens: above 2
    assert value(after, "rayinfer_request_generation_tokens_bucket", le="5.0") == 1
    assert value(after, "rayinfer_time_per_output_token_seconds_count") == 1


def test_an_aborted_sequence_is_counted_by_reason(tokenizer):
    from rayinfer.serve.metrics import ServeMetrics

    m = ServeMetrics("m")
    m.count_finished("abort")
    m.observe_sequence(0.1, 0.5, 4, 2, finish_reason="stop", itl_s=[0.4])
    samples = {(s.name, s.labels.get("finished_reason")): s.value
               for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert samples[("rayinfer_request_success_total", "abort")] == 1
    assert samples[("rayinfer_request_success_total", "stop")] == 1
    assert samples[("rayinfer_request_queue_time_seconds_count", None)] == 0  # unknown queue time: not observed


VLLM_NAMES = {  # sample name -> labels it must carry
    "vllm:num_requests_running": {"model_name", "engine"},
    "vllm:num_requests_waiting": {"model_name", "engine"},
    "vllm:gpu_cache_usage_perc": {"model_name", "engine"},
    "vllm:kv_cache_usage_perc": {"model_name", "engine"},
    "vllm:prompt_tokens_total": {"model_name", "engine"},
    "vllm:generation_tokens_total": {"model_name", "engine"},
    "vllm:num_preemptions_total": {"model_name", "engine"},
    "vllm:time_to_first_token_seconds_bucket": {"model_name", "le"},
    "vllm:time_per_output_token_seconds_bucket": {"model_name", "le"},
    "vllm:inter_token_latency_seconds_bucket": {"model_name", "le"},
    "vllm:request_time_per_output_token_seconds_bucket": {"model_name", "le"},
    "vllm:e2e_request_latency_seconds_bucket": {"model_name", "le"},
    "vllm:request_queue_time_seconds_bucket": {"model_name", "le"},
    "vllm:request_prompt_tokens_bucket": {"model_name", "le"},
    "vllm:request_generation_tokens_bucket": {"model_name", "le"},
    "vllm:request_success_total": {"model_name", "finished_reason"},
}


@pytest.mark.parametrize("names", ["vllm", "both"])
def test_vllm_metric_names(tokenizer, names):
    fe, _ = make(tokenizer, client=SlowQueuedClient(tokenizer), metrics_names=names)
    assert call(fe, "POST", "/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
    samples = scrape(fe)
    for name, labels in VLLM_NAMES.items():
        found = [dict(ls) for n, ls in samples if n == name]
        assert found and all(set(ls) == labels for ls in found), (name, found)
    assert value(samples, "vllm:num_requests_running", engine="0") == 2
    assert value(samples, "vllm:kv_cache_usage_perc", engine="0") == 0.5
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 1
    assert value(samples, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.25)
    has_own = any(n.startswith("rayinfer_num_requests_running") for n, _ in samples)
    assert has_own == (names == "both")
    assert any(n == "rayinfer_requests_total" for n, _ in samples)  # the HTTP counter has no vLLM twin: always there


def test_metrics_names_is_checked():
    with pytest.raises(ValueError, match="metrics_names"):
        ServeConfig(metrics_names="prometheus")


# -- /tokenize, /detokenize, /version --------------------------------------------------------------
def test_tokenize_detokenize_round_trip(tokenizer):
    fe, _ = make(tokenizer)
    text = "The quick brown fox <|im_start|> jumps"
    r = call(fe, "POST", "/tokenize", json={"prompt": text, "return_token_strs": True}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] == 1024
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=True)  # as /v1/completions encodes it
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = call(fe, "POST", "/detokenize", json={"tokens": body["tokens"]}, headers=AUTH)
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_messages_renders_as_the_chat_endpoint(tokenizer):
    fe, fake = make(tokenizer)
    assert call(fe, "POST", "/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
    r = call(fe, "POST", "/tokenize", json={"messages": CHAT["messages"]}, headers=AUTH)
    assert r.status_code == 200 and r.json()["tokens"] == fake.prompts[0] and r.json()["token_strs"] is None
    no_header = call(fe, "POST", "/tokenize", json={"messages": CHAT["messages"], "add_generation_prompt": False},
                     headers=AUTH).json()["tokens"]
    assert len(no_header) < len(fake.prompts[0]) and fake.prompts[0][: len(no_header)] == no_header


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True}, 400,
     "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "a", "chat_template": "x"}, 400, "chat_template"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens.1"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_tokenize_errors_name_the_field(tokenizer, path, body, status, param):
    fe, _ = make(tokenizer)
    r = call(fe, "POST", path, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("method, path", [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version")])
def test_new_routes_need_the_key(tokenizer, method, path):
    fe, _ = make(tokenizer)
    assert call(fe, method, path, json={"prompt": "a", "tokens": [1]}).status_code == 401


def test_version(tokenizer):
    fe, _ = make(tokenizer)
    r = call(fe, "GET", "/version", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"version": __version__}
    assert call(make(tokenizer, public_metrics_and_docs=True)[0], "GET", "/version").status_code == 200


# -- live: the engine measures queue time ----------------------------------------------------------
def test_live_metrics_report_queue_time_and_finish_reasons(live_server, client, model):
    def scrape_live():
        text = httpx.get(live_server.base_url + "/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {live_server.api_key}"}).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    before = scrape_live()
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                   extra_body={"ignore_eos": True})
    after = scrape_live()

    def delta(name, **labels):
        return value(after, name, **labels) - (value(before, name, **labels) if any(
            n == name and all(dict(ls).get(k) == x for k, x in labels.items()) for n, ls in before) else 0)

    assert delta("rayinfer_request_queue_time_seconds_count") == 1  # measured in the engine, carried through Ray
    assert 0 <= delta("rayinfer_request_queue_time_seconds_sum") < 5
    assert delta("rayinfer_inter_token_latency_seconds_count") >= 1  # 4 tokens, some may arrive merged
    assert delta("rayinfer_request_success_total", finished_reason="length") == 1
    assert delta("rayinfer_request_generation_tokens_sum") == 4
