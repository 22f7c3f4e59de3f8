"""Llama-architecture decoder in plain PyTorch over a paged KV cache.

Parameter names match Hugging Face ``LlamaForCausalLM`` so a safetensors state dict loads as is.
Works for Llama 2/3, SmolLM2, Mistral-style GQA models without sliding windows.
"""

from __future__ import annotations

import torch
from torch import nn

from rayinfer import envs
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.gemv import fused_linear, gemv_applies, linear, silu_and_mul_linear
from rayinfer.kernels.matmul import dense_linear
from rayinfer.kernels.norm import rms_norm
from rayinfer.kernels.paged_attention import paged_attention
from rayinfer.kernels.rotary import rope_inv_freq, rotary_store_kv


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v in one GEMM (checkpoint's q_proj/k_proj/v_proj are stacked by load_weights)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.scale = self.head_dim**-0.5
        self.layer_idx = layer_idx

    def forward(self, hidden, positions, inv_freq, kv_cache, meta: AttentionMetadata):
        qkv = dense_linear(hidden, self.qkv_proj.weight, self.qkv_proj.bias)
        out = self.attend(qkv, positions, inv_freq, kv_cache, meta)
        # one row (batch-1 decode on the GPU): a GEMV without cuBLAS's split-K reduction kernel
        return linear(out, self.o_proj.weight, self.o_proj.bias)

    def attend(self, qkv, positions, inv_freq, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """RoPE, KV-cache write and paged attention of the QKV projection's output [T, q + 2 kv];
        returns the attention output [T, num_heads * head_dim] (before o_proj)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q = rotary_store_kv(q, k, v, positions, inv_freq, kv_cache, meta.slot_mapping)
        return paged_attention(q, kv_cache, meta, self.scale).reshape(t, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        # gate and up in one GEMM whose output is silu_and_mul's [gate, up] input
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x):
        # silu_and_mul then down_proj: one fused GEMV for a single row on the GPU, else two kernels
        gate_up = dense_linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        return silu_and_mul_linear(gate_up, self.down_proj.weight, self.down_proj.bias)


class PreNormDecoderLayer(nn.Module):
    """A pre-norm decoder layer, ``x + attn(norm(x))`` then ``+ mlp(norm(.))``, with each residual add
    fused into the next norm. Subclasses set ``self_attn``, ``mlp``, ``input_layernorm`` and
    ``post_attention_layernorm``; ``attn_args`` go to ``self_attn`` unchanged (positions/RoPE tables,
    the layer's KV cache, the step's AttentionMetadata).

    Returns ``(mlp output, residual)``: the caller adds them in the next layer's (or the final) norm.
    """

    def forward(self, hidden, residual, *attn_args):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, *attn_args)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward_one_row(self, h, positions, inv_freq, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """The layer for one token (batch-1 decode) in four GEMV launches plus attention.

        ``h`` [1, hidden] is the residual stream itself, updated in place and returned. Each RMSNorm
        runs in the prologue of the projection after it (QKV, gate/up) and each residual add in the
        epilogue of the projection before it (o_proj, down_proj), so the layer launches no norm,
        activation or add kernel (see ``kernels.gemv.fused_linear``). Same result as :meth:`forward`
        up to rounding (the normalized input is not rounded to the model dtype).
        """
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv = fused_linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias, norm_weight=norm1.weight, eps=norm1.eps)
        out = attn.attend(qkv, positions, inv_freq, kv_cache, meta)
        fused_linear(out, attn.o_proj.weight, attn.o_proj.bias, residual=h)
        gate_up = fused_linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, norm_weight=norm2.weight,
                               eps=norm2.eps)
        fused_linear(gate_up, mlp.down_proj.weight, mlp.down_proj.bias, silu_and_mul_input=True, residual=h)
        return h


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class PagedCausalLM(nn.Module):
    """The engine's model interface, shared by every decoder in ``rayinfer.model``:

        ``kv_cache_shape(num_blocks, block_size)`` -> shape of the whole cache tensor,
        ``forward(input_ids, positions, kv_cache, meta)`` -> hidden states,
        ``compute_logits(hidden)`` -> float32 logits.

    Subclasses build ``self.model`` (``embed_tokens``, ``layers`` of :class:`PreNormDecoderLayer`,
    ``norm``) and an ``lm_head`` (:meth:`_init_head` for the GQA models). Each layer's attention takes
    ``(*rope_args(positions, hidden), kv_cache, meta)``: here the positions and inverse frequencies over
    the standard paged cache; DeepSeek-V3's MLA overrides :meth:`rope_args` and :meth:`kv_cache_shape`
    (its compressed cache).

    ``supports_fp8_kv_cache``: the attention path (``rotary_store_kv``, ``paged_attention``) accepts a
    float8_e4m3fn cache (``EngineConfig.kv_cache_dtype="fp8"``).
    """

    supports_fp8_kv_cache = True

    def _init_head(self, config) -> None:
        """LM head (tied to the embeddings when the config says so) and the RoPE frequencies."""
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        rope_scaling = getattr(config, "rope_scaling", None)
        rope_params = getattr(config, "rope_parameters", None) or {}
        theta = rope_params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        head_dim = self.model.layers[0].self_attn.head_dim
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, rope_scaling), persistent=False)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]: the versioned payload layout."""
        attn = self.model.layers[0].self_attn
        return (len(self.model.layers), num_blocks, 2, block_size, attn.num_kv_heads, attn.head_dim)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Run the decoder over this step's new tokens.

        Args:
            input_ids: [T] int64 new tokens of all requests, concatenated (T may be 0 under EP).
            positions: [T] int64 their positions.
            kv_cache: the tensor of :meth:`kv_cache_shape`; written in place at ``meta.slot_mapping``.
            meta: the step's :class:`AttentionMetadata`.
        Returns:
            hidden: [T, hidden_size], after the final norm.
        """
        return PagedCausalLM.forward_with_prenorm(self, input_ids, positions, kv_cache, meta)[0]

    def forward_with_prenorm(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`, also returning the last layer's hidden states before the final norm (what
        DeepSeek-V3's MTP modules read).

        ``inputs_embeds`` [T, hidden_size]: the decoder's input rows instead of ``embed_tokens(input_ids)``
        (a vision-language model's prompt with image features spliced in, see ``rayinfer.model.llava``).

        Returns:
            (hidden after the final norm, hidden before it): both [T, hidden_size] in the model dtype.
        """
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rope_args(positions, hidden)
        residual = None
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer(hidden, residual, *rope, kv_cache[i], meta)
        return self.model.norm(hidden, residual)

    def rope_args(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple:
        """What every layer's attention takes for RoPE: (positions [T] int64, inv_freq [head_dim/2] fp32)."""
        return positions, self.inv_freq

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32."""
        return dense_linear(hidden, self.lm_head.weight, self.lm_head.bias).float()


class LlamaForCausalLM(PagedCausalLM):
    """Llama decoder with an LM head (see :class:`PagedCausalLM` for the interface).

    ``one_row_fusion``: a step of one token on the GPU in bf16/fp16 (batch-1 decode) runs each layer
    through :meth:`LlamaDecoderLayer.forward_one_row` (norms and residual adds fused into the GEMVs);
    on unless the environment sets ``RAYINFER_ONE_ROW_FUSION=0``.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.one_row_fusion = envs.one_row_fusion()
        self.model = LlamaModel(config)
        self._init_head(config)

    def forward(self, input_ids, positions, kv_cache, meta):
        w = self.model.layers[0].self_attn.qkv_proj.weight
        # w[:1] stands in for the [1, hidden] embedding row: same dtype and device
        if input_ids.shape[0] == 1 and self.one_row_fusion and gemv_applies(w[:1], w):
            return self.forward_one_row(self.model.embed_tokens(input_ids), positions, kv_cache, meta)
        return super().forward(input_ids, positions, kv_cache, meta)

    def forward_one_row(self, hidden, positions, kv_cache, meta) -> torch.Tensor:
        """:meth:`forward` for one token from its embedding ``hidden`` [1, hidden_size] (overwritten)."""
        for i, layer in enumerate(self.model.layers):
            layer.forward_one_row(hidden, positions, self.inv_freq, kv_cache[i], meta)
        return self.model.norm(hidden)

    # checkpoint name -> (fused parameter, shard index); shards are stacked along the output dim
    _STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, named_tensors) -> set[str]:
        """Load Hugging Face-named tensors, stacking q/k/v and gate/up into the fused projections.

        Args:
            named_tensors: iterable of (checkpoint name, tensor).
        Returns:
            the names (in this model's ``state_dict``) that were written.
        Raises:
            KeyError: for a name the model does not have; ValueError: on a shape mismatch.
        """
        params = self.state_dict(keep_vars=True)
        loaded: set[str] = set()
        shards: dict[str, set[int]] = {}  # fused parameter -> shards written
        for name, tensor in named_tensors:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            parts = name.split(".")
            target, offset = name, None
            if len(parts) >= 2 and parts[-2] in self._STACKED:
                fused, shard = self._STACKED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
                module = self.get_submodule(".".join(parts[:-2]))
                sizes = ([module.q_size, module.kv_size, module.kv_size] if fused == "qkv_proj"
                         else [module.down_proj.in_features] * 2)
                offset = (sum(sizes[:shard]), sizes[shard])
            if target not in params:
                raise KeyError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
            dest = params[target] if offset is None else params[target].narrow(0, *offset)
            if dest.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            with torch.no_grad():
                dest.copy_(tensor)
            if offset is None:
                loaded.add(target)
            else:
                got = shards.setdefault(target, set())
                got.add(shard)
                if len(got) == (3 if fused == "qkv_proj" else 2):
                    loaded.add(target)
        if getattr(self.config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in loaded:
            loaded.add("lm_head.weight")
        return loaded
