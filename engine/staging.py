"""One host-to-device copy for a step's small input arrays."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

_ALIGN = 16  # bytes; every array starts at a multiple (dtype views need it, kernels like it)
_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32}


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Tensors on ``device`` with the arrays' shapes, dtypes (int32, int64 or float32 on CUDA) and values,
    without waiting for the copy.

    On CUDA the arrays are packed into one pinned byte buffer (from the caching host allocator, so it is
    not reused before its copy has run) and moved with a single non-blocking copy; the results are
    views of one device buffer. Elsewhere they are ``torch.from_numpy`` views of the arrays themselves.
    """
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
    packed = host.numpy()
    for a, at in zip(arrays, offsets):
        packed[at : at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    dev = host.to(device, non_blocking=True)
    return [dev[at : at + a.nbytes].view(_DTYPES[a.dtype]).view(a.shape) for a, at in zip(arrays, offsets)]
