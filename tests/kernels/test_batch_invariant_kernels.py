"""Batch-invariant kernels: the persistent matmul (2-D and batched), the row-wise log-softmax, the fused
MoE and MLA's absorbed attention against plain torch (tolerance), and each row's result bit for bit the
same whatever the number of rows and the row's place (matmul, fused MoE, whose per-slot outputs summed in
slot order are its result), or whichever kind of step computes a query row (paged and MLA attention:
prefill, chunked extend beside another request, decode).

On CUDA directly; on CPU through the Triton interpreter (``--interpret`` entry point).
"""

from __future__ import annotations

import sys

import pytest
import torch

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.batch_invariant import batch_invariant_mode
from rayinfer.kernels.fused_moe import fused_moe, fused_moe_ref, fused_moe_slots, sum_slots
from rayinfer.kernels.log_softmax import log_softmax, log_softmax_ref, log_softmax_triton
from rayinfer.kernels.matmul import dense_batched_linear, dense_linear, persistent_linear, persistent_linear_ref
from rayinfer.kernels.mla_attention import mla_decode, mla_decode_ref
from rayinfer.kernels.paged_attention import paged_attention, paged_attention_ref

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def check_matmul(device, dtype, shapes, num_rows):
    """Against F.linear, then every slice of rows (sizes 1.., offsets) bitwise equal to the full call."""
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
        b = torch.randn(n, generator=gen).to(device, dtype)
        x = torch.randn(num_rows, k, generator=gen).to(device, dtype)
        full = persistent_linear(x, w, b)
        torch.testing.assert_close(full.float(), persistent_linear_ref(x, w, b).float(), atol=TOL[dtype],
                                   rtol=TOL[dtype])
        for m in sorted({1, 2, 3, 15, 16, 17, 63, 64, 65, 130, num_rows // 2}):
            for start in {0, 1, 7, num_rows - m}:
                part = persistent_linear(x[start:start + m], w, b)
                assert torch.equal(part, full[start:start + m]), f"[{n}, {k}] {dtype}: rows {start}:{start + m} differ"
        # a transposed (strided) input and the dispatcher give the same bits
        assert torch.equal(persistent_linear(x.t().contiguous().t(), w, b), full)
        with batch_invariant_mode():
            assert torch.equal(dense_linear(x[None], w, b)[0], full)
    # batched (MLA's per-head projections): each entry's rows are those of a 2-D call, strided operands
    w3 = torch.randn(3, 40, 48, generator=gen).to(device, dtype).transpose(1, 2)  # [3, 48, 40], strided
    x3 = torch.randn(num_rows, 3, 40, generator=gen).to(device, dtype).transpose(0, 1)  # [3, rows, 40]
    with batch_invariant_mode():
        full3 = dense_batched_linear(x3, w3)
    torch.testing.assert_close(full3.float(), torch.bmm(x3, w3.transpose(1, 2)).float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    for h in range(3):
        for rows in (slice(0, 1), slice(5, 22), slice(0, num_rows)):
            assert torch.equal(persistent_linear(x3[h, rows], w3[h]), full3[h, rows]), f"batched entry {h} {rows}"


def check_fused_moe(device, dtype, num_tokens, num_experts, hidden, inter, top_k):
    """Every slice of tokens bitwise equal to the full call; the per-slot outputs summed in slot order
    are the full call's bits (expert parallelism's combine)."""
    gen = torch.Generator().manual_seed(3)
    to = dict(device=device, dtype=dtype)
    x = torch.randn(num_tokens, hidden, generator=gen).to(**to)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(**to)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(**to)
    ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1)[1].to(device)
    ids.view(-1)[::7] = -1  # slots another rank computes under expert parallelism
    w = torch.rand(num_tokens, top_k, generator=gen).to(device)
    with batch_invariant_mode():
        full = fused_moe(x, w13, w2, ids, w)
        torch.testing.assert_close(full.float(), fused_moe_ref(x, w13, w2, ids, w).float(), atol=TOL[dtype],
                                   rtol=TOL[dtype])
        for start, m in [(0, 1), (3, 1), (1, 6), (num_tokens - 9, 9)]:
            rows = slice(start, start + m)
            got = fused_moe(x[rows], w13, w2, ids[rows], w[rows])
            assert torch.equal(got, full[rows]), f"fused_moe: rows {start}:{start + m} differ"
        assert torch.equal(sum_slots(fused_moe_slots(x, w13, w2, ids, w)).to(dtype), full)


def check_mla(device, dtype, heads, rank, rope, prompt_len, chunks):
    """MLA's absorbed attention (every step's form in batch-invariant mode): one request's query rows as
    a whole prefill, as chunks over the cached prefix (every other one beside another request) and as
    decodes batched with others: the same bits."""
    gen = torch.Generator().manual_seed(4)
    block_size, other_len = 4, 11
    num_blocks, other_blocks = -(-prompt_len // block_size), -(-other_len // block_size)
    table, other_table = list(range(num_blocks)), list(range(num_blocks, num_blocks + other_blocks))
    to = dict(device=device, dtype=dtype)
    cache = torch.randn(num_blocks + other_blocks, block_size, rank + rope, generator=gen).to(**to)
    ql, qp, ol, op = (torch.randn(n, heads, d, generator=gen).to(**to)
                      for n, d in [(prompt_len, rank), (prompt_len, rope), (other_len, rank), (other_len, rope)])
    scale = (rank + rope) ** -0.5

    def build(query_lens, seq_lens, tables):
        return AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device)

    with batch_invariant_mode():
        meta = build([prompt_len], [prompt_len], [table])
        whole = mla_decode(ql, qp, cache, meta, scale)
        torch.testing.assert_close(whole.float(), mla_decode_ref(ql, qp, cache, meta, scale).float(), atol=TOL[dtype],
                                   rtol=TOL[dtype])
        done = 0
        for i, c in enumerate(chunks):
            if i % 2:
                meta = build([other_len, c], [other_len, done + c], [other_table, table])
                got = mla_decode(torch.cat([ol, ql[done:done + c]]), torch.cat([op, qp[done:done + c]]), cache, meta,
                                 scale)[other_len:]
            else:
                got = mla_decode(ql[done:done + c], qp[done:done + c], cache, build([c], [done + c], [table]), scale)
            assert torch.equal(got, whole[done:done + c]), f"mla chunk {i} ({done}:{done + c}) differs"
            done += c
        for pos in (0, block_size, prompt_len - 1):
            meta = build([1, 1, 1], [other_len, pos + 1, 5], [other_table, table, other_table])
            got = mla_decode(torch.stack([ol[0], ql[pos], ol[1]]), torch.stack([op[0], qp[pos], op[1]]), cache, meta,
                             scale)[1]
            assert torch.equal(got, whole[pos]), f"mla decode row {pos} differs"


def check_log_softmax(device):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 5000, generator=gen) * 8).to(device)
    x[2, 100:] = float("-inf")  # masked tokens (a grammar, min_tokens)
    got = log_softmax_triton(x)
    torch.testing.assert_close(got, log_softmax_ref(x), atol=1e-5, rtol=1e-5)
    for rows in (slice(0, 1), slice(3, 5), slice(2, 7)):
        assert torch.equal(log_softmax_triton(x[rows]), got[rows])
    with batch_invariant_mode():
        assert torch.equal(log_softmax(x), got)


def check_attention(device, dtype, head_dim, prompt_len, chunks):
    """One request's rows computed as a whole prefill, as chunks over a cached prefix (alone and beside
    another request) and one decode token at a time: the same bits in batch-invariant mode."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, block_size = 8, 2, 16
    num_blocks = -(-prompt_len // block_size)
    other_len = 37
    other_blocks = -(-other_len // block_size)
    table = list(range(num_blocks))
    other_table = list(range(num_blocks, num_blocks + other_blocks))
    kv = torch.randn(num_blocks + other_blocks, 2, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    q = torch.randn(prompt_len, heads, head_dim, generator=gen).to(device, dtype)
    q_other = torch.randn(other_len, heads, head_dim, generator=gen).to(device, dtype)
    scale = head_dim**-0.5
    with batch_invariant_mode():
        whole = paged_attention(q, kv, AttentionMetadata.build([prompt_len], [prompt_len], [table], block_size,
                                                               device), scale)
        torch.testing.assert_close(whole.float(), paged_attention_ref(
            q, kv, AttentionMetadata.build([prompt_len], [prompt_len], [table], block_size, device), scale).float(),
            atol=TOL[dtype], rtol=TOL[dtype])
        done = 0
        for i, c in enumerate(chunks):  # extend over the cached prefix; every other chunk beside a prefill
            if i % 2:
                meta = AttentionMetadata.build([other_len, c], [other_len, done + c], [other_table, table],
                                               block_size, device)
                got = paged_attention(torch.cat([q_other, q[done:done + c]]), kv, meta, scale)[other_len:]
            else:
                meta = AttentionMetadata.build([c], [done + c], [table], block_size, device)
                got = paged_attention(q[done:done + c], kv, meta, scale)
            assert torch.equal(got, whole[done:done + c]), f"chunk {i} ({done}:{done + c}) differs"
            done += c
        for pos in (0, 1, block_size, prompt_len // 2, prompt_len - 1):  # decode rows, batched with others
            meta = AttentionMetadata.build([1, 1, 1], [other_len, pos + 1, 5], [other_table, table, other_table],
                                           block_size, device)
            got = paged_attention(torch.stack([q_other[0], q[pos], q_other[1]]), kv, meta, scale)[1]
            assert torch.equal(got, whole[pos]), f"decode row {pos} differs"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matmul_on_gpu(dtype):
    # Llama-3-8B's projections (qkv, o, gate/up, down) and a ragged one
    check_matmul("cuda", dtype, [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1000, 200)], 1100)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_log_softmax_on_gpu():
    check_log_softmax("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_rows_on_gpu(dtype):
    check_attention("cuda", dtype, 128, 1500, [700, 1, 63, 500, 236])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_rows_on_gpu(dtype):
    check_fused_moe("cuda", dtype, 300, 64, 2048, 768, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_rows_on_gpu(dtype):
    check_mla("cuda", dtype, 16, 512, 64, 700, [300, 1, 63, 200, 136])


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernels_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


def _interpreter_checks():
    check_matmul("cpu", torch.float32, [(300, 72), (64, 130)], 140)
    check_log_softmax("cpu")
    check_attention("cpu", torch.float32, 32, 70, [30, 1, 9, 30])
    check_fused_moe("cpu", torch.float32, 20, 6, 32, 16, 3)
    check_mla("cpu", torch.float32, 2, 32, 16, 14, [5, 1, 4, 4])
    print("interpreter: batch-invariant matmul, log-softmax, attention, fused MoE and MLA rows ok")


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        _interpreter_checks()
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
