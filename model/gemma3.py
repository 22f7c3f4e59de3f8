"""Gemma 3 text decoder (``Gemma3ForCausalLM``) in plain PyTorch over a paged KV cache.

After Hugging Face transformers' ``models/gemma3/modeling_gemma3.py``; parameter names match it (q/k/v
and gate/up are stacked on load, as for Llama). What differs from Llama:

- embeddings are scaled by ``sqrt(hidden_size)`` (in the weights' dtype);
- RMSNorm multiplies by ``1 + w`` in float32; q and k are RMS-normalized per head before RoPE;
- each layer has four norms: ``x + post_attn_norm(attn(input_norm(x)))``, then
  ``x + post_ff_norm(mlp(pre_ff_norm(x)))``; the MLP is GELU(tanh)-gated;
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5``, optionally soft-capped;
- ``layer_types`` mixes ``sliding_attention`` layers (window ``sliding_window``, RoPE theta of the
  sliding layers) with ``full_attention`` layers (global RoPE theta);
- final logits are optionally soft-capped (``final_logit_softcapping``).

KV cache groups: the engine keeps one cache for the full-attention ("global") layers and, with
``AttentionMetadata.local`` set, a second one for the sliding ("local") layers whose block tables hold
only each request's last window of blocks (see ``engine.kv_cache_manager``). ``kv_cache`` is then a
pair ``(global cache [G, N, ...], local cache [S, M, ...])``; a single tensor ``[L, N, ...]`` is also
accepted (every layer in one table, the sliding window applied by masking only).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.matmul import dense_linear
from rayinfer.kernels.paged_attention import paged_attention
from rayinfer.kernels.rotary import rope_inv_freq, rotary_store_kv
from rayinfer.model.llama import LlamaForCausalLM, PagedCausalLM


class Gemma3RMSNorm(nn.Module):
    """RMSNorm with a zero-centred weight: ``(x / rms(x)) * (1 + w)`` in float32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.softcap = config.attn_logit_softcapping
        if self.softcap is not None:
            raise ValueError("attn_logit_softcapping is not supported by the paged attention kernels")
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if self.is_sliding else None

    def forward(self, hidden, positions, inv_freq, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; writes this layer's new K/V at ``meta.slot_mapping``."""
        t = hidden.shape[0]
        qkv = dense_linear(hidden, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q = rotary_store_kv(q, k, v, positions, inv_freq, kv_cache, meta.slot_mapping)
        out = paged_attention(q, kv_cache, meta, self.scale, self.sliding_window)
        return dense_linear(out.reshape(t, self.q_size), self.o_proj.weight, self.o_proj.bias)


class Gemma3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = dense_linear(x, self.gate_up_proj.weight, None).chunk(2, dim=-1)
        return dense_linear(F.gelu(gate, approximate="tanh") * up, self.down_proj.weight, None)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.mlp = Gemma3MLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = Gemma3RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps)

    def forward(self, hidden, positions, inv_freq, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(hidden), positions, inv_freq, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(h)


class Gemma3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = math.sqrt(config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)


def _rope_theta(config, layer_type: str) -> float:
    """RoPE base of a layer type: ``rope_parameters[type]`` (transformers 5), else the v4 fields."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params and params[layer_type]:
        return params[layer_type]["rope_theta"]
    if layer_type == "sliding_attention":
        return getattr(config, "rope_local_base_freq", 10000.0)
    return getattr(config, "rope_theta", 1_000_000.0)


class Gemma3ForCausalLM(PagedCausalLM):
    """Gemma 3 decoder with the tied LM head (see :class:`PagedCausalLM` for the interface).

    ``sliding_window``: W of the sliding layers; ``is_sliding``: [L] per layer;
    ``global_layers`` / ``local_layers``: indices of the full-attention and sliding layers, the order of
    each group's cache (see :meth:`kv_cache_group_shapes`).
    """

    supports_fp8_kv_cache = True
    _STACKED = LlamaForCausalLM._STACKED
    load_weights = LlamaForCausalLM.load_weights

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.sliding_window: int = config.sliding_window
        self.is_sliding = [layer.self_attn.is_sliding for layer in self.model.layers]
        self.global_layers = [i for i, s in enumerate(self.is_sliding) if not s]
        self.local_layers = [i for i, s in enumerate(self.is_sliding) if s]
        head_dim = config.head_dim
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, _rope_theta(config, "full_attention")),
                             persistent=False)
        self.register_buffer("local_inv_freq", rope_inv_freq(head_dim, _rope_theta(config, "sliding_attention")),
                             persistent=False)

    def kv_cache_group_shapes(self, num_blocks: int, num_local_blocks: int, block_size: int):
        """Shapes of the (global, local) caches: [G, num_blocks, 2, bs, Hkv, D] and [S, num_local_blocks, ...]."""
        attn = self.model.layers[0].self_attn
        tail = (2, block_size, attn.num_kv_heads, attn.head_dim)
        return (len(self.global_layers), num_blocks, *tail), (len(self.local_layers), num_local_blocks, *tail)

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Run the decoder over this step's new tokens (see :meth:`PagedCausalLM.forward`).

        ``kv_cache``: one tensor [L, N, 2, bs, Hkv, D] (all layers share ``meta``'s tables), or the pair
        ``(global [G, N, ...], local [S, M, ...])`` with the sliding layers' tables in ``meta.local``.
        """
        hidden = self.model.embed_tokens(input_ids)
        # the scale rounded to the weights' dtype first, as Hugging Face does
        hidden = hidden * float(torch.tensor(self.model.embed_scale, dtype=hidden.dtype))
        grouped = isinstance(kv_cache, (tuple, list))
        local_meta = meta.local if grouped and meta.local is not None else meta
        slots = {"global": 0, "local": 0}
        for i, layer in enumerate(self.model.layers):
            sliding = self.is_sliding[i]
            inv_freq = self.local_inv_freq if sliding else self.inv_freq
            if grouped:
                group = "local" if sliding else "global"
                cache = kv_cache[1 if sliding else 0][slots[group]]
                slots[group] += 1
            else:
                cache = kv_cache[i]
            hidden = layer(hidden, positions, inv_freq, cache, local_meta if sliding else meta)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32, soft-capped when the config says so."""
        logits = dense_linear(hidden, self.lm_head.weight, None).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
