"""The benchmark: roofline arithmetic by hand, workloads, per-request timing, the HF twin, the tiny scenario."""

import json
from pathlib import Path

import pytest
import torch

from rayinfer.jobs import benchlib as bl
from rayinfer.jobs import roofline as rl
from rayinfer.model.shapes import shape_config

ROOT = Path(__file__).resolve().parents[2]
CEIL = {"bandwidth_Bps": 1e9, "matmul_flops": 1e12}


@pytest.fixture(scope="module")
def tiny_cost():
    # llama-tiny: V=49152, H=64, I=128, L=2, 4 query / 2 KV heads of 16, tied embeddings; float32
    return rl.cost_model_for(shape_config("llama-tiny"), 4)


def test_dense_cost_of_llama_tiny_by_hand(tiny_cost):
    c = tiny_cost
    # per layer: q 64*64 + k, v 2*64*32 + o 64*64 + gate, up, down 3*64*128 = 36864 (+ 2 norms of 64)
    assert c.layer_matmul_params == 4096 + 4096 + 4096 + 24576 == 36864
    assert c.num_params == 49152 * 64 + 2 * (36864 + 128) + 64 == 3219776
    assert c.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 == 512  # layers * (k, v) * heads * dim * bytes
    # weights once (layers, final norm, tied LM head) + 3 embedding rows, 4 bytes each
    assert c.weight_bytes_read(3) == (73984 + 64 + 3145728 + 3 * 64) * 4 == 12879872

    num_bytes, flops = rl.decode_step_cost(c, batch=3, context=100)
    assert num_bytes == 12879872 + 300 * 512
    # matmuls 2*L*36864*B + attention 4*L*heads*dim*(B*C) + LM head 2*H*V*B
    assert flops == 2 * 2 * 36864 * 3 + 4 * 2 * 4 * 16 * 300 + 2 * 64 * 49152 * 3 == 19470336
    num_bytes, flops = rl.prefill_cost(c, 10)  # causal: 10*11/2 = 55 (query, key) pairs, one logits row
    assert flops == 2 * 2 * 36864 * 10 + 4 * 2 * 4 * 16 * 55 + 2 * 64 * 49152 == 7794176
    assert num_bytes == (73984 + 64 + 3145728 + 640) * 4 + 10 * 512

    r = rl.roofline(13033472, 19470336, CEIL)
    assert r["memory_s"] == pytest.approx(13033472 / 1e9) and r["compute_s"] == pytest.approx(19470336 / 1e12)
    assert r["bound"] == "memory" and r["roofline_s"] == r["memory_s"]


def test_offline_roofline_by_hand(tiny_cost):
    # one request, 3 prompt + 3 output tokens, one at a time: 5 tokens computed (15 causal pairs, 3 logits
    # rows); 2 decode steps with contexts 4 and 5, each reading the weights once
    r = rl.offline_roofline(tiny_cost, [3], [3], max_num_seqs=1, ceilings=CEIL)
    assert r["flops"] == 2 * 2 * 36864 * 5 + 4 * 2 * 4 * 16 * 15 + 2 * 64 * 49152 * 3 == 19619328
    assert r["num_decode_steps"] == 2
    assert r["bytes"] == 2 * tiny_cost.weight_bytes_read(1) + (4 + 5) * 512 == 2 * 12879360 + 4608
    assert r["output_tok_s"] == pytest.approx(3 / r["roofline_s"])
    # batching 4 requests: still 2 steps of weights, 4x the KV
    r4 = rl.offline_roofline(tiny_cost, [3] * 4, [3] * 4, max_num_seqs=4, ceilings=CEIL)
    assert r4["num_decode_steps"] == 2 and r4["bytes"] == 2 * tiny_cost.weight_bytes_read(4) + 4 * 9 * 512
    # room for 8 at a time, but each request still decodes its tokens one step after another
    r2 = rl.offline_roofline(tiny_cost, [3, 3], [3, 3], max_num_seqs=8, ceilings=CEIL)
    assert r2["num_decode_steps"] == 2 and r2["bytes"] == 2 * tiny_cost.weight_bytes_read(2) + 2 * 9 * 512
    # 5 requests of 2 decode tokens, 2 at a time: 10 tokens need 5 steps of 2
    assert rl.offline_roofline(tiny_cost, [3] * 5, [3] * 5, max_num_seqs=2, ceilings=CEIL)["num_decode_steps"] == 5


def test_llama_3_8b_parameter_count():
    c = rl.cost_model_for(shape_config("llama-3-8b"), 2)
    assert c.num_params == 8_030_261_248  # Meta's published count
    assert c.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # 128 KiB per token in bf16


def test_cost_model_matches_the_built_model(tiny_cost):
    from rayinfer.model.loader import load_model

    model = load_model("llama-tiny", "float32", "cpu", "dummy")
    assert sum(p.numel() for p in model.parameters()) == tiny_cost.num_params


def test_unknown_architecture_is_named():
    cfg = shape_config("llama-tiny")
    cfg.architectures = ["NopeForCausalLM"]
    with pytest.raises(ValueError, match="NopeForCausalLM"):
        rl.cost_model_for(cfg, 2)


def test_workloads_are_seeded_and_in_range():
    a = bl.fixed_workload(3, 5, 7, vocab_size=50, seed=1)
    assert a == bl.fixed_workload(3, 5, 7, vocab_size=50, seed=1) != bl.fixed_workload(3, 5, 7, 50, seed=2)
    assert all(len(i.prompt_token_ids) == 5 and i.max_tokens == 7 for i in a)
    m = bl.mixed_workload(50, (2, 9), (1, 4), vocab_size=50, seed=0)
    assert {len(i.prompt_token_ids) for i in m} <= set(range(2, 10)) and {i.max_tokens for i in m} <= {1, 2, 3, 4}
    assert len({len(i.prompt_token_ids) for i in m}) > 3
    assert all(0 <= t < 50 for i in m for t in i.prompt_token_ids)


def test_decode_block_tables_alias_when_the_cache_is_short():
    tables, aliased = bl.decode_block_tables(batch=2, context=33, block_size=16, num_blocks=10)
    assert tables == [[0, 1, 2], [3, 4, 5]] and not aliased
    tables, aliased = bl.decode_block_tables(batch=3, context=48, block_size=16, num_blocks=7)
    assert tables == [[0, 1, 2], [3, 4, 5], [6, 0, 1]] and aliased


def test_percentile():
    assert bl.percentile([], 50) is None
    assert bl.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert bl.percentile([0.0, 10.0], 90) == pytest.approx(9.0)


class _FakeEngine:
    """One token per live request per step; the clock advances one second per step."""

    def __init__(self, clock):
        self.clock, self.live = clock, {}

    def add_request(self, rid, prompt, params):
        self.live[rid] = params.max_tokens

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        from rayinfer.engine.types import RequestOutput

        self.clock[0] += 1.0
        outs = []
        for rid in list(self.live)[:2]:  # at most two running requests, in arrival order
            self.live[rid] -= 1
            outs.append(RequestOutput(rid, new_token_ids=[1], finished=self.live[rid] == 0))
            if not self.live[rid]:
                del self.live[rid]
        return outs

    def stats(self):
        return {"num_preemptions": 0}


def test_run_offline_times_each_request_from_the_step_loop(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(bl.time, "perf_counter", lambda: clock[0])
    items = [bl.WorkItem([1, 2], 3), bl.WorkItem([1], 2), bl.WorkItem([5, 6, 7], 2)]
    run = bl.run_offline(_FakeEngine(clock), items)
    # steps 1-2: requests 0 and 1; step 3: 0 (last) and 2; step 4: 2 (last)
    t = run.timings
    assert [(x.ttft_s, x.latency_s, x.num_output_tokens) for x in t] == [(1, 3, 3), (1, 2, 2), (3, 4, 2)]
    assert [x.tpot_s for x in t] == [1.0, 1.0, 1.0]
    s = run.summary()
    assert s["num_output_tokens"] == 7 and s["num_prompt_tokens"] == 6 and run.num_steps == 4
    assert s["elapsed_s"] == 4 and s["output_tok_s"] == 7 / 4 and s["median_ttft_ms"] == 1000.0
    merged = bl.OfflineRun.merge([run, bl.OfflineRun(t[:1], 9.0, 2, {"num_preemptions": 1})])
    assert merged.elapsed_s == 9.0 and len(merged.timings) == 4 and merged.stats["num_preemptions"] == 1


def test_hf_twin_shares_weights_and_matches_logits():
    from rayinfer.kernels.attention_metadata import AttentionMetadata
    from rayinfer.model.loader import load_model

    model = load_model("llama-tiny", "float32", "cpu", "dummy", seed=3)
    hf = bl.hf_twin(model)
    ours = dict(model.named_parameters())
    assert hf.model.layers[1].mlp.down_proj.weight.data_ptr() == ours["model.layers.1.mlp.down_proj.weight"].data_ptr()
    assert hf.model.embed_tokens.weight.data_ptr() == ours["model.embed_tokens.weight"].data_ptr()
    ids = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    kv = torch.zeros(model.kv_cache_shape(2, 16))
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, torch.arange(12), kv, AttentionMetadata.build([12], [12], [[0]], 16)))
        theirs = hf(input_ids=ids[None]).logits[0].float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    r = bl.hf_generate_throughput(hf, [bl.WorkItem([3, 4, 5], 3), bl.WorkItem([6], 2)], batch_size=2)
    assert r["num_output_tokens"] == 5 and r["num_generated_tokens"] == 6 and r["output_tok_s"] > 0


def test_tiny_scenario_end_to_end(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from rayinfer.jobs import bench

    bench.register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        dcfg = compose("bench", overrides=["scenario=tiny", f"out_dir={tmp_path}", "offline.num_prompts=3",
                                           "git_rev=abc1234"])
    cfg = OmegaConf.to_object(dcfg)
    assert cfg.model.model == "llama-tiny" and cfg.engine.device == "cpu" and cfg.offline.num_prompts == 3

    result = bench.run(cfg)
    files = list(tmp_path.glob("bench-tiny-*.json"))
    assert len(files) == 1 and str(files[0]) == result["path"]
    saved = json.loads(files[0].read_text())
    for key in ("scenario", "command", "device", "torch", "git_rev", "git_dirty", "ceilings", "offline", "decode",
                "prefill", "hf", "config", "notes"):
        assert key in saved, key
    assert saved["scenario"] == "tiny" and saved["git_rev"] == "abc1234"
    assert set(saved["section_seconds"]) == {"ceilings", "load", "offline", "decode", "prefill", "hf"}
    assert saved["ceilings"]["bandwidth_Bps"] > 0 and saved["ceilings"]["matmul_flops"] > 0
    fixed, mixed = saved["offline"]["fixed"], saved["offline"]["mixed"]
    assert fixed["num_output_tokens"] == 3 * 6 and fixed["num_requests"] == 3
    assert 0 < fixed["roofline_fraction"] and fixed["median_tpot_ms"] > 0 and mixed["num_requests"] == 3
    assert [(d["batch"], d["context"]) for d in saved["decode"]] == [(1, 32), (4, 32), (1, 160), (4, 160)]
    assert [d["kv_aliased"] for d in saved["decode"]] == [False, False, False, True]  # 4 * 10 blocks > 32
    assert any("wrap around" in n for n in saved["notes"])
    assert all(d["roofline"]["roofline_s"] > 0 and d["step_s"] > 0 for d in saved["decode"])
    assert [(p["num_tokens"], p["num_chunks"]) for p in saved["prefill"]] == [(48, 1), (160, 3)]
    assert saved["hf"]["fixed"]["num_output_tokens"] == 3 * 6 and saved["hf"]["mixed"]["output_tok_s"] > 0
    assert saved["hf"]["fixed"]["engine_over_hf"] > 0
    for name in ("fixed", "mixed"):  # the tiny scenario's hf.batch_sizes=[2, 3]: every size, then the best
        hf = saved["hf"][name]
        rows = hf["by_batch_size"]
        assert sorted(rows) == ["2", "3"] and [rows[k]["batch_size"] for k in ("2", "3")] == [2, 3]
        assert all(r["num_requests"] == 3 and r["roofline"]["roofline_s"] > 0 for r in rows.values())
        best = max(rows, key=lambda k: rows[k]["output_tok_s"])
        assert hf["best_batch_size"] == int(best) and hf["output_tok_s"] == rows[best]["output_tok_s"]
        assert hf["engine_over_hf"] == pytest.approx(saved["offline"][name]["output_tok_s"] / hf["output_tok_s"])


def test_large_model_on_cpu_is_refused(tmp_path):
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.jobs import bench

    cfg = bench.BenchConfig(model=ModelConfig(model="llama-3-8b", dtype="bfloat16", load_format="dummy"),
                            engine=EngineConfig(device="cpu"), out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="scenario=tiny"):
        bench.run(cfg)
    with pytest.raises(ValueError, match="sections"):
        bench.BenchConfig(sections=["offline", "decoder"])
    # a revision Hydra read as a number (git_rev=19688e1 arrives as 196880.0) is refused, a real one kept
    with pytest.raises(ValueError, match="must be quoted"):
        bench.BenchConfig(git_rev="196880.0")
    assert bench.BenchConfig(git_rev="19688e1").git_rev == "19688e1"


def test_a_spec_section_that_cannot_run_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """A ``draft*`` method without spec.draft_model, an unknown method, a size that is not a positive integer, a
    bad ``RAYINFER_*`` value: refused up front (the job exits 2 with that message), not after an 8B model has
    loaded and as a failed section of a written result."""
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.engine import llm_engine
    from rayinfer.jobs import bench

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built before the spec section was checked")

    monkeypatch.setattr(llm_engine, "LLMEngine", no_engine)
    cases = [(dict(methods=["plain", "draft"]), "set spec.draft_model"),
             (dict(methods=["plain", "eagle"]), "unknown entries"),
             (dict(num_draft_tokens=0), "spec.num_draft_tokens must be a positive integer"),
             (dict(batches=[0]), "spec.batches must be"), (dict(batches=[]), "spec.batches must be"),
             (dict(output_len=0), "spec.output_len"), (dict(repeats=0), "spec.repeats")]
    for fields, match in cases:
        cfg = bench.BenchConfig(model=ModelConfig(model="llama-tiny", dtype="float32", load_format="dummy"),
                                engine=EngineConfig(device="cpu"), out_dir=str(tmp_path), sections=["spec"],
                                spec=bench.SpecBenchSpec(**fields), cpu_threads=1)
        with pytest.raises(ValueError, match=match):
            bench.run(cfg)
    # a bad environment variable of the engine's (read on CUDA, or inside an actor): before any model loads
    monkeypatch.setenv("RAYINFER_DRAFT_CATCH_UP_LEN", "-3")
    cfg = bench.BenchConfig(model=ModelConfig(model="llama-tiny", dtype="float32", load_format="dummy"),
                            engine=EngineConfig(device="cpu"), out_dir=str(tmp_path), sections=["spec"], cpu_threads=1)
    with pytest.raises(ValueError, match="RAYINFER_DRAFT_CATCH_UP_LEN must be a non-negative integer, got '-3'"):
        bench.run(cfg)
    assert not list(tmp_path.iterdir())  # no result written


def test_a_failing_section_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.jobs import bench

    def broken(*args, **kwargs):
        raise RuntimeError("kernel fell over")

    monkeypatch.setattr(bl, "time_prefill", broken)
    cfg = bench.BenchConfig(
        scenario="broken", model=ModelConfig(model="llama-tiny", dtype="float32", load_format="dummy"),
        engine=EngineConfig(device="cpu", num_kv_blocks=16), sections=["prefill", "decode"], out_dir=str(tmp_path),
        decode=bench.DecodeSpec(batches=[2], contexts=[20], warmup=0, iters=1), cpu_threads=1,
        ceilings=bench.CeilingSpec(copy_mib=1, gemm_n=32, iters=1))
    result = bench.run(cfg)
    saved = json.loads(Path(result["path"]).read_text())
    assert "kernel fell over" in saved["prefill"]["error"]
    assert saved["decode"][0]["step_s"] > 0 and "offline" not in saved and "hf" not in saved


def test_decode_timing_takes_the_graph_path_when_there_is_one():
    from rayinfer.kernels.attention_metadata import AttentionMetadata
    from rayinfer.model.loader import load_model

    model = load_model("llama-tiny", "float32", "cpu", "dummy")
    kv = torch.zeros(model.kv_cache_shape(8, 16))

    class FakeGraphs:  # engine/cuda_graph.py DecodeGraphs' interface, replayed eagerly
        max_model_len, calls = 64, 0

        def padded_size(self, n):
            return 4 if n <= 4 else None

        def run(self, ids, pos, slot_mapping, seq_lens, block_tables):
            FakeGraphs.calls += 1
            n = ids.shape[0]
            meta = AttentionMetadata(torch.arange(n + 1, dtype=torch.int32), seq_lens, block_tables, slot_mapping,
                                     16, [1] * n, seq_lens.tolist())
            return model(ids, pos, kv, meta)

    r = bl.time_decode_step(model, kv, 16, batch=2, context=40, warmup=0, iters=2, graphs=FakeGraphs())
    assert r["path"] == "cuda_graph" and r["step_s"] == r["graph_step_s"] > 0 and FakeGraphs.calls == 2
    assert r["eager_step_s"] > 0 and not r["kv_aliased"]
    r = bl.time_decode_step(model, kv, 16, batch=8, context=40, warmup=0, iters=1, graphs=FakeGraphs())
    assert r["path"] == "eager" and r["graph_step_s"] is None and r["kv_aliased"]  # 8 * 3 blocks > 8


def test_spec_section_rows_compare_speed_and_outputs_with_plain():
    """jobs/bench_spec.py on a tiny random Llama (CPU, float32): one row per method with its speedup over
    plain decoding, the speculative counters, and the share of outputs equal to plain's (all of them:
    greedy speculation never changes the output)."""
    import transformers

    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.jobs.bench_spec import SpecBenchSpec, run_spec_section
    from rayinfer.model.llama import LlamaForCausalLM
    from rayinfer.model.loader import load_tokenizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                   architectures=["LlamaForCausalLM"])
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    spec = SpecBenchSpec(batches=[2], output_len=6, num_kv_blocks=128, methods=["plain", "ngram", "self-draft",
                                                                                 "ngram-gate-plain"], repeats=2)
    lines = []
    rows = run_spec_section(spec, ModelConfig("tiny-llama", max_model_len=512),
                            EngineConfig(device="cpu", async_scheduling=False), model,
                            load_tokenizer("SmolLM2-135M-Instruct"), line=lines.append)
    assert [r["method"] for r in rows] == ["plain", "ngram", "self-draft", "ngram-gate-plain"] and len(lines) == 4
    assert rows[0]["speedup"] == 1.0 and all(r["fraction_outputs_equal_plain"] == 1.0 for r in rows)
    assert rows[2]["spec_num_drafts_accepted"] == rows[2]["spec_num_drafts_verified"] > 0  # drafting for itself
    assert all(r["num_output_tokens"] == 12 for r in rows)
    assert all(len(r["speedup_runs"]) == 2 and r["output_tok_s"] == pytest.approx(sum(r["output_tok_s_runs"]) / 2)
               for r in rows)  # two runs each: the median is their mean
    assert rows[3]["spec_num_drafts_proposed"] == 0 and "spec_gate_plain_s" in rows[3]  # the gate held plain


def test_spec_section_runs_a_separate_draft_model():
    """spec.draft_model: the ``draft*`` methods draft with that model (a built-in shape with dummy weights, as
    the llama-3-8b-spec scenario's Llama-3.2-1B); without it they are refused, naming the setting."""
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.jobs.bench_spec import SpecBenchSpec, run_spec_section
    from rayinfer.model.loader import load_model, load_tokenizer

    model = load_model("llama-tiny", torch.float32, torch.device("cpu"), "dummy")
    tokenizer = load_tokenizer("SmolLM2-135M-Instruct")
    model_config = ModelConfig("llama-tiny", dtype="float32", load_format="dummy", max_model_len=512)
    spec = SpecBenchSpec(batches=[2], output_len=5, num_kv_blocks=64, methods=["plain", "draft", "draft-confidence"])
    with pytest.raises(ValueError, match="spec.draft_model"):
        run_spec_section(spec, model_config, EngineConfig(device="cpu", async_scheduling=False), model, tokenizer)
    spec.draft_model = "smollm2-135m"  # another model over the same vocab: its drafts are mostly rejected
    rows = run_spec_section(spec, model_config, EngineConfig(device="cpu", async_scheduling=False), model, tokenizer,
                            line=lambda _: None)
    assert [r["method"] for r in rows] == ["plain", "draft", "draft-confidence"]
    assert all(r["fraction_outputs_equal_plain"] == 1.0 and r["num_output_tokens"] == 10 for r in rows)
    draft = rows[1]
    assert draft["spec_num_drafts_verified"] > 0 and draft["spec_num_drafts_accepted"] < draft["spec_num_drafts_verified"]


def _earlier_result(path, model, output_tok_s):
    path.write_text(json.dumps({"config": {"model": {"model": model}}, "git_rev": "abc1234",
                                "offline": {"fixed": {"output_tok_s": output_tok_s}}}))
    return str(path)


def test_hf_batch_sizes_record_oom_and_compare_with_an_earlier_engine_run(tmp_path, monkeypatch):
    """hf.batch_sizes: every size runs (one full batch each with hf.num_prompts=null), a size that runs out of
    memory is "oom" and the next one still runs, the best measured size is reported; with no offline section,
    engine_over_hf uses hf.engine_result's offline figure."""
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.jobs import bench
    from rayinfer.jobs import hf_baseline as hb

    real = hb.hf_generate_throughput
    tried = []

    def fits_up_to_2(hf, items, batch_size):
        tried.append(batch_size)
        if batch_size > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(hf, items, batch_size)

    monkeypatch.setattr(hb, "hf_generate_throughput", fits_up_to_2)

    def config(engine_result):
        return bench.BenchConfig(
            scenario="hf-sizes", model=ModelConfig(model="llama-tiny", dtype="float32", load_format="dummy"),
            engine=EngineConfig(device="cpu", num_kv_blocks=16), sections=["hf"], out_dir=str(tmp_path),
            offline=bench.OfflineSpec(num_prompts=4, input_len=8, output_len=3),
            hf=bench.HFSpec(num_prompts=None, batch_sizes=[1, 4, 2], engine_result=engine_result), cpu_threads=1,
            ceilings=bench.CeilingSpec(copy_mib=1, gemm_n=32, iters=1))

    result = bench.run(config(_earlier_result(tmp_path / "earlier.json", "llama-tiny", 123.0)))
    hf = json.loads(Path(result["path"]).read_text())["hf"]["fixed"]
    assert tried == [1, 4, 2] and hf["by_batch_size"]["4"] == "oom"
    rows = {k: v for k, v in hf["by_batch_size"].items() if v != "oom"}
    assert {k: v["num_requests"] for k, v in rows.items()} == {"1": 1, "2": 2}  # one full batch per size
    best = max(rows, key=lambda k: rows[k]["output_tok_s"])
    assert hf["best_batch_size"] == int(best) and hf["engine_over_hf"] == pytest.approx(123.0 / hf["output_tok_s"])
    assert rows["1"]["engine_over_hf"] == pytest.approx(123.0 / rows["1"]["output_tok_s"])
    assert any("earlier.json" in n for n in result["notes"])
    with pytest.raises(ValueError, match="of model 'smollm2-135m'"):  # another model's run is refused up front
        bench.run(config(_earlier_result(tmp_path / "other.json", "smollm2-135m", 1.0)))
    with pytest.raises(ValueError, match="hf.batch_sizes"):
        bench.HFSpec(batch_sizes=[])
    assert bench.HFSpec(batch_size=8).batch_sizes == [8]  # the former single size still works


def test_qwen3_moe_runs_through_the_bench_sections(tmp_path):
    """The Qwen3-MoE cost model (registered on importing jobs/bench.py) prices the offline, decode and HF
    sections of a tiny Qwen3-MoE on CPU; the HF twin runs at two batch sizes."""
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.jobs import bench
    from rayinfer.jobs.moe_cost import Qwen3MoECost

    cfg = bench.BenchConfig(
        scenario="qwen3-tiny", model=ModelConfig(model="qwen3-moe-tiny", dtype="float32", load_format="dummy"),
        engine=EngineConfig(device="cpu", num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=64),
        sections=["offline", "decode", "hf"], out_dir=str(tmp_path), cpu_threads=1,
        offline=bench.OfflineSpec(num_prompts=3, input_len=10, output_len=4, workloads=["fixed"]),
        decode=bench.DecodeSpec(batches=[1, 2], contexts=[20], warmup=0, iters=1),
        hf=bench.HFSpec(num_prompts=3, batch_sizes=[1, 3]), ceilings=bench.CeilingSpec(copy_mib=1, gemm_n=32, iters=1))
    saved = json.loads(Path(bench.run(cfg)["path"]).read_text())
    cost = Qwen3MoECost.from_config(shape_config("qwen3-moe-tiny"), 4)
    assert saved["num_params"] == cost.num_params
    assert saved["offline"]["fixed"]["num_output_tokens"] == 12 and saved["offline"]["fixed"]["roofline_fraction"] > 0
    for row in saved["decode"]:
        assert row["roofline"]["bytes"] == rl.decode_step_cost(cost, row["batch"], row["context"])[0]
    assert sorted(saved["hf"]["fixed"]["by_batch_size"]) == ["1", "3"] and saved["hf"]["fixed"]["engine_over_hf"] > 0
