"""PREFILL and DECODE engines by hand, no Ray: export -> import continues token for token like a NORMAL
engine, and a DECODE engine that runs out of blocks hands a request back for a re-prefill (SmolLM2, CPU)."""

import dataclasses

import pytest

from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.types import SamplingParams

TEXTS = ["The history of the printing press begins in the fifteenth century, when a goldsmith in the city of "
         "Mainz began to experiment with movable metal type, oil-based inks and a wooden screw press",
         "Photosynthesis is the process by which green plants, algae and some bacteria use the energy of "
         "sunlight to turn carbon dioxide and water into sugars, releasing oxygen as a by-product"]


@pytest.fixture(scope="module")
def engines():
    model = ModelConfig(dtype="float32")
    base = dict(device="cpu", block_size=16)
    return (LLMEngine(model, EngineConfig(num_kv_blocks=64, **base)),
            # pipelined scheduling on the prefill side: its in-flight first token must end the prefill
            LLMEngine(model, EngineConfig(num_kv_blocks=64, role="prefill", async_scheduling=True, **base)),
            LLMEngine(model, EngineConfig(num_kv_blocks=6, role="decode", **base)))


def drain(engine):
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_prefill_export_decode_import_and_hand_back(engines):
    normal, prefill, decode = engines
    from rayinfer.serve.chat import encode_plain

    prompts = {rid: encode_plain(normal.tokenizer, t)[:31] for rid, t in zip("ab", TEXTS)}
    assert all(len(p) == 31 for p in prompts.values())
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = {c.request_id: c.output_token_ids for c in normal.generate(list(prompts.values()), params, list("ab"))}

    tokens = {rid: [] for rid in prompts}
    handbacks = []

    def prefill_into_decode(rids):
        for rid in rids:
            prefill.add_request(rid, prompts[rid], params, output_token_ids=tokens[rid])
        for out in drain(prefill):
            rid = out.request_id
            assert out.finish_reason == "prefilled" and out.kv_handle.num_tokens == 31 + len(tokens[rid])
            assert out.kv_handle.payload is None and rid in prefill.parked  # the KV waits in the pool
            parked = len(prefill.parked[rid].block_ids)
            assert parked == -(-out.kv_handle.num_tokens // 16)
            assert prefill.scheduler.kv.pool.num_free_blocks <= 64 - parked
            free = prefill.scheduler.kv.pool.num_free_blocks
            payload = prefill.take_kv(rid)
            assert rid not in prefill.parked and prefill.scheduler.kv.pool.num_free_blocks == free + parked
            tokens[rid] += out.new_token_ids
            decode.add_request(rid, prompts[rid], params, kv_handle=dataclasses.replace(out.kv_handle, payload=payload),
                               output_token_ids=tokens[rid])

    prefill_into_decode("ab")  # 32 tokens each: 2 + 2 of the decode engine's 6 blocks
    assert prefill.scheduler.kv.pool.num_free_blocks == 64 and not prefill.scheduler.requests
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finish_reason == "preempted":  # both reached 49 tokens: one 4th block too few
                handbacks.append(out.request_id)
                assert out.finished and not out.new_token_ids
                prefill_into_decode([out.request_id])  # re-prefill prompt + outputs so far
            else:
                tokens[out.request_id] += out.new_token_ids
    assert handbacks == ["b"]  # the last admitted is preempted; the decode engine never recomputes it
    # one token per decode step and none twice: 20 outputs each, less the first (prefill) of each leg
    assert decode.stats()["num_computed_tokens"] == 2 * 20 - 2 - len(handbacks)
    assert tokens == ref


def test_a_pinned_parked_request_outlives_expiry_until_released(engines):
    """``pin_kv`` (a cuda_ipc transfer reading the blocks in place) returns the parked blocks and keeps them
    through an expiry scan that frees an unpinned neighbour; ``release_kv`` then frees them."""
    _, prefill, _ = engines
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    free = prefill.scheduler.kv.pool.num_free_blocks
    for rid in ("pinned", "loose"):
        prefill.add_request(rid, list(range(10, 40)), params)
    drain(prefill)
    assert {"pinned", "loose"} <= set(prefill.parked)
    blocks = prefill.pin_kv("pinned")
    assert blocks == prefill.parked["pinned"].block_ids and len(blocks) == 2
    assert prefill.expire_kv(0.0) == ["loose"]
    assert "pinned" in prefill.parked and "loose" not in prefill.parked
    prefill.release_kv(["pinned"])
    assert not prefill.parked and prefill.scheduler.kv.pool.num_free_blocks == free
    with pytest.raises(KeyError, match="no parked KV for request 'pinned'"):
        prefill.pin_kv("pinned")
