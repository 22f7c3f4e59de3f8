"""L2 prefetch: argument checks everywhere, and on a Hopper GPU a launch (also inside a CUDA graph) that
leaves every byte as it was."""

from __future__ import annotations

import pytest
import torch

from rayinfer.kernels import l2_prefetch as pf

CUDA = torch.cuda.is_available()


def test_prefetch_is_a_no_op_off_hopper():
    """On the CPU nothing is launched and nothing is asked for; bad arguments still raise."""
    t = torch.randn(64, 32)
    assert not pf.prefetch_supported(t)
    assert pf.l2_prefetch([t, t[:8]]) == 0
    with pytest.raises(ValueError, match="at most 3"):
        pf.l2_prefetch([t] * 4)
    with pytest.raises(ValueError, match="non-contiguous"):
        pf.l2_prefetch([t.t()])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU")
@pytest.mark.parametrize("evict_last,side_stream,per_program", [(0, 1, 1), (1, 1, 1), (0, 0, 64)])
def test_prefetch_on_gpu_changes_nothing(evict_last, side_stream, per_program, monkeypatch):
    """Three tensors of odd sizes (a chunk boundary, a partial last chunk, fp8), eagerly and replayed from a
    CUDA graph (the side stream forked and joined inside the capture): the kernel compiles, reports the
    bytes asked for, and no byte of any tensor changes."""
    monkeypatch.setattr(pf, "EVICT_LAST", evict_last)
    monkeypatch.setattr(pf, "SIDE_STREAM", side_stream)
    monkeypatch.setattr(pf, "CHUNKS_PER_PROGRAM", per_program)
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(pf.CHUNK_BYTES // 2 * 3 + 8, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(5, 1000, device="cuda", generator=gen)
    c = torch.randn(4096, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    before = [x.clone() for x in (a, b, c)]
    assert pf.l2_prefetch([a, b, c]) == a.numel() * 2 + b.numel() * 4 + c.numel()
    assert pf.l2_prefetch([b[1:]]) == 4 * 4 * 1000  # a slice at a 16-byte boundary
    pf.l2_prefetch_join(a)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pf.l2_prefetch([a, c])
        pf.l2_prefetch_join(a)
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip((a, b, c), before):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
