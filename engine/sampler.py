"""Token sampling: penalties, min_tokens, grammar masks, then greedy / temperature / top-k / top-p / min-p.

The draw itself is ``kernels.sampling.sample``: an exponential race whose per-token uniforms are a hash of
(request seed, step, token id), so the same seed gives the same tokens whatever else shares the batch,
across preemption (the step index is the output position), and with no host sync on the GPU. Requests
without a seed get one from the sampler's own seeded generator when first seen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from rayinfer.engine.staging import to_device
from rayinfer.engine.types import Request, SampledToken
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
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def to(self, device, non_blocking: bool = False) -> "SamplerOutput":
        def mv(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return SamplerOutput(mv(self.token_ids), mv(self.logprobs), mv(self.top_ids), mv(self.top_logprobs))


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

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """Draw a token per request without waiting for the device.

        Args:
            logits: [B, V] float32 (any device), row i for ``reqs[i]``.
            reqs: the B requests (params, outputs so far, grammar matchers).
        Returns:
            a :class:`SamplerOutput` on logits' device.
        """
        dev = logits.device
        raw = logits.float()
        logits = raw
        if any(needs_host_state(r) for r in reqs):
            logits = raw.clone()
            for i, req in enumerate(reqs):
                _apply_host_state(logits[i], req)
            grammar_rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
            if grammar_rows:
                _apply_grammar(logits, reqs, grammar_rows)
        ps = [r.params for r in reqs]
        n = len(reqs)
        token_ids = sample(
            logits,
            *to_device([
                np.fromiter([p.temperature for p in ps], np.float32, n),
                # top_k >= vocab filters nothing: clamp so any integer fits int32
                np.fromiter([min(p.top_k, self.vocab_size) for p in ps], np.int32, n),
                np.fromiter([p.top_p for p in ps], np.float32, n),
                np.fromiter([p.min_p for p in ps], np.float32, n),
                np.fromiter([self._seed(r) for r in reqs], np.int64, n),
                # the output position being drawn (a pending token counts: in-flight steps sampled it)
                np.fromiter([len(r.output_token_ids) + max(r.num_pending_tokens - 1, 0) for r in reqs], np.int64, n),
            ], dev),
            use_top_k_top_p=any(p.top_k or p.top_p < 1.0 for p in ps),
            use_min_p=any(p.min_p > 0 for p in ps),
        )
        out = SamplerOutput(token_ids)
        k = max((p.logprobs for p in ps if p.logprobs is not None), default=None)
        if k is not None:
            logprobs = torch.log_softmax(raw, dim=-1)
            out.logprobs = logprobs.gather(1, token_ids[:, None])[:, 0]
            if k > 0:
                out.top_logprobs, out.top_ids = logprobs.topk(k, dim=-1)
        return out

    def finish(self, out: SamplerOutput, reqs: list[Request]) -> list[SampledToken]:
        """Turn host-side draws into SampledTokens and advance grammar matchers."""
        ids = out.token_ids.tolist()
        result = []
        for i, (req, token) in enumerate(zip(reqs, ids)):
            s = SampledToken(token)
            k = req.params.logprobs
            if k is not None:
                s.logprob = float(out.logprobs[i])
                if k > 0:
                    s.top_logprobs = dict(zip(out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist()))
            if req.grammar is not None and not req.grammar.is_terminated():
                req.grammar.accept_token(token)
            result.append(s)
        return result

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampledToken]:
        """Sample and wait: ``finish(sample(...))``."""
        return self.finish(self.sample(logits, reqs).to("cpu"), reqs)


def _apply_host_state(row: torch.Tensor, req: Request) -> None:
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
    if req.num_output_tokens < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
        banned = [t for t in banned if t < vocab]
        row[banned] = -float("inf")


def _apply_grammar(logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> None:
    """Mask tokens that the request's grammar matcher (xgrammar) does not allow next."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(reqs), logits.shape[1])
    for i in rows:
        if not reqs[i].grammar.is_terminated():
            reqs[i].grammar.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
