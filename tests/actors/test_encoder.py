"""The encoder replica's logic without Ray: batching across callers, the content-hash cache, and routing
by patches in flight (tiny random LLaVA, CPU)."""

import asyncio
import dataclasses

import pytest
import torch

from rayinfer.actors.encoder_actor import BatchingEncoder, EncoderPool
from rayinfer.engine.errors import InvalidRequestError
from rayinfer.policy.encoder_balance import PatchBalancer
from tests.conftest import random_images


def test_patch_balancer_picks_fewest_patches_in_flight():
    b = PatchBalancer(3)
    assert [b.pick(n) for n in (576, 100, 100, 50)] == [0, 1, 2, 1]  # 1 and 2 tie at 100: lowest index
    assert b.in_flight == [576, 150, 100]
    b.release(0, 576)
    assert b.pick(10) == 0
    with pytest.raises(ValueError):
        PatchBalancer(0)


@pytest.fixture(scope="module")
def llava_images(tiny_llava):
    from rayinfer.model.loader import load_model
    from rayinfer.model.mm_processor import ImageInputProcessor

    model = load_model(tiny_llava, torch.float32, "cpu")
    proc = ImageInputProcessor(tiny_llava)
    _, images = proc.prompt_with_images("<image> <image> <image>", random_images(3, seed=21))
    return model, images


def test_batching_encoder_batches_callers_and_caches(llava_images):
    model, (a, b, c) = llava_images
    enc = BatchingEncoder(model, cache_tokens=1024)

    async def go():
        first = await asyncio.gather(enc.encode([a, b]), enc.encode([b]), enc.encode([c]))
        again = await enc.encode([a])
        return first, again

    (ab, b2, c1), again = asyncio.run(go())
    assert enc.num_batches == 2 and enc.cache.num_encoder_runs == 3  # three callers in one batch (b once), then a
    with torch.no_grad():
        want = model.encode_images(torch.stack([a.pixel_values, b.pixel_values, c.pixel_values]))
    torch.testing.assert_close(torch.stack([ab[0], ab[1], c1[0]]), want)
    torch.testing.assert_close(b2[0], ab[1])
    torch.testing.assert_close(again[0], ab[0])
    # hits: b's repeat within the first batch, then a from the cache (runs + hits = the 5 images asked for)
    assert enc.cache.num_encoder_runs == 3 and enc.cache.hits == 2


def test_encoder_pool_spreads_images_by_patches(llava_images):
    model, images = llava_images
    replicas = [BatchingEncoder(model), BatchingEncoder(model)]
    pool = EncoderPool(replicas)
    out = asyncio.run(pool.encode(images))
    assert [r.cache.num_encoder_runs for r in replicas] == [2, 1]  # 16 patches each: 0, 1, 0
    assert all(m.embeds is not None and m.pixel_values is None and m.embeds.shape == (16, 64) for m in out)
    assert pool.balancer.in_flight == [0, 0]


def test_a_failing_caller_does_not_fail_its_batch_mates(llava_images):
    """The model raises for one caller's image: that caller gets the error, the others their embeddings."""
    model, (a, b, _) = llava_images

    class Picky:
        image_size, num_image_tokens = model.image_size, model.num_image_tokens

        def encode_images(self, pixels):
            if (pixels > 100).any():
                raise ValueError("pixels out of range")
            return model.encode_images(pixels)

    enc = BatchingEncoder(Picky())
    bad = dataclasses.replace(b, content_hash="bad", pixel_values=b.pixel_values + 1000)

    async def go():
        return await asyncio.gather(enc.encode([a]), enc.encode([bad]), return_exceptions=True)

    good, err = asyncio.run(go())
    assert isinstance(err, ValueError) and not isinstance(good, BaseException) and good[0].shape == (16, 64)
    with pytest.raises(InvalidRequestError, match=r"pixel_values have shape \(3, 8, 8\)"):
        asyncio.run(enc.encode([dataclasses.replace(a, pixel_values=torch.zeros(3, 8, 8))]))


def test_encoder_pool_moves_images_off_a_failed_replica(llava_images):
    import ray.exceptions

    model, images = llava_images

    class Dead:
        async def encode(self, images):
            raise ray.exceptions.RayActorError()

    live = BatchingEncoder(model)
    pool = EncoderPool([Dead(), live])
    out = asyncio.run(pool.encode(images))
    assert all(m.embeds is not None for m in out) and live.cache.num_encoder_runs == 3 and pool.num_retries == 1
