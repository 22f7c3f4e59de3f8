"""Image chat through the OpenAI API: the tiny random LLaVA in a real engine, in process (the front end
over httpx's ASGI transport, the official ``openai`` client); no Ray. Bad images are 400s naming the
problem, for that request only."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import openai
import pytest

from rayinfer.engine.config import ModelConfig
from rayinfer.serve.config import ServeConfig
from rayinfer.serve.frontend import OpenAIFrontend, create_app
from tests.conftest import random_images

MAX_MODEL_LEN = 72  # 4 images of 16 tokens and the template do not fit


class InProcessClient:
    """An EngineClient over an AsyncLLMEngine in this process."""

    def __init__(self, engine):
        self.engine, self.max_model_len = engine, engine.engine.max_model_len

    async def generate(self, prompt_token_ids, params, request_id=None, mm_inputs=None):
        async for out in self.engine.generate(request_id, prompt_token_ids, params,
                                              **({"mm_inputs": mm_inputs} if mm_inputs else {})):
            yield out


@pytest.fixture(scope="module")
def served(tiny_llava):
    import torch

    from rayinfer.engine.async_engine import AsyncLLMEngine
    from rayinfer.engine.config import EngineConfig
    from rayinfer.engine.llm_engine import LLMEngine
    from rayinfer.model.loader import load_model, load_tokenizer

    tokenizer = load_tokenizer(tiny_llava)
    model_config = ModelConfig(model=str(tiny_llava), dtype="float32", max_model_len=MAX_MODEL_LEN)
    engine = LLMEngine(model_config, EngineConfig(device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=4),
                       model=load_model(tiny_llava, torch.float32, "cpu"), tokenizer=tokenizer)
    client = InProcessClient(AsyncLLMEngine(engine))

    async def connect():
        return client

    cfg = ServeConfig(model=model_config, max_image_pixels=100 * 100, max_images_per_request=4)
    return OpenAIFrontend(cfg, tokenizer, connect), engine


def png(image, fmt="PNG", **save) -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_chat(*urls, text="What is in the picture?"):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def run_client(fe, fn):
    async def go():
        transport = httpx.ASGITransport(app=create_app(fe))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            api = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
            return await fn(api)
    return asyncio.run(go())


def test_image_chat_plain_and_stream(served):
    fe, engine = served
    img = png(random_images(1, seed=11)[0])
    kw = dict(model=fe.model_name, messages=image_chat(img), max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True})

    async def both(api):
        plain = await api.chat.completions.create(**kw)
        chunks = [c async for c in await api.chat.completions.create(**kw, stream=True)]
        return plain, chunks

    plain, chunks = run_client(fe, both)
    assert plain.usage.completion_tokens == 6 and plain.usage.prompt_tokens > 16
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    stats = engine.stats()
    assert stats["num_encoder_runs"] == 1  # the streamed request's image came from the cache (or the KV cache)


def test_same_image_as_png_or_webp_is_one_image(served):
    fe, engine = served
    img = random_images(1, seed=12)[0]
    kw = dict(model=fe.model_name, max_tokens=3, temperature=0)

    async def two(api):
        a = await api.chat.completions.create(messages=image_chat(png(img), text="one"), **kw)
        b = await api.chat.completions.create(messages=image_chat(png(img, "WEBP", lossless=True), text="two"), **kw)
        return a, b

    before = engine.stats()["num_encoder_runs"]
    run_client(fe, two)
    assert engine.stats()["num_encoder_runs"] == before + 1  # lossless WebP: same pixels, same content hash


def _status(fe, messages):
    async def one(api):
        try:
            await api.chat.completions.create(model=fe.model_name, messages=messages, max_tokens=2)
        except openai.APIStatusError as e:
            return e.status_code, e.body
        return 200, None
    return run_client(fe, one)


def test_bad_images_are_400_naming_the_problem(served):
    fe, engine = served
    ok = png(random_images(1, seed=13)[0])
    gif = png(random_images(1, seed=13)[0], "GIF")
    cases = [
        (image_chat("data:image/png;base64," + base64.b64encode(b"not an image").decode()), "not a valid"),
        (image_chat("data:image/png;base64,@@@"), "base64"),
        (image_chat(gif), "not a valid PNG/JPEG/WEBP"),
        (image_chat(png(random_images(1, size=(101, 100))[0])), "pixels"),
        (image_chat("https://example.com/cat.png"), "network"),
        (image_chat("/etc/passwd"), "local image paths are not allowed"),
        (image_chat(*[ok] * 5), "too many images"),
        (image_chat(*[ok] * 4), "context"),
    ]
    for messages, needle in cases:
        status, body = _status(fe, messages)
        assert status == 400 and needle in body["message"], (needle, body)
    assert _status(fe, image_chat(ok))[0] == 200  # the engine and other requests are untouched
    assert engine.stats()["num_running"] == 0


def test_text_model_refuses_image_parts(tokenizer):
    from tests.serve.test_frontend import AUTH, call, make

    fe, fake = make(tokenizer)
    body = {"messages": image_chat(png(random_images(1)[0])), "max_tokens": 2}
    r = call(fe, "POST", "/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and "does not take images" in r.json()["error"]["message"]
    assert fake.prompts == []


def test_batch_lines_take_image_parts(served, tiny_llava):
    """jobs/generate.py's line parser renders image parts as the service does."""
    import json

    from rayinfer.jobs.batch_io import LineParser
    from rayinfer.model.mm_processor import ImageInputProcessor
    from rayinfer.serve.images import ImageLoader

    fe, _ = served
    processor = ImageInputProcessor(tiny_llava)
    parser = LineParser(fe.tokenizer, fe.model_name, MAX_MODEL_LEN, images=ImageLoader(processor))
    line = json.dumps({"messages": image_chat(png(random_images(1, seed=14)[0])), "max_tokens": 2})
    [job] = parser.parse([(1, line)])
    assert job.prepared is not None and len(job.prepared.mm_inputs) == 1
    mm = job.prepared.mm_inputs[0]
    assert job.prepared.jobs[0][0][mm.offset : mm.offset + mm.length] == [processor.image_token_id] * 16
