"""Bytes and FLOPs of MoE decoder steps: the ``CostModel``s of jobs/roofline.py for the DeepSeek-V3
architecture (:class:`MoECost`) and Qwen3-MoE (:class:`Qwen3MoECost`), and the plug-in that adds them and
the MoE scenarios (``deepseek-v2-lite``, ``qwen3-30b-a3b``) to jobs/bench.py (:func:`register_bench_plugins`).

Both follow one convention for the routed experts: a step over ``T`` tokens reads, per MoE layer, the
experts that ``T`` uniformly routed tokens touch, ``L * (1 - (1 - k/L)^T)`` expected distinct experts of
``L`` (top-k), and computes ``k`` experts per token. (The direct decode rows of jobs/bench_moe.py count
the experts a step actually read from the model's expert load instead.) FLOPs are 2 per multiply-add of
the projections and attention; norms, RoPE, softmax and routing are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def expected_experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts of one layer that ``num_tokens`` tokens, each routed uniformly to
    ``top_k`` of ``num_experts``, read: ``L * (1 - (1 - k/L)^T)`` (0 at T = 0, k at T = 1, L as T grows)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


class _RoutedWeights:
    """The weight reads of a MoE step, shared by the cost models below: every dense weight once, the LM
    head, one embedding row per token, and the routed experts that ``num_tokens`` uniformly routed tokens
    touch in each MoE layer."""

    num_moe_layers: int
    num_experts: int
    top_k: int
    expert_params: int
    dense_params: int
    vocab_size: int
    hidden_size: int
    dtype_bytes: int

    def experts_touched(self, num_tokens: int) -> float:
        """Expected distinct routed experts of one MoE layer that ``num_tokens`` uniformly routed tokens read."""
        return expected_experts_touched(self.num_experts, self.top_k, num_tokens)

    def weight_bytes_read(self, num_tokens: int) -> int:
        experts = self.num_moe_layers * self.experts_touched(num_tokens) * self.expert_params
        h = self.hidden_size
        return int((self.dense_params + self.vocab_size * h + num_tokens * h + experts) * self.dtype_bytes)


@dataclass(frozen=True)
class MoECost(_RoutedWeights):
    """Bytes and FLOPs of a DeepSeek-V3-architecture step, the ``CostModel`` of ``jobs/roofline.py``.

    Weight bytes count every non-routed weight once, the LM head, one embedding row per token, and per
    MoE layer the routed experts that ``num_tokens`` tokens touch when routing is uniform
    (:func:`expected_experts_touched`). FLOPs: 2 per multiply-add of the projections with top-k routed
    experts per token, expanded MLA attention (``qk + v`` head dims per (query, key) pair and head); norms,
    RoPE, softmax and routing are left out. (The direct decode rows of jobs/bench_moe.py ``bench_step``
    count the experts actually read and absorbed-MLA attention instead.)
    """

    num_layers: int
    num_moe_layers: int
    hidden_size: int
    vocab_size: int
    dense_params: int  # read every step: attention, dense MLPs, shared experts, routers, norms
    expert_params: int  # one routed expert
    num_experts: int
    top_k: int
    attn_dims: int  # (qk_nope + qk_rope + v_head) * heads
    kv_bytes_per_token: int
    dtype_bytes: int

    @classmethod
    def from_config(cls, config, dtype_bytes: int) -> "MoECost":
        c, h = config, config.hidden_size
        heads, nope, rope, v = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q_lora = getattr(c, "q_lora_rank", None)
        q = h * heads * (nope + rope) if q_lora is None else h * q_lora + q_lora + q_lora * heads * (nope + rope)
        attn = q + h * (c.kv_lora_rank + rope) + c.kv_lora_rank + c.kv_lora_rank * heads * (nope + v) + heads * v * h
        num_moe = c.num_hidden_layers - c.first_k_dense_replace
        moe_inter, num_experts = c.moe_intermediate_size, c.n_routed_experts
        dense = (c.num_hidden_layers * (attn + 2 * h) + c.first_k_dense_replace * 3 * h * c.intermediate_size
                 + num_moe * (num_experts * h + 3 * h * moe_inter * c.n_shared_experts) + h)
        return cls(c.num_hidden_layers, num_moe, h, c.vocab_size, dense, 3 * h * moe_inter, num_experts,
                   c.num_experts_per_tok, heads * (nope + rope + v),
                   c.num_hidden_layers * (c.kv_lora_rank + rope) * dtype_bytes, dtype_bytes)

    @property
    def num_params(self) -> int:
        """All parameters (embedding and LM head untied)."""
        return (self.dense_params + 2 * self.vocab_size * self.hidden_size
                + self.num_moe_layers * self.num_experts * self.expert_params)

    def flops(self, num_tokens: int, num_attn_pairs: int, num_logits: int) -> int:
        active = self.dense_params + self.num_moe_layers * self.top_k * self.expert_params
        return (2 * active * num_tokens + 2 * self.num_layers * self.attn_dims * num_attn_pairs
                + 2 * self.hidden_size * self.vocab_size * num_logits)


def qwen3_moe_layer_is_sparse(config, layer_idx: int) -> bool:
    """Hugging Face Qwen3-MoE's rule for which decoder layers are MoE (the others have a dense MLP)."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


@dataclass(frozen=True)
class Qwen3MoECost(_RoutedWeights):
    """Bytes and FLOPs of a Qwen3-MoE step (GQA attention with q/k RMSNorm, routed experts, no shared
    expert), the ``CostModel`` of ``jobs/roofline.py``, with :class:`MoECost`'s conventions.

    Weight bytes: attention, routers, norms and any dense MLP layers once, the LM head, one embedding row
    per token, and per MoE layer the experts ``num_tokens`` uniformly routed tokens touch. KV: K and V of
    every layer, ``2 * kv_heads * head_dim`` elements per token and layer. FLOPs: 2 per multiply-add of the
    projections with top-k experts per token, and ``4 * head_dim`` per (query, key) pair and query head
    (QK^T and PV).
    """

    num_layers: int
    num_moe_layers: int
    hidden_size: int
    vocab_size: int
    dense_params: int  # read every step: attention (q/k norms, biases), dense MLP layers, routers, norms
    expert_params: int  # one routed expert: gate, up [I, H] and down [H, I]
    num_experts: int
    top_k: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    dtype_bytes: int
    kv_dtype_bytes: int | None = None  # the KV cache's element size when it differs (fp8 KV: 1)

    @classmethod
    def from_config(cls, config, dtype_bytes: int) -> "Qwen3MoECost":
        """Read the sizes from a Hugging Face ``Qwen3MoeConfig``; weights and KV in ``dtype_bytes``."""
        c, h = config, config.hidden_size
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        d = getattr(c, "head_dim", None) or h // heads
        attn = 2 * h * heads * d + 2 * h * kv_heads * d + 2 * d  # q, o; k, v; q_norm, k_norm
        if getattr(c, "attention_bias", False):
            attn += heads * d + 2 * kv_heads * d + h
        num_moe = sum(qwen3_moe_layer_is_sparse(c, i) for i in range(c.num_hidden_layers))
        dense = (c.num_hidden_layers * (attn + 2 * h) + num_moe * c.num_experts * h
                 + (c.num_hidden_layers - num_moe) * 3 * h * c.intermediate_size + h)
        return cls(c.num_hidden_layers, num_moe, h, c.vocab_size, dense, 3 * h * c.moe_intermediate_size,
                   c.num_experts, c.num_experts_per_tok, heads, kv_heads, d,
                   bool(getattr(c, "tie_word_embeddings", False)), dtype_bytes)

    @property
    def num_params(self) -> int:
        """All parameters, a tied LM head counted once."""
        embed = self.vocab_size * self.hidden_size
        return (self.dense_params + embed * (1 if self.tie_word_embeddings else 2)
                + self.num_moe_layers * self.num_experts * self.expert_params)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * (self.kv_dtype_bytes or self.dtype_bytes)

    def flops(self, num_tokens: int, num_attn_pairs: int, num_logits: int) -> int:
        active = self.dense_params + self.num_moe_layers * self.top_k * self.expert_params
        attn = 4 * self.num_layers * self.num_heads * self.head_dim * num_attn_pairs
        return 2 * active * num_tokens + attn + 2 * self.hidden_size * self.vocab_size * num_logits


def write_shape(shape: dict, path: Path, model_type: str = "deepseek_v3") -> Path:
    """Write ``shape`` (Hugging Face config keyword arguments of ``model_type``) as a config.json in ``path``:
    a model directory for ``load_format="dummy"``. Returns ``path``."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    transformers.AutoConfig.for_model(model_type, **shape).save_pretrained(path)
    return path


_MOE_ENGINE = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}
# the cases: decode at batch 1, 32, 128 and 1K / 4K context, prefill 4K
_MOE_CASES = {"decode": {"batches": [1, 32, 128], "contexts": [1024, 4096]}, "prefill": {"lengths": [4096]}}


def register_bench_plugins(model_dir: Path | None = None) -> None:
    """Plug the MoE models into ``jobs/bench.py``: the DeepSeek-V3 and Qwen3-MoE cost models, and the
    scenarios "deepseek-v2-lite" (the built-in shape ``deepseek-v2-lite-v3arch``) and "qwen3-30b-a3b",
    dummy bf16 weights on the GPU. Idempotent; registers in memory only (Hydra's ConfigStore).

    Args:
        model_dir: when given, the V2-Lite config is written there as config.json and the scenario points
            at that directory instead of the built-in shape.
    """
    from rayinfer.jobs import benchlib, roofline
    from rayinfer.model.shapes import SHAPES

    roofline.register_cost_model("DeepseekV3ForCausalLM", MoECost.from_config)
    roofline.register_cost_model("Qwen3MoeForCausalLM", Qwen3MoECost.from_config)
    v2_lite = "deepseek-v2-lite-v3arch"
    if model_dir is not None:
        shape = dict(SHAPES[v2_lite])
        v2_lite = str(write_shape(shape, Path(model_dir), shape.pop("model_type")))
    for name, model, description in (
        ("deepseek-v2-lite", v2_lite, "DeepSeek-V3 architecture with DeepSeek-V2-Lite dimensions"),
        ("qwen3-30b-a3b", "qwen3-30b-a3b", "Qwen3-30B-A3B shape (Qwen3-MoE, 128 experts, top-8)"),
    ):
        benchlib.register_scenario(benchlib.Scenario(
            name, f"{description}, dummy bf16 weights, on the GPU",
            {"model": {"model": model, "dtype": "bfloat16", "load_format": "dummy", "max_model_len": 8192},
             "engine": dict(_MOE_ENGINE), "offline": {"num_prompts": 200}, **_MOE_CASES},
        ))
