"""Token sampling: penalties, min_tokens, grammar masks, then greedy / temperature / top-k / top-p / min-p.

The draw itself is ``kernels.sampling.sample``: an exponential race whose per-token uniforms are a hash of
(request seed, step, token id), so the same seed gives the same tokens whatever else shares the batch,
across preemption (the step index is the output position), and with no host sync on the GPU. Requests
without a seed get one from the sampler's own seeded generator when first seen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from rayinfer.engine.staging import to_device
from rayinfer.engine.types import Request, SampledToken
from rayinfer.kernels.log_softmax import log_softmax
from rayinfer.kernels.sampling import sample


_2_63, _2_64 = 1 << 63, 1 << 64


@dataclass
class SamplerOutput:
    """One step's draws, possibly still on the device.

    Attributes:
        token_ids: [B] int64.
        logprobs: [B] float32 log-probability of each drawn token under the raw model distribution, or
            None when no request asked for logprobs.
        top_ids, top_logprobs: [B, k] int64 / float32 top-k of that distribution (k = the largest asked).
        errors: request id -> what its host-side preparation raised (its row is drawn but not used).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    errors: dict[str, Exception] = field(default_factory=dict)

    def to(self, device, non_blocking: bool = False) -> "SamplerOutput":
        def mv(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return SamplerOutput(mv(self.token_ids), mv(self.logprobs), mv(self.top_ids), mv(self.top_logprobs),
                             self.errors)


def needs_host_state(req: Request) -> bool:
    """True when sampling this request reads host-side state that the previous step may not have
    produced yet (grammar matcher, output tokens for penalties or min_tokens)."""
    p = req.params
    return req.grammar is not None or len(req.output_token_ids) < p.min_tokens or p.needs_penalties


class Sampler:
    """Samples one token per row of logits.

    Args:
        vocab_size: rows' width (the model's, possibly padded past the tokenizer's).
        seed: seed of the generator that gives unseeded requests their seeds.
    """

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self._seed_rng = random.Random(seed)
        self.seeds: dict[str, int] = {}

    def release(self, request_id: str) -> None:
        self.seeds.pop(request_id, None)

    def _seed(self, req: Request) -> int:
        """The request's seed as a signed 64-bit integer: any integer seed is taken modulo 2**64 (so a
        seed past int64, or ``seed + i`` of the ``n``-th choice, never fails a step)."""
        if req.params.seed is not None:
            return (req.params.seed + _2_63) % _2_64 - _2_63
        seed = self.seeds.get(req.request_id)
        if seed is None:
            seed = self.seeds[req.request_id] = self._seed_rng.getrandbits(62)
        return seed

    def _row(self, req: Request, offset: int = 0, num_rows: int = 1) -> tuple[float, int, float, float, int, int]:
        """One request's sampling inputs: temperature, top_k (clamped to the vocabulary, so any integer
        fits int32; top_k >= vocab filters nothing), top_p, min_p, seed, and the output position being
        drawn: the tokens out so far and those earlier in-flight steps sampled (the pending tokens other
        than this step's ``num_rows``), ``offset`` more for the row after that many draft tokens."""
        p = req.params
        position = len(req.output_token_ids) + max(req.num_pending_tokens - num_rows, 0) + offset
        return (float(p.temperature), min(int(p.top_k), self.vocab_size), float(p.top_p), float(p.min_p),
                self._seed(req), position)

    def sample(self, logits: torch.Tensor, reqs: list[Request], offsets: list[int] | None = None,
               position_shift: torch.Tensor | None = None) -> SamplerOutput:
        """Draw a token per row without waiting for the device.

        Each request's host-side preparation (its sampling inputs, penalties, min_tokens, grammar mask)
        runs on its own: one that raises is recorded in ``SamplerOutput.errors``, its row is drawn
        greedily and ignored, and the other rows are drawn as if it were not there.

        Args:
            logits: [B, V] float32 (any device), row i for ``reqs[i]``.
            reqs: the B requests (params, outputs so far, grammar matchers); speculative decoding repeats
                a request for each of its rows.
            offsets: per row, how many draft tokens precede it (speculative verification: row ``j`` of a
                request draws output position ``n + j`` with that position's seeded uniforms and
                min_tokens rule); None: all 0. Rows with an offset must not need penalties or a grammar.
            position_shift: optional [B] int64 on logits' device, added to each row's output position (a
                chained verification step: the step in flight before it accepted that many drafts fewer than
                the host counts; ``Scheduler.schedule_chained``).
        Returns:
            a :class:`SamplerOutput` on logits' device.
        """
        dev = logits.device
        raw = logits.float()
        logits = raw
        errors: dict[str, Exception] = {}
        rows = []
        offsets = offsets or [0] * len(reqs)
        num_rows: dict[str, int] = {}  # this step's rows per request (its pending tokens)
        for req in reqs:
            num_rows[req.request_id] = num_rows.get(req.request_id, 0) + 1
        for req, offset in zip(reqs, offsets):
            try:
                rows.append(self._row(req, offset, num_rows[req.request_id]))
            except Exception as e:  # noqa: BLE001 - this request's fault, not the step's
                errors[req.request_id] = e
                rows.append(_GREEDY_ROW)
        if any(needs_host_state(r) for r in reqs):
            logits = raw.clone()
            for i, req in enumerate(reqs):
                if req.request_id not in errors:
                    _guarded(errors, req, _apply_host_state, logits[i], req, offsets[i])
            grammar_rows = [i for i, r in enumerate(reqs) if r.grammar is not None and r.request_id not in errors]
            if grammar_rows:
                _apply_grammar(logits, reqs, grammar_rows, errors)
        ps = [r.params for r in reqs]
        n = len(reqs)
        cols = list(zip(*rows)) if rows else [()] * 6
        if all(r[0] <= 0 for r in rows):
            # all greedy: the race's result (its greedy rows take the first maximum, as argmax does) in one
            # launch, without the race's input copy and its four kernels
            token_ids = logits.argmax(dim=-1)
        else:
            inputs = to_device([np.fromiter(col, dtype, n) for col, dtype in zip(cols, _ROW_DTYPES)], dev)
            if position_shift is not None:
                inputs[5] = inputs[5] + position_shift
            token_ids = sample(
                logits,
                *inputs,
                use_top_k_top_p=any(r[1] or r[2] < 1.0 for r in rows),
                use_min_p=any(r[3] > 0 for r in rows),
            )
        out = SamplerOutput(token_ids, errors=errors)
        k = max((p.logprobs for p in ps if p.logprobs is not None), default=None)
        if k is not None:
            logprobs = log_softmax(raw)  # row-wise kernel in batch-invariant mode
            out.logprobs = logprobs.gather(1, token_ids[:, None])[:, 0]
            if k > 0:
                out.top_logprobs, out.top_ids = logprobs.topk(k, dim=-1)
        return out

    def finish(self, out: SamplerOutput, reqs: list[Request]) -> tuple[list[SampledToken | None], dict[str, Exception]]:
        """Turn host-side draws into SampledTokens and advance grammar matchers.

        Returns:
            a SampledToken per request (None for a request whose preparation or finishing raised), and
            those requests' errors by request id.
        """
        ids = out.token_ids.tolist()
        errors = dict(out.errors)
        result: list[SampledToken | None] = []
        for i, (req, token) in enumerate(zip(reqs, ids)):
            if req.request_id in errors:
                result.append(None)
                continue
            try:
                s = SampledToken(token)
                k = req.params.logprobs
                if k is not None:
                    assert out.logprobs is not None
                    s.logprob = float(out.logprobs[i])
                    if k > 0:
                        assert out.top_ids is not None and out.top_logprobs is not None
                        s.top_logprobs = dict(zip(out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist()))
                if req.grammar is not None and not req.grammar.is_terminated():
                    req.grammar.accept_token(token)
            except Exception as e:  # noqa: BLE001 - this request's fault, not the step's
                errors[req.request_id] = e
                result.append(None)
            else:
                result.append(s)
        return result, errors

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampledToken]:
        """Sample and wait: ``finish(sample(...))``.

        Raises:
            Exception: the first request's error, if any request's preparation raised.
        """
        tokens, errors = self.finish(self.sample(logits, reqs).to("cpu"), reqs)
        if errors:
            raise next(iter(errors.values()))
        return [t for t in tokens if t is not None]


_GREEDY_ROW = (0.0, 0, 1.0, 0.0, 0, 0)  # the draw of a failed request's row (ignored)
_ROW_DTYPES = (np.float32, np.int32, np.float32, np.float32, np.int64, np.int64)


def _guarded(errors: dict[str, Exception], req: Request, fn, *args) -> None:
    """Run one request's host-side step ``fn(*args)``; what it raises is recorded as that request's error."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - this request's fault, not the step's
        errors[req.request_id] = e


def _apply_host_state(row: torch.Tensor, req: Request, offset: int = 0) -> None:
    """Penalties and min_tokens on one row (in place).

    Repetition penalty (CTRL, Keskar et al. 2019) over prompt and output tokens; presence and frequency
    penalties (OpenAI) over output tokens; EOS and stop ids banned until ``min_tokens``.
    """
    p = req.params
    vocab = row.shape[0]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in req.all_token_ids if 0 <= t < vocab}), dtype=torch.long,
                            device=row.device)
        if len(seen):
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if req.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        outs = torch.tensor([t for t in req.output_token_ids if 0 <= t < vocab], dtype=torch.long,
                            device=row.device)
        counts = torch.bincount(outs, minlength=vocab)[:vocab].float()
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    if req.num_output_tokens + offset < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
        banned = [t for t in banned if t < vocab]
        row[banned] = -float("inf")


def _apply_grammar(logits: torch.Tensor, reqs: list[Request], rows: list[int],
                   errors: dict[str, Exception]) -> None:
    """Mask tokens that the request's grammar matcher (xgrammar) does not allow next; a matcher that
    raises is recorded in ``errors`` and its row left unmasked."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(reqs), logits.shape[1])
    masked = []
    for i in rows:
        grammar = reqs[i].grammar
        try:
            if not grammar.is_terminated():
                grammar.fill_next_token_bitmask(bitmask, i)
        except Exception as e:  # noqa: BLE001 - this request's fault, not the step's
            errors[reqs[i].request_id] = e
        else:
            masked.append(i)
    if masked:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=masked)
