"""A decode graph's inputs written into its static buffers in one launch.

Before each replay the step's inputs (token ids, or the previous step's sampled tokens gathered by row;
positions; slot mapping; context lengths; block tables) are copied into the graph's static buffers and
the padding rows are reset. Done with torch ops that is six to eight small launches a step, each a
kernel boundary on the device; at batch 1, where a whole step takes about 2 ms, they add up to tens of
microseconds. :func:`fill_graph_inputs` does all of it in one kernel, one program per padded request.

With ``advance`` the step's positions, context lengths and slots are computed on the device from the host's
base and a per-request count that a step still in flight produces (how many tokens each request moved by,
e.g. its accepted drafts plus one), so the next step can be launched before that count reaches the host:
the first of the pieces a verification step kept in the pipeline needs (docs/architecture.md, "Not built
yet").
"""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import tl, triton, use_triton


def _check_args(slot_mapping, advance, block_size) -> None:
    if advance is not None and block_size is None:
        raise ValueError("fill_graph_inputs: advance needs block_size (tokens per KV block)")
    if advance is None and slot_mapping is None:
        raise ValueError("fill_graph_inputs: slot_mapping is needed without advance")


def fill_graph_inputs_ref(buffers: tuple[torch.Tensor, ...], ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                          positions: torch.Tensor, slot_mapping: torch.Tensor | None, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor, padded_batch: int, query_len: int = 1,
                          advance: torch.Tensor | None = None, block_size: int | None = None) -> None:
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
        advance: optional [n] integer (on the buffers' device): request i's positions and context length
            are ``positions + advance[i]`` and ``seq_lens[i] + advance[i]``, and its slots are computed from
            its block table, ``table[pos // block_size] * block_size + pos % block_size`` (``slot_mapping``
            is then not read and may be None). The tables must already hold the blocks of those positions; a
            position past its table's first ``min(w, W)`` columns gets slot -1 (its KV is not written).
        block_size: tokens per KV block (needed with ``advance``).
    Raises:
        ValueError: ``advance`` without ``block_size``, or neither ``advance`` nor ``slot_mapping``.
    Effect: rows ``n * query_len ..`` of the padding get slot -1 (their KV is never written), padding
        requests a context of ``query_len`` and an all-zero block table, real requests' table columns past
        ``w`` are zeroed. Input ids and positions of padding rows are left as they were.
    """
    _check_args(slot_mapping, advance, block_size)
    input_ids, pos_buf, slot_buf, seq_buf, table_buf = buffers
    n, q, bs = seq_lens.shape[0], query_len, padded_batch
    t, w = n * q, min(block_tables.shape[1], table_buf.shape[1])
    if isinstance(ids, tuple):
        torch.index_select(ids[0], 0, ids[1], out=input_ids[:t])
    else:
        input_ids[:t].copy_(ids)
    if advance is not None:
        assert block_size is not None
        adv = advance.to(torch.int64)
        positions = positions.to(torch.int64) + adv.repeat_interleave(q)
        seq_lens = seq_lens + adv.to(seq_lens.dtype)
        req = torch.arange(n, device=positions.device).repeat_interleave(q)
        col = positions // block_size
        inside = col < w  # a position past its table (or the graph's) gets slot -1: its KV is not written
        blocks = block_tables[req, col.clamp(max=max(w - 1, 0))].to(torch.int64)
        slot_mapping = torch.where(inside, blocks * block_size + positions % block_size, -1)
    pos_buf[:t].copy_(positions)
    slot_buf[:t].copy_(slot_mapping)
    slot_buf[t : bs * q].fill_(-1)
    seq_buf[:n].copy_(seq_lens)
    seq_buf[n:bs].fill_(q)
    table_buf[:n, :w].copy_(block_tables[:, :w])
    table_buf[:n, w:].zero_()
    table_buf[n:bs].zero_()


@triton.jit(do_not_specialize=["table_stride", "n", "w"])  # they change from step to step: one compile
def _fill_graph_inputs_kernel(ids_ptr, gather_src_ptr, pos_ptr, slot_ptr, seq_ptr, table_ptr, table_stride,
                              ids_buf, pos_buf, slot_buf, seq_buf, table_buf, table_buf_stride,
                              adv_ptr, n, w, W, q, block_size, GATHER: tl.constexpr, ADVANCE: tl.constexpr,
                              BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr):
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
    row = i.to(tl.int64)
    req = i + tl.arange(0, 1)
    pos = tl.load(pos_ptr + rows, mask=load, other=0).to(tl.int64)
    seq = tl.load(seq_ptr + req, mask=req < n, other=q)
    if ADVANCE:  # this step's moves, from a step still in flight: positions, lengths and slots follow
        adv = tl.load(adv_ptr + req, mask=req < n, other=0)
        pos += adv.to(tl.int64)
        seq += adv.to(seq.dtype)
        inside = load & (pos // block_size < w)  # a position past its table gets slot -1: its KV is not written
        pos_blocks = tl.load(table_ptr + row * table_stride + pos // block_size, mask=inside, other=0)
        slots = tl.where(inside, pos_blocks.to(tl.int64) * block_size + pos % block_size, -1)
    else:
        slots = tl.load(slot_ptr + rows, mask=load, other=-1).to(tl.int64)
    tl.store(pos_buf + rows, pos, mask=load)
    tl.store(slot_buf + rows, slots, mask=in_q)
    tl.store(seq_buf + req, seq.to(tl.int32))
    w_row = (i < n).to(tl.int32) * w  # padding requests: an all-zero table
    for c0 in range(0, W, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        blocks = tl.load(table_ptr + row * table_stride + cols, mask=cols < w_row, other=0)
        tl.store(table_buf + row * table_buf_stride + cols, blocks.to(tl.int32), mask=cols < W)


def fill_graph_inputs_triton(buffers, ids, positions, slot_mapping, seq_lens, block_tables, padded_batch: int,
                             query_len: int = 1, advance: torch.Tensor | None = None,
                             block_size: int | None = None) -> None:
    """Triton kernel of :func:`fill_graph_inputs_ref`: one program per padded request, one launch."""
    _check_args(slot_mapping, advance, block_size)
    input_ids, pos_buf, slot_buf, seq_buf, table_buf = buffers
    n = seq_lens.shape[0]
    gather = isinstance(ids, tuple)
    src, rows = ids if gather else (ids, ids)
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    W = table_buf.shape[1]
    _fill_graph_inputs_kernel[(padded_batch,)](
        # an argument the kernel does not read (slot_mapping with advance, advance without) takes any tensor
        rows, src, positions, positions if slot_mapping is None else slot_mapping, seq_lens, tables, tables.stride(0),
        input_ids, pos_buf, slot_buf, seq_buf, table_buf, table_buf.stride(0),
        seq_lens if advance is None else advance, n, min(tables.shape[1], W), W, query_len, block_size or 1,
        GATHER=gather, ADVANCE=advance is not None, BLOCK_Q=triton.next_power_of_2(query_len),
        BLOCK_W=min(1024, triton.next_power_of_2(W)), num_warps=4,
    )


def fill_graph_inputs(buffers, ids, positions, slot_mapping, seq_lens, block_tables, padded_batch: int,
                      query_len: int = 1, advance: torch.Tensor | None = None, block_size: int | None = None) -> None:
    """Same contract as :func:`fill_graph_inputs_ref`; the one-launch Triton kernel on CUDA tensors (no
    host sync), the torch ops elsewhere."""
    tensors = [*buffers, positions, seq_lens, block_tables, *(ids if isinstance(ids, tuple) else (ids,))]
    tensors += [t for t in (slot_mapping, advance) if t is not None]
    fill = fill_graph_inputs_triton if padded_batch and use_triton(*tensors) else fill_graph_inputs_ref
    fill(buffers, ids, positions, slot_mapping, seq_lens, block_tables, padded_batch, query_len, advance, block_size)
