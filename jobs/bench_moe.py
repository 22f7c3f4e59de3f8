"""MoE benchmark at EP=1: decode step and prefill times of a DeepSeek-V2-Lite-shaped model against the
roofline, and the fused MoE kernel against its torch reference.

    python jobs/bench_moe.py                      # on a CUDA machine: V2-Lite shape, bf16 dummy weights
    python jobs/bench_moe.py --tiny --device cpu  # a tiny shape, seconds on CPU (what the test runs)
    python jobs/bench_moe.py --batches 1,16,64,256 --context 1024 --prefill 1024,4096 --out results.json

The model is the DeepSeek-V3 architecture (MLA, shared + routed experts, sigmoid grouped top-k) with
DeepSeek-V2-Lite's dimensions: hidden 2048, 27 layers (the first dense), 64 routed + 2 shared experts,
top-6, expert intermediate 1408, kv_lora_rank 512, qk_rope 64, qk_nope 128, v_head 128, no query
LoRA, vocab 102400. V2-Lite itself routes with a softmax; the V3 router is used here, which moves the
same bytes and FLOPs. Weights are random (``load_format="dummy"``), bf16.

Roofline, both ceilings measured in the same run: HBM bandwidth as a large device-to-device copy (bytes
read plus written) and the bf16 matmul rate of a large square matmul. A step cannot beat
``max(bytes / bandwidth, FLOPs / matmul rate)``, where bytes are the weights it reads (dense weights
and LM head, the routed experts it actually routes to, counted from the model's expert load, the
embedding rows) plus the KV cache it reads and writes, and FLOPs are 2 x the active parameters per token
(routed experts at top-k) x tokens plus attention (absorbed MLA for decode, causal expanded MLA for
prefill). Decode is memory-bound, prefill compute-bound. Times are medians of the model forward plus
the logits of the sampled rows (no sampling, no scheduling): eager, and on CUDA decode also replayed
from the engine's CUDA graphs (``engine.cuda_graph.DecodeGraphs``; ``ms_graph``), the way the engine
runs decode steps (``--no-graphs`` skips them). The fused MoE rows time the routed-expert kernel alone
(alignment, the gate/up GEMM with SiLU-and-mul fused, the down GEMM, top-k sum), replayed from a CUDA
graph (``kernel_ms``; ``kernel_eager_ms`` eager) for M = 1 ... 4096 tokens against its
roofline (the experts it reads, or its FLOPs) and its torch reference; the routing_align rows time the
router (grouped top-k) and the alignment (with load counting) kernels against their torch references,
each replayed from a CUDA graph.

Writes JSON (command, device, git revision, ceilings, one row per case) to ``--out``, by default
``benchmarks/results/moe-<device>.json``. :func:`run` is the entry point for other jobs;
:func:`register_bench_plugins` adds the cost model and a "deepseek-v2-lite" scenario to ``jobs/bench.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# DeepSeek-V3 architecture with DeepSeek-V2-Lite dimensions (Hugging Face config keyword arguments).
V2_LITE_V3_ARCH = dict(
    architectures=["DeepseekV3ForCausalLM"], vocab_size=102400, hidden_size=2048, intermediate_size=10944,
    moe_intermediate_size=1408, num_hidden_layers=27, first_k_dense_replace=1, num_attention_heads=16,
    num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1,
    topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840,
    rms_norm_eps=1e-6, tie_word_embeddings=False, num_nextn_predict_layers=0, bos_token_id=100000,
    eos_token_id=100001,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                         mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1),
)
# The same architecture, small enough for a CPU test run.
TINY_V3_ARCH = dict(
    V2_LITE_V3_ARCH, vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)
BLOCK_SIZE = 64
FULL = dict(batches=[1, 16, 32, 64, 256], context=1024, prefill=[1024, 4096, 8192],
            moe_tokens=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
TINY = dict(batches=[1, 4], context=32, prefill=[32], moe_tokens=[1, 16])


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


def bench_step(model, ceil: dict, counts: dict, *, batch: int, query_len: int, context: int, reps: int,
               graphs: bool = False) -> dict:
    """Time one forward of ``batch`` requests computing ``query_len`` new tokens each after ``context``
    cached tokens, plus the logits of each request's last token; compare with the roofline.

    graphs: (decode on CUDA) also time the forward replayed from the engine's ``DecodeGraphs``
    (``ms_graph``, ``pct_of_roofline_graph``)."""
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
        return model.compute_logits(model(ids, pos, kv, meta)[last])

    with torch.inference_mode():
        model.expert_load(reset=True)
        step()
        touched = int((model.expert_load(reset=True) > 0).sum())  # routed experts this batch reads
        ms = time_ms(step, device, reps)
        graph_ms = _graph_step_ms(model, kv, meta, ids, pos, seq_len, reps) if graphs and query_len == 1 else None
    tokens, item = batch * query_len, dtype.itemsize
    kv_width, layers = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.num_hidden_layers
    num_bytes = (counts["dense_bytes"] + counts["lm_head_bytes"] + touched * counts["per_expert_bytes"]
                 + item * (tokens * cfg.hidden_size + batch * seq_len * layers * kv_width))
    active = counts["dense"] + counts["num_moe_layers"] * counts["top_k"] * counts["per_expert"]
    heads, r, p = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if query_len == 1:  # absorbed MLA: scores over R + P, values of width R, per head and context token
        attn = batch * layers * heads * seq_len * 2 * (r + p + r)
    else:  # expanded MLA, causal: each query sees the context and the new tokens up to itself
        pairs = batch * (query_len * context + query_len * (query_len + 1) // 2)
        attn = layers * heads * pairs * 2 * (cfg.qk_nope_head_dim + p + cfg.v_head_dim)
    flops = 2 * active * tokens + 2 * counts["lm_head"] * batch + attn
    row = {"batch": batch, "query_len": query_len, "context": context, "ms": ms,
           "routed_experts_read": touched, **_roofline(ceil, num_bytes, flops)}
    row["pct_of_roofline"] = 100 * row["roofline_ms"] / ms
    row["tokens_per_s"] = tokens / ms * 1e3
    if graph_ms is not None:
        row["ms_graph"] = graph_ms
        row["pct_of_roofline_graph"] = 100 * row["roofline_ms"] / graph_ms
        row["tokens_per_s_graph"] = tokens / graph_ms * 1e3
    return row


def _graph_step_ms(model, kv, meta, ids, pos, seq_len: int, reps: int) -> float:
    """Median ms of a decode step (one token per request) replayed from the engine's CUDA graphs, plus the
    logits (eager, as the engine computes them)."""
    from rayinfer.engine.cuda_graph import DecodeGraphs

    batch = meta.seq_lens.shape[0]
    graphs = DecodeGraphs(model, kv, BLOCK_SIZE, max_model_len=seq_len, max_num_seqs=batch)
    graphs.capture()

    def step():
        hidden = graphs.run(ids, pos, meta.slot_mapping, meta.seq_lens, meta.block_tables)
        return model.compute_logits(hidden)

    try:
        return time_ms(step, kv.device, reps)
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
    timed from a CUDA graph on CUDA: the router (grouped top-k) and the alignment (with expert-load
    counting, as ``RoutedExperts`` runs it)."""
    from rayinfer.kernels._triton_utils import use_triton
    from rayinfer.kernels.fused_moe import _map_and_count, moe_align_ref, moe_align_triton
    from rayinfer.kernels.fused_moe_config import default_tile_config
    from rayinfer.kernels.moe_routing import grouped_topk_ref, grouped_topk_triton

    num_experts, top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    bias = torch.randn(num_experts, generator=gen, device=device) * 0.01
    args = (top_k, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    ids = grouped_topk_ref(logits, bias, *args)[1]
    load = torch.zeros(num_experts, dtype=torch.int64, device=device)
    block_m = default_tile_config(num_tokens, top_k).block_m
    row = {"num_tokens": num_tokens, "kernel": "triton" if use_triton(logits) else "none (no Triton here)"}
    with torch.inference_mode():
        row["routing_ref_ms"] = graph_ms(lambda: grouped_topk_ref(logits, bias, *args), device, reps)
        row["align_ref_ms"] = graph_ms(
            lambda: moe_align_ref(_map_and_count(ids, None, load), num_experts, block_m), device, reps)
        if use_triton(logits):
            row["routing_kernel_ms"] = graph_ms(lambda: grouped_topk_triton(logits, bias, *args), device, reps)
            row["align_kernel_ms"] = graph_ms(
                lambda: moe_align_triton(ids, num_experts, block_m, expert_load=load), device, reps)
    return row


def bench_fused_moe(ceil: dict, cfg, num_tokens: int, device: torch.device, dtype: torch.dtype, reps: int,
                    num_shared: int = 0, fp8: bool = False) -> dict:
    """fused_moe (Triton on CUDA, else its torch fallback) against fused_moe_ref at the model's expert shape.

    num_shared: S shared experts fused as extra experts every token takes (the model's layout at one rank);
    fp8: block-quantized fp8 expert weights (bf16 activations), against the reference on the dequantized
    weights; bytes count one per weight (plus the scales)."""
    from rayinfer.kernels._triton_utils import use_triton
    from rayinfer.kernels.block_fp8 import block_fp8_dequant_ref, quantize_block_fp8
    from rayinfer.kernels.fused_moe import dequant_w13, fused_moe, fused_moe_ref, quantize_w13
    from rayinfer.kernels.moe_routing import append_shared_experts

    num_routed, top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
    num_experts = num_routed + num_shared
    hidden_size, inter = cfg.hidden_size, cfg.moe_intermediate_size
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
        err = float((fused_moe(x, w13, w2, ids, weights, **scales).float()
                     - fused_moe_ref(x, ref13, ref2, ids, weights).float()).abs().max())
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
           "max_abs_err_vs_ref": err, "experts_read": touched, **_roofline(ceil, num_bytes, flops)}
    row["pct_of_roofline"] = 100 * row["roofline_ms"] / kernel_ms
    return row


# -- plug-in for jobs/bench.py (offline throughput through the engine, HF comparison) ------------
@dataclass(frozen=True)
class MoECost:
    """Bytes and FLOPs of a DeepSeek-V3-architecture step, the ``CostModel`` of ``jobs/roofline.py``.

    Weight bytes count every non-routed weight once, the LM head, one embedding row per token, and per
    MoE layer the routed experts that ``num_tokens`` tokens touch when routing is uniform
    (``L * (1 - (1 - k/L)^T)`` expected distinct experts). FLOPs: 2 per multiply-add of the projections
    with top-k routed experts per token, expanded MLA attention (``qk + v`` head dims per (query, key)
    pair and head); norms, RoPE, softmax and routing are left out. (The direct decode rows of
    :func:`bench_step` count the experts actually read and absorbed-MLA attention instead.)
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

    def experts_touched(self, num_tokens: int) -> float:
        """Expected distinct routed experts of one layer that ``num_tokens`` uniformly routed tokens read."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** num_tokens)

    def weight_bytes_read(self, num_tokens: int) -> int:
        experts = self.num_moe_layers * self.experts_touched(num_tokens) * self.expert_params
        h = self.hidden_size
        return int((self.dense_params + self.vocab_size * h + num_tokens * h + experts) * self.dtype_bytes)

    def flops(self, num_tokens: int, num_attn_pairs: int, num_logits: int) -> int:
        active = self.dense_params + self.num_moe_layers * self.top_k * self.expert_params
        return (2 * active * num_tokens + 2 * self.num_layers * self.attn_dims * num_attn_pairs
                + 2 * self.hidden_size * self.vocab_size * num_logits)


def write_shape(shape: dict, path: Path) -> Path:
    """Write ``shape`` as a Hugging Face config.json in ``path`` (a model directory for ``load_format="dummy"``)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    transformers.DeepseekV3Config(**shape).save_pretrained(path)
    return path


def register_bench_plugins(model_dir: Path | None = None) -> None:
    """Plug the MoE model into ``jobs/bench.py``: the DeepSeek-V3 cost model and a "deepseek-v2-lite"
    scenario (dummy bf16 weights on the GPU), whose config is written to ``model_dir`` (default: the
    user cache directory).
    """
    import platformdirs

    from rayinfer.jobs import benchlib, roofline

    roofline.register_cost_model("DeepseekV3ForCausalLM", MoECost.from_config)
    model_dir = model_dir or Path(platformdirs.user_cache_dir("rayinfer")) / "deepseek-v2-lite-v3arch"
    path = write_shape(V2_LITE_V3_ARCH, model_dir)
    benchlib.register_scenario(benchlib.Scenario(
        "deepseek-v2-lite", "DeepSeek-V3 architecture with DeepSeek-V2-Lite dimensions, dummy bf16 weights, on the GPU",
        {"model": {"model": str(path), "dtype": "bfloat16", "load_format": "dummy", "max_model_len": 8192},
         "engine": {"max_num_seqs": 256, "max_num_batched_tokens": 8192}, "offline": {"num_prompts": 200}},
    ))


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


def build_model(shape: dict, dtype: torch.dtype, device: torch.device, quantization: str | None = None):
    """The DeepSeek-V3 model of ``shape`` with dummy weights, through the engine's loader (``quantization``:
    "fp8" for DeepSeek-V3's 128 x 128 fp8 blocks in every linear and routed expert)."""
    from rayinfer.model.loader import load_model

    with tempfile.TemporaryDirectory() as tmp:
        return load_model(write_shape(shape, Path(tmp)), dtype, device, load_format="dummy", seed=0,
                          quantization=quantization)


def run(tiny: bool = False, device: str | None = None, dtype: str = "bfloat16", batches: list[int] | None = None,
        context: int | None = None, prefill: list[int] | None = None, moe_tokens: list[int] | None = None,
        reps: int | None = None, command: str | None = None, git_rev: str | None = None,
        graphs: bool = True, quantization: str | None = None) -> dict:
    """Run every case and return the results (see the module docstring for what is measured).

    Args:
        tiny: the tiny shape and case list (a CPU smoke run) instead of V2-Lite's.
        device: "cuda" or "cpu"; None picks cuda when available.
        dtype: parameter and activation dtype name.
        batches, context: decode cases (requests per step, cached tokens per request).
        prefill: prompt lengths of the prefill cases (one request, nothing cached).
        moe_tokens: token counts of the fused MoE cases.
        reps: timed repetitions per case (median reported).
        command, git_rev: recorded as given (defaults: this process's argv, :func:`git_revision`).
        graphs: on CUDA, also time decode replayed from CUDA graphs.
        quantization: the model's weights for the decode and prefill rows ("fp8": 128 x 128 fp8 blocks in
            every linear layer and routed expert; None: ``dtype``).
    """
    from rayinfer.model.loader import parse_dtype

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = torch.get_num_threads()
    if tiny and dev.type == "cpu":
        # A smoke run of tiny ops: one thread, since a shared CPU's busy cores stall every parallel
        # region of a multi-threaded op (times then measure the scheduler, not the op).
        torch.set_num_threads(1)
    try:
        return _run(tiny, dev, parse_dtype(dtype), batches, context, prefill, moe_tokens, reps, command, git_rev,
                    graphs and dev.type == "cuda", quantization)
    finally:
        torch.set_num_threads(threads)


def _run(tiny, dev, dt, batches, context, prefill, moe_tokens, reps, command, git_rev, graphs,
         quantization=None) -> dict:
    cases = TINY if tiny else FULL
    batches, context = batches or cases["batches"], context or cases["context"]
    prefill, moe_tokens = prefill or cases["prefill"], moe_tokens or cases["moe_tokens"]
    reps = reps or (3 if tiny else 10)
    shape = TINY_V3_ARCH if tiny else V2_LITE_V3_ARCH
    started = time.time()
    ceil = measure_ceilings(dev, dt, tiny)
    print(f"ceilings: {ceil['copy_GBps']:.0f} GB/s copy, {ceil['matmul_TFLOPs']:.3g} TFLOP/s matmul", flush=True)
    model = build_model(shape, dt, dev, quantization)
    counts = param_counts(model)
    decode = []
    for batch in batches:
        decode.append(bench_step(model, ceil, counts, batch=batch, query_len=1, context=context, reps=reps,
                                 graphs=graphs))
        _print("decode", decode[-1], f"B={batch} ctx={context}")
        if "ms_graph" in decode[-1]:
            r = decode[-1]
            _print("decode", dict(r, ms=r["ms_graph"], pct_of_roofline=r["pct_of_roofline_graph"],
                                  tokens_per_s=r["tokens_per_s_graph"]), f"B={batch} graph")
    prefill_rows = []
    for n in prefill:
        prefill_rows.append(bench_step(model, ceil, counts, batch=1, query_len=n, context=0, reps=max(3, reps // 3)))
        _print("prefill", prefill_rows[-1], f"T={n}")
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    config = _config(shape)
    moe = []
    shared = getattr(config, "n_shared_experts", 0) or 0
    # routed experts alone; with the shared experts fused (the model's layer at one rank); fp8 weights too
    variants = [(0, False), (shared, False), (shared, True)] if shared else [(0, False), (0, True)]
    for (num_shared, fp8), n in itertools.product(variants, moe_tokens):
        moe.append(bench_fused_moe(ceil, config, n, dev, dt, reps, num_shared=num_shared, fp8=fp8))
        r = moe[-1]
        print(f"fused_moe {r['weights']:<17} S={num_shared} T={n:<5} ref {r['ref_ms']:9.3f} ms | {r['kernel']} "
              f"{r['kernel_ms']:9.3f} ms | "
              f"x{r['speedup_vs_ref']:.1f} | roofline {r['roofline_ms']:.3f} ms ({r['pct_of_roofline']:.0f}%) | "
              f"err {r['max_abs_err_vs_ref']:.1e}", flush=True)
    small_ops = []
    for n in moe_tokens:
        small_ops.append(bench_routing_align(config, n, dev, reps))
        r = small_ops[-1]
        print(f"routing+align T={n:<5} routing ref {r['routing_ref_ms'] * 1e3:8.1f} us"
              f" kernel {r.get('routing_kernel_ms', float('nan')) * 1e3:8.1f} us | align ref"
              f" {r['align_ref_ms'] * 1e3:8.1f} us kernel {r.get('align_kernel_ms', float('nan')) * 1e3:8.1f} us"
              f" ({'CUDA graph' if dev.type == 'cuda' else 'eager'})", flush=True)
    return {
        "command": command or "python " + " ".join(sys.argv),
        "device": device_name(dev),
        "git_rev": git_rev or git_revision(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": str(dt),
        "quantization": quantization,
        "model": ("tiny DeepSeek-V3 (CPU smoke shape)" if tiny else
                  "DeepSeek-V3 architecture with DeepSeek-V2-Lite dimensions (dummy weights)"),
        "shape": {k: v for k, v in shape.items() if k != "architectures"},
        "params": counts,
        "ceilings": ceil,
        "notes": ("ms: median wall time, eager, forward + logits of each request's last token; ms_graph: the same "
                  "decode step replayed from the engine's CUDA graphs. roofline_ms: max(bytes / copy bandwidth, "
                  "FLOPs / matmul rate); pct_of_roofline = roofline_ms / ms."),
        "decode": decode,
        "prefill": prefill_rows,
        "fused_moe": moe,
        "routing_align": small_ops,
        "seconds": time.time() - started,
    }


def _config(shape: dict):
    import transformers

    return transformers.DeepseekV3Config(**shape)


def _print(kind: str, row: dict, label: str) -> None:
    print(f"{kind:<7} {label:<16} {row['ms']:9.3f} ms | roofline {row['roofline_ms']:8.3f} ms ({row['bound']}) "
          f"| {row['pct_of_roofline']:5.1f}% | {row['tokens_per_s']:10.0f} tok/s", flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shape and cases (CPU smoke run)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=_ints, default=None, help="decode batch sizes, e.g. 1,16,64,256")
    parser.add_argument("--context", type=int, default=None, help="cached tokens per decode request")
    parser.add_argument("--prefill", type=_ints, default=None, help="prefill lengths, e.g. 1024,4096")
    parser.add_argument("--moe-tokens", type=_ints, default=None, help="fused MoE token counts")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--no-graphs", action="store_true", help="decode eager only (no CUDA-graph rows)")
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="the model's weights for decode/prefill rows: fp8 128x128 blocks (default: --dtype)")
    parser.add_argument("--git-rev", default=None, help="revision of the code (default: git rev-parse HEAD)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/moe-<device>.json)")
    args = parser.parse_args(argv)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    result = run(args.tiny, args.device, args.dtype, args.batches, args.context, args.prefill, args.moe_tokens,
                 args.reps, command=f"python jobs/bench_moe.py {argv_text}".strip(), git_rev=args.git_rev,
                 graphs=not args.no_graphs, quantization=args.quantization)
    out = Path(args.out or Path(__file__).resolve().parents[1] / "benchmarks" / "results"
               / f"moe-{'tiny-' if args.tiny else ''}{_slug(result['device'])}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


def _slug(device: str) -> str:
    if device.startswith("cpu"):
        return "cpu"
    return device.split()[-1].lower()  # "NVIDIA H200" -> "h200"


if __name__ == "__main__":
    main()
