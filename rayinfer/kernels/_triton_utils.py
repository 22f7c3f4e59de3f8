"""The guarded Triton import and the dispatch rule shared by every kernel module.

Kernel modules import ``triton``, ``tl`` and ``libdevice`` from here. On a machine without a working
Triton the names are stand-ins whose ``jit`` leaves the function undecorated, so the modules still
import (their ``@triton.jit`` functions are then never called: :func:`use_triton` is False).
"""

from __future__ import annotations

import functools
import os

import torch

from rayinfer import envs

try:
    import triton
    import triton.language as tl

    try:
        from triton.language.extra import libdevice
    except ImportError:  # older Triton: no portable libdevice module; kernels fall back to tl.*
        libdevice = None
    try:  # grid dependency control, for programmatic dependent launch (Hopper and later)
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # an older Triton: no-ops, and use_pdl() is False
        gdc_launch_dependents = gdc_wait = None
    HAS_TRITON = True
except Exception:  # ImportError, or a Triton that fails to load on a CPU-only machine
    HAS_TRITON = False
    libdevice = None
    gdc_launch_dependents = gdc_wait = None

    class _TritonStandIn:
        """Just enough of ``triton`` for ``@triton.jit`` at import time."""

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 1 << (n - 1).bit_length()

    triton = _TritonStandIn()
    tl = None


def is_interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``).

    Read from Triton's own switch: the interpreter lacks ``libdevice`` and bf16 ``tl.dot``, so kernels
    take their portable branches under it.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the dispatchers should run the Triton kernel on these tensors.

    True when Triton imported and every tensor is on a CUDA device, or when the interpreter is on
    (then CPU tensors run through it, which tests use).
    """
    if not HAS_TRITON:
        return False
    if is_interpreting():
        return True
    return all(t.is_cuda for t in tensors)


def use_libdevice() -> bool:
    """Whether kernels may call ``libdevice`` (correctly rounded cos/sin/log matching torch on CUDA)."""
    return libdevice is not None and not is_interpreting()


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200); 1 on the interpreter."""
    if is_interpreting() or not torch.cuda.is_available():
        return 1
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    return num_sms(t.device.index if t.is_cuda and t.device.index is not None else 0)


@functools.lru_cache(maxsize=None)
def device_capability(index: int | None) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(index)``, cached (dispatchers ask it on every call)."""
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _pdl_supported(device_index: int) -> bool:
    if not HAS_TRITON or gdc_wait is None or is_interpreting() or not torch.cuda.is_available():
        return False
    if not envs.pdl_enabled():
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        if "launch_pdl" not in CUDAOptions.__dataclass_fields__:
            return False
    except Exception:  # not the NVIDIA backend (ROCm) or an older Triton
        return False
    return torch.version.cuda is not None and torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device launch with programmatic dependent launch (PDL).

    True on Hopper and later GPUs with a Triton that has ``launch_pdl`` and ``gdc_wait``, unless the
    environment sets ``RAYINFER_PDL=0``. A kernel launched so (``**pdl_launch(True)``) may start
    while the previous kernel in the stream still runs; every one of its programs must call
    :func:`pdl_wait` before it reads anything an earlier kernel wrote and before it writes anything
    (the wait is what orders it after all earlier kernels). Weights may be read before the wait: no
    kernel writes them during a step.
    Source: CUDA programming guide, "Programmatic Dependent Launch and Synchronization".
    """
    return t.is_cuda and _pdl_supported(t.device.index if t.device.index is not None else torch.cuda.current_device())


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """In a kernel launched with :func:`pdl_launch`: wait until the previous kernel has finished and its
    writes are visible, then let the next kernel start (once all programs got here). Triggering before
    the own wait would let a whole chain of kernels start at once, each holding multiprocessor slots.
    A no-op when ``USE_PDL`` is False."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_launch(enabled: bool) -> dict:
    """Launch keyword arguments for a kernel with a ``USE_PDL`` constexpr (default False) that calls
    :func:`pdl_wait`: ``USE_PDL=True, launch_pdl=True`` when ``enabled`` (see :func:`use_pdl`), else none."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled else {}


# ROWWISE: batch-invariant mode under the Triton interpreter: ``tl.dot`` is numpy's matmul there, and BLAS sums a
# row's products in an order that depends on the row's place in the tile (a GPU's MMA does not). The
# kernels then write the product out as ``tl.sum(a[:, :, None] * b[None, :, :], 1)`` (their ``ROWWISE``
# branch, inlined: a nested jit call costs milliseconds per call in the interpreter), whose sum over K
# runs in the same order for every row.
