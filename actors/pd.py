"""PDClient: a request's prefill/decode disaggregation over a fleet's prefill and decode replicas.

Per request: look up the stored prefix (KVStoreActor.match/get) -> the router picks a prefill replica ->
prefill: load the stored prefix, compute the rest, sample the first token, write new full blocks through
to the store -> the router picks a decode replica -> the KV moves (a ref through the object store, handed
to the decode task; or device to device, batched with other requests' KV by the router) -> decode: import
the KV, stream tokens. Text is detokenized here, once per request, so stop strings that span a handoff are found.

A request's images go first to the fleet's encoder replicas when it has some (encode / prefill / decode:
their embeddings reach the prefill replica as object-store refs; without encoders the prefill replica
encodes them); the decode replica gets the images' content hashes and placeholder ranges only (they key
the KV blocks' hashes, and the store lookups here hash them the same way).

This is the shell: one ``rayinfer.policy.pd.PDRequest`` per request makes every decision (legs, retries,
hand-backs, cleanups, leaving RDT); ``generate`` feeds it events and carries out its actions. Balancers,
failed-replica bookkeeping and RDT transfers belong to the Router (``rayinfer.actors.router``), so every
client of a fleet shares them. The client owns the payload refs of object-store transfers (they outlive
the prefill actor); the KVStoreActor owns stored blocks; Ray restarts dead engine actors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import ray
import ray.exceptions

from rayinfer.actors.client import _FleetClient, granted, unwrap
from rayinfer.actors.kv_transport import COLLECTIVE_TRANSPORTS
from rayinfer.actors.router import FleetInfo
from rayinfer.engine.detokenizer import IncrementalDetokenizer
from rayinfer.engine.errors import InvalidRequestError, ReplicasDeadError
from rayinfer.engine.types import KVHandle, MultiModalInput, RequestOutput, SamplingParams
from rayinfer.policy import pd as P
from rayinfer.policy.kv_store_index import block_hashes
from rayinfer.policy.routing import DecodeTicket, PrefillTicket

logger = logging.getLogger(__name__)


@dataclass
class _Leg:
    """The Ray side of one leg, which the state machine does not hold."""

    engine_request_id: str = ""
    hashes: list[int] = field(default_factory=list)
    layout: str | None = None
    refs: list = field(default_factory=list)  # ObjectRefs of the stored leading blocks
    prefill_ticket: PrefillTicket | None = None  # kept after its release: it names the replica
    prefill: Any = None  # its ActorHandle
    kv_handle: KVHandle | None = None
    decode_ticket: DecodeTicket | None = None
    decode: Any = None
    decode_grown: int = 0  # tokens decoded on the ticket's replica, reported at its release
    rdt: bool = False  # the router allows a device transfer between this leg's replicas
    payload: Any = None  # the object-store ObjectRef of the KV, kept until the leg ends
    stream: Any = None  # the decode's deltas (OutputMux.generate)
    error: Exception | None = None  # the last failure, for ReportFailure (replica_failed)


@dataclass
class _Run:
    """One request as the shell sees it across its legs."""

    prompt: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    leg: _Leg = field(default_factory=_Leg)
    logprobs: list | None = None  # of the replica output the next Emit sends
    queue_time_s: float | None = None  # the first prefill's wait in its engine (vLLM's queue time)
    mm_inputs: list[MultiModalInput] | None = None  # for the prefill: pixels, embeddings or their refs
    decode_mm_inputs: list[MultiModalInput] | None = None  # for the decode: hashes and placeholder ranges only


class PDClient(_FleetClient):
    """Runs requests through a PD fleet's prefill and decode replicas (an ``EngineClient``).

    Args:
        router: the fleet's RouterActor.
        info: the started fleet (``Router.start``): replicas, KV store, transport, block size.
        owned: whether ``shutdown`` stops the fleet.
    """

    def __init__(self, router, info: FleetInfo, owned: bool = False):
        from rayinfer.model.loader import load_tokenizer

        super().__init__(router, info, owned)
        self.store = info.kv_store
        self.transport = info.kv_transport or "object_store"
        self.block_size = info.block_size
        self.max_retries = info.max_retries
        self.retry_deadline_s = info.retry_deadline_s
        self.tokenizer = load_tokenizer(info.model)
        self.kv_state = P.KVTransportState(rdt_ok=self.transport != "object_store",
                                           group=self.transport in COLLECTIVE_TRANSPORTS)
        self.num_retries = 0  # legs this client re-ran after an actor failure
        self.num_handbacks = 0  # legs this client re-ran after a decode replica preempted

    @property
    def prefills(self) -> list:
        """The prefill replicas' actors as this client last fetched them."""
        return self.info.prefills

    @property
    def decodes(self) -> list:
        return self.info.decodes

    @property
    def _rdt_ok(self) -> bool:  # False for good once a device transfer failed
        return self.kv_state.rdt_ok

    # -- the caller's side ----------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, mm_inputs: list[MultiModalInput] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas: prefill on one replica, decode on another, retried on failures.
        Images (``mm_inputs``) are encoded first by the fleet's encoder replicas when it has some (else the
        prefill replica encodes them); the decode replica gets only their hashes and placeholder ranges.

        If the consumer stops early (or the task is cancelled), the state machine's cleanups run: the request
        is aborted on its decode replica, exported KV is dropped, tickets are given back.

        Raises:
            InvalidRequestError: when an engine or encoder rejects the request.
            EngineInternalError: every encoder replica failed.
        """
        mm_inputs = await self.encode(mm_inputs)
        prompt = list(prompt_token_ids)
        req = P.PDRequest(request_id or uuid.uuid4().hex, prompt, self.block_size, self.max_retries,
                          self.kv_state, self.retry_deadline_s)
        run = _Run(prompt, params, IncrementalDetokenizer(self.tokenizer, prompt, params))
        if mm_inputs:
            run.mm_inputs = list(mm_inputs)
            run.decode_mm_inputs = [dataclasses.replace(m, pixel_values=None, embeds=None) for m in mm_inputs]
        # wait here, before the prefill, while the decode replicas are full (pd.admission_headroom)
        await granted(self.router.admit.remote(), lambda _: self.router.leave.remote())
        actions = deque(req.handle(P.Start()))
        try:
            while actions or not req.is_finished:
                if not actions:  # decoding, and nothing else to do: the next event is the stream's
                    actions.extend(req.handle(await self._next_decode_output(run)))
                    continue
                action = actions.popleft()
                if isinstance(action, P.Emit):
                    yield self._output(req, run, action)
                    if not action.finished:
                        actions.extend(req.handle(P.Emitted()))
                elif isinstance(action, P.Fail):
                    if action.rejected:
                        raise InvalidRequestError(action.message)
                    yield RequestOutput(req.request_id, finished=True, finish_reason="error", error=action.message,
                                        num_prompt_tokens=len(prompt), num_output_tokens=req.num_output_tokens)
                else:
                    event = await self._execute(req, run, action)
                    if event is not None:
                        actions.extend(req.handle(event))
        finally:
            try:
                if not req.is_finished:  # the consumer left, the task was cancelled, or a bug raised here
                    for action in req.handle(P.Abort()):
                        await self._execute(req, run, action)
            finally:
                self.router.leave.remote()

    # -- carrying out the state machine's actions ------------------------------------------------
    async def _execute(self, req: P.PDRequest, run: _Run, action) -> P.Event | None:
        """Carry out one action (not Emit or Fail); returns the event it ends in, if any."""
        leg = run.leg
        match action:
            case P.LookupStore():
                run.leg = leg = _Leg()
                leg.hashes = block_hashes(list(action.token_ids), self.block_size, mm_inputs=run.mm_inputs or ())
                leg.layout, leg.refs = await self._stored(leg.hashes)
                return P.StoreLookupDone(len(leg.refs))
            case P.RunPrefill():
                return await self._prefill(run, action)
            case P.ReleasePrefill():
                if leg.prefill_ticket is not None:  # None: cancelled inside the pick
                    await self._release_prefill(leg.prefill_ticket)
            case P.Transfer():
                return await self._transfer(leg, action)
            case P.RunDecode():
                mux = self.mux(leg.decode)
                # the replica streams token ids only: this client detokenizes and finds stop strings
                leg.stream = mux.generate(leg.engine_request_id, leg.decode.submit, run.prompt, run.params,
                                          list(action.output_token_ids), leg.kv_handle, leg.payload, False,
                                          run.decode_mm_inputs)
            case P.GrowDecode():
                await self._grow_decode(leg, action.num_tokens)
            case P.ReleaseDecode():
                if leg.decode_ticket is not None:
                    await self._release_decode(leg)
            case P.AbortDecode():
                if leg.stream is not None:  # closing it aborts the request on the replica
                    await leg.stream.aclose()
                    leg.stream = None
                elif leg.decode is not None:  # None: it failed (or was cancelled) before the replica answered
                    leg.decode.abort.remote(leg.engine_request_id)
            case P.DropKV():
                leg.prefill.release_kv.remote([leg.engine_request_id])
            case P.ReportFailure():
                ticket = leg.prefill_ticket if action.role == "prefill" else leg.decode_ticket
                if ticket is not None:  # the router probes it, keeps it out of picks, replaces it if dead
                    await self.replica_failed(action.role, ticket.replica, leg.error)
            case P.UseObjectStore():
                if self.kv_state.rdt_ok:
                    logger.error("a KV transfer over %s failed (%s); using the object store from now on",
                                 self.transport, type(leg.error).__name__)
                self.kv_state.rdt_ok = False
            case P.Backoff():
                logger.warning("request %s: leg %s failed (%s); re-prefilling %d tokens", req.request_id,
                               leg.engine_request_id, type(leg.error).__name__, req.num_tokens)
                await asyncio.sleep(action.delay_s)
                return P.BackoffElapsed()
            case _:
                raise RuntimeError(f"PDClient cannot carry out {action!r}")
        return None

    async def _prefill(self, run: _Run, action: P.RunPrefill) -> P.Event:
        if action.reason in ("retry", "handback"):
            if action.reason == "retry":
                self.num_retries += 1
            else:
                self.num_handbacks += 1
            self.router.count_leg.remote(action.reason == "handback")
        leg = run.leg
        leg.engine_request_id = erid = action.engine_request_id
        try:
            leg.prefill_ticket = await self._pick_prefill(action.num_tokens, action.num_cached_tokens)
            leg.prefill = await self.replica(leg.prefill_ticket.replica)
            stored = (leg.hashes[: len(leg.refs)], leg.layout, leg.refs)
            out = await unwrap(leg.prefill.prefill.remote(erid, run.prompt, run.params,
                                                          list(action.output_token_ids), stored, run.mm_inputs))
        except (ray.exceptions.RayError, ValueError) as e:
            leg.error = e
            return P.PrefillFailed(_failure_kind(e), _describe(e))
        leg.kv_handle = out.kv_handle
        run.logprobs = out.new_logprobs
        if run.queue_time_s is None:
            run.queue_time_s = out.queue_time_s
        return P.PrefillDone(tuple(out.new_token_ids), out.finish_reason, out.stop_reason, out.num_cached_tokens,
                             out.error, run.detok.add_tokens(out.new_token_ids))

    async def _transfer(self, leg: _Leg, action: P.Transfer) -> P.Event:
        """Pick a decode replica and move the leg's exported KV there: by a device transfer (nccl, gloo or
        cuda_ipc, run by the router, which orders transfers per replica) or as an object-store ref for the
        decode task."""
        rdt = False
        assert leg.prefill_ticket is not None  # a transfer follows a prefill of this leg
        prefill_replica = leg.prefill_ticket.replica
        try:
            leg.decode_ticket, leg.rdt = await self._pick_decode(action.num_tokens, prefill_replica)
            decode_replica = leg.decode_ticket.replica
            leg.decode = await self.replica(self.info.num_prefill + decode_replica)
            rdt = action.may_use_rdt and leg.rdt
            if rdt:
                await unwrap(self.router.transfer_kv.remote(prefill_replica, decode_replica, leg.engine_request_id))
            else:  # the decode task resolves the ref through the object store
                leg.payload = leg.prefill.export_kv.remote(leg.engine_request_id)
        except ray.exceptions.RayError as e:
            leg.error = e
            return P.TransferFailed(_failure_kind(e), str(e), rdt)
        return P.TransferDone(rdt)

    async def _next_decode_output(self, run: _Run) -> P.Event:
        leg = run.leg
        try:
            out = await leg.stream.__anext__()
        except StopAsyncIteration:
            leg.error = RuntimeError("the decode stream ended before the request finished")
            return P.DecodeFailed(P.FailureKind.ERROR, str(leg.error))
        except Exception as e:  # noqa: BLE001 - a rejection, a failed step, a dead replica: the leg's failure
            leg.error = e
            return P.DecodeFailed(_failure_kind(e), _describe(e))
        if out.finish_reason == "preempted":
            return P.DecodePreempted()
        run.logprobs = out.new_logprobs
        return P.DecodeOutput(tuple(out.new_token_ids), out.finished, out.finish_reason, out.stop_reason, out.error,
                              run.detok.add_tokens(out.new_token_ids))

    def _output(self, req: P.PDRequest, run: _Run, emit: P.Emit) -> RequestOutput:
        """The caller's delta for an Emit; the text comes from this request's detokenizer (stop strings cut)."""
        logprobs, run.logprobs = run.logprobs, None
        return RequestOutput(
            request_id=req.request_id, new_token_ids=list(emit.token_ids), new_logprobs=logprobs,
            new_text=run.detok.take_delta(emit.finished), finished=emit.finished, finish_reason=emit.finish_reason,
            stop_reason=emit.stop_reason, num_prompt_tokens=len(run.prompt), error=emit.error,
            num_output_tokens=req.num_output_tokens, num_cached_tokens=req.num_cached_tokens,
            queue_time_s=run.queue_time_s)

    async def _stored(self, hashes: list[int]) -> tuple[str | None, list]:
        """(layout, refs) of the stored leading blocks; a store that is down is a miss."""
        if not hashes:
            return None, []
        try:
            n = await self.store.match.remote(hashes)
            if not n:
                return None, []
            return await self.store.get.remote(hashes[:n])
        except ray.exceptions.RayError as e:
            logger.warning("KV store unavailable (%s); computing the prompt in full", type(e).__name__)
            return None, []

    # -- the router's side: balancers and failed replicas, shared by every client of the fleet ----
    async def _pick_prefill(self, num_tokens: int, num_cached_tokens: int) -> PrefillTicket:
        return await granted(self.router.pick_prefill.remote(num_tokens, num_cached_tokens),
                              lambda t: self.router.release_prefill.remote(t))

    async def _release_prefill(self, ticket: PrefillTicket) -> None:
        self.router.release_prefill.remote(ticket)

    async def _pick_decode(self, num_tokens: int, prefill_replica: int) -> tuple[DecodeTicket, bool]:
        return await granted(self.router.pick_decode.remote(num_tokens, prefill_replica),
                              lambda t: self.router.release_decode.remote(t[0]))

    async def _grow_decode(self, leg: _Leg, num_tokens: int) -> None:
        leg.decode_grown += num_tokens  # reported once, at the release (no call per token)

    async def _release_decode(self, leg: _Leg) -> None:
        self.router.release_decode.remote(leg.decode_ticket, leg.decode_grown)
        leg.decode_grown = 0


def _describe(error: Exception) -> str:
    """One line for a failure's message (what a request that runs out of retries reports): a Ray task
    error's cause (``ActorUnavailableError: ...``), not its remote traceback."""
    cause = error.cause if isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None else error
    if isinstance(cause, ValueError):
        return str(cause)
    text = " ".join(str(cause).split())
    return f"{type(cause).__name__}: {text[:300]}"


def _failure_kind(error: Exception) -> P.FailureKind:
    """How the state machine treats an error: the engine rejected the request, the actor failed (also when
    the router reports a transfer whose actor failed), every replica of a role is gone for good, or other."""
    if isinstance(error, ValueError):
        return P.FailureKind.REJECTED
    cause = getattr(error, "cause", None) if isinstance(error, ray.exceptions.RayTaskError) else error
    if isinstance(cause, ReplicasDeadError):
        return P.FailureKind.UNAVAILABLE
    if isinstance(cause, ray.exceptions.RayActorError):
        return P.FailureKind.REPLICA
    return P.FailureKind.ERROR
