"""The tiny MoE shapes (``qwen3-moe-tiny``, ``deepseek-v3-tiny``): dummy weights load in both MoE
architectures, and a forward over zero tokens (what an expert-parallel rank without work runs) works."""

import pytest
import torch

from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.model.loader import load_model, resolve_model
from rayinfer.model.moe import grouped_topk


@pytest.mark.parametrize("name, arch", [("qwen3-moe-tiny", "Qwen3MoeForCausalLM"),
                                        ("deepseek-v3-tiny", "DeepseekV3ForCausalLM")])
def test_tiny_moe_shape_loads_and_runs_zero_tokens(name, arch):
    model = load_model(name, "float32", "cpu", load_format="dummy")
    assert type(model).__name__ == arch and model.config.vocab_size == 49152  # the default tokenizer fits
    kv = torch.zeros(model.kv_cache_shape(4, 16))
    empty = torch.zeros(0, dtype=torch.long)
    hidden = model(empty, empty, kv, AttentionMetadata.build([], [], [], 16))
    assert hidden.shape == (0, model.config.hidden_size)
    ids = torch.tensor([5, 17, 300])
    logits = model.compute_logits(model(ids, torch.arange(3), kv, AttentionMetadata.build([3], [3], [[0]], 16)))
    assert logits.shape == (3, 49152) and torch.isfinite(logits).all()


def test_grouped_topk_of_zero_tokens():
    weights, ids = grouped_topk(torch.zeros(0, 8), torch.zeros(8), top_k=2, num_groups=2, topk_groups=1,
                                renormalize=True, routed_scaling_factor=2.5)
    assert weights.shape == (0, 2) and ids.shape == (0, 2)


def test_shape_names_ignore_case_and_separators():
    assert resolve_model("llama3-8b") == resolve_model("Llama-3-8B") == "llama-3-8b"
    assert resolve_model("qwen3_moe_tiny") == "qwen3-moe-tiny"
    with pytest.raises(ValueError, match="unknown model 'llama-4'"):
        resolve_model("llama-4")
