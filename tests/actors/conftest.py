"""Shared by the PD tests: a mixed batch of requests, the colocated engine's greedy outputs for it, and
``pd`` (the model config, replica config and stream helpers; a fixture, so test modules import nothing)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.types import SamplingParams

SYSTEM = ("You are a concise assistant. Answer in plain English, keep answers short, and never use more "
          "words than the question needs. ") * 2
MODEL = ModelConfig(dtype="float32")
NUM_KV_BLOCKS = 256


@dataclass
class Case:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def engine_config(**overrides) -> EngineConfig:
    """Small replicas: 256 blocks, a 128-token budget so the long prompt is prefilled in chunks."""
    base = dict(device="cpu", num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=128, max_num_seqs=16)
    base.update(overrides)
    return EngineConfig(**base)


@pytest.fixture(scope="session")
def cases(tokenizer) -> list[Case]:
    """Chat prompts sharing a long system prompt, raw prompts, a long prompt, max_tokens 1, a stop string."""
    from rayinfer.serve.chat import encode_plain, render_chat

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    chats = ["What is 2 + 2?", "Name a primary color.", "Why is the sky blue?", "What is the capital of Italy?"]
    out = [Case(f"chat-{i}", render_chat(tokenizer, [{"role": "system", "content": SYSTEM},
                                                       {"role": "user", "content": q}]), greedy)
           for i, q in enumerate(chats)]
    out.append(Case("raw", encode_plain(tokenizer, "The quick brown fox"), greedy))
    long_text = " ".join(f"Day {i} was {'sunny' if i % 3 else 'rainy'}." for i in range(40))
    out.append(Case("long", render_chat(tokenizer, [{"role": "user", "content": long_text + " Summarize."}]),
                    greedy))
    out.append(Case("one-token", encode_plain(tokenizer, "Paris is"), SamplingParams(temperature=0.0, max_tokens=1)))
    out.append(Case("stop", encode_plain(tokenizer, "Count: one, two, three,"),
                    SamplingParams(temperature=0.0, max_tokens=8, stop=[" five"])))
    return out


@pytest.fixture(scope="session")
def reference(cases, smollm2) -> dict[str, tuple[list[int], str, str]]:
    """request id -> (output token ids, text, finish reason) from one colocated (NORMAL) engine."""
    engine = smollm2.engine(engine_config())
    done = engine.generate([c.prompt_token_ids for c in cases], [c.params for c in cases],
                           [c.request_id for c in cases])
    return {c.request_id: (c.output_token_ids, c.text, c.finish_reason) for c in done}


async def stream_all(client, cases, suffix: str = "", on_output=None) -> dict[str, list]:
    """Run every case through ``client.generate`` concurrently; returns request id -> its outputs."""

    async def one(c):
        outs = []
        async for out in client.generate(c.prompt_token_ids, c.params, c.request_id + suffix):
            outs.append(out)
            if on_output is not None:
                on_output(out)
        return c.request_id, outs

    return dict(await asyncio.gather(*[one(c) for c in cases]))


def check_streams(streams: dict[str, list], reference: dict) -> None:
    """Every request finished exactly once (its last output), with the reference's tokens and text."""
    for rid, outs in streams.items():
        base = rid.split("~")[0]
        tokens, text, reason = reference[base]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], rid
        assert outs[-1].error is None, (rid, outs[-1].error)
        assert [t for o in outs for t in o.new_token_ids] == tokens, rid
        assert "".join(o.new_text for o in outs) == text, rid
        assert outs[-1].finish_reason == reason, rid


@pytest.fixture(scope="session")
def pd():
    """The PD tests' helpers: model, engine_config(**overrides), stream_all, check_streams."""
    return SimpleNamespace(model=MODEL, engine_config=engine_config, stream_all=stream_all,
                           check_streams=check_streams)


@pytest.fixture(scope="session")
def tiny_llama_config(tmp_path_factory) -> ModelConfig:
    """A 2-layer random Llama (SmolLM2's vocabulary, float32) saved as a Hugging Face checkpoint, for
    multi-actor tests that need a model too small to notice (the KV store tier, CP fleets)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, initializer_range=0.1)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return ModelConfig(str(path), dtype="float32")
