"""The engine on the GPU: CUDA graphs and pipelined scheduling keep SmolLM2's greedy outputs equal to the
CPU engine's (float32), and launching a step never synchronizes with the device."""

import pytest
import torch

from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.sync_guard import no_host_sync
from rayinfer.engine.types import SamplingParams

pytestmark = pytest.mark.gpu

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three colors.",
             "What is 12 times 12?", "Explain gravity in one sentence."]


def run(device, **kw):
    from rayinfer.serve.chat import render_chat

    engine = LLMEngine(ModelConfig(dtype="float32"), EngineConfig(device=device, num_kv_blocks=256, **kw))
    prompts = [render_chat(engine.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    prompts.append(engine.tokenizer.encode("The history of the Roman empire " * 40))
    return engine, engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))


@pytest.fixture(scope="module")
def cpu_outputs():
    return [c.output_token_ids for c in run("cpu")[1]]


@pytest.mark.parametrize("kw", [dict(), dict(enforce_eager=True, async_scheduling=False)],
                         ids=["graphs+async", "eager+sync"])
def test_gpu_greedy_equals_cpu(cpu_outputs, kw):
    engine, out = run("cuda", debug_sync_guard=True, **kw)
    same = sum(c.output_token_ids == ref for c, ref in zip(out, cpu_outputs))
    # float32 on both; a difference is tolerated only as a near-tie flip late in a sequence
    assert same >= len(out) - 1, [(c.output_token_ids, ref) for c, ref in zip(out, cpu_outputs)]
    for c, ref in zip(out, cpu_outputs):
        assert c.output_token_ids[:8] == ref[:8]


def test_sync_guard_catches_a_hidden_sync():
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError):
        with no_host_sync():
            x.sum().item()
    with no_host_sync():
        (x * 2).add_(1)  # pure device work passes


def test_bf16_graphs_run():
    engine = LLMEngine(ModelConfig(dtype="bfloat16"), EngineConfig(device="cuda", num_kv_blocks=256,
                                                                   debug_sync_guard=True))
    out = engine.generate([[1, 2, 3, 4]] * 3, SamplingParams(temperature=0.7, seed=1, max_tokens=16, ignore_eos=True))
    assert all(len(c.output_token_ids) == 16 for c in out)
    assert out[0].output_token_ids == out[1].output_token_ids  # same seed, same prompt


@pytest.mark.parametrize("spec", [dict(method="ngram"), dict(method="draft_model", num_draft_tokens=3),
                                  dict(method="ngram", schedule="confidence"),
                                  dict(method="draft_model", num_draft_tokens=3, schedule="confidence")],
                         ids=["ngram", "self-draft", "ngram-confidence", "self-draft-confidence"])
def test_gpu_speculative_greedy_equals_plain(spec):
    """Speculative steps on the GPU (verify steps eager, plain decode steps through the CUDA graphs, steps
    drained; a self-drafting confidence engine chains its verification steps and turns to plain steps when its
    gate says so) give the plain GPU engine's greedy tokens, and seeded sampling its seeded tokens."""
    from rayinfer.engine.config import SpeculativeConfig

    _, plain = run("cuda")
    engine, out = run("cuda", debug_sync_guard=True, speculative=SpeculativeConfig(**spec))
    same = sum(c.output_token_ids == p.output_token_ids for c, p in zip(out, plain))
    assert same >= len(out) - 1, [(c.output_token_ids, p.output_token_ids) for c, p in zip(out, plain)]
    stats = engine.stats()
    assert stats["spec_num_drafts_accepted"] > 0
    if spec["method"] == "draft_model":
        assert stats["spec_num_drafts_accepted"] >= 0.95 * stats["spec_num_drafts_verified"]
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    prompts = [c.prompt_token_ids for c in plain]
    a = engine.generate(prompts, seeded)
    b = LLMEngine(ModelConfig(dtype="float32"), EngineConfig(device="cuda", num_kv_blocks=256)).generate(prompts, seeded)
    assert sum(x.output_token_ids == y.output_token_ids for x, y in zip(a, b)) >= len(a) - 1


@pytest.mark.parametrize("model", ["deepseek-v3-tiny", "qwen3-moe-tiny"])
def test_moe_graphs_and_pipelining_equal_eager_sync(model):
    """A MoE model (routing, alignment, grouped GEMMs; DeepSeek's MLA and fused shared experts) under CUDA
    graphs and pipelined scheduling, with the sync guard on, gives its eager synchronous run's greedy
    tokens (float32, dummy weights; batches of 1 to 12 requests, so graphs of several sizes replay)."""
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(5 + 3 * i)] for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def generate(**kw):
        engine = LLMEngine(ModelConfig(model, dtype="float32", load_format="dummy"),
                           EngineConfig(device="cuda", num_kv_blocks=256, **kw))
        return [c.output_token_ids for c in engine.generate(prompts[:1], params) + engine.generate(prompts, params)]

    eager = generate(enforce_eager=True, async_scheduling=False)
    fast = generate(debug_sync_guard=True)
    same = sum(a == b for a, b in zip(fast, eager))
    assert same >= len(eager) - 1, [(a, b) for a, b in zip(fast, eager) if a != b]


def test_side_stream_copies_and_fused_graph_inputs_keep_tokens(monkeypatch):
    """The step's upload and download on copy streams of their own (RAYINFER_SIDE_STREAM_COPIES) and the
    graph's inputs written in one launch (cuda_graph.FUSED_INPUTS), both off by default, give the greedy tokens
    of an engine with both off (copies on the compute stream, inputs by torch ops), token for token, with the
    sync guard on: same kernels, only the copies move (bf16, dummy weights, batches of 1 to 12 requests under
    CUDA graphs and pipelined scheduling)."""
    from rayinfer.engine import cuda_graph

    prompts = [[(11 * i + j) % 1000 + 3 for j in range(4 + 5 * i)] for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def generate(on: int):
        monkeypatch.setenv("RAYINFER_SIDE_STREAM_COPIES", str(on))
        monkeypatch.setattr(cuda_graph, "FUSED_INPUTS", on)
        engine = LLMEngine(ModelConfig("deepseek-v3-tiny", dtype="bfloat16", load_format="dummy"),
                           EngineConfig(device="cuda", num_kv_blocks=256, debug_sync_guard=True))
        assert (engine.runner.copy_streams is not None) == bool(on)
        return [c.output_token_ids for c in engine.generate(prompts[:1], params) + engine.generate(prompts, params)]

    plain = generate(0)
    moved = generate(1)
    assert moved == plain
