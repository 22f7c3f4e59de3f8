"""Pipelined (async) scheduling gives the same tokens as synchronous stepping; its placeholders and
late stop checks never leak into outputs. On CPU the pipeline's bookkeeping is the same as on GPU."""

import pytest

from rayinfer.engine.types import PLACEHOLDER, SamplingParams


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from rayinfer.serve.chat import render_chat

    qs = ["What is the capital of France?", "Count from one to five.", "Name a fruit.", "Say hi."]
    return [render_chat(tokenizer, [{"role": "user", "content": q}]) for q in qs]


@pytest.fixture(scope="module")
def make(smollm2):
    def make(async_scheduling, **kw):
        return smollm2.engine(**{"num_kv_blocks": 128, "async_scheduling": async_scheduling, "max_num_seqs": 4, **kw})
    return make


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graph-padding"])
def test_async_equals_sync(prompts, make, graphs, monkeypatch):
    """With the decode graphs' buffers (run eagerly on CPU), a pipelined step whose every input is a
    placeholder gathers them straight into the graph's input buffer: the tokens stay the same."""
    from rayinfer.engine.cuda_graph import DecodeGraphs

    gathered = []
    run = DecodeGraphs.run

    def spy(self, *args, gather_ids=None, **kw):
        gathered.append(gather_ids is not None)
        return run(self, *args, gather_ids=gather_ids, **kw)

    monkeypatch.setattr(DecodeGraphs, "run", spy)
    params = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.8, seed=5, max_tokens=10),
              SamplingParams(temperature=0.0, max_tokens=3), SamplingParams(temperature=0.0, max_tokens=12, stop=["!"])]
    sync = make(False, debug_eager_graphs=graphs).generate(prompts, params)
    assert not any(gathered)  # synchronous steps feed real token ids
    engine = make(True, debug_eager_graphs=graphs)
    pipe = engine.generate(prompts, params)
    assert any(gathered) == graphs
    for a, b in zip(sync, pipe):
        assert a.output_token_ids == b.output_token_ids and a.text == b.text
        assert a.finish_reason == b.finish_reason
        assert PLACEHOLDER not in b.output_token_ids
    assert len(pipe[2].output_token_ids) == 3  # max_tokens honoured despite the one-step-late check
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]  # nothing leaked by dropped extra tokens


def test_async_with_host_state_drains(prompts, make):
    params = SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3, min_tokens=4)
    a = make(False).generate(prompts[:2], params)
    b = make(True).generate(prompts[:2], params)
    assert [c.output_token_ids for c in a] == [c.output_token_ids for c in b]


def test_async_under_preemption(prompts, make):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    blocks = sum(-(-len(p) // 16) for p in prompts)
    a = make(False).generate(prompts, params)
    engine = make(True, num_kv_blocks=blocks, enable_prefix_caching=False)
    b = engine.generate(prompts, params)
    assert engine.stats()["num_preemptions"] > 0
    assert [c.output_token_ids for c in a] == [c.output_token_ids for c in b]
