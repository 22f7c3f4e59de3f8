"""Images in the engine (tiny random LLaVA, CPU): the encoder cache, image-keyed prefix caching, checks."""

import pytest
import torch

from rayinfer.engine.block_pool import hash_block
from rayinfer.engine.errors import InvalidRequestError
from rayinfer.engine.multimodal import EncoderCache, block_extra_key, placeholder_ranges
from rayinfer.engine.types import MultiModalInput, SamplingParams
from tests.conftest import random_images

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tiny_llava):
    from rayinfer.model.loader import load_model
    from rayinfer.model.mm_processor import ImageInputProcessor

    return load_model(tiny_llava, torch.float32, "cpu"), ImageInputProcessor(tiny_llava), tiny_llava


def make_engine(llava, **overrides):
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.engine.llm_engine import LLMEngine

    model, proc, path = llava
    cfg = EngineConfig(**{"device": "cpu", "num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 4, **overrides})
    return LLMEngine(ModelConfig(model=str(path), dtype="float32"), cfg, model=model, tokenizer=proc.processor.tokenizer)


def run(engine, proc, text, image, rid):
    ids, mm = proc.prompt_with_images(text, [image])
    [out] = engine.generate([ids], GREEDY, request_ids=[rid], mm_inputs=[mm])
    assert out.error is None
    return out


def test_repeated_image_is_not_encoded_again(llava):
    _, proc, _ = llava
    engine = make_engine(llava)
    img = random_images(1, seed=7)[0]
    run(engine, proc, "<image> What is this?", img, "a")
    assert engine.stats()["num_encoder_runs"] == 1
    run(engine, proc, "Another question first: <image> and then?", img, "b")  # other text: no prefix hit
    stats = engine.stats()
    assert stats["num_encoder_runs"] == 1 and stats["encoder_cache_hits"] == 1
    run(engine, proc, "<image> What is this?", random_images(1, seed=8)[0], "c")
    assert engine.stats()["num_encoder_runs"] == 2


def test_prefix_cache_keys_on_image_content(llava):
    """Same text + another image misses the prefix cache; same text + same image hits, same tokens."""
    _, proc, _ = llava
    engine = make_engine(llava)
    x, y = random_images(2, seed=3)
    text = "<image> Describe the picture in detail."
    first = run(engine, proc, text, x, "x1")
    other = run(engine, proc, text, y, "y1")
    assert other.num_cached_tokens == 0  # the image starts the prompt: block 0 already differs
    again = run(engine, proc, text, x, "x2")
    assert again.num_cached_tokens >= 16  # the image's blocks came from the cache
    assert again.output_token_ids == first.output_token_ids
    cold = make_engine(llava, enable_prefix_caching=False)
    assert run(cold, proc, text, y, "y2").output_token_ids == other.output_token_ids


def test_block_extra_key():
    img = MultiModalInput("ab" * 32, offset=6, length=4)
    assert block_extra_key(None, [img], 0, 4) is None  # text-only blocks hash as before
    assert block_extra_key(5, [img], 0, 4) == 5
    k1 = block_extra_key(None, [img], 4, 8)
    other = MultiModalInput("cd" * 32, offset=6, length=4)
    moved = MultiModalInput("ab" * 32, offset=5, length=4)
    assert k1 is not None and k1 != block_extra_key(None, [other], 4, 8) != block_extra_key(None, [moved], 4, 8)
    assert hash_block(0, [1, 2, 3, 4], k1) != hash_block(0, [1, 2, 3, 4], None)


def test_placeholder_ranges_split_adjacent_images():
    assert placeholder_ranges([1, 9, 9, 9, 9, 2], 9, [2, 2]) == [(1, 2), (3, 2)]
    with pytest.raises(InvalidRequestError):
        placeholder_ranges([1, 9, 9, 2], 9, [3])


def test_encoder_cache_evicts_least_recent():
    cache = EncoderCache(max_tokens=4)
    cache.put("a", torch.zeros(2, 1))
    cache.put("b", torch.zeros(2, 1))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", torch.zeros(2, 1))
    assert cache.get("b") is None and cache.get("a") is not None and cache.num_tokens == 4


def test_bad_image_inputs_fail_that_request_only(llava):
    _, proc, _ = llava
    engine = make_engine(llava)
    ids, [mm] = proc.prompt_with_images("<image> hi", random_images(1))
    shifted = MultiModalInput(mm.content_hash, mm.offset + 1, mm.length, pixel_values=mm.pixel_values)
    wrong_pixels = MultiModalInput(mm.content_hash, mm.offset, mm.length, pixel_values=torch.zeros(3, 8, 8))
    for bad in (shifted, wrong_pixels):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("bad", ids, GREEDY, mm_inputs=[bad])
        assert e.value.param == "image"
    engine.add_request("ok", ids, GREEDY, mm_inputs=[mm])
    assert engine.scheduler.num_waiting == 1


def test_pd_handoff_of_an_image_request(llava):
    """PREFILL (given the image's embeddings) -> DECODE (given only its hash): the colocated engine's tokens,
    and neither engine runs its encoder; a handle offered with another image's hash is refused."""
    import dataclasses

    model, proc, _ = llava
    normal = make_engine(llava)
    prefill, decode = make_engine(llava, role="prefill"), make_engine(llava, role="decode")
    ids, [mm] = proc.prompt_with_images("<image> Describe it.", random_images(1, seed=71))
    want = normal.generate([ids], GREEDY, request_ids=["n"], mm_inputs=[[mm]])[0].output_token_ids
    with torch.no_grad():
        embeds = model.encode_images(mm.pixel_values[None])[0]
    prefill.add_request("r", ids, GREEDY, mm_inputs=[dataclasses.replace(mm, pixel_values=None, embeds=embeds)])
    outs = []
    while prefill.has_unfinished_requests():
        outs += prefill.step()
    [out] = [o for o in outs if o.finished]
    assert out.finish_reason == "prefilled" and prefill.stats()["num_encoder_runs"] == 0
    handle = dataclasses.replace(out.kv_handle, payload=prefill.take_kv("r"))
    other = dataclasses.replace(mm, content_hash="ab" * 32, pixel_values=None)
    with pytest.raises(InvalidRequestError, match="block hashes do not match"):
        decode.add_request("x", ids, GREEDY, kv_handle=handle, output_token_ids=out.new_token_ids, mm_inputs=[other])
    decode.add_request("r", ids, GREEDY, kv_handle=handle, output_token_ids=out.new_token_ids,
                       mm_inputs=[dataclasses.replace(mm, pixel_values=None)])
    tokens = list(out.new_token_ids)
    while decode.has_unfinished_requests():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == want and decode.stats()["num_encoder_runs"] == 0


def test_decode_replica_drops_the_vision_encoder(llava):
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.engine.llm_engine import LLMEngine

    _, proc, path = llava
    cfg = EngineConfig(device="cpu", num_kv_blocks=16, block_size=4, max_num_seqs=2, role="decode")
    engine = LLMEngine(ModelConfig(model=str(path), dtype="float32"), cfg, tokenizer=proc.processor.tokenizer)
    assert engine.model.vision_tower is None and engine.model.multi_modal_projector is None
    with pytest.raises(ValueError, match="dropped its vision encoder"):
        engine.model.encode_images(torch.zeros(1, 3, 8, 8))
    assert llava[0].vision_tower is not None  # a model handed in (shared) is left whole
