"""Built-in model shapes (configs without weights) for ``load_format="dummy"`` benchmarks and tests."""

from __future__ import annotations

import transformers

# name -> keyword arguments of the Hugging Face config ("model_type" picks the config class).
SHAPES: dict[str, dict] = {
    # Meta Llama-3-8B (base): GQA 32/8 heads, 128K vocab.
    "llama-3-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    ),
    # SmolLM2-135M(-Instruct), as in the default model's config.json.
    "smollm2-135m": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    ),
    # A few-MB Llama with the default tokenizer's vocab, for fast engine tests.
    "llama-tiny": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    ),
}


def shape_config(name: str) -> transformers.PretrainedConfig:
    """The Hugging Face config of built-in shape ``name`` (case-insensitive).

    Raises:
        ValueError: for a name not in :data:`SHAPES`.
    """
    key = name.lower()
    if key not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}: built-in shapes are {sorted(SHAPES)}")
    kwargs = dict(SHAPES[key])
    return transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
