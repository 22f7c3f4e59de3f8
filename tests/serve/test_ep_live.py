"""Serve over an expert-parallel fleet (``parallel=ep2``, the tiny random Qwen3-MoE): the OpenAI client
gets the same greedy text streamed and not streamed, equal to one engine's on the same weights, while
the two EP ranks step on their own (the same steps of each kind on both)."""

import concurrent.futures

import pytest

APP = "rayinfer-ep2"
PROMPTS = [[101, 2023, 318, 257], [40, 588, 257, 1110, 286, 1332, 5], [12], [7, 8, 9, 10, 11, 12, 13, 14, 15]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def ep_app(live_server, ray_cluster):
    from ray import serve

    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.placement.parallel_config import EPLBSection, ParallelConfig
    from rayinfer.serve.app import build_app_from_config
    from rayinfer.serve.config import ServeConfig

    model = ModelConfig("qwen3-moe-tiny", dtype="float32", load_format="dummy", max_model_len=256)
    engine = EngineConfig(device="cpu", num_kv_blocks=64, max_num_seqs=8)
    cfg = ServeConfig(model=model, engine=engine, api_key=live_server.api_key, served_model_name="moe",
                      parallel=ParallelConfig(ep=2, eplb=EPLBSection(num_redundant_experts=2, interval=4, window=4)))
    serve.run(build_app_from_config(cfg), name=APP, route_prefix="/ep")
    import openai

    client = openai.OpenAI(base_url=live_server.base_url + "/ep/v1", api_key=live_server.api_key, max_retries=0,
                           timeout=120)
    yield client, model, engine
    serve.delete(APP)


def test_ep2_fleet_answers_openai_stream_and_not(ep_app, ray_cluster):
    from ray import serve

    from rayinfer.engine.llm_engine import LLMEngine
    from rayinfer.engine.types import SamplingParams

    client, model, engine = ep_app
    kw = dict(model="moe", temperature=0.0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})

    def ask(prompt):
        whole = client.completions.create(prompt=prompt, **kw)
        chunks = list(client.completions.create(prompt=prompt, stream=True, **kw))
        return whole, "".join(c.choices[0].text for c in chunks if c.choices), \
            [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, PROMPTS))
    want = LLMEngine(model, engine).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for (whole, streamed, finish), ref in zip(answers, want):
        assert whole.choices[0].text == streamed == ref.text
        assert whole.usage.completion_tokens == MAX_TOKENS
        assert whole.choices[0].finish_reason == "length" and finish == ["length"]

    router = serve.get_deployment_handle("EngineFleet", APP).router_handle.remote().result()
    stats = ray_cluster.get(router.stats.remote())
    assert stats.topology == "ep" and len(stats.replicas) == 2
    assert sum(r.num_generation_tokens for r in stats.replicas) == 2 * MAX_TOKENS * len(PROMPTS)
    assert stats.ep.num_steps >= MAX_TOKENS and stats.ep.eplb_history
