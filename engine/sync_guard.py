"""A scope that turns any hidden GPU-to-host synchronization into an error.

Overlapped scheduling only overlaps if launching a step never waits for the GPU: one stray ``.item()``,
``.tolist()``, ``nonzero`` or blocking copy inside the step serializes CPU and GPU again, silently. Inside
:func:`no_host_sync`, PyTorch raises on such calls (``torch.cuda.set_sync_debug_mode("error")``), so tests
that run a step under it fail on the first hidden sync.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def no_host_sync(enabled: bool = True):
    """Raise ``RuntimeError`` on any synchronizing CUDA call inside the scope (no-op without CUDA)."""
    if not enabled or not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
