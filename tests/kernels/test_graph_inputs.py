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


def make_advance(step, q, block_size, gen):
    """Base positions inside each table, and per-request moves of 0..q (one may run past its table)."""
    ids, positions, _, seq_lens, tables = step
    n, w = tables.shape
    dev = tables.device
    seq = torch.randint(q, max(q + 1, w * block_size - 2 * q), (n,), generator=gen, dtype=torch.int32)
    pos = (seq.to(torch.int64).repeat_interleave(q) - q + torch.arange(q).repeat(n))
    advance = torch.randint(0, q + 1, (n,), generator=gen, dtype=torch.int32)
    if n:
        seq[-1] = w * block_size - q + 1  # its moved rows run past its table: slot -1
        pos[-q:] = torch.arange(q) + int(seq[-1]) - q
        advance[-1] = q
    return (ids, pos.to(dev), None, seq.to(dev), tables), advance.to(dev)


def check_kernel(device, cases):
    for k, (n, bs, q, w, W, gather) in enumerate(cases):
        for moved in (False, True):
            gen = torch.Generator().manual_seed(k)
            buffers = make_buffers(bs + 2, max(q, 2), W, device, gen)
            step, extra = make_step(n, q, w, gather, device, gen), ()
            if moved:
                step, advance = make_advance(step, q, 16, gen)
                extra = (advance, 16)
            got, want = [b.clone() for b in buffers], [b.clone() for b in buffers]
            fill_graph_inputs(tuple(got), *step, bs, q, *extra)
            fill_graph_inputs_ref(tuple(want), *step, bs, q, *extra)
            for name, g, r in zip(("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"), got, want):
                assert g.dtype == r.dtype and torch.equal(g, r), f"case {k} (advance: {moved}): {name}"


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


def test_ref_advance_moves_positions_lengths_and_slots():
    """With a per-request device count, positions and lengths move by it and slots follow the block table."""
    block = 4
    buffers = make_buffers(4, 3, 8, "cpu", torch.Generator().manual_seed(2))
    tables = torch.tensor([[7, 3, 9, 0], [5, 2, 0, 0]], dtype=torch.int32)
    positions = torch.tensor([4, 5, 6, 1, 2, 3])  # request 0 at 4..6 (context 7), request 1 at 1..3 (context 4)
    seq_lens = torch.tensor([7, 4], dtype=torch.int32)
    advance = torch.tensor([3, 5], dtype=torch.int32)
    fill_graph_inputs_ref(buffers, torch.arange(6), positions, None, seq_lens, tables, 3, 3, advance, block)
    ids, pos, slot, seq, _ = buffers
    assert pos[:6].tolist() == [7, 8, 9, 6, 7, 8]
    assert seq[:3].tolist() == [10, 9, 3]
    want = [3 * block + 3, 9 * block + 0, 9 * block + 1, 2 * block + 2, 2 * block + 3, 0 * block + 0]
    assert slot[:6].tolist() == want and slot[6:9].tolist() == [-1, -1, -1]
    # request 1 moved past its table (4 columns: positions up to 15): its rows get slot -1
    fill_graph_inputs_ref(buffers, torch.arange(6), positions, None, seq_lens, tables, 3, 3,
                          torch.tensor([3, 15], dtype=torch.int32), block)
    assert slot[3:6].tolist() == [-1, -1, -1] and slot[:3].tolist() == want[:3]
    with pytest.raises(ValueError, match="block_size"):
        fill_graph_inputs_ref(buffers, torch.arange(6), positions, None, seq_lens, tables, 3, 3, advance)
    with pytest.raises(ValueError, match="slot_mapping"):
        fill_graph_inputs_ref(buffers, torch.arange(6), positions, None, seq_lens, tables, 3, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernel_matches_ref():
    check_kernel("cuda", CASES + [(256, 256, 1, 96, 512, True), (100, 112, 5, 300, 8192, False)])


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("gather,advance", [(True, False), (False, True)])
def test_kernel_compiles_for_hopper(gather, advance):
    """The interpreter does not type-check loops as the compiler does: compile for sm_90 here (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rayinfer.kernels.graph_inputs import _fill_graph_inputs_kernel as kernel

    names = kernel.arg_names
    pointers = {"seq_ptr": "*i32", "table_ptr": "*i32", "seq_buf": "*i32", "table_buf": "*i32", "adv_ptr": "*i32"}
    constexprs = dict(GATHER=gather, ADVANCE=advance, BLOCK_Q=4, BLOCK_W=512)
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "*i64" if n.endswith(("_ptr", "_buf")) else "i32")
                 for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert compiled.asm["cubin"]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        check_kernel("cpu", CASES)
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
