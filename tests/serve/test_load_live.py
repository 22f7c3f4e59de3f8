"""Concurrency, cancellation, metrics and the load client against the live app."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai


def test_200_concurrent_streams_complete_and_free_all_blocks(live_server, model):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count to {i % 7 + 2}."}], max_tokens=4 + i % 5,
            temperature=0.8, seed=i, stream=True)
        text, reason = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=live_server.v1, api_key=live_server.api_key, max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*[one(client, i) for i in range(200)], return_exceptions=True)

    start = time.perf_counter()
    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(reason in ("stop", "length") for _, reason in results)
    stats = live_server.wait_all_blocks_free()
    assert all(s["num_free_blocks"] == s["num_blocks"] for s in stats), stats
    print(f"200 streams in {time.perf_counter() - start:.1f} s")


def test_client_disconnect_aborts_and_frees_blocks(live_server, model):
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {live_server.api_key}"}
    before = live_server.wait_all_blocks_free()[0]["num_generation_tokens"]
    with httpx.Client(base_url=live_server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    seen += 1
                if seen >= 4:
                    break
        # the stream is closed mid-generation here
        mid = live_server.engine_stats()
    stats = live_server.wait_all_blocks_free(timeout_s=20)
    # on a failure, say whether the abort was lost (the request ran on towards its 400 tokens) or late
    assert all(s["num_free_blocks"] == s["num_blocks"] and s["num_running"] == 0 for s in stats), (
        f"20 s after the disconnect: running {[s['num_running'] for s in stats]}, tokens generated since the "
        f"request started {stats[0]['num_generation_tokens'] - before} (at the disconnect "
        f"{mid[0]['num_generation_tokens'] - before}) of its 400")
    gen_tokens = stats[0]["num_generation_tokens"]
    assert gen_tokens - before < 200, "the request ran on after the disconnect"
    time.sleep(1.0)
    assert live_server.engine_stats()[0]["num_generation_tokens"] == gen_tokens  # nothing still decoding


def test_metrics_endpoint_exposes_engine_and_latency_metrics(live_server, client, model):
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    text = httpx.get(live_server.base_url + "/metrics", timeout=30,
                     headers={"Authorization": f"Bearer {live_server.api_key}"}).text
    for name in ("rayinfer_num_requests_running", "rayinfer_num_requests_waiting", "rayinfer_kv_cache_usage_perc",
                 "rayinfer_prefix_cache_hit_rate", "rayinfer_num_preemptions_total", "rayinfer_prompt_tokens_total",
                 "rayinfer_generation_tokens_total", "rayinfer_time_to_first_token_seconds_bucket",
                 "rayinfer_time_per_output_token_seconds_bucket", "rayinfer_e2e_request_latency_seconds_count",
                 "rayinfer_requests_total"):
        assert name in text, name
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    ttft = next(s for s in families["rayinfer_time_to_first_token_seconds"].samples if s.name.endswith("_count"))
    assert ttft.value >= 1
    gen = families["rayinfer_generation_tokens"].samples[0]
    assert gen.value > 0 and gen.labels["model_name"] == model


def test_health(live_server):
    r = httpx.get(live_server.base_url + "/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_bench_serve_reports_percentiles(live_server, tmp_path):
    from rayinfer.jobs import bench_serve

    out = tmp_path / "bench.json"
    code = bench_serve.main(["--base-url", live_server.base_url, "--api-key", live_server.api_key,
                             "--num-prompts", "12", "--request-rate", "20", "--max-concurrency", "8",
                             "--input-len", "8", "--output-len", "4", "--json", str(out)])
    assert code == 0
    summary = json.loads(out.read_text())
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 12 * 4  # ignore_eos: exactly output-len each
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(summary[key]) == {"mean", "median", "p90", "p95", "p99"}
        assert summary[key]["p99"] >= summary[key]["median"] > 0
    assert summary["output_throughput"] > 0


def _requests_total(live_server) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(live_server.base_url + "/metrics", timeout=30,
                     headers={"Authorization": f"Bearer {live_server.api_key}"}).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return {(s.labels["endpoint"], s.labels["outcome"], s.labels["finish_reason"]): s.value
            for s in fams["rayinfer_requests"].samples if s.name == "rayinfer_requests_total"}


def test_a_plain_request_the_client_leaves_counts_as_abort(live_server, model):
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 600,
            "ignore_eos": True}
    key = ("chat", "abort", "abort")
    counts = _requests_total(live_server)
    before = counts.get(key, 0.0)
    errors_before = sum(v for k, v in counts.items() if k[1] == "error_500")  # the server is shared by modules
    with httpx.Client(base_url=live_server.base_url, timeout=2.0) as http:
        try:
            http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {live_server.api_key}"})
            raise AssertionError("600 tokens came back within 2 s")
        except httpx.ReadTimeout:
            pass  # the client hangs up here
    deadline = time.monotonic() + 30
    while _requests_total(live_server).get(key, 0.0) < before + 1:
        assert time.monotonic() < deadline, _requests_total(live_server)
        time.sleep(0.5)
    assert sum(v for k, v in _requests_total(live_server).items() if k[1] == "error_500") == errors_before
    stats = live_server.wait_all_blocks_free(timeout_s=30)
    assert all(s["num_free_blocks"] == s["num_blocks"] and s["num_running"] == 0 for s in stats), stats
