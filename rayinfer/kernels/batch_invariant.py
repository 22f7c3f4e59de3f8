"""The batch-invariant mode switch (``EngineConfig.batch_invariant``), read by the kernel dispatchers.

With the mode on, every kernel on a model's path computes each row with a reduction order that does not
depend on how many rows the call has, where the row sits among them, how the request's prompt was
chunked, or whether its prefix came from the cache; so a greedy request's tokens and logprobs are the same
bits whatever else shares its steps. What each dispatcher does then:

- linear layers (prefill GEMM, decode GEMV, LM head, MoE routers (DeepSeek-V3's in float32) and shared
  experts, MLA's low-rank query and latent projections and output):
  :func:`rayinfer.kernels.matmul.dense_linear` takes the persistent Triton matmul, without split-K
  (its tiles follow the row count; they do not change the bits); the fused batch-1 GEMVs are off;
  MLA's absorbed per-head up-projections (a batched GEMM) take the same kernel once per head
  (:func:`~rayinfer.kernels.matmul.dense_batched_linear`); fp8 block-quantized linears take one tile set
  at every row count (:func:`rayinfer.kernels.block_fp8.block_fp8_linear`);
- attention: one key tile (``BLOCK_N``) for prefill, extend and decode, no split-KV, every tile through
  the same masked code path, so every query row reads its keys in the same tiles from position 0
  (``kernels.paged_attention``);
- MLA (DeepSeek-V3): every step attends in the absorbed form (the model otherwise expands the latents
  for steps with a prefill, which rounds differently), whose kernel gives each query token a program of
  its own over fixed key tiles (``kernels.mla_attention``);
- MoE routing: the sum of a token's k routing weights (renormalization) in slot order, and DeepSeek-V3's
  grouped top-k returns its experts by descending score (``topk(sorted=False)``'s order may follow the
  algorithm torch picks for the batch's shape) (``model.moe``);
- fused MoE: a fixed row tile, and the top-k sum in slot order (``kernels.fused_moe``); under expert
  parallelism the ranks exchange each (token, slot)'s output unsummed, so the cross-rank sum adds one
  nonzero term per element (exact in any order) and a token's row equals the one-process layer's
  (``model.moe.RoutedExperts``);
- log-softmax of the logprobs: one program per row (``kernels.log_softmax``).

RMSNorm (also the per-head q/k norms and MLA's latent norms), RoPE, the KV write, SiLU-and-mul, the
routers' softmax / sigmoid and top-k, and the sampler's draw are row-wise in both modes.

Checked bit for bit on CPU through the Triton interpreter (``tests/engine/test_batch_invariant.py``:
tiny Llama, Qwen3-MoE and DeepSeek-V3 engines with varied chunking, prefix hits and preemption, 1P1D;
``tests/model/test_moe_ep.py``: the expert-parallel layer over 4 gloo ranks;
``tests/kernels/test_batch_invariant_kernels.py``: each kernel's rows), and on an H200 for the dense
Llama path (SmolLM2 shape, bf16); the GPU tests also hold a DeepSeek-V3 (MLA + MoE) case and MoE / MLA
kernel rows, not yet run there.

The switch is a context variable: the model runner enters :func:`batch_invariant_mode` around its
forwards (and the CUDA-graph capture), so engines of one process keep their own modes and nothing
else is affected. On a device without Triton (plain CPU) the dispatchers keep the torch ops, whose
reduction orders are the library's: the mode is exact only where the Triton kernels run (CUDA, or the
Triton interpreter). After Thinking Machines, "Defeating Nondeterminism in LLM Inference" (2025).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_MODE = contextvars.ContextVar("rayinfer_batch_invariant", default=False)


def is_batch_invariant() -> bool:
    """Whether the calling context runs in batch-invariant mode (see the module docstring)."""
    return _MODE.get()


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Run the body with the batch-invariant mode on (``enabled``) or off, then restore the caller's mode."""
    token = _MODE.set(bool(enabled))
    try:
        yield
    finally:
        _MODE.reset(token)
