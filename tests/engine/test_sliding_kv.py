"""The sliding-window KV group (``KVCacheManager`` with ``sliding_window``) and bounded replay in the
scheduler, without a model: local blocks outside the window go back to the pool, and a prefix hit
recomputes only the window's last ``W - 1`` tokens for the sliding layers."""

from rayinfer.engine.kv_cache_manager import NULL_BLOCK, KVCacheManager
from rayinfer.engine.scheduler import Scheduler, SchedulerConfig
from rayinfer.engine.types import Request, SamplingParams

BS, W = 16, 64


def make_req(rid, n, max_tokens=8):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


def test_local_blocks_stay_within_the_window():
    kv = KVCacheManager(256, BS, sliding_window=W, num_local_blocks=32)
    req = make_req("a", 2000)
    held = []
    for step in range(0, 2000, 8):  # chunks of 8 tokens
        assert kv.allocate_slots(req, 8) is not None
        held.append(kv.num_local_blocks_held(req))
        # entries before the window of the step's first query are the null block; the window's are real
        first_needed = max(0, req.num_computed_tokens - W + 1) // BS
        assert all(b == NULL_BLOCK for b in req.local_block_ids[:first_needed])
        assert NULL_BLOCK not in req.local_block_ids[first_needed:]
        req.num_computed_tokens += 8
    assert len(req.block_ids) == 2000 // BS  # the global group keeps everything
    assert max(held) <= -(-(W + 8) // BS) + 1  # the window plus one step's tokens: 6 blocks, not 125
    kv.free(req)
    assert kv.local_pool is not None and kv.local_pool.num_free_blocks == 31  # all but the null block


def test_local_pool_exhaustion_refuses_without_touching_the_global_table():
    kv = KVCacheManager(64, BS, sliding_window=W, num_local_blocks=4)
    req = make_req("a", 200)
    assert kv.allocate_slots(req, 100) is None
    assert req.block_ids == [] and kv.pool.num_free_blocks == 64


def run(sched, steps=100):
    outs = []
    for _ in range(steps):
        out = sched.schedule()
        if not out.scheduled:
            break
        outs.append(out)
        for s in out.scheduled:
            req = sched.requests[s.request_id]
            if s.needs_sample:
                req.num_pending_tokens -= 1
                req.output_token_ids.append(7)
                if req.num_output_tokens >= req.params.max_tokens:
                    sched.finish_requests(req.request_id, req.status.FINISHED_LENGTH)
    return outs


def test_prefix_hit_replays_only_the_window():
    cfg = SchedulerConfig(max_num_batched_tokens=512, block_size=BS, num_blocks=128, sliding_window=W,
                          num_local_blocks=64)
    sched = Scheduler(cfg)
    sched.add_request(make_req("cold", 300, max_tokens=1))
    run(sched)
    assert sched.num_replayed_tokens == 0
    warm = make_req("warm", 300, max_tokens=1)
    warm.prompt_token_ids += [900 + i for i in range(20)]  # the cached 300 tokens and 20 new ones
    sched.add_request(warm)
    first = run(sched)[0].scheduled[0]
    hit = 288  # 18 full blocks of the cached prompt
    assert first.start_pos == hit - (W - 1) and first.num_replay_tokens == W - 1
    assert first.num_new_tokens == (W - 1) + 320 - hit and first.local_kv_start == hit - (W - 1)
    assert sched.num_replayed_tokens == W - 1
    # the local table starts at the replay's block; nothing before it is held
    assert all(b == NULL_BLOCK for b in first.local_block_ids[: (hit - W + 1) // BS])
