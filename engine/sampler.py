"""Token sampling: penalties, min_tokens, grammar masks, greedy / temperature / top-k / top-p / min-p.

Each seeded request draws from its own ``torch.Generator``, advanced once per sampled token, so the
same seed gives the same tokens whatever else shares the batch (and across preemption, which samples
nothing while it recomputes).
"""

from __future__ import annotations

import torch

from rayinfer.engine.types import Request, SampledToken


class Sampler:
    """Samples one token per row of logits.

    Args:
        vocab_size: rows' width (the model's, possibly padded past the tokenizer's).
        seed: seed of the shared generator used by requests without a seed.
    """

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.shared_generator = torch.Generator().manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.shared_generator
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = self.generators[req.request_id] = torch.Generator().manual_seed(req.params.seed)
        return gen

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampledToken]:
        """Sample a token for each request.

        Args:
            logits: [B, V] float32, row i for ``reqs[i]``; may be on any device.
            reqs: the B requests (their params, outputs so far and grammar matchers are read).
        Returns:
            B SampledTokens (logprobs are of the model's raw distribution, before temperature).
        """
        logits = logits.float().cpu()
        raw_logits = logits
        logits = logits.clone()
        for i, req in enumerate(reqs):
            p = req.params
            if p.needs_penalties:
                _apply_penalties(logits[i], req)
            if req.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
                banned = [t for t in banned if t < logits.shape[1]]
                logits[i, banned] = -float("inf")
        grammar_rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if grammar_rows:
            _apply_grammar(logits, reqs, grammar_rows)

        out = []
        logprobs_all = None
        if any(r.params.logprobs is not None for r in reqs):
            logprobs_all = torch.log_softmax(raw_logits, dim=-1)
        for i, req in enumerate(reqs):
            token = self._sample_row(logits[i], req)
            s = SampledToken(token)
            if req.params.logprobs is not None:
                row = logprobs_all[i]
                s.logprob = float(row[token])
                if req.params.logprobs > 0:
                    vals, ids = row.topk(req.params.logprobs)
                    s.top_logprobs = dict(zip(ids.tolist(), vals.tolist()))
            if req.grammar is not None:
                req.grammar.accept_token(token)
            out.append(s)
        return out

    def _sample_row(self, row: torch.Tensor, req: Request) -> int:
        p = req.params
        if p.is_greedy:
            return int(row.argmax())
        row = row / p.temperature
        if p.top_k and p.top_k < row.shape[0]:
            kth = row.topk(p.top_k).values[-1]
            row = row.masked_fill(row < kth, -float("inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cum = sorted_probs.cumsum(0)
            drop = (cum - sorted_probs) > p.top_p  # keep the smallest prefix whose mass reaches top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        # exponential race (equivalent to sampling from probs / probs.sum()), one draw per vocab entry
        noise = torch.empty_like(probs).exponential_(generator=self._generator(req))
        return int((probs / noise).argmax())


def _apply_penalties(row: torch.Tensor, req: Request) -> None:
    """Repetition (prompt + output, CTRL-style), presence and frequency (output only, OpenAI-style)."""
    p = req.params
    vocab = row.shape[0]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in req.all_token_ids if t < vocab}), dtype=torch.long)
        if len(seen):
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if req.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=vocab)[:vocab].float()
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _apply_grammar(logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> None:
    """Mask tokens that the request's grammar matcher (xgrammar) does not allow next."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(reqs), logits.shape[1])
    for i in rows:
        reqs[i].grammar.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
