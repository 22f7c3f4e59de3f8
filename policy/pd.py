"""Prefill/decode disaggregation of one request as a pure state machine: events in, actions out.

The Ray shell (``rayinfer.actors.pd.PDClient``) tells each request's :class:`PDRequest` what happened
(an event) and carries out what ``handle`` returns (actions, in order). Nothing here calls Ray, asyncio or
torch, so every order of events is tested by hand (``tests/policy/test_pd.py``). The router's fleet-wide
:class:`DeviceTransferBreaker` (a circuit breaker) decides whether KV may move by a device transfer at all.

A leg is one prefill and, unless the request ends at its first token, one decode. Every leg starts from
prompt + the tokens already emitted, so each token goes out exactly once however often the request is
re-run::

    Start | BackoffElapsed | DecodePreempted  ->  LOOKUP
    LOOKUP    --StoreLookupDone-->  PREFILL  --PrefillDone (KV exported)-->  PREFILLED  --Emitted-->  TRANSFER
    PREFILL   --PrefillDone (engine finished, or a stop string in the first token)-->  DONE
    TRANSFER  --TransferDone-->  DECODE  --DecodeOutput (more to come)-->  DECODE
    DECODE    --DecodeOutput (engine finished, or a stop string)-->  DONE
    DECODE    --DecodePreempted-->  LOOKUP                    (a hand-back: a new leg, not a failure)
    PREFILL | TRANSFER | DECODE  --*Failed-->  BACKOFF  --BackoffElapsed-->  LOOKUP   (retries left)
                                           --> DONE  (rejected: at once; out of retries: an error output)

Retries: a replica that failed restarts (10-70 s on CPU), so replica failures are retried until
``retry_deadline_s`` after the request's first failure, however many attempts that takes; other errors
(a task raised, an object was lost) at most ``max_retries`` times within that deadline. A request out of
retries ends with an error output (finish_reason "error"), never as a normal answer; so does one whose
every prefill (or decode) replica is gone for good (FailureKind.UNAVAILABLE), at once.
    any phase  --Abort-->  DONE, after that phase's cleanups

Protocol: ``Emit`` is always the last action of a list. After a non-final ``Emit`` the shell hands the
output to its consumer and reports ``Emitted`` (or ``Abort`` if the consumer left). ``RunPrefill`` takes a
prefill ticket and ``Transfer`` a decode ticket; each is given back by exactly one ``ReleasePrefill`` /
``ReleaseDecode``. In DECODE with no actions left, the shell waits for the decode replica's next output.

Glossary: leg = one prefill (+ decode) run of the request; hand-back = the decode replica preempted the
request and returned it for a re-prefill; RDT = a device transfer (KV moved device to device by the
router: nccl, gloo or cuda_ipc; the name is historical); ticket = a balancer's count of the request against
one replica (``policy/routing.py``).
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass
from typing import Callable

__all__ = [
    "Abort", "AbortDecode", "Backoff", "BackoffElapsed", "DecodeFailed", "DecodeOutput", "DecodePreempted",
    "DeviceTransferBreaker", "DropKV", "Emit", "Emitted", "Fail", "FailureKind", "GrowDecode", "KVTransportState",
    "LookupStore", "PDRequest", "Phase", "PrefillDone", "PrefillFailed", "ReleaseDecode", "ReleasePrefill",
    "ReportFailure", "RunDecode", "RunPrefill", "Start", "StoreLookupDone", "Transfer", "TransferDone",
    "TransferFailed", "UseObjectStore", "backoff_s",
]


class Phase(str, enum.Enum):
    NEW = "new"
    LOOKUP = "lookup"  # the KV store is asked for the leading blocks of prompt + outputs
    PREFILL = "prefill"  # a prefill replica computes the rest and samples a token
    PREFILLED = "prefilled"  # that token is out to the consumer; the KV waits on the prefill replica
    TRANSFER = "transfer"  # the KV moves to a decode replica
    DECODE = "decode"  # the decode replica streams tokens
    BACKOFF = "backoff"  # waiting before a retry
    DONE = "done"


class FailureKind(str, enum.Enum):
    REPLICA = "replica"  # the replica's actor died or is restarting: report it, retry
    ERROR = "error"  # another Ray error (a task raised, an object was lost): retry
    REJECTED = "rejected"  # the engine rejected the request (ValueError): fail at once, never retried
    UNAVAILABLE = "unavailable"  # every replica of a role is gone for good: fail at once (an error)


def backoff_s(num_failures: int) -> float:
    """Seconds to wait before the retry that follows the request's ``num_failures``-th failure."""
    return min(0.05 * 2**num_failures, 2.0)


@dataclass
class KVTransportState:
    """Client-wide: whether KV may still move by a device transfer (RDT); shared by a client's requests.

    Attributes:
        rdt_ok: False for the object-store transport; the shell turns it off for good when it carries out
            a :class:`UseObjectStore` (after a failed device transfer, a broken group or a dead end).
        group: device transfers go over one collective group (nccl, gloo), which a replica's death breaks for
            every pair; False for cuda_ipc, where each transfer stands alone and a dead replica takes no
            other transfer with it (the fleet keeps moving KV by device).
    """

    rdt_ok: bool
    group: bool = True


class DeviceTransferBreaker:
    """Fleet-wide (the router's): whether KV may move by a device transfer now, as a circuit breaker.

    Closed, device transfers go ahead. A transfer that fails for the transport's own reason (not a replica's
    death) opens it: the object store carries KV from then on. Over a collective group (nccl, gloo;
    ``recoverable`` False) that is for good, since the failure broke the group. Over cuda_ipc each transfer
    stands alone, so the failure may have been passing (a CUDA error in one call): after the n-th failure in a
    row the breaker stays open ``retry_s * 2 ** (n - 1)`` seconds (at most ``max_retry_s``), then lets one
    trial transfer through (half-open). Its success closes the breaker; its failure opens it again for twice
    as long. A trial that reports nothing within ``trial_timeout_s`` (its request took another way, or
    failed before its transfer) frees the place for another trial.

    Args:
        enabled: False for a fleet that moves KV through the object store only (never allows).
        recoverable: whether an open breaker tries again (cuda_ipc) or stays open (nccl, gloo).
        retry_s: seconds open after the first failure; 0 stays open for good.
        max_retry_s: the longest time open between trials.
        trial_timeout_s: seconds a trial may take before another may start.
        clock: seconds, monotonic.
    """

    def __init__(self, enabled: bool, recoverable: bool, retry_s: float = 30.0, max_retry_s: float = 600.0,
                 trial_timeout_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.enabled, self.recoverable = enabled, recoverable and retry_s > 0
        self.retry_s, self.max_retry_s, self.trial_timeout_s, self.clock = retry_s, max_retry_s, trial_timeout_s, clock
        self.num_failures = 0  # transport failures in a row (0: closed)
        self.num_trials = 0  # trial transfers let through, over the breaker's life
        self._retry_at = math.inf  # when an open breaker lets a trial through
        self._trial_since: float | None = None  # when the trial in flight started

    @property
    def closed(self) -> bool:
        return self.enabled and self.num_failures == 0

    def allow(self) -> bool:
        """Whether the next transfer may go by device; an open breaker past its wait starts a trial (True)."""
        if self.closed:
            return True
        now = self.clock()
        if not self.enabled or now < self._retry_at:
            return False
        if self._trial_since is not None and now - self._trial_since < self.trial_timeout_s:
            return False  # one trial at a time
        self._trial_since = now
        self.num_trials += 1
        return True

    def succeeded(self) -> bool:
        """A device transfer went through: close. Returns whether this closed an open breaker."""
        if self.closed or not self.enabled:
            return False
        self.num_failures, self._retry_at, self._trial_since = 0, math.inf, None
        return True

    def failed(self) -> float | None:
        """A device transfer failed for the transport's reason: open (closed, or a trial failed: the n-th failure
        in a row; a transfer that was already in flight when the breaker opened changes nothing). Returns the
        seconds until the next trial, None when the breaker stays open for good."""
        if self.num_failures and self._trial_since is None:  # one that was in flight when the breaker opened
            return None if self._retry_at == math.inf else max(0.0, self._retry_at - self.clock())
        self.num_failures += 1
        self._trial_since = None
        if not self.recoverable:
            self._retry_at = math.inf
            return None
        wait = min(self.retry_s * 2 ** (self.num_failures - 1), self.max_retry_s)
        self._retry_at = self.clock() + wait
        return wait


# -- events: what the shell tells the machine ---------------------------------------------------

@dataclass(frozen=True)
class Start:
    """The request arrived."""


@dataclass(frozen=True)
class StoreLookupDone:
    """The KV store holds the first ``num_blocks`` full blocks of prompt + outputs (a store that is down: 0)."""

    num_blocks: int


@dataclass(frozen=True)
class PrefillDone:
    """The prefill replica sampled ``token_ids``.

    Attributes:
        finish_reason: "prefilled" (the KV is exported and waits for a decode replica), or the engine's
            own finish ("stop", "length", "error"): the request ends with no decode.
        stop_reason, error: the engine's, passed on to the output.
        num_cached_tokens: tokens the replica loaded instead of computing.
        stop_string: a stop string the shell's detokenizer found in these tokens (it travels with the tokens
            because it decides whether their output is the last one), or None.
    """

    token_ids: tuple[int, ...]
    finish_reason: str
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    stop_string: str | None = None


@dataclass(frozen=True)
class PrefillFailed:
    """The prefill (or waiting for its replica) failed; ``message`` names the error."""

    kind: FailureKind
    message: str


@dataclass(frozen=True)
class Emitted:
    """The consumer took the last non-final output."""


@dataclass(frozen=True)
class TransferDone:
    """The KV is on its way to the decode replica (``used_rdt``: by a device transfer)."""

    used_rdt: bool


@dataclass(frozen=True)
class TransferFailed:
    """Picking or waiting for the decode replica, or moving the KV, failed."""

    kind: FailureKind
    message: str
    used_rdt: bool


@dataclass(frozen=True)
class DecodeOutput:
    """The decode replica streamed ``token_ids`` (fields as in :class:`PrefillDone`)."""

    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    stop_string: str | None = None


@dataclass(frozen=True)
class DecodePreempted:
    """The decode replica preempted the request and handed it back (its KV there is gone)."""


@dataclass(frozen=True)
class DecodeFailed:
    """The decode stream failed (or ended before the request finished)."""

    kind: FailureKind
    message: str


@dataclass(frozen=True)
class BackoffElapsed:
    """The wait a :class:`Backoff` asked for is over."""


@dataclass(frozen=True)
class Abort:
    """The consumer left (or the task was cancelled): clean up and stop."""


Event = (Start | StoreLookupDone | PrefillDone | PrefillFailed | Emitted | TransferDone | TransferFailed
         | DecodeOutput | DecodePreempted | DecodeFailed | BackoffElapsed | Abort)


# -- actions: what the shell does -----------------------------------------------------------------

@dataclass(frozen=True)
class LookupStore:
    """Ask the KV store for the stored leading blocks of ``token_ids``; answer with StoreLookupDone."""

    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RunPrefill:
    """Pick a prefill replica (take a ticket) and prefill prompt + ``output_token_ids`` on it.

    Attributes:
        engine_request_id: the engine-side id of this leg (fresh per leg, so a late copy never collides).
        num_tokens, num_cached_tokens: for the pick (prompt + outputs; the stored leading tokens).
        reason: "first", "retry" (after a failure) or "handback" (after a preemption).
    Answer with PrefillDone or PrefillFailed.
    """

    engine_request_id: str
    output_token_ids: tuple[int, ...]
    num_tokens: int
    num_cached_tokens: int
    reason: str


@dataclass(frozen=True)
class ReleasePrefill:
    """Give back the leg's prefill ticket."""


@dataclass(frozen=True)
class Emit:
    """Send an output with ``token_ids`` (text, usage and logprobs are the shell's); non-final: answer Emitted."""

    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Transfer:
    """Pick a decode replica for ``num_tokens`` (take a ticket) and move the exported KV to it.

    ``may_use_rdt``: device transfers are allowed client-wide (the shell still sends KV of a restarted
    replica, which is outside the collective group, through the object store). Answer with TransferDone or
    TransferFailed.
    """

    num_tokens: int
    may_use_rdt: bool


@dataclass(frozen=True)
class RunDecode:
    """Start decoding on the picked replica from prompt + ``output_token_ids``; feed each of its outputs."""

    output_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class GrowDecode:
    """The request's KV on its decode replica grew by ``num_tokens`` (for the balancer)."""

    num_tokens: int


@dataclass(frozen=True)
class ReleaseDecode:
    """Give back the leg's decode ticket."""


@dataclass(frozen=True)
class AbortDecode:
    """Abort the leg's request on its decode replica (which would otherwise go on decoding it)."""


@dataclass(frozen=True)
class DropKV:
    """Drop the KV the prefill replica exported (rather than keep it until its TTL)."""


@dataclass(frozen=True)
class ReportFailure:
    """Report the leg's ``role`` replica ("prefill" or "decode") as possibly failed, with the leg's error."""

    role: str


@dataclass(frozen=True)
class UseObjectStore:
    """Move KV through the object store from now on, for every request (turn off KVTransportState.rdt_ok)."""


@dataclass(frozen=True)
class Backoff:
    """Wait ``delay_s`` seconds, then answer BackoffElapsed; ``message`` is the failure, for the log."""

    delay_s: float
    message: str


@dataclass(frozen=True)
class Fail:
    """End the request: ``rejected`` raises ``ValueError(message)`` to the caller, else an error output."""

    message: str
    rejected: bool = False


Action = (LookupStore | RunPrefill | ReleasePrefill | Emit | Transfer | RunDecode | GrowDecode | ReleaseDecode
          | AbortDecode | DropKV | ReportFailure | UseObjectStore | Backoff | Fail)

# what an Abort must clean up in each phase (no cleanups: nothing is held)
_ABORT_CLEANUPS: dict[Phase, tuple[Action, ...]] = {
    Phase.PREFILL: (ReleasePrefill(),),  # the prefill itself runs on; its KV expires on the replica
    Phase.PREFILLED: (DropKV(),),
    Phase.TRANSFER: (AbortDecode(), ReleaseDecode()),
    Phase.DECODE: (AbortDecode(), ReleaseDecode()),
}


class PDRequest:
    """One request's way through prefill, KV transfer and decode, with retries and hand-backs.

    Args:
        request_id: the caller's id (engine-side ids are ``f"{request_id}@{leg}"``).
        prompt_token_ids: the prompt.
        block_size: tokens per KV block (turns stored blocks into cached tokens).
        max_retries: retries after failures that are not a replica failing (FailureKind.ERROR) before
            the request fails with an error output.
        kv_transport: the client-wide transport state (read when a Transfer is decided).
        retry_deadline_s: seconds after its first failure during which the request keeps retrying
            (waiting out replica restarts); then it fails with an error output.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], block_size: int, max_retries: int,
                 kv_transport: KVTransportState, retry_deadline_s: float = math.inf,
                 clock: Callable[[], float] = time.monotonic):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.block_size = block_size
        self.max_retries = max_retries
        self.kv_transport = kv_transport
        self.retry_deadline_s = retry_deadline_s
        self.clock = clock
        self.phase = Phase.NEW
        self.output_token_ids: list[int] = []  # emitted, in order; every leg restarts from these
        self.num_failures = 0
        self.num_errors = 0  # failures of kind ERROR (bounded by max_retries)
        self._first_failure_s: float | None = None
        self.num_legs = 0
        self._num_cached_tokens: int | None = None  # the first completed prefill's
        self._leg_reason = "first"
        self._leg_used_rdt = False

    @property
    def is_finished(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached_tokens or 0

    def handle(self, event: Event) -> list[Action]:
        """Advance on ``event``; returns the actions to carry out, in order.

        Side effects: updates ``phase``, ``output_token_ids`` and the counts.
        Raises:
            RuntimeError: for an event the current phase does not expect (a bug in the shell).
        """
        p = self.phase
        match event:
            case Abort():
                self.phase = Phase.DONE
                return list(_ABORT_CLEANUPS.get(p, ()))
            case Start() if p is Phase.NEW:
                return self._new_leg("first")
            case StoreLookupDone() if p is Phase.LOOKUP:
                return self._prefill(event.num_blocks)
            case PrefillDone() if p is Phase.PREFILL:
                return self._prefill_done(event)
            case PrefillFailed() if p is Phase.PREFILL:
                cleanups = [ReportFailure("prefill")] if event.kind is FailureKind.REPLICA else []
                return cleanups + [ReleasePrefill()] + self._failed(event.kind, event.message)
            case Emitted() if p is Phase.PREFILLED:
                self.phase = Phase.TRANSFER
                return [Transfer(self.num_tokens, self.kv_transport.rdt_ok)]
            case Emitted() if p is Phase.DECODE:
                return []
            case TransferDone() if p is Phase.TRANSFER:
                self.phase, self._leg_used_rdt = Phase.DECODE, event.used_rdt
                return [RunDecode(tuple(self.output_token_ids))]
            case TransferFailed() if p is Phase.TRANSFER:
                self._leg_used_rdt = event.used_rdt
                return self._decode_leg_failed(event.kind, event.message)
            case DecodeOutput() if p is Phase.DECODE:
                return self._decode_output(event)
            case DecodePreempted() if p is Phase.DECODE:
                return [ReleaseDecode()] + self._new_leg("handback")
            case DecodeFailed() if p is Phase.DECODE:
                return self._decode_leg_failed(event.kind, event.message)
            case BackoffElapsed() if p is Phase.BACKOFF:
                return self._new_leg("retry")
        raise RuntimeError(f"request {self.request_id}: {type(event).__name__} in phase {p.value}")

    # -- transitions ----------------------------------------------------------------------------------
    def _new_leg(self, reason: str) -> list[Action]:
        self.phase, self._leg_reason, self._leg_used_rdt = Phase.LOOKUP, reason, False
        return [LookupStore(tuple(self.prompt_token_ids + self.output_token_ids))]

    def _prefill(self, num_blocks: int) -> list[Action]:
        self.phase = Phase.PREFILL
        erid = f"{self.request_id}@{self.num_legs}"
        self.num_legs += 1
        return [RunPrefill(erid, tuple(self.output_token_ids), self.num_tokens, num_blocks * self.block_size,
                           self._leg_reason)]

    def _prefill_done(self, e: PrefillDone) -> list[Action]:
        self.output_token_ids.extend(e.token_ids)
        if self._num_cached_tokens is None:
            self._num_cached_tokens = e.num_cached_tokens
        exported = e.finish_reason == "prefilled"
        emit = _emit(e.token_ids, not exported, e.finish_reason, e.stop_reason, e.error, e.stop_string)
        actions: list[Action] = [ReleasePrefill()]
        if not emit.finished:
            self.phase = Phase.PREFILLED
        else:
            self.phase = Phase.DONE
            if exported:  # a stop string in the first token: nobody will take this KV
                actions.append(DropKV())
        return actions + [emit]

    def _decode_output(self, e: DecodeOutput) -> list[Action]:
        self.output_token_ids.extend(e.token_ids)
        actions: list[Action] = [GrowDecode(len(e.token_ids))] if e.token_ids else []
        emit = _emit(e.token_ids, e.finished, e.finish_reason, e.stop_reason, e.error, e.stop_string)
        if emit.finished:
            self.phase = Phase.DONE
            if not e.finished:  # a stop string ended it here; the replica would go on decoding
                actions.append(AbortDecode())
            actions.append(ReleaseDecode())
        return actions + [emit]

    def _decode_leg_failed(self, kind: FailureKind, message: str) -> list[Action]:
        """A transfer or decode failure: report both replicas (the KV's source may be the one that died)."""
        if kind is FailureKind.REPLICA:  # the decode replica's actor is gone: nothing there to abort
            actions: list[Action] = [ReportFailure("decode"), ReportFailure("prefill")]
            if self._leg_used_rdt and self.kv_transport.group:  # a dead end broke the collective group
                actions.append(UseObjectStore())
        else:
            actions = [AbortDecode()]
        return actions + [ReleaseDecode()] + self._failed(kind, message)

    def _failed(self, kind: FailureKind, message: str) -> list[Action]:
        """After a failed leg's cleanups: fail now (rejected, past the deadline, or errors beyond
        ``max_retries``) or back off (never past the deadline) and retry."""
        self.phase = Phase.DONE
        if kind is FailureKind.REJECTED:
            return [Fail(message, rejected=True)]
        if kind is FailureKind.UNAVAILABLE:  # nothing left to wait for
            return [Fail(message)]
        self.num_failures += 1
        now = self.clock()
        if self._first_failure_s is None:
            self._first_failure_s = now
        left_s = self._first_failure_s + self.retry_deadline_s - now
        if kind is FailureKind.ERROR:
            self.num_errors += 1
            if self.num_errors > self.max_retries:
                return [Fail(f"gave up after {self.num_failures} failed attempts ({self.num_errors} errors; "
                             f"pd.max_retries={self.max_retries}): {message}")]
        if left_s <= 0:
            return [Fail(f"gave up after {self.num_failures} failed attempts in {now - self._first_failure_s:.1f} s "
                         f"(pd.retry_deadline_s={self.retry_deadline_s:g}): {message}")]
        self.phase = Phase.BACKOFF
        return [Backoff(min(backoff_s(self.num_failures), left_s), message)]


def _emit(token_ids: tuple[int, ...], engine_finished: bool, finish_reason: str | None,
          stop_reason: int | str | None, error: str | None, stop_string: str | None) -> Emit:
    """The output for new tokens: the engine's finish wins over a stop string the shell found, except
    "length": a stop string completed by the last token the budget allows still ends it as "stop"."""
    if stop_string is not None and (not engine_finished or finish_reason == "length"):
        return Emit(tuple(token_ids), True, "stop", stop_string, error)
    if engine_finished:
        return Emit(tuple(token_ids), True, finish_reason, stop_reason, error)
    return Emit(tuple(token_ids), error=error)
