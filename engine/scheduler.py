"""Continuous-batching scheduler: token budget, chunked prefill, prefix hits, preemption by recompute.

There are no prefill and decode phases. Each step every running request is given some of the tokens it
knows but has not computed (``num_tokens - num_computed_tokens``) under a shared token budget; a new
prompt, a chunk of a long prompt, and a one-token decode are the same rule. Pure CPU and deterministic:
tests drive it without a model. After vLLM v1's scheduler.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

from rayinfer.engine.kv_cache_manager import KVCacheManager
from rayinfer.engine.types import (
    PLACEHOLDER,
    ContextParallelPrefill,
    EngineRole,
    Request,
    RequestStatus,
    ScheduledRequest,
    SchedulerOutput,
    StepOutput,
)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one replica's scheduler.

    Attributes:
        max_num_seqs: running requests at most.
        max_num_batched_tokens: new tokens per step at most (the token budget).
        max_model_len: context limit (prompt + output tokens).
        block_size: tokens per KV block.
        num_blocks: KV blocks in the pool.
        enable_prefix_caching: share full prompt blocks between requests.
        enable_chunked_prefill: split prompts longer than the budget over several steps.
        role: the replica's :class:`EngineRole`.
        num_host_blocks: blocks of the host-memory KV tier (0: none; see ``engine.host_kv_cache``).
        sliding_window: W of a model's sliding-window layers, which then keep a KV group of their own
            (``engine.kv_cache_manager``); None: full attention only.
        num_local_blocks: blocks of that group's pool.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    role: EngineRole = EngineRole.NORMAL
    num_host_blocks: int = 0
    sliding_window: int | None = None
    num_local_blocks: int = 0

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")


class Scheduler:
    """Decides, each step, which requests compute how many tokens, and applies the sampled tokens."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                 config.num_host_blocks, config.sliding_window, config.num_local_blocks)
        self.num_replayed_tokens = 0  # tokens recomputed for the sliding layers only (bounded replay)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.handed_back: list[Request] = []  # DECODE role: preempted requests for the router to re-prefill

    # -- admission and removal ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request (validated by the engine). Raises ValueError on a duplicate id."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """End requests (abort, stop string, error): free their blocks and forget them."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            if req.block_ids:
                self.kv.free(req)
            req.status = status
            del self.requests[rid]
            self._finished_ids.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- the step ------------------------------------------------------------------------------
    def pending_work(self) -> tuple[int, int]:
        """(prompt tokens still to compute, requests that would decode one token): the two counts of a
        data-parallel rank's step vote (``rayinfer.policy.routing.StepVote``)."""
        num_prefill_tokens = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        num_decode = 0
        for r in self.running:
            num_left = r.num_tokens - r.num_computed_tokens
            if _is_decode(r, num_left):
                num_decode += 1
            else:
                num_prefill_tokens += max(num_left, 0)
        return num_prefill_tokens, num_decode

    def schedule(self, step_kind: str | None = None) -> SchedulerOutput:
        """Plan one step. Side effects: allocates blocks, advances ``num_computed_tokens`` of every
        scheduled request, moves admitted requests to running and preempted ones back to waiting.

        Args:
            step_kind: None plans all work (chunked prefill mixes prompt chunks and decodes in one
                step); "prefill" only prompt work (admissions and partly computed prompts); "decode"
                only one-token decodes; "idle" nothing. Data-parallel ranks whose MoE layers run
                collectives agree on the kind by a vote (``rayinfer.policy.routing.vote_step_kind``).
        Raises:
            ValueError: for another step_kind.
        """
        if step_kind not in (None, "prefill", "decode", "idle"):
            raise ValueError(f"step_kind must be None, prefill, decode or idle; got {step_kind!r}")
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        planned: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        running, kv = self.running, self.kv
        has_drafts = False
        chunked, prefill_role = cfg.enable_chunked_prefill, cfg.role == EngineRole.PREFILL
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_left = num_known_left = req.num_tokens - req.num_computed_tokens
            if req.draft_token_ids:  # speculative: verify the last token's drafts in the same forward
                num_left += self._num_drafts(req, num_left, budget)
                has_drafts = True
            num_new = min(num_left, budget)
            if num_new <= 0 or (not chunked and num_new < num_left):
                i += 1
                continue
            if prefill_role and req.num_pending_tokens:
                i += 1  # its in-flight token ends the prefill (async scheduling): never decode here
                continue
            if step_kind is not None and (step_kind == "idle" or (step_kind == "decode") != _is_decode(req, num_known_left)):
                i += 1  # not this step's kind
                continue
            while kv.allocate_slots(req, num_new) is None:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            planned.append((req, num_new))
            budget -= num_new
            i += 1

        imports = []
        admit = step_kind in (None, "prefill")
        while admit and not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            cp_hit = 0  # a context-parallel prefill's tokens found in the prefix cache
            host_slots: list[int] | None = None  # host-tier slots after the device hits, once matched (pinned)
            if req.kv_handle is not None:  # PD import or stored prefix: the handle's tokens arrive computed
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
                cp = req.kv_handle.payload if isinstance(req.kv_handle.payload, ContextParallelPrefill) else None
                if num_hit >= req.kv_handle.num_tokens:  # the local prefix cache already covers it
                    req.kv_handle = None
                elif cp is not None and num_hit and req.kv_handle.num_tokens - num_hit < cp.min_tokens:
                    req.kv_handle = None  # too little left for CP: computed here after the hit
                elif cp is not None and num_hit:  # CP covers the rest; the hit's blocks come first
                    handle = req.kv_handle = replace(req.kv_handle, payload=replace(cp, num_cached=num_hit))
                    cp_hit, num_hit = num_hit, handle.num_tokens
                elif len(hit_blocks) < (skip := req.kv_handle.first_block):
                    # the blocks the payload leaves out that the device pool no longer holds load from the
                    # host tier; evicted from both, the handle is dropped and the prompt computed past the hit
                    host_slots = self.kv.match_host(req, len(hit_blocks))
                    if len(hit_blocks) + len(host_slots) < skip:
                        req.kv_handle = None
                    else:
                        host_slots, num_hit = host_slots[: skip - len(hit_blocks)], req.kv_handle.num_tokens
                else:  # the payload's blocks follow the cached ones it leaves out
                    hit_blocks, num_hit = hit_blocks[: req.kv_handle.first_block], req.kv_handle.num_tokens
            elif req.num_computed_tokens:
                hit_blocks, num_hit = [], 0
            else:
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            if host_slots is None:
                host_slots = (self.kv.match_host(req, len(hit_blocks))
                              if req.kv_handle is None and not req.num_computed_tokens else [])
            if req.kv_handle is None:  # a kept handle's tokens count its host slots already
                num_hit += len(host_slots) * cfg.block_size
            # bounded replay: a hit restores the full-attention layers' KV only; the sliding layers'
            # KV of the hit's last W - 1 tokens is recomputed in the same forward as the rest
            num_replay = self.kv.num_replay_tokens(num_hit)
            num_new = req.num_tokens - req.num_computed_tokens - num_hit + num_replay
            if num_new > budget and not cfg.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            start = req.num_computed_tokens + num_hit - num_replay
            req.num_computed_tokens = start
            first_pos = None if not num_replay else start + self.kv.sliding_window - 1  # keys from start on
            if self.kv.allocate_slots(req, num_new, hit_blocks, first_pos) is None:
                req.num_computed_tokens -= num_hit - num_replay
                break
            if self.kv.local_pool is not None:
                req.local_kv_start, req.replay_end = start, start + num_replay
            self.waiting.popleft()
            if host_slots:  # host-tier hits: fresh device blocks right after the device hits, loaded back
                self.kv.add_loads(host_slots, req.block_ids[len(hit_blocks) : len(hit_blocks) + len(host_slots)])
            computed_here = False  # a context-parallel prefill: its tokens are computed, not cache hits
            if req.kv_handle is not None:
                num_import_blocks = self.kv.blocks_needed(num_hit)
                imports.append((req.request_id, tuple(req.block_ids[req.kv_handle.first_block : num_import_blocks]),
                                req.kv_handle))
                computed_here = isinstance(req.kv_handle.payload, ContextParallelPrefill)
                req.kv_handle = None
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = cp_hit if computed_here else num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            planned.append((req, num_new))
            budget -= num_new

        scheduled = []
        for req, num_new in planned:
            start = req.num_computed_tokens
            end = req.num_computed_tokens = start + num_new
            num_drafts = max(end - req.num_tokens, 0)
            known = req.known_token_ids(start, end - num_drafts)
            if len(known) < num_new - num_drafts:  # tokens an in-flight step sampled: the model runner fills them on the device
                known += [PLACEHOLDER] * (num_new - num_drafts - len(known))
            if num_drafts:
                known += req.draft_token_ids[:num_drafts]
            needs_sample = end >= req.num_tokens
            num_replay = max(0, min(end, req.replay_end) - start)
            self.num_replayed_tokens += num_replay
            scheduled.append(ScheduledRequest(
                request_id=req.request_id,
                token_ids=tuple(known),
                start_pos=start,
                block_ids=tuple(req.block_ids),
                needs_sample=needs_sample,
                num_draft_tokens=num_drafts,
                local_block_ids=None if self.kv.local_pool is None else tuple(req.local_block_ids),
                num_replay_tokens=num_replay,
                local_kv_start=req.local_kv_start,
            ))
            if needs_sample:
                req.num_pending_tokens += 1 + num_drafts
        if has_drafts:
            for req in running:
                req.draft_token_ids = []  # drafts live one step: verified now or dropped
        return self._plan(scheduled, tuple(r.request_id for r in preempted), tuple(imports))

    def _plan(self, scheduled: list[ScheduledRequest], preempted_ids: tuple[str, ...] = (), imports: tuple = (),
              chained: bool = False) -> SchedulerOutput:
        """A step's :class:`SchedulerOutput`, with the ids finished since the last plan and the host-tier copies
        the planning queued (both taken here)."""
        finished, self._finished_ids = tuple(self._finished_ids), []
        offloads, loads = self.kv.take_transfers()
        return SchedulerOutput(tuple(scheduled), preempted_ids, finished, imports, offloads, loads, chained=chained)

    def schedule_chained(self, num_drafts: int) -> SchedulerOutput | None:
        """Plan a verification step of every running request behind the verification step still in flight
        (pipelined speculative decoding), or return None (and change nothing) where it cannot be planned:
        requests waiting while ``max_num_seqs`` leaves room for one (at the limit, the queue waits for a
        request to finish, as it would anyway), a request that is not decoding, needs host state to sample
        (grammar, penalties, min_tokens unmet), has less than ``num_drafts + 1`` tokens of room before the
        context limit counting the in-flight step's drafts as accepted, or too few free blocks.
        ``max_tokens`` is no limit: :meth:`update_from_output` drops what a step samples past it, as past a
        stop.

        Each request verifies ``num_drafts`` drafts that the in-flight step's drafter leaves on the device.
        The plan assumes the in-flight step accepts all its drafts: ``start_pos`` is the position after
        them and blocks are allocated up to there plus this step's ``num_drafts + 1`` tokens; the model runner
        moves the positions back on the device by what it did not accept, and :meth:`update_from_output` of
        the two steps rolls ``num_computed_tokens`` back by the drafts each rejected. No preemption, no
        prefill, no host-tier loads; a sliding-window KV group is not supported (None).

        Returns:
            a :class:`SchedulerOutput` with ``chained`` set: per request ``num_drafts + 1`` placeholder
            tokens, ``num_draft_tokens = num_drafts``.
        """
        from rayinfer.engine.sampler import needs_host_state

        kv, cfg, q = self.kv, self.config, num_drafts + 1
        if not self.running or self.kv.local_pool is not None or num_drafts < 1:
            return None
        if self.waiting and len(self.running) < cfg.max_num_seqs:  # one could be admitted: not past it
            return None
        if q * len(self.running) > cfg.max_num_batched_tokens:
            return None
        num_blocks = 0
        for req in self.running:
            # max_tokens is no limit here: the tokens past it are dropped when the step is processed (as past a
            # stop), so requests of different lengths keep chaining to their ends
            room = cfg.max_model_len - req.num_tokens - 1
            if (req.num_tokens - req.num_computed_tokens != 1 or req.num_computed_tokens < req.num_prompt_tokens
                    or needs_host_state(req) or room < num_drafts):
                return None
            num_blocks += max(kv.blocks_needed(req.num_computed_tokens + q) - len(req.block_ids), 0)
        if num_blocks > kv.pool.num_free_blocks:
            return None
        scheduled = []
        for req in self.running:
            start = req.num_computed_tokens
            allocated = kv.allocate_slots(req, q)
            assert allocated is not None  # counted above
            req.num_computed_tokens = start + q
            req.num_pending_tokens += q
            scheduled.append(ScheduledRequest(request_id=req.request_id, token_ids=(PLACEHOLDER,) * q,
                                              start_pos=start, block_ids=tuple(req.block_ids), needs_sample=True,
                                              num_draft_tokens=num_drafts))
        return self._plan(scheduled, chained=True)

    def undo_chained(self, sched: SchedulerOutput) -> None:
        """Take back a plan of :meth:`schedule_chained` whose launch failed: the requests' counts return (their
        blocks stay allocated) and its finished ids go to the next plan. Its host-tier copies are the model
        runner's to have run (``ModelRunner.execute_async`` runs them first)."""
        self._finished_ids[:0] = sched.finished_ids
        for s in sched.scheduled:
            req = self.requests.get(s.request_id)
            if req is not None:
                req.num_computed_tokens -= len(s.token_ids)
                req.num_pending_tokens -= len(s.token_ids)

    def _num_drafts(self, req: Request, num_left: int, budget: int) -> int:
        """How many of a decoding request's drafts to verify this step: none unless only its last token
        is left to compute; never past ``max_tokens``, the context limit or the step's token budget (a
        step emits at most ``drafts + 1`` tokens)."""
        if num_left != 1 or req.num_pending_tokens or req.num_computed_tokens < req.num_prompt_tokens:
            return 0
        p = req.params
        room = self.config.max_model_len - req.num_tokens - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - req.num_output_tokens - 1)
        return max(min(len(req.draft_token_ids), room, budget - 1), 0)

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: drop the KV, keep the tokens, requeue at the front.

        A DECODE replica has no prefill path, so it never recomputes: the request leaves the scheduler
        (status PREEMPTED) and joins ``handed_back``, which the engine drains into outputs that tell the
        router to re-prefill prompt + outputs so far.
        """
        self.kv.free(req)
        req.num_computed_tokens = req.local_kv_start = req.replay_end = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.role == EngineRole.DECODE:
            del self.requests[req.request_id]
            self.handed_back.append(req)
            return
        self.waiting.appendleft(req)

    def take_handed_back(self) -> list[Request]:
        """DECODE role: the requests preempted since the last call (each returned once)."""
        out, self.handed_back = self.handed_back, []
        return out

    def update_from_output(self, sched: SchedulerOutput, out: StepOutput) -> list[Request]:
        """Append sampled tokens and finish requests that hit EOS, a stop token, max_tokens or the
        context limit.

        Speculative decoding: a request's accepted drafts (``out.accepted``) come before its sampled
        token; its computed tokens are rolled back past its rejected drafts (their KV slots are written
        again later). Tokens are appended one at a time and the stop checks run after each; when one
        ends the request, the tokens after it are dropped and ``out`` is cut to match (side effect), so
        ``out.tokens(rid)`` is what was appended.

        Returns:
            the requests that got a token this step (finished ones included, with their status set).
        """
        updated = []
        requests, sampled_tokens = self.requests, out.sampled
        for s in sched.scheduled:
            if not s.needs_sample:
                continue
            req = requests.get(s.request_id)
            sampled = sampled_tokens.get(s.request_id)
            if req is None or sampled is None or req.status.is_finished:
                continue  # aborted or finished while the step was in flight: the token is dropped
            req.num_pending_tokens -= 1 + s.num_draft_tokens
            updated.append(req)
            accepted = out.accepted.get(s.request_id)
            if s.num_draft_tokens:
                req.num_computed_tokens -= s.num_draft_tokens - len(accepted or ())
            if accepted:
                tokens = [*accepted, sampled]
                for i, token in enumerate(tokens):
                    req.output_token_ids.append(token.token_id)
                    status = self._check_stop(req, token.token_id)
                    if status is not None:
                        out.accepted[s.request_id], out.sampled[s.request_id] = tokens[:i], token
                        self._finish(req, status)
                        break
                continue
            req.output_token_ids.append(sampled.token_id)
            status = self._check_stop(req, sampled.token_id)
            if status is not None:
                self._finish(req, status)
        return updated

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if len(req.output_token_ids) >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if req.grammar is not None and req.grammar.is_terminated():
                return RequestStatus.FINISHED_STOPPED
        if (p.max_tokens is not None and req.num_output_tokens >= p.max_tokens) or (
            req.num_tokens >= self.config.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        if self.config.role == EngineRole.PREFILL:
            return RequestStatus.FINISHED_PREFILLED
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if status == RequestStatus.FINISHED_PREFILLED:
            # keep the blocks until the KV is exported; the engine calls finish_requests after export
            self.running.remove(req)
            req.status = status
            return
        self.finish_requests(req.request_id, status)


def _is_decode(req: Request, num_left: int) -> bool:
    """Whether a running request's next work is one decoded token (its whole prompt is computed)."""
    return num_left == 1 and req.num_computed_tokens >= req.num_prompt_tokens
