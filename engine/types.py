"""The engine's contract types: sampling parameters, requests, scheduler and step outputs, KV handles.

A leaf module: it imports nothing from actors, model or kernels, so every part of the system (scheduler
tests, Ray actors, the HTTP layer) can speak these types without loading a model.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field, fields
from typing import Any

from rayinfer.engine.errors import InvalidRequestError


PLACEHOLDER = -1  # token id of a sampled-but-not-yet-returned token in a scheduled step


class EngineRole(str, enum.Enum):
    """What one replica does (after DeepSeek's engine types)."""

    NORMAL = "normal"  # prefill and decode in one replica; chunked prefill mixes them in a step
    PREFILL = "prefill"  # prompts only; a finished prefill leaves through a KVHandle
    DECODE = "decode"  # admits only requests that arrive with imported KV


class RequestStatus(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, a stop token, a stop string, or a finished grammar
    FINISHED_LENGTH = "length"  # max_tokens or the context limit
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    FINISHED_PREFILLED = "prefilled"  # PREFILL role: KV ready for export, blocks still held

    @property
    def is_finished(self) -> bool:
        return self not in _UNFINISHED


_UNFINISHED = frozenset((RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED))


@dataclass
class SamplingParams:
    """How to sample one request's output; validates itself.

    Raises:
        ValueError: naming the field, for an out-of-range or wrongly typed value.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None: none; k >= 0: sampled token's logprob plus the top k
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    response_format: dict | None = None  # {"type": "json_object" | "json_schema" | "regex" | "ebnf", ...}
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check_number("temperature", self.temperature, lo=0.0)
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=0)
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                                      "min_tokens")
        _check_int("n", self.n, lo=1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=20)
        _check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop must be a string or a list of non-empty strings", "stop")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be a list of non-negative integers", "stop_token_ids")
        if self.response_format is not None and not isinstance(self.response_format, dict):
            raise InvalidRequestError("response_format must be an object with a 'type' field", "response_format")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict; an unknown key raises ``ValueError`` naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling field(s): {', '.join(unknown)}", unknown[0])
        return cls(**data)


def _check_number(name, value, lo=None, hi=None, lo_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise InvalidRequestError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise InvalidRequestError(f"{name} must be <= {hi}, got {value}", name)


def _check_int(name, value, lo=None, hi=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)
    _check_number(name, value, lo=lo, hi=hi)


@dataclass
class KVHandle:
    """A request's KV cache in transit between replicas (PD disaggregation, KV store).

    Attributes:
        request_id: the request the KV belongs to.
        block_hashes: chained hashes of the full blocks (empty for partial-only payloads).
        num_tokens: tokens whose KV the payload holds.
        layout: versioned payload layout tag, e.g. ``"v1:L,N,2,bs,H,D:float32"``: layers x blocks x
            (k, v) x block_size x kv heads x head dim.
        payload: a tensor of that layout, or a Ray ObjectRef to one, holding blocks ``first_block`` ..
            ``ceil(num_tokens / block_size) - 1``.
        first_block: leading full blocks the payload leaves out because the importing replica holds them
            (device pool, then host tier: a KV-store fetch skips what the replica has); if they are gone
            from both by admission, the handle is dropped and the prompt is computed past what is cached.
    """

    request_id: str
    block_hashes: list[int]
    num_tokens: int
    layout: str
    payload: Any = None
    first_block: int = 0


@dataclass(frozen=True)
class ContextParallelPrefill:
    """The payload of a :class:`KVHandle` whose KV is computed on import by the replica's context-parallel
    ranks instead of copied (``rayinfer.engine.context_parallel``).

    Attributes:
        token_ids: the tokens to prefill, positions ``0..len-1`` (the prompt without its last token).
        min_tokens: the fewest tokens, beyond a prefix-cache hit, worth a CP prefill; a request whose
            uncached part has shrunk below it by admission runs on rank 0 alone, reusing the hit.
        num_cached: the first tokens' K/V already in rank 0's cache (a prefix hit, set at admission):
            they are broadcast to the other ranks, not computed.
    """

    token_ids: tuple[int, ...]
    min_tokens: int = 0
    num_cached: int = 0


@dataclass(frozen=True, eq=False)
class MultiModalInput:
    """One image of a request: its content hash, where its placeholder tokens are in the prompt, and its
    pixels or precomputed embeddings (see ``rayinfer.engine.multimodal``).

    Attributes:
        content_hash: sha256 hex of the image's content (``multimodal.hash_pixel_values``); keys the
            encoder cache and goes into the prefix-cache hashes of the blocks its placeholders fall in.
        offset: prompt position of its first placeholder token.
        length: placeholder tokens (= the rows its embeddings have).
        pixel_values: [3, H, W] float tensor from the model's image processor, or None with ``embeds``.
        embeds: [length, hidden_size] precomputed embeddings (an encoder replica's), or None.
        num_patches: vision patches of the image (an encoder's work unit, for load balancing).
    """

    content_hash: str
    offset: int
    length: int
    pixel_values: Any = None
    embeds: Any = None
    num_patches: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(eq=False)
class Request:
    """One sequence in the engine. Prefill and decode are not phases: each step computes some of the
    tokens the request knows but has not computed (``num_tokens - num_computed_tokens``)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # time.monotonic() when the scheduler first admitted it
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)  # the block table
    local_block_ids: list[int] = field(default_factory=list)  # sliding layers' table (kv_cache_manager)
    # bounded replay (sliding-window models): the sliding layers' KV exists from local_kv_start on; the
    # tokens before replay_end (the prefix hit) are recomputed for the sliding layers only
    local_kv_start: int = 0
    replay_end: int = 0
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, in order
    num_registered_blocks: int = 0  # leading blocks of block_ids already registered in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    # sampled on the device by in-flight steps, not yet known here (a verification step counts its k drafts too:
    # it may accept them all; the count comes back to the real one when the step is processed)
    num_pending_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    grammar: Any = None  # an xgrammar GrammarMatcher when output is constrained
    kv_handle: KVHandle | None = None  # DECODE role: the KV to import on admission
    cache_salt: int | None = None  # extra key of the hash chain (LoRA id, tenant salt)
    draft_token_ids: list[int] = field(default_factory=list)  # speculative: proposed for the next step
    mm_inputs: list[MultiModalInput] = field(default_factory=list)  # images, in prompt order

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the request has, including ones an in-flight step has sampled but not returned."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known on the host (``all_token_ids``)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def known_token_ids(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` (0 <= start) without copying the whole token list."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        if self.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                           RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            return self.status.value
        return None


@dataclass(slots=True)
class ScheduledRequest:
    """What one request computes in a step (not frozen: a frozen dataclass's ``__init__`` costs about 1 us
    more, for every request of every step; nothing writes one after the scheduler makes it).

    Attributes:
        request_id: the request.
        token_ids: the ``num_new_tokens`` token ids to compute, in order.
        start_pos: position of the first of them (the request's computed tokens before the step).
        block_ids: the request's whole block table after this step's allocation.
        needs_sample: True when these tokens reach the end of the known tokens, so a token is sampled.
        num_draft_tokens: speculative decoding: the last this many of ``token_ids`` are draft tokens to
            verify (a token is sampled after each computed token from the last known one on, so
            ``num_draft_tokens + 1`` are sampled and the longest prefix of drafts the target agrees
            with is accepted).
        local_block_ids: the sliding layers' block table (models with a local KV group), else None.
        num_replay_tokens: the leading this many of ``token_ids`` are a bounded replay: their
            full-attention KV is already cached (a prefix hit), so only the sliding layers write theirs.
        local_kv_start: first position with sliding-layer KV (a replay's start; keys before it are
            never read).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    needs_sample: bool
    num_draft_tokens: int = 0
    local_block_ids: tuple[int, ...] | None = None
    num_replay_tokens: int = 0
    local_kv_start: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan; pure data, so the model runner (or another process) can execute it."""

    scheduled: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...] = ()
    finished_ids: tuple[str, ...] = ()  # freed since the last step (finished or aborted)
    kv_imports: tuple[tuple[str, tuple[int, ...], "KVHandle"], ...] = ()  # (request id, blocks, handle)
    # host KV tier, run before the step's forward in this order: (device block, host slot) copies of
    # evicted blocks, then (host slot, device block) copies of host prefix hits
    kv_offloads: tuple[tuple[int, int], ...] = ()
    kv_loads: tuple[tuple[int, int], ...] = ()
    # a verification step planned behind one still in flight (``Scheduler.schedule_chained``): each request's
    # inputs are that step's target token and device drafts, its positions move on the device by the
    # in-flight step's accepted count minus its drafts (``token_ids`` are placeholders, ``start_pos`` assumes
    # every draft accepted)
    chained: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    """The sampler's result for one request in one step."""

    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None  # token id -> logprob of the top-k tokens


@dataclass
class StepOutput:
    """The model runner's result for one step: a sampled token per request that needed one, and the
    requests whose own part of the step raised (their rows are not sampled; the engine fails them alone).

    Speculative decoding: ``accepted[rid]`` are the request's draft tokens the target accepted (each with
    the target's logprobs); they come before ``sampled[rid]`` (the token after the last accepted one).
    """

    sampled: dict[str, SampledToken]
    errors: dict[str, Exception] = field(default_factory=dict)
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)

    def tokens(self, request_id: str) -> list[SampledToken]:
        """The request's new tokens in order: accepted drafts, then the sampled token."""
        return [*self.accepted.get(request_id, ()), self.sampled[request_id]]


@dataclass
class RequestOutput:
    """What the caller sees of a request after a step (a delta, plus totals).

    ``LLMEngine.step`` returns core deltas (token ids, ``new_text`` empty, the core's finish reasons);
    an ``OutputProcessor`` turns them into the deltas callers stream (text, stop strings).

    Attributes:
        request_id: the request.
        new_token_ids: tokens produced this step.
        new_text: detokenized text added this step (never a broken UTF-8 sequence); empty in a core delta.
        new_logprobs: per new token, a SampledToken with its logprob and top logprobs (if asked).
        finished: whether the request ended this step.
        finish_reason: "stop", "length", "abort", "error", "prefilled" (PREFILL role, with ``kv_handle``),
            "preempted" (DECODE role: re-prefill elsewhere), or None.
        stop_reason: on "stop", the stop string or stop token id that ended it (None for EOS).
        num_prompt_tokens, num_output_tokens, num_cached_tokens: usage counts.
        error: a message when the request failed (finish_reason "error").
        queue_time_s: seconds the request waited in this engine before it was first scheduled (vLLM's
            queue time); None before that, or where no engine measured it.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[SampledToken] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    kv_handle: KVHandle | None = None
    queue_time_s: float | None = None


@dataclass
class Completion:
    """A whole request's result (what ``LLMEngine.generate`` returns and the batch job writes)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[SampledToken] | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    def add(self, out: RequestOutput) -> None:
        """Fold one step's delta into the totals."""
        self.output_token_ids.extend(out.new_token_ids)
        self.text += out.new_text
        if out.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.new_logprobs
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            self.num_cached_tokens, self.error = out.num_cached_tokens, out.error
