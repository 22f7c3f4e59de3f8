"""The batch-invariant mode switch (``EngineConfig.batch_invariant``), read by the kernel dispatchers.

With the mode on, every kernel on a model's path computes each row with a reduction order that does not
depend on how many rows the call has, where the row sits among them, how the request's prompt was
chunked, or whether its prefix came from the cache; so a greedy request's tokens and logprobs are the same
bits whatever else shares its steps. What each dispatcher does then:

- linear layers (prefill GEMM, decode GEMV, LM head, MoE router and shared experts):
  :func:`rayinfer.kernels.matmul.dense_linear` takes the persistent Triton matmul, without split-K
  (its tiles follow the row count; they do not change the bits); the fused batch-1 GEMVs are off;
- attention: one key tile (``BLOCK_N``) for prefill, extend and decode, no split-KV, every tile through
  the same masked code path, so every query row reads its keys in the same tiles from position 0
  (``kernels.paged_attention``);
- fused MoE: a fixed row tile, and the top-k sum in a fixed order (``kernels.fused_moe``);
- log-softmax of the logprobs: one program per row (``kernels.log_softmax``).

RMSNorm, RoPE, the KV write, SiLU-and-mul and the sampler's draw are row-wise in both modes.

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
