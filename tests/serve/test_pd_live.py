"""The Serve app over a prefill/decode-disaggregated topology (parallel=1p1d) answers like colocated."""

import openai
import pytest

QUESTIONS = ["What is the capital of France?", "Name three fruits.", "What is 7 times 6?"]


@pytest.fixture(scope="module")
def pd_server(live_server):
    from ray import serve

    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.placement.parallel_config import ParallelConfig
    from rayinfer.serve.app import build_app_from_config
    from rayinfer.serve.config import ServeConfig

    cfg = ServeConfig(model=ModelConfig(max_model_len=1024), engine=EngineConfig(device="cpu", num_kv_blocks=512),
                      api_key=live_server.api_key,
                      parallel=ParallelConfig(num_prefill=1, num_decode=1, num_cpus_per_replica=1))
    serve.run(build_app_from_config(cfg), name="rayinfer-pd", route_prefix="/pd")
    yield openai.OpenAI(base_url=live_server.base_url + "/pd/v1", api_key=live_server.api_key, max_retries=0,
                        timeout=120)
    serve.delete("rayinfer-pd")


def test_1p1d_chat_equals_colocated(client, pd_server, model):
    for q in QUESTIONS:
        kw = dict(model=model, messages=[{"role": "user", "content": q}], temperature=0.0, max_tokens=16)
        colocated = client.chat.completions.create(**kw).choices[0]
        disaggregated = pd_server.chat.completions.create(**kw).choices[0]
        assert disaggregated.message.content == colocated.message.content
        assert disaggregated.finish_reason == colocated.finish_reason


def test_1p1d_streaming_equals_non_streamed(pd_server, model):
    kw = dict(model=model, messages=[{"role": "user", "content": QUESTIONS[1]}], temperature=0.0, max_tokens=16)
    full = pd_server.chat.completions.create(**kw).choices[0].message.content
    deltas = [c.choices[0].delta.content or "" for c in pd_server.chat.completions.create(stream=True, **kw)
              if c.choices]
    assert "".join(deltas) == full
