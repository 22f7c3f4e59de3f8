"""A decode graph's step moved on the device (``DecodeGraphs.run(advance=...)``): positions, context lengths and
slots computed from the host's base and a per-request device count give the step the host would have built."""

import torch

from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.cuda_graph import DecodeGraphs
from rayinfer.engine.llm_engine import LLMEngine


def test_advance_equals_host_built_step():
    engine = LLMEngine(ModelConfig("llama-tiny", load_format="dummy"),
                       EngineConfig(device="cpu", num_kv_blocks=32, enforce_eager=True))
    runner = engine.runner
    B = runner.block_size
    graphs = DecodeGraphs(runner.model, runner.kv_cache, B, 8 * B, 4, max_query_len=3, eager=True)
    gen = torch.Generator().manual_seed(0)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=gen).to(runner.kv_cache.dtype))
    start = runner.kv_cache.clone()
    tables = torch.tensor([[3, 7, 1, 9], [4, 2, 0, 0], [8, 5, 6, 0]], dtype=torch.int32)
    q = 3  # a verification-sized step: each request's last token and two more
    base = torch.tensor([B + 2, 5, 2 * B - 4], dtype=torch.int32)  # each context before the move
    advance = torch.tensor([2, 0, 3], dtype=torch.int32)
    ids = torch.randint(0, engine.vocab_size, (3 * q,), generator=gen)
    rows = torch.arange(q).repeat(3)
    req = torch.arange(3).repeat_interleave(q)
    positions = base.long().repeat_interleave(q) - q + rows

    moved = positions + advance.long().repeat_interleave(q)
    slots = tables[req, moved // B].long() * B + moved % B
    want = graphs.run(ids, moved, slots, base + advance, tables, query_len=q).clone()
    want_kv = runner.kv_cache.clone()

    runner.kv_cache.copy_(start)
    got = graphs.run(ids, positions, None, base, tables, query_len=q, advance=advance).clone()
    assert graphs.seq_lens[:3].tolist() == (base + advance).tolist()
    assert graphs.slot_mapping[: 3 * q].tolist() == slots.tolist()
    assert torch.equal(got, want)
    assert torch.equal(runner.kv_cache, want_kv) and not torch.equal(want_kv, start)
