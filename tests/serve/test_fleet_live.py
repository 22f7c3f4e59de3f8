"""Two Serve ingress replicas share one engine fleet: one EngineFleet deployment starts the replicas
once, and both ingresses route through its Router (one view of load)."""

import concurrent.futures

import openai
import pytest

APP = "rayinfer-two-ingress"
QUESTIONS = ["What is the capital of France?", "Name three fruits.", "What is 7 times 6?", "Say hello.",
             "Name a color.", "What is 2 + 2?", "Name a planet.", "What is water made of?"]


def _cpus_free(ray) -> float:
    """CPUs not reserved (each engine replica's placement-group bundle holds its CPUs; the ingress, fleet
    and router deployments hold none)."""
    return ray.available_resources().get("CPU", 0.0)


@pytest.fixture(scope="module")
def two_ingress(live_server, ray_cluster):
    from ray import serve

    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.placement.parallel_config import ParallelConfig
    from rayinfer.serve.app import build_app_from_config
    from rayinfer.serve.config import ServeConfig

    before = _cpus_free(ray_cluster)
    cfg = ServeConfig(model=ModelConfig(max_model_len=1024), engine=EngineConfig(device="cpu", num_kv_blocks=256),
                      api_key=live_server.api_key, num_ingress_replicas=2,
                      parallel=ParallelConfig(dp=2, num_cpus_per_replica=1))
    serve.run(build_app_from_config(cfg), name=APP, route_prefix="/two")
    client = openai.OpenAI(base_url=live_server.base_url + "/two/v1", api_key=live_server.api_key, max_retries=0,
                           timeout=120)
    yield client, before
    serve.delete(APP)


def test_two_ingress_replicas_share_one_fleet(two_ingress, client, model, ray_cluster):
    from ray import serve

    two, before = two_ingress
    status = serve.status().applications[APP].deployments
    assert status["OpenAIIngress"].replica_states.get("RUNNING") == 2
    assert status["EngineFleet"].replica_states.get("RUNNING") == 1
    assert before - _cpus_free(ray_cluster) == 2  # dp=2 one-CPU replicas started once, not once per ingress

    def ask(q):
        kw = dict(model=model, messages=[{"role": "user", "content": q}], temperature=0.0, max_tokens=12)
        return two.chat.completions.create(**kw), client.chat.completions.create(**kw)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, QUESTIONS))
    for shared, reference in answers:  # same answers as the one-replica service
        assert shared.choices[0].message.content == reference.choices[0].message.content

    handle = serve.get_deployment_handle("EngineFleet", APP)
    router = handle.router_handle.remote().result()
    assert ray_cluster.get(router.in_flight.remote()) == [0, 0]  # every pick released, by both ingresses
    stats = ray_cluster.get(router.stats.remote())
    assert [r.error for r in stats.replicas] == [None, None]
    generated = sum(a[0].usage.completion_tokens for a in answers)
    assert sum(r.num_generation_tokens for r in stats.replicas) == generated  # one fleet served every request
