"""Which rayinfer class implements each Hugging Face architecture (``config.architectures[0]``)."""

from __future__ import annotations

import importlib

# HF architecture name -> "module:Class". A plain dict: add a line per supported architecture.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "rayinfer.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "rayinfer.model.llama:LlamaForCausalLM",
    "DeepseekV3ForCausalLM": "rayinfer.model.deepseek_v3:DeepseekV3ForCausalLM",
    "Qwen3MoeForCausalLM": "rayinfer.model.qwen3_moe:Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM": "rayinfer.model.gemma3:Gemma3ForCausalLM",
    "LlavaForConditionalGeneration": "rayinfer.model.llava:LlavaForConditionalGeneration",
}


def get_model_class(arch: str) -> type:
    """Import and return the model class registered for ``arch``.

    Raises:
        ValueError: if ``arch`` is not in :data:`ARCHITECTURES` (the message lists the supported ones).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported model architecture {arch!r}: supported are {sorted(ARCHITECTURES)}")
    module, _, cls = ARCHITECTURES[arch].partition(":")
    return getattr(importlib.import_module(module), cls)
