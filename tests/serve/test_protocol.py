"""Request parsing, error shapes, config and the load client's statistics (no model, no Ray)."""

from __future__ import annotations

import math

import pytest
import yaml

from rayinfer.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
    response_format_of,
)


def test_parse_valid_chat_body_ignores_unknown_fields_and_logs_them(caplog):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache": 1}]}], "max_tokens": 3,
            "temprature": 0.5, "stream_options": {"include_usage": True, "extra": 1}}
    with caplog.at_level("WARNING", logger="rayinfer.serve.protocol"):
        req = parse_body(ChatCompletionRequest, body, "chatcmpl-1")
    assert req.messages[0].content[0].text == "hi" and req.max_tokens == 3 and req.temperature is None
    assert caplog.text.strip().endswith("request chatcmpl-1: the following fields were present in the request but "
                                        "ignored: temprature")  # nested extras may reach the chat template
    caplog.clear()
    with caplog.at_level("WARNING", logger="rayinfer.serve.protocol"):
        parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})
    assert "ignored" not in caplog.text


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 1}]}, "messages.0.content"),
    ({"messages": [{"role": "user"}], "temperature": True}, "temperature"),
    ({"messages": [{"role": "user"}], "stop": 7}, "stop"),
    ({"messages": [{"role": "user"}], "max_tokens": 1.5}, "max_tokens"),
    ({"messages": [{"role": "user"}], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_bodies_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse_body(ChatCompletionRequest, body)
    assert e.value.status == 400 and e.value.param == param
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_non_object_body_is_400():
    with pytest.raises(APIError):
        parse_body(CompletionRequest, [1, 2])


def test_response_format_and_guided_aliases():
    chat = lambda **kw: parse_body(ChatCompletionRequest, {"messages": [{"role": "user"}], **kw})  # noqa: E731
    assert response_format_of(chat()) is None
    assert response_format_of(chat(response_format={"type": "text"})) is None
    assert response_format_of(chat(guided_regex="a+")) == {"type": "regex", "regex": "a+"}
    assert response_format_of(chat(guided_json={"type": "object"}))["json_schema"]["schema"] == {"type": "object"}
    assert response_format_of(chat(guided_choice=["a.b", "c"]))["regex"] == r"(a\.b|c)"
    with pytest.raises(APIError, match="at most one"):
        response_format_of(chat(guided_regex="a", response_format={"type": "json_object"}))


def test_serve_yaml_is_both_a_serve_config_and_a_hydra_config():
    from importlib.resources import files

    from ray.serve.schema import ServeDeploySchema

    from rayinfer.serve.config import compose_config

    raw = yaml.safe_load(files("rayinfer.conf").joinpath("serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw)
    assert schema.applications[0].import_path == "rayinfer.serve.app:build_app"
    cfg = compose_config(["port=9123", "api_key=k", "engine.num_kv_blocks=64"])
    assert (cfg.port, cfg.api_key, cfg.engine.num_kv_blocks) == (9123, "k", 64)
    assert compose_config([]).port == raw["http_options"]["port"]
    with pytest.raises(ValueError):
        compose_config(["num_ingress_replicas=0"])


def test_bench_summary_percentiles():
    from rayinfer.jobs.bench_serve import RequestResult, arrival_delays, summarize

    results = [RequestResult(True, ttft=0.1 * i, latency=1.0 + 0.1 * i, itl=[0.01, 0.02], num_prompt_tokens=5,
                             num_output_tokens=3) for i in range(1, 11)] + [RequestResult(False, error="boom")]
    s = summarize(results, duration=2.0)
    assert s["completed"] == 10 and s["failed"] == 1 and s["errors"] == ["boom"]
    assert math.isclose(s["ttft_ms"]["median"], 550.0) and math.isclose(s["ttft_ms"]["p99"], 991.0)
    assert math.isclose(s["tpot_ms"]["mean"], 500.0)  # (latency - ttft) / (3 - 1) = 0.5 s
    assert math.isclose(s["output_throughput"], 15.0)
    delays = arrival_delays(2000, rate=10.0, seed=0)
    assert abs(sum(delays) / len(delays) - 0.1) < 0.01
    assert arrival_delays(3, float("inf"), 0) == [0.0, 0.0, 0.0]


def test_5xx_errors_carry_only_a_request_id_and_ray_task_errors_map_by_their_cause():
    import ray.exceptions

    from rayinfer.engine.errors import EngineInternalError, InvalidRequestError, OverloadedError
    from rayinfer.serve.protocol import from_error

    secret = "Memory on the node (IP: 10.0.0.7) was 61.2GB / 64GB"
    for e, status in [(RuntimeError(secret), 500), (EngineInternalError(secret), 500), (OverloadedError(secret), 503),
                      (KeyError(secret), 500)]:
        err = from_error(e, request_id="cmpl-1")
        assert err.status == status and secret not in err.message and err.message.endswith("(request id cmpl-1)")
    try:
        raise InvalidRequestError("prompt token id 99999 is out of the vocabulary", "prompt")
    except InvalidRequestError as cause:
        wrapped = ray.exceptions.RayTaskError("generate", "Traceback ...\n" + secret, cause).as_instanceof_cause()
    assert isinstance(wrapped, ValueError) and secret in str(wrapped)
    err = from_error(wrapped)
    assert (err.status, err.param, err.message) == (400, "prompt", "prompt token id 99999 is out of the vocabulary")


@pytest.mark.parametrize("field,value", [("max_request_bytes", 0), ("max_prompt_chars", -1),
                                         ("max_prompt_chars", True), ("max_request_bytes", 1.5)])
def test_serve_config_limits_must_be_positive_integers(field, value):
    from rayinfer.serve.config import ServeConfig

    with pytest.raises(ValueError, match=field):
        ServeConfig(**{field: value})


def test_serve_yaml_sets_the_documented_limits():
    from rayinfer.serve.config import compose_config

    cfg = compose_config(["max_prompt_chars=10", "public_metrics_and_docs=true"])
    assert (cfg.max_request_bytes, cfg.max_prompt_chars, cfg.public_metrics_and_docs) == (8 * 2**20, 10, True)


def test_pd_transfer_stats_are_exported_per_replica():
    from prometheus_client.parser import text_string_to_metric_families

    from rayinfer.engine.protocol import FleetStats, ReplicaStats
    from rayinfer.serve.metrics import ServeMetrics

    prefill = ReplicaStats.from_dict({"num_parked_kv": 3, "kv_transfer_batches": 2, "kv_transfer_bytes_sent": 4096},
                                     replica_id=0, role="prefill")
    decode = ReplicaStats.from_dict({"kv_transfer_batches": 2, "kv_transfer_bytes_received": 4096,
                                     "kv_transfer_budget_used": 1024}, replica_id=1, role="decode")
    assert decode.kv_transfer["kv_transfer_budget_used"] == 1024 and prefill.num_parked_kv == 3
    metrics = ServeMetrics("m")
    metrics.set_engine_stats(FleetStats("pd", [prefill, decode], num_retries=5, num_handbacks=2, num_replacements=1,
                                        kv_device_transfers=False, num_kv_device_failures=3))
    samples = {(s.name, s.labels.get("replica")): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert samples[("rayinfer_replica_replacements_total", "fleet")] == 1  # the router's own counts
    assert samples[("rayinfer_pd_leg_retries_total", "fleet")] == 5
    assert samples[("rayinfer_pd_leg_handbacks_total", "fleet")] == 2
    assert samples[("rayinfer_pd_kv_device_transfers", "fleet")] == 0  # the object store stands in
    assert samples[("rayinfer_pd_kv_device_transfer_failures_total", "fleet")] == 3
    assert ("rayinfer_pd_leg_retries_total", "0") not in samples  # not a replica's
    assert samples[("rayinfer_pd_parked_kv_requests", "0")] == 3
    assert samples[("rayinfer_pd_kv_transfer_sent_bytes_total", "0")] == 4096
    assert samples[("rayinfer_pd_kv_transfer_received_bytes_total", "1")] == 4096
    assert samples[("rayinfer_pd_kv_transfer_budget_used_bytes", "1")] == 1024
    assert ("rayinfer_requests_resent_total", "fleet") not in samples  # colocated fleets' count
    metrics.set_engine_stats(FleetStats("colocated", [ReplicaStats(replica_id=0)], num_resent=4, num_replacements=1))
    samples = {(s.name, s.labels.get("replica")): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert samples[("rayinfer_requests_resent_total", "fleet")] == 4
    assert ("rayinfer_pd_leg_retries_total", "fleet") not in samples


def test_spec_decode_stats_are_exported_per_replica():
    from prometheus_client.parser import text_string_to_metric_families

    from rayinfer.engine.protocol import FleetStats, ReplicaStats
    from rayinfer.engine.spec_decode import SpecStats
    from rayinfer.serve.metrics import ServeMetrics

    spec = SpecStats(max_drafts=3)
    spec.num_drafts_proposed = 9
    spec.record(3, 2)  # a request-step verified 3 drafts and accepted the first 2
    spec.record(2, 0)
    replica = ReplicaStats.from_dict({"num_running": 1, **spec.to_dict(), "spec_device_drafted_steps": 4,
                                      "spec_chained_steps": 3, "spec_gate_plain_steps": 11,
                                      "spec_gate_draft_triggers": 2}, replica_id=0)
    assert replica.spec_decode["spec_num_drafts_verified"] == 5
    metrics = ServeMetrics("m", names="both")
    metrics.set_engine_stats(FleetStats("colocated", [replica]))
    samples = {(s.name, s.labels.get("replica") or s.labels.get("engine"), s.labels.get("position")): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert samples[("rayinfer_spec_decode_num_draft_tokens_proposed_total", "0", None)] == 9
    assert samples[("rayinfer_spec_decode_num_draft_tokens_total", "0", None)] == 5
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", "0", None)] == 2
    assert samples[("rayinfer_spec_decode_mean_accepted_length", "0", None)] == 2.0  # (2 + 0) / 2 steps + 1
    assert samples[("rayinfer_spec_decode_device_drafted_steps_total", "0", None)] == 4
    assert samples[("rayinfer_spec_decode_chained_steps_total", "0", None)] == 3
    assert samples[("rayinfer_spec_decode_gate_plain_steps_total", "0", None)] == 11
    assert samples[("rayinfer_spec_decode_gate_draft_triggers_total", "0", None)] == 2
    assert [samples[("rayinfer_spec_decode_acceptance_by_position", "0", str(j))] for j in range(3)] == [0.5, 0.5, 0.0]


def test_cp_stats_are_exported_per_replica():
    """A CP replica's rank 0 and peer counters reach /metrics (cp_active as 0/1)."""
    from prometheus_client.parser import text_string_to_metric_families

    from rayinfer.engine.protocol import FleetStats, ReplicaStats
    from rayinfer.serve.metrics import ServeMetrics

    rank0 = ReplicaStats.from_dict({"cp": 2, "cp_active": False, "num_cp_prefills": 3, "num_cp_prefill_tokens": 900,
                                    "num_cp_solo_prefills": 1}, replica_id=0)
    peer = ReplicaStats.from_dict({"cp_rank": 1, "num_cp_peer_prefills": 3}, replica_id=1)
    assert rank0.context_parallel["num_cp_prefill_tokens"] == 900 and peer.context_parallel == {
        "cp_rank": 1, "num_cp_peer_prefills": 3}
    metrics = ServeMetrics("m")
    metrics.set_engine_stats(FleetStats("colocated", [rank0, peer]))
    samples = {(s.name, s.labels.get("replica")): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert samples[("rayinfer_cp_active", "0")] == 0.0
    assert samples[("rayinfer_cp_prefills_total", "0")] == 3
    assert samples[("rayinfer_cp_prefill_tokens_total", "0")] == 900
    assert samples[("rayinfer_cp_solo_prefills_total", "0")] == 1
    assert samples[("rayinfer_cp_peer_prefills_total", "1")] == 3
    assert ("rayinfer_cp_active", "1") not in samples  # a peer has no such gauge
