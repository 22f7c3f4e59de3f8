"""Speculative decoding: proposers of draft tokens, the confidence schedule of how many to verify, and
the acceptance counters.

A proposer drafts up to ``k`` tokens per decoding request before a step; the scheduler gives the request
its last token plus the drafts to compute in one target forward (paged KV written for all of them); the
model runner samples a target token after each and accepts the longest prefix of drafts the target
agrees with (:func:`rayinfer.engine.model_runner.accepted_length`); the scheduler rolls the rejected
drafts' computed tokens back. Drafts are deterministic (one-hot draft distributions: n-gram lookup, the
draft model's and MTP's greedy tokens), so verification is the speculative rejection rule of Leviathan
et al. 2023 / Chen et al. 2023 with the sampler's seeded uniforms shared with plain sampling: output is
token-for-token that of non-speculative decoding, greedy or seeded.

How many drafts to verify: all of them (``schedule="fixed"``), or (``"confidence"``) per request the
prefix whose expected gain pays for its cost: :class:`AcceptanceCalibrator` turns the drafter's
probabilities into confidences, :class:`StepTimeModel` fits step time to token count from measured
steps, and :func:`choose_num_drafts` picks the drafts that maximize expected tokens per second;
:class:`SpeculationGate` turns speculation off for a batch size where plain decode steps measured faster.

Proposers: :class:`NgramProposer` (prompt lookup), :class:`DraftModelProposer` (a small model),
:class:`MtpProposer` (DeepSeek-V3's multi-token-prediction module over the target's hidden states).

Glossary: *draft* a proposed token; *verify* compute it in the target forward; *accept* the target's
token at its position equals it; *confidence* the drafter's estimate that a draft is accepted (the
running product of its top-1 probabilities up to that draft).
"""

from __future__ import annotations


import bisect
import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from rayinfer.engine.types import PLACEHOLDER, Request, SchedulerOutput, StepOutput
from rayinfer.kernels.ngram import ngram_lookup_device

logger = logging.getLogger(__name__)


@dataclass
class Draft:
    """One request's proposal.

    Attributes:
        token_ids: the draft tokens, in order (possibly empty).
        probs: per draft, the drafter's top-1 probability at its position (the draft model's softmax;
            conditional on the drafts before it), or None when the drafter has no probabilities (n-gram).
    """

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] | None = None


class Proposer:
    """Drafts tokens for decoding requests (the interface every method implements).

    ``needs_hidden``: the proposer reads the target's hidden states (:meth:`observe` after every step);
    the engine then has the model runner keep them. ``drafts_vary``: how many drafts it finds depends on
    the text (n-gram lookup) and costs little on the host, so the confidence schedule's plain steps look
    now and then (:meth:`SpeculationGate.note_drafts`).
    """

    needs_hidden = False
    drafts_vary = False
    device_graphs = None  # set by enable_device_drafts where the proposer drafts on the device

    def propose(self, reqs: list[Request], max_drafts: list[int]) -> list[Draft]:
        """Draft up to ``max_drafts[i]`` tokens after ``reqs[i].all_token_ids``.

        Args:
            reqs: decoding requests (every token known on the host, the last one not yet computed).
            max_drafts: per request, the most drafts worth proposing (>= 1).
        Returns:
            one :class:`Draft` per request.
        """
        raise NotImplementedError

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request (free its draft KV); unknown ids are ignored."""

    def enable_device_drafts(self, max_model_len: int, max_num_seqs: int, num_draft_tokens: int) -> None:
        """Draft on the device behind each verification step from now on (:meth:`launch_drafts`), where the
        proposer can (it then sets ``device_graphs``). Default: it cannot; nothing changes."""

    def launch_drafts(self, sched: SchedulerOutput, step, num_drafts: int) -> None:
        """Right after a step is launched (``step``: its :class:`~rayinfer.engine.model_runner.PendingStep`),
        queue drafting for the step after it on the device, from the step's own samples: the drafts then
        need no pass of their own before the next step (:meth:`take_drafts`). A proposer that can also
        sets ``step.next_inputs`` (the next step's inputs on the device), from which the engine may chain the
        next verification step before this one is processed (:meth:`take_chained` then hands out the drafts).
        Proposers that cannot (the default) do nothing, and :meth:`propose` drafts before the next step as usual."""

    _queued: tuple | None = None  # the drafts the last launch_drafts queued (_queue_drafts), until taken

    def take_chained(self) -> dict[str, "Draft"]:
        """The drafts behind ``step.next_inputs`` of the last :meth:`launch_drafts`, by request id, whatever
        the host knows yet (a chained step verifies exactly those); waits for the device. Default: what the
        last launch queued (none for a proposer that does not draft on the device), once."""
        queued, self._queued = self._queued, None
        return {} if queued is None else _queued_drafts(queued)

    def take_drafts(self, reqs: list[Request]) -> dict[str, "Draft"]:
        """The drafts :meth:`launch_drafts` queued behind the last step for those of ``reqs`` they are still
        valid for (made after the request's last token), by request id; waits for the device. The rest are
        dropped: a call takes what the last launch queued, once."""
        return {}

    def observe(self, sched: SchedulerOutput, hidden: torch.Tensor, step_out: StepOutput,
                ended: frozenset[str] = frozenset()) -> None:
        """After a step (before its tokens are appended), with ``needs_hidden``: the target's hidden states.

        Args:
            sched: the step's schedule (rows of ``hidden`` follow its requests' tokens in order).
            hidden: [num_scheduled_tokens, hidden_size] in the model dtype: the last layer before the
                final norm.
            step_out: what the step sampled and accepted (rows past a request's accepted drafts are stale).
            ended: requests of the step that ended while it was in flight (released already; their rows
                are to be ignored, and their ids may name new requests by now).
        """


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from
    ``ngram_max`` down to ``ngram_min``) and propose the tokens that followed it (after Saxena 2023,
    "Prompt lookup decoding", and vLLM's n-gram proposer). No model.

    On the host by default. With ``on_device`` (``speculative.ngram_on_device``) and device drafts enabled,
    :meth:`launch_drafts` also runs the same lookup on the device behind each verification step
    (:class:`_NgramDeviceLookup`), so that verification steps chain as MTP's and the draft model's do.

    Args:
        ngram_min, ngram_max: n-gram lengths tried, longest first.
        on_device: allow the device lookup (:meth:`enable_device_drafts` then turns it on).
    """

    drafts_vary = True

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, on_device: bool = False):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.on_device = on_device
        self._contexts: dict[str, TokenBuffer] = {}

    def enable_device_drafts(self, max_model_len: int, max_num_seqs: int, num_draft_tokens: int) -> None:
        """With ``on_device``: look drafts up on the device behind each verification step (:meth:`launch_drafts`);
        the lookup's buffers are made at the first launch, on that step's device."""
        if self.on_device:
            self.device_graphs = _NgramDeviceLookup(max_model_len, max_num_seqs, self.ngram_min, self.ngram_max)

    @torch.inference_mode()
    def launch_drafts(self, sched: SchedulerOutput, step, num_drafts: int) -> None:
        """Queue the next step's drafts at the end of a verification step, on the device and without a host
        sync: each verified request's context (its tokens through the last known one, kept on the device and
        topped up from the host) is extended by the target's tokens through the first rejected draft, and the
        n-gram lookup of :func:`ngram_lookup` runs over it (:meth:`_NgramDeviceLookup.lookup`). A request
        whose lookup finds no n-gram, or fewer than ``num_drafts`` tokens, gets token 0 in the missing places
        (verified and, unless the target samples it, rejected: a graph verifies one width for all)."""
        self._queued = None
        lookup = self.device_graphs
        if lookup is None or step.drafts is None or step.token_ids is None or num_drafts < 1:
            return
        assert isinstance(lookup, _NgramDeviceLookup)
        reqs = {r.request_id: r for r in step.sample_reqs}
        # a request without a draft chains too; not a prompt's last chunk (its first drafts come from the host), nor
        # a request that ended after this step was scheduled (released already: a row taken now would never be freed)
        rows = [r for r in _verified_rows(sched, step, decode_rows=True)
                if r.rid in reqs and not reqs[r.rid].is_finished
                and reqs[r.rid].num_prompt_tokens <= r.p0 == reqs[r.rid].num_known_tokens - 1
                and lookup.slot(r.rid) is not None]
        if not rows:
            return
        v = _verify_on_device(step, rows, [np.array([r.p0 for r in rows], dtype=np.int64)])
        (p0_t,) = v.extra
        ids = lookup.lookup([reqs[r.rid] for r in rows], [r.p0 for r in rows], p0_t, v.target, v.accepted,
                            num_drafts)
        self._queued = _queue_drafts([r.rid for r in rows], ids)
        step.next_inputs = v.next_inputs(ids)

    def take_drafts(self, reqs: list[Request]) -> dict[str, Draft]:
        self._queued = None  # a drained step drafts on the host: the lookup there is exact and cheap
        return {}

    def propose(self, reqs: list[Request], max_drafts: list[int]) -> list[Draft]:
        drafts = []
        for r, k in zip(reqs, max_drafts):
            context = self._contexts.get(r.request_id)
            if context is None:
                context = self._contexts[r.request_id] = TokenBuffer()
            context.sync(r.prompt_token_ids, r.output_token_ids)
            drafts.append(Draft(context.ngram_lookup(k, self.ngram_min, self.ngram_max)))
        return drafts

    def release(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)
        if isinstance(self.device_graphs, _NgramDeviceLookup):
            self.device_graphs.release(request_id)


class _NgramDeviceLookup:
    """Prompt lookup on the device, for chained verification (:meth:`NgramProposer.launch_drafts`).

    Each request holds a row of a [max_num_seqs, max_model_len] int32 buffer of its tokens (256 x 8K: 8 MiB).
    Before a lookup the host uploads the tokens it knows that the row lacks (from ``synced[rid]`` through the
    last known one); the device then writes the verified step's target tokens after it (the accepted drafts
    equal them) and searches. Positions past a row's context may hold stale tokens; the search never reads
    them.
    """

    def __init__(self, max_model_len: int, max_num_seqs: int, ngram_min: int, ngram_max: int):
        self.max_model_len, self.ngram_min, self.ngram_max = max_model_len, ngram_min, ngram_max
        self.ctx: torch.Tensor | None = None  # made at the first lookup, on the step's device
        self.free = list(range(max_num_seqs))[::-1]
        self.slots: dict[str, int] = {}
        self.synced: dict[str, int] = {}  # tokens of the request's row the host wrote (positions 0 .. n-1)

    def slot(self, rid: str) -> int | None:
        """The request's row (a new one for a new request; None when all are taken)."""
        if rid not in self.slots:
            if not self.free:
                return None
            self.slots[rid], self.synced[rid] = self.free.pop(), 0
        return self.slots[rid]

    def release(self, rid: str) -> None:
        if rid in self.slots:
            self.free.append(self.slots.pop(rid))
            self.synced.pop(rid, None)

    def lookup(self, reqs: list[Request], p0: list[int], p0_t: torch.Tensor, target: torch.Tensor,
               accepted: torch.Tensor, k: int) -> torch.Tensor:
        """Drafts for ``reqs`` (each known through position ``p0[i]``) after a verification step whose target
        tokens ``target`` [n, w] and accepted-draft counts ``accepted`` [n] are on the device (``p0_t``: [n]
        int64 there). Returns [n, k] int64 on the device: :func:`ngram_lookup`'s continuation of each context
        ``tokens[: p0 + accepted + 2]``, 0 where it has fewer than k tokens (:func:`ngram_lookup_device`: one
        Triton launch on CUDA)."""
        from rayinfer.engine.staging import to_device

        dev, (n, w) = target.device, target.shape
        if self.ctx is None:
            self.ctx = torch.zeros(len(self.free) + len(self.slots), self.max_model_len, dtype=torch.int32, device=dev)
        ctx, max_len = self.ctx, self.max_model_len
        slots = np.array([self.slots[r.request_id] for r in reqs], dtype=np.int64)
        up_rows, up_pos, up_tok = [], [], []
        for e, (req, last) in enumerate(zip(reqs, p0)):
            start = self.synced[req.request_id]
            if start <= last:
                tokens = req.known_token_ids(start, last + 1)
                up_rows.append(np.full(len(tokens), slots[e], dtype=np.int64))
                up_pos.append(np.arange(start, last + 1, dtype=np.int64))
                up_tok.append(np.asarray(tokens, dtype=np.int32))
                self.synced[req.request_id] = last + 1
        slots_t, *up = to_device([slots] + ([np.concatenate(up_rows), np.concatenate(up_pos), np.concatenate(up_tok)]
                                            if up_rows else []), dev)
        if up:
            ctx[up[0], up[1]] = up[2]
        # the target's tokens after the last known one: the accepted drafts (equal to them), then its own
        pos = (p0_t[:, None] + 1 + torch.arange(w, device=dev)).clamp(max=max_len - 1)
        ctx[slots_t[:, None], pos] = target.to(torch.int32)
        width = min(max(p0) + w + 1, max_len)  # the longest context, at most (known on the host)
        length = (p0_t + accepted + 2).clamp(max=max_len)
        return ngram_lookup_device(ctx[:, :width], slots_t, length, k, self.ngram_min, self.ngram_max)


class TokenBuffer:
    """A request's token ids as a growing int64 array (capacity doubled as it fills), so a step converts
    only the tokens appended since the last one instead of the whole context; and where each token id
    occurs (``positions``: id -> ascending positions, about 40 bytes a token), kept up to date the same way,
    for :meth:`ngram_lookup`."""

    FAST_CANDIDATES = 8  # latest occurrences :meth:`ngram_lookup` checks before the full search

    def __init__(self):
        self.data = np.empty(0, dtype=np.int64)
        self.length = 0
        self.positions: dict[int, list[int]] = {}

    def sync(self, tokens: list[int], more: list[int] = ()) -> np.ndarray:  # type: ignore[assignment]
        """The array of ``tokens + more`` (a view, valid until the next call; a request's prompt and outputs,
        never concatenated): appends what is new, or rebuilds when the kept tokens are no longer a prefix
        (checked at the last kept token)."""
        p, n = len(tokens), self.length
        total = p + len(more)
        if n > total or (n and (tokens[n - 1] if n <= p else more[n - 1 - p]) != self.data[n - 1]):
            n = 0
        kept = n  # tokens already converted and indexed (0: rebuilt)
        if total > len(self.data):
            grown = np.empty(max(2 * len(self.data), total, 64), dtype=np.int64)
            grown[:n] = self.data[:n]
            self.data = grown
        if n < p:
            self.data[n:p] = tokens[n:]
            n = p
        if total > n:
            self.data[n:total] = more[n - p:]
        if not kept:
            self.positions = {}
        positions = self.positions
        for i in range(kept, total):
            positions.setdefault(tokens[i] if i < p else more[i - p], []).append(i)
        self.length = total
        return self.data[:total]

    def ngram_lookup(self, k: int, ngram_min: int, ngram_max: int) -> list[int]:
        """:func:`ngram_lookup` of the synced tokens, the same result, faster in the common case: when one
        of the last :attr:`FAST_CANDIDATES` occurrences of the last token that are followed by ``k`` tokens
        ends the longest n-gram tried, it is the answer (the latest such occurrence), found from
        ``positions`` without a pass over the context; otherwise the full search runs."""
        length, data = self.length, self.data
        if length < 2 or k < 1:
            return ngram_lookup(data[:length], k, ngram_min, ngram_max)
        cap = min(ngram_max, length - 1)
        ends = self.positions[int(data[length - 1])]
        if cap >= ngram_min:
            suffix = data[length - cap : length].tolist()
            i = bisect.bisect_right(ends, length - 1 - k) - 1  # the latest occurrence followed by k tokens
            for _ in range(self.FAST_CANDIDATES):
                if i < 0 or ends[i] < cap - 1:
                    break
                end = ends[i]
                if data[end - cap + 1 : end + 1].tolist() == suffix:
                    return data[end + 1 : end + 1 + k].tolist()
                i -= 1
        # the last position is the suffix itself
        return ngram_lookup(data[:length], k, ngram_min, ngram_max, np.array(ends[:-1], dtype=np.int64))


def ngram_lookup(tokens: np.ndarray, k: int, ngram_min: int, ngram_max: int, ends: np.ndarray | None = None) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the last n tokens of ``tokens``: the
    latest one that is followed by ``k`` tokens, else the first one.

    One pass over the context finds where its last token occurred before; each n then checks only
    those candidates' preceding tokens (O(L + candidates x n), not a comparison of every window).

    Args:
        tokens: [L] int64, the context.
        k: drafts wanted.
        ngram_min, ngram_max: n-gram lengths tried, longest first; the first that occurs wins.
        ends: the earlier positions of the last token, ascending (int64), if known; else found here.
    Returns:
        the continuation (at most k tokens; empty when no n-gram recurs).
    """
    length = len(tokens)
    if length < 2:
        return []
    if ends is None:
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # earlier occurrences' last positions
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        hits = ends[ends >= n - 1]
        for j in range(1, n):
            hits = hits[tokens[hits - j] == tokens[length - 1 - j]]
        if hits.size:
            starts = hits - (n - 1)
            # the latest occurrence followed by k tokens (a loop's last period is too short), else the first
            full = starts[starts + n + k <= length]
            start = int(full[-1] if full.size else starts[0]) + n
            return tokens[start: start + k].tolist()
    return []


class _DraftCache:
    """A draft model's own paged KV cache: blocks handed out per request from a free list (no prefix
    sharing), with the token ids each request's KV was computed over so that stale tails (rejected
    drafts) are recomputed."""

    def __init__(self, shape: tuple[int, ...], block_size: int, dtype: torch.dtype, device: torch.device):
        """``shape``: the cache's (a model's ``kv_cache_shape(num_blocks, block_size)``; blocks on dim 1)."""
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.free_blocks = list(range(shape[1] - 1, -1, -1))
        self.block_ids: dict[str, list[int]] = {}
        self.computed: dict[str, list[int]] = {}  # token ids whose KV is in the request's blocks

    def reserve(self, rid: str, num_tokens: int) -> list[int] | None:
        """The request's block table grown to ``num_tokens`` slots, or None if the pool is out of blocks."""
        blocks = self.block_ids.setdefault(rid, [])
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > len(self.free_blocks):
            return None
        for _ in range(max(need, 0)):
            blocks.append(self.free_blocks.pop())
        return blocks

    def release(self, rid: str) -> None:
        self.free_blocks.extend(reversed(self.block_ids.pop(rid, [])))
        self.computed.pop(rid, None)


class DraftModelProposer(Proposer):
    """A small model sharing the target's tokenizer drafts greedily, ``k`` forwards per step, over its
    own paged KV cache (each request catches up on the tokens it has not seen, then drafts one token
    per forward).

    Args:
        model: a paged model (``forward(input_ids, positions, kv_cache, meta)``, ``compute_logits``,
            ``kv_cache_shape``), in eval mode; the target itself drafts for itself (acceptance 1 greedy).
        num_blocks, block_size: its KV pool.
        vocab_size: the target's vocabulary (draft logits past it are ignored).
        max_catch_up_tokens: most rows of one eager catch-up forward (a longer catch-up runs as several;
            the engine passes its ``max_num_batched_tokens``).
    Raises:
        ValueError: if the draft's vocabulary is smaller than the target's tokenizer needs.
    """

    def __init__(self, model, num_blocks: int, block_size: int, vocab_size: int, max_catch_up_tokens: int = 8192):
        weight = next(model.parameters())
        self.max_catch_up_tokens = max(int(max_catch_up_tokens), 1)
        if model.config.vocab_size < vocab_size:
            raise ValueError(f"draft model's vocab_size ({model.config.vocab_size}) is smaller than the target's "
                             f"({vocab_size}); a draft model must share the target's tokenizer")
        self.model, self.vocab_size = model, vocab_size
        self.device = weight.device
        self.cache = _DraftCache(model.kv_cache_shape(num_blocks, block_size), block_size, weight.dtype, self.device)
        self.graphs = None  # DecodeGraphs over the draft cache once captured
        # launch_drafts: the drafts queued behind the last verification step, (request ids, ids, probs, event), and
        # per request (its last known position p0, the drafts it verified) until its cache bookkeeping is settled
        self._queued = None
        self._launched: dict[str, tuple[int, int]] = {}
        self._host: dict[str, Draft] | None = None

    # Catch-ups on more tokens than a verification step accepts (the prompt, the confidence schedule's plain
    # steps) replay graphs of RAYINFER_DRAFT_CATCH_UP_LEN tokens a request (default 32), up to this many rows
    # (DecodeGraphs.catch_up_rounds).
    MAX_CATCH_UP_TOKENS = 8192

    def capture_cuda_graphs(self, max_model_len: int, max_num_seqs: int, max_query_len: int) -> None:
        """Capture the draft model's forwards (CUDA only): one-token draft steps, catch-up steps of up
        to ``max_query_len`` tokens (the last verification's accepted tokens), and steps of
        ``RAYINFER_DRAFT_CATCH_UP_LEN`` tokens a request, of which a longer catch-up runs several."""
        from rayinfer import envs
        from rayinfer.engine.cuda_graph import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.cache.kv_cache, self.cache.block_size, max_model_len,
                                   max_num_seqs, max_query_len=max_query_len, catch_up_len=envs.draft_catch_up_len(),
                                   max_catch_up_tokens=self.MAX_CATCH_UP_TOKENS)
        self.graphs.capture()

    def enable_device_drafts(self, max_model_len: int, max_num_seqs: int, num_draft_tokens: int) -> None:
        """Draft at the end of each verification step (:meth:`launch_drafts`): in the captured graphs when
        there are (call after :meth:`capture_cuda_graphs`), off CUDA on the same padded buffers run eagerly.
        On CUDA without graphs (``enforce_eager``) the drafts stay on the host. The k drafted per step is
        :meth:`launch_drafts`' argument (``num_draft_tokens`` sizes nothing here)."""
        from rayinfer.engine.cuda_graph import DecodeGraphs

        if self.graphs is not None and self.graphs.max_query_len >= 2:
            self.device_graphs = self.graphs
        elif self.device.type != "cuda":
            self.device_graphs = DecodeGraphs(self.model, self.cache.kv_cache, self.cache.block_size, max_model_len,
                                              max_num_seqs, max_query_len=2, eager=True)

    def release(self, request_id: str) -> None:
        self.cache.release(request_id)
        self._launched.pop(request_id, None)

    def _host_drafts(self) -> dict[str, Draft]:
        """The queued drafts on the host, by request id (waits for their copy once)."""
        if self._host is None and self._queued is not None:
            self._host = _queued_drafts(self._queued)
        return self._host or {}

    def _settle(self, reqs: list[Request]) -> dict[str, Draft]:
        """Once the step the last :meth:`launch_drafts` followed is processed: the draft cache of each of
        ``reqs`` it drafted for holds the request's tokens up to the target's token after the accepted drafts,
        then the first k - 1 new drafts (``cache.computed`` says so). Returns those requests' new drafts and
        probabilities, by request id. A request it drafted for that is not in ``reqs`` keeps its older
        ``computed``, which stays true of the cache's first entries (the device rewrote them with the same
        tokens), so its next catch-up is only longer."""
        host, launched = self._host_drafts(), self._launched
        self._queued, self._host, self._launched = None, None, {}
        out = {}
        for req in reqs:
            rid = req.request_id
            if rid not in launched or rid not in host:
                continue
            p0, k = launched[rid]
            if not 0 <= req.num_known_tokens - p0 - 2 <= k:  # not (only) that step's tokens were appended
                continue
            self.cache.computed[rid] = req.all_token_ids + host[rid].token_ids[:-1]
            out[rid] = host[rid]
        return out

    def take_chained(self) -> dict[str, Draft]:
        return dict(self._host_drafts())

    def take_drafts(self, reqs: list[Request]) -> dict[str, Draft]:
        return self._settle(reqs)

    @torch.inference_mode()
    def launch_drafts(self, sched: SchedulerOutput, step, num_drafts: int) -> None:
        """Queue the next step's drafts on the device at the end of a verification step, with no host sync.

        For each verified request whose draft cache holds its tokens up to the last known one (position p0)
        and then its first k - 1 drafts (what :meth:`propose` or the last device drafting left), the device
        counts the accepted drafts ``a``, feeds the draft model the two tokens at p0 + a and p0 + a + 1 (the
        last accepted token, whose entry is rewritten with the same values or, for a = k, first computed,
        and the target's token after it) and chains ``num_drafts - 1`` one-token forwards from the top-1 of
        each: the draft graphs of widths 2 and 1 (:meth:`DecodeGraphs.run` with ``advance=a``). The drafts and
        their probabilities are copied to pinned host memory; ``step.next_inputs`` gets the next step's inputs.
        """
        self._settle(step.sample_reqs if step.drafts is not None else [])  # the step before was processed
        graphs = self.device_graphs
        if graphs is None or step.drafts is None or step.token_ids is None or num_drafts < 1:
            return
        cache = self.cache
        rows = []
        for r in _verified_rows(sched, step):
            k, computed = len(r.drafts), cache.computed.get(r.rid)
            if (computed is not None and len(computed) == r.p0 + k and computed[r.p0 + 1:] == list(r.drafts[: k - 1])
                    and len(rows) < graphs.sizes[-1] and cache.reserve(r.rid, r.p0 + k + num_drafts + 1) is not None):
                rows.append(r)
        if not rows or graphs.padded_size(len(rows), 2) is None:
            return
        blocks = [cache.block_ids[r.rid] for r in rows]
        tables = np.zeros((len(rows), max(len(b) for b in blocks)), dtype=np.int32)
        for e, b in enumerate(blocks):
            tables[e, : len(b)] = b
        p0 = np.array([r.p0 for r in rows], dtype=np.int64)
        last = np.array([r.last for r in rows], dtype=np.int64)
        v = _verify_on_device(step, rows, [p0, tables, last])
        p0_t, tables_t, last_t = v.extra
        dev = p0_t.device
        fed = torch.cat([last_t[:, None], v.drafts], dim=1)  # the last known token, then the drafts
        ids = torch.cat([fed.gather(1, v.accepted[:, None]), v.target.gather(1, v.accepted[:, None])], dim=1)
        ids = ids.reshape(-1)
        pos = (p0_t[:, None] + torch.arange(2, device=dev)).reshape(-1)  # moved by a on the device
        out_ids, out_probs = [], []
        for step_j in range(num_drafts):
            q = 2 if step_j == 0 else 1
            seq = (p0_t + 2 + step_j).to(torch.int32)  # the context through the last fed token, before the move
            hidden = graphs.run(ids, pos, None, seq, tables_t, query_len=q, advance=v.accepted)
            last = hidden[q - 1:: q] if q > 1 else hidden
            probs = torch.softmax(self.model.compute_logits(last)[:, : self.vocab_size].float(), dim=-1)
            top_p, top_id = probs.max(dim=-1)
            out_ids.append(top_id)
            out_probs.append(top_p)
            ids, pos = top_id, p0_t + 2 + step_j
        ids_t, probs_t = torch.stack(out_ids, dim=1), torch.stack(out_probs, dim=1)
        self._queued = _queue_drafts([r.rid for r in rows], ids_t, probs_t)
        self._launched = {r.rid: (r.p0, len(r.drafts)) for r in rows}
        step.next_inputs = v.next_inputs(ids_t)  # last: a chained step needs the drafts queued too

    def _forward(self, ids: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                 tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over ``query_lens`` new tokens a request (``ids``: [sum(query_lens)] int64 on the
        device), in a captured graph where one fits, else eagerly. Returns the hidden states [tokens,
        hidden_size] and each request's last row's index among them ([n] int64, on the device)."""
        from rayinfer.engine.staging import to_device
        from rayinfer.kernels.attention_metadata import AttentionMetadata, host_arrays

        cache, dev = self.cache, self.device
        qsl, sl, bt, slots, positions = host_arrays(query_lens, seq_lens, tables, cache.block_size)
        width = self.graphs.ragged_width(query_lens, seq_lens) if self.graphs is not None else None
        if width is not None:  # draft steps and short catch-ups: a captured graph
            assert self.graphs is not None
            hidden = self.graphs.run_ragged(ids, slots, query_lens, seq_lens, bt, width)
            (last,) = to_device([qsl[1:].astype(np.int64) - 1], dev)
            return hidden, last  # type: ignore[return-value]
        qsl_t, sl_t, bt_t, slots_t, pos_t, last = to_device(
            [qsl, sl, bt, slots, positions, qsl[1:].astype(np.int64) - 1], dev)
        meta = AttentionMetadata(qsl_t, sl_t, bt_t, slots_t, cache.block_size, query_lens, seq_lens)
        return self.model(ids, pos_t, cache.kv_cache, meta), last

    @torch.inference_mode()
    def propose(self, reqs: list[Request], max_drafts: list[int]) -> list[Draft]:
        from rayinfer.engine.staging import to_device

        self._settle(reqs)
        cache = self.cache
        drafts = [Draft([], []) for _ in reqs]
        live, chunks, starts = [], [], []
        for i, (req, k) in enumerate(zip(reqs, max_drafts)):
            tokens = req.all_token_ids
            seen = cache.computed.get(req.request_id, [])
            start = _common_prefix(seen, tokens)
            start = min(start, len(tokens) - 1)  # the last token's logits give the first draft
            if cache.reserve(req.request_id, len(tokens) + k - 1) is None:
                continue  # out of draft blocks: no drafts for it this step
            cache.computed[req.request_id] = tokens[:start]
            live.append(i)
            chunks.append(tokens[start:])
            starts.append(start)
        if not live:
            return drafts
        catch_up = dict(zip(live, chunks))  # request index -> the tokens its first forward computes
        # The catch-up forward, then one forward a draft, each fed the one before's top-1 on the device; the
        # rows that still want drafts follow from max_drafts on the host, so nothing is read back until all
        # forwards are launched (one read a step, not one a draft).
        dev = self.device
        num_left = [max_drafts[i] for i in live]
        query_lens = [len(c) for c in chunks]
        seq_lens = [s + q for s, q in zip(starts, query_lens)]
        rounds = None if self.graphs is None else self.graphs.catch_up_rounds(query_lens, seq_lens)
        if rounds is None:
            rounds = _eager_catch_up_rounds(query_lens, self.max_catch_up_tokens)
        for take in rounds:  # a long catch-up (the prompt, the plain steps' tokens): its first tokens
            rows = [j for j, t in enumerate(take) if t]
            fed = [chunks[j][:take[j]] for j in rows]
            (fed_t,) = to_device([np.fromiter((t for c in fed for t in c), np.int64)], dev)
            self._forward(fed_t, [take[j] for j in rows], [starts[j] + take[j] for j in rows],
                          [cache.block_ids[reqs[live[j]].request_id] for j in rows])
            for j in rows:
                chunks[j], starts[j] = chunks[j][take[j]:], starts[j] + take[j]
            query_lens = [len(c) for c in chunks]
        (ids,) = to_device([np.fromiter((t for c in chunks for t in c), np.int64)], dev)
        steps = []  # per forward: (the indexes into reqs it drafted for, top-1 ids [n], their probabilities [n])
        while True:
            rids = [reqs[i].request_id for i in live]
            seq_lens = [s + q for s, q in zip(starts, query_lens)]
            hidden, last = self._forward(ids, query_lens, seq_lens, [cache.block_ids[rid] for rid in rids])
            probs = torch.softmax(self.model.compute_logits(hidden[last])[:, : self.vocab_size].float(), dim=-1)
            top_p, top_id = probs.max(dim=-1)
            steps.append((live, top_id, top_p))
            num_left = [n - 1 for n in num_left]
            keep = [j for j, n in enumerate(num_left) if n > 0]
            if not keep:
                break
            ids = top_id if len(keep) == len(live) else top_id[to_device([np.asarray(keep, dtype=np.int64)], dev)[0]]
            live, num_left = [live[j] for j in keep], [num_left[j] for j in keep]
            starts, query_lens = [seq_lens[j] for j in keep], [1] * len(keep)
        top_ids = torch.cat([t for _, t, _ in steps]).tolist()  # the step's one read
        top_ps = torch.cat([p for _, _, p in steps]).tolist()
        at = 0
        for n, (rows, _, _) in enumerate(steps):
            for i in rows:
                d, rid = drafts[i], reqs[i].request_id
                # the KV this forward computed: the catch-up tokens, then each request's draft before
                cache.computed[rid] = cache.computed[rid] + (catch_up[i] if n == 0 else [d.token_ids[-1]])
                d.token_ids.append(top_ids[at])
                assert d.probs is not None
                d.probs.append(top_ps[at])
                at += 1
        return drafts


def _eager_catch_up_rounds(query_lens: list[int], max_tokens: int) -> list[list[int]]:
    """Eager forwards that bound a catch-up's rows by ``max_tokens`` (a batch of long prompts at once): how
    many of its next tokens each request feeds in each forward before the last, which then feeds every
    request's last token. [] when one forward of ``sum(query_lens)`` rows fits."""
    if sum(query_lens) <= max_tokens:
        return []
    left, rounds = [n - 1 for n in query_lens], []
    while sum(left):
        room, take = max_tokens, []
        for n in left:
            take.append(min(n, room))
            room -= take[-1]
        rounds.append(take)
        left = [n - t for n, t in zip(left, take)]
    return rounds


class _VerifiedRows(NamedTuple):
    """One request's rows in a verification step (a proposer's ``launch_drafts``): its first sampler row and
    first row in the step's tokens (and hidden states), the position ``p0`` and id of its last known token,
    the drafts it verifies."""

    rid: str
    sample_row: int
    hidden_row: int
    p0: int
    last: int
    drafts: tuple[int, ...]


def _verified_rows(sched: SchedulerOutput, step, decode_rows: bool = False) -> list[_VerifiedRows]:
    """The requests of a launched step (``step``: its ``PendingStep``) that verify drafts, the chained step's
    rows of requests that ended before it (placeholder drafts) left out; with ``decode_rows`` also those that
    decode one token without drafts (no draft verified: the device's count of accepted drafts is then 0)."""
    placed, token_start = {}, 0  # request id -> (its schedule, its first row in the step's tokens)
    for s in sched.scheduled:
        placed[s.request_id] = (s, token_start)
        token_start += len(s.token_ids)
    rows, sample_row = [], 0
    for req, drafts in zip(step.sample_reqs, step.drafts):
        (s, token_row), k = placed[req.request_id], len(drafts)
        if (k or decode_rows and len(s.token_ids) == 1) and PLACEHOLDER not in drafts:
            first = len(s.token_ids) - k - 1  # the last known token's index among the step's tokens
            rows.append(_VerifiedRows(req.request_id, sample_row, token_row + first, s.start_pos + first,
                                      s.token_ids[first], drafts))
        sample_row += k + 1
    return rows


class _DeviceVerification(NamedTuple):
    """What the device knows of a launched verification step before the host does (``_verify_on_device``):
    ``target`` [n, w] int64, the target's token after each verified row (padded rows repeat the last);
    ``accepted`` [n] int64, the leading drafts it agrees with; ``drafts`` [n, w - 1] int64 (-1 padded);
    ``verified`` [n] int64, the drafts each request verified; ``rids``; ``extra``: the caller's arrays."""

    rids: list[str]
    target: torch.Tensor
    accepted: torch.Tensor
    drafts: torch.Tensor
    verified: torch.Tensor
    extra: list[torch.Tensor]

    def next_inputs(self, new_drafts: torch.Tensor) -> tuple[dict[str, int], torch.Tensor, torch.Tensor]:
        """``PendingStep.next_inputs``, the inputs of a chained step: the target's token after the accepted drafts,
        then ``new_drafts`` [n, k]; its positions move by the drafts not accepted (the host plans as if all were)."""
        first = self.target.gather(1, self.accepted[:, None])
        return ({rid: e for e, rid in enumerate(self.rids)}, torch.cat([first, new_drafts], dim=1),
                self.accepted - self.verified)


def _verify_on_device(step, rows: list[_VerifiedRows], extra: list[np.ndarray]) -> _DeviceVerification:
    """Count, on the device and without a host sync, the drafts a launched step accepts for ``rows``
    (``accepted[i]``: the leading ``target[j] == draft[j + 1]``); ``extra`` host arrays travel in the same
    upload and come back on the device in order."""
    from rayinfer.engine.staging import to_device

    n, w = len(rows), max(len(r.drafts) for r in rows) + 1
    j = np.arange(w)
    tok_rows = np.array([r.sample_row + np.minimum(j, len(r.drafts)) for r in rows], dtype=np.int64)
    drafts = np.full((n, w - 1), -1, dtype=np.int64)
    for e, r in enumerate(rows):
        drafts[e, : len(r.drafts)] = r.drafts
    verified = np.array([len(r.drafts) for r in rows], dtype=np.int64)
    tok_t, drafts_t, verified_t, *extra_t = to_device([tok_rows, drafts, verified, *extra], step.token_ids.device)
    target = step.token_ids[tok_t]
    accepted = torch.cumprod((target[:, :-1] == drafts_t).long(), dim=1).sum(dim=1)
    return _DeviceVerification([r.rid for r in rows], target, accepted, drafts_t, verified_t, extra_t)


@dataclass
class _MtpState:
    """One request's MTP progress. Entry p (at RoPE position p, local slot ``p - base`` of its blocks)
    pairs the target's hidden state at p - 1 with token p.

    Attributes:
        base: position of the entry in local slot 0 (None before the first); the target's hidden
            states before ``base - 1`` were never seen (a prefix-cache hit, a KV import).
        tokens: the tokens of the entries computed from the target's hidden states, from ``base`` on
            (drafted entries past them are stale and rewritten).
        pend_start, pending: the target's hidden states [n, hidden_size] of positions pend_start.. that
            no entry has consumed yet (None before the first step).
    """

    base: int | None = None
    tokens: list[int] = field(default_factory=list)
    pend_start: int = 0
    pending: torch.Tensor | None = None

    def append(self, start: int, rows: torch.Tensor) -> None:
        """Hidden states of positions ``start..``; a gap or a recomputation restarts the span there."""
        pending = self.pending
        if pending is None or not self.pend_start <= start <= self.pend_start + len(pending):
            self.pend_start, self.pending = start, rows.clone()
        else:
            self.pending = torch.cat([pending[: start - self.pend_start], rows])


class MtpProposer(Proposer):
    """DeepSeek-V3's multi-token-prediction module drafts: after each target step it reads the target's
    last-layer hidden states (``observe``), catches its own KV up on the tokens since (one entry per
    token: the hidden state before it and the token), then chains greedily: its output hidden state and
    the token it drafted go back into the same module for the next draft, ``k`` module forwards per step
    for all requests at once.

    The module's attention KV lives in its own paged cache (:class:`_DraftCache`, one layer per MTP
    module, per-request blocks, no prefix sharing): an MTP entry at position p needs token p and the
    target's state at p - 1, so it lags the target's KV by one token and drafted entries are rewritten
    after verification; the main pool's blocks, hashes, host tier and KV transfers stay as they are.
    Positions whose target hidden states this proposer never saw (prefix-cache hits, a PD import) are not
    attended to: the module's context then starts after them (drafts get worse, output stays exact).

    Args:
        model: the target, built with MTP modules (``mtp``, ``mtp_forward``, ``mtp_logits``,
            ``mtp_kv_cache_shape``: :class:`rayinfer.model.deepseek_v3.DeepseekV3ForCausalLM` with
            ``enable_mtp=True``); module 0 drafts every token (DeepSeek-V3 has one).
        num_blocks, block_size: its KV pool.
        vocab_size: the target's vocabulary (logits past it are ignored).
    Raises:
        ValueError: if the model has no MTP module.
    Source: DeepSeek-V3 technical report (arXiv:2412.19437) §2.2 ("MTP in inference": the modules can
    be repurposed for speculative decoding).
    """

    needs_hidden = True

    def __init__(self, model, num_blocks: int, block_size: int, vocab_size: int):
        if not len(getattr(model, "mtp", ())):
            raise ValueError(f"speculative.method=mtp needs a model with multi-token-prediction modules "
                             f"(DeepSeek-V3 loaded with them); {type(model).__name__} has none")
        weight = next(model.parameters())
        self.model, self.vocab_size, self.device = model, vocab_size, weight.device
        self.cache = _DraftCache(model.mtp_kv_cache_shape(num_blocks, block_size), block_size, weight.dtype,
                                 self.device)
        self.states: dict[str, _MtpState] = {}
        self.graphs: MtpDraftGraphs | None = None  # a step's drafts in one replay (capture_cuda_graphs)
        self.device_graphs: MtpDraftGraphs | None = None  # enable_device_drafts: the graphs, or eager buffers
        self._launched: dict[str, int] = {}  # launch_drafts: request id -> its verified rows' first position
        self._queued = None  # launch_drafts: (request ids, draft ids, probs, event) on their way to the host
        self.expected_num_tokens: dict[str, int] = {}  # observe: the token count each queued draft follows

    def capture_cuda_graphs(self, max_model_len: int, max_num_seqs: int, num_draft_tokens: int) -> None:
        """Capture a decode step's drafting (the catch-up forward over the tokens since the last step, then
        the chained one-token forwards) per padded batch size and catch-up width (CUDA only;
        :class:`MtpDraftGraphs`)."""
        self.graphs = MtpDraftGraphs(self.model, self.cache, self.vocab_size, max_model_len, max_num_seqs,
                                     num_draft_tokens)
        self.graphs.capture()

    def enable_device_drafts(self, max_model_len: int, max_num_seqs: int, num_draft_tokens: int) -> None:
        """Draft at the end of each verification step (:meth:`launch_drafts`), in the captured graphs when
        there are (call after :meth:`capture_cuda_graphs`), else eagerly on the same buffers."""
        # uncaptured on CUDA (enforce_eager): the same forwards run eagerly, with the graphs' device-side lengths
        self.device_graphs = self.graphs or MtpDraftGraphs(self.model, self.cache, self.vocab_size, max_model_len,
                                                           max_num_seqs, num_draft_tokens,
                                                           eager=self.device.type != "cuda")

    def release(self, request_id: str) -> None:
        self.cache.release(request_id)
        self.states.pop(request_id, None)
        self.expected_num_tokens.pop(request_id, None)

    @torch.inference_mode()
    def launch_drafts(self, sched: SchedulerOutput, step, num_drafts: int) -> None:
        """Queue the next step's drafts on the device at the end of a verification step, with no host sync.

        For each verified request whose module entries are current up to its last token's position p0
        (the last :meth:`propose` or device drafting caught it up), the device counts the drafts the
        target accepted (``a``: the leading ``sampled[j] == draft[j + 1]``), catches the module up on
        entries ``p0 + 1 .. p0 + a + 1`` (the target's tokens at rows ``0..a``, paired with its hidden
        states at those rows; the rows past ``a`` are padding whose cache writes are masked), and chains
        ``num_drafts`` drafts from the last entry: :meth:`MtpDraftGraphs.run_device`, the same forwards as
        :meth:`propose` makes for those tokens before the next step. The drafts and their probabilities
        are copied to pinned host memory; :meth:`take_drafts` hands them out after :meth:`observe` has
        moved each request's state past the entries made here.
        """
        self._launched, self._queued = {}, None
        graphs = self.device_graphs
        if graphs is None or step.drafts is None or step.hidden is None or step.token_ids is None:
            return
        cache = self.cache
        rows: list[_VerifiedRows] = []
        for r in _verified_rows(sched, step):
            st = self.states.get(r.rid)
            if (st is not None and st.base is not None and st.pending is not None and not len(st.pending)
                    and st.pend_start == r.p0 and st.base + len(st.tokens) == r.p0 + 1
                    and graphs.fits(len(rows) + 1, len(r.drafts) + 1)
                    and cache.reserve(r.rid, r.p0 + len(r.drafts) + 1 - st.base + num_drafts) is not None):
                rows.append(r)
        if not rows:
            return
        w = max(len(r.drafts) for r in rows) + 1
        j = np.arange(w)
        hid_rows = np.array([r.hidden_row + np.minimum(j, len(r.drafts)) for r in rows], dtype=np.int64).reshape(-1)
        tables = np.zeros((len(rows), graphs.max_blocks), dtype=np.int32)
        for e, r in enumerate(rows):
            blocks = cache.block_ids[r.rid][: graphs.max_blocks]
            tables[e, : len(blocks)] = blocks
        first_pos = np.array([r.p0 + 1 for r in rows], dtype=np.int64)
        first_local = first_pos - np.array([self.states[r.rid].base for r in rows], dtype=np.int64)
        v = _verify_on_device(step, rows, [hid_rows, first_pos, first_local, tables])
        hid_t, pos_t, local_t, tables_t = v.extra
        ids, probs = graphs.run_device(v.target, step.hidden[hid_t], pos_t, local_t, tables_t, v.accepted, num_drafts)
        self._launched = {r.rid: r.p0 for r in rows}
        self._queued = _queue_drafts([r.rid for r in rows], ids, probs)
        step.next_inputs = v.next_inputs(ids)  # last: a chained step needs the drafts queued too

    def take_drafts(self, reqs: list[Request]) -> dict[str, Draft]:
        drafts = self.take_chained()
        expected = self.expected_num_tokens  # observe: the token count each request's drafts follow
        return {r.request_id: drafts[r.request_id] for r in reqs
                if r.request_id in drafts and expected.get(r.request_id) == r.num_tokens}

    def observe(self, sched: SchedulerOutput, hidden: torch.Tensor, step_out: StepOutput,
                ended: frozenset[str] = frozenset()) -> None:
        row = 0
        launched, self._launched = self._launched, {}
        self.expected_num_tokens = {}
        for s in sched.scheduled:
            num = len(s.token_ids)
            rows, row = hidden[row: row + num], row + num
            rid = s.request_id
            if rid in ended or rid in step_out.errors or (s.num_draft_tokens and rid not in step_out.sampled):
                continue
            p0, st = launched.get(rid), self.states.get(rid)
            if p0 is not None and st is not None:  # launch_drafts made this step's entries: the state moves past them
                new = [t.token_id for t in step_out.accepted.get(rid, ())] + [step_out.sampled[rid].token_id]
                st.tokens = st.tokens[: p0 + 1 - st.base] + new
                st.pend_start, st.pending = p0 + len(new), rows[:0]
                self.expected_num_tokens[rid] = p0 + len(new) + 1
                continue
            # rows past the last accepted draft were computed over rejected tokens
            num_valid = num - s.num_draft_tokens + len(step_out.accepted.get(rid, ()))
            self.states.setdefault(rid, _MtpState()).append(s.start_pos, rows[:num_valid])

    @torch.inference_mode()
    def propose(self, reqs: list[Request], max_drafts: list[int]) -> list[Draft]:
        from rayinfer.kernels.attention_metadata import AttentionMetadata, host_arrays

        cache, model = self.cache, self.model
        drafts = [Draft([], []) for _ in reqs]
        live, chunks, prev, bases, starts = [], [], [], [], []  # starts: local slot of each chunk's first entry
        for i, (req, k) in enumerate(zip(reqs, max_drafts)):
            rid, st = req.request_id, self.states.get(req.request_id)
            tokens = req.all_token_ids
            last = len(tokens) - 1  # the entry of the last token gives the first draft
            if st is None or st.pending is None or st.pend_start + len(st.pending) < last:
                continue  # the target's state before the last token was not seen (an isolated rerun)
            num_valid = 0 if st.base is None else _common_prefix(st.tokens, tokens[st.base: st.base + len(st.tokens)])
            first = -1 if st.base is None else st.base + num_valid  # the next entry
            if st.base is None or first - 1 < st.pend_start:  # no entries yet, or a gap: start over
                st.base, num_valid, first = st.pend_start + 1, 0, st.pend_start + 1
            if first > last or cache.reserve(rid, last - st.base + k) is None:
                continue  # nothing to catch up on (cannot happen when decoding), or out of MTP blocks
            st.tokens = st.tokens[:num_valid] + tokens[first:]
            rows = st.pending[first - 1 - st.pend_start: last - st.pend_start]
            st.pend_start, st.pending = last, st.pending[:0]
            live.append(i)
            chunks.append(tokens[first:])
            prev.append(rows)
            bases.append(st.base)
            starts.append(first - st.base)
        graphs = self.graphs
        if live and graphs is not None and graphs.fits(len(live), max(len(c) for c in chunks)):
            graphs.run(drafts, live, [max_drafts[i] for i in live], chunks, prev, bases, starts,
                       [cache.block_ids[reqs[i].request_id] for i in live])
            return drafts
        num_left = {i: max_drafts[i] for i in live}  # eager: prompts' first catch-ups, batches past the graphs
        dev = self.device
        while live:
            rids = [reqs[i].request_id for i in live]
            query_lens = [len(c) for c in chunks]
            seq_lens = [s + q for s, q in zip(starts, query_lens)]
            qsl, sl, bt, slots, local = host_arrays(query_lens, seq_lens, [cache.block_ids[r] for r in rids],
                                                    cache.block_size)
            meta = AttentionMetadata(*(torch.from_numpy(a).to(dev) for a in (qsl, sl, bt, slots)), cache.block_size,
                                     query_lens, seq_lens)
            positions = local + np.repeat(np.asarray(bases, dtype=np.int64), query_lens)
            ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=dev)
            out = model.mtp_forward(ids, torch.cat(prev), torch.from_numpy(positions).to(dev), cache.kv_cache, meta)
            out = out[torch.from_numpy(qsl[1:].astype(np.int64) - 1).to(dev)]  # each request's last entry
            probs = torch.softmax(model.mtp_logits(out)[:, : self.vocab_size], dim=-1)
            top_id, keep = _append_top1(probs, drafts, live, num_left)
            live = [live[j] for j in keep]
            chunks = [[top_id[j]] for j in keep]
            prev = [out[j: j + 1] for j in keep]
            bases = [bases[j] for j in keep]
            starts = [seq_lens[j] for j in keep]
        return drafts


class MtpDraftGraphs:
    """A decode step's MTP drafting as one CUDA graph per (padded batch size, catch-up width W): the module
    forward over each request's entries since the last step (the tokens the last verification accepted,
    each paired with the target's hidden state before it; padded to W rows at the request's end, slot -1,
    as :meth:`rayinfer.engine.cuda_graph.DecodeGraphs.run_ragged` pads verification), the shared head and
    the top-1 token at each request's last entry, then S = k - 1 chained one-token forwards (the module's
    own output and its last draft back in) with positions, context lengths and cache slots advanced on the
    device. A step's drafts cost one replay and one host read instead of k eager forwards, each synced
    to the host for its token.

    Widths 1 .. k + 1 are captured (a verification accepts at most k drafts, plus the target's token). A
    request that wants fewer than k drafts (near ``max_tokens``) keeps running past its last one with its
    cache writes masked (slot -1), so nothing is written outside the blocks it reserved.

    Args:
        model: the target with MTP modules (``mtp_forward``, ``mtp_logits``); module 0 drafts.
        cache: the proposer's :class:`_DraftCache` over the modules' compressed KV.
        vocab_size: the target's vocabulary (logits past it are ignored).
        max_model_len, max_num_seqs: the longest context and the largest batch to capture.
        num_draft_tokens: k (>= 1).
        eager: run the same code on the static buffers without capturing (CPU tests).
    """

    def __init__(self, model, cache: _DraftCache, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 num_draft_tokens: int, eager: bool = False):
        from rayinfer.engine.cuda_graph import capture_sizes

        dev, dtype = cache.kv_cache.device, cache.kv_cache.dtype
        self.model, self.cache, self.vocab_size = model, cache, vocab_size
        self.num_drafts, self.num_steps, self.max_width = num_draft_tokens, num_draft_tokens - 1, num_draft_tokens + 1
        self.eager = eager
        self.sizes = capture_sizes(max_num_seqs)
        n, w = self.sizes[-1], self.max_width
        # a request's module entries span at most max_model_len + k slots of its blocks
        self.max_blocks = -(-(max_model_len + self.max_width) // cache.block_size)
        self.ids = torch.zeros(n * w, dtype=torch.long, device=dev)
        self.prev = torch.zeros(n * w, model.config.hidden_size, dtype=dtype, device=dev)
        self.positions = torch.zeros(n * w, dtype=torch.long, device=dev)
        self.slots = torch.full((n * w,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)  # the catch-up's (padded) contexts
        self.real_lens = torch.ones(n, dtype=torch.int32, device=dev)  # ... without the padding
        self.last_row = torch.zeros(n, dtype=torch.long, device=dev)  # each request's last real entry
        self.num_wanted = torch.zeros(n, dtype=torch.long, device=dev)  # chained drafts each request wants
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, device=dev)
        self.query_start_loc = {q: torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=dev)
                                for q in range(1, w + 1)}
        self.out_ids = torch.zeros(n, num_draft_tokens, dtype=torch.long, device=dev)
        self.out_probs = torch.zeros(n, num_draft_tokens, dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, num_reqs: int, width: int) -> bool:
        """Whether a step of ``num_reqs`` requests whose longest catch-up is ``width`` entries runs here."""
        return num_reqs <= self.max_batch and 1 <= width <= self.max_width

    def _meta(self, bs: int, q: int, seq: torch.Tensor, slots: torch.Tensor):
        from rayinfer.kernels.attention_metadata import AttentionMetadata

        # eager (CPU) attention reads the host lengths; a graph's split-KV is sized for the longest context
        host = seq.tolist() if self.eager else [self.max_blocks * self.cache.block_size] * bs
        return AttentionMetadata(self.query_start_loc[q][: bs + 1], seq, self.block_tables[:bs], slots,
                                 self.cache.block_size, [q] * bs, host)

    def _head(self, out: torch.Tensor, col: int, bs: int) -> torch.Tensor:
        probs = torch.softmax(self.model.mtp_logits(out)[:, : self.vocab_size], dim=-1)
        top_p, top_id = probs.max(dim=-1)
        self.out_ids[:bs, col] = top_id
        self.out_probs[:bs, col] = top_p
        return top_id

    def _draft(self, bs: int, w: int) -> None:
        model, kv, bsz = self.model, self.cache.kv_cache, self.cache.block_size
        t = bs * w
        out = model.mtp_forward(self.ids[:t], self.prev[:t], self.positions[:t], kv,
                                self._meta(bs, w, self.seq_lens[:bs], self.slots[:t]))
        last = self.last_row[:bs]
        out = out[last]
        ids = self._head(out, 0, bs)
        pos, seq = self.positions[:t][last] + 1, self.real_lens[:bs] + 1
        tables, rows, wanted = self.block_tables[:bs], self.rows[:bs], self.num_wanted[:bs]
        last_slot = self.max_blocks * bsz - 1
        for j in range(self.num_steps):
            local = (seq.long() - 1).clamp(max=last_slot)  # the new entry's slot in the request's blocks
            slot = torch.where(wanted > j, tables[rows, local // bsz].long() * bsz + local % bsz, -1)
            out = model.mtp_forward(ids, out, pos, kv, self._meta(bs, 1, seq, slot))
            ids = self._head(out, j + 1, bs)
            pos, seq = pos + 1, seq + 1

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, width), largest first, sharing one memory pool (a warm-up run before each,
        so Triton compiles outside the capture; the warm-up and capture write nothing to the cache)."""
        if self.eager:
            return
        pool = None
        self.slots.fill_(-1)
        self.num_wanted.zero_()
        self.last_row.zero_()
        for w in range(1, self.max_width + 1):
            self.seq_lens.fill_(w)
            for bs in reversed(self.sizes):
                self._draft(bs, w)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._draft(bs, w)
                pool = graph.pool()
                self.graphs[(bs, w)] = graph
        torch.cuda.synchronize()
        logger.info("captured MTP drafting graphs (%d drafts, catch-ups of 1..%d entries) for batch sizes %s",
                    self.num_drafts, self.max_width, self.sizes)

    def run_device(self, ids: torch.Tensor, prev: torch.Tensor, first_pos: torch.Tensor, first_local: torch.Tensor,
                   tables: torch.Tensor, accepted: torch.Tensor, wanted: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`run` with inputs that are still on the device (a verification step in flight): each request's
        catch-up entries are its ``w`` rows, of which the first ``accepted + 1`` are real.

        Args:
            ids: [n, w] int64, the entries' tokens; prev: [n * w, hidden_size], the target's hidden states
                before them; first_pos, first_local: [n] int64, the RoPE position and the local slot of each
                request's first entry; tables: [n, max_blocks] int32, its blocks in the module's cache
                (reserved for ``accepted + wanted`` more entries); accepted: [n] int64, at most ``w - 1``;
                wanted: drafts per request (at most k).
        Returns:
            draft ids [n, wanted] int64 and their top-1 probabilities [n, wanted] float32 (new tensors).
        """
        n, w = ids.shape
        bs = next(size for size in self.sizes if size >= n)
        bsz, dev = self.cache.block_size, ids.device
        j = torch.arange(w, device=dev)
        local = first_local[:, None] + j
        slots = tables.long().gather(1, (local // bsz).clamp(max=self.max_blocks - 1)) * bsz + local % bsz
        slots = torch.where(j <= accepted[:, None], slots, -1)
        t = n * w
        self.ids[: bs * w].zero_()
        self.ids[:t] = ids.reshape(-1)
        self.prev[: bs * w].zero_()
        self.prev[:t] = prev
        self.positions[: bs * w].zero_()
        self.positions[:t] = (first_pos[:, None] + j).reshape(-1)
        self.slots[: bs * w].fill_(-1)
        self.slots[:t] = slots.reshape(-1)
        self.block_tables[:bs].zero_()
        self.block_tables[:n] = tables
        self.seq_lens[:bs].fill_(w)
        self.seq_lens[:n] = (first_local + w).to(torch.int32)
        self.real_lens[:bs].fill_(1)
        self.real_lens[:n] = (first_local + accepted + 1).to(torch.int32)
        self.last_row[:bs] = self.rows[:bs] * w
        self.last_row[:n] += accepted
        self.num_wanted[:bs].zero_()
        self.num_wanted[:n] = min(max(wanted - 1, 0), self.num_steps)
        if self.eager or (bs, w) not in self.graphs:
            self._draft(bs, w)
        else:
            self.graphs[(bs, w)].replay()
        take = min(wanted, self.num_drafts)
        return self.out_ids[:n, :take].clone(), self.out_probs[:n, :take].clone()

    def run(self, drafts: list[Draft], live: list[int], wanted: list[int], chunks: list[list[int]],
            prev: list[torch.Tensor], bases: list[int], starts: list[int], tables: list[list[int]]) -> None:
        """Draft for the requests ``live`` (indexes into ``drafts``): append each one's ``wanted`` (at most k)
        tokens and probabilities.

        Args:
            chunks: each request's catch-up tokens (the entries since its last step; :meth:`fits`).
            prev: per request [len(chunk), hidden_size], the target's hidden states before those tokens.
            bases: the RoPE position of each request's local slot 0; starts: the local slot of its chunk's
                first entry; tables: its block ids in the module's cache (reserved for ``wanted`` drafts).
        """
        from rayinfer.kernels.attention_metadata import host_arrays

        n = len(live)
        q = [len(c) for c in chunks]
        w = max(q)
        bs = next(size for size in self.sizes if size >= n)
        real_lens = [s + k for s, k in zip(starts, q)]
        # the real entries' slots as the eager loop computes them; rows: their places in the padded layout
        _, _, table, slots, _ = host_arrays(q, real_lens, tables, self.cache.block_size)
        rows = np.concatenate([r * w + np.arange(k) for r, k in enumerate(q)])
        padded_ids, padded_slots = np.zeros(bs * w, dtype=np.int64), np.full(bs * w, -1, dtype=np.int64)
        padded_ids[rows] = [t for c in chunks for t in c]
        padded_slots[rows] = slots
        padded_table = np.zeros((bs, self.max_blocks), dtype=np.int32)
        width = min(table.shape[1], self.max_blocks)
        padded_table[:n, :width] = table[:, :width]
        pad = bs - n  # padding requests: one entry, no cache write, no draft wanted
        first = np.array([b + s for b, s in zip(bases, starts)] + [0] * pad, dtype=np.int64)
        host = {"ids": padded_ids, "positions": (first[:, None] + np.arange(w)[None, :]).reshape(-1),
                "slots": padded_slots, "block_tables": padded_table,
                "seq_lens": np.array([s + w for s in starts] + [w] * pad, dtype=np.int32),
                "real_lens": np.array(real_lens + [1] * pad, dtype=np.int32),
                "last_row": np.arange(bs) * w + np.array(q + [1] * pad) - 1,
                "num_wanted": np.clip(np.array(wanted + [0] * pad) - 1, 0, self.num_steps)}
        for name, values in host.items():
            buf = getattr(self, name)
            buf[: len(values)].copy_(torch.from_numpy(np.ascontiguousarray(values)).to(buf.dtype), non_blocking=True)
        self.prev[: bs * w].zero_()
        self.prev[torch.from_numpy(rows).to(self.ids.device)] = torch.cat(prev)
        if self.eager or (bs, w) not in self.graphs:
            self._draft(bs, w)
        else:
            self.graphs[(bs, w)].replay()
        out_ids, out_probs = self.out_ids[:n].tolist(), self.out_probs[:n].tolist()  # one read for the step
        for r, i in enumerate(live):
            take = min(wanted[r], self.num_drafts)
            drafts[i].token_ids.extend(out_ids[r][:take])
            assert drafts[i].probs is not None
            drafts[i].probs.extend(out_probs[r][:take])


def _append_top1(probs: torch.Tensor, drafts, live: list[int],
                 num_left: dict[int, int]) -> tuple[list[int], list[int]]:
    """One greedy draft step for the ``live`` requests (row j of ``probs`` [len(live), vocab] is request
    ``live[j]``): append each row's top-1 token and its probability to its draft and count it off
    ``num_left``. Returns the top-1 ids (per row) and the rows whose requests still want drafts."""
    top_p, top_id = probs.max(dim=-1)
    top_p, top_id = top_p.tolist(), top_id.tolist()
    keep = []
    for j, i in enumerate(live):
        d = drafts[i]
        d.token_ids.append(top_id[j])
        assert d.probs is not None
        d.probs.append(top_p[j])
        num_left[i] -= 1
        if num_left[i] > 0:
            keep.append(j)
    return top_id, keep

def _queue_drafts(rids: list[str], ids: torch.Tensor, probs: torch.Tensor | None = None) -> tuple:
    """What ``launch_drafts`` keeps of the drafts it queued: ``(rids, ids, probs, event)`` (``probs`` None for a
    drafter without probabilities: prompt lookup), on CUDA copied to pinned host memory without waiting and the
    event recorded after the copy (None elsewhere)."""
    if ids.device.type != "cuda":
        return rids, ids, probs, None
    ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True).copy_(ids, non_blocking=True)
    if probs is not None:
        probs = torch.empty(probs.shape, dtype=probs.dtype, pin_memory=True).copy_(probs, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return rids, ids, probs, event


def _queued_drafts(queued) -> dict[str, Draft]:
    """Drafts a proposer's ``launch_drafts`` queued, ``(request ids, ids [n, k], probs [n, k] or None, event)``,
    on the host by request id (waits for their copy: the event, recorded after it on CUDA)."""
    rids, ids, probs, event = queued
    if event is not None:
        event.synchronize()
    if probs is None:
        return {rid: Draft(d) for rid, d in zip(rids, ids.tolist())}
    return {rid: Draft(d, p) for rid, d, p in zip(rids, ids.tolist(), probs.tolist())}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class AcceptanceCalibrator:
    """Turns drafter probabilities into confidences: the chance a draft is accepted given the drafts
    before it, measured online per bin of the drafter's top-1 probability (per draft position for
    drafters without probabilities), Laplace-smoothed; a draft's confidence is the running product of
    those up to it.

    A drafter's top-1 probability is the acceptance chance of a draft only under sampling at the
    drafter's temperature; greedy targets accept whenever the argmaxes agree, so raw probabilities are
    mapped through what verification measured.

    Args:
        max_drafts: draft positions.
        num_bins: bins of [0, 1] for the top-1 probability.
    """

    def __init__(self, max_drafts: int, num_bins: int = 10):
        self.num_bins = num_bins
        self.accepted = np.zeros(num_bins + max_drafts)
        self.verified = np.zeros(num_bins + max_drafts)

    def _keys(self, num: int, probs: list[float] | None) -> np.ndarray:
        if probs is None:
            return self.num_bins + np.arange(num)
        return np.minimum((np.asarray(probs[:num]) * self.num_bins).astype(np.int64), self.num_bins - 1)

    def confidence(self, draft: Draft) -> list[float]:
        """Per draft of ``draft``, the estimated chance that it and every draft before it are accepted."""
        keys = self._keys(len(draft.token_ids), draft.probs)
        return np.cumprod((self.accepted[keys] + 1) / (self.verified[keys] + 2)).tolist()

    def record(self, probs: list[float] | None, num_verified: int, num_accepted: int) -> None:
        """Fold in one verification: drafts up to the first rejected one were observed."""
        num_seen = min(num_accepted + 1, num_verified)
        keys = self._keys(num_seen, probs)
        np.add.at(self.verified, keys, 1)
        np.add.at(self.accepted, keys[:num_accepted], 1)


class StepTimeModel:
    """The cost of a step as ``a + b * num_tokens`` seconds, fit by least squares with exponential
    forgetting over measured step times (the closed loop of DeepInfer's scheduler, which corrects its
    plans from measured forward and sampler times).

    Args:
        decay: weight of the past per new sample, in (0, 1).
        a, b: the prior (seconds, seconds per token) until two distinct token counts were measured.
    """

    def __init__(self, decay: float = 0.95, a: float = 1.0, b: float = 0.01):
        self.decay, self.a, self.b = decay, a, b
        self._sums = np.zeros(5)  # w, w*n, w*n*n, w*t, w*n*t

    def update(self, num_tokens: int, seconds: float) -> None:
        """Fold in one step of ``num_tokens`` tokens that took ``seconds``."""
        n, t = float(num_tokens), float(seconds)
        self._sums = self._sums * self.decay + np.array([1.0, n, n * n, t, n * t])
        w, sn, snn, st, snt = self._sums
        det = w * snn - sn * sn
        if det > 1e-9 * max(w * snn, 1.0):
            b = (w * snt - sn * st) / det
            a = (st - b * sn) / w
            self.b = max(b, 1e-7)
            self.a = max(a, 0.0)
        elif w > 0:
            self.a = max(st / w - self.b * sn / w, 0.0)


class SpeculationGate:
    """Whether a pure-decode step speculates at all (``schedule="confidence"``): the closed loop compares
    the output tokens per second that speculative and plain decode steps measured at this batch size.

    Drafting and verification have a fixed cost per step (the proposer's host work, a wider forward, a
    drained pipeline) that the per-draft schedule (:func:`choose_num_drafts`) cannot see, since every step
    it times speculates. At large batches a decode step is bound by its weights and not by its token
    count, so the extra tokens are cheap but the fixed costs are not, and speculation can lose to plain
    decoding. The gate keeps a decaying average of each mode's measured output rate per power-of-two batch
    bucket and takes the faster mode.

    It runs the slower mode again to keep both measurements fresh (the measure-and-correct loop of
    DeepInfer's scheduler), by regret: a step of the slower mode loses ``step_s * (1 - slow_rate /
    fast_rate)`` seconds against the faster mode (the time its tokens would have taken at the faster
    rate), and the slower mode runs for ``explore_steps`` steps once the bucket has spent
    ``1 / explore_fraction`` of their regret since it last ran. Exploring so loses about
    ``explore_fraction`` of the time at most, however the two modes compare: two close modes re-measure
    each other every few steps (a bucket whose acceptance changes mid-run switches soon), a drafting
    step that costs ten plain ones only every few hundred. Several steps at a time let the pipeline of
    plain steps refill and average out n-gram steps that find no draft. A re-measurement also switches
    modes twice, and a switch costs time of its own that neither mode's rate shows apart (the pipeline of
    plain steps drained and refilled, a drafter catching up on the plain steps' tokens): the regret counts
    ``switch_steps`` of the faster mode's steps besides. Without it, two modes measured close (at the 8B
    shape on the H100, plain steps at 13 ms in a confidence engine re-measuring n-gram every few steps,
    against 9.7 ms in steps left alone) re-measured each other so often that the switches made them close
    (the engine's accounting then also charged the wait for a drafting step still in flight to the plain call
    after it, which made plain steps between drafting ones look slower; see ``LLMEngine._flush_gate_sample``).

    A proposer whose drafts depend on the text (n-gram lookup) may find none early in a request's output
    and many later (once it starts to repeat or quote its prompt), so a rate measured then goes stale in a
    way the regret schedule repairs only slowly. The engine tells the gate how many drafts a request the
    proposer finds (:meth:`note_drafts`): drafting steps record it beside their rate, and where a plain step's
    lookup finds at least twice as many (plus a quarter draft a request) while plain decoding is the faster
    mode, speculation's measurement is dropped and re-taken at once (``explore_steps`` steps at least).

    Measurements (:meth:`record`, :meth:`charge`): tokens count for the mode of the step that computed
    them, and so does the time a call spent processing that step (on a GPU, the wait for it); the rest of a
    call's time counts for the mode of the call; the engine charges the refill of the pipeline after a
    drafting step to speculation. The first ``warmup_steps`` steps of each mode and bucket are not
    measured (compiles, first graph replays). Averages decay per step of that mode (``decay``), over
    tokens and seconds apart, so a pipelined call that returned nothing yet is no zero rate.

    Args:
        explore_fraction: share of a bucket's time the slower mode's regret may take, in (0, 1).
        decay: weight of the past per new step, in [0, 1).
        explore_steps: steps of the slower mode per re-measurement (>= 1).
        warmup_steps: unmeasured first steps of each mode and bucket (>= 0).
        switch_steps: what one re-measurement's switches cost, in steps of the faster mode (>= 0).
    Raises:
        ValueError: for an argument out of range.
    """

    def __init__(self, explore_fraction: float = 0.03, decay: float = 0.9, explore_steps: int = 4,
                 warmup_steps: int = 2, switch_steps: float = 2.0):
        if not 0.0 < explore_fraction < 1.0:
            raise ValueError(f"explore_fraction must be in (0, 1), got {explore_fraction}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if explore_steps < 1:
            raise ValueError(f"explore_steps must be >= 1, got {explore_steps}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if switch_steps < 0:
            raise ValueError(f"switch_steps must be >= 0, got {switch_steps}")
        self.switch_steps = switch_steps
        self.explore_fraction, self.decay = explore_fraction, decay
        self.explore_steps, self.warmup_steps = explore_steps, warmup_steps
        self._sums: dict[tuple[bool, int], list[float]] = {}  # (speculative, bucket) -> [tokens, s, steps]
        self._warm: dict[tuple[bool, int], int] = {}  # unmeasured steps so far, up to warmup_steps
        self._since: dict[int, float] = {}  # bucket -> seconds of its steps since its slower mode last ran
        self._exploring: dict[int, tuple[bool, int]] = {}  # bucket -> (mode re-measured, steps left)
        self._explored: dict[int, bool] = {}  # bucket -> whether its last step re-measured the slower mode
        self.num_plain_steps = 0  # decode steps the gate kept plain (engine stats)
        self.num_drafting_steps = 0  # decode steps the gate let draft
        self.num_explore_steps = 0  # steps of the slower mode, to re-measure it
        self._drafts: dict[int, float] = {}  # bucket -> drafts a request found where speculation was measured
        self.num_draft_triggers = 0  # re-measurements of speculation that more drafts found in plain steps set off
        self.seconds = {False: 0.0, True: 0.0}  # seconds recorded per mode (engine stats)

    @property
    def rates(self) -> dict[tuple[bool, int], float]:
        """Measured output tokens per second by (speculative, batch bucket)."""
        return {k: tokens / seconds for k, (tokens, seconds, _) in self._sums.items() if seconds > 0}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(int(batch_size), 1).bit_length()

    def speculate(self, batch_size: int) -> bool:
        """Whether the next decode step of ``batch_size`` requests should draft and verify. Unmeasured
        modes are tried first: speculation, then plain decoding."""
        b = self.bucket(batch_size)
        rates = self.rates
        spec, plain = rates.get((True, b)), rates.get((False, b))
        self._explored[b] = False
        if spec is None or plain is None:
            choice = spec is None
        else:
            fast = spec >= plain
            mode, left = self._exploring.pop(b, (fast, 0))
            if mode != fast and left > 0:  # re-measuring the slower mode: its next step
                choice = mode
                if left > 1:
                    self._exploring[b] = (mode, left - 1)
                self.num_explore_steps += 1
                self._explored[b] = True
            else:
                slow_rate, fast_rate = (plain, spec) if fast else (spec, plain)
                _, secs, steps = self._sums[(not fast, b)]
                _, fast_secs, fast_steps = self._sums[(fast, b)]
                regret = (self.explore_steps * secs / steps * (1.0 - slow_rate / fast_rate)
                          + self.switch_steps * fast_secs / fast_steps)
                choice = fast
                if self._since.get(b, 0.0) * self.explore_fraction >= regret:
                    choice = not fast
                    self._since[b] = 0.0
                    self.num_explore_steps += 1
                    self._explored[b] = True
                    if self.explore_steps > 1:
                        self._exploring[b] = (choice, self.explore_steps - 1)
        if choice:
            self.num_drafting_steps += 1
        else:
            self.num_plain_steps += 1
        return choice

    def record(self, speculative: bool, batch_size: int, num_output_tokens: int, seconds: float,
               other_tokens: int = 0, other_seconds: float = 0.0) -> None:
        """Fold in one decode call of ``batch_size`` requests in the mode :meth:`speculate` chose (or the
        wait for a step of that mode, drained; or the part of a call that processed a pipelined step of this
        mode): ``seconds`` it took (host and device: proposing, scheduling, the forward, sampling),
        ``num_output_tokens`` that steps of this mode gave back in it, and ``other_tokens`` tokens and
        ``other_seconds`` seconds of the other mode in the same call, credited to that mode (added to its
        measurement, once it has one, without counting a step)."""
        if batch_size <= 0:
            return
        b = self.bucket(batch_size)
        other_seconds = max(other_seconds, 0.0)
        if (other_tokens or other_seconds) and (not speculative, b) in self._sums:
            sums = self._sums[(not speculative, b)]
            sums[0] += other_tokens
            sums[1] += other_seconds
            self.seconds[not speculative] += other_seconds
        if seconds <= 0:
            return
        key = (speculative, b)
        self.seconds[speculative] += seconds
        if self._warm.get(key, 0) < self.warmup_steps:  # a mode's first steps may pay one-time costs
            self._warm[key] = self._warm.get(key, 0) + 1
            return
        if not self._explored.get(b):  # the regret budget grows with the faster mode's time only
            self._since[b] = self._since.get(b, 0.0) + seconds
        sums = self._sums.get(key)
        if sums is None:
            self._sums[key] = [float(num_output_tokens), seconds, 1.0]
        else:
            d = self.decay
            sums[0], sums[1], sums[2] = d * sums[0] + num_output_tokens, d * sums[1] + seconds, d * sums[2] + 1

    def note_drafts(self, speculative: bool, batch_size: int, drafts_per_request: float) -> None:
        """How many drafts a request the proposer found for a decode step of ``batch_size`` requests (the
        mean over the requests that may draft): a drafting step's (``speculative``) is kept beside its rate
        (an average over its last steps); a plain step's lookup that finds at least ``2 x + 0.25`` of that,
        where plain decoding is the faster mode, drops speculation's measurement of this batch size so that
        the next steps re-measure it (``explore_steps`` of them, at least)."""
        b = self.bucket(batch_size)
        last = self._drafts.get(b)
        if speculative:
            self._drafts[b] = drafts_per_request if last is None else 0.5 * (last + drafts_per_request)
            return
        if last is None or drafts_per_request < 2.0 * last + 0.25:
            return
        rates = self.rates
        spec, plain = rates.get((True, b)), rates.get((False, b))
        if spec is None or plain is None or spec >= plain:
            return
        del self._sums[(True, b)]  # measured on text where the proposer found fewer drafts
        self._exploring[b] = (True, self.explore_steps)
        self._drafts[b] = drafts_per_request
        self.num_draft_triggers += 1

    def charge(self, speculative: bool, batch_size: int, seconds: float) -> None:
        """Add ``seconds`` to a mode's time without a step (the engine charges speculation the refill of
        the pipeline after a drafting step: the next plain step's host work, which nothing overlapped)."""
        key = (speculative, self.bucket(batch_size))
        if seconds > 0 and key in self._sums:
            self.seconds[speculative] += seconds
            self._since[key[1]] = self._since.get(key[1], 0.0) + seconds
            self._sums[key][1] += seconds


def choose_num_drafts(confidence: torch.Tensor, num_base_tokens: int, base_tokens_out: float, a: float, b: float,
                      max_verify_tokens: int, min_confidence: float) -> torch.Tensor:
    """How many drafts of each request to verify so that expected output tokens per second is highest.

    A draft with confidence c adds c expected tokens and costs ``b`` seconds; drafts are taken in
    decreasing confidence while the rate ``(base_tokens_out + sum c) / (a + b * (num_base_tokens + m))``
    grows (it rises then falls, as c falls), at most ``max_verify_tokens`` and none below
    ``min_confidence``. Pure torch ops on ``confidence``'s device (no host sync).

    Args:
        confidence: [B, K] float32, per request the running product of its drafts' confidences
            (non-increasing along K; 0 where there is no draft).
        num_base_tokens: tokens the step computes without drafts.
        base_tokens_out: tokens the step emits without drafts (one per decoding request).
        a, b: the step time model (seconds, seconds per token).
        max_verify_tokens: verified drafts per step at most.
        min_confidence: drafts below it are never verified.
    Returns:
        [B] int64 on ``confidence``'s device, each in [0, K] (a prefix of the request's drafts).
    """
    batch, k = confidence.shape
    if batch * k == 0:
        return torch.zeros(batch, dtype=torch.long, device=confidence.device)
    flat = confidence.reshape(-1).float()
    order = flat.argsort(descending=True, stable=True)
    ranked = flat[order]
    m = torch.arange(1, ranked.numel() + 1, device=flat.device, dtype=torch.float32)
    rate = (base_tokens_out + ranked.cumsum(0)) / (a + b * (num_base_tokens + m))
    base_rate = base_tokens_out / (a + b * num_base_tokens)
    best = torch.cat([torch.tensor([base_rate], device=flat.device, dtype=torch.float32), rate])
    best = best[: max_verify_tokens + 1]
    num_take = best.argmax()  # drafts taken: the top num_take
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(order.numel(), device=flat.device)
    keep = (ranks < num_take) & (flat >= min_confidence) & (flat > 0)
    return keep.reshape(batch, k).sum(dim=1)


class SpecStats:
    """Counters of speculative decoding (engine stats, Prometheus, benchmark JSON).

    Attributes:
        num_drafts_proposed: draft tokens the proposer made.
        num_drafts_verified: draft tokens computed in a target forward.
        num_drafts_accepted: verified drafts the target accepted.
        num_verify_steps: request-steps that verified at least one draft.
        accepted_by_position / verified_by_position: per draft position j (0-based), drafts accepted /
            verified there.
    """

    def __init__(self, max_drafts: int):
        self.num_drafts_proposed = 0
        self.num_drafts_verified = 0
        self.num_drafts_accepted = 0
        self.num_verify_steps = 0
        self.accepted_by_position = [0] * max_drafts
        self.verified_by_position = [0] * max_drafts

    def record(self, num_verified: int, num_accepted: int) -> None:
        if not num_verified:
            return
        self.num_verify_steps += 1
        self.num_drafts_verified += num_verified
        self.num_drafts_accepted += num_accepted
        for j in range(num_verified):
            self.verified_by_position[j] += 1
            if j < num_accepted:
                self.accepted_by_position[j] += 1

    def to_dict(self) -> dict:
        verified, steps = self.num_drafts_verified, self.num_verify_steps
        return {
            "spec_num_drafts_proposed": self.num_drafts_proposed,
            "spec_num_drafts_verified": verified,
            "spec_num_drafts_accepted": self.num_drafts_accepted,
            "spec_num_verify_steps": steps,
            "spec_acceptance_rate": self.num_drafts_accepted / verified if verified else 0.0,
            # tokens emitted per verifying request-step: accepted drafts + the target's own token
            "spec_mean_accepted_length": 1 + self.num_drafts_accepted / steps if steps else 0.0,
            "spec_acceptance_by_position": [a / v if v else 0.0 for a, v in
                                            zip(self.accepted_by_position, self.verified_by_position)],
        }
