"""jobs/tune_gemv.py's per-shape search, on CPU through the Triton interpreter: it takes the fastest tile set
(times from a stand-in clock), keeps the rule's tiles when nothing beats them, and checks its winner against
the torch reference, for 16-bit-style and fp8 block weights."""

from __future__ import annotations

import sys

import pytest

from rayinfer.kernels._triton_utils import HAS_TRITON


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_tune_shape_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__, timeout_s=300)


def check(fp8: bool, fastest: dict | None) -> None:
    """Tune one small shape with a clock that makes ``fastest`` (or, None, the rule's tiles) quickest."""
    import torch

    from rayinfer.jobs import tune_gemv
    from rayinfer.jobs import benchlib
    from rayinfer.kernels import gemv

    real, used = gemv.fused_linear_triton, []

    def spy(*args, config=None, **kw):
        used.append(config)
        return real(*args, config=config, **kw)

    def clock(fns, **_):
        fns[0]()  # the kernel runs (and must not raise) under each tile set
        return 1.0 if used[-1] == (fastest or gemv._choose_config(200, 256, True)) else 2.0

    gemv.fused_linear_triton, benchlib.graph_time_us = spy, clock
    try:
        r = tune_gemv.tune_shape(200, 256, "rms_norm", torch.float32, fp8=fp8, device="cpu")
    finally:
        gemv.fused_linear_triton = real
    assert r["config"] == (fastest or r["rule"]), r
    assert r["us"] == 1.0 and r["rule_us"] == (2.0 if fastest else 1.0), r
    assert len(used) >= len(tune_gemv.candidates()) + 2, "every candidate was timed"
    assert r["max_abs_err"] < (2e-2 if fp8 else 1e-4), r  # fp8: the reference is the dequantized weight


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        check(False, dict(block_n=4, block_k=1024, num_warps=4, num_stages=3))
        check(True, None)
        check(True, dict(block_n=16, block_k=512, num_warps=8, num_stages=4))
        print("tune_gemv: ok")
    else:
        sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
