"""AttentionMetadata.build and PaddedBlockTables against a per-token Python computation written out here."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rayinfer.kernels.attention_metadata import AttentionMetadata, PaddedBlockTables, host_arrays


def reference(query_lens, seq_lens, block_tables, block_size):
    """Per-token lists: query_start_loc, padded block tables, slot mapping, positions."""
    starts, slots, positions = [0], [], []
    for q, s, table in zip(query_lens, seq_lens, block_tables):
        starts.append(starts[-1] + q)
        for pos in range(s - q, s):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max((len(t) for t in block_tables), default=0) or 1
    padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
    return starts, padded, slots, positions


def random_step(rng, num_reqs, block_size, decode_only=False):
    query_lens, seq_lens, tables = [], [], []
    for _ in range(num_reqs):
        q = 1 if decode_only else rng.randint(1, 40)
        s = q + rng.randint(0, 100)
        tables.append(tuple(rng.sample(range(1000), -(-s // block_size) + rng.randint(0, 2))))
        query_lens.append(q)
        seq_lens.append(s)
    return query_lens, seq_lens, tables


@pytest.mark.parametrize("num_reqs,decode_only", [(0, False), (1, True), (1, False), (7, False), (64, True)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_build_matches_per_token_reference(num_reqs, decode_only, block_size):
    rng = random.Random(num_reqs * 100 + block_size)
    query_lens, seq_lens, tables = random_step(rng, num_reqs, block_size, decode_only)
    starts, padded, slots, positions = reference(query_lens, seq_lens, tables, block_size)
    meta = AttentionMetadata.build(query_lens, seq_lens, [list(t) for t in tables], block_size)
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.tolist() == starts
    assert meta.seq_lens.tolist() == seq_lens
    assert meta.block_tables.shape == (num_reqs, len(padded[0]) if padded else 1)
    assert meta.block_tables.tolist() == padded
    assert meta.slot_mapping.tolist() == slots
    assert (meta.query_lens_cpu, meta.seq_lens_cpu) == (query_lens, seq_lens)
    assert meta.is_decode_only == all(q == 1 for q in query_lens)
    *_, arr_positions = host_arrays(query_lens, seq_lens, tables, block_size)
    assert arr_positions.dtype == np.int64 and arr_positions.tolist() == positions


@pytest.mark.parametrize("args", [
    ([1, 1], [3], [[0], [1]]),  # lengths disagree
    ([1], [5], [[0]]),  # 5 tokens need 2 blocks of 4
    ([6], [5], [[0, 1]]),  # more new tokens than context
])
def test_build_rejects_bad_lists(args):
    with pytest.raises(ValueError):
        AttentionMetadata.build(*args, 4)


def test_padded_block_tables_follow_changing_steps():
    rng = random.Random(0)
    padder = PaddedBlockTables()
    live = {f"r{i}": [rng.randrange(1000) for _ in range(rng.randint(1, 5))] for i in range(20)}
    for step in range(60):
        for rid in rng.sample(sorted(live), min(5, len(live))):
            if rng.random() < 0.3:
                del live[rid]  # finished
            elif rng.random() < 0.2:
                live[rid] = [rng.randrange(1000)]  # preempted and re-admitted: new blocks, same key
            else:
                live[rid].append(rng.randrange(1000))  # grew by a block
        if rng.random() < 0.3:
            live[f"n{step}"] = [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
        keys = rng.sample(sorted(live), len(live)) if step % 7 == 0 else sorted(live)  # order changes too
        tables = [tuple(live[k]) for k in keys]
        out = padder.pad(keys, tables)
        assert out.dtype == np.int32
        assert out.tolist() == reference([1] * len(tables), [1] * len(tables), tables, 1)[1]
