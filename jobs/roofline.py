"""The two ceilings of this machine and the bytes and FLOPs of a model's steps: the roofline arithmetic.

Decode is memory-bound: a step cannot beat (weight bytes + KV bytes read) / HBM bandwidth. Prefill is
compute-bound: it cannot beat FLOPs / matmul rate. Both ceilings are measured (:func:`measure_ceilings`),
never taken from a datasheet. Cost models are pure arithmetic on a Hugging Face config, one per
architecture (:func:`register_cost_model`; jobs/bench_moe.py adds the MoE ones), checked by hand in
tests/jobs/test_bench.py.
"""

from __future__ import annotations

import dataclasses

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch


# -- timing and ceilings -------------------------------------------------------------------------
def time_fn(fn: Callable[[], Any], device: torch.device, warmup: int = 3, iters: int = 10) -> list[float]:
    """Seconds per call of ``fn``, one entry per timed call, after ``warmup`` untimed calls.

    CUDA: a pair of CUDA events around each call (GPU timeline, launch gaps included); CPU: perf_counter.
    """
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def measure_ceilings(device: torch.device, dtype: torch.dtype, copy_bytes: int, gemm_n: int,
                     iters: int = 10) -> dict[str, Any]:
    """Measure this machine's memory bandwidth and matmul rate, the two ceilings of every roofline.

    Args:
        device, dtype: where and in which dtype (the model's) to measure.
        copy_bytes: size of the source buffer of the device-to-device copy (bytes).
        gemm_n: side of the square ``[n, n] @ [n, n]`` matmul on random data.
    Returns:
        ``bandwidth_Bps`` (bytes read + written per second by the copy, median call),
        ``matmul_flops`` (FLOP/s of the matmul, median call), and the sizes used.
    """
    n = max(1, copy_bytes // dtype.itemsize)
    src = torch.empty(n, dtype=dtype, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_s = statistics.median(time_fn(lambda: dst.copy_(src), device, warmup=3, iters=iters))
    del src, dst
    a = torch.randn(gemm_n, gemm_n, dtype=dtype, device=device)
    b = torch.randn(gemm_n, gemm_n, dtype=dtype, device=device)
    c = torch.empty_like(a)
    gemm_s = statistics.median(time_fn(lambda: torch.mm(a, b, out=c), device, warmup=3, iters=iters))
    del a, b, c
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "bandwidth_Bps": 2 * n * dtype.itemsize / copy_s,
        "matmul_flops": 2 * gemm_n**3 / gemm_s,
        "copy_bytes": n * dtype.itemsize,
        "gemm_n": gemm_n,
        "dtype": str(dtype).removeprefix("torch."),
        "method": "median of timed calls: copy_ of a device buffer (bytes read + written); torch.mm on randn",
    }


# -- cost models: bytes and FLOPs of a step ------------------------------------------------------
class CostModel(Protocol):
    """What a roofline needs to know about an architecture (one per ``config.architectures[0]``)."""

    kv_bytes_per_token: int  # KV-cache bytes of one token over all layers

    def weight_bytes_read(self, num_tokens: int) -> int:
        """Weight bytes a step over ``num_tokens`` tokens must read at least once."""

    def flops(self, num_tokens: int, num_attn_pairs: int, num_logits: int) -> int:
        """FLOPs of a step: ``num_tokens`` through the layers, ``num_attn_pairs`` (query, key) pairs of
        attention summed over the batch, ``num_logits`` rows through the LM head."""


@dataclass(frozen=True)
class DenseDecoderCost:
    """Bytes and FLOPs of a dense Llama-architecture decoder (GQA attention, gated MLP, RMSNorm).

    Counts the fewest bytes and the matmul FLOPs (2 per multiply-add); norms, RoPE, softmax and
    activations are left out of the FLOPs (under 1% at these shapes). Biases are ignored.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype_bytes: int
    kv_dtype_bytes: int | None = None  # the KV cache's element size when it differs (fp8 KV: 1)

    @classmethod
    def from_config(cls, config, dtype_bytes: int) -> "DenseDecoderCost":
        """Read the sizes from a Hugging Face Llama-style config; weights and KV in ``dtype_bytes``."""
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size, tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            dtype_bytes=dtype_bytes,
        )

    @property
    def layer_matmul_params(self) -> int:
        """Parameters of one layer's projections: q, k, v, o and gate, up, down."""
        h, qd, kvd = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * qd + 2 * h * kvd + qd * h + 3 * h * self.intermediate_size

    @property
    def layer_params(self) -> int:
        return self.layer_matmul_params + 2 * self.hidden_size  # + two RMSNorm weights

    @property
    def num_params(self) -> int:
        """All parameters, a tied LM head counted once."""
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tie_word_embeddings else 2) + self.num_layers * self.layer_params + self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * (self.kv_dtype_bytes or self.dtype_bytes)

    def weight_bytes_read(self, num_tokens: int) -> int:
        """Every layer, the final norm and the LM head once, plus one embedding row per token (bytes)."""
        h = self.hidden_size
        return (self.num_layers * self.layer_params + h + self.vocab_size * h + num_tokens * h) * self.dtype_bytes

    def flops(self, num_tokens: int, num_attn_pairs: int, num_logits: int) -> int:
        attn = 4 * self.num_layers * self.num_heads * self.head_dim * num_attn_pairs  # QK^T and PV
        return 2 * self.num_layers * self.layer_matmul_params * num_tokens + attn + \
            2 * self.hidden_size * self.vocab_size * num_logits


COST_MODELS: dict[str, Callable[[Any, int], CostModel]] = {
    "LlamaForCausalLM": DenseDecoderCost.from_config,
    "MistralForCausalLM": DenseDecoderCost.from_config,
}


def register_cost_model(architecture: str, factory: Callable[[Any, int], CostModel]) -> None:
    """Add the cost model of an architecture: ``factory(hf_config, dtype_bytes) -> CostModel``."""
    COST_MODELS[architecture] = factory


def cost_model_for(config, dtype_bytes: int, kv_dtype_bytes: int | None = None) -> CostModel:
    """The cost model of ``config.architectures[0]``; ``kv_dtype_bytes`` sets the KV cache's element size
    where the model's cost class has that field (else KV is counted in ``dtype_bytes``).

    Raises:
        ValueError: for an architecture with no registered cost model (naming the known ones).
    """
    arch = (getattr(config, "architectures", None) or [None])[0]
    if arch not in COST_MODELS:
        raise ValueError(f"no roofline cost model for architecture {arch!r}; known: {sorted(COST_MODELS)} "
                         "(add one with benchlib.register_cost_model)")
    cost = COST_MODELS[arch](config, dtype_bytes)
    if kv_dtype_bytes and hasattr(cost, "kv_dtype_bytes"):
        cost = dataclasses.replace(cost, kv_dtype_bytes=kv_dtype_bytes)
    return cost


def decode_step_cost(cost: CostModel, batch: int, context: int) -> tuple[int, int]:
    """(bytes, FLOPs) of one decode step: ``batch`` requests, each with ``context`` tokens after the step.

    Bytes: the weights once plus every request's KV (``context`` tokens) read once.
    """
    num_bytes = cost.weight_bytes_read(batch) + batch * context * cost.kv_bytes_per_token
    return num_bytes, cost.flops(batch, batch * context, batch)


def prefill_cost(cost: CostModel, num_tokens: int) -> tuple[int, int]:
    """(bytes, FLOPs) of prefilling one ``num_tokens``-token sequence from empty (causal, logits of the
    last token only); bytes are the weights once plus the KV written."""
    num_bytes = cost.weight_bytes_read(num_tokens) + num_tokens * cost.kv_bytes_per_token
    return num_bytes, cost.flops(num_tokens, num_tokens * (num_tokens + 1) // 2, 1)


def roofline(num_bytes: int, num_flops: int, ceilings: dict) -> dict[str, Any]:
    """The roofline of a step that moves ``num_bytes`` and computes ``num_flops``.

    Returns:
        ``memory_s`` (bytes / bandwidth), ``compute_s`` (FLOPs / matmul rate), ``roofline_s`` (their max),
        ``bound`` ("memory" or "compute"), and the inputs.
    """
    memory_s = num_bytes / ceilings["bandwidth_Bps"]
    compute_s = num_flops / ceilings["matmul_flops"]
    return {"bytes": num_bytes, "flops": num_flops, "memory_s": memory_s, "compute_s": compute_s,
            "roofline_s": max(memory_s, compute_s), "bound": "memory" if memory_s >= compute_s else "compute"}


def offline_roofline(cost: CostModel, prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                     ceilings: dict) -> dict[str, Any]:
    """The fastest an engine could finish an offline workload on this machine.

    Compute: every token's FLOPs (a request computes ``prompt + output - 1`` tokens, causal attention, one
    LM-head row per output token). Memory: each decode step reads the weights; there are at least as many
    steps as the longest request's decode tokens and as all decode tokens / ``max_num_seqs``; every
    decode token reads its request's KV once.

    Returns:
        :func:`roofline`'s dict plus ``num_decode_steps`` and ``output_tok_s`` (output tokens / roofline_s).
    """
    flops = kv_tokens = decode_tokens = 0
    for p, o in zip(prompt_lens, output_lens):
        n = p + o - 1
        flops += cost.flops(n, n * (n + 1) // 2, o)
        d = o - 1  # decode steps of this request; contexts p+1 .. p+d
        decode_tokens += d
        kv_tokens += d * (2 * p + 1 + d) // 2
    steps = max(-(-decode_tokens // max_num_seqs), max((o - 1 for o in output_lens), default=0))
    weights = steps * cost.weight_bytes_read(-(-decode_tokens // steps)) if steps else 0
    out = roofline(weights + kv_tokens * cost.kv_bytes_per_token, flops, ceilings)
    out["num_decode_steps"] = steps
    out["output_tok_s"] = sum(output_lens) / out["roofline_s"]
    return out
