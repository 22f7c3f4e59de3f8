"""Qwen3-MoE decoder in plain PyTorch over the standard paged KV cache, with optional expert parallelism.

Parameter names match Hugging Face 5.x ``Qwen3MoeForCausalLM`` (stacked experts), and
:meth:`Qwen3MoeForCausalLM.load_weights` also takes per-expert checkpoint names. Attention is grouped-
query attention with an RMSNorm over each head's queries and keys before RoPE; MoE layers route with
softmax top-k (``norm_topk_prob``); ``decoder_sparse_step`` and ``mlp_only_layers`` pick the dense layers.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from rayinfer import envs
from rayinfer.kernels import gemv
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.gemv import fused_linear, gemv_applies
from rayinfer.kernels.matmul import dense_linear
from rayinfer.kernels.moe_routing import norm_router_logits
from rayinfer.kernels.paged_attention import paged_attention
from rayinfer.kernels.rotary import rotary_store_kv
from rayinfer.model.llama import PagedCausalLM, PreNormDecoderLayer, RMSNorm
from rayinfer.model.moe import ExpertParallelism, GatedMLP, MoEModelMixin, RoutedExperts, softmax_topk
from rayinfer.kernels.block_fp8 import WEIGHT_BLOCK
from rayinfer.model.quantization import SCALE_SUFFIX, linear


# 1: the per-head q/k RMSNorms run inside the RoPE + KV-write kernel; 0: as launches of their own (an A/B
# switch of jobs/bench_moe.py, variant qk-norm-apart).
QK_NORM_IN_ROPE = 1


class Qwen3MoeAttention(nn.Module):
    """Grouped-query attention; each projection may be block-fp8 (:func:`rayinfer.model.quantization.linear`)."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.qkv_proj: nn.Linear | None = None  # q, k and v stacked after loading (fuse_qkv)

    def fuse_qkv(self) -> bool:
        """Stack ``q_proj``, ``k_proj`` and ``v_proj`` into one ``qkv_proj`` (rows: q's, k's, v's), so a step
        runs one GEMM for the three (a decode step: two launches less a layer), as the Llama path does at
        load time. fp8 blocks stack when q's and k's rows fill whole 128-row blocks (Qwen3-30B-A3B's 4096
        and 512 do); their scales stack with them. Returns whether it fused (the originals are dropped)."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        fp8 = [getattr(m, "weight_scale_inv", None) is not None for m in parts]
        if self.qkv_proj is not None or len(set(fp8)) > 1 or (fp8[0] and (parts[0].out_features % 128
                                                                            or parts[1].out_features % 128)):
            return False
        has_bias = parts[0].bias is not None
        fused = nn.Linear(parts[0].in_features, sum(m.out_features for m in parts), bias=has_bias, device="meta")
        fused.weight = nn.Parameter(torch.cat([m.weight for m in parts]), requires_grad=False)
        if has_bias:
            fused.bias = nn.Parameter(torch.cat([m.bias for m in parts]), requires_grad=False)
        if fp8[0]:
            fused.register_parameter("weight_scale_inv", nn.Parameter(
                torch.cat([m.get_parameter("weight_scale_inv") for m in parts]), requires_grad=False))
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj
        return True

    def forward(self, hidden, positions, inv_freq, kv_cache, meta: AttentionMetadata):
        """hidden [T, hidden_size] -> [T, hidden_size]; writes this step's K/V into ``kv_cache`` (one layer)."""
        if self.qkv_proj is not None and QK_NORM_IN_ROPE:
            return linear(self.attend(linear(hidden, self.qkv_proj), positions, inv_freq, kv_cache, meta), self.o_proj)
        t, d = hidden.shape[0], self.head_dim
        if self.qkv_proj is not None:
            nq, nkv = self.num_heads * d, self.num_kv_heads * d
            q, k, v = linear(hidden, self.qkv_proj).split([nq, nkv, nkv], dim=-1)
            v = v.view(t, self.num_kv_heads, d)  # strided rows: the rotary kernel takes them as they are
        else:
            q, k = linear(hidden, self.q_proj), linear(hidden, self.k_proj)
            v = linear(hidden, self.v_proj).view(t, self.num_kv_heads, d)
        # per-head norms over rows of head_dim, inside the RoPE + KV-write launch (q and k read in place as
        # column slices of the stacked projection)
        if QK_NORM_IN_ROPE:
            q, k = q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d)
            q = rotary_store_kv(q, k, v, positions, inv_freq, kv_cache, meta.slot_mapping,
                                qk_norm=(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps))
        else:  # launches of their own (a copy of q's and k's columns when q, k, v are stacked)
            q = self.q_norm(q.reshape(-1, d)).view(t, self.num_heads, d)
            k = self.k_norm(k.reshape(-1, d)).view(t, self.num_kv_heads, d)
            q = rotary_store_kv(q, k, v, positions, inv_freq, kv_cache, meta.slot_mapping)
        out = paged_attention(q, kv_cache, meta, self.scale)
        return linear(out.reshape(t, self.num_heads * d), self.o_proj)

    def attend(self, qkv: torch.Tensor, positions, inv_freq, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """The attention between the stacked projection and ``o_proj``: qkv [T, (H + 2 * H_kv) * head_dim]
        (``qkv_proj``'s output) -> [T, H * head_dim]; q/k norms and RoPE in the KV-write launch, the step's
        K/V written into ``kv_cache``. Raises: AssertionError without ``qkv_proj`` (:meth:`fuse_qkv`)."""
        assert self.qkv_proj is not None
        t, d = qkv.shape[0], self.head_dim
        nq, nkv = self.num_heads * d, self.num_kv_heads * d
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        q = rotary_store_kv(q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d),
                            v.view(t, self.num_kv_heads, d), positions, inv_freq, kv_cache, meta.slot_mapping,
                            qk_norm=(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps))
        return paged_attention(q, kv_cache, meta, self.scale).reshape(t, nq)


class Qwen3MoeRouter(nn.Module):
    """Router weights under the Hugging Face name ``mlp.gate.weight``: [num_experts, hidden_size]."""

    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Softmax top-k routing over the routed experts (no shared expert)."""

    def __init__(self, config, ep: ExpertParallelism, moe_layer: int):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Qwen3MoeRouter(config)
        self.experts = RoutedExperts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size,
            group=ep.group, phy2log=ep.layer_phy2log(moe_layer, config.num_experts),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]."""
        weights, ids = softmax_topk(dense_linear(hidden, self.gate.weight), self.top_k, self.norm_topk_prob)
        return self.experts(hidden, ids, weights)

    def forward_norm_residual(self, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The block over ``norm(residual)``, its output added into ``residual`` in place (returned): the
        norm in the router kernel's prologue where it applies (``moe_routing.norm_router_logits``), the sum
        added by the fused MoE kernel's last launch. residual [T, hidden_size]. The router's float32 logits
        are rounded to the model dtype, as :meth:`forward`'s router GEMM rounds them, so both route alike."""
        logits, hidden = norm_router_logits(residual, norm.weight, norm.eps, self.gate.weight)
        weights, ids = softmax_topk(logits.to(residual.dtype), self.top_k, self.norm_topk_prob)
        return self.experts(hidden, ids, weights, residual=residual)


def _is_sparse(config, layer_idx: int) -> bool:
    """Hugging Face's rule for which decoder layers are MoE."""
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_idx: int, ep: ExpertParallelism, moe_layer: int):
        super().__init__()
        self.self_attn = Qwen3MoeAttention(config)
        if _is_sparse(config, layer_idx):
            self.mlp = Qwen3MoeSparseMoeBlock(config, ep, moe_layer)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward_one_row(self, h: torch.Tensor, positions, inv_freq, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """The layer for one token (batch-1 decode); ``h`` [1, hidden] is the residual stream itself, updated
        in place and returned (as ``LlamaDecoderLayer.forward_one_row``).

        input_layernorm runs in the prologue of the ``qkv_proj`` GEMV and the attention's residual add in the
        epilogue of the ``o_proj`` GEMV (``kernels.gemv.fused_linear``); post_attention_layernorm runs in the
        router kernel's prologue (:meth:`Qwen3MoeSparseMoeBlock.forward_norm_residual`), whose output the
        fused MoE kernel adds into ``h``; a dense layer's MLP runs as in :meth:`forward`. Needs ``qkv_proj``
        (:meth:`Qwen3MoeAttention.fuse_qkv`; :meth:`Qwen3MoeForCausalLM.process_weights_after_loading`
        checks). Same result as :meth:`forward` up to rounding (the normed inputs of the GEMVs are not
        rounded to the model dtype)."""
        attn = self.self_attn
        assert attn.qkv_proj is not None
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv = fused_linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias, norm_weight=norm1.weight, eps=norm1.eps,
                           weight_scale=attn.qkv_proj._parameters.get(SCALE_SUFFIX))
        out = attn.attend(qkv, positions, inv_freq, kv_cache, meta)
        fused_linear(out, attn.o_proj.weight, attn.o_proj.bias, residual=h,
                     weight_scale=attn.o_proj._parameters.get(SCALE_SUFFIX))
        mlp = self.mlp
        if isinstance(mlp, Qwen3MoeSparseMoeBlock):
            mlp.forward_norm_residual(h, norm2)
        else:  # a dense layer (``mlp_only_layers``; Qwen3-30B-A3B has none)
            h.add_(mlp(norm2(h)))
        return h


class Qwen3MoeModel(nn.Module):
    def __init__(self, config, ep: ExpertParallelism):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers, moe_layer = [], 0
        for i in range(config.num_hidden_layers):
            layers.append(Qwen3MoeDecoderLayer(config, i, ep, moe_layer))
            moe_layer += _is_sparse(config, i)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3MoeForCausalLM(MoEModelMixin, PagedCausalLM):
    """Qwen3-MoE with an LM head; the engine's model interface (see ``rayinfer.model.llama``).

    Expert parallelism: pass ``ep`` (group, physical slots, initial phy2log); every rank of the group
    must then run ``forward`` at every step, with zero tokens if it has none (the MoE layers meet in
    collectives). Attention and dense weights are replicated; each rank keeps its own KV cache.
    Block-fp8 linears and routed experts as DeepSeek-V3 (:mod:`rayinfer.model.quantization`).
    """

    supports_block_fp8 = True

    def __init__(self, config, ep: ExpertParallelism | None = None):
        """Raises: ValueError for sliding-window attention, which this model does not implement."""
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen3-MoE with use_sliding_window=True is not supported")
        self.config = config
        self.model = Qwen3MoeModel(config, ep or ExpertParallelism())
        self._init_head(config)
        self.one_row_fusion = False  # process_weights_after_loading decides

    def forward(self, input_ids, positions, kv_cache, meta):
        """:meth:`PagedCausalLM.forward`; a one-token step on the GPU in bf16/fp16 (batch-1 decode) runs each
        layer through :meth:`Qwen3MoeDecoderLayer.forward_one_row` when ``one_row_fusion`` holds."""
        if input_ids.shape[0] == 1 and self.one_row_fusion:
            w = self.model.embed_tokens.weight
            if gemv_applies(w[:1], w):  # the [1, hidden] embedding row: 16-bit on a GPU, not batch-invariant
                hidden = self.model.embed_tokens(input_ids)
                for i, layer in enumerate(self.model.layers):
                    cast(Qwen3MoeDecoderLayer, layer).forward_one_row(hidden, positions, self.inv_freq,
                                                                      kv_cache[i], meta)
                return self.model.norm(hidden)
        return super().forward(input_ids, positions, kv_cache, meta)

    def process_weights_after_loading(self) -> None:
        """Called by ``model.loader.load_model`` once the weights are in: stacks each attention's q, k and v
        projections (:meth:`Qwen3MoeAttention.fuse_qkv`). A model built and loaded by hand runs unfused, with
        the same outputs up to float summation order. Then turns on ``one_row_fusion`` (unless
        RAYINFER_ONE_ROW_FUSION=0) when every attention has ``qkv_proj`` and its GEMV-read weights
        (``qkv_proj``, ``o_proj``) are 16-bit, or fp8 blocks with ``kernels.gemv.FP8_WEIGHTS``."""
        for module in self.modules():
            if isinstance(module, Qwen3MoeAttention):
                module.fuse_qkv()
        attns = [cast(Qwen3MoeDecoderLayer, layer).self_attn for layer in self.model.layers]
        self.one_row_fusion = envs.one_row_fusion() and all(
            a.qkv_proj is not None and (bool(gemv.FP8_WEIGHTS) or not any(
                SCALE_SUFFIX in m._parameters for m in (a.qkv_proj, a.o_proj)))
            for a in attns)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters and buffers under the Hugging Face 5.x names, whatever
        :meth:`process_weights_after_loading` stacked: ``qkv_proj`` as ``q_proj`` / ``k_proj`` / ``v_proj``
        (row views; fp8 scales alike). For an HF twin, and to load into another model of this class."""
        out = dict(self.state_dict())
        for name, module in self.named_modules():
            if isinstance(module, Qwen3MoeAttention) and module.qkv_proj is not None:
                d = module.head_dim
                rows = [module.num_heads * d, module.num_kv_heads * d, module.num_kv_heads * d]
                for leaf, t in module.qkv_proj.state_dict().items():
                    del out[f"{name}.qkv_proj.{leaf}"]
                    sizes = [r // WEIGHT_BLOCK[0] for r in rows] if leaf == SCALE_SUFFIX else rows
                    for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split(sizes)):
                        out[f"{name}.{part}.{leaf}"] = piece
        return out

