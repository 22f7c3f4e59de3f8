"""The expert-parallel dispatch kernels (``rayinfer/kernels/ep_dispatch.py``) against the torch reference path of
``model/ep_dispatch.py``: route + place, pack, unpack and combine, exact splits and fixed capacity, with
redundant experts, tokens without experts, zero tokens and 1 / 2 / 4 ranks (each rank's side computed in
one process: these kernels have no collectives). CPU through the Triton interpreter (``--interpret``);
``-m gpu`` runs the same checks on CUDA, and the whole layer against the torch path."""

from __future__ import annotations

import sys

import pytest
import torch

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.model.ep_dispatch import _local_slots, pack_rows, route_to_ranks

CUDA = torch.cuda.is_available()


def _map(num_logical: int, ep_size: int, num_local: int, gen: torch.Generator):
    """A random placement: every logical expert once, the remaining slots redundant copies; returns
    (log2phy [L, max_replicas] int64 (-1 padded), replica_counts [L] int64)."""
    slots = ep_size * num_local
    phy2log = torch.cat([torch.arange(num_logical), torch.randint(0, num_logical, (slots - num_logical,), generator=gen)])
    phy2log = phy2log[torch.randperm(slots, generator=gen)]
    counts = torch.bincount(phy2log, minlength=num_logical)
    log2phy = torch.full((num_logical, int(counts.max())), -1, dtype=torch.int64)
    for e in range(num_logical):
        where = (phy2log == e).nonzero().squeeze(1)
        log2phy[e, : len(where)] = where
    return log2phy, counts


def check(device: str) -> None:
    from rayinfer.kernels.ep_dispatch import combine_rows, pack_rows_to, route_and_place, unpack_local

    gen = torch.Generator().manual_seed(0)
    cases = [(1, 8, 8, 2, 5), (2, 8, 5, 2, 9), (4, 16, 5, 6, 33), (4, 16, 5, 6, 0), (2, 6, 4, 8, 1)]
    for case, (ep_size, num_logical, num_local, top_k, num_tokens) in enumerate(cases):
        log2phy, replicas = _map(num_logical, ep_size, num_local, gen)
        hidden_size = 24
        for ep_rank in range(ep_size):
            ids = torch.randint(0, num_logical, (num_tokens, top_k), generator=gen)
            ids[torch.rand(num_tokens, top_k, generator=gen) < 0.2] = -1  # slots without an expert
            if num_tokens > 2:
                ids[1] = -1  # a token that goes nowhere
            hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(torch.bfloat16)
            weights = torch.rand(num_tokens, top_k, generator=gen)
            to = dict(device=device)
            ids_d, map_d, rep_d = ids.to(**to), log2phy.to(**to), replicas.to(**to)
            # reference: routing, destinations and each token's place in its destinations' segments
            physical_ref, dest = route_to_ranks(ids, log2phy, replicas, ep_rank, ep_size, num_local)
            to_rank = (dest[:, None, :] == torch.arange(ep_size)[None, :, None]).any(dim=2)
            place_ref = torch.where(to_rank, torch.cumsum(to_rank.long(), 0) - 1, -1)
            counts_ref = to_rank.sum(0)
            for capacity in (None, max(num_tokens, 1) + 3):
                physical, place, counts, offsets = route_and_place(ids_d, map_d, rep_d, ep_rank, ep_size, num_local,
                                                                   capacity)
                assert torch.equal(physical.cpu().long(), physical_ref), (case, ep_rank)
                assert torch.equal(place.cpu().long(), place_ref), (case, ep_rank)
                assert torch.equal(counts.cpu(), counts_ref), (case, ep_rank)
                first = (torch.arange(ep_size) * capacity if capacity else torch.cumsum(counts_ref, 0) - counts_ref)
                assert torch.equal(offsets.cpu(), first), (case, capacity)
                # pack: every destination's segment holds the reference's byte rows, in token order
                words = hidden_size * 2 // 4 + 2 * top_k
                rows = ep_size * capacity if capacity else int(counts_ref.sum())
                send = torch.zeros((rows, words), dtype=torch.int32, device=device)
                pack_rows_to(send, hidden.to(**to), physical, weights.to(**to), place, offsets)
                packed = pack_rows(hidden, physical_ref, weights).view(torch.int32)
                want = torch.zeros_like(send.cpu())
                for r in range(ep_size):
                    tokens = to_rank[:, r].nonzero().squeeze(1)
                    want[int(first[r]): int(first[r]) + len(tokens)] = packed[tokens]
                assert torch.equal(send.cpu(), want), (case, ep_rank, capacity)
                # unpack on every receiving rank: local slots (-1 for others' and for zero rows), weights, hidden
                for rank in range(ep_size):
                    h, local, w = unpack_local(send, torch.bfloat16, hidden_size, top_k, rank, num_local)
                    slots_ref = send.cpu()[:, hidden_size // 2: hidden_size // 2 + top_k].long() - 1
                    assert torch.equal(local.cpu().long(), _local_slots(slots_ref, rank, num_local)), (case, rank)
                    assert torch.equal(w.cpu(), send.cpu()[:, hidden_size // 2 + top_k:].view(torch.float32))
                    assert torch.equal(h.cpu(), send.cpu()[:, : hidden_size // 2].contiguous().view(torch.bfloat16))
                # combine: rank-ordered partial sums in float32, rounded once to the rows' dtype (float32 rows:
                # batch-invariant mode's per-slot outputs, bit for bit; bf16: exact on CUDA, within the last
                # bit under the interpreter, whose float32 -> bf16 conversion rounds differently)
                for dtype in (torch.float32, torch.bfloat16):
                    back = torch.randn(rows, hidden_size, generator=gen).to(dtype)
                    got = combine_rows(back.to(**to), place, offsets, num_tokens).cpu()
                    acc = torch.zeros(num_tokens, hidden_size)
                    for r in range(ep_size):
                        for t in to_rank[:, r].nonzero().squeeze(1).tolist():
                            acc[t] += back[int(first[r]) + int(place_ref[t, r])].float()
                    if dtype == torch.float32 or device == "cuda":
                        assert torch.equal(got, acc.to(dtype)), (case, ep_rank, capacity, dtype)
                    else:
                        ulp = acc.abs().clamp(min=1e-30) * 2.0**-7
                        assert ((got.float() - acc).abs() <= ulp).all(), (case, ep_rank, capacity)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernels_through_triton_interpreter(run_interpreted):
    run_interpreted(__file__)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_kernels_on_gpu():
    check("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_layer_equals_torch_path_on_gpu(monkeypatch, tmp_path):
    """One rank (a gloo group of one over CUDA tensors is not possible with NCCL absent: NCCL, world 1):
    all_to_all_moe through the kernels equals the torch path, exact splits and fixed capacity."""
    import torch.distributed as dist

    from rayinfer.model.ep_dispatch import all_to_all_moe

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(1)
        log2phy, replicas = _map(8, 1, 10, gen)
        ids = torch.randint(0, 8, (37, 4), generator=gen).cuda()
        hidden = torch.randn(37, 64, generator=gen).to(torch.bfloat16).cuda()
        weights = torch.rand(37, 4, generator=gen).cuda()
        w = torch.randn(10, 64, 64, generator=gen).to(torch.bfloat16).cuda()

        def experts(rows, slots, wts):  # a per-slot linear map, weighted: any function of the slots works
            out = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
            for j in range(slots.shape[1]):
                s = slots[:, j].long()
                keep = (s >= 0).float()[:, None] * wts[:, j : j + 1]
                out += keep * torch.einsum("nh,nhg->ng", rows.float(), w[s.clamp(min=0)].float())
            return out.to(rows.dtype)

        for capacity in (None, 40):
            kw = dict(group=dist.group.WORLD, log2phy=log2phy.cuda(), replica_counts=replicas.cuda(), num_local=10,
                      capacity=capacity)
            fused = all_to_all_moe(hidden, ids, weights, experts, **kw)
            monkeypatch.setenv("RAYINFER_EP_FUSED_DISPATCH", "0")
            plain = all_to_all_moe(hidden, ids, weights, experts, **kw)
            monkeypatch.delenv("RAYINFER_EP_FUSED_DISPATCH")
            assert torch.equal(fused, plain), capacity
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "--interpret" in sys.argv:
        check("cpu")
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", *sys.argv[1:]]))
