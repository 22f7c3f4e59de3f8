"""Our DeepSeek-V3 over the compressed paged cache equals Hugging Face DeepseekV3ForCausalLM
(float32, small random configs): chunked prefill + decode of two requests in one batch, greedy
generation, checkpoint names (per-expert, MTP layers)."""

import pytest
import torch
import transformers

from rayinfer.model.deepseek_v3 import DeepseekV3ForCausalLM

BLOCK_SIZE = 4
TABLES = [[5, 2, 9, 7], [11, 0, 3]]  # scattered blocks on purpose
# (request, new tokens) per step: chunked prefills, a decode inside a mixed batch, pure decode batches
SCHEDULE = [[(0, 6), (1, 4)], [(0, 1), (1, 5)], [(0, 4), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1)]]
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)


def tiny_config(**kw):
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
                q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16, n_group=4, topk_group=2,
                num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                max_position_embeddings=256, initializer_range=0.1, num_nextn_predict_layers=1)
    base.update(kw)
    return transformers.DeepseekV3Config(**base)


def make_pair(cfg, seed=0):
    torch.manual_seed(seed)
    ref = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, buf in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)
    ours = DeepseekV3ForCausalLM(cfg).eval()
    loaded = ours.load_weights(ref.state_dict().items())
    assert loaded == set(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("variant", ["base", "no_q_lora_no_interleave", "yarn"])
def test_prefill_then_decode_matches_hf(variant, paged):
    extra = {"base": {}, "no_q_lora_no_interleave": dict(q_lora_rank=None, rope_interleave=False),
             "yarn": dict(rope_parameters=YARN)}[variant]
    ref, ours = make_pair(tiny_config(**extra))
    seqs = [torch.randint(0, 128, (14,)), torch.randint(0, 128, (12,))]
    paged.assert_matches_hf(ref, ours, seqs, TABLES, SCHEDULE, BLOCK_SIZE)
    load = ours.expert_load()
    assert load.shape == (2, 8) and (load.sum(1) == 26 * 3).all()  # every token of both requests, top-3


def test_greedy_generation_matches_hf(paged):
    cfg = tiny_config()
    ref, ours = make_pair(cfg, seed=1)
    prompt = torch.randint(0, 128, (8,))
    with torch.no_grad():
        want = ref.generate(prompt[None], max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        got = paged.greedy(ours, prompt, 16, [5, 3], TABLES[0] + [12, 13, 14], BLOCK_SIZE)
    assert got == want[0, 8:].tolist()


def to_checkpoint_names(state_dict, cfg):
    """Hugging Face 5.x stacked experts -> per-expert names as released checkpoints store them, plus an
    MTP layer (index num_hidden_layers) that must be skipped."""
    out, inter = {}, cfg.moe_intermediate_size
    for name, t in state_dict.items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :inter]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e]
        else:
            out[name] = t
    mtp = f"model.layers.{cfg.num_hidden_layers}"
    out.update({f"{mtp}.eh_proj.weight": torch.zeros(64, 128), f"{mtp}.enorm.weight": torch.ones(64),
                f"{mtp}.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64)})
    return out


def test_loads_checkpoint_names_and_skips_mtp():
    cfg = tiny_config()
    ref, ours = make_pair(cfg)
    fresh = DeepseekV3ForCausalLM(cfg).eval()
    loaded = fresh.load_weights(to_checkpoint_names(ref.state_dict(), cfg).items())
    assert loaded == set(ref.state_dict())
    for name, t in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    with pytest.raises(KeyError):
        fresh.load_weights([("model.layers.0.mlp.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="FP8"):
        fresh.load_weights([("model.layers.0.mlp.gate_proj.weight_scale_inv", torch.zeros(1))])


def test_cache_is_compressed():
    cfg = tiny_config()
    assert DeepseekV3ForCausalLM(cfg).kv_cache_shape(10, 4) == (3, 10, 4, 32 + 16)
