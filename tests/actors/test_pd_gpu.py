"""1P1D on GPUs: the KV moves device to device through Ray Direct Transport and greedy outputs equal the
colocated engine's on the same GPU.

On one GPU both replicas share it (half a GPU each) and the KV goes over CUDA IPC: NCCL refuses two
ranks on one device ("Duplicate GPU detected"). With two or more GPUs the same check also runs over
NCCL (one GPU per replica). Weights are SmolLM2's shape with dummy values (seeded, identical in every
replica), in float32, so any lost or misplaced KV block changes the greedy tokens.
"""

import asyncio

import pytest
import torch

from rayinfer.engine.config import EngineConfig, ModelConfig

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MODEL = ModelConfig(dtype="float32", load_format="dummy", seed=1)
TRANSPORTS = ["cuda_ipc"] + (["nccl"] if torch.cuda.device_count() >= 2 else [])


def engine_config(**overrides) -> EngineConfig:
    base = dict(device="cuda", num_kv_blocks=1024, max_num_batched_tokens=128, max_num_seqs=16)
    return EngineConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def gpu_reference(cases):
    from rayinfer.engine.llm_engine import LLMEngine

    engine = LLMEngine(MODEL, engine_config())
    done = engine.generate([c.prompt_token_ids for c in cases], [c.params for c in cases],
                           [c.request_id for c in cases])
    ref = {c.request_id: (c.output_token_ids, c.text, c.finish_reason) for c in done}
    del engine
    torch.cuda.empty_cache()
    return ref


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_1p1d_over_device_transport_equals_colocated(ray_cluster, pd, cases, gpu_reference, transport):
    from rayinfer.actors.client import make_client
    from rayinfer.placement.parallel_config import ParallelConfig, PDSection

    gpus = 0.5 if transport == "cuda_ipc" else 1
    client = make_client(MODEL, engine_config(enable_prefix_caching=False),
                         ParallelConfig(num_prefill=1, num_decode=1, num_cpus_per_replica=1, num_gpus_per_replica=gpus,
                                        pd=PDSection(kv_transport=transport)))
    try:
        assert client.transport == transport and client._rdt_ok
        streams = asyncio.run(pd.stream_all(client, cases, f"~{transport}"))
        pd.check_streams(streams, gpu_reference)
        assert client._rdt_ok, "a device transfer failed and the client fell back to the object store"
        stats = asyncio.run(client.stats())
        assert stats.by_role("decode")[0].num_generation_tokens > 0
    finally:
        client.shutdown()
