"""DeepSeek-V3 decoder in plain PyTorch: multi-head latent attention (MLA) over a compressed paged KV
cache, dense first layers, then MoE layers (shared + routed experts, grouped top-k sigmoid routing).

Parameter names match Hugging Face 5.x ``DeepseekV3ForCausalLM``; :meth:`DeepseekV3ForCausalLM.load_weights`
also takes the per-expert names of the released checkpoints and their multi-token-prediction (MTP)
layers (loaded with ``enable_mtp=True``, skipped otherwise). The cache holds per token the normalized
latent ``c_kv`` (``kv_lora_rank``) and the roped shared key ``k_pe`` (``qk_rope_head_dim``):
[num_layers, num_blocks, block_size, R + P]. Glossary of R, P, Dn, Dv: ``rayinfer.kernels.mla_attention``.

MTP (DeepSeek-V3 technical report, arXiv:2412.19437 §2.2): module ``d`` predicts one token further
than its input. For the target's hidden state ``h_i`` at position i (last layer, before the final
norm) and the next token ``t_{i+1}``::

    h'_i  = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))    # [T, 2H] -> [T, H]
    o_i   = decoder block(h'_i)  (MLA over the module's own KV, MoE) + its residual  (pre-norm)
    logits(t_{i+2}) = lm_head(shared_head.norm(o_i))

with the embedding and the LM head shared with the main model. ``o_i`` chains: fed back with the
drafted token it predicts, it drafts the next one (how :class:`rayinfer.engine.spec_decode.MtpProposer`
drafts k > 1 tokens with one module). The concatenation order (embedding first) is that of the released
checkpoints' ``eh_proj`` (the report's equation writes the hidden state first).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from rayinfer import envs
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels import gemv
from rayinfer.kernels.gemv import fused_linear, gemv_applies
from rayinfer.kernels.matmul import dense_linear
from rayinfer.kernels.mla_attention import ABSORBED_MAX_QUERY_LEN, mla_decode, mla_prefill, use_absorbed
from rayinfer.kernels.mla_rope import mla_rope_store, mla_rope_store_absorb
from rayinfer.model.llama import PagedCausalLM, PreNormDecoderLayer, RMSNorm
from rayinfer.kernels.moe_routing import grouped_topk, norm_router_logits, router_logits
from rayinfer.model.moe import ExpertParallelism, GatedMLP, MoEModelMixin, RoutedExperts
from rayinfer.kernels.block_fp8 import WEIGHT_BLOCK
from rayinfer.model.quantization import SCALE_SUFFIX, linear

# A/B switches of jobs/bench_moe.py: ROPE_TABLE 0 computes RoPE's cos/sin each step (variant ``rope-formula``);
# DENSE_ONE_ROW_GEMV 0 runs a dense layer's MLP in a one-token step on the generic kernels (``dense-mlp-cublas``).
ROPE_TABLE = 1
DENSE_ONE_ROW_GEMV = 1


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_rope(config) -> tuple[torch.Tensor, float, float]:
    """RoPE frequencies of the rope part of each head, and the two YaRN scalings.

    Reads ``config.rope_parameters`` (transformers 5.x) or ``rope_scaling`` / ``rope_theta`` (4.x).

    Returns:
        (inv_freq [P // 2] float32, cos/sin multiplier, softmax-scale multiplier); both multipliers are
        1.0 for the default rope type.
    Raises:
        ValueError: for a rope type other than "default" and "yarn".
    Source: Peng et al., "YaRN" (2023); Hugging Face ``_compute_yarn_parameters`` and ``yarn_apply_mscale``.
    """
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.update(getattr(config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    dim = config.qk_rope_head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if kind in (None, "default"):
        return inv_freq, 1.0, 1.0
    if kind != "yarn":
        raise ValueError(f"unsupported rope type {kind!r} for DeepSeek-V3 (supported: default, yarn)")
    old_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / old_len
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    softmax_factor = _yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return inv_freq, float(attention_factor), softmax_factor


class DeepseekV3Attention(nn.Module):
    """MLA with optional low-rank queries (``q_lora_rank``); see ``rayinfer.kernels.mla_attention``.

    With block-fp8 weights (:mod:`rayinfer.model.quantization`) every projection but ``kv_b_proj`` is
    fp8: the absorbed form reads ``kv_b_proj.weight`` per head as W_UK / W_UV (batched matmuls over its
    views) and the expanded form passes it to :func:`mla_prefill`, so an fp8 checkpoint's ``kv_b_proj``
    is dequantized to the model dtype once at load (as SGLang does), and online quantization leaves it
    as it is.
    """

    def __init__(self, config, softmax_factor: float):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.interleave = getattr(config, "rope_interleave", True)
        qk_dim = self.nope_dim + self.rope_dim
        hidden, bias = config.hidden_size, getattr(config, "attention_bias", False)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # Hugging Face's default eps, not rms_norm_eps
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.scale = qk_dim**-0.5 * softmax_factor
        self.qkv_a_proj: nn.Linear | None = None  # fuse_qkv_a

    @torch.no_grad()
    def fuse_qkv_a(self) -> bool:
        """Stack the two projections of the hidden state, ``q_proj`` (or ``q_a_proj`` with q_lora) and
        ``kv_a_proj_with_mqa``, into one ``qkv_a_proj`` (rows: the query's, then the latent's and k_pe's),
        so a step runs one GEMM for both (a decode step: one launch less a layer; after SGLang's
        ``fused_qkv_a_proj_with_mqa``). fp8 blocks stack when the query's rows fill whole 128-row blocks
        (3072 and 1536 do); their scales stack with them. Returns whether it fused (the originals are
        dropped)."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        second = self.kv_a_proj_with_mqa
        fp8 = [getattr(m, "weight_scale_inv", None) is not None for m in (first, second)]
        if self.qkv_a_proj is not None or fp8[0] != fp8[1] or (fp8[0] and first.out_features % 128):
            return False
        w = first.weight
        fused = nn.Linear(w.shape[1], first.out_features + second.out_features, bias=second.bias is not None,
                          device="meta")
        fused.weight = nn.Parameter(torch.cat([w, second.weight]), requires_grad=False)
        if second.bias is not None:
            lead = first.bias if first.bias is not None else second.bias.new_zeros(first.out_features)
            fused.bias = nn.Parameter(torch.cat([lead, second.bias]), requires_grad=False)
        if fp8[0]:
            fused.register_parameter("weight_scale_inv", nn.Parameter(
                torch.cat([cast(torch.Tensor, first.weight_scale_inv), cast(torch.Tensor, second.weight_scale_inv)]),
                requires_grad=False))
        self.qkv_a_proj = fused
        if self.q_lora_rank is None:
            del self.q_proj
        else:
            del self.q_a_proj
        del self.kv_a_proj_with_mqa
        return True

    def forward(self, hidden, cos, sin, kv_cache, meta: AttentionMetadata):
        """hidden [T, hidden_size] -> [T, hidden_size]; writes this step's latents into ``kv_cache`` (one layer).

        Steps whose queries are all short (decode, speculative verification: at most
        ``ABSORBED_MAX_QUERY_LEN`` tokens per request, :func:`use_absorbed`) attend in the absorbed form
        (:func:`mla_decode`), others expanded (:func:`mla_prefill`). In batch-invariant mode
        (``kernels.batch_invariant``) every step takes the absorbed form, so a token's attention is the
        same arithmetic whether its step is a prefill, an extend or a decode and whatever the step's other
        requests do (the two forms round differently); the projections then run through the persistent
        matmul (per head for the absorbed ones).
        """
        if self.qkv_a_proj is not None:  # one GEMM for the two projections of the hidden state (fuse_qkv_a)
            return linear(self.attend(linear(hidden, self.qkv_a_proj), cos, sin, kv_cache, meta), self.o_proj)
        if self.q_lora_rank is None:
            q = linear(hidden, self.q_proj)
        else:
            q = linear(self.q_a_layernorm(linear(hidden, self.q_a_proj)), self.q_b_proj)
        kv_a = linear(hidden, self.kv_a_proj_with_mqa)
        return linear(self._attend(q, kv_a, cos, sin, kv_cache, meta), self.o_proj)

    def attend(self, qkv_a: torch.Tensor, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """The attention after ``qkv_a_proj`` (:meth:`fuse_qkv_a`): qkv_a [T, rows of qkv_a_proj] (the
        query or q_lora's q_a, then the latent and k_pe) -> [T, H * v_head_dim], before ``o_proj``; writes
        this step's latents into ``kv_cache``. With one row in bf16/fp16 on the GPU, q_lora's q_b_proj
        runs as one GEMV with q_a_layernorm in its prologue (``kernels.gemv.fused_linear``; fp8 blocks too)."""
        assert self.qkv_a_proj is not None
        q_or_q_a, kv_a = qkv_a.split(
            [self.qkv_a_proj.out_features - self.kv_lora_rank - self.rope_dim, self.kv_lora_rank + self.rope_dim], -1)
        if self.q_lora_rank is None:
            q = q_or_q_a
        elif gemv_applies(q_or_q_a, self.q_b_proj.weight, scale := self.q_b_proj._parameters.get(SCALE_SUFFIX)):
            norm = self.q_a_layernorm
            q = fused_linear(q_or_q_a, self.q_b_proj.weight, norm_weight=norm.weight, eps=norm.eps, weight_scale=scale)
        else:
            q = linear(self.q_a_layernorm(q_or_q_a), self.q_b_proj)
        return self._attend(q, kv_a, cos, sin, kv_cache, meta)

    def _attend(self, q: torch.Tensor, kv_a: torch.Tensor, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H * (Dn + P)], kv_a [T, R + P] -> attention output [T, H * v_head_dim] (before o_proj)."""
        t, heads = q.shape[0], self.num_heads
        # explicit sizes: an EP rank without work runs this over t = 0 tokens, where -1 is ambiguous
        q = q.view(t, heads, self.nope_dim + self.rope_dim)
        q_nope = q[..., : self.nope_dim]
        # the latent's RMSNorm, RoPE of q_pe and k_pe, and the cache store: one kernel on the GPU (at decode
        # sizes with the absorbed query's W_UK product in the same launch)
        norm = self.kv_a_layernorm
        if use_absorbed(meta):
            w_kv_b = self.kv_b_proj.weight.view(heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
            # per head h: q_latent[:, h] = q_nope[:, h] @ W_UK[h] ([Dn, R]); out[:, h] = latent @ W_UV[h].T
            q_latent, q_pe = mla_rope_store_absorb(q, kv_a, norm.weight, norm.eps, cos, sin, kv_cache,
                                                   meta.slot_mapping, self.interleave, w_kv_b)  # [T, H, R]
            out = mla_decode(q_latent, q_pe, kv_cache, meta, self.scale, w_uv=w_kv_b[:, self.nope_dim :])
        else:
            q_pe = mla_rope_store(q, kv_a, norm.weight, norm.eps, cos, sin, kv_cache, meta.slot_mapping,
                                  self.interleave)
            out = mla_prefill(q_nope, q_pe, kv_cache, meta, self.kv_b_proj.weight, self.scale)
        return out.reshape(t, heads * self.v_dim)


class DeepseekV3TopkRouter(nn.Module):
    """Router weights under Hugging Face names: ``weight`` [L, H] and ``e_score_correction_bias`` [L]."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))


class DeepseekV3MoE(nn.Module):
    """Shared experts plus routed experts chosen by grouped top-k sigmoid routing."""

    def __init__(self, config, ep: ExpertParallelism, moe_layer: int):
        super().__init__()
        if config.n_routed_experts % config.n_group or config.n_routed_experts // config.n_group < 2:
            raise ValueError(f"n_routed_experts={config.n_routed_experts} must split into n_group={config.n_group} "
                             "groups of at least 2")
        self.config = config
        self.gate = DeepseekV3TopkRouter(config)
        self.experts = RoutedExperts(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
            group=ep.group, phy2log=ep.layer_phy2log(moe_layer, config.n_routed_experts),
        )
        self.shared_experts: GatedMLP | None = GatedMLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.hidden_act
        )

    def fuse_shared_experts(self) -> bool:
        """Move the shared experts into the routed experts' slots where the layer allows it
        (``RoutedExperts.fuse_shared_experts``; one rank, no replicas). Returns whether it did."""
        if self.shared_experts is None or not self.experts.accepts_shared(self.shared_experts):
            return False
        self.experts.fuse_shared_experts(self.shared_experts)
        self.shared_experts = None
        return True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; routing in float32 as Hugging Face."""
        return self._experts(hidden, router_logits(hidden, self.gate.weight), None)

    def forward_norm_residual(self, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The layer over ``norm(residual)``, its output added into ``residual`` in place (returned): the
        norm in the router kernel's prologue where it applies (``moe_routing.norm_router_logits``)."""
        logits, hidden = norm_router_logits(residual, norm.weight, norm.eps, self.gate.weight)
        return self._experts(hidden, logits, residual)

    def _experts(self, hidden: torch.Tensor, logits: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Grouped top-k routing of ``logits`` and the experts over ``hidden``; added into ``residual`` in
        place (inside the fused MoE kernel's last launch when the shared experts are fused) when given."""
        c = self.config
        weights, ids = grouped_topk(logits, self.gate.e_score_correction_bias.float(), c.num_experts_per_tok,
                                    c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor,
                                    self.experts.num_shared)
        if self.shared_experts is None:
            return self.experts(hidden, ids, weights, residual=residual)
        out = self.experts(hidden, ids, weights) + self.shared_experts(hidden)
        return out if residual is None else residual.add_(out)


class DeepseekV3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_idx: int, ep: ExpertParallelism, softmax_factor: float):
        super().__init__()
        self.self_attn = DeepseekV3Attention(config, softmax_factor)
        if layer_idx >= config.first_k_dense_replace:
            self.mlp = DeepseekV3MoE(config, ep, layer_idx - config.first_k_dense_replace)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward_one_row(self, h: torch.Tensor, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """The layer for one token (batch-1 decode); ``h`` [1, hidden] is the residual stream itself,
        updated in place and returned (as ``LlamaDecoderLayer.forward_one_row``).

        input_layernorm runs in the prologue of the ``qkv_a_proj`` GEMV and the attention's residual add
        in the epilogue of the ``o_proj`` GEMV (``kernels.gemv.fused_linear``); post_attention_layernorm
        runs in the router kernel's prologue, which also stores the normed row for the experts
        (:meth:`DeepseekV3MoE.forward_norm_residual`), and the MoE output is added into ``h`` by the
        fused MoE kernel's last launch. Needs ``qkv_a_proj`` (:meth:`DeepseekV3Attention.fuse_qkv_a`)
        (:meth:`DeepseekV3ForCausalLM.process_weights_after_loading` checks); fp8 block weights of
        ``qkv_a_proj`` / ``o_proj`` take the GEMV's fp8 form (their ``weight_scale_inv``).
        Same result as :meth:`forward` up to rounding (the normalized input of qkv_a_proj is not rounded
        to the model dtype).
        """
        attn = self.self_attn
        assert attn.qkv_a_proj is not None
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv_a = fused_linear(h, attn.qkv_a_proj.weight, attn.qkv_a_proj.bias, norm_weight=norm1.weight, eps=norm1.eps,
                             weight_scale=attn.qkv_a_proj._parameters.get(SCALE_SUFFIX))
        out = attn.attend(qkv_a, cos, sin, kv_cache, meta)
        fused_linear(out, attn.o_proj.weight, attn.o_proj.bias, residual=h,
                     weight_scale=attn.o_proj._parameters.get(SCALE_SUFFIX))
        mlp = self.mlp
        if isinstance(mlp, DeepseekV3MoE):
            mlp.forward_norm_residual(h, norm2)
        elif isinstance(mlp, GatedMLP) and mlp.gate_up_proj is not None and DENSE_ONE_ROW_GEMV:
            # a dense layer's MLP in two GEMVs, as Llama's: the norm in gate/up's prologue, SiLU-and-mul in
            # down's prologue and the residual add in its epilogue
            gate_up = fused_linear(h, mlp.gate_up_proj.weight, None, norm_weight=norm2.weight, eps=norm2.eps,
                                   weight_scale=mlp.gate_up_proj._parameters.get(SCALE_SUFFIX))
            fused_linear(gate_up, mlp.down_proj.weight, None, silu_and_mul_input=True, residual=h,
                         weight_scale=mlp.down_proj._parameters.get(SCALE_SUFFIX))
        else:
            h.add_(mlp(norm2(h)))
        return h


class DeepseekV3SharedHead(nn.Module):
    """The MTP module's norm before the shared LM head (checkpoint names ``shared_head.norm``)."""

    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3MTPLayer(DeepseekV3DecoderLayer):
    """One multi-token-prediction module: a full decoder block (MLA + MoE, the parameters of a decoder
    layer under the same names) after ``enorm``/``hnorm``/``eh_proj``, and ``shared_head.norm`` before
    the main model's LM head. Stored in checkpoints as decoder layer ``num_hidden_layers + d``.

    ``embed_weight`` / ``head_weight``: non-persistent buffers, None while the module shares the main
    model's embedding and LM head (the report's design); set by ``load_weights`` only when a checkpoint
    stores its own copies that differ from the main model's.
    """

    embed_weight: torch.Tensor | None
    head_weight: torch.Tensor | None

    def __init__(self, config, layer_idx: int, ep: ExpertParallelism, softmax_factor: float):
        super().__init__(config, layer_idx, ep, softmax_factor)
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = DeepseekV3SharedHead(config)
        self.register_buffer("embed_weight", None, persistent=False)
        self.register_buffer("head_weight", None, persistent=False)


class DeepseekV3Model(nn.Module):
    def __init__(self, config, ep: ExpertParallelism, softmax_factor: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i, ep, softmax_factor) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3ForCausalLM(MoEModelMixin, PagedCausalLM):
    """DeepSeek-V3 with an LM head; the engine's model interface (:class:`PagedCausalLM`'s forward over
    MLA's compressed cache). MoE layers count routed tokens as they run (:meth:`expert_load`).

    The MTP modules (``num_nextn_predict_layers``) are built with ``enable_mtp=True`` (``self.mtp``,
    see the module docstring, :meth:`mtp_forward` and :meth:`mtp_logits`); otherwise ``self.mtp`` is
    empty and :meth:`load_weights` skips their checkpoint layers. Expert parallelism as in
    ``Qwen3MoeForCausalLM`` (pass ``ep``); not with MTP. The MTP modules' experts are not counted by
    :meth:`expert_load` (EPLB balances the main model's layers).
    """

    inv_freq: torch.Tensor  # [qk_rope_head_dim / 2] float32 (a non-persistent buffer)
    supports_fp8_kv_cache = False  # MLA's cache and kernels are the model's dtype only
    supports_mtp = True
    supports_block_fp8 = True  # fp8 linears and routed experts (model.quantization)
    block_fp8_dequantized = ("kv_b_proj",)  # read as W_UK / W_UV views: kept in the model dtype
    # longest query per request a CUDA graph may capture: the absorbed attention's (the expanded form
    # slices the context by host-side lengths, which a graph would bake in)
    max_graph_query_len = ABSORBED_MAX_QUERY_LEN

    def __init__(self, config, ep: ExpertParallelism | None = None, enable_mtp: bool = False):
        """Raises: ValueError for an unsupported rope type, activation or expert grouping; with
        ``enable_mtp``, for a config without MTP layers (``num_nextn_predict_layers`` 0) or an
        expert-parallel group."""
        super().__init__()
        self.config = config
        ep = ep or ExpertParallelism()
        inv_freq, self.rope_factor, softmax_factor = deepseek_rope(config)
        self.model = DeepseekV3Model(config, ep, softmax_factor)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # [max_position_embeddings, 2, P // 2] in the model dtype: rope_args' cos and sin by position, built
        # once the weights are in (process_weights_after_loading; None until then: the formula)
        self.rope_table: torch.Tensor | None = None
        num_mtp = (getattr(config, "num_nextn_predict_layers", 0) or 0) if enable_mtp else 0
        if enable_mtp and num_mtp == 0:
            raise ValueError("speculative.method=mtp needs multi-token-prediction layers, but this DeepSeek-V3 "
                             "config has num_nextn_predict_layers=0")
        if enable_mtp and ep.group is not None:
            raise ValueError("MTP (speculative.method=mtp) is not supported with expert parallelism (ep > 1)")
        n = config.num_hidden_layers
        self.mtp = nn.ModuleList(DeepseekV3MTPLayer(config, n + d, ep, softmax_factor) for d in range(num_mtp))
        self.one_row_fusion = False  # process_weights_after_loading decides

    def forward(self, input_ids, positions, kv_cache, meta):
        """:meth:`PagedCausalLM.forward`; a one-token step on the GPU in bf16/fp16 (batch-1 decode) runs
        each layer through :meth:`DeepseekV3DecoderLayer.forward_one_row` when ``one_row_fusion`` holds."""
        if input_ids.shape[0] == 1 and self.one_row_fusion:
            w = self.model.embed_tokens.weight
            if gemv_applies(w[:1], w):  # the [1, hidden] embedding row: 16-bit on a GPU, not batch-invariant
                hidden = self.model.embed_tokens(input_ids)
                cos, sin = self.rope_args(positions, hidden)
                for i, layer in enumerate(self.model.layers):
                    cast(DeepseekV3DecoderLayer, layer).forward_one_row(hidden, cos, sin, kv_cache[i], meta)
                return self.model.norm(hidden)
        return super().forward(input_ids, positions, kv_cache, meta)

    def process_weights_after_loading(self) -> None:
        """Called by ``model.loader.load_model`` once the weights are in: stacks each attention's query and
        latent projections (``DeepseekV3Attention.fuse_qkv_a``) and fuses each MoE layer's shared experts
        into its routed experts (``DeepseekV3MoE.fuse_shared_experts``, unless
        RAYINFER_FUSE_SHARED_EXPERTS=0) and stacks each dense layer's gate and up projections
        (``GatedMLP.fuse_gate_up``). A model built and loaded by hand runs unfused, with the same
        outputs up to float summation order. Then turns on ``one_row_fusion`` (unless
        RAYINFER_ONE_ROW_FUSION=0) when every layer's attention has ``qkv_a_proj`` and its GEMV-read
        weights (``qkv_a_proj``, ``o_proj``) are 16-bit, or fp8 blocks with ``kernels.gemv.FP8_WEIGHTS``."""
        for module in list(self.modules()):
            if isinstance(module, DeepseekV3Attention):
                module.fuse_qkv_a()
            elif isinstance(module, DeepseekV3MoE) and envs.fuse_shared_experts():
                module.fuse_shared_experts()
        for layer in self.model.layers:  # the dense layers' gate and up projections stacked (not the MTP's)
            if isinstance(mlp := cast(DeepseekV3DecoderLayer, layer).mlp, GatedMLP):
                mlp.fuse_gate_up()
        self.build_rope_table()
        attns = [cast(DeepseekV3DecoderLayer, layer).self_attn for layer in self.model.layers]
        self.one_row_fusion = envs.one_row_fusion() and all(
            a.qkv_a_proj is not None and (bool(gemv.FP8_WEIGHTS) or not any(
                SCALE_SUFFIX in m._parameters for m in (a.qkv_a_proj, a.o_proj)))
            for a in attns)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters and buffers under the unfused Hugging Face 5.x names, whatever
        :meth:`process_weights_after_loading` fused: ``qkv_a_proj`` as ``q_proj`` / ``q_a_proj`` and
        ``kv_a_proj_with_mqa`` (row views), a layer's fused shared experts as
        ``mlp.shared_experts.{gate,up,down}_proj.weight`` (small copies) beside the L routed experts'
        stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` (views); fp8 scales alike. For an HF twin and
        tests that compare against checkpoint names."""
        out = dict(self.state_dict())
        for name, module in self.named_modules():
            if isinstance(module, DeepseekV3Attention) and module.qkv_a_proj is not None:
                first = "q_proj" if module.q_lora_rank is None else "q_a_proj"
                n_q = module.qkv_a_proj.out_features - module.kv_lora_rank - module.rope_dim
                for leaf, t in module.qkv_a_proj.state_dict().items():
                    rows = n_q // WEIGHT_BLOCK[0] if leaf == SCALE_SUFFIX else n_q
                    del out[f"{name}.qkv_a_proj.{leaf}"]
                    if not (leaf == "bias" and first == "q_proj"):  # q_proj has no bias (zeros stacked in)
                        out[f"{name}.{first}.{leaf}"] = t[:rows]
                    out[f"{name}.kv_a_proj_with_mqa.{leaf}"] = t[rows:]
            elif isinstance(module, GatedMLP) and module.gate_up_proj is not None:
                for leaf, t in module.gate_up_proj.state_dict().items():
                    del out[f"{name}.gate_up_proj.{leaf}"]
                    half = t.shape[0] // 2
                    out[f"{name}.gate_proj.{leaf}"], out[f"{name}.up_proj.{leaf}"] = t[:half], t[half:]
            elif isinstance(module, RoutedExperts) and module.num_shared:
                shared = name.removesuffix("experts") + "shared_experts"
                for leaf, t in module.state_dict().items():
                    num_routed, kind = module.num_local_experts, leaf.removesuffix("_scale_inv")
                    suffix = SCALE_SUFFIX if leaf.endswith("_scale_inv") else "weight"
                    out[f"{name}.{leaf}"], extra = t[:num_routed], t[num_routed:]
                    if kind == "gate_up_proj":
                        half = extra.shape[1] // 2
                        out[f"{shared}.gate_proj.{suffix}"] = extra[:, :half].reshape(-1, extra.shape[2])
                        out[f"{shared}.up_proj.{suffix}"] = extra[:, half:].reshape(-1, extra.shape[2])
                    else:  # down_proj
                        out[f"{shared}.down_proj.{suffix}"] = extra.transpose(0, 1).reshape(extra.shape[1], -1)
        return out

    def expert_layers(self):
        """The main model's routed-expert layers, in order (the MTP modules' are left out of EPLB)."""
        return [m for m in self.model.modules() if isinstance(m, RoutedExperts)]

    def mtp_kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[num MTP modules, num_blocks, block_size, R + P]: the MTP modules' own compressed cache."""
        c = self.config
        return (len(self.mtp), num_blocks, block_size, c.kv_lora_rank + c.qk_rope_head_dim)

    def mtp_forward(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, depth: int = 0) -> torch.Tensor:
        """One MTP module over T entries: entry j pairs ``prev_hidden[j]`` (the hidden state at the
        position before, pre-norm: the target's last layer or this module's own output) with the token
        ``input_ids[j]`` that followed it.

        Args:
            input_ids: [T] int64, the tokens t_{i+1}.
            prev_hidden: [T, hidden_size] in the model dtype, h_i (before the final norm).
            positions: [T] int64 RoPE positions of the entries (the engine uses the position of t_{i+1};
                only differences matter to attention). With ``rope_table`` built, one at or past
                ``max_position_embeddings`` takes the last position's cos/sin (only the engine's chained
                drafting steps past a request's wanted drafts reach there, and their output is dropped).
            kv_cache: :meth:`mtp_kv_cache_shape`; layer ``depth`` is written at ``meta.slot_mapping``.
            meta: attention metadata over the module's own cache.
            depth: which MTP module.
        Returns:
            [T, hidden_size] the module's output before ``shared_head.norm`` (chains as ``prev_hidden``).
        Source: DeepSeek-V3 technical report (arXiv:2412.19437) §2.2, eq. 21-23.
        """
        layer = cast(DeepseekV3MTPLayer, self.mtp[depth])
        weight = self.model.embed_tokens.weight if layer.embed_weight is None else layer.embed_weight
        embeds = F.embedding(input_ids, weight)
        hidden = linear(torch.cat([layer.enorm(embeds), layer.hnorm(prev_hidden)], dim=-1), layer.eh_proj)
        # MtpDraftGraphs runs every chained step, also those past a request's wanted drafts (no cache write,
        # drafts dropped): near max_model_len = max_position_embeddings their positions pass the table's end
        hidden, residual = layer(hidden, None, *self._rope(positions, hidden.dtype, clamp=True), kv_cache[depth],
                                 meta)
        return hidden + residual

    def mtp_logits(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """MTP output [N, hidden_size] -> logits [N, vocab_size] float32 (``shared_head.norm``, then the
        LM head: the main model's unless the checkpoint gave the module its own)."""
        layer = cast(DeepseekV3MTPLayer, self.mtp[depth])
        normed = layer.shared_head.norm(hidden)
        if layer.head_weight is None:
            return self.compute_logits(normed)
        return dense_linear(normed, layer.head_weight).float()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """:meth:`MoEModelMixin.load_weights`, with the MTP layers (``model.layers.{num_hidden_layers + d}.*``)
        loaded into ``mtp.{d}`` when they are built (skipped otherwise). Their copies of the embedding and
        LM head (``embed_tokens.weight``, ``shared_head.head.weight``), when stored, are checked against
        the main model's: equal, they stay shared; different, the module keeps its own.

        Raises:
            as :meth:`MoEModelMixin.load_weights`; ValueError when MTP is built but the checkpoint has no
            MTP layer.
        """
        n, num_mtp = self.config.num_hidden_layers, len(self.mtp)
        copies: dict[tuple[int, str], torch.Tensor] = {}
        seen_mtp: set[int] = set()

        def renamed():
            for name, tensor in named_tensors:
                m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
                d = int(m.group(1)) - n if m else -1
                if d < 0:
                    yield name, tensor
                elif m is not None and d < num_mtp:
                    seen_mtp.add(d)
                    rest = m.group(2)
                    if rest in ("embed_tokens.weight", "shared_head.head.weight"):
                        copies[(d, rest)] = tensor
                    else:
                        yield f"mtp.{d}.{rest}", tensor
                # else: an MTP layer that is not built: skipped

        loaded = super().load_weights(renamed())
        if num_mtp and len(seen_mtp) < num_mtp:
            missing = sorted(set(range(num_mtp)) - seen_mtp)
            raise ValueError(f"MTP is on but the checkpoint has no MTP layer "
                             f"{', '.join(f'model.layers.{n + d}' for d in missing)} (num_nextn_predict_layers="
                             f"{num_mtp}); speculative.method=mtp needs a checkpoint with its MTP weights")
        with torch.no_grad():
            for (d, rest), tensor in copies.items():
                main = self.model.embed_tokens.weight if rest == "embed_tokens.weight" else self.lm_head.weight
                if tensor.shape != main.shape:
                    raise ValueError(f"model.layers.{n + d}.{rest}: expected {tuple(main.shape)}, "
                                     f"got {tuple(tensor.shape)}")
                tensor = tensor.to(main.device, main.dtype)
                if not torch.equal(tensor, main):  # a module trained with its own copy keeps it
                    setattr(self.mtp[d], "embed_weight" if rest == "embed_tokens.weight" else "head_weight", tensor)
        return loaded

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[num_layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]: the compressed layout."""
        c = self.config
        return (c.num_hidden_layers, num_blocks, block_size, c.kv_lora_rank + c.qk_rope_head_dim)

    def rope_args(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple:
        """(cos, sin) [T, qk_rope_head_dim / 2] in the hidden dtype, YaRN's magnitude factor applied: rows of
        ``rope_table`` (one gather; row-strided views, which the MLA RoPE kernels and their reference take)
        where it is built on positions' device in that dtype, else computed (:meth:`_rope_formula`).
        Positions must be in [0, max_position_embeddings) on the table's path (the engine's
        ``max_model_len`` is at most that, and its positions are never negative); one at or past the end is
        an IndexError on the CPU and a device-side assert on CUDA, not a wrong row."""
        return self._rope(positions, hidden.dtype)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype,
              clamp: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`rope_args`; ``clamp``: positions past the table's end read its last row (one more launch)."""
        table = self.rope_table
        if ROPE_TABLE and table is not None and table.device == positions.device and table.dtype == dtype:
            rows = table[positions.clamp(max=table.shape[0] - 1) if clamp else positions]
            return rows[:, 0], rows[:, 1]
        return self._rope_formula(positions, dtype)

    def _rope_formula(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return (freqs.cos() * self.rope_factor).to(dtype), (freqs.sin() * self.rope_factor).to(dtype)

    def build_rope_table(self, dtype: torch.dtype | None = None) -> None:
        """Precompute ``rope_table`` [max_position_embeddings, 2, qk_rope_head_dim / 2] (cos, sin) in ``dtype``
        (None: the embedding's) on inv_freq's device, with :meth:`_rope_formula` itself, so a lookup gives the
        formula's bits (as vLLM's ``cos_sin_cache``). A decode step's RoPE inputs are then one gather, not
        eight elementwise launches (about 11 us of a batch-1 step's critical path on an H200). A plain attribute,
        not a buffer: not in the state dict and not moved or cast by ``.to()`` (a table on another device or in
        another dtype than the step's is not used; call this again after moving the model)."""
        dtype = dtype or self.model.embed_tokens.weight.dtype
        positions = torch.arange(self.config.max_position_embeddings, device=self.inv_freq.device)
        cos, sin = self._rope_formula(positions, dtype)
        self.rope_table = torch.stack([cos, sin], dim=1)
