"""Our Qwen3-MoE over the paged cache equals Hugging Face Qwen3MoeForCausalLM (float32, small random
configs): chunked prefill + decode of two requests in one batch, greedy generation, per-expert names."""

import pytest
import torch
import transformers

from rayinfer.model.qwen3_moe import Qwen3MoeForCausalLM

BLOCK_SIZE = 4
TABLES = [[5, 2, 9, 7], [11, 0, 3]]  # scattered blocks on purpose
# (request, new tokens) per step: chunked prefills, a decode inside a mixed batch, pure decode batches
SCHEDULE = [[(0, 6), (1, 4)], [(0, 1), (1, 5)], [(0, 4), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1)]]


def tiny_config(**kw):
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=256,
                initializer_range=0.1)
    base.update(kw)
    return transformers.Qwen3MoeConfig(**base)


def make_pair(cfg, seed=0):
    torch.manual_seed(seed)
    ref = transformers.Qwen3MoeForCausalLM(cfg).eval()
    ours = Qwen3MoeForCausalLM(cfg).eval()
    assert ours.load_weights(ref.state_dict().items()) == set(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("extra", [{}, dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
                                            tie_word_embeddings=True)])
def test_prefill_then_decode_matches_hf(extra, paged):
    ref, ours = make_pair(tiny_config(**extra))
    seqs = [torch.randint(0, 128, (14,)), torch.randint(0, 128, (12,))]
    paged.assert_matches_hf(ref, ours, seqs, TABLES, SCHEDULE, BLOCK_SIZE)
    load = ours.expert_load(reset=True)
    num_moe = 2 if not extra else 1
    assert load.shape == (num_moe, 8) and (load.sum(1) == 26 * 2).all()
    assert ours.expert_load().sum() == 0


def test_greedy_generation_matches_hf(paged):
    ref, ours = make_pair(tiny_config(), seed=1)
    prompt = torch.randint(0, 128, (8,))
    with torch.no_grad():
        want = ref.generate(prompt[None], max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        got = paged.greedy(ours, prompt, 16, [5, 3], TABLES[0] + [12, 13, 14], BLOCK_SIZE)
    assert got == want[0, 8:].tolist()


def test_loads_per_expert_names():
    cfg = tiny_config()
    ref, ours = make_pair(cfg)
    named, inter = [], cfg.moe_intermediate_size
    for name, t in ref.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                named += [(name.replace("gate_up_proj", f"{e}.gate_proj.weight"), t[e, :inter]),
                          (name.replace("gate_up_proj", f"{e}.up_proj.weight"), t[e, inter:])]
        elif name.endswith("experts.down_proj"):
            named += [(name.replace("down_proj", f"{e}.down_proj.weight"), t[e]) for e in range(t.shape[0])]
        else:
            named.append((name, t))
    fresh = Qwen3MoeForCausalLM(cfg)
    assert fresh.load_weights(named) == set(ref.state_dict())
    for name, t in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    with pytest.raises(ValueError):
        fresh.load_weights([("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(3, 3))])
