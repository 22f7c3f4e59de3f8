"""Row-wise log-softmax (the sampler's logprobs), batch-invariant.

One program per row walks the vocabulary in ``BLOCK`` columns, in order, with an online max and
sum of exponentials held per lane and reduced once at the end: a row's reduction order depends on the
row's width and ``BLOCK`` only, never on the number of rows (``kernels.batch_invariant``).
"""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import tl, triton, use_triton
from rayinfer.kernels.batch_invariant import is_batch_invariant

_BLOCK = 4096


def log_softmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dim. logits: [B, V] float32 -> [B, V] float32."""
    return torch.log_softmax(logits.float(), dim=-1)


@triton.jit
def _log_softmax_kernel(x_ptr, y_ptr, V, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_ptr + row * stride_x + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane that saw only -inf: no inf - inf
        s = s * tl.exp(m - m_use) + tl.exp(x - m_use)
        m = m_new
    row_max = tl.max(m, 0)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(s * tl.exp(m - row_max), 0)
    lse = row_max + tl.log(total)
    for v0 in range(0, V, BLOCK):
        ok = v0 + cols < V
        x = tl.load(x_ptr + row * stride_x + v0 + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + v0 + cols, x - lse, mask=ok)


def log_softmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """Triton kernel of :func:`log_softmax_ref` (same contract; one program per row)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab = logits.shape
    out = torch.empty((num_rows, vocab), dtype=torch.float32, device=logits.device)
    if num_rows and vocab:
        block = min(_BLOCK, triton.next_power_of_2(vocab))
        _log_softmax_kernel[(num_rows,)](logits, out, vocab, logits.stride(0), out.stride(0), BLOCK=block,
                                         num_warps=8 if block >= 2048 else 4)
    return out


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`log_softmax_ref`; the row-wise Triton kernel in batch-invariant mode
    (on CUDA, or under the Triton interpreter), else torch's."""
    if is_batch_invariant() and logits.dim() == 2 and use_triton(logits):
        return log_softmax_triton(logits)
    return log_softmax_ref(logits)
