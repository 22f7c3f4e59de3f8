"""FP8 block-quantized weights (DeepSeek-V3's format: dense linears and routed experts) through the
loader: an fp8 checkpoint (weights + ``weight_scale_inv``, per-expert scales, MTP layer included) loads
and its logits equal the same model's with the dequantized weights; a 16/32-bit checkpoint with
``quantization="fp8"`` is quantized as it loads and ``"none"`` dequantizes an fp8 one; dummy fp8
weights are the dummy weights quantized; bad ``quantization_config`` values, an fp8 weight without its
scale and unsupported models are refused by name; ``ModelConfig.quantization`` reaches the loader
through the engine."""

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import nn

from rayinfer.engine.config import ModelConfig
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.block_fp8 import block_fp8_dequant_ref, quantize_block_fp8
from rayinfer.kernels.fused_moe import dequant_w13, quantize_w13
from rayinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from rayinfer.model.loader import check_quantization, load_config, load_model
from rayinfer.model.moe import RoutedExperts
from rayinfer.model.quantization import BlockFp8Config, parse_quantization_config, quantizable_linears

FP8 = torch.float8_e4m3fn
DEEPSEEK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
BLOCK_SIZE = 4


def tiny_config(**kw):
    """hidden 128 (whole K blocks), and N or K off the 128 grid elsewhere: q_b_proj [96, 96],
    kv_a_proj_with_mqa [80, 128], the dense MLP's [320, 128] / [128, 320], eh_proj [128, 256]."""
    base = dict(vocab_size=256, hidden_size=128, intermediate_size=320, moe_intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, n_group=2,
                topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32,
                v_head_dim=32, max_position_embeddings=256, num_nextn_predict_layers=1, tie_word_embeddings=False,
                architectures=["DeepseekV3ForCausalLM"])
    base.update(kw)
    return transformers.DeepseekV3Config(**base)


def random_model(cfg, seed=0) -> DeepseekV3ForCausalLM:
    """Our model (MTP built when the config has it) in float32 with random weights: matrices N(0, 0.05),
    norms around 1."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg, enable_mtp=cfg.num_nextn_predict_layers > 0).eval()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name and t.dim() == 1:
                t.copy_(1 + 0.1 * torch.randn_like(t))
            elif t.is_floating_point() and not name.endswith("inv_freq"):
                t.normal_(0, 0.05)
    return model


def checkpoint_names(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Our names -> the released checkpoints': MTP module d as decoder layer num_hidden_layers + d,
    per-expert routed experts."""
    out, inter, n = {}, cfg.moe_intermediate_size, cfg.num_hidden_layers
    for name, t in state.items():
        if name.startswith("mtp."):
            d, rest = name[4:].split(".", 1)
            name = f"model.layers.{n + int(d)}.{rest}"
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :inter].contiguous()
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, inter:].contiguous()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def fp8_checkpoint(model: DeepseekV3ForCausalLM, cfg) -> tuple[dict[str, torch.Tensor], DeepseekV3ForCausalLM]:
    """(DeepSeek-V3-style checkpoint of ``model``: every decoder linear, kv_b_proj and the MTP eh_proj
    included, and each routed expert's gate/up/down, as fp8 + weight_scale_inv, the rest float32; the same
    model with those weights dequantized)."""
    ref = copy.deepcopy(model)
    state = dict(model.state_dict())
    scales = {}  # per-expert checkpoint scale names
    with torch.no_grad():
        for name, layer in ref.named_modules():
            if isinstance(layer, nn.Linear) and not name.endswith("lm_head"):
                q, s = quantize_block_fp8(layer.weight)
                state[f"{name}.weight"], state[f"{name}.weight_scale_inv"] = q, s
                layer.weight.copy_(block_fp8_dequant_ref(q, s))
            elif isinstance(layer, RoutedExperts):  # routed experts: each expert's projections in blocks of their own
                (q13, s13), (q2, s2) = quantize_w13(layer.gate_up_proj), quantize_block_fp8(layer.down_proj)
                state[f"{name}.gate_up_proj"], state[f"{name}.down_proj"] = q13, q2
                layer.gate_up_proj.copy_(dequant_w13(q13, s13, torch.float32))
                layer.down_proj.copy_(block_fp8_dequant_ref(q2, s2))
                prefix = name.replace("mtp.0.", f"model.layers.{cfg.num_hidden_layers}.")
                rows = s13.shape[1] // 2
                for e in range(s13.shape[0]):
                    scales[f"{prefix}.{e}.gate_proj.weight_scale_inv"] = s13[e, :rows].contiguous()
                    scales[f"{prefix}.{e}.up_proj.weight_scale_inv"] = s13[e, rows:].contiguous()
                    scales[f"{prefix}.{e}.down_proj.weight_scale_inv"] = s2[e].contiguous()
    return {**checkpoint_names(state, cfg), **scales}, ref


def save_checkpoint(path, cfg, state, quantization_config=None):
    cfg = copy.deepcopy(cfg)
    if quantization_config is not None:
        cfg.quantization_config = quantization_config
    cfg.save_pretrained(path)
    save_file(state, str(path / "model.safetensors"))
    return path


def assert_same_logits(ours, ref, tol=1e-5):
    """Prefill of two requests (7 and 5 tokens), then two decode steps; and the MTP module over the
    first request's hidden states: the same logits within ``tol``."""
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (9,), generator=gen), torch.randint(0, 256, (7,), generator=gen)]
    tables, schedule = [[3, 0, 5], [1, 4]], [[(0, 7), (1, 5)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]
    with torch.no_grad():
        kvs = [torch.zeros(m.kv_cache_shape(8, BLOCK_SIZE)) for m in (ours, ref)]
        done = [0, 0]
        for step in schedule:
            meta = AttentionMetadata.build([n for _, n in step], [done[r] + n for r, n in step],
                                           [tables[r] for r, _ in step], BLOCK_SIZE)
            ids = torch.cat([seqs[r][done[r]: done[r] + n] for r, n in step])
            pos = torch.cat([torch.arange(done[r], done[r] + n) for r, n in step])
            got, want = [m.forward_with_prenorm(ids, pos, kv, meta) for m, kv in zip((ours, ref), kvs)]
            torch.testing.assert_close(ours.compute_logits(got[0]), ref.compute_logits(want[0]), rtol=tol, atol=tol)
            torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)
            for r, n in step:
                done[r] += n
        # MTP: entry i pairs a pre-norm hidden state (random here) with token i + 1
        meta = AttentionMetadata.build([6], [6], [[2, 6]], BLOCK_SIZE)
        prev = torch.randn(6, 128, generator=gen)
        outs = [m.mtp_forward(seqs[0][1:7], prev, torch.arange(1, 7), torch.zeros(m.mtp_kv_cache_shape(8, BLOCK_SIZE)),
                              meta) for m in (ours, ref)]
        torch.testing.assert_close(ours.mtp_logits(outs[0]), ref.mtp_logits(outs[1]), rtol=tol, atol=tol)


@pytest.mark.parametrize("inter", [64, 128])
def test_fp8_checkpoint_loads_and_equals_the_dequantized_model(tmp_path, inter):
    """inter 128: the shared expert's blocks align with the experts', so it is fused in as a fifth fp8 slot
    (weights and scales copied); 64: it stays a separate fp8 MLP."""
    cfg = tiny_config(moe_intermediate_size=inter)
    state, ref = fp8_checkpoint(random_model(cfg), cfg)
    assert state["model.layers.2.eh_proj.weight"].dtype == FP8 and "model.layers.2.eh_proj.weight_scale_inv" in state
    path = save_checkpoint(tmp_path, cfg, state, DEEPSEEK_FP8)
    ours = load_model(path, torch.float32, "cpu", model_kwargs={"enable_mtp": True})
    params = dict(ours.named_parameters())
    attn = "model.layers.0.self_attn"
    for name in (f"{attn}.q_b_proj", f"{attn}.o_proj", "model.layers.0.mlp.down_proj", "mtp.0.eh_proj",
                 "mtp.0.self_attn.q_a_proj"):
        assert params[f"{name}.weight"].dtype == FP8, name
        assert params[f"{name}.weight_scale_inv"].dtype == torch.float32, name
    assert params[f"{attn}.q_b_proj.weight_scale_inv"].shape == (1, 1)
    assert params["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (3, 1)
    assert params["mtp.0.eh_proj.weight_scale_inv"].shape == (1, 2)
    # routed experts in fp8 with per-expert scales, the shared expert fused in as a fifth slot
    experts = "model.layers.1.mlp.experts"
    assert params[f"{experts}.gate_up_proj"].dtype == params[f"{experts}.down_proj"].dtype == FP8
    slots = 4 + (inter == 128)
    assert params[f"{experts}.gate_up_proj_scale_inv"].shape == (slots, 2, 1)
    assert params[f"{experts}.down_proj_scale_inv"].shape == (slots, 1, 1)
    # I = 64: the shared expert's 128-row blocks do not align with the experts' per-half ones, so it stays apart
    assert (ours.model.layers[1].mlp.shared_experts is None) == (inter == 128)
    # kv_b_proj, router, embedding and LM head stay float32; kv_b_proj holds the dequantized weight
    for name in (f"{attn}.kv_b_proj.weight", "model.layers.1.mlp.gate.weight", "model.embed_tokens.weight",
                 "lm_head.weight"):
        assert params[name].dtype == torch.float32, name
    assert torch.equal(params[f"{attn}.kv_b_proj.weight"], ref.model.layers[0].self_attn.kv_b_proj.weight)
    assert f"{attn}.kv_b_proj.weight_scale_inv" not in params
    assert_same_logits(ours, ref)


def test_fp8_checkpoint_with_quantization_none_is_dequantized(tmp_path):
    cfg = tiny_config(num_nextn_predict_layers=0)
    model = random_model(cfg)
    state, ref = fp8_checkpoint(model, cfg)
    path = save_checkpoint(tmp_path, cfg, state, DEEPSEEK_FP8)
    ours = load_model(path, torch.float32, "cpu", quantization="none")
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    unfused = ours.hf_state_dict()  # the loader fused the shared expert and the query/latent projections
    assert unfused.keys() == ref.state_dict().keys()
    for name, t in unfused.items():
        assert torch.equal(t, ref.state_dict()[name]), name


def test_16_bit_checkpoint_is_quantized_as_it_loads(tmp_path):
    cfg = tiny_config(num_nextn_predict_layers=0)
    model = random_model(cfg)
    state = checkpoint_names({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, cfg)
    path = save_checkpoint(tmp_path, cfg, state)
    ours = load_model(path, torch.float32, "cpu", quantization="fp8")
    params = dict(ours.named_parameters())
    quantized = quantizable_linears(ours)
    assert "model.layers.0.self_attn.o_proj" in quantized and "model.layers.0.self_attn.kv_b_proj" not in quantized
    for name in quantized:
        q, s = quantize_block_fp8(state[f"{name}.weight"])
        assert torch.equal(params[f"{name}.weight"].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(params[f"{name}.weight_scale_inv"], s), name
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"
    assert params[kv_b].dtype == torch.float32 and torch.equal(params[kv_b], state[kv_b].float())
    # each routed expert's projections quantized in blocks of their own (slot 0 holds expert 0)
    experts = "model.layers.1.mlp.experts"
    for kind, rows in (("gate_proj", slice(0, 64)), ("up_proj", slice(64, 128))):
        q, sc = quantize_block_fp8(state[f"{experts}.0.{kind}.weight"])
        assert torch.equal(params[f"{experts}.gate_up_proj"][0, rows].view(torch.uint8), q.view(torch.uint8)), kind
        assert torch.equal(params[f"{experts}.gate_up_proj_scale_inv"][0, 0 if kind == "gate_proj" else 1], sc[0])


def test_dummy_fp8_weights_are_the_dummy_weights_quantized():
    # fp8 at I = 32 and a 48-row q_a_proj: blocks do not align, so nothing is fused; the bf16 model is fused,
    # and compared under the unfused names (hf_state_dict)
    plain = load_model("deepseek-v3-tiny", "float32", "cpu", "dummy", seed=0).hf_state_dict()
    fp8 = load_model("deepseek-v3-tiny", "float32", "cpu", "dummy", seed=0, quantization="fp8")
    # under the unfused names: the dense MLP's I = 128 fills a block, so its gate_up_proj is stacked
    params = fp8.hf_state_dict()
    names = [m for n in quantizable_linears(fp8) for m in (
        [n.replace("gate_up", "gate"), n.replace("gate_up", "up")] if n.endswith("mlp.gate_up_proj") else [n])]
    assert fp8.model.layers[0].mlp.gate_up_proj is not None
    assert len(names) == 2 * 4 + 3 + 3  # 4 attention projections a layer, the dense MLP, the shared expert
    for name in names:
        q, s = quantize_block_fp8(plain[f"{name}.weight"])
        assert torch.equal(params[f"{name}.weight"].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(params[f"{name}.weight_scale_inv"], s), name
    experts = "model.layers.1.mlp.experts"
    for name, p in plain.items():
        if name.startswith(experts):  # the 8 routed slots: the dummy experts quantized
            q, s = (quantize_w13 if name.endswith("gate_up_proj") else quantize_block_fp8)(p[:8])
            assert torch.equal(params[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(params[f"{name}_scale_inv"], s), name
        elif name.rpartition(".")[0] not in names:
            assert torch.equal(params[name], p), name
    ids = torch.randint(0, 1000, (7,))
    meta = AttentionMetadata.build([7], [7], [[0, 1]], BLOCK_SIZE)
    with torch.no_grad():
        logits = fp8.compute_logits(fp8(ids, torch.arange(7), torch.zeros(fp8.kv_cache_shape(4, BLOCK_SIZE)), meta))
    assert logits.shape == (7, fp8.config.vocab_size) and logits.isfinite().all()


def test_qwen3_moe_dummy_fp8_runs():
    model = load_model("qwen3-moe-tiny", "float32", "cpu", "dummy", quantization="fp8")
    assert model.model.layers[0].self_attn.k_proj.weight.dtype == FP8
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == FP8
    meta = AttentionMetadata.build([5], [5], [[0, 1]], BLOCK_SIZE)
    with torch.no_grad():
        logits = model.compute_logits(model(torch.arange(5), torch.arange(5),
                                            torch.zeros(model.kv_cache_shape(4, BLOCK_SIZE)), meta))
    assert logits.isfinite().all()


@pytest.mark.parametrize("field, value", [("quant_method", "awq"), ("fmt", "e5m2"), ("activation_scheme", "static"),
                                          ("weight_block_size", [64, 64]), ("weight_block_size", None)])
def test_bad_quantization_config_is_refused_by_field(field, value):
    assert parse_quantization_config(DEEPSEEK_FP8) == BlockFp8Config((128, 128))
    assert parse_quantization_config(None) is None
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        parse_quantization_config({**DEEPSEEK_FP8, field: value})


def test_refusals_through_the_loader(tmp_path):
    cfg = tiny_config(num_nextn_predict_layers=0)
    state, _ = fp8_checkpoint(random_model(cfg), cfg)
    save_checkpoint(tmp_path, cfg, state, {**DEEPSEEK_FP8, "quant_method": "gptq"})
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        load_model(tmp_path, torch.float32, "cpu")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model("deepseek-v3-tiny", torch.float32, "cpu", "dummy", quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="int8")
    assert ModelConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="LlamaForCausalLM has no fp8 block-quantized layers.*Qwen3MoeForCausalLM"):
        load_model("llama-tiny", torch.float32, "cpu", "dummy", quantization="fp8")
    # the jobs' check before any work: the same refusal from the config alone, nothing for a supported one
    with pytest.raises(ValueError, match="model.quantization: LlamaForCausalLM"):
        check_quantization(load_config("llama-tiny"), "fp8")
    assert check_quantization(load_config("qwen3-moe-tiny"), "fp8") is not None
    assert check_quantization(load_config("llama-tiny"), None) is None
    # an fp8 expert weight without its scale, with quantization="none" (its dequantization waits for it)
    expert = "model.layers.1.mlp.experts.0.up_proj"
    save_checkpoint(tmp_path, cfg, {k: v for k, v in state.items() if k != f"{expert}.weight_scale_inv"}, DEEPSEEK_FP8)
    with pytest.raises(ValueError, match="fp8 expert weights without their weight_scale_inv"):
        load_model(tmp_path, torch.float32, "cpu", quantization="none")
    # an fp8 weight without its scale
    del state["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"]
    save_checkpoint(tmp_path, cfg, state, DEEPSEEK_FP8)
    with pytest.raises(ValueError, match="without their weight_scale_inv.*kv_b_proj"):
        load_model(tmp_path, torch.float32, "cpu")


def test_engine_passes_model_config_quantization_to_the_loader():
    from rayinfer.engine.config import EngineConfig
    from rayinfer.engine.llm_engine import LLMEngine
    from rayinfer.engine.types import SamplingParams

    engine = LLMEngine(ModelConfig("deepseek-v3-tiny", dtype="float32", load_format="dummy", quantization="fp8"),
                       EngineConfig(device="cpu", num_kv_blocks=16, block_size=BLOCK_SIZE))
    assert engine.model.model.layers[0].self_attn.o_proj.weight.dtype == FP8
    out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert out[0].error is None and len(out[0].output_token_ids) == 3


def test_stacked_16_bit_experts_are_quantized_per_half_as_they_load():
    """A Hugging Face 5.x state dict (stacked ``experts.gate_up_proj`` / ``down_proj``, float32) loaded into
    an fp8 model: the experts hold quantize_w13 / quantize_block_fp8 of them, scales included."""
    from rayinfer.kernels.fused_moe import quantize_w13

    plain = load_model("qwen3-moe-tiny", "float32", "cpu", "dummy", seed=0)
    fp8 = load_model("qwen3-moe-tiny", "float32", "cpu", "dummy", seed=1, quantization="fp8")
    fp8.load_weights(plain.hf_state_dict().items())  # Hugging Face names (the loader stacked q, k and v)
    ours, src = fp8.model.layers[0].mlp.experts, plain.model.layers[0].mlp.experts
    for name, quantize in (("gate_up_proj", quantize_w13), ("down_proj", quantize_block_fp8)):
        q, s = quantize(getattr(src, name))
        assert torch.equal(getattr(ours, name).view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(getattr(ours, f"{name}_scale_inv"), s), name
