"""Shared by the model tests: drive a model through the paged KV cache the way the engine does."""

from types import SimpleNamespace

import pytest
import torch

from rayinfer.kernels.attention_metadata import AttentionMetadata


def run_schedule(model, seqs, tables, schedule, block_size):
    """Feed each request's tokens step by step through the paged cache; logits per request.

    Args:
        seqs: per request, a [n] int64 token tensor. tables: per request, its block ids.
        schedule: per step, ``[(request index, new tokens), ...]``.
    Returns:
        per request, [n, vocab] float32 logits of every position.
    """
    kv = torch.zeros(model.kv_cache_shape(16, block_size))
    done, logits = [0] * len(seqs), [[] for _ in seqs]
    for step in schedule:
        meta = AttentionMetadata.build([n for _, n in step], [done[r] + n for r, n in step],
                                       [tables[r] for r, _ in step], block_size)
        ids = torch.cat([seqs[r][done[r] : done[r] + n] for r, n in step])
        pos = torch.cat([torch.arange(done[r], done[r] + n) for r, n in step])
        out = model.compute_logits(model(ids, pos, kv, meta)).split([n for _, n in step])
        for (r, n), lg in zip(step, out):
            logits[r].append(lg)
            done[r] += n
    return [torch.cat(lg) for lg in logits]


def greedy(model, prompt, num_new, chunks, table, block_size):
    """Prefill ``prompt`` in ``chunks`` (token counts), then decode ``num_new`` tokens by argmax."""
    kv = torch.zeros(model.kv_cache_shape(16, block_size))
    tokens, done = prompt.tolist(), 0
    for n in chunks + [1] * (num_new - 1):
        meta = AttentionMetadata.build([n], [done + n], [table], block_size)
        ids = torch.tensor(tokens[done : done + n])
        logits = model.compute_logits(model(ids, torch.arange(done, done + n), kv, meta))
        done += n
        if done >= len(prompt):  # a prefill chunk before the last predicts nothing new
            tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt) :]


def assert_matches_hf(ref, ours, seqs, tables, schedule, block_size, tol=1e-4):
    """Every position's logits of ``ours`` through the paged cache equal the HF model ``ref``'s over each
    whole sequence (rtol = atol = ``tol``)."""
    with torch.no_grad():
        got = run_schedule(ours, seqs, tables, schedule, block_size)
        for s, g in zip(seqs, got):
            torch.testing.assert_close(g, ref(s[None]).logits[0], rtol=tol, atol=tol)


@pytest.fixture
def paged():
    """``paged.run_schedule(...)``, ``paged.greedy(...)``, ``paged.assert_matches_hf(...)`` (test modules
    cannot import each other)."""
    return SimpleNamespace(run_schedule=run_schedule, greedy=greedy, assert_matches_hf=assert_matches_hf)
