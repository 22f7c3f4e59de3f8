"""MoE benchmark at EP=1: decode step and prefill times of a MoE model (the DeepSeek-V2-Lite shape or the
Qwen3-30B-A3B shape, dummy bf16 weights) against the roofline, and the fused MoE kernel against its torch
reference.

    python jobs/bench_moe.py                      # on a CUDA machine: V2-Lite shape, bf16 dummy weights
    python jobs/bench_moe.py --tiny --device cpu  # a tiny shape, seconds on CPU (what the test runs)
    python jobs/bench_moe.py --batches 1,16,64,256 --context 1024 --prefill 1024,4096 --out results.json
    python jobs/bench_moe.py --model qwen3-30b-a3b --tiny --device cpu   # the tiny Qwen3-MoE shape

The issue's cases, one H200 each (benchmarks/README.md, "MoE benchmarks"; about 1-3 minutes a run)::

    python jobs/bench_moe.py --model qwen3-30b-a3b --batches 1,32,128 --context 1024,4096 --prefill 4096 \
        --moe-tokens 1,8,16,32,64,128,256,1024,4096 --out benchmarks/results/moe-qwen3-30b-a3b-h200.json
    python jobs/bench_moe.py --model deepseek-v2-lite --batches 1,32,128 --context 1024,4096 --prefill 4096 \
        --moe-tokens 1,8,16,32,64,128,256,1024,4096 --out benchmarks/results/moe-v2lite-h200-1k4k.json

``--model`` (:data:`MODELS`): ``deepseek-v2-lite`` (the default) is the DeepSeek-V3 architecture (MLA,
shared + routed experts, sigmoid grouped top-k) with DeepSeek-V2-Lite's dimensions: hidden 2048, 27
layers (the first dense), 64 routed + 2 shared experts, top-6, expert intermediate 1408, kv_lora_rank 512,
qk_rope 64, qk_nope 128, v_head 128, no query LoRA, vocab 102400 (model/shapes.py
``deepseek-v2-lite-v3arch``). V2-Lite itself routes with a softmax; the V3 router is used here, which
moves the same bytes and FLOPs. ``qwen3-30b-a3b`` is Qwen3-30B-A3B's shape (Qwen3-MoE: GQA 32/4 heads of
128 with q/k RMSNorm, 48 MoE layers of 128 experts of intermediate 768, softmax top-8, no shared expert,
vocab 151936). ``--tiny`` takes the same architecture at a CPU size. Weights are random
(``load_format="dummy"``), bf16 by default.

Roofline, both ceilings measured in the same run: HBM bandwidth as a large device-to-device copy (bytes
read plus written) and the bf16 matmul rate of a large square matmul. A step cannot beat
``max(bytes / bandwidth, FLOPs / matmul rate)``, where bytes are the weights it reads (dense weights
(attention, routers, norms, DeepSeek's shared experts) and LM head, the routed experts it actually routes
to, counted from the model's expert load, the embedding rows) plus the KV cache it reads and writes
(MLA: ``kv_lora_rank + qk_rope`` per token and layer; GQA: K and V of every KV head), and FLOPs are 2 x
the active parameters per token (routed experts at top-k) x tokens plus attention (MLA: absorbed for
decode, causal expanded for prefill; GQA: ``4 * head_dim`` per (query, key) pair and query head).
Decode is memory-bound, prefill compute-bound. Times are medians of the model forward plus
the logits of the sampled rows (no sampling, no scheduling): eager, and on CUDA decode also replayed
from the engine's CUDA graphs (``engine.cuda_graph.DecodeGraphs``; ``ms_graph``), the way the engine
runs decode steps (``--no-graphs`` skips them). Decode rows run every ``--context`` (a list) x
``--batches``. The fused MoE rows time the routed-expert kernel alone at the model's expert shape
(alignment, the gate/up GEMM with SiLU-and-mul fused, the down GEMM, top-k sum), replayed from a CUDA
graph (``kernel_ms``; ``kernel_eager_ms`` eager) for M = 1 ... 4096 tokens against its
roofline (the experts it reads, or its FLOPs) and its torch reference, with the Triton kernel's and (bf16 on
Hopper) torch's grouped-GEMM path's times beside it (``triton_ms``, ``grouped_mm_ms``; ``kernel_ms`` is
whichever ``fused_moe`` takes at that M; fp8 rows: ``kernel_ms`` is W8A8 on GPUs with fp8 tensor cores,
``w8a16_ms`` the 16-bit-activation scheme; ``--moe-paths`` names the other paths to time, e.g. ``none`` for the
kernel alone); the routing_align rows time the
router (DeepSeek's grouped top-k, Qwen3's softmax top-k) and the alignment (with load counting) kernels
against their torch references, each replayed from a CUDA graph.

Writes JSON (command, device, git revision, ceilings, one row per case) to ``--out``, by default
``benchmarks/results/moe-<device>.json`` (``moe-qwen3-30b-a3b-<device>.json`` for Qwen3), rewritten after each
case with ``complete`` false until the run ends, so that a run cut short (a time limit) keeps its rows; a run stopped
by SIGTERM (``timeout``'s signal) prints every thread's stack first, to show where it was. :func:`run` is
the entry point for other jobs; the cost models and jobs/bench.py's MoE scenarios live in
jobs/moe_cost.py (:func:`register_bench_plugins`, re-exported here).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import functools
import importlib
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rayinfer.engine.llm_engine import resolve_device
from rayinfer.jobs.benchlib import env_settings
from rayinfer.jobs.moe_cost import MoECost, Qwen3MoECost, register_bench_plugins, write_shape  # noqa: F401
from rayinfer.model.shapes import SHAPES


def _kwargs(shape: str) -> dict:
    """A built-in shape's config keyword arguments without ``model_type`` (a deep copy: configs may edit
    nested dicts such as ``rope_parameters``)."""
    return {k: copy.deepcopy(v) for k, v in SHAPES[shape].items() if k != "model_type"}


# DeepSeek-V3 architecture with DeepSeek-V2-Lite dimensions (Hugging Face config keyword arguments).
V2_LITE_V3_ARCH = _kwargs("deepseek-v2-lite-v3arch")
# The same architecture, small enough for a CPU test run.
TINY_V3_ARCH = dict(
    V2_LITE_V3_ARCH, vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)
QWEN3_30B_A3B = _kwargs("qwen3-30b-a3b")
TINY_QWEN3 = dict(
    QWEN3_30B_A3B, vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, rope_theta=10000.0, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
)


@dataclass(frozen=True)
class MoEBenchModel:
    """A shape this job runs: its Hugging Face ``model_type``, the full and the tiny (CPU) config keyword
    arguments, and how the result names them."""

    model_type: str
    full: dict
    tiny: dict
    description: str
    tiny_description: str


MODELS = {
    "deepseek-v2-lite": MoEBenchModel("deepseek_v3", V2_LITE_V3_ARCH, TINY_V3_ARCH,
                                      "DeepSeek-V3 architecture with DeepSeek-V2-Lite dimensions (dummy weights)",
                                      "tiny DeepSeek-V3 (CPU smoke shape)"),
    "qwen3-30b-a3b": MoEBenchModel("qwen3_moe", QWEN3_30B_A3B, TINY_QWEN3,
                                   "Qwen3-30B-A3B shape, Qwen3-MoE architecture (dummy weights)",
                                   "tiny Qwen3-MoE (CPU smoke shape)"),
}
BLOCK_SIZE = 64
FULL = dict(batches=[1, 16, 32, 64, 256], contexts=[1024], prefill=[1024, 4096, 8192],
            moe_tokens=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
TINY = dict(batches=[1, 4], contexts=[32], prefill=[32], moe_tokens=[1, 16])


# -- measurement ---------------------------------------------------------------------------------
def time_ms(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median wall-clock milliseconds of ``fn()`` (the device synchronized around each call)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_ceilings(device: torch.device, dtype: torch.dtype, tiny: bool) -> dict:
    """Memory bandwidth (GB/s, bytes read + written by a copy) and matmul rate (TFLOP/s) in ``dtype``."""
    num_bytes, n = (64 << 20, 512) if tiny else (2 << 30, 8192)
    src = torch.empty(num_bytes // dtype.itemsize, dtype=dtype, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps=5 if tiny else 20)
    copy_gbps = 2 * num_bytes / ms / 1e6
    del src, dst
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    ms = time_ms(lambda: a @ b, device, reps=5 if tiny else 20)
    return {"copy_GBps": copy_gbps, "matmul_TFLOPs": 2 * n**3 / ms / 1e9, "matmul_n": n, "copy_bytes": num_bytes}


def param_counts(model) -> dict:
    """Parameters by role: ``dense`` (read every step: attention, dense MLP, shared experts, norms, router),
    ``embed``, ``lm_head``, ``per_expert`` (one routed expert of one layer), ``num_moe_layers``, ``top_k``."""
    from rayinfer.model.moe import RoutedExperts

    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    expert_ids = {id(p) for m in experts for p in m.parameters()}
    counts = {"dense": 0, "embed": model.model.embed_tokens.weight.numel(), "lm_head": model.lm_head.weight.numel()}
    skip = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)} | expert_ids
    counts["dense"] = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    # bytes as held (fp8 weights are one byte, their float32 block scales four)
    counts["dense_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    counts["lm_head_bytes"] = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    first = experts[0]
    slots = first.num_local_experts + first.num_shared  # fused shared experts sit in the last slots
    counts["per_expert"] = (first.gate_up_proj.numel() + first.down_proj.numel()) // slots
    counts["per_expert_bytes"] = sum(p.numel() * p.element_size() for p in first.parameters()) // slots
    shared = sum(m.num_shared for m in experts)  # read every step
    counts["dense"] += shared * counts["per_expert"]
    counts["dense_bytes"] += shared * counts["per_expert_bytes"]
    counts["num_moe_layers"] = len(experts)
    counts["top_k"] = model.config.num_experts_per_tok
    return counts


def _roofline(ceil: dict, num_bytes: float, flops: float) -> dict:
    mem_ms, compute_ms = num_bytes / ceil["copy_GBps"] / 1e6, flops / ceil["matmul_TFLOPs"] / 1e9
    return {"bytes": num_bytes, "flops": flops, "roofline_mem_ms": mem_ms, "roofline_compute_ms": compute_ms,
            "roofline_ms": max(mem_ms, compute_ms), "bound": "memory" if mem_ms >= compute_ms else "compute"}


def _is_mla(cfg) -> bool:
    return getattr(cfg, "kv_lora_rank", None) is not None


def kv_elements_per_token(cfg) -> int:
    """KV-cache elements of one token over all layers: MLA's latent and roped key (``kv_lora_rank +
    qk_rope_head_dim``) or GQA's K and V (``2 * num_key_value_heads * head_dim``) per layer."""
    if _is_mla(cfg):
        return cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim


def attention_flops(cfg, batch: int, query_len: int, context: int) -> int:
    """Attention FLOPs of ``batch`` requests of ``query_len`` new tokens after ``context`` cached ones.

    MLA decode (query_len 1) is absorbed: scores over R + P and values of width R per head and key; MLA
    prefill is expanded, causal: ``qk_nope + qk_rope + v_head`` per (query, key) pair and head, 2 FLOPs each.
    GQA: QK^T and PV, ``4 * head_dim`` per (query, key) pair and query head."""
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    pairs = batch * (query_len * context + query_len * (query_len + 1) // 2)  # causal over the new tokens
    if not _is_mla(cfg):
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return 4 * layers * heads * head_dim * pairs
    r, p = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if query_len == 1:
        return batch * layers * heads * (context + 1) * 2 * (r + p + r)
    return layers * heads * pairs * 2 * (cfg.qk_nope_head_dim + p + cfg.v_head_dim)


def expert_shape(cfg) -> tuple[int, int, int, int, int]:
    """(routed experts L, top-k, hidden H, expert intermediate I, shared experts S) of a MoE config
    (DeepSeek-V3's ``n_routed_experts`` / ``n_shared_experts`` or Qwen3-MoE's ``num_experts``, no shared)."""
    num_routed = getattr(cfg, "n_routed_experts", None) or cfg.num_experts
    shared = getattr(cfg, "n_shared_experts", 0) or 0
    return num_routed, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, shared


def bench_step(model, ceil: dict, counts: dict, *, batch: int, query_len: int, context: int, reps: int,
               graphs: bool = False) -> dict:
    """Time one forward of ``batch`` requests computing ``query_len`` new tokens each after ``context``
    cached tokens, plus the logits of each request's last token; compare with the roofline.

    graphs: (decode on CUDA) also time the forward replayed from the engine's ``DecodeGraphs``
    (``ms_graph``, ``pct_of_roofline_graph``: each step synchronized) and the same steps enqueued back to back
    (``ms_graph_pipelined``, ``pct_of_roofline_graph_pipelined``: a step's input copies, replay and logits
    issued while the one before still runs, as the engine's pipelined scheduling runs decode, which feeds
    each step its tokens on the device)."""
    from rayinfer.kernels.attention_metadata import AttentionMetadata

    cfg, device, dtype = model.config, model.lm_head.weight.device, model.lm_head.weight.dtype
    seq_len = context + query_len
    blocks = -(-seq_len // BLOCK_SIZE)
    kv = torch.zeros(model.kv_cache_shape(batch * blocks, BLOCK_SIZE), dtype=dtype, device=device)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    meta = AttentionMetadata.build([query_len] * batch, [seq_len] * batch, tables, BLOCK_SIZE, device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch * query_len,), generator=gen).to(device)
    pos = torch.arange(context, seq_len, device=device).repeat(batch)
    last = torch.arange(query_len - 1, batch * query_len, query_len, device=device)

    def step():
        meta.derived.clear()  # each step derives its index tensors (its first layer's work), as an engine step does
        return model.compute_logits(model(ids, pos, kv, meta)[last])

    with torch.inference_mode():
        model.expert_load(reset=True)
        step()
        touched = int((model.expert_load(reset=True) > 0).sum())  # routed experts this batch reads
        ms = time_ms(step, device, reps)
        graph_ms = _graph_step_ms(model, kv, meta, ids, pos, seq_len, reps) if graphs and query_len == 1 else None
    tokens, item = batch * query_len, dtype.itemsize
    num_bytes = (counts["dense_bytes"] + counts["lm_head_bytes"] + touched * counts["per_expert_bytes"]
                 + item * (tokens * cfg.hidden_size + batch * seq_len * kv_elements_per_token(cfg)))
    active = counts["dense"] + counts["num_moe_layers"] * counts["top_k"] * counts["per_expert"]
    flops = 2 * active * tokens + 2 * counts["lm_head"] * batch + attention_flops(cfg, batch, query_len, context)
    row = {"batch": batch, "query_len": query_len, "context": context, "ms": ms,
           "routed_experts_read": touched, **_roofline(ceil, num_bytes, flops)}
    row["pct_of_roofline"] = 100 * row["roofline_ms"] / ms
    row["tokens_per_s"] = tokens / ms * 1e3
    if graph_ms is not None:
        row["ms_graph"], row["ms_graph_pipelined"] = graph_ms
        row["pct_of_roofline_graph"] = 100 * row["roofline_ms"] / row["ms_graph"]
        row["tokens_per_s_graph"] = tokens / row["ms_graph"] * 1e3
        row["pct_of_roofline_graph_pipelined"] = 100 * row["roofline_ms"] / row["ms_graph_pipelined"]
    return row


# A/B variants of the decode step (``--ab``): environment settings applied in this process, so that every
# variant is timed on the same model, machine and clocks (separate processes differ by about 0.1 ms at
# batch 1 on an H200).
# A key "@module.NAME" sets that module attribute (an int) instead of an environment variable.
AB_VARIANTS = {"default": {}, "no-pdl": {"RAYINFER_PDL": "0"}, "no-one-row": {"RAYINFER_ONE_ROW_FUSION": "0"},
               **{f"mla-splits-{n}": {"@rayinfer.kernels.mla_attention._MAX_SPLITS": str(n)} for n in (4, 8, 16)},
               "mla-prefetch-0": {"@rayinfer.kernels.mla_attention.PREFETCH_INDEX": "0"},
               "no-direct": {"@rayinfer.kernels.fused_moe.ONE_TOKEN_DIRECT": "0"},
               # one token's experts as GEMVs (kernels.moe_gemv) with 16-bit weights; fp8 ones on the grouped GEMM's tiles
               "moe-gemv-16bit": {"@rayinfer.kernels.fused_moe.ONE_TOKEN_GEMV": "1"},
               "moe-tiles-fp8": {"@rayinfer.kernels.fused_moe.ONE_TOKEN_GEMV_FP8": "0"},
               # the absorbed RoPE/store after the first W_UK product's program (before c68b019), not on its own
               "rope-after": {"@rayinfer.kernels.mla_rope.ROPE_APART": "0"},
               "fp32-slots": {"@rayinfer.kernels.fused_moe.SLOTS_IN_HIDDEN_DTYPE": "0"},
               # DeepSeek-V3: RoPE's cos/sin computed each step (before the table); a one-token step's dense MLP on
               # cuBLAS, SiLU-and-mul and an add (before its two GEMVs; gate and up stay stacked)
               "rope-formula": {"@rayinfer.model.deepseek_v3.ROPE_TABLE": "0"},
               "dense-mlp-cublas": {"@rayinfer.model.deepseek_v3.DENSE_ONE_ROW_GEMV": "0"},
               # the MLA split merge in its own launch before the W_UV GEMV (before it ran in that GEMV's launch)
               "merge-apart": {"@rayinfer.kernels.mla_attention.MERGE_IN_UV": "0"},
               **{f"merge-uv-{n}": {"@rayinfer.kernels.mla_attention.MERGE_UV_BLOCK_N": str(n)} for n in (16, 64, 128)},
               # MLA decode: its metadata and first block numbers read after the PDL wait (before the sixteenth round)
               "mla-early-0": {"@rayinfer.kernels.mla_attention.EARLY_META": "0"},
               **{f"mla-swap-{n}": {"@rayinfer.kernels.mla_attention.FEW_TOKEN_SWAP_FROM": str(n)}
                  for n in (1024, 2048, 3072, 4096, 8192)},
               **{f"grouped-mm-{n}": {"@rayinfer.kernels.fused_moe.GROUPED_MM_FROM": str(n)}
                  for n in (0, 1024, 2048, 3072, 4096, 6144, 8192)},
               "qk-norm-apart": {"@rayinfer.model.qwen3_moe.QK_NORM_IN_ROPE": "0"},
               "w8a16": {"@rayinfer.kernels.fused_moe.FP8_ACTIVATIONS": "0"},
               "dense-w8a16": {"@rayinfer.kernels.block_fp8.W8A8_FROM_ROWS": "0"},
               # fp8 one-row linears on block_fp8_linear and no one-row layers: the fp8 model before its GEMV
               "no-fp8-gemv": {"@rayinfer.kernels.gemv.FP8_WEIGHTS": "0", "RAYINFER_ONE_ROW_FUSION": "0"},
               # one-row GEMVs on kernels.gemv._choose_config's rule only, not the device table's tiles (jobs/tune_gemv.py)
               "gemv-table-0": {"@rayinfer.kernels.gemv.DEVICE_TABLE": "0"},
               # the fused MoE without the device's table (jobs/tune_moe.py): heuristic tiles, no grouped-GEMM path
               "moe-table-0": {"@rayinfer.kernels.fused_moe.DEVICE_TABLE": "0"},
               # the grouped-GEMM path's GEMMs on TileLang (kernels.moe_tilelang), SwiGLU fused into the first
               "moe-grouped-tilelang": {"@rayinfer.kernels.fused_moe.GROUPED_TILELANG": "1"},
               "graph-inputs-fused": {"@rayinfer.engine.cuda_graph.FUSED_INPUTS": "1"},
               # MLA decode on TileLang (keys-as-rows tiles on cache blocks of 64: every step; auto: from 64 tokens)
               "mla-tilelang": {"RAYINFER_MLA_BACKEND": "tilelang"}, "mla-auto": {"RAYINFER_MLA_BACKEND": "auto"}}


@contextlib.contextmanager
def ab_variant(model, name: str):
    """Run the block under variant ``name`` of :data:`AB_VARIANTS`: its environment set, the PDL probe's
    cache cleared, the model's ``one_row_fusion`` re-read; everything restored after.
    Raises: KeyError for an unknown variant."""
    from rayinfer import envs
    from rayinfer.kernels import _triton_utils

    settings = AB_VARIANTS[name]
    attrs = [(importlib.import_module(k[1:].rpartition(".")[0]), k.rpartition(".")[2], int(v))
             for k, v in settings.items() if k.startswith("@")]
    env = {k: v for k, v in settings.items() if not k.startswith("@")}
    saved_attrs = [(module, attr, getattr(module, attr)) for module, attr, _ in attrs]
    saved_env = {k: os.environ.get(k) for k in env}
    saved_row = getattr(model, "one_row_fusion", None)
    os.environ.update(env)
    for module, attr, value in attrs:
        setattr(module, attr, value)
    _triton_utils._pdl_supported.cache_clear()
    if saved_row is not None:
        model.one_row_fusion = saved_row and envs.one_row_fusion()
    try:
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for module, attr, value in saved_attrs:
            setattr(module, attr, value)
        _triton_utils._pdl_supported.cache_clear()
        if saved_row is not None:
            model.one_row_fusion = saved_row


def ab_rows(model, ceil: dict, counts: dict, variants: list[str], batches: list[int], context: int,
            rounds: int, reps: int, prefill: list[int] = ()) -> list[dict]:
    """Decode-step rows (:func:`bench_step` with graphs) and prefill rows (one prompt of each ``prefill``
    length, eager) of each variant, interleaved over ``rounds`` rounds:
    [{"variant", "round", "batch", "query_len", "context", "ms", "ms_graph" (decode), ...}]."""
    rows = []
    cases = [(batch, 1, context) for batch in batches] + [(1, n, 0) for n in prefill]
    for rnd, name, (batch, query_len, ctx) in itertools.product(range(rounds), variants, cases):
        with ab_variant(model, name):
            row = bench_step(model, ceil, counts, batch=batch, query_len=query_len, context=ctx,
                             reps=reps if query_len == 1 else max(3, reps // 3), graphs=model.lm_head.weight.is_cuda)
        rows.append({"variant": name, "round": rnd, **row})
        piped = (f", pipelined {row['ms_graph_pipelined']:.3f} ms ({row['pct_of_roofline_graph_pipelined']:.1f}%)"
                 if "ms_graph_pipelined" in row else "")
        print(f"ab {name:<11} round {rnd} B={batch} T={query_len} ctx={ctx}: {row.get('ms_graph', row['ms']):.3f} ms "
              f"({row.get('pct_of_roofline_graph', row['pct_of_roofline']):.1f}%){piped}", flush=True)
    return rows


def prefill_kernel_profile(model, num_tokens: int, steps: int = 3, top: int = 30) -> dict:
    """Kernels of one prefill of ``num_tokens`` tokens (one request, nothing cached) under ``torch.profiler``:
    {"num_tokens", "kernel_ms_per_step", "kernels": [{"name", "ms_per_step", "calls_per_step"}, ...]} by
    time, device time on CUDA (CPU op time elsewhere), averaged over ``steps`` profiled forwards."""
    from torch.profiler import ProfilerActivity, profile

    from rayinfer.kernels.attention_metadata import AttentionMetadata

    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    cuda = device.type == "cuda"
    blocks = -(-num_tokens // BLOCK_SIZE)
    kv = torch.zeros(model.kv_cache_shape(blocks, BLOCK_SIZE), dtype=dtype, device=device)
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [list(range(blocks))], BLOCK_SIZE, device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=gen).to(device)
    pos = torch.arange(num_tokens, device=device)
    last = torch.tensor([num_tokens - 1], device=device)
    with torch.inference_mode():
        model.compute_logits(model(ids, pos, kv, meta)[last])  # warm-up (compiles)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                meta.derived.clear()  # each step derives its index tensors, as an engine step does
                model.compute_logits(model(ids, pos, kv, meta)[last])
            if cuda:
                torch.cuda.synchronize(device)

    def spent(e) -> float:  # microseconds
        return e.device_time_total if cuda else e.self_cpu_time_total

    events = sorted((e for e in prof.key_averages() if spent(e) > 0), key=lambda e: -spent(e))
    return {"num_tokens": num_tokens, "kernel_ms_per_step": sum(spent(e) for e in events) / steps / 1e3,
            "kernels": [{"name": e.key, "ms_per_step": spent(e) / steps / 1e3, "calls_per_step": e.count // steps}
                        for e in events[:top]]}


def _graph_step_ms(model, kv, meta, ids, pos, seq_len: int, reps: int, pipelined: int = 10) -> tuple[float, float]:
    """Median ms of a decode step (one token per request) replayed from the engine's CUDA graphs, plus the
    logits (eager, as the engine computes them): synchronized after each step, and a step of ``pipelined``
    steps enqueued back to back (the host's input copies and launches overlap the step before)."""
    from rayinfer.engine.cuda_graph import DecodeGraphs

    batch = meta.seq_lens.shape[0]
    graphs = DecodeGraphs(model, kv, BLOCK_SIZE, max_model_len=seq_len, max_num_seqs=batch)
    graphs.capture()

    def step():
        hidden = graphs.run(ids, pos, meta.slot_mapping, meta.seq_lens, meta.block_tables)
        return model.compute_logits(hidden)

    def steps():
        for _ in range(pipelined):
            step()

    try:
        return time_ms(step, kv.device, reps), time_ms(steps, kv.device, max(3, reps // pipelined)) / pipelined
    finally:
        del graphs
        torch.cuda.empty_cache()


def graph_ms(fn, device: torch.device, reps: int, inner: int = 10) -> float:
    """Median ms of one ``fn`` replayed from a CUDA graph (on CPU: :func:`time_ms`, eager), so that a step
    of small kernels is timed as the engine runs it, without per-launch host cost. The graph holds
    ``inner`` calls back to back (the replay's own launch and sync are paid once per ``inner`` calls,
    as inside a decode step's graph)."""
    if device.type != "cuda":
        return time_ms(fn, device, reps)
    fn()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return time_ms(graph.replay, device, reps) / inner


def bench_routing_align(cfg, num_tokens: int, device: torch.device, reps: int) -> dict:
    """The MoE layer's small ops at ``num_tokens`` tokens, kernels against their torch references, each
    timed from a CUDA graph on CUDA: the router (DeepSeek-V3's grouped top-k, or Qwen3-MoE's softmax top-k,
    over float32 logits) and the alignment (with expert-load counting, as ``RoutedExperts`` runs it)."""
    from rayinfer.kernels._triton_utils import use_triton
    from rayinfer.kernels.fused_moe import _map_and_count, moe_align_ref, moe_align_triton
    from rayinfer.kernels.fused_moe_config import default_tile_config
    from rayinfer.kernels.moe_routing import (grouped_topk_ref, grouped_topk_triton, softmax_topk_ref,
                                              softmax_topk_triton)

    num_experts, top_k = expert_shape(cfg)[:2]
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    bias = torch.randn(num_experts, generator=gen, device=device) * 0.01
    if hasattr(cfg, "n_group"):
        router = "grouped_topk"
        args = (top_k, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        ref = lambda: grouped_topk_ref(logits, bias, *args)  # noqa: E731
        kernel = lambda: grouped_topk_triton(logits, bias, *args)  # noqa: E731
    else:
        router = "softmax_topk"
        ref = lambda: softmax_topk_ref(logits, top_k, cfg.norm_topk_prob)  # noqa: E731
        kernel = lambda: softmax_topk_triton(logits, top_k, cfg.norm_topk_prob)  # noqa: E731
    ids = ref()[1]
    load = torch.zeros(num_experts, dtype=torch.int64, device=device)
    block_m = default_tile_config(num_tokens, top_k).block_m
    row = {"num_tokens": num_tokens, "router": router,
           "kernel": "triton" if use_triton(logits) else "none (no Triton here)"}
    with torch.inference_mode():
        row["routing_ref_ms"] = graph_ms(ref, device, reps)
        row["align_ref_ms"] = graph_ms(
            lambda: moe_align_ref(_map_and_count(ids, None, load), num_experts, block_m), device, reps)
        if use_triton(logits):
            row["routing_kernel_ms"] = graph_ms(kernel, device, reps)
            row["align_kernel_ms"] = graph_ms(
                lambda: moe_align_triton(ids, num_experts, block_m, expert_load=load), device, reps)
    return row


# the fused MoE's paths a row may time beside its default kernel (``<path>_ms``, ``pct_of_roofline_<path>``)
FUSED_MOE_PATHS = ("triton", "grouped_mm", "grouped_tilelang", "w8a16")


def bench_fused_moe(ceil: dict, cfg, num_tokens: int, device: torch.device, dtype: torch.dtype, reps: int,
                    num_shared: int = 0, fp8: bool = False, paths: tuple[str, ...] = FUSED_MOE_PATHS) -> dict:
    """fused_moe (Triton on CUDA, else its torch fallback) against fused_moe_ref at the model's expert shape.

    num_shared: S shared experts fused as extra experts every token takes (the model's layout at one rank);
    fp8: block-quantized fp8 expert weights (bf16 activations), against the reference on the dequantized
    weights; bytes count one per weight (plus the scales); paths: the other paths (of :data:`FUSED_MOE_PATHS`)
    timed beside the one fused_moe takes (a path that is the one it takes is reported whether named or not)."""
    from rayinfer.kernels._triton_utils import use_triton
    from rayinfer.kernels.block_fp8 import block_fp8_dequant_ref, quantize_block_fp8
    from rayinfer.kernels.fused_moe import (GROUPED_TILELANG, dequant_w13, fused_moe, fused_moe_grouped_mm,
                                            fused_moe_ref, fused_moe_triton, fused_moe_w8a8_ref, grouped_mm_applies,
                                            quantize_w13, tilelang_gemms_apply)
    from rayinfer.kernels.moe_routing import append_shared_experts

    num_routed, top_k, hidden_size, inter, _ = expert_shape(cfg)
    num_experts = num_routed + num_shared
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden_size, generator=gen, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden_size, generator=gen, device=device) * 0.02).to(dtype)
    w2 = (torch.randn(num_experts, hidden_size, inter, generator=gen, device=device) * 0.02).to(dtype)
    scores = torch.rand(num_tokens, num_routed, generator=gen, device=device)
    weights, ids = scores.topk(top_k, dim=-1)
    weights, ids = append_shared_experts(weights / weights.sum(-1, keepdim=True), ids, num_routed, num_shared)
    scales: dict = {}
    ref13, ref2 = w13, w2
    if fp8:
        (w13, s13), (w2, s2) = quantize_w13(w13), quantize_block_fp8(w2)
        scales = dict(w13_scale=s13, w2_scale=s2)
        ref13, ref2 = dequant_w13(w13, s13, dtype), block_fp8_dequant_ref(w2, s2, dtype)
    with torch.inference_mode():
        ref_ms = time_ms(lambda: fused_moe_ref(x, ref13, ref2, ids, weights), device, reps)
        # replayed from a CUDA graph, as a decode step runs it (eager wall time is mostly launches)
        kernel_ms = graph_ms(lambda: fused_moe(x, w13, w2, ids, weights, **scales), device, reps)
        eager_ms = time_ms(lambda: fused_moe(x, w13, w2, ids, weights, **scales), device, reps)
        want = fused_moe_ref(x, ref13, ref2, ids, weights).float()
        got = fused_moe(x, w13, w2, ids, weights, **scales).float()
        err = float((got - want).abs().max())
        # kernel_ms is the path fused_moe takes at this size (GROUPED_MM_FROM); the others `paths` names are
        # timed here
        timed = {}
        grouped = grouped_mm_applies(x, w13, fp8)
        if use_triton(x, w13, w2, ids, weights):
            if not grouped:
                timed["triton_ms"] = kernel_ms
            elif "triton" in paths:
                timed["triton_ms"] = graph_ms(lambda: fused_moe_triton(x, w13, w2, ids, weights, **scales), device,
                                              reps)
            if fp8:
                want8 = fused_moe_w8a8_ref(x, w13, w2, scales["w13_scale"], scales["w2_scale"], ids, weights)
                timed["w8a8_err_vs_w8a8_ref"] = float((got - want8.float()).abs().max())
            if fp8 and "w8a16" in paths:
                # the other scheme: 16-bit activations (W8A16; kernel_ms is W8A8 where fp8 tensor cores exist)
                w8a16 = functools.partial(fused_moe_triton, x, w13, w2, ids, weights, act_fp8=False, **scales)
                timed["w8a16_ms"] = graph_ms(w8a16, device, reps)
                timed["w8a16_err_vs_ref"] = float((w8a16().float() - want).abs().max())
        if grouped_mm_applies(x, w13, fp8, force=True):  # whether it runs here at all
            torch_path = functools.partial(fused_moe_grouped_mm, x, w13, w2, ids, weights, gemms="torch")
            taken = grouped and not GROUPED_TILELANG
            if taken or "grouped_mm" in paths:
                timed["grouped_mm_ms"] = kernel_ms if taken else graph_ms(torch_path, device, reps)
                timed["grouped_mm_err_vs_ref"] = float((torch_path().float() - want).abs().max())
            taken_tl = grouped and GROUPED_TILELANG
            if (taken_tl or "grouped_tilelang" in paths) and tilelang_gemms_apply(x, w13, w2):  # GEMMs on TileLang
                tl_path = functools.partial(fused_moe_grouped_mm, x, w13, w2, ids, weights, gemms="tilelang")
                timed["grouped_tilelang_ms"] = kernel_ms if taken_tl else graph_ms(tl_path, device, reps)
                timed["grouped_tilelang_err_vs_ref"] = float((tl_path().float() - want).abs().max())
    touched = int(ids.unique().numel())
    weight_bytes = 1 if fp8 else dtype.itemsize
    scale_bytes = 4 * (scales["w13_scale"][0].numel() + scales["w2_scale"][0].numel()) if fp8 else 0
    num_bytes = (touched * (weight_bytes * 3 * hidden_size * inter + scale_bytes)
                 + 2 * dtype.itemsize * num_tokens * hidden_size)
    flops = 2 * num_tokens * (top_k + num_shared) * 3 * hidden_size * inter
    row = {"num_tokens": num_tokens, "num_experts": num_experts, "num_shared": num_shared, "top_k": top_k,
           "weights": "fp8 block 128x128" if fp8 else str(dtype).removeprefix("torch."),
           "hidden": hidden_size, "inter": inter,
           "kernel": "triton" if use_triton(x, w13, w2, ids, weights) else "torch fallback",
           "ref_ms": ref_ms, "kernel_ms": kernel_ms, "kernel_eager_ms": eager_ms, "speedup_vs_ref": ref_ms / kernel_ms,
           "max_abs_err_vs_ref": err, "experts_read": touched, **timed, **_roofline(ceil, num_bytes, flops)}
    row["pct_of_roofline"] = 100 * row["roofline_ms"] / kernel_ms
    for path in FUSED_MOE_PATHS:
        if f"{path}_ms" in row:
            row[f"pct_of_roofline_{path}"] = 100 * row["roofline_ms"] / row[f"{path}_ms"]
    return row


# -- the job -------------------------------------------------------------------------------------
def git_revision() -> str | None:
    """``git rev-parse HEAD``, with ``-dirty`` when the tree has changes; None outside a checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def build_model(shape: dict, dtype: torch.dtype, device: torch.device, model_type: str = "deepseek_v3",
                quantization: str | None = None):
    """The model of ``shape`` (Hugging Face config keyword arguments of ``model_type``) with dummy weights,
    through the engine's loader (which fuses DeepSeek's shared experts into the routed experts);
    ``quantization`` "fp8": 128 x 128 fp8 blocks in every linear layer and routed expert."""
    from rayinfer.model.loader import load_model

    with tempfile.TemporaryDirectory() as tmp:
        return load_model(write_shape(shape, Path(tmp), model_type), dtype, device, load_format="dummy", seed=0,
                          quantization=quantization)


def run(tiny: bool = False, device: str | None = None, dtype: str = "bfloat16", batches: list[int] | None = None,
        context: int | list[int] | None = None, prefill: list[int] | None = None,
        moe_tokens: list[int] | None = None, reps: int | None = None, command: str | None = None,
        git_rev: str | None = None, graphs: bool = True, model: str = "deepseek-v2-lite",
        quantization: str | None = None, ab: list[str] | None = None, ab_rounds: int = 3,
        profile_prefill: bool = False, checkpoint: Callable[[dict], None] | None = None,
        moe_paths: list[str] | None = None) -> dict:
    """Run every case and return the results (see the module docstring for what is measured).

    Args:
        tiny: the model's tiny shape and case list (a CPU smoke run) instead of its full shape.
        device: "cuda" or "cpu"; None picks cuda when available.
        dtype: parameter and activation dtype name.
        batches, context: decode cases (requests per step; cached tokens per request, one or a list:
            every context x every batch).
        prefill: prompt lengths of the prefill cases (one request, nothing cached).
        moe_tokens: token counts of the fused MoE cases.
        reps: timed repetitions per case (median reported).
        command, git_rev: recorded as given (defaults: this process's argv, :func:`git_revision`).
        graphs: on CUDA, also time decode replayed from CUDA graphs.
        model: a key of :data:`MODELS` ("deepseek-v2-lite" or "qwen3-30b-a3b").
        quantization: the model's weights for the decode and prefill rows ("fp8": 128 x 128 fp8 blocks in
            every linear layer and routed expert; None: ``dtype``).
        ab, ab_rounds: variants of :data:`AB_VARIANTS` whose decode steps (every batch, the first context)
            and prefills are timed in this process, interleaved over ``ab_rounds`` rounds (the ``ab`` rows).
        profile_prefill: also profile each prefill case's kernels (:func:`prefill_kernel_profile`, the
            ``prefill_profile`` rows).
        checkpoint: called with the results so far (``complete`` False) after each case, so that a run cut
            short (a device call's time limit) leaves what it measured; the returned results have ``complete``
            True.
        moe_paths: the fused MoE rows' other paths timed beside the kernel ``fused_moe`` takes (names from
            :data:`FUSED_MOE_PATHS`; None: all of them, [] none).
    Raises:
        ValueError: for a model not in :data:`MODELS`, an unknown A/B variant or an unknown fused MoE path.
    """
    from rayinfer.model.loader import parse_dtype

    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {sorted(MODELS)}")
    unknown = sorted(set(ab or []) - set(AB_VARIANTS))
    if unknown:
        raise ValueError(f"unknown A/B variant(s) {unknown}; choose from {sorted(AB_VARIANTS)}")
    unknown = sorted(set(moe_paths or []) - set(FUSED_MOE_PATHS))
    if unknown:
        raise ValueError(f"unknown fused MoE path(s) {unknown}; choose from {list(FUSED_MOE_PATHS)}")
    dev = resolve_device(device or "auto")
    threads = torch.get_num_threads()
    if tiny and dev.type == "cpu":
        # A smoke run of tiny ops: one thread, since a shared CPU's busy cores stall every parallel
        # region of a multi-threaded op (times then measure the scheduler, not the op).
        torch.set_num_threads(1)
    contexts = [context] if isinstance(context, int) else context
    try:
        return _run(MODELS[model], tiny, dev, parse_dtype(dtype), batches, contexts, prefill, moe_tokens, reps,
                    command, git_rev, graphs and dev.type == "cuda", quantization, ab, ab_rounds, profile_prefill,
                    checkpoint, FUSED_MOE_PATHS if moe_paths is None else tuple(moe_paths))
    finally:
        torch.set_num_threads(threads)


def _run(spec: MoEBenchModel, tiny, dev, dt, batches, contexts, prefill, moe_tokens, reps, command, git_rev,
         graphs, quantization=None, ab: list[str] | None = None, ab_rounds: int = 3,
         profile_prefill: bool = False, checkpoint: Callable[[dict], None] | None = None,
         moe_paths: tuple[str, ...] = FUSED_MOE_PATHS) -> dict:
    cases = TINY if tiny else FULL
    batches, contexts = batches or cases["batches"], contexts or cases["contexts"]
    prefill, moe_tokens = prefill or cases["prefill"], moe_tokens or cases["moe_tokens"]
    reps = reps or (3 if tiny else 10)
    shape = spec.tiny if tiny else spec.full
    started = time.time()
    ceil = measure_ceilings(dev, dt, tiny)
    print(f"ceilings: {ceil['copy_GBps']:.0f} GB/s copy, {ceil['matmul_TFLOPs']:.3g} TFLOP/s matmul", flush=True)
    model = build_model(shape, dt, dev, spec.model_type, quantization)
    counts = param_counts(model)
    decode, prefill_rows, moe, small_ops, ab_out, profiles = [], [], [], [], [], []
    result = {
        "command": command or "python " + " ".join(sys.argv),
        "device": device_name(dev),
        "git_rev": git_rev or git_revision(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": str(dt),
        "quantization": quantization,
        "model": spec.tiny_description if tiny else spec.description,
        "shape": {k: v for k, v in shape.items() if k != "architectures"},
        "architecture": shape["architectures"][0],
        "params": counts,
        "ceilings": ceil,
        "notes": ("ms: median wall time, eager, forward + logits of each request's last token; ms_graph: the same "
                  "decode step replayed from the engine's CUDA graphs, synchronized after each step; "
                  "ms_graph_pipelined: the same steps enqueued back to back, the step time of the engine's "
                  "pipelined scheduling. roofline_ms: max(bytes / copy bandwidth, FLOPs / matmul rate); "
                  "pct_of_roofline = roofline_ms / ms. complete: False while the run is under way (a file "
                  "left so was cut short)."),
        "decode": decode,
        "prefill": prefill_rows,
        "fused_moe": moe,
        "routing_align": small_ops,
        "ab": ab_out,
        "prefill_profile": profiles,
        "complete": False,
        "seconds": 0.0,
    }

    def saved() -> None:  # the rows so far, for a run that may be cut short
        if checkpoint is not None:
            result["seconds"] = time.time() - started
            checkpoint(result)

    for context, batch in itertools.product(contexts, batches):
        decode.append(bench_step(model, ceil, counts, batch=batch, query_len=1, context=context, reps=reps,
                                 graphs=graphs))
        _print("decode", decode[-1], f"B={batch} ctx={context}")
        saved()
        if "ms_graph" in decode[-1]:
            r = decode[-1]
            _print("decode", dict(r, ms=r["ms_graph"], pct_of_roofline=r["pct_of_roofline_graph"],
                                  tokens_per_s=r["tokens_per_s_graph"]), f"B={batch} graph")
            _print("decode", dict(r, ms=r["ms_graph_pipelined"], pct_of_roofline=r["pct_of_roofline_graph_pipelined"],
                                  tokens_per_s=batch / r["ms_graph_pipelined"] * 1e3), f"B={batch} pipelined")
    ab_out += ab_rows(model, ceil, counts, ab, batches, contexts[0], ab_rounds, reps, prefill) if ab else []
    saved()
    for n in prefill:
        prefill_rows.append(bench_step(model, ceil, counts, batch=1, query_len=n, context=0, reps=max(3, reps // 3)))
        _print("prefill", prefill_rows[-1], f"T={n}")
        saved()
    profiles += [prefill_kernel_profile(model, n) for n in prefill] if profile_prefill else []
    for prof in profiles:
        print(f"prefill T={prof['num_tokens']} kernels: {prof['kernel_ms_per_step']:.2f} ms a step; top:", flush=True)
        for k in prof["kernels"][:12]:
            print(f"  {k['ms_per_step']:8.3f} ms {k['calls_per_step']:5d}x  {k['name'][:100]}", flush=True)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    config = _config(shape, spec.model_type)
    shared = expert_shape(config)[4]
    # routed experts alone; with the shared experts fused (the model's layer at one rank); fp8 weights too
    variants = [(0, False), (shared, False), (shared, True)] if shared else [(0, False), (0, True)]
    for (num_shared, fp8), n in itertools.product(variants, moe_tokens):
        moe.append(bench_fused_moe(ceil, config, n, dev, dt, reps, num_shared=num_shared, fp8=fp8, paths=moe_paths))
        r = moe[-1]
        print(f"fused_moe {r['weights']:<17} S={num_shared} T={n:<5} ref {r['ref_ms']:9.3f} ms | {r['kernel']} "
              f"{r['kernel_ms']:9.3f} ms | "
              f"x{r['speedup_vs_ref']:.1f} | roofline {r['roofline_ms']:.3f} ms ({r['pct_of_roofline']:.0f}%) | "
              f"err {r['max_abs_err_vs_ref']:.1e}"
              + "".join(f" | {p} {r[p + '_ms']:.3f} ms ({r['pct_of_roofline_' + p]:.0f}%)"
                        for p in FUSED_MOE_PATHS if p + "_ms" in r), flush=True)
        saved()

    def kernel_us(r: dict, key: str) -> str:  # the Triton kernels are timed on CUDA only
        return f"{r[key] * 1e3:8.1f} us" if key in r else "  (none on this device)"

    for n in moe_tokens:
        small_ops.append(bench_routing_align(config, n, dev, reps))
        r = small_ops[-1]
        print(f"routing+align T={n:<5} routing ref {r['routing_ref_ms'] * 1e3:8.1f} us"
              f" kernel {kernel_us(r, 'routing_kernel_ms')} | align ref {r['align_ref_ms'] * 1e3:8.1f} us"
              f" kernel {kernel_us(r, 'align_kernel_ms')} ({'CUDA graph' if dev.type == 'cuda' else 'eager'})",
              flush=True)
        saved()
    result["complete"], result["seconds"] = True, time.time() - started
    return result


def _config(shape: dict, model_type: str = "deepseek_v3"):
    import transformers

    return transformers.AutoConfig.for_model(model_type, **shape)


def _print(kind: str, row: dict, label: str) -> None:
    print(f"{kind:<7} {label:<16} {row['ms']:9.3f} ms | roofline {row['roofline_ms']:8.3f} ms ({row['bound']}) "
          f"| {row['pct_of_roofline']:5.1f}% | {row['tokens_per_s']:10.0f} tok/s", flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str, known, what: str, none: bool = False) -> list[str]:
    """A flag's comma-separated names from ``known`` (with ``none``, "none" is the empty list); an unknown one is a
    usage error naming it (before any benchmark runs)."""
    names = [] if none and text.strip() == "none" else [v for v in text.split(",") if v]
    unknown = [v for v in names if v not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what}(s) {', '.join(unknown)}; known: {', '.join(known)}"
                                         + (", or none" if none else ""))
    return names


def _variants(text: str) -> list[str]:
    """``--ab``'s comma-separated names."""
    return _names(text, AB_VARIANTS, "A/B variant")


def _paths(text: str) -> list[str]:
    """``--moe-paths``' comma-separated names ("none": no other path)."""
    return _names(text, FUSED_MOE_PATHS, "fused MoE path", none=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v2-lite", choices=sorted(MODELS),
                        help="the MoE shape (default: deepseek-v2-lite)")
    parser.add_argument("--tiny", action="store_true", help="the model's tiny shape and cases (CPU smoke run)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=_ints, default=None, help="decode batch sizes, e.g. 1,16,64,256")
    parser.add_argument("--context", type=_ints, default=None,
                        help="cached tokens per decode request, one or a list, e.g. 1024,4096")
    parser.add_argument("--prefill", type=_ints, default=None, help="prefill lengths, e.g. 1024,4096")
    parser.add_argument("--moe-tokens", type=_ints, default=None, help="fused MoE token counts")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--no-graphs", action="store_true", help="decode eager only (no CUDA-graph rows)")
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="the model's weights for decode/prefill rows: fp8 128x128 blocks (default: --dtype)")
    parser.add_argument("--git-rev", default=None, help="revision of the code (default: git rev-parse HEAD)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/moe-<device>.json, "
                        "moe-qwen3-30b-a3b-<device>.json for Qwen3)")
    parser.add_argument("--ab", default=None, type=_variants,
                        help=f"A/B variants of the decode step timed in this process, e.g. default,no-pdl "
                        f"(from {', '.join(AB_VARIANTS)}; every --batches at the first --context, and every --prefill)")
    parser.add_argument("--ab-rounds", type=int, default=3, help="interleaved rounds of the --ab variants")
    parser.add_argument("--moe-paths", default=None, type=_paths,
                        help=f"the fused MoE rows' other paths timed beside the kernel fused_moe takes, e.g. "
                        f"grouped_mm ({', '.join(FUSED_MOE_PATHS)}; default all; 'none' for none)")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="also profile each prefill case's kernels (torch.profiler; prefill_profile rows)")
    args = parser.parse_args(argv)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    prefix = "" if args.model == "deepseek-v2-lite" else f"{args.model}-"  # the V2-Lite file names of before
    dev = resolve_device(args.device or "auto")
    out = Path(args.out or Path(__file__).resolve().parents[1] / "benchmarks" / "results"
               / f"moe-{prefix}{'tiny-' if args.tiny else ''}{_slug(device_name(dev))}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = run(args.tiny, str(dev), args.dtype, args.batches, args.context, args.prefill, args.moe_tokens,
                 args.reps, command=" ".join([*env_settings(), "python jobs/bench_moe.py", argv_text]).strip(),
                 git_rev=args.git_rev,
                 graphs=not args.no_graphs, model=args.model, quantization=args.quantization, ab=args.ab,
                 ab_rounds=args.ab_rounds, profile_prefill=args.profile_prefill,
                 checkpoint=functools.partial(_write_result, out), moe_paths=args.moe_paths)
    _write_result(out, result)
    print(f"wrote {out}")
    return result


def _write_result(path: Path, result: dict) -> None:
    """Write ``result`` to ``path`` as JSON (after each case and at the end: a run cut short leaves its rows, with
    ``complete`` False), through a temporary file so that a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def _slug(device: str) -> str:
    if device.startswith("cpu"):
        return "cpu"
    return device.split()[-1].lower()  # "NVIDIA H200" -> "h200"


if __name__ == "__main__":
    # a run stopped by a time limit (timeout's SIGTERM) first prints every thread's stack: where it was
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    main()
