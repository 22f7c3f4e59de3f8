"""jobs/bench_moe.py and jobs/moe_cost.py: the tiny CPU runs of both MoE architectures write complete JSON; the
full shapes are DeepSeek-V2-Lite's and Qwen3-30B-A3B's size; the cost models count the models by hand; the MoE
scenarios of jobs/bench.py compose."""

import json
from pathlib import Path

import pytest
import torch

from rayinfer.jobs.bench_moe import TINY, V2_LITE_V3_ARCH, main, param_counts


def test_tiny_run_writes_results(tmp_path, monkeypatch):
    """The tiny run's JSON, and the file it leaves after each case (``complete`` False until the end), so that a
    run cut short keeps what it measured."""
    from rayinfer.jobs import bench_moe

    out = tmp_path / "moe.json"
    threads = torch.get_num_threads()
    written = []  # (complete, decode rows, fused-MoE rows) of each write, as read back from the file
    write = bench_moe._write_result

    def recording(path, result):
        write(path, result)
        data = json.loads(Path(path).read_text())
        written.append((data["complete"], len(data["decode"]), len(data["fused_moe"])))

    monkeypatch.setattr(bench_moe, "_write_result", recording)
    main(["--tiny", "--device", "cpu", "--reps", "1", "--out", str(out)])
    assert torch.get_num_threads() == threads
    assert written[0] == (False, 1, 0) and written[-1][0] and not any(c for c, _, _ in written[:-1])
    assert [d for _, d, _ in written] == sorted(d for _, d, _ in written) and len(written) > 3
    data = json.loads(out.read_text())
    assert data["complete"] and not list(tmp_path.glob("*.tmp"))
    assert data["command"] == f"python jobs/bench_moe.py --tiny --device cpu --reps 1 --out {out}"
    assert data["device"].startswith("cpu") and "git_rev" in data and data["dtype"] == "torch.bfloat16"
    assert data["ceilings"]["copy_GBps"] > 0 and data["ceilings"]["matmul_TFLOPs"] > 0
    assert [r["batch"] for r in data["decode"]] == TINY["batches"]
    assert [r["query_len"] for r in data["prefill"]] == TINY["prefill"]
    moe_layers, experts = data["params"]["num_moe_layers"], data["shape"]["n_routed_experts"]
    for row in data["decode"] + data["prefill"]:
        assert row["ms"] > 0 and 0 < row["roofline_ms"] == max(row["roofline_mem_ms"], row["roofline_compute_ms"])
        assert 1 <= row["routed_experts_read"] <= moe_layers * experts
    assert data["decode"][0]["routed_experts_read"] <= moe_layers * data["shape"]["num_experts_per_tok"]
    # routed experts alone, with the shared expert fused, and fp8 block weights with it
    assert [(r["num_shared"], r["weights"], r["num_tokens"]) for r in data["fused_moe"]] == [
        (s, w, n) for s, w in [(0, "bfloat16"), (1, "bfloat16"), (1, "fp8 block 128x128")] for n in TINY["moe_tokens"]]
    assert all(r["kernel"] == "torch fallback" and r["max_abs_err_vs_ref"] < 1e-2 for r in data["fused_moe"])
    assert data["prefill_profile"] == []  # only with --profile-prefill


def test_prefill_profile_lists_the_forward_ops(tmp_path):
    """--profile-prefill: each prefill case's ops by time, the MoE layer's expert GEMMs among them."""
    out = tmp_path / "moe.json"
    main(["--tiny", "--device", "cpu", "--reps", "1", "--batches", "1", "--moe-tokens", "1", "--profile-prefill",
          "--out", str(out)])
    data = json.loads(out.read_text())
    (prof,) = data["prefill_profile"]
    assert prof["num_tokens"] == TINY["prefill"][0] and prof["kernel_ms_per_step"] > 0
    times = [k["ms_per_step"] for k in prof["kernels"]]
    assert times == sorted(times, reverse=True) and all(k["calls_per_step"] >= 1 for k in prof["kernels"])
    assert any("linear" in k["name"] or "mm" in k["name"] for k in prof["kernels"])


def test_v2_lite_shape_has_v2_lite_size():
    import transformers

    from rayinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
    from rayinfer.model.loader import _params_on_meta

    with _params_on_meta():  # no memory: parameters on the meta device
        model = DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**V2_LITE_V3_ARCH))
    c = param_counts(model)
    assert c["num_moe_layers"] == 26 and c["per_expert"] == 3 * 2048 * 1408
    total = c["dense"] + c["embed"] + c["lm_head"] + c["num_moe_layers"] * 64 * c["per_expert"]
    assert round(total / 1e9, 1) == 15.7  # DeepSeek-V2-Lite: 15.7B parameters


def test_moe_cost_model_counts_the_model_by_hand():
    """MoECost's parameter count equals the built model's; bytes and FLOPs follow the formulas."""
    import transformers

    from rayinfer.jobs.bench_moe import TINY_V3_ARCH, MoECost
    from rayinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
    from rayinfer.model.loader import _params_on_meta

    for shape in (TINY_V3_ARCH, V2_LITE_V3_ARCH, dict(TINY_V3_ARCH, q_lora_rank=24)):
        config = transformers.DeepseekV3Config(**shape)
        with _params_on_meta():
            model = DeepseekV3ForCausalLM(config)
        cost = MoECost.from_config(config, 2)
        assert cost.num_params == sum(p.numel() for p in model.parameters()), shape
    cost = MoECost.from_config(transformers.DeepseekV3Config(**TINY_V3_ARCH), 2)
    assert cost.experts_touched(1) == 2 and 7.9 < cost.experts_touched(1000) <= 8
    h, v = 64, 1024
    one = cost.dense_params + v * h + h + 2 * 2 * cost.expert_params  # 2 MoE layers x top-2
    assert cost.weight_bytes_read(1) == 2 * one
    assert cost.kv_bytes_per_token == 3 * (32 + 16) * 2
    active = cost.dense_params + 2 * 2 * cost.expert_params
    assert cost.flops(10, 55, 1) == 2 * active * 10 + 2 * 3 * 4 * (16 + 16 + 16) * 55 + 2 * h * v


def test_plugs_into_jobs_bench(tmp_path):
    roofline = pytest.importorskip("rayinfer.jobs.roofline")
    benchlib = pytest.importorskip("rayinfer.jobs.benchlib")
    from rayinfer.jobs.bench_moe import MoECost, register_bench_plugins
    from rayinfer.model.loader import load_config

    register_bench_plugins(tmp_path / "v2-lite")
    scenario = benchlib.SCENARIOS["deepseek-v2-lite"]
    config = load_config(scenario.overrides["model"]["model"])
    cost = roofline.cost_model_for(config, 2)
    assert isinstance(cost, MoECost) and round(cost.num_params / 1e9, 1) == 15.7


def test_qwen3_tiny_run_counts_gqa_kv_and_the_experts_it_read(tmp_path):
    """--model qwen3-30b-a3b --tiny: decode rows at every --context x --batches, bytes with GQA's K and V, the
    fused MoE and routing rows at Qwen3's expert shape (no shared expert, softmax top-k)."""
    from rayinfer.jobs.bench_moe import TINY_QWEN3, Qwen3MoECost, _config

    out = tmp_path / "moe.json"
    main(["--model", "qwen3-30b-a3b", "--tiny", "--device", "cpu", "--reps", "1", "--context", "16,40",
          "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["architecture"] == "Qwen3MoeForCausalLM" and data["shape"]["num_experts"] == 8
    assert [(r["context"], r["batch"]) for r in data["decode"]] == [(16, 1), (16, 4), (40, 1), (40, 4)]
    p = data["params"]
    cost = Qwen3MoECost.from_config(_config(TINY_QWEN3, "qwen3_moe"), 2)  # two independent parameter counts
    assert p["dense"] == cost.dense_params and p["per_expert"] == 3 * 64 * 32 and p["num_moe_layers"] == 3
    kv_per_token = 3 * 2 * 2 * 16  # layers * (K, V) * KV heads * head_dim
    for r in data["decode"]:
        seq, b = r["context"] + 1, r["batch"]
        assert r["bytes"] == 2 * (p["dense"] + p["lm_head"] + r["routed_experts_read"] * p["per_expert"]
                                  + b * 64 + b * seq * kv_per_token)
        active = p["dense"] + 3 * 2 * p["per_expert"]
        assert r["flops"] == 2 * active * b + 2 * p["lm_head"] * b + 4 * 3 * 4 * 16 * b * seq
    assert all(r["routed_experts_read"] == 3 * 2 for r in data["decode"] if r["batch"] == 1)  # top-2, 3 layers
    assert all(2 * 3 <= r["routed_experts_read"] <= 3 * 8 for r in data["decode"])
    assert [r["query_len"] for r in data["prefill"]] == TINY["prefill"]
    assert [(r["num_shared"], r["weights"], r["num_experts"], r["top_k"]) for r in data["fused_moe"]] == [
        (0, w, 8, 2) for w in ["bfloat16", "fp8 block 128x128"] for _ in TINY["moe_tokens"]]
    assert all(r["max_abs_err_vs_ref"] < 1e-2 for r in data["fused_moe"])
    assert {r["router"] for r in data["routing_align"]} == {"softmax_topk"}


def test_qwen3_cost_model_counts_the_model_by_hand():
    import transformers

    from rayinfer.jobs.bench_moe import QWEN3_30B_A3B, TINY_QWEN3, Qwen3MoECost
    from rayinfer.model.loader import _params_on_meta
    from rayinfer.model.qwen3_moe import Qwen3MoeForCausalLM

    variants = (TINY_QWEN3, QWEN3_30B_A3B, dict(TINY_QWEN3, mlp_only_layers=[0]),
                dict(TINY_QWEN3, decoder_sparse_step=3), dict(TINY_QWEN3, attention_bias=True),
                dict(TINY_QWEN3, tie_word_embeddings=True))
    for shape in variants:
        config = transformers.Qwen3MoeConfig(**shape)
        with _params_on_meta():
            model = Qwen3MoeForCausalLM(config)
        assert Qwen3MoECost.from_config(config, 2).num_params == sum(p.numel() for p in model.parameters()), shape
    assert round(Qwen3MoECost.from_config(transformers.Qwen3MoeConfig(**QWEN3_30B_A3B), 2).num_params / 1e9, 1) == 30.5
    cost = Qwen3MoECost.from_config(transformers.Qwen3MoeConfig(**TINY_QWEN3), 2)
    # per layer: q, o 2*64*64 + k, v 2*64*32 + q/k norms 2*16 + 2 norms of 64; routers 8*64; final norm 64
    assert cost.dense_params == 3 * (8192 + 4096 + 32 + 128) + 3 * 8 * 64 + 64 == 38944
    assert cost.experts_touched(1) == 2 and 7.9 < cost.experts_touched(1000) <= 8
    assert cost.weight_bytes_read(1) == 2 * (38944 + 1024 * 64 + 64 + 3 * 2 * 6144)
    assert cost.kv_bytes_per_token == 3 * 2 * 2 * 16 * 2
    assert cost.flops(10, 55, 1) == 2 * (38944 + 3 * 2 * 6144) * 10 + 4 * 3 * 4 * 16 * 55 + 2 * 64 * 1024
    from rayinfer.jobs import roofline

    assert roofline.cost_model_for(transformers.Qwen3MoeConfig(**TINY_QWEN3), 2, 1).kv_bytes_per_token == 3 * 2 * 2 * 16


def test_moe_scenarios_of_jobs_bench(tmp_path):
    """``jobs/bench.py scenario=qwen3-30b-a3b`` / ``scenario=deepseek-v2-lite`` compose with the README's
    overrides; their models are the built-in shapes and cost what the published models do."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from rayinfer.jobs import bench, roofline
    from rayinfer.jobs.moe_cost import MoECost, Qwen3MoECost
    from rayinfer.model.loader import load_config

    root = Path(__file__).resolve().parents[2]
    bench.register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(root / "conf")):
        for name, cls, billions in (("qwen3-30b-a3b", Qwen3MoECost, 30.5), ("deepseek-v2-lite", MoECost, 15.7)):
            cfg = OmegaConf.to_object(compose("bench", overrides=[
                f"scenario={name}", "offline.num_prompts=1000", "hf.batch_sizes=[32,64,128,256]",
                "hf.num_prompts=null"]))
            assert cfg.model.load_format == "dummy" and cfg.model.dtype == "bfloat16"
            assert cfg.offline.num_prompts == 1000
            assert (cfg.engine.max_num_seqs, cfg.engine.max_num_batched_tokens) == (256, 8192)
            assert cfg.hf.batch_sizes == [32, 64, 128, 256] and cfg.hf.num_prompts is None
            assert cfg.decode.batches == [1, 32, 128] and cfg.decode.contexts == [1024, 4096]
            cost = roofline.cost_model_for(load_config(cfg.model.model), 2)
            assert isinstance(cost, cls) and round(cost.num_params / 1e9, 1) == billions
        old = OmegaConf.to_object(compose("bench", overrides=["scenario=tiny", "hf.batch_size=8"]))
        assert old.hf.batch_sizes == [8]


def test_ab_variants_run_interleaved_and_restore_the_settings(tmp_path, monkeypatch):
    """--ab times each variant in this process, round by round; a variant's settings hold only inside it."""
    import os
    from types import SimpleNamespace

    from rayinfer.jobs.bench_moe import ab_variant
    from rayinfer.kernels import _triton_utils

    monkeypatch.delenv("RAYINFER_PDL", raising=False)
    monkeypatch.delenv("RAYINFER_ONE_ROW_FUSION", raising=False)
    model = SimpleNamespace(one_row_fusion=True)
    with ab_variant(model, "no-pdl"):
        assert os.environ["RAYINFER_PDL"] == "0" and model.one_row_fusion
    with ab_variant(model, "no-one-row"):
        assert not model.one_row_fusion
    assert "RAYINFER_PDL" not in os.environ and model.one_row_fusion
    from rayinfer.kernels import mla_attention

    default_splits = mla_attention._MAX_SPLITS
    with ab_variant(model, "mla-splits-8"):  # a module attribute the kernel reads at each launch
        assert mla_attention._MAX_SPLITS == 8
        assert mla_attention.choose_num_splits(1, 4096, 132) == 8
    assert mla_attention._MAX_SPLITS == default_splits
    from rayinfer.kernels import fused_moe

    with ab_variant(model, "no-direct"), ab_variant(model, "fp32-slots"):
        assert fused_moe.ONE_TOKEN_DIRECT == 0 and fused_moe.SLOTS_IN_HIDDEN_DTYPE == 0
    assert fused_moe.ONE_TOKEN_DIRECT == 1 and fused_moe.SLOTS_IN_HIDDEN_DTYPE == 1
    assert _triton_utils._pdl_supported.cache_info().currsize == 0  # re-probed after a variant
    out = tmp_path / "ab.json"
    variants = ["default", "no-pdl", "no-one-row"]
    main(["--tiny", "--device", "cpu", "--reps", "1", "--batches", "1", "--prefill", "8", "--moe-tokens", "1",
          "--ab", ",".join(variants), "--ab-rounds", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["ab"]
    # each variant's decode step, then its prefill of the --prefill length, round by round
    assert [(r["variant"], r["round"], r["batch"], r["query_len"]) for r in rows] == [
        (v, i, 1, q) for i in range(2) for v in variants for q in (1, 8)]
    assert all(r["ms"] > 0 and r["roofline_ms"] > 0 for r in rows)


def test_unknown_ab_variant_is_a_usage_error(capsys):
    """A misspelt --ab name stops at argument parsing with one line naming it (no benchmark runs first)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--tiny", "--device", "cpu", "--ab", "default,merge-apartt"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown A/B variant(s) merge-apartt" in err and "merge-apart" in err


def test_unknown_moe_path_is_a_usage_error(capsys):
    """A misspelt --moe-paths name stops at argument parsing, naming it; run() refuses one too."""
    from rayinfer.jobs.bench_moe import _paths, run

    assert _paths("none") == [] and _paths("grouped_mm,w8a16") == ["grouped_mm", "w8a16"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--tiny", "--device", "cpu", "--moe-paths", "grouped_mm,tritn"])
    assert exit_info.value.code == 2 and "unknown fused MoE path(s) tritn" in capsys.readouterr().err
    with pytest.raises(ValueError, match="grouped_tl"):
        run(tiny=True, device="cpu", moe_paths=["grouped_tl"])


def test_fused_moe_rows_time_only_the_paths_asked(monkeypatch):
    """bench_fused_moe times another path only when ``paths`` names it (the grouped-GEMM path made to apply on
    the CPU by a stand-in that computes the reference)."""
    from rayinfer.jobs import bench_moe
    from rayinfer.kernels import fused_moe as fm

    calls = []

    def grouped(x, w13, w2, ids, weights, *args, gemms=None, **kwargs):
        calls.append(gemms)
        return fm.fused_moe_ref(x, w13, w2, ids, weights)

    monkeypatch.setattr(fm, "grouped_mm_applies", lambda x, w13, fp8=False, force=False: force)
    monkeypatch.setattr(fm, "fused_moe_grouped_mm", grouped)
    monkeypatch.setattr(fm, "tilelang_gemms_apply", lambda *a: True)
    spec = bench_moe.MODELS["deepseek-v2-lite"]
    config = bench_moe._config(spec.tiny, spec.model_type)
    ceil = {"copy_GBps": 10.0, "matmul_TFLOPs": 0.1}
    cpu = torch.device("cpu")
    none = bench_moe.bench_fused_moe(ceil, config, 2, cpu, torch.float32, 1, paths=())
    assert calls == [] and not any(k.startswith("grouped") for k in none)
    some = bench_moe.bench_fused_moe(ceil, config, 2, cpu, torch.float32, 1, paths=("grouped_mm",))
    assert set(calls) == {"torch"} and some["grouped_mm_ms"] > 0 and some["grouped_mm_err_vs_ref"] < 1e-4
    assert "grouped_tilelang_ms" not in some and some["pct_of_roofline_grouped_mm"] > 0
    calls.clear()
    every = bench_moe.bench_fused_moe(ceil, config, 2, cpu, torch.float32, 1)
    assert set(calls) == {"torch", "tilelang"} and "grouped_tilelang_ms" in every


def test_a_run_stopped_by_sigterm_prints_where_it_was(tmp_path):
    """A run that a time limit stops (``timeout``'s SIGTERM) first prints every thread's Python stack, so that a
    device call cut short shows which case it was in."""
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    argv = ["--tiny", "--device", "cpu", "--reps", "400", "--out", str(tmp_path / "moe.json")]
    proc = subprocess.Popen([sys.executable, str(root / "jobs" / "bench_moe.py"), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=root)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until the cases run
            if line.startswith("ceilings:"):
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM
    assert "Current thread" in err and "bench_moe.py" in err, err[-2000:]
