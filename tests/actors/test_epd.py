"""Encode / prefill / decode disaggregation (1 encoder + 1 prefill + 1 decode replica, tiny random LLaVA,
CPU): greedy outputs equal the colocated engine's, the prefill engine never runs its encoder, a repeated
image is not encoded again, another image with the same text misses the prefix cache, a bad image fails
its own request only, and the batch job runs image lines on the fleet."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import pytest
import torch

from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.types import MultiModalInput, SamplingParams
from rayinfer.placement.parallel_config import EncoderSection, ParallelConfig
from tests.conftest import random_images

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TEXTS = ["<image> Describe the picture in detail.", "<image> What colors do you see?"]


def engine_config() -> EngineConfig:
    return EngineConfig(device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=4)


@pytest.fixture(scope="module")
def proc(tiny_llava):
    from rayinfer.model.mm_processor import ImageInputProcessor

    return ImageInputProcessor(tiny_llava)


@pytest.fixture(scope="module")
def epd(ray_cluster, tiny_llava):
    from rayinfer.actors.client import make_client

    client = make_client(ModelConfig(str(tiny_llava), dtype="float32"), engine_config(),
                         ParallelConfig(num_prefill=1, num_decode=1, num_cpus_per_replica=1,
                                        encoder=EncoderSection(num_encoders=1)))
    yield client
    client.shutdown()


def colocated(tiny_llava, prompts):
    """Greedy output ids of (text, image) prompts on one in-process NORMAL engine that encodes itself."""
    from rayinfer.engine.llm_engine import LLMEngine

    engine = LLMEngine(ModelConfig(str(tiny_llava), dtype="float32"), engine_config())
    ids, mm = zip(*prompts)
    return [c.output_token_ids for c in engine.generate(list(ids), GREEDY, mm_inputs=list(mm))]


def stats(client):
    s = asyncio.run(client.stats())
    return s.by_role("prefill")[0], s.by_role("decode")[0], s.encoders[0]


def run_all(client, prompts):
    async def main():
        return await asyncio.gather(*[client.complete(ids, GREEDY, mm_inputs=mm) for ids, mm in prompts])

    return asyncio.run(main())


def test_epd_equals_colocated_and_never_runs_the_prefill_encoder(epd, proc, tiny_llava):
    a, b = random_images(2, seed=31)
    prompts = [proc.prompt_with_images(TEXTS[0], [a]), proc.prompt_with_images(TEXTS[0], [b]),
               proc.prompt_with_images(TEXTS[1], [a])]
    outs = run_all(epd, prompts)
    assert [o.error for o in outs] == [None] * 3
    assert [o.output_token_ids for o in outs] == colocated(tiny_llava, prompts)
    prefill, decode, encoder = stats(epd)
    assert prefill.num_encoder_runs == prefill.encoder_cache_hits == 0  # embeddings came from the encoder replica
    assert decode.num_encoder_runs == 0
    assert encoder.num_encoder_runs == 2 and encoder.num_images == 3  # image a twice, encoded once

    # the same image again (other text): served from the encoder replica's cache
    [again] = run_all(epd, [proc.prompt_with_images(TEXTS[1], [b])])
    assert again.error is None
    _, _, encoder2 = stats(epd)
    assert encoder2.num_encoder_runs == 2 and encoder2.encoder_cache_hits == encoder.encoder_cache_hits + 1


def test_same_text_other_image_misses_the_prefix_cache(epd, proc, tiny_llava):
    x, y = random_images(2, seed=41)
    [first] = run_all(epd, [proc.prompt_with_images(TEXTS[0], [x])])
    [other] = run_all(epd, [proc.prompt_with_images(TEXTS[0], [y])])
    [same] = run_all(epd, [proc.prompt_with_images(TEXTS[0], [x])])
    assert first.error is None and other.error is None and same.error is None
    assert other.num_cached_tokens == 0  # the image starts the prompt: block 0 already differs
    assert same.num_cached_tokens >= 16  # the image's blocks came from the prefix cache (or the KV store)
    assert same.output_token_ids == first.output_token_ids


def test_bad_image_fails_its_request_only(epd, proc):
    ids, [mm] = proc.prompt_with_images(TEXTS[0], random_images(1, seed=51))
    bad = MultiModalInput(mm.content_hash[::-1], mm.offset, mm.length, pixel_values=torch.zeros(3, 8, 8),
                          num_patches=1)
    bad_out, good_out = run_all(epd, [(ids, [bad]), (ids, [mm])])
    assert bad_out.finish_reason == "error" and "pixel_values" in bad_out.error and "(3, 32, 32)" in bad_out.error
    assert good_out.error is None and len(good_out.output_token_ids) == GREEDY.max_tokens
    assert all(s.error is None for s in stats(epd))  # every replica still answers


def test_batch_job_runs_image_lines_on_the_fleet(epd, tiny_llava, tmp_path):
    from rayinfer.jobs.generate import GenerateConfig, run

    buf = io.BytesIO()
    random_images(1, seed=61)[0].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    lines = [{"id": "img", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}],
        "max_tokens": 3},
        {"id": "bad", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 3}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = GenerateConfig(input=str(tmp_path / "in.jsonl"), model=ModelConfig(str(tiny_llava), dtype="float32"),
                         engine=engine_config(), print_outputs=False)
    assert run(cfg, client=epd) == 0
    out = [json.loads(x) for x in (tmp_path / "in.out.jsonl").read_text().splitlines()]
    assert out[0]["id"] == "img" and out[0]["error"] is None and len(out[0]["output_token_ids"]) == 3
    assert out[1]["id"] == "bad" and "image" in out[1]["error"]


def test_encoder_config_errors_name_the_problem():
    from rayinfer.actors.encoder_actor import check_encoder_model
    from rayinfer.actors.router import check_supported
    from rayinfer.engine.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="encoder.num_encoders"):
        check_supported(ParallelConfig(ep=2, encoder=EncoderSection(num_encoders=1)))
    with pytest.raises(ValueError, match=r"encoder.num_encoders=1 needs a vision-language model"):
        check_encoder_model(ParallelConfig(encoder={"num_encoders": 1}), "llama-tiny")
    check_encoder_model(ParallelConfig(), "llama-tiny")  # no encoders: any model


def test_encoder_transport_resolves_and_bad_names_are_refused():
    from rayinfer.actors.encoder_actor import resolve_encoder_transport

    assert resolve_encoder_transport("auto", 0.3) == "object_store"  # measured faster for MB-sized images
    assert resolve_encoder_transport("cuda_ipc", 0.3) == "cuda_ipc"
    assert resolve_encoder_transport("object_store", 0.5) == "object_store"
    with pytest.raises(ValueError, match="no GPUs"):
        resolve_encoder_transport("cuda_ipc", 0)
    with pytest.raises(ValueError, match="encoder.transport"):
        EncoderSection(num_encoders=1, transport="nccl")


@pytest.mark.gpu
def test_epd_over_cuda_ipc_on_one_gpu_equals_colocated(ray_cluster, proc, tiny_llava):
    """Encoder, prefill and decode replicas share one GPU (0.3 each): embeddings move by Ray Direct
    Transport (cuda_ipc); greedy outputs equal one in-process GPU engine's."""
    from rayinfer.actors.client import make_client
    from rayinfer.engine.llm_engine import LLMEngine

    cfg = EngineConfig(device="cuda", num_kv_blocks=64, block_size=16, max_num_seqs=4)
    model = ModelConfig(str(tiny_llava), dtype="float32")
    a, b = random_images(2, seed=51)
    prompts = [proc.prompt_with_images(TEXTS[0], [a]), proc.prompt_with_images(TEXTS[1], [b]),
               proc.prompt_with_images(TEXTS[1], [a])]
    engine = LLMEngine(model, cfg)
    ids, mm = zip(*prompts)
    want = [c.output_token_ids for c in engine.generate(list(ids), GREEDY, mm_inputs=list(mm))]
    del engine
    torch.cuda.empty_cache()
    client = make_client(model, cfg, ParallelConfig(num_prefill=1, num_decode=1, num_cpus_per_replica=1,
                                                    num_gpus_per_replica=0.3,
                                                    encoder=EncoderSection(num_encoders=1, transport="cuda_ipc")))
    try:
        assert client.info.encoder_transport == "cuda_ipc"
        outs = run_all(client, prompts)
        assert [o.error for o in outs] == [None] * 3
        assert [o.output_token_ids for o in outs] == want
        prefill, _, encoder = stats(client)
        assert prefill.num_encoder_runs == 0 and encoder.num_encoder_runs == 2
    finally:
        client.shutdown()
