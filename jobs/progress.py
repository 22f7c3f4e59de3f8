"""Progress of offline runs as tokens stream: a bar's postfix with the tokens generated so far and the
estimated input and output speeds, as vLLM's ``LLM.generate`` shows them, updated on every delta (not
only when a request finishes), so a CPU run that takes minutes per request still moves.

    progress = TokenProgress(tqdm(total=len(lines), desc="generate", unit="line"))
    client = ProgressClient(fleet_client, progress)   # an EngineClient that reports each delta
    ...                                                # progress.done() per finished line
    print(progress.summary())

Used by the batch job (``jobs/generate.py``, one bar tick per line) and the sweep (``jobs/sweep.py``, one
per request: ``count_requests=True``).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable

from rayinfer.engine.types import RequestOutput, SamplingParams


class TokenProgress:
    """Token counts and speeds of a run, shown in a progress bar's postfix.

    Args:
        bar: a tqdm-like bar (``update(n)``, ``set_postfix_str(s, refresh=...)``, ``refresh()``), or None
            to only count.
        clock: seconds, monotonic (``time.perf_counter``; tests pass a fake).
        min_interval_s: the least time between two redraws caused by tokens (a line finishing always
            redraws), so a fast GPU run does not spend its time drawing.
    """

    def __init__(self, bar: Any = None, clock: Callable[[], float] = time.perf_counter, min_interval_s: float = 0.5):
        self.bar = bar
        self.clock = clock
        self.min_interval_s = min_interval_s
        self.start = clock()
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self._last_draw = -float("inf")

    def add(self, num_prompt_tokens: int = 0, num_output_tokens: int = 0) -> None:
        """Count tokens: a request's prompt tokens once its first token arrived (its prefill is done),
        and output tokens as they stream; redraws at most every ``min_interval_s``."""
        self.num_prompt_tokens += num_prompt_tokens
        self.num_output_tokens += num_output_tokens
        if self.clock() - self._last_draw >= self.min_interval_s:
            self._draw()

    def done(self, n: int = 1) -> None:
        """``n`` more units (lines, requests) finished: advance the bar and redraw."""
        if self.bar is not None:
            self.bar.update(n)
        self._draw()

    def speeds(self) -> tuple[float, float]:
        """(input, output) tokens per second since the start."""
        elapsed = max(self.clock() - self.start, 1e-9)
        return self.num_prompt_tokens / elapsed, self.num_output_tokens / elapsed

    def postfix(self) -> str:
        """The bar's postfix, e.g. ``"152 toks, est. speed input: 40.12 toks/s, output: 7.61 toks/s"``."""
        inp, out = self.speeds()
        return f"{self.num_output_tokens} toks, est. speed input: {inp:.2f} toks/s, output: {out:.2f} toks/s"

    def summary(self) -> str:
        """One line for the end of the run: tokens, seconds and both speeds."""
        inp, out = self.speeds()
        return (f"generated {self.num_output_tokens} tokens from {self.num_prompt_tokens} prompt tokens in "
                f"{self.clock() - self.start:.1f} s (input: {inp:.1f} toks/s, output: {out:.1f} toks/s)")

    def _draw(self) -> None:
        self._last_draw = self.clock()
        if self.bar is not None:
            self.bar.set_postfix_str(self.postfix(), refresh=False)
            self.bar.refresh()


class ProgressClient:
    """An ``EngineClient`` that reports every delta of the client it wraps to a :class:`TokenProgress`.

    Args:
        client: the fleet's client (``rayinfer.actors.client``).
        progress: where the counts go.
        count_requests: also call ``progress.done()`` when a request finishes (the sweep counts
            requests; the batch job counts lines itself, since a line with ``n`` > 1 runs n requests).
    """

    def __init__(self, client: Any, progress: TokenProgress, count_requests: bool = False):
        self.client = client
        self.progress = progress
        self.count_requests = count_requests
        self.max_model_len = client.max_model_len

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, mm_inputs: list | None = None) -> AsyncIterator[RequestOutput]:
        """The wrapped client's stream, unchanged; each delta is counted as it passes."""
        prefilled = False
        gen = self.client.generate(prompt_token_ids, params, request_id=request_id,
                                   **({"mm_inputs": mm_inputs} if mm_inputs else {}))
        try:
            async for out in gen:
                num_prompt = 0
                if not prefilled and (out.new_token_ids or out.finished):
                    prefilled, num_prompt = True, len(prompt_token_ids)
                self.progress.add(num_prompt, len(out.new_token_ids))
                if out.finished and self.count_requests:
                    self.progress.done()
                yield out
        finally:
            await gen.aclose()

    async def complete(self, prompt_token_ids, params, request_id=None, mm_inputs=None):
        return await self.client.complete(prompt_token_ids, params, request_id,
                                          **({"mm_inputs": mm_inputs} if mm_inputs else {}))

    async def stats(self):
        return await self.client.stats()

    def shutdown(self) -> None:
        self.client.shutdown()
