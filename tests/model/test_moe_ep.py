"""Expert parallelism over gloo groups of 4 and 2 ranks (torch.multiprocessing, no Ray) equals one process.

Each rank routes its own tokens (one rank of four has none) through a :class:`RoutedExperts` holding
only its slice of the physical experts: identity placement, redundant experts (P > L), dispatch with
exact splits and with fixed-size buffers, and after a placement update whose weight moves run in the
background (on a process group of their own) while the layer keeps serving with the old map. Then a whole tiny Qwen3-MoE with one request per
rank (data-parallel attention, expert-parallel MoE) against the same model in one process.

Batch-invariant mode (``engine.batch_invariant``): probe tokens on every rank, among companions whose
number differs per rank and per trial (none included), come out of the expert-parallel layer with the
bits of the one-process layer on the probes alone (:func:`check_batch_invariant_layer`). That check runs
the Triton kernels the GPU runs, through the Triton interpreter (``tl.dot`` written out row-wise, see
ROWWISE in ``kernels._triton_utils``): on plain CPU the engine keeps torch's ops, whose rows the mode does
not claim exact. The ranks start with ``TRITON_INTERPRET=1`` so that the kernels are built for the
interpreter; the other checks switch it off for their calls (the dispatchers read it per call) and run
the torch path, which is many times faster there.

One spawn of 4 processes serves both sizes (the 2-rank group is global ranks 1 and 3, so group and
global ranks differ), which halves the start-up time on a small machine. The ranks run this file
through ``runpy`` under the name ``__ep_worker__`` (see the bottom), so they do not depend on how
pytest imported the test module.
"""

from __future__ import annotations

import contextlib
import os
import runpy
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from rayinfer.kernels._triton_utils import HAS_TRITON
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.batch_invariant import batch_invariant_mode
from rayinfer.model.moe import ExpertParallelism, RoutedExperts
from rayinfer.model.qwen3_moe import Qwen3MoeForCausalLM

NUM_EXPERTS, HIDDEN, INTER, TOP_K = 8, 32, 16, 2
REDUNDANT = [0, 1, 2, 3, 4, 5, 6, 7, 3, 3, 5, 0]  # 12 slots: expert 3 three times, 0 and 5 twice
REBALANCED = [7, 6, 5, 4, 3, 2, 1, 0, 1, 1, 2, 6]
TOKENS_PER_RANK = {2: [7, 4], 4: [5, 0, 9, 3]}
TOL = dict(atol=1e-5, rtol=1e-5)


def test_expert_parallel_equals_one_process(tmp_path, monkeypatch):
    world_size = 4
    if HAS_TRITON:  # the ranks inherit it: their kernels are built for the interpreter (module docstring)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ctx = torch.multiprocessing.get_context("spawn")
    procs = []
    for rank in range(world_size):
        init = dict(EP_RANK=rank, EP_WORLD=world_size, EP_STORE=str(tmp_path / "store"))
        kwargs = dict(init_globals=init, run_name="__ep_worker__")
        proc = ctx.Process(target=runpy.run_path, args=(__file__,), kwargs=kwargs)
        proc.start()
        procs.append(proc)
    for proc in procs:
        proc.join(timeout=120)
    hung = [proc for proc in procs if proc.is_alive()]
    for proc in hung:
        proc.kill()
        proc.join()
    assert not hung, f"{len(hung)} ranks hung"
    assert [proc.exitcode for proc in procs] == [0] * world_size, "a rank failed: see its traceback in stderr"


def test_redundant_experts_in_one_process():
    """P > L without a group: replicas split tokens by row % replica count, output unchanged."""
    torch.manual_seed(0)
    full = RoutedExperts(NUM_EXPERTS, HIDDEN, INTER)
    layer = RoutedExperts(NUM_EXPERTS, HIDDEN, INTER, phy2log=torch.tensor(REDUNDANT))
    layer.load_stacked("gate_up_proj", full.gate_up_proj.data)
    layer.load_stacked("down_proj", full.down_proj.data)
    assert layer.log2phy[3].tolist() == [3, 8, 9] and layer.replica_counts.tolist() == [2, 1, 1, 3, 1, 2, 1, 1]
    ids = torch.tensor([[3, -1]] * 4)
    assert layer._local_ids(ids)[:, 0].tolist() == [3, 8, 9, 3] and (layer._local_ids(ids)[:, 1] == -1).all()
    x, ids, w = torch.randn(9, HIDDEN), torch.rand(9, NUM_EXPERTS).topk(TOP_K, dim=-1)[1], torch.rand(9, TOP_K)
    torch.testing.assert_close(layer(x, ids, w), full(x, ids, w), **TOL)
    layer.update_placement(torch.tensor(REBALANCED))
    assert torch.equal(layer.down_proj[8], full.down_proj[1])
    assert torch.equal(layer.gate_up_proj[0], full.gate_up_proj[7])
    torch.testing.assert_close(layer(x, ids, w), full(x, ids, w), **TOL)
    with pytest.raises(ValueError, match="no replica"):
        layer.update_placement(torch.tensor([0] * 12))
    with pytest.raises(ValueError, match="entries"):
        RoutedExperts(NUM_EXPERTS, HIDDEN, INTER, phy2log=torch.tensor(REDUNDANT[:-1] + [8]))


@pytest.mark.gpu
def test_fixed_capacity_dispatch_is_captured_in_a_cuda_graph(tmp_path):
    """A one-rank NCCL group on the GPU: the layer's dispatch captured in a CUDA graph (fixed-size buffers,
    no host read) replays the eager exact-split dispatch's result, and the one-process layer's, for new
    inputs written into the graph's input buffers (bf16, redundant experts)."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        dev, dtype = torch.device("cuda"), torch.bfloat16
        torch.manual_seed(0)
        full = RoutedExperts(NUM_EXPERTS, HIDDEN, INTER, dtype=dtype, device=dev)
        layer = RoutedExperts(NUM_EXPERTS, HIDDEN, INTER, group=dist.group.WORLD, phy2log=torch.tensor(REDUNDANT),
                              dtype=dtype, device=dev)
        for e in range(NUM_EXPERTS):
            layer.load_expert_weight(e, "gate_proj", full.gate_up_proj.data[e, :INTER])
            layer.load_expert_weight(e, "up_proj", full.gate_up_proj.data[e, INTER:])
            layer.load_expert_weight(e, "down_proj", full.down_proj.data[e])

        def batch(seed: int):
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(16, HIDDEN, generator=gen).to(dev, dtype)
            ids = torch.rand(16, NUM_EXPERTS, generator=gen).topk(TOP_K, dim=-1)[1].to(dev)
            return x, ids, torch.rand(16, TOP_K, generator=gen).to(dev)

        static = batch(0)
        eager = layer(*static)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles outside the capture
            layer(*static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(*static)
        graph.replay()
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
        for seed in (1, 2):
            for buf, new in zip(static, batch(seed)):
                buf.copy_(new)
            graph.replay()
            torch.testing.assert_close(out, full(*static), atol=2e-2, rtol=2e-2)
    finally:
        dist.destroy_process_group()


def check_layer(group, move_group) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)
    full = RoutedExperts(NUM_EXPERTS, HIDDEN, INTER)
    counts = TOKENS_PER_RANK[world]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), HIDDEN, generator=gen)
    ids = torch.rand(sum(counts), NUM_EXPERTS, generator=gen).topk(TOP_K, dim=-1)[1]
    w = torch.rand(sum(counts), TOP_K, generator=gen)
    mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
    want = full(x[mine], ids[mine], w[mine])
    all_counts = torch.bincount(ids.flatten(), minlength=NUM_EXPERTS)

    for phy2log, capacity in [(None, None), (None, 12), (torch.tensor(REDUNDANT), None), (torch.tensor(REDUNDANT), 9)]:
        layer = RoutedExperts(NUM_EXPERTS, HIDDEN, INTER, group=group, phy2log=phy2log)
        layer.dispatch_capacity = capacity  # None: exact splits; else fixed-size buffers (the CUDA-graph layout)
        if phy2log is None:
            layer.load_stacked("gate_up_proj", full.gate_up_proj.data)
            layer.load_stacked("down_proj", full.down_proj.data)
        else:  # per-expert checkpoint names: every local replica gets its copy
            for e in range(NUM_EXPERTS):
                layer.load_expert_weight(e, "gate_proj", full.gate_up_proj.data[e, :INTER])
                layer.load_expert_weight(e, "up_proj", full.gate_up_proj.data[e, INTER:])
                layer.load_expert_weight(e, "down_proj", full.down_proj.data[e])
        assert layer.num_local_experts == layer.num_physical_experts // world
        torch.testing.assert_close(layer(x[mine], ids[mine], w[mine]), want, **TOL)
        moved = layer.dispatch_counters
        assert moved.num_exchanges == 1
        if phy2log is None:  # no replicas: a token goes exactly to the ranks holding its experts, once to each
            homes = ids[mine] // layer.num_local_experts
            assert moved.num_rows_sent == sum(len(set(row)) for row in homes.tolist()), (rank, capacity)
        rows = torch.tensor([moved.num_rows_sent, moved.num_rows_received])
        dist.all_reduce(rows, group=group)
        assert rows[0] == rows[1] and rows[0] <= sum(counts) * min(TOP_K, world)
        local_counts = layer.read_expert_counts(reset=True)
        assert local_counts.sum() == counts[rank] * TOP_K
        dist.all_reduce(local_counts, group=group)
        assert torch.equal(local_counts, all_counts)
        assert layer.read_expert_counts().sum() == 0

    # a move in the background: the layer keeps serving with the old map and weights until it switches
    move = layer.start_placement(torch.tensor(REBALANCED), move_group)
    torch.testing.assert_close(layer(x[mine], ids[mine], w[mine]), want, **TOL)
    assert layer.phy2log.tolist() == REDUNDANT
    layer.finish_placement(move)
    assert move.is_done() and layer.phy2log.tolist() == REBALANCED
    for slot in range(layer.num_local_experts):
        e = REBALANCED[layer.first_local + slot]
        assert torch.equal(layer.gate_up_proj[slot], full.gate_up_proj[e]), (rank, slot)
        assert torch.equal(layer.down_proj[slot], full.down_proj[e]), (rank, slot)
    torch.testing.assert_close(layer(x[mine], ids[mine], w[mine]), want, **TOL)
    try:
        layer.update_placement(torch.arange(NUM_EXPERTS))
    except ValueError:
        pass
    else:
        raise AssertionError("a map with another slot count must be refused")


def tiny_qwen3_config():
    return SimpleNamespace(
        vocab_size=96, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=INTER, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, hidden_act="silu",
        rope_theta=10000.0, tie_word_embeddings=False,
    )


def check_qwen3_model(group) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cfg = tiny_qwen3_config()
    torch.manual_seed(0)
    ref = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)  # routers start at zero
    ep = ExpertParallelism(group=group, num_physical_experts=len(REDUNDANT), phy2log=torch.tensor(REDUNDANT))
    model = Qwen3MoeForCausalLM(cfg, ep).eval()
    model.load_weights(ref.state_dict().items())

    prompt_len = TOKENS_PER_RANK[world][rank]
    tokens = torch.randint(0, cfg.vocab_size, (prompt_len + 2,), generator=torch.Generator().manual_seed(rank))
    kv_ref, kv_ep = torch.zeros(ref.kv_cache_shape(8, 4)), torch.zeros(model.kv_cache_shape(8, 4))
    table = [[6, 1, 4]]
    steps = [(0, prompt_len), (prompt_len, prompt_len + 1), (prompt_len + 1, prompt_len + 2)]  # prefill, 2 decodes
    with torch.no_grad():
        for lo, hi in steps:
            if prompt_len == 0:  # idle rank: still steps with no tokens, so the collectives line up
                meta, lo, hi = AttentionMetadata.build([], [], [], 4), 0, 0
            else:
                meta = AttentionMetadata.build([hi - lo], [hi], table, 4)
            ids, pos = tokens[lo:hi], torch.arange(lo, hi)
            got = model.compute_logits(model(ids, pos, kv_ep, meta))
            want = ref.compute_logits(ref(ids, pos, kv_ref, meta))
            torch.testing.assert_close(got, want, **TOL)
    load = model.expert_load()
    assert (load.sum(1) == (prompt_len + 2 if prompt_len else 0) * TOP_K).all()


def check_batch_invariant_layer(group) -> None:
    """Batch-invariant mode: 3 probe tokens on every rank, placed among 0..8 random companions (another
    count on each rank and in each of 4 trials, exact and fixed-capacity dispatch alternating, so the
    probes sit at other rows of the dispatched buffers),
    through the layer with redundant experts: the bits of the one-process layer on the probes alone.
    Top-4 routing: with two experts per token any order of adding them gives the same bits."""
    rank, top_k = dist.get_rank(group), 4
    torch.manual_seed(0)
    full = RoutedExperts(NUM_EXPERTS, HIDDEN, INTER)
    layer = RoutedExperts(NUM_EXPERTS, HIDDEN, INTER, group=group, phy2log=torch.tensor(REDUNDANT))
    for e in range(NUM_EXPERTS):
        layer.load_expert_weight(e, "gate_proj", full.gate_up_proj.data[e, :INTER])
        layer.load_expert_weight(e, "up_proj", full.gate_up_proj.data[e, INTER:])
        layer.load_expert_weight(e, "down_proj", full.down_proj.data[e])

    def tokens(n: int, gen: torch.Generator):
        return (torch.randn(n, HIDDEN, generator=gen), torch.rand(n, NUM_EXPERTS, generator=gen).topk(top_k, dim=-1)[1],
                torch.rand(n, top_k, generator=gen))

    probe = tokens(3, torch.Generator().manual_seed(5))
    with batch_invariant_mode():
        want = full(*probe)
        for trial in range(4):
            layer.dispatch_capacity = None if trial % 2 == 0 else 11  # exact splits, then fixed-size buffers
            gen = torch.Generator().manual_seed(100 * trial + rank)
            n = int(torch.randint(0, 9, (), generator=gen))
            at = int(torch.randint(0, n + 1, (), generator=gen))
            batch = [torch.cat([c[:at], p, c[at:]]) for c, p in zip(tokens(n, gen), probe)]
            got = layer(*batch)[at : at + 3]
            assert torch.equal(got, want), (rank, trial, (got - want).abs().max())


@contextlib.contextmanager
def _interpreter(on: bool):
    """Route the dispatchers' calls through the interpreter-built kernels (on) or the torch ops (off)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old


def _worker(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        pair = dist.new_group([1, 3])  # collective: every rank calls it
        # each group's expert-weight moves run on a group of their own (RoutedExperts.start_placement)
        move_groups = [dist.new_group(list(range(world))), dist.new_group([1, 3])]
        for group, move_group in zip([dist.group.WORLD, pair], move_groups):
            if dist.get_rank(group) >= 0:  # -1 on ranks outside the group
                with _interpreter(False):
                    check_layer(group, move_group)
                    check_qwen3_model(group)
        if HAS_TRITON:
            with _interpreter(True):
                check_batch_invariant_layer(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


if __name__ == "__ep_worker__":
    _worker(globals()["EP_RANK"], globals()["EP_WORLD"], globals()["EP_STORE"])
