"""Progress as tokens stream: counts and speeds by hand with a fake clock, redraws before any request
finishes, and the counting client in front of a fake fleet client."""

import asyncio

from rayinfer.engine.types import RequestOutput, SamplingParams
from rayinfer.jobs.progress import ProgressClient, TokenProgress


class FakeBar:
    def __init__(self):
        self.n, self.postfixes = 0, []

    def update(self, n):
        self.n += n

    def set_postfix_str(self, s, refresh=True):
        self.postfixes.append(s)

    def refresh(self):
        pass


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_postfix_updates_as_tokens_stream_and_is_throttled():
    bar, clock = FakeBar(), Clock()
    p = TokenProgress(bar, clock=clock, min_interval_s=0.5)
    clock.t += 2.0
    p.add(num_prompt_tokens=40, num_output_tokens=1)  # the first token of a request: no line done yet
    assert bar.n == 0 and bar.postfixes == ["1 toks, est. speed input: 20.00 toks/s, output: 0.50 toks/s"]
    clock.t += 0.1
    p.add(num_output_tokens=3)  # within min_interval_s: counted, not drawn
    assert len(bar.postfixes) == 1 and p.num_output_tokens == 4
    clock.t += 1.9
    p.add(num_output_tokens=4)
    assert bar.postfixes[-1] == "8 toks, est. speed input: 10.00 toks/s, output: 2.00 toks/s"
    p.done()  # a finished line always redraws
    assert bar.n == 1 and len(bar.postfixes) == 3
    assert p.summary() == ("generated 8 tokens from 40 prompt tokens in 4.0 s "
                           "(input: 10.0 toks/s, output: 2.0 toks/s)")


class FakeClient:
    max_model_len = 64

    async def generate(self, prompt_token_ids, params, request_id=None):
        for i in range(3):
            yield RequestOutput(request_id or "r", new_token_ids=[7, 8], finished=i == 2,
                                finish_reason="length" if i == 2 else None)


def test_progress_client_counts_each_delta_and_the_prompt_once():
    p = TokenProgress(FakeBar())
    client = ProgressClient(FakeClient(), p, count_requests=True)

    async def consume():
        return [out async for out in client.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=6), "r")]

    outs = asyncio.run(consume())
    assert len(outs) == 3 and outs[-1].finished  # passed through unchanged
    assert (p.num_prompt_tokens, p.num_output_tokens, p.bar.n) == (5, 6, 1)
    assert client.max_model_len == 64
