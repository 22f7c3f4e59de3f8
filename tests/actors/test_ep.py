"""Expert parallelism as Ray actors (gloo on CPU): EP=2 and EP=4 groups equal one engine (greedy), the
ranks drive their own step loops (same steps of each kind on every rank, dummy steps on a rank without
work, a stop reaching every rank), and EPLB rebalances a skewed workload at steps the ranks agree on
(moe_lb falls, outputs stay the same); a dead rank fails the group's requests instead of hanging.

The model is a tiny random Qwen3-MoE (16 experts, top-4) saved with ``save_pretrained`` (per-expert
checkpoint names), so every rank loads identical weights. Its routing is skewed on purpose: every token
embedding carries a constant component and the router rows of experts 8-15 favour it, so those experts
get most tokens; under the initial map they sit on half of the ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest
import torch

from rayinfer.actors.ep_group import EPEngineGroup
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.placement.parallel_config import EPLBSection, ParallelConfig
from rayinfer.engine.types import SamplingParams

NUM_EXPERTS = 16
HOT_EXPERTS = list(range(8, 16))
NUM_PROMPTS, MAX_TOKENS = 24, 16
ENGINE = EngineConfig(device="cpu", num_kv_blocks=128, max_num_seqs=32)


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> ModelConfig:
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=NUM_EXPERTS, num_experts_per_tok=4,
        norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.1)  # routers start at zero, and 0.02 gives near-ties everywhere
        model.model.embed_tokens.weight[:, 0] += 0.3
        model.lm_head.weight[:, 0] = 0.0  # the constant component skews routing, not the outputs
        for layer in model.model.layers:
            layer.mlp.gate.weight[HOT_EXPERTS, 0] = 1.0
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    model.save_pretrained(path)
    return ModelConfig(str(path), dtype="float32")


@contextlib.contextmanager
def _one_thread():
    """The one-engine reference runs in this process: one thread, since on a busy shared CPU every
    parallel region of a multi-threaded op waits for a descheduled thread (the ranks are Ray actors
    with one CPU, hence one thread, already)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _prompts(num: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 30, (num,), generator=gen).tolist()
    return [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts(NUM_PROMPTS)


@pytest.fixture(scope="module")
def reference(model_config, prompts) -> list[list[int]]:
    """Greedy outputs of one engine (EP=1, every expert local)."""
    from rayinfer.engine.llm_engine import LLMEngine

    with _one_thread():
        engine = LLMEngine(model_config, ENGINE)
        done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert all(c.error is None and len(c.output_token_ids) == MAX_TOKENS for c in done)
    return [c.output_token_ids for c in done]


def test_ep2_equals_ep1_with_idle_rank_and_bad_request(ray_cluster, model_config, prompts, reference):
    """Requests of different lengths over 2 ranks holding 18 slots (experts 0 and 1 twice, no EPLB):
    one rank runs out of work first and keeps stepping over zero tokens; an invalid request fails alone.
    The ranks step on their own (the driver has no step to call), and one rank's stop ends both loops."""
    lengths = [MAX_TOKENS if i % 2 else 4 + i // 2 for i in range(NUM_PROMPTS)]  # rank i % 2 gets request i
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    # decode steps through the graphs' padded buffers (run eagerly on CPU): every rank at the group's batch
    # size, with fixed-size dispatch buffers; the other steps eager with exact splits
    engine = dataclasses.replace(ENGINE, debug_eager_graphs=True)
    group = EPEngineGroup(model_config, engine, ParallelConfig(ep=2, eplb=EPLBSection(num_redundant_experts=2)))
    try:
        assert not hasattr(group, "step") and not hasattr(group.ranks[0], "step")  # no driver-issued steps
        done = group.generate(prompts + [[]], params + [params[0]])
        assert done[-1].error == "prompt is empty" and done[-1].finish_reason == "error"
        for i, c in enumerate(done[:-1]):
            assert c.error is None and c.finish_reason == "length", (i, c.error)
            assert c.output_token_ids == reference[i][: lengths[i]], i
        stats = group.stats()
        ranks = stats["ranks"]
        assert [r["num_steps"] for r in ranks] == [stats["num_steps"]] * 2 and stats["num_steps"] >= MAX_TOKENS
        assert [r["num_generation_tokens"] for r in ranks] == [sum(lengths[0::2]), sum(lengths[1::2])]
        assert ranks[0]["num_empty_steps"] >= 1  # rank 0's last request ends a step before rank 1's
        # every step was of one voted kind on all ranks (DeepSeek's DP step vote): prefill steps for the
        # prompts, then decode steps; the same counts on both ranks
        kinds = [r["num_steps_by_kind"] for r in ranks]
        assert kinds[0] == kinds[1] and kinds[0].get("prefill", 0) >= 1 and kinds[0].get("decode", 0) >= 1, kinds
        # each decode step replayed the group's graph size on both ranks (the one out of work too)
        assert [r["num_group_graph_steps"] for r in ranks] == [kinds[0]["decode"]] * 2
        assert 1.0 <= stats["moe_lb"] < 2.0 and stats["num_rebalances"] == 0
        assert not group.has_unfinished_requests()
        with pytest.raises(ValueError, match="given twice"):
            group.add_requests([("again", prompts[0], params[0])] * 2)
        assert not group.has_unfinished_requests()

        # one request: it goes to rank 0, and rank 1 keeps the group moving with a dummy step for each step
        one = group.generate([prompts[0]], params[0], request_ids=["alone"])
        assert one[0].output_token_ids == reference[0][: lengths[0]]
        after = group.stats()["ranks"]
        num_steps = after[0]["num_steps"] - ranks[0]["num_steps"]
        assert after[1]["num_steps"] - ranks[1]["num_steps"] == num_steps >= lengths[0]
        assert after[1]["num_empty_steps"] - ranks[1]["num_empty_steps"] == num_steps
        assert after[1]["num_generation_tokens"] == ranks[1]["num_generation_tokens"]
        assert after[0]["num_steps_by_kind"] == after[1]["num_steps_by_kind"]

        # a stop asked of one rank goes out in its vote: both loops end after the same vote
        assert ray_cluster.get(group.ranks[1].stop.remote(10.0))
        # stop waits for rank 1's own loop; rank 0's thread leaves after the same vote, a moment later on a busy CPU
        deadline = time.monotonic() + 10.0
        while ray_cluster.get(group.ranks[0].is_looping.remote()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ray_cluster.get([r.is_looping.remote() for r in group.ranks]) == [False, False]
        final = ray_cluster.get([r.stats.remote() for r in group.ranks])
        assert final[0]["num_votes"] == final[1]["num_votes"] and final[0]["num_steps"] == final[1]["num_steps"]
        assert final[0]["loop_error"] is None and final[1]["loop_error"] is None
    finally:
        group.shutdown()


def test_a_dead_rank_fails_the_groups_requests_instead_of_hanging(ray_cluster, model_config, prompts):
    """The ranks' MoE collectives cannot go on without a rank: when one dies mid-generation, every live
    request of the group ends with an error at once (its output stream fails), and so do later adds."""
    import threading

    from rayinfer.engine.errors import EngineInternalError

    group = EPEngineGroup(model_config, ENGINE, ParallelConfig(ep=2, eplb=EPLBSection(num_redundant_experts=2)),
                          timeout_s=30)
    try:
        killer = threading.Timer(1.0, lambda: ray_cluster.kill(group.ranks[1]))
        killer.start()
        done = group.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        killer.join()
        assert all(c.finish_reason == "error" and "EP rank 1 failed" in c.error for c in done), done
        assert not group.has_unfinished_requests()
        with pytest.raises(EngineInternalError, match="EP rank 1 failed"):
            group.add_requests([("late", prompts[0], SamplingParams(max_tokens=2))])
    finally:
        group.shutdown()


def test_ep4_eplb_balances_skewed_load_with_same_outputs(ray_cluster, model_config, prompts, reference):
    """EP=4 with 16 redundant experts (8 slots per rank), rebalancing every 8 steps over an 8-step window:
    the first window (initial map, hot experts on ranks 1 and 2) is badly balanced, the next (new map)
    is not, and the outputs are those of one engine."""
    ep_config = ParallelConfig(ep=4, eplb=EPLBSection(num_redundant_experts=16, interval=8, window=8))
    group = EPEngineGroup(model_config, ENGINE, ep_config)
    try:
        initial = group.placement()
        done = group.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert [c.output_token_ids for c in done] == reference
        _wait_for(lambda: len(group.eplb_history) >= 2)  # rank 0's call at step 16 may still be on its way
        first, second = group.eplb_history[:2]
        assert first["num_steps"] == 8 and first["changed"], group.eplb_history
        assert first["moe_lb"] > 1.5 and first["moe_lb_expected"] <= 1.10, group.eplb_history
        assert second["num_steps"] == 16 and second["moe_lb"] < 1.15, group.eplb_history
        stats = group.stats()
        assert stats["moe_lb"] < 1.15 and stats["num_rebalances"] >= 1
        # every rank switched to the coordinator's last map at a step their votes agreed on (a map pushed
        # after the last request is switched to at the next idle vote)
        _wait_for(lambda: [r["placement_version"] for r in group.stats()["ranks"]] == [stats["num_rebalances"]] * 4)
        assert 0 < group.stats()["rebalance_stall_s"] < 30  # weights moved in the background; switches timed
        maps = ray_cluster.get([rank.placement.remote() for rank in group.ranks])
        assert all(torch.equal(m, maps[0]) for m in maps) and not torch.equal(maps[0], initial)
        assert maps[0].shape == (2, 32)
        hot_slots = torch.isin(maps[0], torch.tensor(HOT_EXPERTS)).sum(dim=1)
        assert (hot_slots > 16).all(), (maps[0], group.eplb_history)  # the redundant slots went to hot experts
    finally:
        group.shutdown()


def test_deepseek_v3_ep2_with_eplb_equals_ep1(ray_cluster, tmp_path):
    """DeepSeek-V3 (MLA, shared experts, grouped top-k, an MTP layer in the checkpoint) over 2 ranks with
    2 redundant experts, rebalanced (hierarchically, by expert group) every 4 steps."""
    import transformers

    from rayinfer.engine.llm_engine import LLMEngine

    cfg = transformers.DeepseekV3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
        q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16, n_group=4, topk_group=2,
        num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=512, initializer_range=0.1, num_nextn_predict_layers=1,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)
    model.save_pretrained(tmp_path)
    model_config = ModelConfig(str(tmp_path), dtype="float32")
    prompts = [p[:12] for p in _prompts(8, seed=1)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with _one_thread():
        want = [c.output_token_ids for c in LLMEngine(model_config, ENGINE).generate(prompts, params)]
    group = EPEngineGroup(model_config, ENGINE, ParallelConfig(
        ep=2, eplb=EPLBSection(num_redundant_experts=2, interval=4, window=4)))
    try:
        assert [c.output_token_ids for c in group.generate(prompts, params)] == want
        # rank 0 tells the coordinator every 4 steps; a request that reached its rank a vote late can add steps
        _wait_for(lambda: len(group.eplb_history) >= 2)
        history = group.eplb_history
        assert [d["num_steps"] for d in history][:2] == [4, 8] and history[0]["changed"], history
        assert group.placement().shape == (2, 10)
    finally:
        group.shutdown()
