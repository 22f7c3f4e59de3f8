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


def one_row_vs_generic(model, layer_cls, block_size, fp8=False):
    """A decode token's hidden states through a model's one-row path and its generic path, from the same cache
    after a 9-token prefill: ``(generic, fused, direct, calls)``. ``fused`` is ``model(...)`` with
    ``one_row_fusion`` on, ``direct`` each layer's ``forward_one_row`` called in a loop here (then the final
    norm), ``calls`` how many layers ``layer_cls.forward_one_row`` ran (both ways). ``fp8``: the generic path's
    one-row linears on block_fp8_linear (``kernels.gemv.FP8_WEIGHTS`` = 0). ``model``: loaded, on its device
    and dtype, ``process_weights_after_loading`` done."""
    from rayinfer.kernels import gemv

    w = model.model.embed_tokens.weight
    device, dtype = w.device, w.dtype
    kv = torch.zeros(model.kv_cache_shape(8, block_size), device=device, dtype=dtype)
    ids = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(0)).to(device)
    table = [3, 1, 6]
    calls = []
    real = layer_cls.forward_one_row

    def counting(self, *a):
        calls.append(1)
        return real(self, *a)

    with torch.no_grad():
        model(ids[:9], torch.arange(9, device=device), kv,
              AttentionMetadata.build([9], [9], [table], block_size, device=device))
        meta = AttentionMetadata.build([1], [10], [table], block_size, device=device)
        pos = torch.arange(9, 10, device=device)
        model.one_row_fusion = False
        saved, gemv.FP8_WEIGHTS = gemv.FP8_WEIGHTS, 0 if fp8 else gemv.FP8_WEIGHTS
        try:
            generic = model(ids[9:], pos, kv.clone(), meta)
        finally:
            gemv.FP8_WEIGHTS = saved
        model.one_row_fusion = True
        layer_cls.forward_one_row = counting
        try:
            fused = model(ids[9:], pos, kv.clone(), meta)
            h = model.model.embed_tokens(ids[9:])
            rope = model.rope_args(pos, h)
            cache = kv.clone()
            for i, layer in enumerate(model.model.layers):
                layer.forward_one_row(h, *rope, cache[i], meta)
            direct = model.model.norm(h)
        finally:
            layer_cls.forward_one_row = real
    return generic, fused, direct, len(calls)


@pytest.fixture
def paged():
    """``paged.run_schedule(...)``, ``paged.greedy(...)``, ``paged.assert_matches_hf(...)``,
    ``paged.one_row_vs_generic(...)`` (test modules cannot import each other)."""
    return SimpleNamespace(run_schedule=run_schedule, greedy=greedy, assert_matches_hf=assert_matches_hf,
                           one_row_vs_generic=one_row_vs_generic)
