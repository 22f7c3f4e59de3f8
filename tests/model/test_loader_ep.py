"""load_model's ``model_kwargs`` passthrough: an expert-parallel model with redundant expert slots gets
the one-process model's dummy weights (each slot its logical expert's)."""

import torch
import transformers

from rayinfer.model.loader import load_model
from rayinfer.model.moe import ExpertParallelism


def test_dummy_weights_do_not_depend_on_expert_placement(tmp_path):
    transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        architectures=["Qwen3MoeForCausalLM"],
    ).save_pretrained(tmp_path)
    one = load_model(tmp_path, "float32", "cpu", "dummy", seed=3)
    phy2log = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0, 3, 3])
    ep = ExpertParallelism(num_physical_experts=10, phy2log=phy2log)
    spread = load_model(tmp_path, "float32", "cpu", "dummy", seed=3, model_kwargs={"ep": ep})
    experts = spread.expert_layers()
    assert [layer.phy2log.tolist() for layer in experts] == [phy2log.tolist()] * 2
    ref = dict(one.named_parameters())
    for name, p in spread.named_parameters():
        want = ref[name][phy2log] if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else ref[name]
        assert torch.equal(p, want), name
