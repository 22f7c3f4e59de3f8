"""Sampler: greedy, seeds independent of the batch, top-k/top-p/min-p supports, penalties, logprobs."""

import torch

from rayinfer.engine.sampler import Sampler
from rayinfer.engine.types import Request, SamplingParams


def req(rid, **kw):
    return Request(rid, [1, 2, 3], SamplingParams(**kw), eos_token_ids=(0,))


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    out = Sampler(50)(logits, [req(str(i), temperature=0.0) for i in range(3)])
    assert [o.token_id for o in out] == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    rows = torch.randn(5, 100)

    def draws(sampler, batch_rows, reqs, steps=6):
        return [[o.token_id for o in sampler(rows[batch_rows], reqs)] for _ in range(steps)]

    a = draws(Sampler(100), [0], [req("x", seed=42)])
    s = Sampler(100)
    b = draws(s, [3, 0, 4], [req("u"), req("x", seed=42), req("v", seed=7)])
    assert [step[0] for step in a] == [step[1] for step in b]
    c = draws(Sampler(100), [0], [req("x", seed=43)])
    assert a != c


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, -2.0, -3.0] + [-10.0] * 5])
    probs = torch.softmax(logits[0], -1)
    s = Sampler(10)
    for params, allowed in [
        (dict(top_k=2), {0, 1}),
        (dict(top_p=float(probs[0] + probs[1]) - 1e-4), {0, 1}),
        (dict(min_p=float(probs[2] / probs[0]) - 1e-4), {0, 1, 2}),
    ]:
        seen = {s(logits, [req(f"r{j}", temperature=1.0, **params)])[0].token_id for j in range(300)}
        assert seen == allowed, params


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.full((1, 10), -5.0)
    logits[0, 0] = 10.0  # EOS would win
    logits[0, 4] = 9.0  # stop id next
    r = req("r", temperature=0.0, min_tokens=2, stop_token_ids=[4])
    assert Sampler(10)(logits, [r])[0].token_id not in (0, 4)
    r.output_token_ids = [5, 6]
    assert Sampler(10)(logits, [r])[0].token_id == 0


def test_penalties():
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0]])
    r = req("r", temperature=0.0, presence_penalty=0.5)
    r.output_token_ids = [0]
    assert Sampler(4)(logits, [r])[0].token_id == 1
    r2 = req("r2", temperature=0.0, repetition_penalty=1.2)  # prompt has token 1..3; 0 is unseen
    logits2 = torch.tensor([[1.0, 1.1, 0.0, 0.0]])
    assert Sampler(4)(logits2, [r2])[0].token_id == 0  # 1.1 / 1.2 < 1.0


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(1, 20)
    out = Sampler(20)(logits, [req("r", temperature=0.0, logprobs=3)])[0]
    lp = torch.log_softmax(logits[0], -1)
    assert abs(out.logprob - float(lp.max())) < 1e-6
    assert list(out.top_logprobs) == lp.topk(3).indices.tolist()
