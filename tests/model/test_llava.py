"""LLaVA against transformers' LlavaForConditionalGeneration on a tiny random checkpoint (CPU, float32)."""

import pytest
import torch

from rayinfer.model.llava import _canonical_name
from tests.conftest import random_images


@pytest.fixture(scope="module")
def models(tiny_llava):
    import transformers

    from rayinfer.model.loader import load_model
    from rayinfer.model.mm_processor import ImageInputProcessor

    ref = transformers.LlavaForConditionalGeneration.from_pretrained(tiny_llava).eval()
    ours = load_model(tiny_llava, torch.float32, "cpu")
    return ref, ours, ImageInputProcessor(tiny_llava)


def test_image_features_equal_transformers(models):
    ref, ours, proc = models
    _, inputs = proc.prompt_with_images("a <image> b <image>", random_images(2))
    pixels = torch.stack([m.pixel_values for m in inputs])
    with torch.no_grad():
        want = torch.stack(list(ref.model.get_image_features(pixels).pooler_output))
        got = ours.encode_images(pixels)
    assert got.shape == (2, 16, 64) == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_checkpoint_layouts():
    assert _canonical_name("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert _canonical_name("model.language_model.norm.weight") == "model.norm.weight"
    assert _canonical_name("language_model.lm_head.weight") == "lm_head.weight"
    assert _canonical_name("lm_head.weight") == "lm_head.weight"
    assert _canonical_name("model.vision_tower.vision_model.pre_layrnorm.bias") == "vision_tower.pre_layrnorm.bias"
    assert _canonical_name("model.multi_modal_projector.linear_1.weight") == "multi_modal_projector.linear_1.weight"


@pytest.mark.parametrize("num_images", [1, 2])
def test_engine_greedy_equals_transformers_generate(tiny_llava, models, num_images):
    """Greedy tokens of our engine (prefill in 7-token chunks, so chunk boundaries fall inside images)
    equal transformers' generate."""
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.engine.llm_engine import LLMEngine
    from rayinfer.engine.types import SamplingParams

    ref, ours, proc = models
    text = "Describe " + " and ".join(["<image>"] * num_images) + " please."
    ids, mm = proc.prompt_with_images(text, random_images(num_images, seed=num_images))
    assert len(mm) == num_images and all(m.length == 16 for m in mm)
    with torch.no_grad():
        pixels = torch.stack([m.pixel_values for m in mm])
        out = ref.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=8, do_sample=False)
    want = out[0, len(ids):].tolist()
    engine = LLMEngine(ModelConfig(model=str(tiny_llava), dtype="float32"),
                       EngineConfig(device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=7,
                                    max_num_seqs=4),
                       model=ours, tokenizer=proc.processor.tokenizer)
    [got] = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), mm_inputs=[mm])
    assert got.error is None
    assert got.output_token_ids[: len(want)] == want
    assert engine.stats()["num_encoder_runs"] == num_images
