"""fill_graph_inputs: the reference against its contract, the one-launch Triton kernel against the reference."""

from __future__ import annotations

import sys

import pytest
import torch

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.graph_inputs import fill_graph_inputs, fill_graph_inputs_ref

CUDA = torch.cuda.is_available()


def make_buffers(max_batch, max_q, width, device, gen):
    """A graph's static buffers, full of junk from an earlier step."""
    t = max_batch * max_q
    return (torch.randint(0, 1000, (t,), generator=gen).to(device),
            torch.randint(0, 1000, (t,), generator=gen).to(device),
            torch.randint(0, 1000, (t,), generator=gen).to(device),
            torch.randint(1, 1000, (max_batch,), generator=gen, dtype=torch.int32).to(device),
            torch.randint(1, 1000, (max_batch, width), generator=gen, dtype=torch.int32).to(device))


def make_step(n, q, w, gather, device, gen):
    """A step's inputs as the model runner stages them (int32 tables and lengths, int64 ids)."""
    t = n * q
    ids = torch.randint(0, 50_000, (t,), generator=gen)
    if gather:
        source = torch.randint(0, 50_000, (max(t, 1) + 3,), generator=gen)
        ids = (source.to(device), torch.randperm(source.numel(), generator=gen)[:t].to(device))
    else:
        ids = ids.to(device)
    positions = torch.randint(0, 4096, (t,), generator=gen).to(device)
    slots = torch.randint(0, 65_536, (t,), generator=gen).to(device)
    seq_lens = torch.randint(1, 4096, (n,), generator=gen, dtype=torch.int32).to(device)
    tables = torch.randint(1, 4096, (n, w), generator=gen, dtype=torch.int32).to(device)
    return ids, positions, slots, seq_lens, tables


# (n, padded batch, q, w, buffer width W, gather)
CASES = [(1, 1, 1, 64, 512, True), (3, 4, 1, 7, 32, False), (0, 2, 1, 5, 8, True), (5, 8, 3, 40, 32, False),
         (2, 2, 5, 3, 2000, True), (16, 16, 1, 1, 4, True)]


def check_kernel(device, cases):
    for k, (n, bs, q, w, W, gather) in enumerate(cases):
        gen = torch.Generator().manual_seed(k)
        buffers = make_buffers(bs + 2, max(q, 2), W, device, gen)
        step = make_step(n, q, w, gather, device, gen)
        got, want = [b.clone() for b in buffers], [b.clone() for b in buffers]
        fill_graph_inputs(tuple(got), *step, bs, q)
        fill_graph_inputs_ref(tuple(want), *step, bs, q)
        for name, g, r in zip(("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"), got, want):
            assert g.dtype == r.dtype and torch.equal(g, r), f"case {k}: {name}"


def test_ref_writes_the_step_and_resets_padding():
    gen = torch.Generator().manual_seed(0)
    buffers = make_buffers(6, 2, 10, "cpu", gen)
    before = [b.clone() for b in buffers]
    (source, rows), positions, slots, seq_lens, tables = make_step(2, 2, 4, True, "cpu", gen)
    fill_graph_inputs_ref(buffers, (source, rows), positions, slots, seq_lens, tables, 4, 2)
    ids, pos, slot, seq, table = buffers
    assert ids[:4].tolist() == source[rows].tolist() and pos[:4].tolist() == positions.tolist()
    assert slot[:4].tolist() == slots.tolist() and slot[4:8].tolist() == [-1] * 4
    assert torch.equal(slot[8:], before[2][8:]) and torch.equal(ids[4:], before[0][4:])  # past the padded batch
    assert seq[:2].tolist() == seq_lens.tolist() and seq[2:4].tolist() == [2, 2] and torch.equal(seq[4:], before[3][4:])
    assert torch.equal(table[:2, :4], tables) and not table[:2, 4:].any() and not table[2:4].any()
    assert torch.equal(table[4:], before[4][4:])


def test_ref_drops_columns_past_the_buffer():
    gen = torch.Generator().manual_seed(1)
    buffers = make_buffers(2, 1, 3, "cpu", gen)
    step = make_step(2, 1, 5, False, "cpu", gen)
    fill_graph_inputs_ref(buffers, *step, 2, 1)
    assert torch.equal(buffers[4][:2], step[4][:, :3])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_matches_ref():
    check_kernel("cuda", CASES + [(256, 256, 1, 96, 512, True), (100, 112, 5, 300, 8192, False)])


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        check_kernel("cpu", CASES)
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
