"""A decode graph's inputs written into its static buffers in one launch.

Before each replay the step's inputs (token ids, or the previous step's sampled tokens gathered by row;
positions; slot mapping; context lengths; block tables) are copied into the graph's static buffers and
the padding rows are reset. Done with torch ops that is six to eight small launches a step, each a
kernel boundary on the device; at batch 1, where a whole step takes about 2 ms, they add up to tens of
microseconds. :func:`fill_graph_inputs` does all of it in one kernel, one program per padded request.
"""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import tl, triton, use_triton


def fill_graph_inputs_ref(buffers: tuple[torch.Tensor, ...], ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                          positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor, padded_batch: int, query_len: int = 1) -> None:
    """Write a step of ``n`` requests of ``query_len`` tokens into a graph's buffers, padded to ``padded_batch``.

    Args:
        buffers: the graph's static ``(input_ids [T] int64, positions [T] int64, slot_mapping [T] int64,
            seq_lens [B] int32, block_tables [B, W] int32)``, T >= ``padded_batch * query_len``, B >=
            ``padded_batch``.
        ids: [n * query_len] token ids, or ``(source, rows)``: the ids are ``source[rows]`` (int64; a previous
            step's sampled tokens and each input's row among them).
        positions, slot_mapping: [n * query_len] integer. seq_lens: [n] integer.
        block_tables: [n, w] integer; columns past the buffer's W are dropped (they hold no position of a
            context the graph was captured for).
        padded_batch: the graph's batch size (>= n).
    Effect: rows ``n * query_len ..`` of the padding get slot -1 (their KV is never written), padding
        requests a context of ``query_len`` and an all-zero block table, real requests' table columns past
        ``w`` are zeroed. Input ids and positions of padding rows are left as they were.
    """
    input_ids, pos_buf, slot_buf, seq_buf, table_buf = buffers
    n, q, bs = seq_lens.shape[0], query_len, padded_batch
    t = n * q
    if isinstance(ids, tuple):
        torch.index_select(ids[0], 0, ids[1], out=input_ids[:t])
    else:
        input_ids[:t].copy_(ids)
    pos_buf[:t].copy_(positions)
    slot_buf[:t].copy_(slot_mapping)
    slot_buf[t : bs * q].fill_(-1)
    seq_buf[:n].copy_(seq_lens)
    seq_buf[n:bs].fill_(q)
    w = min(block_tables.shape[1], table_buf.shape[1])
    table_buf[:n, :w].copy_(block_tables[:, :w])
    table_buf[:n, w:].zero_()
    table_buf[n:bs].zero_()


@triton.jit
def _fill_graph_inputs_kernel(ids_ptr, gather_src_ptr, pos_ptr, slot_ptr, seq_ptr, table_ptr, table_stride,
                              ids_buf, pos_buf, slot_buf, seq_buf, table_buf, table_buf_stride,
                              n, w, W, q, GATHER: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr):
    i = tl.program_id(0)
    rows = i * q + tl.arange(0, BLOCK_Q)
    in_q = tl.arange(0, BLOCK_Q) < q
    load = in_q & (rows < n * q)  # a real request's row (padding requests are i >= n)
    if GATHER:
        src_rows = tl.load(ids_ptr + rows, mask=load, other=0)
        ids = tl.load(gather_src_ptr + src_rows, mask=load, other=0)
    else:
        ids = tl.load(ids_ptr + rows, mask=load, other=0)
    tl.store(ids_buf + rows, ids.to(tl.int64), mask=load)
    pos = tl.load(pos_ptr + rows, mask=load, other=0)
    tl.store(pos_buf + rows, pos.to(tl.int64), mask=load)
    slots = tl.load(slot_ptr + rows, mask=load, other=-1)
    tl.store(slot_buf + rows, slots.to(tl.int64), mask=in_q)
    req = i + tl.arange(0, 1)
    seq = tl.load(seq_ptr + req, mask=req < n, other=q)
    tl.store(seq_buf + req, seq.to(tl.int32))
    row = i.to(tl.int64)
    w_row = (i < n).to(tl.int32) * w  # padding requests: an all-zero table
    for c0 in range(0, W, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        blocks = tl.load(table_ptr + row * table_stride + cols, mask=cols < w_row, other=0)
        tl.store(table_buf + row * table_buf_stride + cols, blocks.to(tl.int32), mask=cols < W)


def fill_graph_inputs_triton(buffers, ids, positions, slot_mapping, seq_lens, block_tables, padded_batch: int,
                             query_len: int = 1) -> None:
    """Triton kernel of :func:`fill_graph_inputs_ref`: one program per padded request, one launch."""
    input_ids, pos_buf, slot_buf, seq_buf, table_buf = buffers
    n = seq_lens.shape[0]
    gather = isinstance(ids, tuple)
    src, rows = ids if gather else (ids, ids)
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    W = table_buf.shape[1]
    _fill_graph_inputs_kernel[(padded_batch,)](
        rows, src, positions, slot_mapping, seq_lens, tables, tables.stride(0),
        input_ids, pos_buf, slot_buf, seq_buf, table_buf, table_buf.stride(0),
        n, min(tables.shape[1], W), W, query_len,
        GATHER=gather, BLOCK_Q=triton.next_power_of_2(query_len), BLOCK_W=min(1024, triton.next_power_of_2(W)),
        num_warps=4,
    )


def fill_graph_inputs(buffers, ids, positions, slot_mapping, seq_lens, block_tables, padded_batch: int,
                      query_len: int = 1) -> None:
    """Same contract as :func:`fill_graph_inputs_ref`; the one-launch Triton kernel on CUDA tensors (no
    host sync), the torch ops elsewhere."""
    tensors = [*buffers, positions, slot_mapping, seq_lens, block_tables, *(ids if isinstance(ids, tuple) else (ids,))]
    if padded_batch and use_triton(*tensors):
        fill_graph_inputs_triton(buffers, ids, positions, slot_mapping, seq_lens, block_tables, padded_batch,
                                 query_len)
    else:
        fill_graph_inputs_ref(buffers, ids, positions, slot_mapping, seq_lens, block_tables, padded_batch,
                              query_len)
