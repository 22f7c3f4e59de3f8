"""Built-in model shapes (configs without weights) for ``load_format="dummy"`` benchmarks and tests."""

from __future__ import annotations

import re

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
    # Meta Llama-3.2-1B: Llama-3-8B's tokenizer and vocab, so a draft model for it (tied embeddings; the
    # "llama3" RoPE scaling of the real checkpoint is left out: a dummy-weight shape for speed).
    "llama-3.2-1b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
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
    # Tiny MoE shapes with the default tokenizer's vocab: expert parallelism (parallel=ep2, ep4) on a laptop
    # with dummy weights. 8 routed experts, so 8 + 0, 2 or 4 redundant experts split over 2 or 4 EP ranks.
    "qwen3-moe-tiny": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=49152, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rope_theta=10000.0, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
    ),
    # Qwen3-30B-A3B (Qwen3MoeForCausalLM), as in its config.json: 48 MoE layers (no dense layer, no shared
    # expert), 128 experts of intermediate 768, top-8 softmax renormalized; GQA 32/4 heads of 128. 30.5B parameters.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0, max_position_embeddings=40960,
        rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645,
    ),
    # The DeepSeek-V3 architecture (MLA, sigmoid grouped top-k) at DeepSeek-V2-Lite's size: hidden 2048, 27 layers
    # (the first dense), 64 routed + 2 shared experts of 1408, top-6, kv_lora_rank 512, no query LoRA; 15.7B
    # parameters. V2-Lite itself routes with a softmax (same bytes and FLOPs). jobs/bench_moe.py's default shape.
    "deepseek-v2-lite-v3arch": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, first_k_dense_replace=1,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, num_nextn_predict_layers=0,
        bos_token_id=100000, eos_token_id=100001,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1),
    ),
    # MLA attention, a dense first layer, then 1 shared + 8 routed experts in 2 groups (grouped top-k).
    "deepseek-v3-tiny": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=49152, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        rope_theta=10000.0, max_position_embeddings=2048, num_nextn_predict_layers=1, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
    ),
    # LLaVA-1.5 layout over a ~1.1B Llama-3.2-1B-like decoder: the CLIP ViT-L/14-336 vision tower (~300M; 576
    # image tokens from the penultimate layer, no CLS), a two-layer GELU projector. The vocabulary is the
    # default tokenizer's plus the <image> token (id 49152), padded to 49280. Encoder benchmarks (jobs/bench_encoder.py).
    "llava-clip-l-1b": dict(
        model_type="llava", architectures=["LlavaForConditionalGeneration"], image_token_index=49152,
        vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu",
        text_config=dict(model_type="llama", vocab_size=49280, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                           num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14,
                           projection_dim=768, hidden_act="quick_gelu", layer_norm_eps=1e-5),
    ),
    # The same layout at toy size (CLIP 32x32 px, patch 8 -> 16 image tokens; Llama hidden 64): EPD and the
    # encoder benchmark on a laptop CPU in seconds.
    "llava-tiny": dict(
        model_type="llava", architectures=["LlavaForConditionalGeneration"], image_token_index=49152,
        vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu",
        text_config=dict(model_type="llama", vocab_size=49280, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32,
                           hidden_act="quick_gelu", layer_norm_eps=1e-5),
    ),
}


def shape_name(name: str) -> str | None:
    """The key of :data:`SHAPES` that ``name`` names, ignoring case and ``-``, ``_``, ``.`` (so
    ``llama3-8b`` and ``Llama-3-8B`` are ``llama-3-8b``); None when it names none."""
    def canonical(s: str) -> str:
        return re.sub(r"[^a-z0-9]", "", s.lower())

    return next((key for key in SHAPES if canonical(key) == canonical(name)), None)


def shape_config(name: str) -> transformers.PretrainedConfig:
    """The Hugging Face config of built-in shape ``name`` (see :func:`shape_name`).

    Raises:
        ValueError: for a name not in :data:`SHAPES`.
    """
    key = shape_name(name)
    if key is None:
        raise ValueError(f"unknown model shape {name!r}: built-in shapes are {sorted(SHAPES)}")
    kwargs = dict(SHAPES[key])
    return transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
